#include "engine/host_kv_tier.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "core/error.h"
#include "core/log.h"
#include "model/model_runner.h"

namespace kvlm {

namespace {
size_t checked_page_bytes(const ModelRunner& runner, int block_size, size_t capacity) {
  KVLM_CHECK(block_size > 0 && capacity >= 2, "the host tier needs at least two pages");
  const size_t page = runner.kv_page_bytes(block_size);
  KVLM_CHECK(page > 0, "the runner cannot copy its KV pages to host memory");
  return page;
}

// The tier's memory; pinning tens of GiB takes seconds at start, so say how long.
HostBytes allocate_logged(ModelRunner& runner, size_t bytes) {
  const auto t0 = std::chrono::steady_clock::now();
  HostBytes p = runner.allocate_host(bytes);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  char line[160];
  std::snprintf(line, sizeof line, "host tier: %.2f GiB of host memory allocated%s in %.1f s", double(bytes) / double(1ull << 30),
                runner.device() == Device::Cuda ? " and pinned" : "", s);
  log::info(line);
  return p;
}
}  // namespace

HostKVTier::HostKVTier(ModelRunner& runner, int block_size, size_t capacity)
    : runner_(runner), block_size_(block_size), page_bytes_(checked_page_bytes(runner, block_size, capacity)),
      data_(allocate_logged(runner, capacity * page_bytes_)) {  // uninitialized: written as pages arrive
  tokens_.resize(capacity * size_t(block_size));
  entries_.resize(capacity);
  for (size_t i = capacity; i-- > 0;) free_.push_back(int(i));
}

void HostKVTier::unlink(int slot) {
  Entry& e = entries_[size_t(slot)];
  if (e.prev >= 0) entries_[size_t(e.prev)].next = e.next; else head_ = e.next;
  if (e.next >= 0) entries_[size_t(e.next)].prev = e.prev; else tail_ = e.prev;
  e.prev = e.next = -1;
}

void HostKVTier::push_back(int slot) {
  Entry& e = entries_[size_t(slot)];
  e.next = -1;
  e.prev = tail_;
  if (tail_ >= 0) entries_[size_t(tail_)].next = slot; else head_ = slot;
  tail_ = slot;
}

void HostKVTier::keep(BlockId id, uint64_t serial, uint64_t parent_serial, uint64_t key, std::span<const TokenId> tokens) {
  KVLM_CHECK(serial != 0 && tokens.size() == size_t(block_size_), "host tier: a page without a cache identity");
  if (const auto it = by_serial_.find(serial); it != by_serial_.end()) {  // restored earlier: the same contents
    unlink(it->second);
    push_back(it->second);
    return;
  }
  int slot = -1;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {  // replace the least recently used entry that is not pinned
    for (int s = head_; s >= 0; s = entries_[size_t(s)].next)
      if (!entries_[size_t(s)].pinned) {
        slot = s;
        break;
      }
    if (slot < 0) return;  // every entry pinned (a restore in progress): this page is not kept
    Entry& old = entries_[size_t(slot)];
    unlink(slot);
    auto [lo, hi] = index_.equal_range(old.key);
    for (auto it = lo; it != hi; ++it)
      if (it->second == slot) {
        index_.erase(it);
        break;
      }
    by_serial_.erase(old.serial);
    ++evicted_;
  }
  uint8_t* const dst = slot_data(slot);
  runner_.save_pages({&id, 1}, {&dst, 1});
  entries_[size_t(slot)] = Entry{.serial = serial, .parent_serial = parent_serial, .key = key};
  std::ranges::copy(tokens, tokens_of(slot).begin());
  index_.emplace(key, slot);
  by_serial_.emplace(serial, slot);
  push_back(slot);
  ++kept_;
}

int HostKVTier::find(uint64_t key, uint64_t parent_serial, std::span<const TokenId> tokens) {
  auto [lo, hi] = index_.equal_range(key);
  for (auto it = lo; it != hi; ++it) {
    Entry& e = entries_[size_t(it->second)];
    if (e.parent_serial == parent_serial && std::ranges::equal(tokens, tokens_of(it->second))) {
      unlink(it->second);
      push_back(it->second);
      e.pinned = true;
      return it->second;
    }
  }
  return -1;
}

void HostKVTier::unpin(int slot) { entries_[size_t(slot)].pinned = false; }

void HostKVTier::restore(std::span<const int> slots, std::span<const BlockId> ids) {
  KVLM_CHECK(slots.size() == ids.size(), "host tier: restore of mismatched lists");
  if (slots.empty()) return;
  // In slot order: a chain's pages were evicted last page first into slots taken in order, so
  // sorted they sit next to each other and the runner moves them in fewer, larger copies.
  std::vector<std::pair<int, BlockId>> order;
  for (size_t i = 0; i < slots.size(); ++i) order.emplace_back(slots[i], ids[i]);
  std::ranges::sort(order);
  std::vector<const uint8_t*> src;
  std::vector<BlockId> dst;
  for (const auto& [slot, id] : order) {
    Entry& e = entries_[size_t(slot)];
    KVLM_CHECK(e.serial != 0 && e.pinned, "host tier: restoring an entry that was not found");
    e.pinned = false;
    src.push_back(slot_data(slot));
    dst.push_back(id);
  }
  runner_.load_pages(dst, src);
  restored_ += slots.size();
}

}  // namespace kvlm

#include "engine/host_kv_tier.h"

#include <algorithm>

#include "core/error.h"
#include "model/model_runner.h"

namespace kvlm {

HostKVTier::HostKVTier(ModelRunner& runner, int block_size, size_t capacity)
    : runner_(runner), block_size_(block_size), page_bytes_(runner.kv_page_bytes(block_size)) {
  KVLM_CHECK(block_size > 0 && capacity >= 2, "the host tier needs at least two pages");
  KVLM_CHECK(page_bytes_ > 0, "the runner cannot copy its KV pages to host memory");
  data_.reset(new uint8_t[capacity * page_bytes_]);  // uninitialized: touched as pages arrive
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
  runner_.save_pages({&id, 1}, std::span(data_.get() + size_t(slot) * page_bytes_, page_bytes_));
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

std::pair<uint64_t, uint64_t> HostKVTier::restore(int slot, BlockId id) {
  Entry& e = entries_[size_t(slot)];
  KVLM_CHECK(e.serial != 0 && e.pinned, "host tier: restoring an entry that was not found");
  runner_.load_pages({&id, 1}, std::span<const uint8_t>(data_.get() + size_t(slot) * page_bytes_, page_bytes_));
  e.pinned = false;
  ++restored_;
  return {e.serial, e.parent_serial};
}

}  // namespace kvlm

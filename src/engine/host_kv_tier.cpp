#include "engine/host_kv_tier.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>

#include "core/error.h"
#include "core/log.h"
#include "core/units.h"
#include "model/model_runner.h"

namespace kvlm {

namespace {
size_t checked_page_bytes(const ModelRunner& runner, int block_size, size_t capacity, PageKind kind) {
  KVLM_CHECK(block_size > 0 && capacity >= 2, "the host tier needs at least two pages");
  const size_t page = runner.kv_page_bytes(block_size, kind);
  KVLM_CHECK(page > 0, "the runner cannot copy its KV pages to host memory");
  return page;
}

// The tier's memory; pinning tens of GiB takes seconds at start, so say how long.
HostBytes allocate_logged(ModelRunner& runner, size_t bytes, PageKind kind) {
  const auto t0 = std::chrono::steady_clock::now();
  HostBytes p = runner.allocate_host(bytes);
  char line[200];
  std::snprintf(line, sizeof line, "host tier%s: %.2f GiB of host memory allocated%s in %.1f s",
                kind == PageKind::Exact ? " (exact pages)" : "", double(bytes) / double(1ull << 30),
                runner.device() == Device::Cuda ? " and pinned" : "", seconds_since(t0));
  log::info(line);
  return p;
}
}  // namespace

HostKVTier::HostKVTier(ModelRunner& runner, int block_size, size_t capacity, std::unique_ptr<DiskKVTier> disk,
                       PageKind kind)
    : runner_(runner), kind_(kind), block_size_(block_size),
      page_bytes_(checked_page_bytes(runner, block_size, capacity, kind)),
      data_(allocate_logged(runner, capacity * page_bytes_, kind)),  // uninitialized: written as pages arrive
      disk_(std::move(disk)) {
  tokens_.resize(capacity * size_t(block_size));
  entries_.resize(capacity);
  unfenced_.assign(capacity, false);
  for (size_t i = capacity; i-- > 0;) free_.push_back(int(i));
  // A batch handed to the disk tier's writer has one fence on the copies that filled it: an
  // eighth of the tier or 64 MiB, whichever is fewer pages.
  demote_batch_ = std::clamp<size_t>(std::min(capacity / 8, kPageStagingBytes / page_bytes_), 1, capacity);
  // Slots kept free or on their way to disk ahead of need: a hit that reads many pages from
  // disk, or a burst of evictions, takes them without waiting for the writer.
  reserve_ = std::max(demote_batch_, capacity / 8);
}

HostKVTier::~HostKVTier() {
  try {
    flush_to_disk();
  } catch (const std::exception& e) {  // a failing runner at shutdown: the pages are lost, nothing else
    log::warn(std::string("host tier: pages not written to disk at shutdown: ") + e.what());
  }
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

void HostKVTier::drop(int slot) {
  unlink(slot);
  index_.erase(entries_[size_t(slot)].chain);
  entries_[size_t(slot)] = Entry{};
  free_.push_back(slot);
}

bool HostKVTier::demote() {
  std::vector<DiskKVTier::WriteJob> jobs;
  bool any = false;
  for (int s = head_, n = 0; s >= 0 && size_t(n) < demote_batch_;) {
    const int next = entries_[size_t(s)].next;
    Entry& e = entries_[size_t(s)];
    if (!e.pinned && !e.writing) {
      ++n;
      any = true;
      if (e.on_disk) {  // on disk already (read from it, or written before): nothing to write
        drop(s);
        unfenced_[size_t(s)] = true;  // a restore from it may be in flight
        ++evicted_;
      } else {
        e.writing = true;
        ++writing_;
        e.used = false;
        const auto t = tokens_of(s);
        jobs.push_back({e.chain, e.serial, std::vector<TokenId>(t.begin(), t.end()), slot_data(s), s});
      }
    }
    s = next;
  }
  if (!jobs.empty()) disk_->write_async(std::move(jobs), runner_.page_fence());
  return any;
}

void HostKVTier::reclaim(bool wait) {
  for (int s : disk_->take_written(wait)) {
    Entry& e = entries_[size_t(s)];
    KVLM_CHECK(e.writing, "host tier: a slot came back from the disk tier twice");
    e.writing = false;
    --writing_;
    e.on_disk = true;  // or its write failed (logged): then it is lost once replaced
    if (e.pinned || e.used) {  // a hit used it meanwhile: it stays, now also on disk
      e.used = false;
      continue;
    }
    drop(s);
    ++evicted_;
  }
}

int HostKVTier::take_slot() {
  if (disk_) {
    // Keep a batch of slots free ahead of need, written to disk in the background; wait for
    // the writer only when nothing is free.
    reclaim(false);
    while (free_.size() + writing_ < reserve_ && demote()) {
    }
    while (free_.empty()) {
      reclaim(false);  // pages the disk tier had already come back at once
      if (!free_.empty()) break;
      if (disk_->writes_in_flight() > 0) reclaim(true);
      else if (!demote()) break;  // every entry pinned (a restore in progress)
    }
  } else if (free_.empty()) {  // the least recently used entry that is not pinned is replaced
    int victim = -1;
    for (int s = head_; s >= 0 && victim < 0; s = entries_[size_t(s)].next)
      if (!entries_[size_t(s)].pinned) victim = s;
    if (victim >= 0) {
      drop(victim);
      ++evicted_;
    }
  }
  if (free_.empty()) return -1;
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

int HostKVTier::take_slot_for_host_write() {
  const int slot = take_slot();
  if (slot >= 0 && unfenced_[size_t(slot)]) {
    runner_.wait_pages();  // every copy issued so far: no slot is read any more
    unfenced_.assign(unfenced_.size(), false);
  }
  return slot;
}

void HostKVTier::keep(BlockId id, uint64_t serial, const PageHash& chain, std::span<const TokenId> tokens) {
  KVLM_CHECK(serial != 0 && tokens.size() == size_t(block_size_), "host tier: a page without a cache identity");
  if (chain.empty()) return;  // registered without a chain (no tier then): nothing names it here
  if (const auto it = index_.find(chain); it != index_.end()) {  // restored earlier: the same contents
    unlink(it->second);
    push_back(it->second);
    entries_[size_t(it->second)].used = true;
    return;
  }
  const int slot = take_slot();
  if (slot < 0) return;  // every entry pinned: this page is not kept
  uint8_t* const dst = slot_data(slot);
  try {
    runner_.save_pages({&id, 1}, {&dst, 1}, kind_);
  } catch (...) {
    free_.push_back(slot);
    throw;
  }
  entries_[size_t(slot)] = Entry{.serial = serial, .chain = chain};
  std::ranges::copy(tokens, tokens_of(slot).begin());
  index_.emplace(chain, slot);
  push_back(slot);
  ++kept_;
}

int HostKVTier::find(const PageHash& chain, std::span<const TokenId> tokens, bool from_disk) {
  if (!use_host_) return -1;
  from_disk = from_disk && use_disk_;
  if (disk_ && !index_.count(chain) && (loading_.count(chain) || (from_disk && disk_->contains(chain)))) {
    // On its way here (or, when allowed, on disk: read it first): wait for this page alone.
    if (!loading_.count(chain)) {
      fetch({&chain, 1}, tokens);
      ++found_on_disk_;
    }
    while (loading_.count(chain)) poll(/*wait=*/true);
  }
  const auto it = index_.find(chain);
  if (it == index_.end() || !std::ranges::equal(tokens, tokens_of(it->second))) return -1;
  unlink(it->second);
  push_back(it->second);
  entries_[size_t(it->second)].pinned = true;
  entries_[size_t(it->second)].used = true;
  return it->second;
}

void HostKVTier::unpin(int slot) { entries_[size_t(slot)].pinned = false; }

size_t HostKVTier::fetch(std::span<const PageHash> chains, std::span<const TokenId> tokens, size_t* started) {
  if (started) *started = 0;
  if (!disk_) return 0;
  poll(false);  // reads in flight land whether or not the tiers are in use
  const size_t bs = size_t(block_size_);
  size_t loading = 0;
  if (!use_host_ || !use_disk_) {  // no new reads; those started before are waited for as before
    for (size_t i = 0; i < chains.size() && i < max_fetch(); ++i) loading += loading_.count(chains[i]);
    return loading;
  }
  std::vector<size_t> want;
  for (size_t i = 0; i < chains.size() && i < max_fetch(); ++i) {
    if (loading_.count(chains[i])) ++loading;
    else if (!index_.count(chains[i]) && disk_->contains(chains[i])) want.push_back(i);
  }
  // The pages about to be read become the disk's most recently used first, so that room made
  // for the writes take_slot may start is not taken from them.
  for (size_t i : want) disk_->touch(chains[i]);
  std::vector<DiskKVTier::ReadJob> jobs;
  try {
    for (size_t i : want) {
      const int slot = take_slot_for_host_write();
      if (slot < 0) break;
      const auto t = tokens.subspan(i * bs, bs);
      entries_[size_t(slot)] = Entry{.chain = chains[i], .loading = true};
      std::ranges::copy(t, tokens_of(slot).begin());
      loading_.emplace(chains[i], slot);
      jobs.push_back({chains[i], std::vector<TokenId>(t.begin(), t.end()), slot_data(slot), slot});
    }
  } catch (...) {  // a failed wait for the copies: none of these reads starts, their slots are free again
    for (const auto& j : jobs) {
      loading_.erase(j.chain);
      entries_[size_t(j.tag)] = Entry{};
      free_.push_back(j.tag);
    }
    throw;
  }
  loading += jobs.size();
  if (started) *started = jobs.size();
  disk_->read_async(std::move(jobs));
  return loading;
}

void HostKVTier::poll(bool wait) {
  if (!disk_) return;
  for (const DiskKVTier::ReadDone& d : disk_->take_read(wait)) {
    const int slot = d.tag;
    Entry& e = entries_[size_t(slot)];
    KVLM_CHECK(e.loading, "host tier: a slot came back from the disk tier's readers twice");
    loading_.erase(e.chain);
    if (!d.ok || index_.count(e.chain)) {  // a miss, or kept from the pool meanwhile
      e = Entry{};
      free_.push_back(slot);
      continue;
    }
    e.loading = false;
    e.serial = d.serial;
    e.on_disk = true;
    index_.emplace(e.chain, slot);
    push_back(slot);
    ++disk_hits_;
  }
}

void HostKVTier::wait_reads() {
  while (!loading_.empty()) {
    KVLM_CHECK(disk_->reads_in_flight() > 0, "host tier: pages on their way from disk with no read in flight");
    poll(/*wait=*/true);
  }
}

void HostKVTier::prefetch(std::span<const PageHash> chains, std::span<const TokenId> tokens) {
  if (fetch(chains, tokens) == 0) return;
  for (const PageHash& c : chains)  // these pages' reads, not every one in flight
    while (loading_.count(c)) poll(/*wait=*/true);
}

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
    KVLM_CHECK(!e.chain.empty() && e.pinned, "host tier: restoring an entry that was not found");
    e.pinned = false;
    src.push_back(slot_data(slot));
    dst.push_back(id);
  }
  runner_.load_pages(dst, src, kind_);
  restored_ += slots.size();
}

void HostKVTier::flush_to_disk() {
  if (!disk_ || index_.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<DiskKVTier::WriteJob> jobs;
  for (int s = head_; s >= 0; s = entries_[size_t(s)].next) {  // least recent first: the newest files are the most recent
    Entry& e = entries_[size_t(s)];
    if (e.on_disk || e.writing) continue;
    e.writing = true;
    ++writing_;
    e.used = true;  // kept when it comes back
    const auto t = tokens_of(s);
    jobs.push_back({e.chain, e.serial, std::vector<TokenId>(t.begin(), t.end()), slot_data(s), s});
  }
  const bool any = !jobs.empty();
  const uint64_t before = disk_->pages_written();
  if (any) disk_->write_async(std::move(jobs), runner_.page_fence());
  while (disk_->writes_in_flight() > 0) reclaim(/*wait=*/true);
  if (!any) return;
  const uint64_t n = disk_->pages_written() - before;  // failed writes were logged, not counted; batches in flight are
  char line[256];
  std::snprintf(line, sizeof line, "disk tier: %llu %spages (%s) written to %s in %.2f s", (unsigned long long)n,
                kind_ == PageKind::Exact ? "exact " : "",
                human_bytes(n * disk_->file_bytes()).c_str(), disk_->directory().c_str(), seconds_since(t0));
  log::info(line);
}

}  // namespace kvlm

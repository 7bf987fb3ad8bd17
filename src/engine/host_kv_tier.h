// The prefix cache's second tier (--kv-offload-gib): pages the KV pool evicts are kept in host
// memory in their stored format — every layer's K and V codes and token scales, whatever the
// per-layer plan — and copied back into the pool when a later prompt's prefix reaches them,
// instead of being computed again. Quantized pages are 2-3.8x smaller than bf16 ones, so the
// same host memory holds that many more prefixes.
//
// An entry is named by its page's chain hash (page_hash.h: the model and plan, then every
// token up to the page's end) and holds its tokens, compared on every hit. It also keeps the
// serial the page had in the pool, so that a restored page is registered under it again when
// no pool page holds it (state snapshots, keyed by serial, stay usable); the block manager
// gives it a fresh one otherwise. A page restored and evicted again is not copied twice (its
// chain is still here). Entries are replaced least recently used first.
//
// With a disk tier (disk_kv_tier.h, --kv-offload-dir) entries are written there before they
// are replaced: while fewer than an eighth of the slots are free or being written, the least
// recently used batches go to the disk tier's writer thread (after a fence on the copies that
// filled them); their slots stay findable until written, and come back free unless a hit used
// them meanwhile. A miss here is looked up there: a page found is read into a slot here
// (checked whole, on the disk tier's reader threads) and restored from it as any other. The
// scheduler starts the reads of a waiting request's prefix (fetch) and schedules other requests
// until they are done (the request is "restoring"). When the tier is destroyed (the server
// stops), the pages it holds are written to disk, so that a restart finds them.
//
// The same class holds exact pages (PageKind::Exact: layers with exact sink / recent tokens keep
// their copies in the model dtype): a second tier beside the pages', whose entries are named by
// their page's chain; ids given to keep and restore are then exact page ids (the block
// manager's restore_exact and detach_exact).
//
// Host memory comes from the runner (pinned on a GPU). The copies are issued in the runner's
// stream order and do not wait (ModelRunner::save_pages / load_pages): an eviction's copy is
// ordered before the step that overwrites the page, a restore's before the step that reads
// it, and a slot's later copies after its earlier ones; the host reads a slot's bytes itself
// (the disk tier's writer) only after a fence on the copies that filled it, and writes one (a
// disk read) only once the copies that may still read it are done (take_slot_for_host_write). The pages of one hit are restored in one batch
// (BlockManager::commit_restores).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/index_types.h"
#include "engine/disk_kv_tier.h"
#include "engine/page_hash.h"
#include "model/model_runner.h"

namespace kvlm {

class HostKVTier {
 public:
  // `capacity` pages of runner.kv_page_bytes(block_size, kind) each (reserved, touched as
  // pages arrive), and the disk tier below it (nullptr: none). `kind`: the pool's pages (ids
  // given to keep and restore are page ids), or exact pages (exact page ids).
  HostKVTier(ModelRunner& runner, int block_size, size_t capacity, std::unique_ptr<DiskKVTier> disk = nullptr,
             PageKind kind = PageKind::Pages);
  ~HostKVTier();  // writes what it holds to the disk tier
  HostKVTier(const HostKVTier&) = delete;
  HostKVTier& operator=(const HostKVTier&) = delete;

  size_t capacity() const { return entries_.size(); }
  size_t size() const { return index_.size(); }
  size_t page_bytes() const { return page_bytes_; }
  PageKind kind() const { return kind_; }
  const DiskKVTier* disk() const { return disk_.get(); }

  // The pool is about to reuse its page `id`, cached under `serial` with chain hash `chain`
  // and `tokens`: keeps a copy unless this chain is here already (an empty chain: not kept).
  void keep(BlockId id, uint64_t serial, const PageHash& chain, std::span<const TokenId> tokens);
  // The entry of that chain and tokens — here, else (waiting for the read) on its way from the
  // disk tier or, `from_disk`, read from it into a slot here — or -1. A found entry becomes the
  // most recently used and is pinned — not replaced — until restore() or unpin().
  int find(const PageHash& chain, std::span<const TokenId> tokens, bool from_disk = true);
  void unpin(int slot);
  // Whether this tier or the disk tier below holds page `chain` (or it is on its way here) for
  // a hit to take it: only the tiers in use count.
  bool holds(const PageHash& chain) const {
    if (!use_host_) return false;
    return index_.count(chain) > 0 || loading_.count(chain) > 0 || (use_disk_ && disk_ && disk_->contains(chain));
  }
  // Which tiers hits take pages from (tier_costs.h: while restoring pays against computing the
  // tokens again). Off, find() and holds() see no page of that tier and fetch() starts no read
  // (it still counts the reads in flight, which land as before); pages are still kept and
  // written.
  void set_use(bool host, bool disk) {
    use_host_ = host;
    use_disk_ = disk;
  }
  // Starts reading into slots here the pages `chains[i]` (holding tokens[i * block_size,
  // (i + 1) * block_size)) that only the disk tier holds, on its reader threads, among the
  // first max_fetch() of them; returns how many of those are on their way here
  // (started now or before). They become entries, unpinned and most recently used, as poll()
  // takes them (find() and fetch() poll too).
  // `started`: how many reads this call started.
  size_t fetch(std::span<const PageHash> chains, std::span<const TokenId> tokens, size_t* started = nullptr);
  // Pages one hit reads from disk at most: all but an eighth of the slots (a hit pins the pages it
  // restores until its commit, right after).
  size_t max_fetch() const { return std::max<size_t>(capacity() - capacity() / 8, 1); }
  void poll(bool wait = false);
  void wait_reads();  // until no page is on its way here
  size_t loading() const { return loading_.size(); }
  // fetch(), then waits for those pages' reads (a hit's pages read together, ahead of the
  // find() calls that take them).
  void prefetch(std::span<const PageHash> chains, std::span<const TokenId> tokens);
  // The serial entry `slot` was kept under (0: none known, a page from an earlier process).
  uint64_t serial(int slot) const { return entries_[size_t(slot)].serial; }
  void set_serial(int slot, uint64_t serial) { entries_[size_t(slot)].serial = serial; }
  // Copies entries `slots[i]` into the pool's pages `ids[i]`, together, and unpins them.
  void restore(std::span<const int> slots, std::span<const BlockId> ids);
  // Writes every entry the disk tier lacks to it (no-op without one).
  void flush_to_disk();

  // Statistics: pages copied out and back, entries replaced (written to disk, with one).
  uint64_t pages_kept() const { return kept_; }
  uint64_t pages_restored() const { return restored_; }
  uint64_t evictions() const { return evicted_; }
  uint64_t disk_hits() const { return disk_hits_; }  // pages read from the disk tier
  // Of those, the reads find() itself started and waited for (no fetch() had asked for them).
  uint64_t reads_found_on_disk() const { return found_on_disk_; }

 private:
  struct Entry {
    uint64_t serial = 0;
    PageHash chain;           // empty: a free slot
    int prev = -1, next = -1;  // LRU links (head: least recent)
    bool pinned = false;
    bool on_disk = false;  // the disk tier holds this page (read from it, or written)
    bool writing = false;  // with the disk tier's writer: not free until it comes back
    bool used = false;     // found or kept again since it was handed to the writer
    bool loading = false;  // being read from the disk tier into the slot: not an entry yet
  };
  bool demote();              // hands a batch of LRU entries to the disk tier; false: none could go
  void reclaim(bool wait);    // takes back the entries the writer is done with
  void unlink(int slot);
  void push_back(int slot);
  // A free slot, replacing entries when none is (-1: every entry pinned).
  int take_slot();
  // The same, for the host to write into (a disk read): first waits for the copies that may
  // still read a slot freed without a fence.
  int take_slot_for_host_write();
  void drop(int slot);  // forgets the entry, frees the slot
  std::span<TokenId> tokens_of(int slot) {
    return std::span(tokens_).subspan(size_t(slot) * size_t(block_size_), size_t(block_size_));
  }
  uint8_t* slot_data(int slot) { return data_.get() + size_t(slot) * page_bytes_; }

  ModelRunner& runner_;
  PageKind kind_;
  bool use_host_ = true, use_disk_ = true;
  int block_size_;
  size_t page_bytes_;
  HostBytes data_;                   // [capacity][page_bytes], from runner.allocate_host
  std::vector<TokenId> tokens_;      // [capacity][block_size]
  std::vector<Entry> entries_;
  std::unordered_map<PageHash, int, PageHashHasher> index_;  // chain -> slot
  std::unordered_map<PageHash, int, PageHashHasher> loading_;  // chain -> slot, reads in flight
  std::vector<int> free_;
  int head_ = -1, tail_ = -1;
  std::unique_ptr<DiskKVTier> disk_;
  size_t demote_batch_ = 1;  // entries handed to the disk tier's writer at a time
  size_t reserve_ = 1;       // slots kept free or being written ahead of need
  size_t writing_ = 0;       // entries with the writer now
  // Slots freed without a fence (on-disk entries dropped at once): a restore issued earlier may
  // still read them, so the host waits before writing into one.
  std::vector<bool> unfenced_;
  uint64_t kept_ = 0, restored_ = 0, evicted_ = 0, disk_hits_ = 0, found_on_disk_ = 0;
};

}  // namespace kvlm

// The prefix cache's second tier (--kv-offload-gib): pages the KV pool evicts are kept in host
// memory in their stored format — every layer's K and V codes and token scales, whatever the
// per-layer plan — and copied back into the pool when a later prompt's prefix reaches them,
// instead of being computed again. Quantized pages are 2-3.8x smaller than bf16 ones, so the
// same host memory holds that many more prefixes.
//
// An entry keeps the page's cache identity from the pool (engine/block_manager.h): its serial,
// its parent's serial and its tokens. A restored page is registered again under the same
// serial, so the pages after it — in the pool or here — still chain to it; a hit is confirmed
// on the tokens and the parent serial, never on the hash alone. Serials are never reused, so
// an entry is the page's exact contents for as long as it lives. A page restored and evicted
// again is not copied twice (its serial is still here). Entries are replaced least recently
// used first.
//
// Exact pages (layers with exact sink / recent tokens) are not kept: a restored page has no
// exact copy, and the scheduler's admit_prefix ends a hit before a page a query must read
// exact, as it does after any loss of an exact copy.
//
// Host memory comes from the runner (pinned on a GPU). The copies are issued in the runner's
// stream order and do not wait (ModelRunner::save_pages / load_pages): an eviction's copy is
// ordered before the step that overwrites the page, a restore's before the step that reads
// it, and a slot's later copies after its earlier ones; the host never touches the bytes.
// The pages of one hit are restored in one batch (BlockManager::commit_restores).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/index_types.h"
#include "model/model_runner.h"

namespace kvlm {

class HostKVTier {
 public:
  // `capacity` pages of runner.kv_page_bytes(block_size) each (reserved, touched as pages arrive).
  HostKVTier(ModelRunner& runner, int block_size, size_t capacity);

  size_t capacity() const { return entries_.size(); }
  size_t size() const { return index_.size(); }
  size_t page_bytes() const { return page_bytes_; }

  // The pool is about to reuse its page `id`, cached under (serial, parent_serial, key,
  // tokens): keeps a copy unless this serial is here already.
  void keep(BlockId id, uint64_t serial, uint64_t parent_serial, uint64_t key, std::span<const TokenId> tokens);
  // The entry with that identity, or -1. A found entry becomes the most recently used and is
  // pinned — not replaced by keep() — until restore() or unpin().
  int find(uint64_t key, uint64_t parent_serial, std::span<const TokenId> tokens);
  void unpin(int slot);
  // The serial and parent serial of entry `slot`.
  std::pair<uint64_t, uint64_t> identity(int slot) const {
    return {entries_[size_t(slot)].serial, entries_[size_t(slot)].parent_serial};
  }
  // Copies entries `slots[i]` into the pool's pages `ids[i]`, together, and unpins them.
  void restore(std::span<const int> slots, std::span<const BlockId> ids);

  // Statistics: pages copied out and back, entries replaced.
  uint64_t pages_kept() const { return kept_; }
  uint64_t pages_restored() const { return restored_; }
  uint64_t evictions() const { return evicted_; }

 private:
  struct Entry {
    uint64_t serial = 0, parent_serial = 0, key = 0;  // serial 0: empty
    int prev = -1, next = -1;                         // LRU links (head: least recent)
    bool pinned = false;
  };
  void unlink(int slot);
  void push_back(int slot);
  std::span<TokenId> tokens_of(int slot) {
    return std::span(tokens_).subspan(size_t(slot) * size_t(block_size_), size_t(block_size_));
  }

  ModelRunner& runner_;
  int block_size_;
  size_t page_bytes_;
  uint8_t* slot_data(int slot) { return data_.get() + size_t(slot) * page_bytes_; }

  HostBytes data_;                   // [capacity][page_bytes], from runner.allocate_host
  std::vector<TokenId> tokens_;      // [capacity][block_size]
  std::vector<Entry> entries_;
  std::unordered_multimap<uint64_t, int> index_;  // key -> slot
  std::unordered_map<uint64_t, int> by_serial_;   // serial -> slot
  std::vector<int> free_;
  int head_ = -1, tail_ = -1;
  uint64_t kept_ = 0, restored_ = 0, evicted_ = 0;
};

}  // namespace kvlm

// KV pages shared among the sequences of the serving engine, with reference counts and a
// prefix cache.
//
// A page is *full* when it holds block_size computed tokens. A full page may be registered
// in the prefix cache under the identity (parent page's identity, its tokens); a later
// prompt that starts with the same tokens reuses it instead of recomputing it. Identities
// are exact, not hashes: the cache key is a hash, but a hit is confirmed by comparing the
// tokens and the parent's serial number (each registration gets a fresh serial), so a hash
// collision or a page that was evicted and reused can never produce a false hit.
//
// Free pages form one queue: pages without a cache identity first (nothing to lose), then
// cached pages in least-recently-used order. Allocation takes the head, evicting its
// identity if it has one; freeing a cached page appends it to the tail.
//
// Exact pages (layers with exact sink / recent tokens, kv/kv_cache.h): a second, smaller
// pool. A page that some sequence reads exact — one of its sink pages, or a page from its
// recent window on — has an exact page, attached when the page is allocated fresh (its
// tokens are written to both) and held by every sequence that needs it. A page nobody holds
// keeps its exact page, idle, for a later prefix hit that resumes right after it; idle exact
// pages are taken back, least recently idle first, when the exact pool runs dry, and a page
// allocated afresh gives its up. A page whose exact copy is gone never gets one again (its
// tokens are not written again), so a prefix hit stops before it (the scheduler's
// admit_prefix).
//
// A lower tier (engine/host_kv_tier.h, --kv-offload-gib): a cached page about to be reused is
// copied there first, and a prefix that runs out of cached pages goes on there: each page
// found takes a fresh page, registered again under the serial the tier kept when no pool page
// holds that serial (else a fresh one), and the pages the caller keeps of the hit are copied
// back together (commit_restores). The tiers name pages by chain hash (engine/page_hash.h),
// which outlives serials: with a tier, every registered page also carries its chain, and the
// caller keeps the chains of its pages beside their serials (chain_of). With exact tokens, an
// exact tier beside it (HostKVTier of PageKind::Exact) keeps the exact copies cached pages
// give up (evicted, or their idle exact page taken back), under the same chains; a hit whose
// query must read a page exact that has lost its copy takes it back from there (restore_exact).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/index_types.h"
#include "engine/page_hash.h"

namespace kvlm {

class HostKVTier;

class BlockManager {
 public:
  BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int num_exact_pages = 0);

  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  bool prefix_caching() const { return caching_; }
  // Pages that allocate() can hand out now (free, including evictable cached pages).
  int num_free() const { return num_free_; }
  // Pages referenced by at least one sequence.
  int num_used() const { return num_blocks_ - num_free_; }

  // A fresh page with reference count 1; nullopt when every page is referenced.
  std::optional<BlockId> allocate();
  // Drops one reference; at zero the page becomes free (cached pages stay findable).
  void release(BlockId id);
  int ref_count(BlockId id) const { return blocks_[size_t(id)].refs; }

  const HostKVTier* exact_tier() const { return exact_tier_; }
  // The tier evicted cached pages go to and prefix hits are restored from (nullptr: none), and
  // the root of the chain hashes that name pages there (page_hash.h's kv_root). `exact`: the
  // tier of exact pages beside it (PageKind::Exact; nullptr: none), named by the same chains.
  void set_lower_tier(HostKVTier* tier, const PageHash& root, HostKVTier* exact = nullptr) {
    tier_ = tier;
    root_ = root;
    exact_tier_ = tier ? exact : nullptr;
  }
  // The chain hash of a page holding `tokens` after the page whose chain is `parent` (nullptr:
  // the first page). Empty without a lower tier (nothing needs it).
  PageHash chain_of(const PageHash* parent, std::span<const TokenId> tokens) const {
    return tier_ ? page_chain(parent ? *parent : root_, tokens) : PageHash{};
  }
  // Copies every cached page to the lower tier (a server stopping: its disk tier keeps them).
  void offload_cached();

  // Longest run of cached full pages that `tokens` starts with, in the pool or, past its
  // pages, in the lower tier (copied back into fresh pages; pages on disk are read first, and
  // waited for). Each page found gains a reference and is appended to `pages`, its serial to
  // `serials`; returns how many were found. `chains`, when given, holds the chain hashes of
  // the first pages of `tokens` (the caller's, kept from an earlier call) and gets those this
  // call computes. Only whole pages match; the caller decides how many of them to keep.
  // Pages found in the lower tier are registered at once (the chain goes on through them) but
  // copied back only by commit_restores(), which the caller runs before anything else uses
  // the pool: after it has released the pages of the hit it does not keep.
  int match_prefix(std::span<const TokenId> tokens, std::vector<BlockId>& pages, std::vector<uint64_t>& serials,
                   std::vector<PageHash>* chains = nullptr);
  // Starts reading from the disk tier the pages past the pool's that a match_prefix of
  // `tokens` would restore (HostKVTier::fetch; `chains` as for match_prefix); returns how many
  // are on their way (0: a match_prefix now waits for nothing), `started` how many of those
  // this call started. `exact_read(found, pages)`, with exact pages in the tiers: lists the
  // pages a hit of `found` pages reads exact; the exact copies of those the pool lacks are
  // read from the exact pages' disk tier too (and counted), so that restore_exact finds them
  // in host memory.
  size_t fetch_prefix(std::span<const TokenId> tokens, std::vector<PageHash>& chains, size_t* started = nullptr,
                      const std::function<void(int, std::vector<int>&)>& exact_read = {});
  // Copies the last match's lower-tier pages that are still referenced back into their pages,
  // in one batch; the ones released meanwhile lose their identity and are not copied.
  void commit_restores();

  // Registers the full page `id` holding `tokens` (block_size of them) after the page
  // whose serial is `parent_serial` (0 for the first page). Returns the page's serial. When
  // an identical page is already cached, `id` stays unregistered and that page's serial is
  // returned, so the chain continues either way. `chain` is the page's chain hash (chain_of;
  // with a lower tier, a page registered without one is not kept there).
  uint64_t register_full(BlockId id, uint64_t parent_serial, std::span<const TokenId> tokens, const PageHash& chain = {});

  // --- exact pages ---
  int num_exact_pages() const { return int(exact_owner_.size()); }
  // Exact pages a hold on fresh pages can take now (free, or idle on an unheld sink page).
  int num_exact_available() const { return int(exact_free_.size()) + num_idle_exact_; }
  // The exact page of page `id`, -1 = none; exact_map() is that for every page.
  int32_t exact_of(BlockId id) const { return exact_of_[size_t(id)]; }
  std::span<const int32_t> exact_map() const {
    return exact_owner_.empty() ? std::span<const int32_t>{} : std::span<const int32_t>(exact_of_);
  }
  // A sequence needs page `id`'s exact copy. A page without one gets one only when `fresh`
  // (just allocated, nothing written yet); otherwise it must have one. Throws when the
  // exact pool is exhausted (check num_exact_available first).
  void hold_exact(BlockId id, bool fresh);
  // Drops one hold. At zero the exact page stays attached, idle, until the pool needs it
  // back or the page is allocated afresh. The pool takes back the stale idle copies first
  // (mark_exact_stale), then the least recently idle. A cached page's exact copy is kept in
  // the exact tier when it is given up (either way), unless it was marked stale since its
  // last hold.
  void drop_exact(BlockId id);
  // Page `id`'s idle exact copy is not worth keeping: a later hit reads exact its sinks and
  // the recent window before the page boundary it ends on, and this page is behind the windows
  // of the boundaries hits are expected to end on (the scheduler's advance_exact). The pool
  // takes it back before the copies that are not stale, and the exact tier does not keep it —
  // copying out every such page would move several times the pages' bytes. No effect on a
  // held page, or one without an exact copy.
  void mark_exact_stale(BlockId id);
  // The pages `pages` (cached, referenced: the ones a query reads exact) that lack an exact copy
  // get theirs back from the exact tier, attached idle: copied in, in stream order, before the
  // next step. Their entries there are all found (and pinned) first, so that an idle exact page
  // taken back to make room, whose copy the tier then keeps, cannot replace an entry a later page
  // of the same call restores from. An exact page is a free one, or an idle one taken back from a
  // page not in `pages`. Returns false when the tier lacks one of them (nothing changed) or no
  // exact page can be had for one (those restored before it stay).
  bool restore_exact(std::span<const BlockId> pages);
  // Whether page `id` has its exact copy, or the exact tier holds one for it.
  bool exact_restorable(BlockId id) const;
  int exact_holds(BlockId id) const { return blocks_[size_t(id)].exact_holds; }

  // Statistics (tokens, in whole pages): looked up / found by match_prefix.
  uint64_t cache_queries() const { return queries_; }
  uint64_t cache_hits() const { return hits_; }
  uint64_t lower_tier_hits() const { return tier_hits_; }  // of the hits, tokens restored from the lower tier
  uint64_t exact_restores() const { return exact_restores_; }  // exact pages restored from the exact tier
  int num_cached() const { return int(index_.size()); }

 private:
  struct Block {
    int refs = 0;
    uint64_t serial = 0;         // cache identity; 0 = not cached
    uint64_t parent_serial = 0;
    uint64_t key = 0;
    PageHash chain;              // with a lower tier: the name there
    BlockId prev = -1, next = -1;  // free-queue links
    bool in_queue = false;
    int exact_holds = 0;
    bool exact_idle = false;  // an exact page attached with no hold (counted in num_idle_exact_)
    bool exact_stale = false;  // its idle exact copy is not kept in the exact tier (mark_exact_stale)
  };
  // Frees page id's exact page; a cached page's goes to the exact tier first.
  void detach_exact(BlockId id);
  // Frees one idle exact page for another use: a stale one first, else the least recently
  // idle; never the copy of one of `keep`'s pages. False when there is none.
  bool take_back_idle_exact(std::span<const BlockId> keep);
  uint64_t key_of(uint64_t parent_serial, std::span<const TokenId> tokens) const;
  // The cached pool page holding `page` after the page of serial `parent` (key: key_of), or -1.
  BlockId find_cached(uint64_t parent, uint64_t key, std::span<const TokenId> page) const;
  // chains[i], computing those before it that `chains` lacks (`pool_page`: page i in the pool,
  // whose chain is taken when it has one).
  const PageHash& chain_at(std::span<const TokenId> tokens, std::vector<PageHash>& chains, size_t i,
                           BlockId pool_page = -1) const;
  bool same_tokens(BlockId id, std::span<const TokenId> tokens) const;
  void queue_remove(BlockId id);
  void queue_push_front(BlockId id);
  void queue_push_back(BlockId id);
  void uncache(BlockId id);

  int num_blocks_, block_size_;
  bool caching_;
  std::vector<Block> blocks_;
  std::vector<TokenId> tokens_;  // [num_blocks][block_size]: a cached page's tokens
  std::unordered_multimap<uint64_t, BlockId> index_;  // key -> cached pages
  std::unordered_map<uint64_t, BlockId> by_serial_;   // serial -> cached page (with a lower tier)
  BlockId head_ = -1, tail_ = -1;
  int num_free_ = 0;
  uint64_t next_serial_ = 1;
  uint64_t queries_ = 0, hits_ = 0, tier_hits_ = 0, exact_restores_ = 0;
  HostKVTier* tier_ = nullptr;
  HostKVTier* exact_tier_ = nullptr;
  PageHash root_;
  std::vector<std::pair<BlockId, int>> pending_;  // the last match's pages from the tier, and their slots
  std::vector<int32_t> exact_of_;      // [num_blocks] exact page or -1
  std::vector<BlockId> exact_owner_;   // [num_exact_pages] page it is attached to, or -1
  std::vector<int32_t> exact_free_;    // unattached exact pages
  std::deque<BlockId> idle_exact_;     // pages whose exact page went idle, oldest first (checked when taken)
  std::deque<BlockId> stale_exact_;    // of those, the ones marked stale, oldest first (likewise)
  int num_idle_exact_ = 0;
};

}  // namespace kvlm

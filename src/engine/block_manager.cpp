#include "engine/block_manager.h"

#include <algorithm>

#include "core/error.h"
#include "engine/host_kv_tier.h"

namespace kvlm {

BlockManager::BlockManager(int num_blocks, int block_size, bool enable_prefix_caching, int num_exact_pages)
    : num_blocks_(num_blocks), block_size_(block_size), caching_(enable_prefix_caching),
      blocks_(size_t(std::max(num_blocks, 0))) {
  KVLM_CHECK(num_blocks > 0 && block_size > 0 && num_exact_pages >= 0, "empty block manager");
  exact_of_.assign(size_t(num_blocks), -1);
  exact_owner_.assign(size_t(num_exact_pages), -1);
  for (int32_t e = num_exact_pages - 1; e >= 0; --e) exact_free_.push_back(e);
  if (caching_) tokens_.assign(size_t(num_blocks) * size_t(block_size), 0);
  for (BlockId i = 0; i < num_blocks; ++i) queue_push_back(i);
}

// splitmix64 over the parent serial and the tokens: a well-mixed key; equality is checked
// on the tokens and parent serial, so collisions cost a comparison, never a wrong page.
uint64_t BlockManager::key_of(uint64_t parent_serial, std::span<const TokenId> tokens) const {
  auto mix = [](uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  uint64_t h = mix(parent_serial);
  for (TokenId t : tokens) h = mix(h ^ uint64_t(uint32_t(t)));
  return h;
}

bool BlockManager::same_tokens(BlockId id, std::span<const TokenId> tokens) const {
  return std::equal(tokens.begin(), tokens.end(), tokens_.begin() + ptrdiff_t(size_t(id) * size_t(block_size_)));
}

void BlockManager::queue_remove(BlockId id) {
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(b.in_queue, "page not in the free queue");
  if (b.prev >= 0) blocks_[size_t(b.prev)].next = b.next; else head_ = b.next;
  if (b.next >= 0) blocks_[size_t(b.next)].prev = b.prev; else tail_ = b.prev;
  b.prev = b.next = -1;
  b.in_queue = false;
  --num_free_;
}

void BlockManager::queue_push_front(BlockId id) {
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(!b.in_queue, "page queued twice");
  b.prev = -1;
  b.next = head_;
  if (head_ >= 0) blocks_[size_t(head_)].prev = id; else tail_ = id;
  head_ = id;
  b.in_queue = true;
  ++num_free_;
}

void BlockManager::queue_push_back(BlockId id) {
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(!b.in_queue, "page queued twice");
  b.next = -1;
  b.prev = tail_;
  if (tail_ >= 0) blocks_[size_t(tail_)].next = id; else head_ = id;
  tail_ = id;
  b.in_queue = true;
  ++num_free_;
}

void BlockManager::uncache(BlockId id) {
  Block& b = blocks_[size_t(id)];
  if (b.serial == 0) return;
  auto [lo, hi] = index_.equal_range(b.key);
  for (auto it = lo; it != hi; ++it)
    if (it->second == id) {
      index_.erase(it);
      break;
    }
  if (tier_) by_serial_.erase(b.serial);
  b.serial = b.parent_serial = b.key = 0;
  b.chain = {};
}

std::optional<BlockId> BlockManager::allocate() {
  if (head_ < 0) return std::nullopt;
  const BlockId id = head_;
  queue_remove(id);
  Block& b = blocks_[size_t(id)];
  if (tier_ && b.serial != 0)  // to the lower tier before its contents are replaced
    tier_->keep(id, b.serial, b.chain, std::span(tokens_).subspan(size_t(id) * size_t(block_size_), size_t(block_size_)));
  KVLM_CHECK(b.exact_holds == 0, "a free page with exact holds");
  detach_exact(id);  // its tokens are about to be replaced (its exact copy kept first)
  uncache(id);  // evict: the least recently used cached page (or a never-cached one)
  b.refs = 1;
  return id;
}

void BlockManager::detach_exact(BlockId id) {
  Block& b = blocks_[size_t(id)];
  const int32_t e = exact_of_[size_t(id)];
  if (e < 0) return;
  const bool keep = exact_tier_ && b.serial != 0 && !b.exact_stale;
  b.exact_stale = false;
  if (b.exact_idle) {
    b.exact_idle = false;
    --num_idle_exact_;
  }
  exact_of_[size_t(id)] = -1;
  exact_owner_[size_t(e)] = -1;
  exact_free_.push_back(e);
  // Freed first, so that a failing copy leaves the pool's books whole; the copy is issued
  // before anything can write into the exact page again.
  if (keep)
    exact_tier_->keep(e, b.serial, b.chain, std::span(tokens_).subspan(size_t(id) * size_t(block_size_), size_t(block_size_)));
}

void BlockManager::hold_exact(BlockId id, bool fresh) {
  KVLM_CHECK(id >= 0 && id < num_blocks_, "page id out of range");
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(b.refs > 0, "exact hold on an unreferenced page");
  if (exact_of_[size_t(id)] < 0) {
    KVLM_CHECK(fresh, "a page whose exact copy is gone was held for exact reads");
    if (exact_free_.empty()) take_back_idle_exact({});
    KVLM_CHECK(!exact_free_.empty(), "the exact-token pool is exhausted (the scheduler checks num_exact_available)");
    const int32_t e = exact_free_.back();
    exact_free_.pop_back();
    exact_of_[size_t(id)] = e;
    exact_owner_[size_t(e)] = id;
  } else if (b.exact_idle) {
    b.exact_idle = false;
    --num_idle_exact_;
  }
  b.exact_stale = false;
  ++b.exact_holds;
}

bool BlockManager::exact_restorable(BlockId id) const {
  const Block& b = blocks_[size_t(id)];
  return exact_of_[size_t(id)] >= 0 || (exact_tier_ && b.serial != 0 && !b.chain.empty() && exact_tier_->holds(b.chain));
}

bool BlockManager::restore_exact(std::span<const BlockId> pages) {
  if (!exact_tier_) return std::ranges::all_of(pages, [&](BlockId id) { return exact_of_[size_t(id)] >= 0; });
  std::vector<std::pair<BlockId, int>> todo;  // page, its pinned entry in the exact tier
  auto unpin_from = [&](size_t i) {
    for (; i < todo.size(); ++i) exact_tier_->unpin(todo[i].second);
  };
  for (BlockId id : pages) {
    KVLM_CHECK(id >= 0 && id < num_blocks_, "page id out of range");
    if (exact_of_[size_t(id)] >= 0 || std::ranges::find(todo, id, &std::pair<BlockId, int>::first) != todo.end())
      continue;
    const Block& b = blocks_[size_t(id)];
    KVLM_CHECK(b.refs > 0, "restore_exact of an unreferenced page");
    const int slot = b.serial == 0 || b.chain.empty()
                         ? -1
                         : exact_tier_->find(b.chain, std::span(tokens_).subspan(size_t(id) * size_t(block_size_),
                                                                                 size_t(block_size_)));
    if (slot < 0) {
      unpin_from(0);
      return false;
    }
    todo.emplace_back(id, slot);
  }
  for (size_t i = 0; i < todo.size(); ++i) {
    const auto [id, slot] = todo[i];
    if (exact_free_.empty()) {  // an idle exact page taken back, not one of `pages`
      bool taken = false;
      try {
        taken = take_back_idle_exact(pages);  // its copy kept in the exact tier unless stale
      } catch (...) {
        unpin_from(i);
        throw;
      }
      if (!taken) {
        unpin_from(i);
        return false;
      }
    }
    Block& b = blocks_[size_t(id)];
    const int32_t e = exact_free_.back();
    exact_free_.pop_back();
    exact_of_[size_t(id)] = e;
    exact_owner_[size_t(e)] = id;
    b.exact_idle = true;
    b.exact_stale = false;
    ++num_idle_exact_;
    idle_exact_.push_back(id);
    const BlockId dst = e;
    exact_tier_->restore({&slot, 1}, {&dst, 1});
    ++exact_restores_;
  }
  return true;
}

void BlockManager::mark_exact_stale(BlockId id) {
  KVLM_CHECK(id >= 0 && id < num_blocks_, "page id out of range");
  Block& b = blocks_[size_t(id)];
  if (b.exact_holds > 0 || exact_of_[size_t(id)] < 0 || b.exact_stale) return;
  b.exact_stale = true;
  stale_exact_.push_back(id);
  if (stale_exact_.size() > 2 * size_t(num_blocks_))  // drop the entries of pages held or taken back since
    std::erase_if(stale_exact_, [&](BlockId p) { return !blocks_[size_t(p)].exact_idle || !blocks_[size_t(p)].exact_stale; });
}

bool BlockManager::take_back_idle_exact(std::span<const BlockId> keep) {
  for (std::deque<BlockId>* q : {&stale_exact_, &idle_exact_}) {
    const bool stale_only = q == &stale_exact_;
    for (auto it = q->begin(); it != q->end();) {
      const Block& b = blocks_[size_t(*it)];
      if (!b.exact_idle || (stale_only && !b.exact_stale)) {  // an entry outdated by a hold or a take
        it = q->erase(it);
        continue;
      }
      if (std::ranges::find(keep, *it) != keep.end()) {
        ++it;
        continue;
      }
      const BlockId victim = *it;
      q->erase(it);
      detach_exact(victim);
      return true;
    }
  }
  return false;
}

void BlockManager::drop_exact(BlockId id) {
  KVLM_CHECK(id >= 0 && id < num_blocks_, "page id out of range");
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(b.exact_holds > 0, "exact hold dropped more often than taken");
  if (--b.exact_holds > 0) return;
  if (exact_of_[size_t(id)] >= 0) {
    b.exact_idle = true;
    ++num_idle_exact_;
    idle_exact_.push_back(id);
    if (idle_exact_.size() > 2 * size_t(num_blocks_)) {  // drop the entries of pages held again
      std::erase_if(idle_exact_, [&](BlockId p) { return !blocks_[size_t(p)].exact_idle; });
    }
  }
}

void BlockManager::release(BlockId id) {
  KVLM_CHECK(id >= 0 && id < num_blocks_, "page id out of range");
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(b.refs > 0, "page released more often than referenced");
  if (--b.refs > 0) return;
  if (b.serial != 0) queue_push_back(id);  // keep for reuse, evicted last
  else queue_push_front(id);               // nothing to keep: hand out first
}

BlockId BlockManager::find_cached(uint64_t parent, uint64_t key, std::span<const TokenId> page) const {
  auto [lo, hi] = index_.equal_range(key);
  for (auto it = lo; it != hi; ++it)
    if (blocks_[size_t(it->second)].parent_serial == parent && same_tokens(it->second, page)) return it->second;
  return -1;
}

const PageHash& BlockManager::chain_at(std::span<const TokenId> tokens, std::vector<PageHash>& chains, size_t i,
                                       BlockId pool_page) const {
  const size_t bs = size_t(block_size_);
  while (chains.size() <= i) {
    const size_t j = chains.size();
    // A pool page registered with its chain has it; the others are hashed.
    const bool known = j == i && pool_page >= 0 && !blocks_[size_t(pool_page)].chain.empty();
    chains.push_back(known ? blocks_[size_t(pool_page)].chain
                           : chain_of(j == 0 ? nullptr : &chains[j - 1], tokens.subspan(j * bs, bs)));
  }
  return chains[i];
}

int BlockManager::match_prefix(std::span<const TokenId> tokens, std::vector<BlockId>& pages,
                               std::vector<uint64_t>& serials, std::vector<PageHash>* chains) {
  if (!caching_) return 0;
  KVLM_CHECK(pending_.empty(), "match_prefix before the previous match's commit_restores");
  const size_t bs = size_t(block_size_);
  const size_t full = tokens.size() / bs;
  queries_ += full * bs;
  std::vector<PageHash> own;
  std::vector<PageHash>& ch = chains ? *chains : own;
  uint64_t parent = 0;
  bool prefetched = false;
  size_t window_end = 0;  // pages past it are not read from disk (a hit pins at most max_fetch of them)
  int matched = 0;
  for (size_t i = 0; i < full; ++i) {
    const auto page = tokens.subspan(i * bs, bs);
    const uint64_t key = key_of(parent, page);
    BlockId found = find_cached(parent, key, page);
    const PageHash chain = tier_ ? chain_at(tokens, ch, i, found) : PageHash{};
    if (found < 0 && tier_) {  // past the pool's pages: the lower tier's, copied back by commit_restores
      if (!prefetched) {  // the run of pages the tiers hold from here, read from disk together
        prefetched = true;
        size_t n = 0;
        while (i + n < full && n < tier_->max_fetch() && tier_->holds(chain_at(tokens, ch, i + n))) ++n;
        tier_->prefetch(std::span(ch).subspan(i, n), tokens.subspan(i * bs, n * bs));
        window_end = i + n;
      }
      const int slot = tier_->find(chain, page, /*from_disk=*/i < window_end);
      if (slot < 0) break;
      const std::optional<BlockId> fresh = allocate();
      if (!fresh) {
        tier_->unpin(slot);
        break;
      }
      // The serial the page had, unless a pool page holds it (the same contents, reached by
      // another parent serial) or it is unknown (a page from disk written by an earlier process).
      uint64_t serial = tier_->serial(slot);
      if (serial == 0 || by_serial_.count(serial)) {
        serial = next_serial_++;
        tier_->set_serial(slot, serial);
      }
      Block& r = blocks_[size_t(*fresh)];
      r.serial = serial;
      r.parent_serial = parent;
      r.key = key;
      r.chain = chain;
      std::ranges::copy(page, tokens_.begin() + ptrdiff_t(size_t(*fresh) * bs));
      index_.emplace(key, *fresh);
      by_serial_.emplace(serial, *fresh);
      pending_.push_back({*fresh, slot});
      found = *fresh;  // referenced once, by allocate()
    } else if (found < 0) {
      break;
    } else if (blocks_[size_t(found)].refs++ == 0) {
      queue_remove(found);
    }
    const Block& b = blocks_[size_t(found)];
    pages.push_back(found);
    serials.push_back(b.serial);
    hits_ += bs;
    parent = b.serial;
    ++matched;
  }
  return matched;
}

size_t BlockManager::fetch_prefix(std::span<const TokenId> tokens, std::vector<PageHash>& chains, size_t* started,
                                  const std::function<void(int, std::vector<int>&)>& exact_read) {
  if (started) *started = 0;
  if (!caching_ || !tier_ || !tier_->disk()) return 0;
  const size_t bs = size_t(block_size_);
  const size_t full = tokens.size() / bs;
  uint64_t parent = 0;
  std::vector<BlockId> pool;  // the pool's pages
  while (pool.size() < full) {
    const auto page = tokens.subspan(pool.size() * bs, bs);
    const BlockId found = find_cached(parent, key_of(parent, page), page);
    if (found < 0) break;
    parent = blocks_[size_t(found)].serial;
    pool.push_back(found);
  }
  const size_t i = pool.size();
  size_t n = 0;  // then the run the tiers hold
  while (i + n < full && n < tier_->max_fetch() && tier_->holds(chain_at(tokens, chains, i + n))) ++n;
  size_t loading = n == 0 ? 0 : tier_->fetch(std::span(chains).subspan(i, n), tokens.subspan(i * bs, n * bs), started);
  // The exact copies that hit reads, where only the exact pages' disk tier has them.
  if (exact_read && exact_tier_ && exact_tier_->disk() && i + n > 0) {
    std::vector<int> read;
    exact_read(int(i + n), read);
    std::vector<PageHash> want;
    std::vector<TokenId> want_tokens;
    for (int p : read) {
      if (p < 0 || size_t(p) >= i + n || (size_t(p) < i && exact_of_[size_t(pool[size_t(p)])] >= 0)) continue;
      want.push_back(chain_at(tokens, chains, size_t(p), size_t(p) < i ? pool[size_t(p)] : -1));
      const auto page = tokens.subspan(size_t(p) * bs, bs);
      want_tokens.insert(want_tokens.end(), page.begin(), page.end());
    }
    size_t exact_started = 0;
    if (!want.empty()) loading += exact_tier_->fetch(want, want_tokens, &exact_started);
    if (started) *started += exact_started;
  }
  return loading;
}

void BlockManager::offload_cached() {
  if (!tier_) return;
  auto keep = [&](BlockId id) {
    const Block& b = blocks_[size_t(id)];
    if (b.serial == 0) return;
    const auto tokens = std::span(tokens_).subspan(size_t(id) * size_t(block_size_), size_t(block_size_));
    tier_->keep(id, b.serial, b.chain, tokens);
    if (exact_tier_ && exact_of_[size_t(id)] >= 0 && !b.exact_stale)
      exact_tier_->keep(exact_of_[size_t(id)], b.serial, b.chain, tokens);
  };
  for (BlockId id = head_; id >= 0; id = blocks_[size_t(id)].next) keep(id);  // free pages, least recent first
  for (BlockId id = 0; id < num_blocks_; ++id)
    if (blocks_[size_t(id)].refs > 0) keep(id);  // then the pages in use
}

void BlockManager::commit_restores() {
  if (pending_.empty()) return;
  std::vector<BlockId> ids;
  std::vector<int> slots;
  for (const auto& [id, slot] : pending_) {
    if (blocks_[size_t(id)].refs > 0) {
      ids.push_back(id);
      slots.push_back(slot);
      continue;
    }
    // Dropped by the caller before its contents arrived: forget its identity (the entry
    // stays in the tier; so does an exact copy restored for it) and hand the page out first.
    tier_->unpin(slot);
    detach_exact(id);
    uncache(id);
    queue_remove(id);
    queue_push_front(id);
  }
  pending_.clear();
  tier_->restore(slots, ids);
  tier_hits_ += ids.size() * size_t(block_size_);
}

uint64_t BlockManager::register_full(BlockId id, uint64_t parent_serial, std::span<const TokenId> tokens,
                                     const PageHash& chain) {
  KVLM_CHECK(id >= 0 && id < num_blocks_ && tokens.size() == size_t(block_size_), "register_full: bad page");
  if (!caching_) return 0;
  Block& b = blocks_[size_t(id)];
  KVLM_CHECK(b.refs > 0, "register_full of an unreferenced page");
  if (b.serial != 0) return b.serial;  // registered already (a page reused from the cache)
  const uint64_t key = key_of(parent_serial, tokens);
  auto [lo, hi] = index_.equal_range(key);
  for (auto it = lo; it != hi; ++it) {
    const Block& o = blocks_[size_t(it->second)];
    if (o.parent_serial == parent_serial && same_tokens(it->second, tokens)) return o.serial;
  }
  b.serial = next_serial_++;
  b.parent_serial = parent_serial;
  b.key = key;
  b.chain = chain;
  std::copy(tokens.begin(), tokens.end(), tokens_.begin() + ptrdiff_t(size_t(id) * size_t(block_size_)));
  index_.emplace(key, id);
  if (tier_) by_serial_.emplace(b.serial, id);
  return b.serial;
}

}  // namespace kvlm

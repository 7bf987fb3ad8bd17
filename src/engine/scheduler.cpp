#include "engine/scheduler.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <optional>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "core/log.h"
#include "model/model_runner.h"

namespace kvlm {

namespace {
int pages_for(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& cfg, int block_size, ModelRunner& runner, EngineStats& stats)
    : cfg_(cfg),
      sink_pages_(cfg.num_exact_pages > 0 ? pages_for(cfg.keep_sink, block_size) : 0),
      snapshots_(cfg.max_num_seqs, std::max(cfg.state_snapshots, 0)),
      costs_(block_size),
      blocks_(cfg.num_blocks, block_size, cfg.enable_prefix_caching, cfg.num_exact_pages),
      runner_(runner),
      stats_(stats) {
  for (int i = cfg.max_num_seqs; i-- > 0;) free_state_slots_.push_back(i);
  KVLM_CHECK(cfg.num_exact_pages == 0 || cfg.keep_sink > 0 || cfg.keep_recent > 0, "exact pages without exact tokens");
  if (cfg.kv_offload_pages > 0 && cfg.enable_prefix_caching) {
    const PageHash root = kv_root(cfg.kv_identity);
    std::unique_ptr<DiskKVTier> disk;
    if (!cfg.kv_offload_dir.empty())
      disk = std::make_unique<DiskKVTier>(cfg.kv_offload_dir, cfg.kv_offload_disk_bytes, root, cfg.kv_identity,
                                          runner.kv_page_bytes(block_size), block_size);
    tier_ = std::make_unique<HostKVTier>(runner, block_size, size_t(cfg.kv_offload_pages), std::move(disk));
    if (cfg.kv_offload_exact_pages > 0 && cfg.num_exact_pages > 0) {
      // Exact pages on disk live under a root of their own (another directory, another lock).
      const std::string identity = cfg.kv_identity + "\nexact sink / recent pages";
      std::unique_ptr<DiskKVTier> exact_disk;
      if (!cfg.kv_offload_dir.empty() && cfg.kv_offload_exact_disk_bytes > 0)
        exact_disk = std::make_unique<DiskKVTier>(cfg.kv_offload_dir, cfg.kv_offload_exact_disk_bytes, kv_root(identity),
                                                  identity, runner.kv_page_bytes(block_size, PageKind::Exact),
                                                  block_size);
      exact_tier_ = std::make_unique<HostKVTier>(runner, block_size, size_t(cfg.kv_offload_exact_pages),
                                                 std::move(exact_disk), PageKind::Exact);
    }
    blocks_.set_lower_tier(tier_.get(), root, exact_tier_.get());
  }
}

Scheduler::~Scheduler() {
  if (!tier_ || !tier_->disk()) return;
  try {
    blocks_.offload_cached();  // the host tier's destructor writes them to disk
  } catch (const std::exception& e) {
    log::warn(std::string("prefix cache: pages not written to the disk tier at shutdown: ") + e.what());
  }
}

int Scheduler::window_page(int next) const {
  if (cfg_.keep_recent <= 0) return std::numeric_limits<int>::max();
  return std::max(0, next - cfg_.keep_recent + 1) / blocks_.block_size();
}

void Scheduler::exact_pages_read(int found, int total, std::vector<int>& pages) const {
  const int sinks = std::min(found, sink_pages_);
  for (int i = 0; i < sinks; ++i) pages.push_back(i);
  for (int i = std::max(sinks, std::min(found, window_page(std::min(found * blocks_.block_size(), total - 1)))); i < found; ++i)
    pages.push_back(i);
}

void Scheduler::drop_exact_at(Sequence& s, size_t page) {
  if (holds_exact(s, int(page))) blocks_.drop_exact(s.pages[page]);
}

void Scheduler::advance_exact(Sequence& s) {
  if (!keeps_exact()) return;
  const int from = std::max(s.exact_from, window_page(s.num_computed));
  for (int i = std::max(sink_pages_, s.exact_from); i < std::min(from, int(s.pages.size())); ++i)
    blocks_.drop_exact(s.pages[size_t(i)]);
  s.exact_from = from;
  // The copies a later hit is likely to read exact are its sinks, and the windows before the
  // two page boundaries hits end on most — the last full page of the prompt (the same prompt
  // again) and of everything computed (the next turn of a conversation). The pages behind both
  // are marked stale: the pool takes their idle copies back first, and the exact tier does not
  // keep them.
  const int bs = blocks_.block_size();
  const int stale = std::min({window_page(s.num_computed / bs * bs), from, int(s.pages.size())});
  const int prompt_end = std::min(s.num_prompt, s.num_computed) / bs;
  // A hit on the whole prompt again runs its last token: its query is at num_prompt - 1.
  const int prompt_window = window_page(std::min(prompt_end * bs, s.num_prompt - 1));
  for (int i = std::max(sink_pages_, s.exact_stale_from); i < stale; ++i)
    if (i < prompt_window || i >= prompt_end) blocks_.mark_exact_stale(s.pages[size_t(i)]);
  s.exact_stale_from = std::max(s.exact_stale_from, stale);
}

int Scheduler::num_running() const {
  return int(std::ranges::count_if(running_, [](const auto& s) { return !s->finished; }));
}
int Scheduler::num_waiting() const {
  return int(std::ranges::count_if(waiting_, [](const auto& s) { return !s->finished; }));
}

void Scheduler::drop_finished() {
  auto gone = [](const std::unique_ptr<Sequence>& s) { return s->finished; };
  std::erase_if(running_, gone);
  std::erase_if(waiting_, gone);
}

bool Scheduler::ensure_pages(Sequence& s, int tokens) {
  const int need = pages_for(tokens, blocks_.block_size()) - int(s.pages.size());
  if (need <= 0) return true;
  if (need > blocks_.num_free()) return false;
  if (s.pages.empty()) s.exact_from = window_page(s.num_computed);
  const int first = int(s.pages.size());
  if (keeps_exact()) {
    int exact = 0;
    for (int i = first; i < first + need; ++i) exact += holds_exact(s, i) ? 1 : 0;
    if (exact > blocks_.num_exact_available()) return false;
  }
  for (int i = first; i < first + need; ++i) {
    auto b = blocks_.allocate();
    KVLM_CHECK(b.has_value(), "free page count and allocation disagree");
    s.pages.push_back(*b);
    if (holds_exact(s, i)) blocks_.hold_exact(*b, /*fresh=*/true);
  }
  return true;
}

void Scheduler::release_pages(Sequence& s) {
  for (size_t i = s.pages.size(); i-- > 0;) drop_exact_at(s, i);
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) blocks_.release(*it);
  s.pages.clear();
  s.serials.clear();
  s.num_computed = 0;
  if (s.state_slot >= 0) free_state_slots_.push_back(s.state_slot);
  s.state_slot = -1;
  s.snapshot_at = -1;
  s.exact_from = window_page(0);
  s.exact_stale_from = 0;
}

bool Scheduler::takes_prefix(const Sequence& s) const {
  // Rows whose outputs are wanted must be computed; a hit can serve every prompt token but
  // the last (match_prefix leaves it), so a request that wants only the last row still hits.
  const bool rows_wanted = s.prompt_rows_end() > s.prompt_rows_begin() && s.prompt_rows_begin() < s.num_prompt - 1;
  return blocks_.prefix_caching() && !rows_wanted && s.pages.empty();
}

bool Scheduler::restoring(Sequence& s) {
  if (!tier_ || !tier_->disk() || !takes_prefix(s)) return false;
  size_t started = 0;
  const int total = int(s.tokens.size());
  const bool reading =
      blocks_.fetch_prefix(s.tokens, s.chains, &started,
                           keeps_exact() ? [&](int found, std::vector<int>& pages) { exact_pages_read(found, total, pages); }
                                         : std::function<void(int, std::vector<int>&)>{}) > 0;
  // Its pages land in the host tier unpinned: under enough churn they are replaced before it is
  // admitted and read again. After a few rounds it waits for them in admission instead.
  constexpr int kMaxRestoreRounds = 3;
  if (started > 0 && ++s.restore_rounds > kMaxRestoreRounds) {
    s.restoring = false;
    return false;
  }
  if (reading && !s.restoring) ++stats_.kv_offload_disk_restoring_total;
  s.restoring = reading;
  return reading;
}

// A sequence about to be scheduled for the first time (or again after preemption) takes
// the pages the prefix cache holds for its leading tokens.
void Scheduler::admit_prefix(Sequence& s) {
  if (!takes_prefix(s)) return;
  const int bs = blocks_.block_size();
  const int total = int(s.tokens.size());
  // s.chains: its pages' chain hashes, kept (they depend on tokens alone) and extended here.
  int found = blocks_.match_prefix(s.tokens, s.pages, s.serials, &s.chains);
  auto drop_last = [&] {
    blocks_.release(s.pages.back());
    s.pages.pop_back();
    s.serials.pop_back();
    --found;
  };
  // With exact tokens, a hit ends where a page the next query reads exact (its sinks, its
  // recent window) has lost its exact copy and the exact tier has none to give back: those
  // tokens are computed again instead.
  auto settle = [&] {
    if (!keeps_exact()) return;
    std::vector<int> read;
    std::vector<BlockId> needed;  // the pages this hit reads exact: their idle copies are not taken back
    for (;;) {
      read.clear();
      exact_pages_read(found, total, read);
      needed.clear();
      for (int i : read) needed.push_back(s.pages[size_t(i)]);
      // Every one has its copy or the exact tier holds one, before any is taken back: a copy
      // taken back for a hit that then ends short would be lost for nothing.
      bool ok = std::ranges::all_of(needed, [&](BlockId id) { return blocks_.exact_restorable(id); });
      ok = ok && blocks_.restore_exact(needed);
      if (ok || found == 0) return;
      drop_last();
    }
  };
  settle();
  // A hybrid model resumes only where a snapshot of its recurrent state was kept, and short of
  // the last token (whose row must run, and the state after it is not kept).
  while (snapshots_on() && found > 0 && (found * bs >= total || !snapshots_.contains(s.serials[size_t(found - 1)]))) {
    drop_last();
    settle();
  }
  blocks_.commit_restores();  // the host tier's pages of the hit that are kept, in one batch
  if (found == 0) return;
  // Hold the pages the next query reads exact now, before a copy-on-write page is allocated:
  // the exact page taken back for the copy must not be one of theirs.
  auto hold_needed = [&](int next) {
    s.exact_from = window_page(next);
    for (size_t i = 0; i < s.pages.size(); ++i)
      if (holds_exact(s, int(i))) blocks_.hold_exact(s.pages[i], /*fresh=*/false);
  };
  hold_needed(std::min(found * bs, total - 1));
  int computed = found * bs;
  if (computed >= total) {
    // Every token is cached, but the last one must run to give the next token's logits and
    // will write its K/V into the last page, which other sequences share: copy that page
    // first (copy-on-write) and recompute only the last token into the copy.
    const bool fresh_exact = holds_exact(s, int(s.pages.size()) - 1);  // the copy is read exact too
    std::optional<BlockId> fresh;
    if (!fresh_exact || blocks_.num_exact_available() > 0) fresh = blocks_.allocate();
    if (fresh) {
      PageCopy cow{.src = s.pages.back(), .dst = *fresh};
      if (fresh_exact) {
        blocks_.hold_exact(*fresh, /*fresh=*/true);
        cow.exact_src = blocks_.exact_of(cow.src);
        cow.exact_dst = blocks_.exact_of(*fresh);
      }
      runner_.copy_blocks({&cow, 1});
      if (fresh_exact) blocks_.drop_exact(cow.src);  // its hold passed to the copy
      blocks_.release(s.pages.back());
      s.pages.back() = *fresh;
      s.serials.pop_back();
    } else {  // no page to copy into: recompute the whole last page instead
      for (size_t i = s.pages.size(); i-- > 0;) drop_exact_at(s, i);
      drop_last();
      settle();
      if (found == 0) return;
      hold_needed(found * bs);
    }
    computed = std::min(total - 1, int(s.pages.size()) * bs);
  }
  s.num_computed = computed;
  KVLM_CHECK(!keeps_exact() || s.exact_from == window_page(computed), "exact holds taken for another position");
  if (!s.started) s.cached_prompt_tokens = std::min(computed, s.num_prompt);
}

namespace {
// The request a sequence belongs to, for fairness: its group (the n sequences of one API
// request) or, alone, its id.
std::string_view group_of(const Sequence& s) { return s.req.group.empty() ? s.req.id : s.req.group; }
}  // namespace

Scheduler::GroupCounts Scheduler::running_per_group() const {
  GroupCounts running;
  for (const auto& r : running_) ++running[group_of(*r)];
  return running;
}

bool Scheduler::make_room(GroupCounts& running) {
  // A request with nothing running while the running set is full: the newest sequence of the
  // request with the most running makes room (preempted; its pages stay in the prefix cache),
  // so that one request of hundreds of sequences cannot hold everyone else out until it ends.
  const bool starved =
      std::any_of(waiting_.begin(), waiting_.end(), [&](const auto& w) { return !w->finished && !running.count(group_of(*w)); });
  if (!starved) return false;
  const auto most = std::max_element(running.begin(), running.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  if (most == running.end() || most->second < 2) return false;
  for (size_t i = running_.size(); i-- > 0;) {
    if (group_of(*running_[i]) != most->first) continue;
    std::unique_ptr<Sequence> victim = std::move(running_[i]);
    running_.erase(running_.begin() + long(i));
    --most->second;
    preempt(*victim);
    waiting_.push_back(std::move(victim));  // behind the request it made room for
    return true;
  }
  return false;
}

size_t Scheduler::next_waiting(const GroupCounts& running) const {
  if (waiting_.size() < 2) return 0;
  // Priority: only the sequences of the best (lowest) priority value compete below.
  int best_priority = INT32_MAX;
  if (cfg_.priority)
    for (const auto& w : waiting_) best_priority = std::min(best_priority, w->req.priority);
  const auto eligible = [&](const Sequence& s) { return !cfg_.priority || s.req.priority == best_priority; };
  // The usual case, one group waiting, costs one pass.
  const std::string_view g0 = group_of(*waiting_.front());
  if (!cfg_.priority && std::all_of(waiting_.begin() + 1, waiting_.end(), [&](const auto& w) { return group_of(*w) == g0; }))
    return 0;
  size_t best = 0;
  int best_running = INT32_MAX;
  for (size_t i = 0; i < waiting_.size() && best_running > 0; ++i) {
    if (!eligible(*waiting_[i])) continue;
    const auto it = running.find(group_of(*waiting_[i]));
    const int n = it == running.end() ? 0 : it->second;
    if (n < best_running) best = i, best_running = n;
  }
  return best;
}

void Scheduler::admit_state(Sequence& s) {
  if (!snapshots_on()) return;
  const int bs = blocks_.block_size();
  if (s.num_computed > 0) {  // a prefix hit: the state where it ends (admit_prefix checked it is kept)
    KVLM_CHECK(s.num_computed % bs == 0, "a hybrid model's prefix hit ends inside a page");
    const StateCopy c{.src = snapshots_.find(s.serials[size_t(s.num_computed / bs - 1)]), .dst = s.state_slot};
    KVLM_CHECK(c.src >= 0, "a prefix hit without its state snapshot");
    runner_.copy_states({&c, 1});
  }
}

void Scheduler::save_draft_states(std::span<Sequence* const> seqs) {
  if (!rewinds_drafts()) return;
  std::vector<StateCopy> copies;
  for (const Sequence* s : seqs)
    if (!s->draft.empty() && s->state_slot >= 0)
      copies.push_back({.src = s->state_slot, .dst = draft_slot(s->state_slot)});
  if (!copies.empty()) runner_.copy_states(copies);
}

void Scheduler::rewind_draft(Sequence& s, int before) {
  KVLM_CHECK(rewinds_drafts() && s.state_slot >= 0 && before <= s.num_computed, "rewind_draft without a saved state");
  const StateCopy c{.src = draft_slot(s.state_slot), .dst = s.state_slot};
  runner_.copy_states({&c, 1});
  s.num_computed = before;
  ++stats_.spec_state_rewinds_total;
}

void Scheduler::preempt(Sequence& s) {
  release_pages(s);
  s.draft.clear();
  // A token still to draw is drawn again from the recomputed logits.
  s.deferred = false;
  s.deferred_row = {};
  if (!s.prompt_lp_sent) s.prompt_lp.clear();
  ++stats_.preemptions_total;
}

void Scheduler::trim_pages(Sequence& s) {
  const size_t keep = size_t(pages_for(int(s.tokens.size()), blocks_.block_size()));
  while (s.pages.size() > keep) {
    drop_exact_at(s, s.pages.size() - 1);
    blocks_.release(s.pages.back());
    s.pages.pop_back();
  }
}

void Scheduler::register_full_pages(Sequence& s) {
  if (!blocks_.prefix_caching()) return;
  const int bs = blocks_.block_size();
  const int full = std::min(s.num_computed, int(s.tokens.size())) / bs;
  auto page_tokens = [&](size_t i) { return std::span(s.tokens).subspan(i * size_t(bs), size_t(bs)); };
  for (int i = int(s.serials.size()); i < full; ++i) {
    const uint64_t parent = i == 0 ? 0 : s.serials[size_t(i - 1)];
    if (tier_)
      for (size_t j = s.chains.size(); j <= size_t(i); ++j)
        s.chains.push_back(blocks_.chain_of(j == 0 ? nullptr : &s.chains[j - 1], page_tokens(j)));
    s.serials.push_back(blocks_.register_full(s.pages[size_t(i)], parent, page_tokens(size_t(i)),
                                              tier_ ? s.chains[size_t(i)] : PageHash{}));
  }
  if (s.snapshot_at < 0 || s.num_computed < s.snapshot_at) return;
  // The sequence's recurrent state is that of its first snapshot_at tokens (take() ended a
  // step there): keep a copy under the serial of the page it ends with, unless one is kept.
  KVLM_CHECK(s.num_computed == s.snapshot_at && s.state_slot >= 0, "a state snapshot point was stepped over");
  const uint64_t serial = s.serials[size_t(s.snapshot_at / bs - 1)];
  if (snapshots_.find(serial) < 0) {
    const StateCopy c{.src = s.state_slot, .dst = snapshots_.insert(serial)};
    runner_.copy_states({&c, 1});
  }
  s.snapshot_at = -1;
}

// The tiers' restores so far, in pages' worth of bytes (exact pages are larger), and whether
// each tier pays now.
void Scheduler::decide_tiers() {
  if (!tier_) return;
  const double page = double(tier_->page_bytes());
  double bytes = double(tier_->pages_restored()) * page;
  if (exact_tier_) bytes += double(exact_tier_->pages_restored()) * double(exact_tier_->page_bytes());
  copy_times_ = runner_.page_copy_times();
  costs_.note_restores(TierCosts::Tier::Host, copy_times_.load_seconds, uint64_t(bytes / page));
  if (const DiskKVTier* d = tier_->disk()) {  // the exact pages' reads too, in pages' worth of bytes
    tier_->poll(false);  // reads done land, whichever tiers are in use
    double seconds = d->read_seconds(), pages = double(d->pages_read());
    if (const DiskKVTier* x = exact_tier_ ? exact_tier_->disk() : nullptr) {
      seconds += x->read_seconds();
      pages += double(x->pages_read()) * double(exact_tier_->page_bytes()) / page;
    }
    costs_.note_restores(TierCosts::Tier::Disk, seconds, uint64_t(pages));
  }
  use_ = costs_.decide();
  tier_->set_use(use_.host, use_.disk);
  // Exact copies come from host memory whatever it costs (without them the hit ends), but are
  // read from disk only while the disk pays.
  if (exact_tier_) exact_tier_->set_use(true, use_.disk);
}

std::vector<Sequence*> Scheduler::schedule() {
  decide_tiers();
  int budget = cfg_.max_num_batched_tokens;
  std::vector<Sequence*> batch;
  // The rows a sequence runs now: what is pending, within the budget; a draft that does not
  // fit is shortened rather than left to split the verification over two steps.
  auto take = [&](Sequence& s) {
    int n = std::min(s.num_pending(), budget);
    if (s.snapshot_at > s.num_computed) n = std::min(n, s.snapshot_at - s.num_computed);  // end the step there
    if (s.req.prompt_logits && s.req.prompt_logits_step > 0) {  // scored rows a few at a time
      const int from = s.req.prompt_logits_from;
      n = s.num_computed >= from ? std::min(n, s.req.prompt_logits_step) : std::min(n, from - s.num_computed);
    }
    const int uncomputed = int(s.tokens.size()) - s.num_computed;
    if (n < s.num_pending()) s.draft.resize(size_t(std::max(0, n - uncomputed)));
    return n;
  };
  bool preempted = false;
  // Running sequences per request, for fair admission; kept true until anything is
  // preempted below, after which nobody is admitted this step.
  GroupCounts running = waiting_.empty() ? GroupCounts{} : running_per_group();
  if (int(running_.size()) >= cfg_.max_num_seqs && !waiting_.empty()) preempted = make_room(running);
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    if (s.deferred) {  // its token waits for its grammar mask: nothing to run yet
      ++i;
      continue;
    }
    int n = take(s);
    bool dropped = false;
    while (!ensure_pages(s, s.num_computed + n)) {
      // A draft is a bet, not a need: give it up before preempting anyone.
      if (!s.draft.empty()) {
        s.draft.clear();
        n = std::min(n, s.num_pending());
        continue;
      }
      // Preempt the newest running sequence (possibly this one) and retry.
      std::unique_ptr<Sequence> victim = std::move(running_.back());
      running_.pop_back();
      preempt(*victim);
      preempted = true;
      const bool self = victim.get() == &s;
      waiting_.push_front(std::move(victim));
      if (self) {
        dropped = true;
        break;
      }
    }
    if (dropped) break;  // it was the newest: nothing after it to schedule
    s.scheduled = n;
    budget -= n;
    batch.push_back(&s);
    ++i;
  }
  // Sequences whose prefix is being read from disk, set aside while the others are admitted
  // (with --scheduling-policy priority, only those of their priority or better).
  std::vector<std::unique_ptr<Sequence>> restoring_now;
  int aside_priority = INT32_MAX;
  const auto admit = [&](bool may_set_aside) {
    while (!preempted && budget > 0 && !waiting_.empty() && int(running_.size()) < cfg_.max_num_seqs) {
      // Fair between requests: the next is the oldest waiting sequence of the group with the
      // fewest running (one request of 8 prompts x n = 128 would otherwise queue everyone
      // behind its 1,024 sequences).
      const size_t pick = next_waiting(running);
      if (pick) std::rotate(waiting_.begin(), waiting_.begin() + long(pick), waiting_.begin() + long(pick) + 1);
      Sequence& s = *waiting_.front();
      if (cfg_.priority && s.req.priority > aside_priority) break;  // a better one waits for its pages
      if (may_set_aside && restoring(s)) {
        aside_priority = std::min(aside_priority, s.req.priority);
        restoring_now.push_back(std::move(waiting_.front()));
        waiting_.pop_front();
        continue;
      }
      s.restoring = false;
      s.restore_rounds = 0;
      s.draft.clear();  // drafts are proposed for running sequences only
      admit_prefix(s);
      // A hybrid model's state is kept where the sequence's last full page ends: the furthest a
      // later hit on these tokens (or on a prompt that extends them) can resume from.
      const int snap = (int(s.tokens.size()) - 1) / blocks_.block_size() * blocks_.block_size();
      s.snapshot_at = snapshots_on() && snap > s.num_computed ? snap : -1;
      const int n = take(s);
      if (!ensure_pages(s, s.num_computed + n)) {
        release_pages(s);  // do not sit on cached pages while waiting (they stay cached)
        break;             // first come, first served: nobody overtakes the head (but a restoring one)
      }
      if (!s.started) {
        s.started = true;
        stats_.prompt_tokens_total += uint64_t(s.num_prompt - s.cached_prompt_tokens);
        stats_.prefix_cache_queries_total += uint64_t(s.num_prompt);
        stats_.prefix_cache_hits_total += uint64_t(s.cached_prompt_tokens);
      } else {  // resumed after preemption: what was not found cached is computed again
        stats_.recomputed_tokens_total += uint64_t(int(s.tokens.size()) - s.num_computed);
      }
      KVLM_CHECK(!free_state_slots_.empty(), "more running sequences than --max-num-seqs state slots");
      s.state_slot = free_state_slots_.back();
      free_state_slots_.pop_back();
      admit_state(s);
      s.scheduled = n;
      budget -= n;
      batch.push_back(&s);
      ++running[group_of(s)];
      if (cfg_.priority) {  // after every sequence of its priority or better: the back is the first to go
        const auto at = std::upper_bound(running_.begin(), running_.end(), s.req.priority,
                                         [](int p, const auto& r) { return p < r->req.priority; });
        running_.insert(at, std::move(waiting_.front()));
      } else {
        running_.push_back(std::move(waiting_.front()));
      }
      waiting_.pop_front();
    }
  };
  // Back at the head, in their order: admitted first once their pages are here.
  const auto put_back = [&] {
    for (auto it = restoring_now.rbegin(); it != restoring_now.rend(); ++it) waiting_.push_front(std::move(*it));
    restoring_now.clear();
  };
  try {
    admit(/*may_set_aside=*/true);
  } catch (...) {
    put_back();  // not lost with the step
    throw;
  }
  restoring_ = int(restoring_now.size());
  if (!restoring_now.empty()) {
    put_back();
    if (batch.empty()) {  // nothing else to run: wait for the reads here
      tier_->wait_reads();
      aside_priority = INT32_MAX;
      restoring_ = 0;
      admit(/*may_set_aside=*/false);
    }
  }
  return batch;
}

}  // namespace kvlm

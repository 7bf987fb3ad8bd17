#include "engine/scheduler.h"

#include <algorithm>

#include "core/error.h"
#include "model/model_runner.h"

namespace kvlm {

namespace {
int pages_for(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }
}  // namespace

Scheduler::Scheduler(const SchedulerConfig& cfg, int block_size, ModelRunner& runner, EngineStats& stats)
    : cfg_(cfg), blocks_(cfg.num_blocks, block_size, cfg.enable_prefix_caching), runner_(runner), stats_(stats) {}

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
  for (int i = 0; i < need; ++i) {
    auto b = blocks_.allocate();
    KVLM_CHECK(b.has_value(), "free page count and allocation disagree");
    s.pages.push_back(*b);
  }
  return true;
}

void Scheduler::release_pages(Sequence& s) {
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) blocks_.release(*it);
  s.pages.clear();
  s.serials.clear();
  s.num_computed = 0;
}

// A sequence about to be scheduled for the first time (or again after preemption) takes
// the pages the prefix cache holds for its leading tokens.
void Scheduler::admit_prefix(Sequence& s) {
  if (!blocks_.prefix_caching() || s.prompt_rows_end() > s.prompt_rows_begin() || !s.pages.empty()) return;
  const int bs = blocks_.block_size();
  const int found = blocks_.match_prefix(s.tokens, s.pages, s.serials);
  if (found == 0) return;
  int computed = found * bs;
  const int total = int(s.tokens.size());
  if (computed >= total) {
    // Every token is cached, but the last one must run to give the next token's logits and
    // will write its K/V into the last page, which other sequences share: copy that page
    // first (copy-on-write) and recompute only the last token into the copy.
    if (auto fresh = blocks_.allocate()) {
      const std::pair<BlockId, BlockId> cow{s.pages.back(), *fresh};
      runner_.copy_blocks({&cow, 1});
      blocks_.release(s.pages.back());
      s.pages.back() = *fresh;
    } else {  // no page to copy into: recompute the whole last page instead
      blocks_.release(s.pages.back());
      s.pages.pop_back();
    }
    s.serials.pop_back();
    computed = std::min(total - 1, int(s.pages.size()) * bs);
  }
  s.num_computed = computed;
  if (!s.started) s.cached_prompt_tokens = std::min(computed, s.num_prompt);
}

void Scheduler::preempt(Sequence& s) {
  release_pages(s);
  s.draft.clear();
  if (!s.prompt_lp_sent) s.prompt_lp.clear();
  ++stats_.preemptions_total;
}

void Scheduler::trim_pages(Sequence& s) {
  const size_t keep = size_t(pages_for(int(s.tokens.size()), blocks_.block_size()));
  while (s.pages.size() > keep) {
    blocks_.release(s.pages.back());
    s.pages.pop_back();
  }
}

void Scheduler::register_full_pages(Sequence& s) {
  if (!blocks_.prefix_caching()) return;
  const int bs = blocks_.block_size();
  const int full = std::min(s.num_computed, int(s.tokens.size())) / bs;
  for (int i = int(s.serials.size()); i < full; ++i) {
    const uint64_t parent = i == 0 ? 0 : s.serials[size_t(i - 1)];
    s.serials.push_back(
        blocks_.register_full(s.pages[size_t(i)], parent, std::span(s.tokens).subspan(size_t(i) * size_t(bs), size_t(bs))));
  }
}

std::vector<Sequence*> Scheduler::schedule() {
  int budget = cfg_.max_num_batched_tokens;
  std::vector<Sequence*> batch;
  // The rows a sequence runs now: what is pending, within the budget; a draft that does not
  // fit is shortened rather than left to split the verification over two steps.
  auto take = [&](Sequence& s) {
    const int n = std::min(s.num_pending(), budget);
    const int uncomputed = int(s.tokens.size()) - s.num_computed;
    if (n < s.num_pending()) s.draft.resize(size_t(std::max(0, n - uncomputed)));
    return n;
  };
  bool preempted = false;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
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
  while (!preempted && budget > 0 && !waiting_.empty() && int(running_.size()) < cfg_.max_num_seqs) {
    Sequence& s = *waiting_.front();
    s.draft.clear();  // drafts are proposed for running sequences only
    admit_prefix(s);
    const int n = take(s);
    if (!ensure_pages(s, s.num_computed + n)) {
      release_pages(s);  // do not sit on cached pages while waiting (they stay cached)
      break;             // first come, first served: nobody overtakes the head
    }
    if (!s.started) {
      s.started = true;
      stats_.prompt_tokens_total += uint64_t(s.num_prompt - s.cached_prompt_tokens);
      stats_.prefix_cache_queries_total += uint64_t(s.num_prompt);
      stats_.prefix_cache_hits_total += uint64_t(s.cached_prompt_tokens);
    }
    s.scheduled = n;
    budget -= n;
    batch.push_back(&s);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  return batch;
}

}  // namespace kvlm

// The serving engine's scheduler: which sequences run in a step and with how many query
// rows, and the KV pages they own (vLLM v1's unified schedule).
//
//   1. running sequences first, oldest first: each gets its pending rows (one for decode,
//      1 + its draft when speculating, a chunk for an unfinished prefill) within
//      --max-num-batched-tokens; when a page cannot be had, the newest running sequence is
//      preempted (its pages released, its tokens kept, recomputed later — with the prefix
//      cache, mostly from cache);
//   2. then waiting sequences, first come first served, while tokens, pages and
//      --max-num-seqs allow; a new sequence first takes what the prefix cache holds.
#pragma once

#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "engine/block_manager.h"
#include "engine/metrics.h"
#include "engine/sequence.h"

namespace kvlm {

class ModelRunner;

struct SchedulerConfig {
  int max_num_seqs = 256;              // sequences in one step
  int max_num_batched_tokens = 2048;   // tokens in one step (prefill chunks + decodes + drafts)
  int max_model_len = 0;               // prompt + output limit; 0 = the model's context
  bool enable_prefix_caching = true;
  int num_blocks = 0;                  // KV pool pages (see memory_plan.h)
};

class Scheduler {
 public:
  // `runner` copies pages for copy-on-write; `stats` receives the scheduling counters.
  Scheduler(const SchedulerConfig& cfg, int block_size, ModelRunner& runner, EngineStats& stats);

  void add(std::unique_ptr<Sequence> s) { waiting_.push_back(std::move(s)); }
  // The sequences of this step, each with `scheduled` set (a draft the budget cannot hold
  // is shortened). Empty when nothing can run.
  std::vector<Sequence*> schedule();
  // Forgets finished sequences (their pages were released by release_pages).
  void drop_finished();
  bool empty() const { return running_.empty() && waiting_.empty(); }
  int num_running() const;
  int num_waiting() const;
  const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }

  // Drops every page of `s` (last pages first, so its tail is evicted before its more
  // shareable head); its K/V must be recomputed if it runs again.
  void release_pages(Sequence& s);
  // Pages for the first `positions` positions of `s`; false (nothing taken) when the pool
  // cannot give them without preempting.
  bool reserve(Sequence& s, int positions) { return ensure_pages(s, positions); }
  // Returns the pages past those `s` needs for its tokens (a rejected draft's tail).
  void trim_pages(Sequence& s);
  // Registers the pages `s` has filled with computed tokens in the prefix cache.
  void register_full_pages(Sequence& s);
  const BlockManager& blocks() const { return blocks_; }

 private:
  bool ensure_pages(Sequence& s, int tokens);  // pages for `tokens` positions
  void admit_prefix(Sequence& s);
  void preempt(Sequence& s);

  SchedulerConfig cfg_;
  BlockManager blocks_;
  ModelRunner& runner_;
  EngineStats& stats_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order (oldest first)
};

}  // namespace kvlm

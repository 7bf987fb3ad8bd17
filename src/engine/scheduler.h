// The serving engine's scheduler: which sequences run in a step and with how many query
// rows, and the KV pages they own (vLLM v1's unified schedule).
//
//   1. running sequences first, oldest first: each gets its pending rows (one for decode,
//      1 + its draft when speculating, a chunk for an unfinished prefill) within
//      --max-num-batched-tokens; when a page cannot be had, the newest running sequence is
//      preempted (its pages released, its tokens kept, recomputed later — with the prefix
//      cache, mostly from cache);
//   2. then waiting sequences, first come first served, while tokens, pages and
//      --max-num-seqs allow; a new sequence first takes what the prefix cache holds. One
//      whose prefix is on disk (the prefix cache's disk tier) is "restoring": its pages are
//      read on the disk tier's threads while the sequences behind it are admitted, and it is
//      admitted, ahead of them again, once they are here (or at once when nothing else runs).
// With --scheduling-policy priority the running set is kept in (priority, admission) order
// and the waiting head is the lowest priority value: a request of a better priority is
// scheduled, and keeps its pages, before any of a worse one; the one preempted is the
// newest of the worst priority.
#pragma once

#include <algorithm>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/tier_costs.h"
#include "engine/block_manager.h"
#include "engine/host_kv_tier.h"
#include "engine/metrics.h"
#include "engine/sequence.h"
#include "engine/state_snapshots.h"

namespace kvlm {

class ModelRunner;

struct SchedulerConfig {
  int max_num_seqs = 256;              // sequences in one step
  int max_num_batched_tokens = 2048;   // tokens in one step (prefill chunks + decodes + drafts)
  int max_model_len = 0;               // prompt + output limit; 0 = the model's context
  bool enable_prefix_caching = true;
  int num_blocks = 0;                  // KV pool pages (see memory_plan.h)
  // Exact sink / recent tokens: set by LLMEngine from the model's KV plan (memory_plan.h's
  // exact_pages_needed sizes the exact pool); 0 = none.
  int keep_sink = 0;
  int keep_recent = 0;
  int num_exact_pages = 0;
  bool priority = false;  // --scheduling-policy priority (EngineRequest::priority); false: fcfs
  // Hybrid models with prefix caching: the recurrent-state snapshots that prefix hits resume
  // from (engine/state_snapshots.h), in runner slots max_num_seqs and up; -1 = one per
  // --max-num-seqs slot (MemoryPlan::state_snapshots), 0 = none, which turns prefix caching
  // off for them. LLMEngine resolves it (0 for models without recurrent layers).
  int state_snapshots = -1;
  // Hybrid models with drafting: a copy of each drafting sequence's state from before its
  // verification step, in runner slots max_num_seqs + state_snapshots and up, that a rejected
  // draft rolls back to. Set by LLMEngine: one per --max-num-seqs slot when the model drafts.
  int draft_states = 0;
  // The prefix cache's host tier (engine/host_kv_tier.h, --kv-offload-gib): pages of host
  // memory evicted cached pages go to; 0 = none. Needs prefix caching.
  int64_t kv_offload_pages = 0;
  // Its disk tier (engine/disk_kv_tier.h, --kv-offload-dir, --kv-offload-disk-gib): "" = none.
  std::string kv_offload_dir;
  uint64_t kv_offload_disk_bytes = 0;
  // With exact sink / recent tokens: a tier of exact pages beside them (the same HostKVTier,
  // PageKind::Exact; 0 = none) and its disk tier's bytes (0 = none).
  int64_t kv_offload_exact_pages = 0;
  uint64_t kv_offload_exact_disk_bytes = 0;
  // What the pages' bytes depend on (the model, its weights, the KV plan, the device: set by
  // LLMEngine), the root of the chain hashes that name pages in the tiers (page_hash.h).
  std::string kv_identity;
};

class Scheduler {
 public:
  // `runner` copies pages for copy-on-write; `stats` receives the scheduling counters.
  Scheduler(const SchedulerConfig& cfg, int block_size, ModelRunner& runner, EngineStats& stats);
  // With a disk tier, the cached pages go to it (through the host tier), for a restart.
  ~Scheduler();

  void add(std::unique_ptr<Sequence> s) { waiting_.push_back(std::move(s)); }
  // The sequences of this step, each with `scheduled` set (a draft the budget cannot hold
  // is shortened). Empty when nothing can run.
  std::vector<Sequence*> schedule();
  // Forgets finished sequences (their pages were released by release_pages).
  void drop_finished();
  bool empty() const { return running_.empty() && waiting_.empty(); }
  int num_running() const;
  int num_waiting() const;
  // Of the waiting, those the last schedule() set aside while their prefix was read from disk.
  int num_restoring() const { return restoring_; }
  const std::vector<std::unique_ptr<Sequence>>& running() const { return running_; }

  // Drops every page of `s` (last pages first, so its tail is evicted before its more
  // shareable head); its K/V must be recomputed if it runs again.
  void release_pages(Sequence& s);
  // Pages for the first `positions` positions of `s`; false (nothing taken) when the pool
  // cannot give them without preempting.
  bool reserve(Sequence& s, int positions) { return ensure_pages(s, positions); }
  // Returns the pages past those `s` needs for its tokens (a rejected draft's tail).
  void trim_pages(Sequence& s);
  // Registers the pages `s` has filled with computed tokens in the prefix cache, and, on a
  // hybrid model, snapshots its recurrent state when it has just reached its snapshot point.
  void register_full_pages(Sequence& s);
  const StateSnapshots& snapshots() const { return snapshots_; }
  const BlockManager& blocks() const { return blocks_; }
  const HostKVTier* host_tier() const { return tier_.get(); }
  const HostKVTier* exact_tier() const { return exact_tier_.get(); }
  // The lower tiers' costs against recomputing (tier_costs.h): fed the steps' times here
  // (LLMEngine::step) and the tiers' copy times by schedule(), which decides from them.
  void note_step(double seconds, int rows) { costs_.note_step(seconds, rows); }
  TierCosts& tier_costs() { return costs_; }
  const TierCosts& tier_costs() const { return costs_; }
  TierCosts::Use tiers_in_use() const { return use_; }
  // The runner's page copy times as the last schedule() began (with a lower tier).
  const ModelRunner::PageCopyTimes& copy_times() const { return copy_times_; }
  // After a step moved s.num_computed on: the pages that left every future query's recent
  // window give up their exact copies.
  void advance_exact(Sequence& s);
  // Hybrid models with drafting (cfg.draft_states): before a step, keeps the recurrent state of
  // every sequence in `seqs` that verifies a draft; after it, rewind_draft(s, before) puts back
  // the state of a sequence whose draft was not wholly accepted (its state went through the
  // rejected tokens) and sets s.num_computed to `before`, the step's start: the accepted tokens
  // are computed again in its next step, as a short prefill.
  bool rewinds_drafts() const { return cfg_.draft_states > 0; }
  void save_draft_states(std::span<Sequence* const> seqs);
  void rewind_draft(Sequence& s, int before);

 private:
  bool ensure_pages(Sequence& s, int tokens);  // pages for `tokens` positions
  // Running sequences per request (EngineRequest::group, else the id), keyed by views of
  // the sequences' own strings.
  using GroupCounts = std::unordered_map<std::string_view, int>;
  GroupCounts running_per_group() const;
  // The index in waiting_ of the sequence to admit next: the oldest of the request with the
  // fewest running.
  size_t next_waiting(const GroupCounts& running) const;
  // Preempts one sequence for a request that has none running while the running set is
  // full (see scheduler.cpp), updating `running`; true when it did.
  bool make_room(GroupCounts& running);
  // Whether `s`, about to be admitted, would start from the prefix cache.
  bool takes_prefix(const Sequence& s) const;
  // Whether `s` must wait for pages of its prefix the disk tier is reading (starting the reads
  // it needs): the scheduler admits others meanwhile.
  bool restoring(Sequence& s);
  void admit_prefix(Sequence& s);
  // Hybrid models: once `s` has its state slot, copies into it the snapshot its prefix hit
  // ends with (schedule() has set where its next snapshot is due).
  void admit_state(Sequence& s);
  bool snapshots_on() const { return snapshots_.capacity() > 0; }
  // The runner slot holding running slot `slot`'s state from before its draft's verification.
  int draft_slot(int slot) const { return cfg_.max_num_seqs + std::max(cfg_.state_snapshots, 0) + slot; }
  void preempt(Sequence& s);
  // Exact tokens (kv_plan.h's kv_key_exact): the sequence's first sink_pages_ pages and
  // every page from window_page(next) on, `next` being its next query's position.
  bool keeps_exact() const { return cfg_.num_exact_pages > 0; }
  int window_page(int next) const;
  // The pages a prefix hit of `found` full pages (of a sequence of `total` tokens) reads exact:
  // its next query's sinks and recent window, each once, in order.
  void exact_pages_read(int found, int total, std::vector<int>& pages) const;
  bool holds_exact(const Sequence& s, int page) const {
    return keeps_exact() && (page < sink_pages_ || page >= std::max(sink_pages_, s.exact_from));
  }
  void drop_exact_at(Sequence& s, size_t page);  // the hold of s on its page-th page, if any

  SchedulerConfig cfg_;
  int sink_pages_ = 0;
  // Recurrent-state slots (hybrid models' Gated DeltaNet layers; ModelRunner::allocate_states):
  // one per running sequence, max_num_seqs in all, taken at admission and given back with the
  // pages. Unused otherwise (the runner ignores AttnSeq::state_slot).
  std::vector<int> free_state_slots_;
  StateSnapshots snapshots_;
  std::unique_ptr<HostKVTier> tier_;
  std::unique_ptr<HostKVTier> exact_tier_;  // exact pages beside tier_ (exact sink / recent tokens)
  TierCosts costs_;
  TierCosts::Use use_;  // the last schedule's decision
  ModelRunner::PageCopyTimes copy_times_;
  void decide_tiers();
  BlockManager blocks_;
  ModelRunner& runner_;
  EngineStats& stats_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order (oldest first)
  int restoring_ = 0;  // set aside by the last schedule() (num_restoring)
};

}  // namespace kvlm

// The synchronous core of the serving engine: a scheduler with continuous batching over
// one model runner and one shared KV pool. AsyncEngine runs it on a thread; tests and
// `kvlm bench throughput` may drive it step by step.
//
// A step is the engine's three parts in turn: the Scheduler picks the sequences and their
// rows (scheduler.h), the StepBatch lays them out and runs the model runner (step_batch.h),
// the OutputProcessor turns logits into tokens, verifies drafts and applies stops
// (output_processor.h); then the outputs are delivered through the requests' callbacks.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/metrics.h"
#include "engine/output_processor.h"
#include "engine/proposer.h"
#include "engine/request.h"
#include "engine/scheduler.h"
#include "engine/step_batch.h"
#include "model/loaded_model.h"

namespace kvlm {

class LLMEngine {
 public:
  // Allocates the runner's KV pool: cfg.num_blocks pages. Throws kvlm::Error when the pool
  // cannot hold one sequence of max_model_len tokens.
  LLMEngine(LoadedModel& model, SchedulerConfig cfg);
  ~LLMEngine();

  // Validates (kvlm::Error for the client) and queues the request.
  void add_request(EngineRequest req);
  // The checks of add_request that need no scheduler state (safe from any thread).
  void check_request(const EngineRequest& req) const;
  // Finishes a live request with FinishReason::Abort at the start of the next step.
  void abort(const std::string& id);
  // Runs one scheduler step; false when there was nothing to do.
  bool step();
  bool has_work() const { return !scheduler_.empty() || !aborts_.empty(); }
  bool is_live(const std::string& id) const { return live_.count(id) != 0; }

  // Speculative decoding: `p` proposes drafts for decoding sequences every step (nullptr:
  // none), except in steps that start with more than `disable_by_batch_size` sequences
  // running (0: every step). Outputs are the same as without it; only the number of steps
  // changes.
  void set_proposer(std::unique_ptr<DraftProposer> p, int disable_by_batch_size = 0) {
    proposer_ = std::move(p);
    draft_max_running_ = disable_by_batch_size;
  }

  EngineStats stats() const;
  // Called with fresh stats after each step's bookkeeping and before its outputs are
  // delivered, so a client that has seen its request finish reads counters that include it.
  void set_stats_listener(std::function<void(const EngineStats&)> f) { listener_ = std::move(f); }
  const SchedulerConfig& config() const { return cfg_; }
  const BlockManager& blocks() const { return scheduler_.blocks(); }
  // The lower tiers' cost model (whether restoring pays against recomputing).
  TierCosts& tier_costs() { return scheduler_.tier_costs(); }
  const StateSnapshots& snapshots() const { return scheduler_.snapshots(); }
  LoadedModel& model() { return model_; }

 private:
  void propose();
  void finish(Sequence& s, FinishReason why, const std::string& error = {});
  bool deliver(Sequence& s, RequestOutput& out);
  // Delivers a step's outputs in order (finishing those whose consumer stops them) and
  // forgets the finished sequences.
  void deliver_all(std::vector<std::pair<Sequence*, RequestOutput>> outputs);
  bool draw_deferred(bool wait);
  void publish();

  LoadedModel& model_;
  SchedulerConfig cfg_;
  EngineStats stats_;
  Scheduler scheduler_;
  StepBatch batch_;
  OutputProcessor outputs_;
  std::unordered_map<std::string, Sequence*> live_;
  std::vector<std::string> aborts_;
  std::function<void(const EngineStats&)> listener_;
  std::unique_ptr<DraftProposer> proposer_;
  int draft_max_running_ = 0;  // --speculative-config disable_by_batch_size
  std::vector<Sequence*> decoding_;  // per-step scratch for the proposer
  std::vector<int> max_draft_;
};

}  // namespace kvlm

// The synchronous core of the serving engine: a scheduler with continuous batching over
// one model runner and one shared KV pool. AsyncEngine runs it on a thread; tests and
// `kvlm bench throughput` may drive it step by step.
//
// Each step (vLLM v1's unified schedule):
//   1. running sequences first, oldest first: each gets its next tokens (one for decode,
//      a chunk for an unfinished prefill) within --max-num-batched-tokens; when a page
//      cannot be had, the newest running sequence is preempted (its pages released, its
//      tokens kept, recomputed later — with the prefix cache, mostly from cache);
//   2. then waiting sequences, first come first served, while tokens, pages and
//      --max-num-seqs allow; a new sequence first takes what the prefix cache holds;
//   3. one forward pass over the flattened batch; full pages are registered in the prefix
//      cache; finished prefills and decodes are sampled and reported.
#pragma once

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine.h"
#include "serve/async_engine.h"  // SchedulerConfig
#include "serve/block_manager.h"
#include "serve/metrics.h"
#include "serve/request.h"

namespace kvlm {

class LLMEngine {
 public:
  // Allocates the runner's KV pool: cfg.num_blocks pages. Throws kvlm::Error when the pool
  // cannot hold one sequence of max_model_len tokens.
  LLMEngine(Engine& engine, SchedulerConfig cfg);
  ~LLMEngine();

  // Validates (kvlm::Error for the client) and queues the request.
  void add_request(EngineRequest req);
  // The checks of add_request that need no scheduler state (safe from any thread).
  void check_request(const EngineRequest& req) const;
  // Finishes a live request with FinishReason::Abort at the start of the next step.
  void abort(const std::string& id);
  // Runs one scheduler step; false when there was nothing to do.
  bool step();
  bool has_work() const { return !running_.empty() || !waiting_.empty() || !aborts_.empty(); }
  bool is_live(const std::string& id) const { return live_.count(id) != 0; }

  EngineStats stats() const;
  // Called with fresh stats after each step's bookkeeping and before its outputs are
  // delivered, so a client that has seen its request finish reads counters that include it.
  void set_stats_listener(std::function<void(const EngineStats&)> f) { listener_ = std::move(f); }
  const SchedulerConfig& config() const { return cfg_; }
  const BlockManager& blocks() const { return *blocks_; }
  Engine& engine() { return engine_; }

 private:
  struct Sequence;
  using Clock = std::chrono::steady_clock;

  bool ensure_pages(Sequence& s, int tokens);   // pages for `tokens` computed tokens
  void release_pages(Sequence& s);
  void admit_prefix(Sequence& s);
  void preempt(Sequence& s);
  void finish(Sequence& s, FinishReason why, const std::string& error = {});
  void register_full_pages(Sequence& s);
  bool deliver(Sequence& s, RequestOutput& out);
  void publish();

  Engine& engine_;
  SchedulerConfig cfg_;
  std::unique_ptr<BlockManager> blocks_;
  std::vector<TokenId> eos_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;  // admission order (oldest first)
  std::unordered_map<std::string, Sequence*> live_;
  std::vector<std::string> aborts_;
  EngineStats stats_;
  std::function<void(const EngineStats&)> listener_;
  // Per-step scratch, kept to avoid reallocation.
  std::vector<TokenId> tokens_;
  std::vector<Position> positions_;
  std::vector<SlotId> slots_;
  std::vector<AttnSeq> attn_;
  std::vector<int32_t> logit_rows_;
  std::vector<RowSampling> row_sampling_;  // per logit row (runners that sample on their device)
  std::vector<int> host_row_;              // per logit row: its row in logits_, -1 = sampled by the runner
  std::vector<TokenId> device_tokens_;     // per logit row: the runner's token
  std::vector<float> logits_;              // the host rows' logits
};

}  // namespace kvlm

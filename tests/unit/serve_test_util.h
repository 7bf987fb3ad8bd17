// What the serving-engine tests share: the stories260K checkpoint, the exact-page check,
// loading a checkpoint with a KV cache dtype, a request whose outputs are collected, random
// prompts, one request run alone, a runner that samples "on its device", running an
// engine until it is idle, the batched-equals-sequential check, and n-gram drafting on a hybrid
// model.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../support/greedy_compare.h"
#include "config/speculative_config.h"
#include "engine/block_manager.h"
#include "engine/llm_engine.h"
#include "model/loaded_model.h"
#include "offline/generate.h"

namespace kvlm::testing {

inline const std::filesystem::path kStories = std::filesystem::path(KVLM_TEST_DATA) / ".." / "models" / "stories260K";

// Every exact page is free or idle again (no hold outlives its sequence).
inline void expect_exact_pages_released(const BlockManager& b) {
  EXPECT_EQ(b.num_exact_available(), b.num_exact_pages()) << "exact pages still held";
  for (BlockId i = 0; i < b.num_blocks(); ++i) EXPECT_EQ(b.exact_holds(i), 0) << "page " << i;
}

inline std::unique_ptr<LoadedModel> load(const std::filesystem::path& dir, KVCacheDType dt = KVCacheDType::Auto, int block_size = 16,
                                  int keep_sink = 0, int keep_recent = 0) {
  ModelOptions o;
  o.model_dir = dir;
  o.cache.kv_cache_dtype = dt;
  o.cache.block_size = block_size;
  o.cache.keep_sink = keep_sink;
  o.cache.keep_recent = keep_recent;
  return LoadedModel::load(o);
}

struct Collected {
  std::vector<TokenId> tokens;
  std::vector<TokenLogprobs> logprobs, prompt_logprobs;
  FinishReason reason = FinishReason::None;
  std::string error;
  int outputs = 0, cached = 0, finishes = 0;
};

inline EngineRequest make(const std::string& id, std::vector<TokenId> prompt, int max_tokens, std::map<std::string, Collected>& out) {
  EngineRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.ignore_eos = true;
  r.on_output = [&out, id](const RequestOutput& o) {
    Collected& c = out[id];
    c.tokens.insert(c.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
    c.logprobs.insert(c.logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
    c.prompt_logprobs.insert(c.prompt_logprobs.end(), o.prompt_logprobs.begin(), o.prompt_logprobs.end());
    c.cached = o.cached_prompt_tokens;
    ++c.outputs;
    if (o.finished) {
      c.reason = o.finish_reason;
      c.error = o.error;
      ++c.finishes;
    }
    return true;
  };
  return r;
}

// The request asking for its tokens' log-probabilities.
inline EngineRequest with_logprobs(EngineRequest r) {
  r.logprobs = 1;
  return r;
}

// The largest difference between two runs' log-probabilities of their tokens (with_logprobs);
// infinite when they differ in length or are empty.
inline double max_logprob_diff(const Collected& a, const Collected& b) {
  if (a.logprobs.size() != b.logprobs.size() || a.logprobs.empty()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.logprobs.size(); ++i)
    worst = std::max(worst, double(std::abs(a.logprobs[i].logprob - b.logprobs[i].logprob)));
  return worst;
}

inline std::vector<TokenId> random_prompt(std::mt19937& rng, int len, int vocab) {
  std::uniform_int_distribution<int> d(3, vocab - 1);
  std::vector<TokenId> p(static_cast<size_t>(len));
  for (auto& t : p) t = d(rng);
  return p;
}

inline std::vector<TokenId> one_at_a_time(LoadedModel& e, const std::vector<TokenId>& prompt, int max_tokens) {
  GenerateRequest g;
  g.prompt = prompt;
  g.max_tokens = max_tokens;
  g.sampling.temperature = 0;
  g.ignore_eos = true;
  return generate(e, g).tokens;
}

// A runner that says it samples on its device: the base ModelRunner::forward_sampled (host
// sample_gumbel), so the engine's split between rows sampled by the runner and rows whose
// logits come back is exercised on the CPU. Counts what it was asked for. With
// patient_masks, it asks for a masked row's mask until it comes (as if the forward pass took
// as long as the mask), so that no mask is late; without, a mask not ready after the forward
// pass is late, as on a GPU.
class DeviceSamplingRunner final : public ModelRunner {
 public:
  explicit DeviceSamplingRunner(std::unique_ptr<ModelRunner> inner) : inner_(std::move(inner)) {}
  const ModelConfig& config() const override { return inner_->config(); }
  Device device() const override { return inner_->device(); }
  size_t num_parameters() const override { return inner_->num_parameters(); }
  size_t weight_bytes() const override { return inner_->weight_bytes(); }
  void allocate_kv(int num_blocks, int block_size, int num_exact_pages) override {
    inner_->allocate_kv(num_blocks, block_size, num_exact_pages);
  }
  void allocate_states(int slots) override { inner_->allocate_states(slots); }
  void copy_states(std::span<const StateCopy> copies) override { inner_->copy_states(copies); }
  int kv_num_blocks() const override { return inner_->kv_num_blocks(); }
  size_t kv_bytes() const override { return inner_->kv_bytes(); }
  void forward(const ForwardBatch& b, std::span<float> logits) override {
    ++plain_forwards;
    inner_->forward(b, logits);
  }
  void copy_blocks(std::span<const PageCopy> copies) override { inner_->copy_blocks(copies); }
  bool samples_on_device() const override { return true; }
  void forward_sampled(const ForwardBatch& b, std::span<const RowSampling> rows, std::span<TokenId> tokens,
                       std::span<float> host_logits, const RowMaskFn& mask) override {
    int dev = 0, host = 0;
    for (const RowSampling& r : rows) {
      ++(r.on_device ? dev : host);
      masked_rows += r.masked;
    }
    device_rows += dev;
    host_rows += host;
    mixed_steps += dev > 0 && host > 0;
    const RowMaskFn patient = [&](size_t row, std::span<uint64_t> words) {
      for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
           std::chrono::steady_clock::now() < until; std::this_thread::sleep_for(std::chrono::milliseconds(1)))
        if (mask(row, words)) return true;
      return false;
    };
    ModelRunner::forward_sampled(b, rows, tokens, host_logits, patient_masks ? patient : mask);
    for (size_t i = 0; i < rows.size(); ++i) late_masks += rows[i].masked && tokens[i] < 0;
    --plain_forwards;  // the base implementation's own forward()
  }
  void reset_counters() { device_rows = host_rows = mixed_steps = plain_forwards = masked_rows = late_masks = 0; }
  int device_rows = 0, host_rows = 0, mixed_steps = 0, plain_forwards = 0, masked_rows = 0, late_masks = 0;
  bool patient_masks = false;

 private:
  std::unique_ptr<ModelRunner> inner_;
};

// Puts a DeviceSamplingRunner around `e`'s runner; the wrapper, for its counters.
inline DeviceSamplingRunner* sample_on_device(LoadedModel& e) {
  DeviceSamplingRunner* runner = nullptr;
  e.wrap_model([&](std::unique_ptr<ModelRunner> inner) {
    auto r = std::make_unique<DeviceSamplingRunner>(std::move(inner));
    runner = r.get();
    return r;
  });
  return runner;
}

inline void run_to_end(LLMEngine& le) {
  for (int guard = 0; le.has_work(); ++guard) {
    ASSERT_LT(guard, 100000) << "the scheduler made no progress";
    le.step();
  }
}

// Greedy outputs of a continuously batched, chunk-prefilled, preempted run equal the
// outputs of the same prompts run one at a time — per model, with mixed attention kinds.
inline void check_batched_equals_sequential(const std::filesystem::path& model, KVCacheDType dt, int num_blocks, int budget, int keep_sink = 0,
                                     int keep_recent = 0) {
  auto e = load(model, dt, 8, keep_sink, keep_recent);
  std::mt19937 rng(7);
  const int vocab = e->config().vocab_size;
  std::vector<std::vector<TokenId>> prompts;
  std::vector<int> max_tokens;
  for (int i = 0; i < 9; ++i) {
    prompts.push_back(random_prompt(rng, 5 + int(rng() % 60), vocab));
    max_tokens.push_back(4 + int(rng() % 20));
  }
  std::vector<std::vector<TokenId>> expected;
  for (size_t i = 0; i < prompts.size(); ++i) expected.push_back(one_at_a_time(*e, prompts[i], max_tokens[i]));

  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 6, .max_num_batched_tokens = budget, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = num_blocks});
  for (size_t i = 0; i < prompts.size(); ++i) le.add_request(make("r" + std::to_string(i), prompts[i], max_tokens[i], out));
  run_to_end(le);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const Collected& c = out["r" + std::to_string(i)];
    EXPECT_EQ(c.tokens, expected[i]) << model << " request " << i;
    EXPECT_EQ(c.reason, FinishReason::Length);
    EXPECT_EQ(c.finishes, 1);
  }
  const EngineStats st = le.stats();
  EXPECT_EQ(st.num_running, 0);
  EXPECT_EQ(st.num_waiting, 0);
  EXPECT_EQ(le.blocks().num_used(), 0) << "pages leaked";
  expect_exact_pages_released(le.blocks());
  EXPECT_EQ(le.blocks().num_exact_pages() > 0, keep_sink + keep_recent > 0);
  EXPECT_EQ(st.requests_finished_total.at("length"), prompts.size());
  uint64_t gen = 0;
  for (int m : max_tokens) gen += uint64_t(m);
  EXPECT_EQ(st.generation_tokens_total, gen);
  // The small pools below force preemption; the large one must not preempt at all.
  if (num_blocks < 40) EXPECT_GT(st.preemptions_total, 0u) << "the test meant to exercise preemption";
  else EXPECT_EQ(st.preemptions_total, 0u);
}

// n-gram drafting on a hybrid model (ModelOptions o: its checkpoint, device and dtypes): a
// verification step runs the draft through the Gated DeltaNet layers too, so a draft not
// wholly accepted rolls each sequence's recurrent state back to the step's start (from the
// copy kept before it) and computes the accepted tokens again. Greedy tokens are plain
// generation's, one request at a time and batched with chunked prefill, prefix hits and
// drafts in the same steps (parting only after a near tie, as for dense models:
// support/greedy_compare.h; `near_tie` as there). `label` names the device in the printed
// counts.
inline void check_hybrid_drafts(ModelOptions o, const std::string& label, double near_tie = test::kNearTie) {
  o.speculative = {};
  auto plain = LoadedModel::load(o);
  // Prompts that end as they began, after the model's own continuation of that beginning: the
  // n-gram proposer drafts that continuation again, which the model partly repeats (random
  // weights do not continue repeated text as a trained model does).
  std::vector<std::vector<TokenId>> prompts;
  for (const std::vector<TokenId>& start : {std::vector<TokenId>{1, 45, 87, 45, 87, 45, 87, 45},
                                            std::vector<TokenId>{1, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14},
                                            std::vector<TokenId>{1, 200, 31, 57, 99, 100, 150, 190, 57, 99, 100}}) {
    std::vector<TokenId> p = start;
    const std::vector<TokenId> cont = one_at_a_time(*plain, start, 12);
    p.insert(p.end(), cont.begin(), cont.end());
    p.insert(p.end(), start.begin() + 1, start.end());
    prompts.push_back(p);
  }
  o.speculative = parse_speculative_config(
      R"({"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1,"prompt_lookup_max":4})");
  auto spec = LoadedModel::load(o);
  std::vector<GenerateResult> want;
  int parted = 0;
  uint64_t drafted = 0, accepted = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerateRequest g;
    g.prompt = prompts[i];
    g.max_tokens = 40;
    g.sampling.temperature = 0;
    g.ignore_eos = true;
    const GenerateResult b = generate(*spec, g);
    g.logprobs = 2;
    want.push_back(generate(*plain, g));
    parted += test::expect_same_greedy(want.back(), b, label + " prompt " + std::to_string(i) + " alone", near_tie);
    drafted += b.draft_tokens;
    accepted += b.accepted_tokens;
  }
  std::printf("[hybrid drafts, %s] one at a time: %llu draft tokens, %llu accepted\n", label.c_str(),
              (unsigned long long)drafted, (unsigned long long)accepted);
  EXPECT_GT(accepted, 0u) << "no draft was accepted: the rollback is not exercised with accepted tokens";
  EXPECT_GT(drafted, accepted) << "every draft was accepted: no state was rolled back";
  for (const int budget : {64, 7}) {
    std::map<std::string, Collected> out;
    LLMEngine le(*spec, SchedulerConfig{.max_num_seqs = 3, .max_num_batched_tokens = budget, .max_model_len = 128,
                                        .enable_prefix_caching = true, .num_blocks = 64});
    EXPECT_EQ(le.config().draft_states, 3);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EngineRequest r = make("p" + std::to_string(i), prompts[i], 40, out);
      r.ignore_eos = true;
      le.add_request(std::move(r));
    }
    run_to_end(le);
    const EngineStats st = le.stats();
    EXPECT_GT(st.spec_state_rewinds_total, 0u) << label << ", budget " << budget;
    EXPECT_GT(st.spec_accepted_tokens_total, 0u) << label << ", budget " << budget;
    std::printf("[hybrid drafts, %s] budget %d: %llu drafts, %llu tokens, %llu accepted, %llu states rolled back\n",
                label.c_str(), budget, (unsigned long long)st.spec_drafts_total,
                (unsigned long long)st.spec_draft_tokens_total, (unsigned long long)st.spec_accepted_tokens_total,
                (unsigned long long)st.spec_state_rewinds_total);
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenerateResult got;
      got.tokens = out["p" + std::to_string(i)].tokens;
      parted += test::expect_same_greedy(want[i], got, label + " prompt " + std::to_string(i) + " batched, budget " +
                                                           std::to_string(budget), near_tie);
    }
    EXPECT_EQ(le.blocks().num_used(), 0);
  }
  EXPECT_LE(parted, 1) << "drafted and plain greedy outputs part (at near ties) for more than one of 9 runs";
}

}  // namespace kvlm::testing

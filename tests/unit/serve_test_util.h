// What the serving-engine tests share: the stories260K checkpoint, the exact-page check,
// loading a checkpoint with a KV cache dtype, a request whose outputs are collected, random
// prompts, one request run alone, and running an engine until it is idle.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

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

inline void run_to_end(LLMEngine& le) {
  for (int guard = 0; le.has_work(); ++guard) {
    ASSERT_LT(guard, 100000) << "the scheduler made no progress";
    le.step();
  }
}

}  // namespace kvlm::testing

// The host tier's workload (engine/host_kv_tier.h): multi-turn conversations over a shared
// system prefix on a pool too small to keep them, run with a large pool, the small pool alone
// and the small pool with a tier; the tokens must agree and the tier must save recomputation.
// For the CPU tests (test_host_tier.cpp) and the CUDA ones (tests/cuda/test_host_tier_cuda.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <map>
#include <random>

#include "engine/llm_engine.h"
#include "serve_test_util.h"

namespace kvlm::testing {

inline constexpr int kTierBlock = 8;  // the workload's page size (load the model with it)

struct Workload {
  std::vector<std::vector<TokenId>> outputs;  // per (conversation, turn)
  EngineStats stats;
};

// Conversations over one shared system prefix, turn after turn: each turn's prompt is the
// previous prompt, its answer and a new user message. The pool holds about two conversations,
// so by the time a conversation's next turn comes its pages have been evicted.
// `disk_dir` / `disk_bytes`: a disk tier below the host tier ("": none).
inline Workload run_conversations(LoadedModel& e, int num_blocks, int64_t offload_pages, int conversations, int turns,
                                  const std::string& disk_dir = "", uint64_t disk_bytes = 0) {
  std::mt19937 rng(11);
  const int vocab = e.config().vocab_size;
  const auto system = random_prompt(rng, 3 * kTierBlock + 5, vocab);
  std::vector<std::vector<TokenId>> history(size_t(conversations), system);
  LLMEngine le(e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 32, .max_model_len = 128,
                                  .enable_prefix_caching = true, .num_blocks = num_blocks,
                                  .kv_offload_pages = offload_pages, .kv_offload_dir = disk_dir,
                                  .kv_offload_disk_bytes = disk_bytes});
  Workload w;
  for (int t = 0; t < turns; ++t)
    for (int c = 0; c < conversations; ++c) {
      auto& h = history[size_t(c)];
      const auto user = random_prompt(rng, 6 + 3 * t, vocab);
      h.insert(h.end(), user.begin(), user.end());
      std::map<std::string, Collected> out;
      le.add_request(make("c", h, 5, out));
      run_to_end(le);
      const auto& got = out["c"].tokens;
      EXPECT_EQ(out["c"].reason, FinishReason::Length) << out["c"].error;
      w.outputs.push_back(got);
      h.insert(h.end(), got.begin(), got.end());
    }
  w.stats = le.stats();
  EXPECT_EQ(le.blocks().num_used(), 0);
  return w;
}

// `saves`: the tier must save recomputation (it cannot where exact tokens end every hit; see
// GreedyTokensUnchangedWithExactTokens). The tier's tokens must equal the large pool's, which
// reuses the same pages; `recompute_equal`: the small pool's, which recomputes them, too (on the
// CPU; a GPU's chunked prefill may round differently from the steps that wrote the pages).
inline void check_tier_is_exact(LoadedModel& e, bool saves = true, bool recompute_equal = true) {
  // A pool large enough to keep everything, the small pool alone, the small pool and a tier.
  const Workload all = run_conversations(e, 400, 0, 6, 3);
  const Workload small = run_conversations(e, 20, 0, 6, 3);
  const Workload tiered = run_conversations(e, 20, 200, 6, 3);
  if (recompute_equal) EXPECT_EQ(small.outputs, all.outputs);
  EXPECT_EQ(tiered.outputs, all.outputs);
  // Every page copied back serves a hit: pages of a hit that admit_prefix does not keep are
  // not copied (BlockManager::commit_restores).
  EXPECT_EQ(tiered.stats.kv_offload_restored_total * uint64_t(kTierBlock), tiered.stats.kv_offload_hit_tokens_total);
  if (saves) {
    EXPECT_GT(tiered.stats.kv_offload_restored_total, 0u);
    EXPECT_LT(tiered.stats.prompt_tokens_total, small.stats.prompt_tokens_total) << "the tier should save recomputation";
    EXPECT_EQ(tiered.stats.prompt_tokens_total, all.stats.prompt_tokens_total) << "the tier holds what the pool evicted";
  } else {
    EXPECT_LE(tiered.stats.prompt_tokens_total, small.stats.prompt_tokens_total);
  }
  EXPECT_LE(tiered.stats.kv_offload_pages, tiered.stats.kv_offload_capacity);
  std::printf("[host tier] %s: prompt tokens computed %llu (pool alone %llu, large pool %llu); tier: %llu pages kept, "
              "%llu restored, %llu tokens hit\n",
              describe_kv_resolution(e.plan()).c_str(), (unsigned long long)tiered.stats.prompt_tokens_total,
              (unsigned long long)small.stats.prompt_tokens_total, (unsigned long long)all.stats.prompt_tokens_total,
              (unsigned long long)tiered.stats.kv_offload_stored_total,
              (unsigned long long)tiered.stats.kv_offload_restored_total,
              (unsigned long long)tiered.stats.kv_offload_hit_tokens_total);
}


}  // namespace kvlm::testing

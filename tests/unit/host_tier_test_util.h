// The host tier's workload (engine/host_kv_tier.h): multi-turn conversations over a shared
// system prefix on a pool too small to keep them, run with a large pool, the small pool alone
// and the small pool with a tier; the tokens must agree and the tier must save recomputation.
// For the CPU tests (test_host_tier.cpp) and the CUDA ones (tests/cuda/test_host_tier_cuda.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
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
// `disk_dir` / `disk_bytes`: a disk tier below the host tier ("": none). `exact_pages`: the
// tier's exact pages (exact sink / recent tokens), and `exact_disk_bytes` their disk tier's.
// `setup`: runs on the engine before the first request. `max_num_seqs` sizes the exact pool
// too (exact tokens): requests run one at a time whatever it is.
inline Workload run_conversations(LoadedModel& e, int num_blocks, int64_t offload_pages, int conversations, int turns,
                                  const std::string& disk_dir = "", uint64_t disk_bytes = 0, int64_t exact_pages = 0,
                                  uint64_t exact_disk_bytes = 0, const std::function<void(LLMEngine&)>& setup = {},
                                  int max_num_seqs = 2) {
  std::mt19937 rng(11);
  const int vocab = e.config().vocab_size;
  const auto system = random_prompt(rng, 3 * kTierBlock + 5, vocab);
  std::vector<std::vector<TokenId>> history(size_t(conversations), system);
  LLMEngine le(e, SchedulerConfig{.max_num_seqs = max_num_seqs, .max_num_batched_tokens = 32, .max_model_len = 128,
                                  .enable_prefix_caching = true, .num_blocks = num_blocks,
                                  .kv_offload_pages = offload_pages, .kv_offload_dir = disk_dir,
                                  .kv_offload_disk_bytes = disk_bytes, .kv_offload_exact_pages = exact_pages,
                                  .kv_offload_exact_disk_bytes = exact_disk_bytes});
  if (setup) setup(le);
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

// `saves`: the tier must save recomputation (it cannot where exact tokens end every hit and it
// keeps no exact pages; see GreedyTokensUnchangedWithExactTokens). The tier's tokens must equal
// the large pool's, which reuses the same pages; `recompute_equal`: the small pool's, which
// recomputes them, too (on the CPU; a GPU's chunked prefill may round differently from the steps
// that wrote the pages). `exact_pages`: the tier's exact pages.
inline void check_tier_is_exact(LoadedModel& e, bool saves = true, bool recompute_equal = true,
                                int64_t exact_pages = 0) {
  // A pool large enough to keep everything, the small pool alone, the small pool and a tier.
  const Workload all = run_conversations(e, 400, 0, 6, 3);
  const Workload small = run_conversations(e, 20, 0, 6, 3);
  const Workload tiered = run_conversations(e, 20, 200, 6, 3, "", 0, exact_pages);
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
              "%llu restored, %llu tokens hit; exact pages: %llu kept, %llu restored\n",
              describe_kv_resolution(e.plan()).c_str(), (unsigned long long)tiered.stats.prompt_tokens_total,
              (unsigned long long)small.stats.prompt_tokens_total, (unsigned long long)all.stats.prompt_tokens_total,
              (unsigned long long)tiered.stats.kv_offload_stored_total,
              (unsigned long long)tiered.stats.kv_offload_restored_total,
              (unsigned long long)tiered.stats.kv_offload_hit_tokens_total,
              (unsigned long long)tiered.stats.kv_offload_exact_stored_total,
              (unsigned long long)tiered.stats.kv_offload_exact_restored_total);
}


// Exact sink / recent tokens with exact pages in the tier (PageKind::Exact beside the pages):
// an exact copy a cached page gives up — its page evicted, or its idle exact page taken back
// for another sequence — is kept there, and a hit whose query reads that page exact takes it
// back. The hits that ended before the previous turn's last pages now go through them: fewer
// prompt tokens are computed than with the large pool alone (whose idle exact copies are lost),
// as many as with a large pool whose exact pool loses nothing (an exact page for each of 64
// sequences), and the tokens are that run's: the same computation. `recompute_equal`: they
// also equal the large pool's, which recomputes what the tier restores (on the CPU; a GPU's
// prefill in other chunks may round differently).
inline void check_exact_pages_come_back(LoadedModel& e, bool recompute_equal = true) {
  const Workload all = run_conversations(e, 400, 0, 6, 3);
  const Workload roomy = run_conversations(e, 400, 0, 6, 3, "", 0, 0, 0, {}, /*max_num_seqs=*/64);
  const Workload without = run_conversations(e, 20, 200, 6, 3);
  const Workload with = run_conversations(e, 20, 200, 6, 3, "", 0, /*exact_pages=*/60);
  EXPECT_EQ(with.outputs, roomy.outputs);
  EXPECT_EQ(with.stats.prompt_tokens_total, roomy.stats.prompt_tokens_total)
      << "the exact tier holds what the small exact pool lost";
  if (recompute_equal) {
    EXPECT_EQ(with.outputs, all.outputs);
    EXPECT_EQ(without.outputs, all.outputs);
  }
  EXPECT_GT(with.stats.kv_offload_exact_stored_total, 0u);
  EXPECT_GT(with.stats.kv_offload_exact_restored_total, 0u);
  EXPECT_GT(with.stats.kv_offload_restored_total, 0u) << "pages restored with their exact copies";
  EXPECT_LT(with.stats.prompt_tokens_total, without.stats.prompt_tokens_total);
  EXPECT_LT(with.stats.prompt_tokens_total, all.stats.prompt_tokens_total);
  EXPECT_EQ(with.stats.kv_offload_restored_total * uint64_t(kTierBlock), with.stats.kv_offload_hit_tokens_total);
  std::printf("[exact tier] %s: prompt tokens computed %llu (without exact pages %llu, large pool %llu); %llu pages and "
              "%llu exact pages restored, %llu exact pages kept\n",
              describe_kv_resolution(e.plan()).c_str(), (unsigned long long)with.stats.prompt_tokens_total,
              (unsigned long long)without.stats.prompt_tokens_total, (unsigned long long)all.stats.prompt_tokens_total,
              (unsigned long long)with.stats.kv_offload_restored_total,
              (unsigned long long)with.stats.kv_offload_exact_restored_total,
              (unsigned long long)with.stats.kv_offload_exact_stored_total);
}

}  // namespace kvlm::testing

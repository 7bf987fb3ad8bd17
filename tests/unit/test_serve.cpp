// The serving engine: block manager (reference counts, prefix cache, LRU eviction), the
// scheduler (continuous batching, chunked prefill, preemption, prefix reuse with
// copy-on-write, aborts, stop callbacks, prompt logprobs) and the async wrapper — checked
// against single-request generation on real checkpoints.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <thread>
#include <tuple>

#include "config/speculative_config.h"
#include "core/error.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "engine/async_engine.h"
#include "engine/block_manager.h"
#include "engine/llm_engine.h"
#include "engine/engine_args.h"
#include "engine/memory_plan.h"
#include "io/safetensors.h"
#include "config/model_config.h"
#include <nlohmann/json.hpp>
#include "text/tokenizer/tokenizer.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"
#include "serve_test_util.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::testing;

namespace {

const fs::path kTests = KVLM_TEST_DATA;
const fs::path kQwen3Mixed = kTests / "golden" / "models" / "qwen3-mixed";
const fs::path kQwen35 = kTests / "golden" / "models" / "qwen3.5";

std::vector<TokenId> tokens_of(std::span<const TokenId> s) { return {s.begin(), s.end()}; }

// ---------------------------------------------------------------- block manager
TEST(BlockManager, AllocatesEveryPageOnceAndCountsReferences) {
  BlockManager bm(4, 2, false);
  std::vector<BlockId> got;
  for (int i = 0; i < 4; ++i) got.push_back(*bm.allocate());
  EXPECT_FALSE(bm.allocate().has_value());
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<BlockId>{0, 1, 2, 3}));
  EXPECT_EQ(bm.num_free(), 0);
  bm.release(2);
  EXPECT_EQ(bm.num_free(), 1);
  EXPECT_EQ(*bm.allocate(), 2);
  EXPECT_THROW(bm.release(-1), std::exception);
  bm.release(1);
  EXPECT_THROW(bm.release(1), std::exception);  // released more often than referenced
}

TEST(BlockManager, PrefixMatchFollowsTheChainExactly) {
  BlockManager bm(8, 2, true);
  const std::vector<TokenId> a{1, 2, 3, 4, 5, 6, 7};
  std::vector<BlockId> pages;
  for (int i = 0; i < 3; ++i) pages.push_back(*bm.allocate());
  uint64_t parent = 0;
  for (int i = 0; i < 3; ++i) parent = bm.register_full(pages[size_t(i)], parent, std::span(a).subspan(size_t(i) * 2, 2));
  EXPECT_EQ(bm.num_cached(), 3);

  std::vector<BlockId> found;
  std::vector<uint64_t> serials;
  EXPECT_EQ(bm.match_prefix(a, found, serials), 3);
  EXPECT_EQ(found, pages);
  EXPECT_EQ(bm.ref_count(pages[0]), 2);

  // Same second page, different first page: no match at all (the chain is the identity).
  const std::vector<TokenId> b{9, 9, 3, 4};
  found.clear();
  serials.clear();
  EXPECT_EQ(bm.match_prefix(b, found, serials), 0);
  // Shares the first page only.
  const std::vector<TokenId> c{1, 2, 3, 5};
  EXPECT_EQ(bm.match_prefix(c, found, serials), 1);
  EXPECT_EQ(found.front(), pages[0]);
}

TEST(BlockManager, EvictsLeastRecentlyUsedCachedPagesAndNeverReturnsStaleOnes) {
  BlockManager bm(3, 1, true);
  const BlockId p0 = *bm.allocate(), p1 = *bm.allocate(), p2 = *bm.allocate();
  const TokenId t0 = 10, t1 = 11, t2 = 12;
  const uint64_t s0 = bm.register_full(p0, 0, {&t0, 1});
  bm.register_full(p1, s0, {&t1, 1});  // the chain 10 -> 11
  bm.register_full(p2, 0, {&t2, 1});
  bm.release(p0);  // least recently used
  bm.release(p2);
  bm.release(p1);
  EXPECT_EQ(bm.num_free(), 3);
  EXPECT_EQ(bm.num_cached(), 3);
  // The next allocation evicts p0 although its child p1 stays cached.
  const BlockId n = *bm.allocate();
  EXPECT_EQ(n, p0);
  EXPECT_EQ(bm.num_cached(), 2);
  std::vector<BlockId> found;
  std::vector<uint64_t> serials;
  const std::vector<TokenId> chain{10, 11};
  EXPECT_EQ(bm.match_prefix(chain, found, serials), 0);
  // The page comes back with other content: [99, 11] finds the new page, never p1, whose
  // parent was the evicted identity.
  const TokenId other = 99;
  EXPECT_NE(bm.register_full(n, 0, {&other, 1}), s0);
  const std::vector<TokenId> q{99, 11};
  EXPECT_EQ(bm.match_prefix(q, found, serials), 1);
  EXPECT_EQ(found, std::vector<BlockId>{n});
  // The next eviction takes p2, then p1, in release order.
  EXPECT_EQ(*bm.allocate(), p2);
  EXPECT_EQ(*bm.allocate(), p1);
  EXPECT_FALSE(bm.allocate().has_value());
}

TEST(BlockManager, UncachedPagesAreHandedOutBeforeCachedOnes) {
  BlockManager bm(2, 1, true);
  const BlockId a = *bm.allocate(), b = *bm.allocate();
  const TokenId t = 5;
  bm.register_full(a, 0, {&t, 1});
  bm.release(a);  // cached: kept
  bm.release(b);  // never cached: reused first
  EXPECT_EQ(*bm.allocate(), b);
  EXPECT_EQ(bm.num_cached(), 1);
}

TEST(BlockManager, DuplicateRegistrationKeepsOneCopy) {
  BlockManager bm(2, 2, true);
  const std::vector<TokenId> t{3, 4};
  const BlockId a = *bm.allocate(), b = *bm.allocate();
  const uint64_t sa = bm.register_full(a, 0, t);
  EXPECT_EQ(bm.register_full(b, 0, t), sa);
  EXPECT_EQ(bm.num_cached(), 1);
}

// ---------------------------------------------------------------- helpers
// State snapshots (hybrid models' prefix cache): slots of their own range, found by serial,
// the least recently used given up first.
TEST(StateSnapshots, KeepsTheMostRecentlyUsed) {
  StateSnapshots s(4, 2);  // slots 4 and 5
  EXPECT_EQ(s.find(7), -1);
  const int a = s.insert(7), b = s.insert(9);
  EXPECT_NE(a, b);
  EXPECT_TRUE(a >= 4 && a <= 5 && b >= 4 && b <= 5);
  EXPECT_EQ(s.find(7), a);     // 7 is now the most recent
  EXPECT_EQ(s.insert(11), b);  // so 9 gives its slot up
  EXPECT_FALSE(s.contains(9));
  EXPECT_TRUE(s.contains(7) && s.contains(11));
  EXPECT_EQ(s.size(), 2);
  EXPECT_THROW(s.insert(7), std::exception);  // a serial is kept once
  StateSnapshots none(4, 0);
  EXPECT_EQ(none.find(7), -1);
  EXPECT_THROW(none.insert(7), std::exception);
}

TEST(Metrics, HistogramBucketsAreUpperBounds) {
  Histogram h({0.1, 1.0});
  h.observe(0.1);
  h.observe(0.5);
  h.observe(7);
  EXPECT_EQ(h.counts, (std::vector<uint64_t>{1, 1, 1}));
  EXPECT_EQ(h.count, 3u);
  EXPECT_DOUBLE_EQ(h.sum, 7.6);
}

TEST(MemoryPlan, ParsesByteSizes) {
  EXPECT_EQ(parse_byte_size("1000"), 1000u);
  EXPECT_EQ(parse_byte_size("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_byte_size("4G"), 4000000000ull);
  EXPECT_EQ(parse_byte_size("1.5kib"), 1536u);
  for (const char* bad : {"", "GiB", "-1", "12XB", "1e3", "0"}) EXPECT_THROW(parse_byte_size(bad), Error) << bad;
}

// A hybrid's step also holds its Gated DeltaNet rows: the fused projection (bf16) and fp32 conv
// output, delta rule output and chunked-form scratch (gates, W, U) per row, counted for every
// row of the step on top of the dense estimate.
TEST(MemoryPlan, ActivationsCountTheLinearAttentionRows) {
  ModelConfig dense;
  dense.hidden_size = 256, dense.intermediate_size = 512, dense.num_heads = 4, dense.num_kv_heads = 2;
  dense.head_dim = 64, dense.vocab_size = 1000;
  ModelConfig hybrid = dense;
  hybrid.linear_attention = LinearAttentionConfig{.k_heads = 2, .v_heads = 4, .k_dim = 32, .v_dim = 64, .conv_kernel = 4};
  MemoryOptions o;
  o.max_num_batched_tokens = 100;
  const LinearAttentionConfig& l = *hybrid.linear_attention;
  const uint64_t per_row = 2ull * uint64_t(l.in_proj_dim()) +
                           4ull * uint64_t(l.conv_dim() + l.value_dim() + l.v_heads * (2 + l.k_dim + l.v_dim));
  EXPECT_EQ(activation_bytes(hybrid, o) - activation_bytes(dense, o), 100 * per_row);
  o.max_num_batched_tokens = 200;
  EXPECT_EQ(activation_bytes(hybrid, o) - activation_bytes(dense, o), 200 * per_row);
}

TEST(MemoryPlan, CapacityFollowsThePerLayerPlan) {
  auto bf16 = load(kQwen3Mixed, KVCacheDType::BFloat16);
  auto fp8 = load(kQwen3Mixed, KVCacheDType::Fp8E4M3);
  MemoryOptions o;
  o.kv_cache_memory = 1 << 20;
  const MemoryPlan a = plan_kv_memory(*bf16, o), b = plan_kv_memory(*fp8, o);
  EXPECT_EQ(b.bytes_per_token * 2, a.bytes_per_token);
  EXPECT_EQ(a.capacity_tokens, int64_t((1 << 20) / (a.bytes_per_token * 16)) * 16);
  EXPECT_NEAR(double(b.capacity_tokens) / double(a.capacity_tokens), 2.0, 0.01);
  EXPECT_NE(a.summary.find("maximum concurrency"), std::string::npos);
  o.kv_cache_memory = 1000;  // smaller than one max_model_len request
  try {
    plan_kv_memory(*bf16, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--max-model-len"), std::string::npos) << e.what();
  }
}

// Exact sink / recent tokens come out of the same budget: per sequence 1 sink page (4 tokens)
// and 4 + 2 window pages (63 tokens, 16 per page), times max_num_seqs, plus a step's tokens
// in pages, each token 1024 bytes (4 layers, bf16 K and V of 2 heads x 32).
TEST(MemoryPlan, ExactTokensComeOutOfTheBudget) {
  auto e = load(kQwen3Mixed, KVCacheDType::Int4PerTokenHead, 16, 4, 64);
  MemoryOptions o;
  o.kv_cache_memory = 1 << 26;
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 512;
  const MemoryPlan mp = plan_kv_memory(*e, o);
  EXPECT_EQ(mp.num_exact_pages, 8 * (1 + 4 + 2) + 512 / 16);
  EXPECT_EQ(mp.exact_bytes, uint64_t(mp.num_exact_pages) * 16 * 1024);
  EXPECT_EQ(mp.num_blocks, int(((1 << 26) - mp.exact_bytes) / mp.bytes_per_block));
  EXPECT_NE(mp.summary.find("exact sink/recent tokens"), std::string::npos) << mp.summary;
  EXPECT_EQ(exact_pages_needed(e->plan(), 16, 8, 512), mp.num_exact_pages);
  o.kv_cache_memory = mp.exact_bytes;  // nothing left for the pages
  try {
    plan_kv_memory(*e, o);
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("lower --max-num-seqs or the kept tokens"), std::string::npos) << err.what();
  }
  auto plain = load(kQwen3Mixed, KVCacheDType::Int4PerTokenHead, 16);
  EXPECT_EQ(exact_pages_needed(plain->plan(), 16, 8, 512), 0);
}

// A hybrid model's recurrent states (Qwen3.5 golden: 4 Gated DeltaNet layers of 2016 fp32
// values per sequence) come out of the same budget, one per --max-num-seqs slot and, with
// prefix caching, as many snapshots; the pages count only the attention layer's K/V (256
// bytes per token in bf16).
TEST(MemoryPlan, LinearAttentionStatesComeOutOfTheBudget) {
  auto e = load(kQwen35);
  MemoryOptions o;
  o.kv_cache_memory = 1 << 22;
  o.max_num_seqs = 8;
  o.prefix_caching = false;
  MemoryPlan mp = plan_kv_memory(*e, o);
  EXPECT_EQ(mp.bytes_per_token, 256u);
  EXPECT_EQ(mp.state_bytes, 8u * 4u * 2016u * 4u);
  EXPECT_EQ(mp.state_snapshots, 0);
  EXPECT_EQ(mp.num_blocks, int(((1 << 22) - mp.state_bytes) / mp.bytes_per_block));
  EXPECT_NE(mp.summary.find("linear-attention states"), std::string::npos) << mp.summary;
  o.prefix_caching = true;
  mp = plan_kv_memory(*e, o);
  EXPECT_EQ(mp.state_snapshots, 8);
  EXPECT_EQ(mp.state_bytes, 16u * 4u * 2016u * 4u);
  EXPECT_EQ(mp.num_blocks, int(((1 << 22) - mp.state_bytes) / mp.bytes_per_block));
  EXPECT_NE(mp.summary.find("prefix-cache snapshots"), std::string::npos) << mp.summary;
  auto dense = load(kStories);
  EXPECT_EQ(plan_kv_memory(*dense, o).state_snapshots, 0);
  o.max_num_seqs = 200;  // 25.8 MB of states in a 4 MiB budget
  try {
    plan_kv_memory(*e, o);
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("lower --max-num-seqs"), std::string::npos) << err.what();
  }
}

// ---------------------------------------------------------------- scheduler






TEST(Scheduler, BatchedEqualsSequentialStories) {
  check_batched_equals_sequential(kStories, KVCacheDType::Auto, 200, 48);
}
TEST(Scheduler, BatchedEqualsSequentialUnderPreemption) {
  check_batched_equals_sequential(kStories, KVCacheDType::Auto, 16, 16);
}
TEST(Scheduler, BatchedEqualsSequentialSlidingAndFullLayersFp8) {
  check_batched_equals_sequential(kQwen3Mixed, KVCacheDType::Fp8PerTokenHead, 16, 23);
}

// Exact sink / recent tokens: which keys a query reads exact depends on its position only
// (kv_key_exact), so chunked prefill, batching and preemption leave the outputs as they are
// one request at a time; sink 3 and recent 11 straddle the 8-token pages.
TEST(Scheduler, BatchedEqualsSequentialExactTokensInt4) {
  check_batched_equals_sequential(kStories, KVCacheDType::Int4PerTokenHead, 200, 48, 3, 11);
}
TEST(Scheduler, BatchedEqualsSequentialExactTokensUnderPreemption) {
  check_batched_equals_sequential(kStories, KVCacheDType::Int4PerTokenHead, 16, 16, 3, 11);
}
TEST(Scheduler, BatchedEqualsSequentialExactTokensSlidingAndFullLayers) {
  check_batched_equals_sequential(kQwen3Mixed, KVCacheDType::Int8PerTokenHead, 16, 23, 0, 9);
}

TEST(Scheduler, PrefixCacheReusesPagesAndCopiesOnWrite) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::mt19937 rng(3);
  const auto shared = random_prompt(rng, 40, e->config().vocab_size);  // 5 full pages
  auto longer = shared;
  longer.insert(longer.end(), {5, 6, 7});
  const auto want_shared = one_at_a_time(*e, shared, 6);
  const auto want_longer = one_at_a_time(*e, longer, 6);

  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = 64});
  le.add_request(make("first", shared, 6, out));
  run_to_end(le);
  // Same prompt again: every page is cached; the last token is recomputed into a copy of
  // the last shared page.
  le.add_request(make("again", shared, 6, out));
  le.add_request(make("longer", longer, 6, out));
  run_to_end(le);
  EXPECT_EQ(out["first"].cached, 0);
  EXPECT_EQ(out["again"].cached, 39);
  EXPECT_EQ(out["longer"].cached, 40);
  EXPECT_EQ(out["first"].tokens, want_shared);
  EXPECT_EQ(out["again"].tokens, want_shared);
  EXPECT_EQ(out["longer"].tokens, want_longer);
  const EngineStats st = le.stats();
  EXPECT_EQ(st.prefix_cache_hits_total, 79u);
  EXPECT_EQ(st.prompt_tokens_total, 40u + 1u + 3u);
  EXPECT_EQ(le.blocks().num_used(), 0);
}

// Exact tokens and the prefix cache: a hit resumes only where the pages its next query reads
// exact (its sinks, its recent window) still have their exact copies. Idle copies stay for a
// later hit, so a repeated prompt reuses every page; once other requests have taken the exact
// pool back, the hit stops earlier (or never starts) and the outputs stay the same.
TEST(Scheduler, PrefixCacheWithExactTokens) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, 8, 2, 10);
  std::mt19937 rng(3);
  const int vocab = e->config().vocab_size;
  const auto shared = random_prompt(rng, 40, vocab);  // 5 full pages
  auto longer = shared;
  longer.insert(longer.end(), {5, 6, 7});
  const auto want_shared = one_at_a_time(*e, shared, 6);
  const auto want_longer = one_at_a_time(*e, longer, 6);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 16, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = 200});
  le.add_request(make("first", shared, 6, out));
  run_to_end(le);
  le.add_request(make("again", shared, 6, out));
  le.add_request(make("longer", longer, 6, out));
  run_to_end(le);
  EXPECT_EQ(out["again"].cached, 39);
  EXPECT_EQ(out["longer"].cached, 40);
  EXPECT_EQ(out["first"].tokens, want_shared);
  EXPECT_EQ(out["again"].tokens, want_shared);
  EXPECT_EQ(out["longer"].tokens, want_longer);
  for (int i = 0; i < 6; ++i) {  // other traffic: fresh pages take the idle exact copies back
    le.add_request(make("other" + std::to_string(i), random_prompt(rng, 60, vocab), 4, out));
    run_to_end(le);
  }
  le.add_request(make("late", shared, 6, out));
  run_to_end(le);
  std::printf("[exact prefix] exact pages %d; the late repeat reused %d of 39 tokens\n", le.blocks().num_exact_pages(),
              out["late"].cached);
  EXPECT_LT(out["late"].cached, 39);
  EXPECT_EQ(out["late"].tokens, want_shared);
  EXPECT_EQ(le.blocks().num_used(), 0);
  expect_exact_pages_released(le.blocks());
}

// Exact tokens, the pool alone: conversations come back turn after turn, each turn's hit
// ending where the previous one ended, which reads the window before that boundary exact.
// Every prompt chunk takes exact pages back from idle copies; the copies behind the windows a
// later hit reads are stale (Scheduler::advance_exact) and go first, so the boundaries' copies
// outlive them: as many prompt tokens are computed as with an exact pool that loses nothing
// (64 sequences' worth), with the same tokens. Least recently idle first, the boundaries went
// first: 1172 tokens computed instead of 612.
TEST(Scheduler, PrefixCacheKeepsTheExactCopiesConversationsComeBackFor) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, 8, 3, 11);
  auto run = [&](int max_num_seqs) {
    std::mt19937 rng(11);
    const int vocab = e->config().vocab_size;
    const auto system = random_prompt(rng, 29, vocab);
    std::vector<std::vector<TokenId>> history(6, system);
    std::vector<std::vector<TokenId>> outputs;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = max_num_seqs, .max_num_batched_tokens = 64, .max_model_len = 256,
                                     .enable_prefix_caching = true, .num_blocks = 400});
    for (int turn = 0; turn < 3; ++turn)
      for (auto& h : history) {
        const auto user = random_prompt(rng, 20 + 7 * turn, vocab);
        h.insert(h.end(), user.begin(), user.end());
        std::map<std::string, Collected> out;
        le.add_request(make("c", h, 5, out));
        run_to_end(le);
        EXPECT_EQ(out["c"].reason, FinishReason::Length) << out["c"].error;
        h.insert(h.end(), out["c"].tokens.begin(), out["c"].tokens.end());
        outputs.push_back(out["c"].tokens);
      }
    EXPECT_EQ(le.blocks().num_used(), 0);
    expect_exact_pages_released(le.blocks());
    return std::tuple(outputs, le.stats().prompt_tokens_total, le.blocks().num_exact_pages());
  };
  const auto [tokens, computed, exact_pages] = run(2);
  const auto [roomy_tokens, roomy_computed, roomy_exact_pages] = run(64);
  std::printf("[exact prefix] conversations: %llu prompt tokens computed with %d exact pages, %llu with %d\n",
              (unsigned long long)computed, exact_pages, (unsigned long long)roomy_computed, roomy_exact_pages);
  EXPECT_EQ(tokens, roomy_tokens);
  EXPECT_EQ(computed, roomy_computed) << "the conversations' exact copies were taken back before stale ones";
  EXPECT_LT(exact_pages * 10, roomy_exact_pages);
}

// A whole prompt in the cache copies its last page (copy-on-write), and with exact tokens the
// copy needs an exact page too. With every exact page attached (the pool is small: one
// sequence), it is taken back from an idle one — never from a page this prompt's next query
// reads exact (its sink and window pages are held first). Here the first request fills 8
// whole pages (all cached, so the copy goes to a page without an exact one), and the oldest
// idle exact page, page 2's, is in the repeated prompt's window.
TEST(Scheduler, CopyOnWriteWithExactTokensKeepsTheWindowsCopies) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, 8, 2, 10);
  std::mt19937 rng(9);
  const auto first = random_prompt(rng, 60, e->config().vocab_size);
  const std::vector<TokenId> repeat(first.begin(), first.begin() + 32);  // 4 full pages of `first`
  const auto want = one_at_a_time(*e, repeat, 3);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 1, .max_num_batched_tokens = 16, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = 64});
  le.add_request(make("first", first, 5, out));
  run_to_end(le);
  ASSERT_EQ(le.blocks().num_exact_pages(), 7);  // 1 sink + 2 + 2 window pages + 2 for a step
  le.add_request(make("repeat", repeat, 3, out));
  run_to_end(le);
  EXPECT_EQ(out["repeat"].cached, 31);
  EXPECT_EQ(out["repeat"].tokens, want);
  expect_exact_pages_released(le.blocks());
}


TEST(Scheduler, PrefixCachingOffComputesEverything) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::mt19937 rng(3);
  const auto p = random_prompt(rng, 40, e->config().vocab_size);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 128,
                                   .enable_prefix_caching = false, .num_blocks = 64});
  le.add_request(make("a", p, 3, out));
  run_to_end(le);
  le.add_request(make("b", p, 3, out));
  run_to_end(le);
  EXPECT_EQ(out["b"].cached, 0);
  EXPECT_EQ(out["a"].tokens, out["b"].tokens);
  EXPECT_EQ(le.stats().prompt_tokens_total, 80u);
}

// peak_running: the most sequences in one step of a busy period, exact (bench reports it), and
// a new busy period starts from zero.
TEST(Scheduler, PeakRunningCountsOneBusyPeriod) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 3, .max_num_batched_tokens = 64, .max_model_len = 128,
                                   .enable_prefix_caching = false, .num_blocks = 64});
  for (int i = 0; i < 5; ++i) le.add_request(make("p" + std::to_string(i), {1, 2, TokenId(3 + i)}, 4, out));
  run_to_end(le);
  EXPECT_EQ(le.stats().peak_running, 3) << "five requests, at most three at once";
  EXPECT_EQ(le.stats().num_running, 0);
  le.add_request(make("alone", {1, 2, 3}, 4, out));
  run_to_end(le);
  EXPECT_EQ(le.stats().peak_running, 1) << "the next busy period counts from zero";
}

// --scheduling-policy priority: the lowest priority value is admitted first, and when pages
// run out the worst priority is preempted even when it is the older request; fcfs does the
// opposite on both counts.
TEST(Scheduler, PriorityOrdersAdmissionAndPreemption) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  for (const bool priority : {false, true}) {
    std::map<std::string, Collected> out;
    std::vector<std::string> first_token, finished;
    const auto tracked = [&](const std::string& id, int prio, int max_tokens) {
      EngineRequest r = make(id, {1, 2, 3, TokenId(4 + int(id.size()))}, max_tokens, out);
      r.priority = prio;
      auto inner = r.on_output;
      r.on_output = [&, id, inner](const RequestOutput& o) {
        if (!o.new_tokens.empty() && std::ranges::find(first_token, id) == first_token.end()) first_token.push_back(id);
        if (o.finished) finished.push_back(id);
        return inner(o);
      };
      return r;
    };
    {  // admission: one sequence at a time
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 1, .max_num_batched_tokens = 64, .max_model_len = 64,
                                       .enable_prefix_caching = false, .num_blocks = 32, .priority = priority});
      le.add_request(tracked("low-a", 5, 2));
      le.add_request(tracked("low-b", 5, 2));
      le.add_request(tracked("high", -1, 2));
      run_to_end(le);
      EXPECT_EQ(first_token, priority ? (std::vector<std::string>{"high", "low-a", "low-b"})
                                      : (std::vector<std::string>{"low-a", "low-b", "high"}));
    }
    finished.clear();
    {  // preemption: 6 pages of 8 tokens cannot hold both 34-token sequences
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 64, .max_model_len = 40,
                                       .enable_prefix_caching = false, .num_blocks = 6, .priority = priority});
      le.add_request(tracked("low", 3, 30));
      le.step();
      le.step();
      le.add_request(tracked("urgent", 0, 30));
      run_to_end(le);
      EXPECT_GT(le.stats().preemptions_total, 0u);
      EXPECT_EQ(finished, priority ? (std::vector<std::string>{"urgent", "low"}) : (std::vector<std::string>{"low", "urgent"}));
      EXPECT_EQ(out["low"].tokens.size(), 30u);
      EXPECT_EQ(out["urgent"].tokens.size(), 30u);
    }
  }
}

TEST(Scheduler, AbortAndStopCallbackFreePages) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 256,
                                   .enable_prefix_caching = true, .num_blocks = 64});
  le.add_request(make("abort-me", {1, 2, 3, 4, 5}, 100, out));
  auto stopper = make("stop-me", {1, 9, 8, 7}, 100, out);
  int seen = 0;
  auto inner = stopper.on_output;
  stopper.on_output = [&, inner](const RequestOutput& o) {
    inner(o);
    return ++seen < 3;  // "a stop string matched" after the third token
  };
  le.add_request(std::move(stopper));
  le.step();
  le.step();
  le.abort("abort-me");
  le.abort("no-such-request");
  run_to_end(le);
  EXPECT_EQ(out["abort-me"].reason, FinishReason::Abort);
  EXPECT_EQ(out["abort-me"].tokens.size(), 2u);
  EXPECT_EQ(out["stop-me"].reason, FinishReason::Stop);
  EXPECT_EQ(out["stop-me"].tokens.size(), 3u);
  EXPECT_EQ(out["stop-me"].finishes, 1);
  EXPECT_EQ(le.blocks().num_used(), 0);
  EXPECT_FALSE(le.is_live("abort-me"));
}

// A stop string matched in the text of a request's last allowed token: the client is told
// "stop", and /metrics must count it as stop too, not as length.
TEST(Scheduler, StopStringOnTheLastTokenCountsAsStop) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 256,
                                   .enable_prefix_caching = true, .num_blocks = 64});
  auto r = make("last", {1, 9, 8, 7}, 3, out);
  auto inner = r.on_output;
  r.on_output = [inner](const RequestOutput& o) {
    inner(o);
    return !o.finished;  // the stop string shows up in the third (last) token
  };
  le.add_request(std::move(r));
  le.add_request(make("plain", {1, 2, 3}, 3, out));
  run_to_end(le);
  const EngineStats st = le.stats();
  EXPECT_EQ(st.requests_finished_total.at("stop"), 1u);
  EXPECT_EQ(st.requests_finished_total.at("length"), 1u);
  EXPECT_EQ(out["last"].finishes, 1);
  EXPECT_EQ(le.blocks().num_used(), 0);
}

TEST(Scheduler, StopTokensRespectMinTokens) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378};
  const auto greedy = one_at_a_time(*e, prompt, 8);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 256,
                                   .enable_prefix_caching = true, .num_blocks = 64});
  auto a = make("a", prompt, 8, out);
  a.stop_token_ids = {greedy[0]};
  auto b = make("b", prompt, 8, out);
  b.stop_token_ids = {greedy[0]};
  b.min_tokens = 3;
  le.add_request(std::move(a));
  le.add_request(std::move(b));
  run_to_end(le);
  EXPECT_EQ(out["a"].tokens, std::vector<TokenId>{greedy[0]});
  EXPECT_EQ(out["a"].reason, FinishReason::Stop);
  ASSERT_GE(out["b"].tokens.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(out["b"].tokens[i], greedy[0]);
}

TEST(Scheduler, LogprobsAndPromptLogprobsMatchTheModel) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378, 324, 434, 412, 281, 266, 397};
  const std::vector<float> all = all_logits(*e, prompt, int(prompt.size()));
  const size_t vocab = size_t(e->config().vocab_size);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 4, .max_model_len = 64,
                                   .enable_prefix_caching = true, .num_blocks = 16});
  auto r = make("lp", prompt, 2, out);
  r.logprobs = 3;
  r.prompt_logprobs = 2;
  le.add_request(std::move(r));
  run_to_end(le);
  const Collected& c = out["lp"];
  ASSERT_EQ(c.prompt_logprobs.size(), prompt.size() - 1);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const auto row = std::span<const float>(all).subspan(i * vocab, vocab);
    EXPECT_EQ(c.prompt_logprobs[i].token, prompt[i + 1]);
    EXPECT_NEAR(c.prompt_logprobs[i].logprob, logprob_of(row, prompt[i + 1]), 1e-4);
    ASSERT_EQ(c.prompt_logprobs[i].top.size(), 2u);
  }
  ASSERT_EQ(c.logprobs.size(), 2u);
  const auto last = std::span<const float>(all).subspan((prompt.size() - 1) * vocab, vocab);
  EXPECT_EQ(c.logprobs[0].token, argmax(last));
  EXPECT_NEAR(c.logprobs[0].logprob, logprob_of(last, argmax(last)), 1e-4);
  EXPECT_EQ(c.logprobs[0].top.size(), 3u);
}

TEST(Scheduler, PromptLogitsArriveOnceInOrder) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const size_t vocab = size_t(e->config().vocab_size);
  std::mt19937 rng(5);
  const auto prompt = random_prompt(rng, 40, int(vocab));
  const std::vector<float> whole = all_logits(*e, prompt, 64);
  const std::vector<float> chunked = all_logits(*e, prompt, 7);
  ASSERT_EQ(whole.size(), prompt.size() * vocab);
  double worst = 0;
  for (size_t i = 0; i < whole.size(); ++i) worst = std::max(worst, double(std::fabs(whole[i] - chunked[i])));
  EXPECT_LT(worst, 1e-4);
  // In a shared engine, next to a generating request that preempts it.
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 8, .max_model_len = 64,
                                   .enable_prefix_caching = true, .num_blocks = 8});
  std::vector<float> got(prompt.size() * vocab, std::nanf(""));
  int next = 0, finishes = 0;
  std::map<std::string, Collected> out;
  le.add_request(make("gen", random_prompt(rng, 20, int(vocab)), 40, out));
  EngineRequest score{.id = "score", .prompt = prompt, .max_tokens = 0, .prompt_logits = true};
  score.on_output = [&](const RequestOutput& o) {
    if (!o.prompt_logits.empty()) {
      EXPECT_EQ(o.prompt_logits_begin, next);
      std::copy(o.prompt_logits.begin(), o.prompt_logits.end(), got.begin() + std::ptrdiff_t(size_t(next) * vocab));
      next += int(o.prompt_logits.size() / vocab);
    }
    EXPECT_TRUE(o.new_tokens.empty());
    if (o.finished) {
      ++finishes;
      EXPECT_EQ(o.finish_reason, FinishReason::Length);
    }
    return true;
  };
  le.add_request(std::move(score));
  run_to_end(le);
  EXPECT_GT(le.stats().preemptions_total, 0u);
  EXPECT_EQ(next, int(prompt.size()));
  EXPECT_EQ(finishes, 1);
  worst = 0;
  for (size_t i = 0; i < whole.size(); ++i) worst = std::max(worst, double(std::fabs(whole[i] - got[i])));
  EXPECT_LT(worst, 1e-4);
}

// prompt_logits_step (eval perplexity --decode-steps): the rows before prompt_logits_from run
// as chunks, every later one in a step of its own, and the logits are the chunked run's.
TEST(Scheduler, ScoredRowsRunOneAStepWhenAsked) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const size_t vocab = size_t(e->config().vocab_size);
  std::mt19937 rng(9);
  const auto prompt = random_prompt(rng, 40, int(vocab));
  const std::vector<float> whole = all_logits(*e, prompt, 64);
  constexpr int kFrom = 23;
  std::vector<int> firsts, counts;
  double worst = 0;
  score_tokens(
      *e, prompt, 16,
      [&](int first, std::span<const float> rows) {
        firsts.push_back(first);
        counts.push_back(int(rows.size() / vocab));
        for (size_t i = 0; i < rows.size(); ++i)
          worst = std::max(worst, double(std::fabs(rows[i] - whole[size_t(first) * vocab + i])));
      },
      kFrom, 1);
  ASSERT_EQ(firsts.size(), prompt.size() - size_t(kFrom));  // one delivery per scored row
  for (size_t i = 0; i < firsts.size(); ++i) {
    EXPECT_EQ(firsts[i], kFrom + int(i));
    EXPECT_EQ(counts[i], 1);
  }
  EXPECT_LT(worst, 1e-4);
  // The default runs the scored rows in chunks of the budget.
  int deliveries = 0;
  score_tokens(*e, prompt, 16, [&](int, std::span<const float>) { ++deliveries; }, kFrom);
  EXPECT_LT(deliveries, 3);
  EXPECT_THROW(score_tokens(*e, prompt, 16, [](int, std::span<const float>) {}, kFrom, -1), Error);
}

TEST(Scheduler, RejectsInvalidRequestsWithClearErrors) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 64,
                                   .enable_prefix_caching = true, .num_blocks = 16});
  auto expect_error = [&](EngineRequest r, const std::string& needle) {
    try {
      le.add_request(std::move(r));
      FAIL() << "accepted a request that should fail with: " << needle;
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
  };
  expect_error(make("a", {}, 4, out), "empty");
  expect_error(make("a", {1, 100000}, 4, out), "outside the model's vocabulary");
  expect_error(make("a", std::vector<TokenId>(64, 5), 1, out), "maximum context length is 64");
  expect_error(make("a", {1, 2}, 63, out), "lower max_tokens to at most 62");
  expect_error(make("a", {1, 2}, -1, out), "max_tokens must not be negative");
  auto bad = make("a", {1, 2}, 4, out);
  bad.sampling.top_p = 2;
  expect_error(std::move(bad), "top");
  le.add_request(make("dup", {1, 2}, 4, out));
  expect_error(make("dup", {1, 2}, 4, out), "already in use");
  EXPECT_THROW(LLMEngine(*e, SchedulerConfig{.max_model_len = 64, .num_blocks = 2}), Error);  // pool < one request
}

TEST(AsyncEngine, ManyThreadsSubmitAndAllFinish) {
  auto e = load(kStories, KVCacheDType::Fp8PerTokenHead, 8);
  std::mt19937 rng(11);
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < 12; ++i) prompts.push_back(random_prompt(rng, 3 + int(rng() % 40), e->config().vocab_size));
  std::vector<std::vector<TokenId>> expected;
  for (const auto& p : prompts) expected.push_back(one_at_a_time(*e, p, 10));

  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Collected> out;
  int finished = 0;
  {
    AsyncEngine ae(*e, SchedulerConfig{.max_num_seqs = 5, .max_num_batched_tokens = 32, .max_model_len = 128,
                                       .enable_prefix_caching = true, .num_blocks = 24});
    std::vector<std::thread> clients;
    for (size_t i = 0; i < prompts.size(); ++i)
      clients.emplace_back([&, i] {
        EngineRequest r;
        r.id = "c" + std::to_string(i);
        r.prompt = prompts[i];
        r.max_tokens = 10;
        r.sampling.temperature = 0;
        r.ignore_eos = true;
        r.on_output = [&, id = r.id](const RequestOutput& o) {
          std::lock_guard lock(mu);
          auto& c = out[id];
          c.tokens.insert(c.tokens.end(), o.new_tokens.begin(), o.new_tokens.end());
          if (o.finished) {
            c.reason = o.finish_reason;
            ++finished;
            cv.notify_all();
          }
          return true;
        };
        ae.add_request(std::move(r));
      });
    for (auto& t : clients) t.join();
    EXPECT_THROW(ae.add_request(EngineRequest{.id = "bad", .prompt = {}}), Error);
    std::unique_lock lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(120), [&] { return finished == int(prompts.size()); }));
    lock.unlock();
    const EngineStats st = ae.stats();
    EXPECT_EQ(st.requests_total, prompts.size());
    EXPECT_EQ(st.generation_tokens_total, 10u * prompts.size());
    EXPECT_EQ(st.time_to_first_token.count, prompts.size());
    EXPECT_EQ(st.inter_token_latency.count, 9u * prompts.size());
    ae.shutdown(true);
    EXPECT_THROW(ae.add_request(EngineRequest{.id = "late", .prompt = {1}}), Error);
  }
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(out["c" + std::to_string(i)].tokens, expected[i]) << i;
}

TEST(AsyncEngine, ShutdownWithoutDrainAbortsInFlightRequests) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::atomic<int> aborted{0}, tokens{0};
  AsyncEngine ae(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 512,
                                     .enable_prefix_caching = true, .num_blocks = 128});
  for (int i = 0; i < 3; ++i) {
    EngineRequest r;
    r.id = "long" + std::to_string(i);
    r.prompt = {1, 2, 3};
    r.max_tokens = 500;
    r.ignore_eos = true;
    r.on_output = [&](const RequestOutput& o) {
      tokens += int(o.new_tokens.size());
      if (o.finished && o.finish_reason == FinishReason::Abort) ++aborted;
      return true;
    };
    ae.add_request(std::move(r));
  }
  while (tokens.load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ae.shutdown(false);
  EXPECT_EQ(aborted.load(), 3);
  EXPECT_LT(tokens.load(), 1500);
  // After shutdown a request is refused with the shutdown type (a server's 503), not as invalid.
  EngineRequest late;
  late.id = "late";
  late.prompt = {1, 2, 3};
  EXPECT_THROW(ae.add_request(std::move(late)), EngineShutDown);
}

}  // namespace

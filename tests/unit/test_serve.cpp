// The serving engine: block manager (reference counts, prefix cache, LRU eviction), the
// scheduler (continuous batching, chunked prefill, preemption, prefix reuse with
// copy-on-write, aborts, stop callbacks, prompt logprobs) and the async wrapper — checked
// against single-request generation on real checkpoints.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <thread>

#include "config/speculative_config.h"
#include "core/error.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "engine/async_engine.h"
#include "engine/block_manager.h"
#include "engine/llm_engine.h"
#include "engine/memory_plan.h"
#include "io/tokenizer/tokenizer.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"
#include "serve_test_util.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::testing;

namespace {

const fs::path kTests = KVLM_TEST_DATA;
const fs::path kStories = fs::path(KVLM_TEST_DATA) / ".." / "models" / "stories260K";
const fs::path kQwen3Mixed = kTests / "golden" / "models" / "qwen3-mixed";

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


// Every exact page is free or idle again (no hold outlives its sequence).
void expect_exact_pages_released(const BlockManager& b) {
  EXPECT_EQ(b.num_exact_available(), b.num_exact_pages()) << "exact pages still held";
  for (BlockId i = 0; i < b.num_blocks(); ++i) EXPECT_EQ(b.exact_holds(i), 0) << "page " << i;
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

// ---------------------------------------------------------------- scheduler





// Greedy outputs of a continuously batched, chunk-prefilled, preempted run equal the
// outputs of the same prompts run one at a time — per model, with mixed attention kinds.
void check_batched_equals_sequential(const fs::path& model, KVCacheDType dt, int num_blocks, int budget, int keep_sink = 0,
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

namespace {

// A runner that says it samples on its device: the base ModelRunner::forward_sampled (host
// sample_gumbel), so the engine's split between rows sampled by the runner and rows whose
// logits come back is exercised on the CPU. Counts what it was asked for.
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
  int kv_num_blocks() const override { return inner_->kv_num_blocks(); }
  size_t kv_bytes() const override { return inner_->kv_bytes(); }
  void forward(const ForwardBatch& b, std::span<float> logits) override {
    ++plain_forwards;
    inner_->forward(b, logits);
  }
  void copy_blocks(std::span<const PageCopy> copies) override { inner_->copy_blocks(copies); }
  bool samples_on_device() const override { return true; }
  void forward_sampled(const ForwardBatch& b, std::span<const RowSampling> rows, std::span<TokenId> tokens,
                       std::span<float> host_logits) override {
    int dev = 0, host = 0;
    for (const RowSampling& r : rows) ++(r.on_device ? dev : host);
    device_rows += dev;
    host_rows += host;
    mixed_steps += dev > 0 && host > 0;
    ModelRunner::forward_sampled(b, rows, tokens, host_logits);
    --plain_forwards;  // the base implementation's own forward()
  }
  void reset_counters() { device_rows = host_rows = mixed_steps = plain_forwards = 0; }
  int device_rows = 0, host_rows = 0, mixed_steps = 0, plain_forwards = 0;

 private:
  std::unique_ptr<ModelRunner> inner_;
};

}  // namespace

// With a runner that samples where the logits are, plain sampled requests draw their tokens
// there (the Gumbel sampler, reproducible from the seed and the token position), while rows
// with logprobs, penalties or prompt logprobs still come back to the host — in the same steps.
TEST(Scheduler, RunnerSideSamplingAndHostRowsShareSteps) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  DeviceSamplingRunner* runner = nullptr;
  e->wrap_model([&](std::unique_ptr<ModelRunner> inner) {
    auto r = std::make_unique<DeviceSamplingRunner>(std::move(inner));
    runner = r.get();
    return r;
  });
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378, 324, 434, 412, 281, 266, 397};
  const SamplingParams sp{.temperature = 0.9f, .top_k = 40, .top_p = 0.95f};
  // The reference: teacher-forced logits of the sampled continuation, drawn by sample_gumbel.
  auto reference = [&](uint64_t seed, int n) {
    std::vector<TokenId> seq = prompt;
    const size_t vocab = size_t(e->config().vocab_size);
    for (int i = 0; i < n; ++i) {
      const std::vector<float> all = all_logits(*e, seq, 64);
      seq.push_back(sample_gumbel(std::span(all).last(vocab), sp, seed, uint64_t(i)));
    }
    return std::vector<TokenId>(seq.begin() + std::ptrdiff_t(prompt.size()), seq.end());
  };
  const int n = 12;
  // (before the LLMEngine: scoring reallocates the runner's KV pool)
  const std::vector<TokenId> greedy = one_at_a_time(*e, prompt, n);
  const std::vector<TokenId> ref11 = reference(11, n), ref12 = reference(12, n);
  runner->reset_counters();  // the references ran through it too
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 64,
                                   .enable_prefix_caching = true, .num_blocks = 48});
  for (uint64_t seed : {11u, 12u}) {
    auto r = make("s" + std::to_string(seed), prompt, n, out);
    r.sampling = sp;
    r.seed = seed;
    le.add_request(std::move(r));
  }
  auto greedy_lp = make("lp", prompt, n, out);
  greedy_lp.logprobs = 2;
  greedy_lp.prompt_logprobs = 1;
  le.add_request(std::move(greedy_lp));
  auto penalized = make("pen", prompt, n, out);
  penalized.sampling.repetition_penalty = 2.0f;
  le.add_request(std::move(penalized));
  run_to_end(le);

  EXPECT_EQ(out["s11"].tokens, ref11);
  EXPECT_EQ(out["s12"].tokens, ref12);
  EXPECT_NE(out["s11"].tokens, out["s12"].tokens);
  EXPECT_EQ(out["lp"].tokens, greedy);  // greedy, sampled on the host
  EXPECT_EQ(out["lp"].logprobs.size(), size_t(n));
  EXPECT_EQ(out["lp"].prompt_logprobs.size(), prompt.size() - 1);
  EXPECT_EQ(out["pen"].tokens.size(), size_t(n));
  // The penalty changed the greedy continuation (host Sampler with the penalty applied).
  EXPECT_NE(out["pen"].tokens, greedy);
  EXPECT_EQ(runner->device_rows, 2 * n);
  EXPECT_GE(runner->host_rows, 2 * n + int(prompt.size()) - 1);
  EXPECT_GT(runner->mixed_steps, 0);
  EXPECT_EQ(runner->plain_forwards, 0) << "the engine should use forward_sampled with such a runner";
  EXPECT_EQ(le.blocks().num_used(), 0);
  const EngineStats st = le.stats();
  EXPECT_GT(st.forward_seconds_total, 0.0);
  EXPECT_GE(st.sample_seconds_total, 0.0);
  EXPECT_GT(st.schedule_seconds_total, 0.0);
}

namespace {

// A drafter that knows where each prompt's continuation should go (`script`, by the prompt's
// first token) and proposes it, wrong on purpose at draft position 1 on every third call, so
// that verification both accepts and rejects.
class ScriptedProposer final : public DraftProposer {
 public:
  ScriptedProposer(std::map<TokenId, std::vector<TokenId>> script, int k, int vocab)
      : script_(std::move(script)), k_(k), vocab_(vocab) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override {
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = *seqs[i];
      const auto& cont = script_.at(s.tokens[0]);
      const int at = s.num_output();
      for (int j = 0; j < std::min(k_, max_draft[i]) && at + j < int(cont.size()); ++j)
        s.draft.push_back(cont[size_t(at + j)]);
      if (++calls % 3 == 0 && s.draft.size() > 1) s.draft[1] = (s.draft[1] + 1) % vocab_;
    }
  }
  int calls = 0;

 private:
  std::map<TokenId, std::vector<TokenId>> script_;
  int k_, vocab_;
};

}  // namespace

// A multi-token step per sequence: the draft rows run with the sequence's last token, each
// with its logits, and the verification keeps exactly the tokens plain decoding would have
// made — greedy and seeded sampling, host- and runner-side sampling, several sequences at
// once, with chunked prefill, a pool small enough to preempt, and the prefix cache on. The
// cache is the exact fp32 one: a verification step's rows go through GEMMs of another shape
// than one-row decode, and in a quantized cache such a last-bit difference can move a code
// across a rounding boundary, which would make exact token equality a test of luck.
TEST(Scheduler, SpeculativeStepsGiveThePlainOutputs) {
  for (const auto [device_sampling, exact] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
    SCOPED_TRACE(std::string(device_sampling ? "runner-side sampling" : "host sampling") +
                 (exact ? ", int4 with exact sink 2 / recent 6 tokens" : ""));
    auto e = exact ? load(kStories, KVCacheDType::Int4PerTokenHead, 8, 2, 6) : load(kStories, KVCacheDType::Auto, 8);
    if (device_sampling)
      e->wrap_model([](std::unique_ptr<ModelRunner> inner) { return std::make_unique<DeviceSamplingRunner>(std::move(inner)); });
    std::mt19937 rng(3);
    const int vocab = e->config().vocab_size;
    std::vector<std::vector<TokenId>> prompts;
    for (int i = 0; i < 4; ++i) {
      auto p = random_prompt(rng, 9 + 7 * i, vocab);
      p[0] = TokenId(10 + i);  // the script's key
      prompts.push_back(p);
    }
    const SamplingParams sampled{.temperature = 0.8f, .top_k = 50};
    auto run = [&](std::unique_ptr<DraftProposer> proposer, int num_blocks, EngineStats* stats) {
      std::map<std::string, Collected> out;
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 24, .max_model_len = 96,
                                       .enable_prefix_caching = true, .num_blocks = num_blocks});
      if (proposer) le.set_proposer(std::move(proposer));
      for (size_t i = 0; i < prompts.size(); ++i) {
        auto r = make("r" + std::to_string(i), prompts[i], 20, out);
        if (i % 2 == 1) {
          r.sampling = sampled;
          r.seed = 100 + i;
        }
        if (i == 3) r.logprobs = 2;  // host rows in a runner-sampling engine
        le.add_request(std::move(r));
      }
      run_to_end(le);
      EXPECT_EQ(le.blocks().num_used(), 0);
      expect_exact_pages_released(le.blocks());
      if (stats) *stats = le.stats();
      std::vector<Collected> v;
      for (size_t i = 0; i < prompts.size(); ++i) v.push_back(out["r" + std::to_string(i)]);
      return v;
    };
    EngineStats plain_stats, spec_stats;
    const auto plain = run(nullptr, 64, &plain_stats);
    std::map<TokenId, std::vector<TokenId>> script;
    for (size_t i = 0; i < prompts.size(); ++i) script[prompts[i][0]] = plain[i].tokens;
    const auto spec = run(std::make_unique<ScriptedProposer>(script, 4, vocab), 64, &spec_stats);
    // A quantized cache makes the sampled requests (odd) a poor probe: a verification step
    // computes K/V in a batch of rows whose last bits differ from one row's, a code on a
    // rounding boundary flips, and a close draw of the sampler goes the other way (plain
    // int4 does the same without exact tokens). The greedy ones hold the exact bookkeeping
    // (rejected drafts trimmed, windows moved on, preemption) to the plain outputs.
    auto compared = [&](size_t i) { return !exact || i % 2 == 0; };
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (!compared(i)) continue;
      EXPECT_EQ(spec[i].tokens, plain[i].tokens) << "request " << i;
      EXPECT_EQ(spec[i].reason, plain[i].reason) << "request " << i;
      ASSERT_EQ(spec[i].logprobs.size(), plain[i].logprobs.size());
      for (size_t j = 0; j < spec[i].logprobs.size(); ++j)
        EXPECT_NEAR(spec[i].logprobs[j].logprob, plain[i].logprobs[j].logprob, 1e-4);
    }
    EXPECT_GT(spec_stats.spec_accepted_tokens_total, 0u);
    EXPECT_LT(spec_stats.spec_accepted_tokens_total, spec_stats.spec_draft_tokens_total) << "no draft was rejected";
    EXPECT_LT(spec_stats.steps_total, plain_stats.steps_total);
    EXPECT_EQ(spec_stats.generation_tokens_total, plain_stats.generation_tokens_total);
    // A pool that forces preemption: drafts give way first, outputs stay the same.
    const auto tight = run(std::make_unique<ScriptedProposer>(script, 4, vocab), 14, nullptr);
    for (size_t i = 0; i < prompts.size(); ++i)
      if (compared(i)) EXPECT_EQ(tight[i].tokens, plain[i].tokens) << "request " << i;
  }
}

namespace {

// Records how many sequences each propose() call saw, then drafts nothing.
class CountingProposer final : public DraftProposer {
 public:
  explicit CountingProposer(std::vector<size_t>& calls) : calls_(calls) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int>) override { calls_.push_back(seqs.size()); }

 private:
  std::vector<size_t>& calls_;
};

}  // namespace

// disable_by_batch_size (vLLM's key): while more sequences run than the limit, nothing is
// proposed; once the batch shrinks to it, drafting resumes.
TEST(Scheduler, DraftingPausesAboveTheBatchSizeLimit) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::mt19937 rng(5);
  const int vocab = e->config().vocab_size;
  for (const int limit : {0, 1, 2}) {
    std::vector<size_t> calls;
    std::map<std::string, Collected> out;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 96,
                                     .enable_prefix_caching = true, .num_blocks = 64});
    le.set_proposer(std::make_unique<CountingProposer>(calls), limit);
    for (int i = 0; i < 4; ++i) le.add_request(make("r" + std::to_string(i), random_prompt(rng, 6, vocab), 4 + 6 * i, out));
    run_to_end(le);
    ASSERT_FALSE(calls.empty()) << "limit " << limit;
    const size_t most = *std::ranges::max_element(calls);
    if (limit == 0) EXPECT_EQ(most, 4u) << "no limit: every decoding sequence is offered to the proposer";
    else EXPECT_LE(most, size_t(limit)) << "proposals while more than " << limit << " sequences ran";
  }
  const SpeculativeConfig c =
      parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":3,"disable_by_batch_size":16})");
  EXPECT_EQ(c.disable_by_batch_size, 16);
}

namespace {

// Proposes one fixed token after the first output token (a deterministic drafter).
class FixedDraft final : public DraftProposer {
 public:
  explicit FixedDraft(TokenId t) : t_(t) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override {
    for (size_t i = 0; i < seqs.size(); ++i)
      if (seqs[i]->num_output() == 1 && max_draft[i] >= 1) seqs[i]->draft = {t_};
  }

 private:
  TokenId t_;
};

// Pearson's chi-square of `counts` (n draws) against probabilities `p`, bins with an expected
// count under 5 pooled; returns {statistic, the p = 1e-4 critical value for its degrees of
// freedom (Wilson-Hilferty)}.
std::pair<double, double> chi_square(const std::map<TokenId, int>& counts, int n, std::span<const double> p) {
  double stat = 0, rest_obs = 0, rest_exp = 0;
  int bins = 0;
  for (size_t t = 0; t < p.size(); ++t) {
    const double expect = p[t] * n;
    const auto it = counts.find(TokenId(t));
    const double obs = it == counts.end() ? 0 : it->second;
    if (expect < 5) {
      rest_obs += obs;
      rest_exp += expect;
      continue;
    }
    stat += (obs - expect) * (obs - expect) / expect;
    ++bins;
  }
  if (rest_exp > 0) {
    stat += (rest_obs - rest_exp) * (rest_obs - rest_exp) / rest_exp;
    ++bins;
  }
  const double df = bins - 1, z = 3.719;  // one-sided 1e-4
  const double crit = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  return {stat, crit};
}

}  // namespace

// Sampling at temperature 1 with a draft to verify keeps the target's distribution: the second
// output token, drawn by a verification step (a fixed draft token proposed for it, accepted
// when the target's own draw agrees), follows the target's next-token probabilities exactly — a
// chi-square test over 4000 seeds — and the same test rejects a sampler that is off by a
// temperature of 1.25, so it can tell.
TEST(Scheduler, DraftedSamplingKeepsTheTargetDistribution) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378, 324, 434, 412, 281, 266};
  const size_t vocab = size_t(e->config().vocab_size);
  const int N = 4000;
  // The most likely first token and, after it, the target's distribution of the second.
  const std::vector<float> first = all_logits(*e, prompt, 64);
  const TokenId t1 = argmax(std::span<const float>(first).last(vocab));
  std::vector<TokenId> ctx = prompt;
  ctx.push_back(t1);
  const std::vector<float> second = all_logits(*e, ctx, 64);
  const auto row = std::span<const float>(second).last(vocab);
  std::vector<double> p(vocab);
  const float mx = *std::ranges::max_element(row);
  double z = 0;
  for (size_t v = 0; v < vocab; ++v) z += p[v] = std::exp(double(row[v] - mx));
  for (double& x : p) x /= z;
  const TokenId draft = TokenId(std::ranges::max_element(p) - p.begin());

  std::map<std::string, Collected> out;
  EngineStats st;
  {
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 256, .max_num_batched_tokens = 4096, .max_model_len = 64,
                                     .enable_prefix_caching = true, .num_blocks = 1024});
    le.set_proposer(std::make_unique<FixedDraft>(draft));
    for (int i = 0; i < N; ++i) {
      auto r = make("s" + std::to_string(i), prompt, 3, out);  // the draft for token 2, room for the token after it
      r.sampling.temperature = 1.0f;
      r.seed = uint64_t(1000 + i);
      r.ignore_eos = true;
      le.add_request(std::move(r));
    }
    run_to_end(le);
    st = le.stats();
  }
  std::map<TokenId, int> counts;
  int n = 0;
  for (const auto& [id, c] : out) {
    ASSERT_EQ(c.tokens.size(), 3u) << id;
    if (c.tokens[0] != t1) continue;
    ++counts[c.tokens[1]];
    ++n;
  }
  ASSERT_GT(n, 500) << "too few samples start with the most likely token";
  EXPECT_GT(st.spec_accepted_tokens_total, 0u);
  EXPECT_LT(st.spec_accepted_tokens_total, st.spec_draft_tokens_total);
  const auto [stat, crit] = chi_square(counts, n, p);
  EXPECT_LT(stat, crit) << "drafted samples of the second token do not follow the target's distribution (" << n
                        << " samples)";
  // The test's power: the same number of draws at temperature 1.25 (a sampler off by that much)
  // must fail it.
  std::map<TokenId, int> biased;
  for (int i = 0; i < n; ++i) {
    Sampler s(uint64_t(77 + i));
    ++biased[s.sample(row, SamplingParams{.temperature = 1.25f})];
  }
  const auto [bstat, bcrit] = chi_square(biased, n, p);
  EXPECT_GT(bstat, bcrit) << "the chi-square test cannot tell a temperature-1.25 sampler from the target";
  std::printf("[spec-dist] %d samples: chi2 %.1f (critical %.1f); temperature-1.25 sampler: chi2 %.1f\n", n, stat, crit,
              bstat);
}

// Scoring a prompt (max_tokens 0, prompt logits) through the engine: every row arrives once,
// in order, equal to one unchunked pass, also when the sequence is preempted and recomputed.
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

// The prefix cache's host tier (engine/host_kv_tier.h, --kv-offload-gib): pages the pool
// evicts are copied out in their stored format and come back, byte for byte, under their own
// serials; the serving engine's greedy tokens are the same with and without the tier in every
// KV format and a mixed per-layer plan, while the tier turns recomputed prompt tokens into
// restored ones.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "core/error.h"
#include "engine/block_manager.h"
#include "engine/host_kv_tier.h"
#include "engine/llm_engine.h"
#include "engine/memory_plan.h"
#include "model/cpu/cpu_runner.h"
#include "host_tier_test_util.h"
#include "serve_test_util.h"

using namespace kvlm;
using namespace kvlm::testing;

namespace {

constexpr int kBs = kTierBlock;

// Fills page `id` of every layer (codes and scales) with bytes derived from `tag`.
void fill_page(KVCache& c, BlockId id, uint8_t tag) {
  for (size_t l = 0; l < c.num_layers(); ++l) {
    LayerKVCache& L = c.layer(l);
    const KVPageBytes p = kv_page_bytes(*L.spec, c.block_size());
    auto fill = [&](uint8_t* pool, size_t bytes, uint8_t salt) {
      for (size_t i = 0; i < bytes; ++i) pool[size_t(id) * bytes + i] = uint8_t(tag * 31 + salt + i);
    };
    fill(L.k.data(), p.k_codes, uint8_t(l * 4));
    fill(L.v.data(), p.v_codes, uint8_t(l * 4 + 1));
    fill(reinterpret_cast<uint8_t*>(L.k_scale.data()), p.k_scales, uint8_t(l * 4 + 2));
    fill(reinterpret_cast<uint8_t*>(L.v_scale.data()), p.v_scales, uint8_t(l * 4 + 3));
  }
}

std::vector<uint8_t> page_of(const KVCache& c, BlockId id) {
  std::vector<uint8_t> out(c.page_bytes());
  c.save_page(id, out);
  return out;
}

// The chain hash of page `i` of `tokens` (page_hash.h), as the scheduler keeps it.
PageHash chain_at(const BlockManager& bm, std::span<const TokenId> tokens, int i) {
  PageHash h;
  for (int j = 0; j <= i; ++j) h = bm.chain_of(j == 0 ? nullptr : &h, tokens.subspan(size_t(j * kBs), kBs));
  return h;
}

// Registers page `i` of `tokens` in page `id` after the page of serial `parent`, with its chain.
uint64_t reg(BlockManager& bm, BlockId id, uint64_t parent, std::span<const TokenId> tokens, int i) {
  return bm.register_full(id, parent, tokens.subspan(size_t(i * kBs), kBs), chain_at(bm, tokens, i));
}

std::vector<TokenId> chain_tokens(int pages, int first) {
  std::vector<TokenId> t(size_t(pages * kBs));
  for (size_t i = 0; i < t.size(); ++i) t[i] = TokenId(first + int(i));
  return t;
}

}  // namespace

// The block manager with a tier of 3 pages over a pool of 4: a chain of 3 cached pages
// evicted by fresh allocations goes to the tier, comes back byte for byte under the same
// serials (so the chain continues), is not copied out twice, and the tier replaces its
// least recently used entry when full.
TEST(HostTier, EvictedPagesComeBackUnderTheirSerials) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kBs);
  auto& runner = dynamic_cast<CpuModelRunner&>(e->model());
  runner.allocate_kv(4, kBs);
  KVCache& cache = *runner.kv_cache();
  ASSERT_GT(cache.layer(0).k_scale.size(), 0u) << "int4 per token-head pages carry scales";
  EXPECT_EQ(runner.kv_page_bytes(kBs), cache.page_bytes());

  BlockManager bm(4, kBs, true);
  HostKVTier tier(runner, kBs, 3);
  EXPECT_EQ(tier.page_bytes(), cache.page_bytes());
  bm.set_lower_tier(&tier, kv_root("test"));

  const auto chain = chain_tokens(3, 100);
  std::vector<BlockId> ids;
  std::vector<uint64_t> serials;
  std::vector<std::vector<uint8_t>> want;
  uint64_t parent = 0;
  for (int i = 0; i < 3; ++i) {
    const BlockId id = *bm.allocate();
    fill_page(cache, id, uint8_t(i + 1));
    want.push_back(page_of(cache, id));
    parent = reg(bm, id, parent, chain, i);
    ids.push_back(id);
    serials.push_back(parent);
  }
  for (BlockId id : ids) bm.release(id);

  // Four fresh pages: the uncached one first, then the three cached ones, least recent first.
  std::vector<BlockId> fresh;
  for (int i = 0; i < 4; ++i) fresh.push_back(*bm.allocate());
  EXPECT_EQ(tier.size(), 3u);
  EXPECT_EQ(tier.pages_kept(), 3u);
  for (BlockId id : fresh) fill_page(cache, id, 0xEE);  // the pool's copies are gone
  for (BlockId id : fresh) bm.release(id);

  std::vector<BlockId> found;
  std::vector<uint64_t> found_serials;
  ASSERT_EQ(bm.match_prefix(chain, found, found_serials), 3);
  EXPECT_EQ(found_serials, serials);
  EXPECT_EQ(tier.pages_restored(), 0u) << "copied back only when the caller commits";
  bm.commit_restores();
  EXPECT_EQ(bm.lower_tier_hits(), uint64_t(3 * kBs));
  EXPECT_EQ(tier.pages_restored(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(page_of(cache, found[size_t(i)]), want[size_t(i)]) << "page " << i;
  // A chain that starts with a pool page and goes on in the tier: the next page after the
  // chain, registered now, chains to the restored serial.
  const auto longer = chain_tokens(4, 100);
  const BlockId fourth = *bm.allocate();
  EXPECT_GT(reg(bm, fourth, serials.back(), longer, 3), serials.back());
  for (BlockId id : found) bm.release(id);
  bm.release(fourth);

  // Evicted again: the tier still holds those serials, so nothing is copied out twice.
  for (int i = 0; i < 4; ++i) fresh[size_t(i)] = *bm.allocate();
  EXPECT_EQ(tier.pages_kept(), 4u) << "only the fourth page is new to the tier";
  EXPECT_EQ(tier.size(), 3u);
  EXPECT_EQ(tier.evictions(), 1u) << "the least recently used entry made room for the fourth";
  for (BlockId id : fresh) bm.release(id);

  // The first page of the chain was the least recently used: it is gone, so nothing matches
  // (the chain's later pages are unreachable without it) and no page was restored.
  found.clear();
  found_serials.clear();
  EXPECT_EQ(bm.match_prefix(longer, found, found_serials), 0);
  bm.commit_restores();
  EXPECT_EQ(tier.pages_restored(), 3u);
}

// Pages of a hit that the caller releases before commit_restores (admit_prefix ending a hit
// early) are not copied back: they lose their identity, so no later match can find a page
// whose contents never arrived, and their entries stay in the tier for the next match.
TEST(HostTier, PagesDroppedBeforeTheCommitAreNotRestored) {
  auto e = load(kStories, KVCacheDType::Int8PerTokenHead, kBs);
  auto& runner = dynamic_cast<CpuModelRunner&>(e->model());
  runner.allocate_kv(3, kBs);
  KVCache& cache = *runner.kv_cache();
  BlockManager bm(3, kBs, true);
  HostKVTier tier(runner, kBs, 4);
  bm.set_lower_tier(&tier, kv_root("test"));
  const auto chain = chain_tokens(2, 40);
  uint64_t parent = 0;
  std::vector<BlockId> ids;
  std::vector<std::vector<uint8_t>> want;
  for (int i = 0; i < 2; ++i) {
    ids.push_back(*bm.allocate());
    fill_page(cache, ids.back(), uint8_t(9 + i));
    want.push_back(page_of(cache, ids.back()));
    parent = reg(bm, ids.back(), parent, chain, i);
  }
  for (BlockId id : ids) bm.release(id);
  std::vector<BlockId> fresh;
  for (int i = 0; i < 3; ++i) fresh.push_back(*bm.allocate());  // both chain pages go to the tier
  EXPECT_EQ(tier.size(), 2u);
  for (BlockId id : fresh) {
    fill_page(cache, id, 0xEE);
    bm.release(id);
  }

  std::vector<BlockId> found;
  std::vector<uint64_t> serials;
  ASSERT_EQ(bm.match_prefix(chain, found, serials), 2);
  bm.release(found.back());  // the caller keeps only the first page
  bm.commit_restores();
  EXPECT_EQ(tier.pages_restored(), 1u);
  EXPECT_EQ(bm.lower_tier_hits(), uint64_t(kBs));
  EXPECT_EQ(page_of(cache, found[0]), want[0]);
  bm.release(found[0]);

  // The dropped page is not findable in the pool; the next match restores it from the tier.
  found.clear();
  serials.clear();
  ASSERT_EQ(bm.match_prefix(chain, found, serials), 2);
  bm.commit_restores();
  EXPECT_EQ(tier.pages_restored(), 2u) << "the first page was still in the pool";
  for (int i = 0; i < 2; ++i) EXPECT_EQ(page_of(cache, found[size_t(i)]), want[size_t(i)]) << "page " << i;
  for (BlockId id : found) bm.release(id);
}

// A restore needs a pool page; with every page referenced the hit stops there and the entry
// stays in the tier for later.
TEST(HostTier, NoFreePageEndsTheHit) {
  auto e = load(kStories, KVCacheDType::Auto, kBs);
  auto& runner = dynamic_cast<CpuModelRunner&>(e->model());
  runner.allocate_kv(2, kBs);
  BlockManager bm(2, kBs, true);
  HostKVTier tier(runner, kBs, 4);
  bm.set_lower_tier(&tier, kv_root("test"));
  const auto chain = chain_tokens(1, 7);
  const BlockId a = *bm.allocate();
  reg(bm, a, 0, chain, 0);
  bm.release(a);
  const BlockId x = *bm.allocate(), y = *bm.allocate();  // a is evicted into the tier
  EXPECT_EQ(tier.size(), 1u);
  std::vector<BlockId> found;
  std::vector<uint64_t> serials;
  EXPECT_EQ(bm.match_prefix(chain, found, serials), 0);
  bm.commit_restores();
  bm.release(x);
  EXPECT_EQ(bm.match_prefix(chain, found, serials), 1);
  bm.commit_restores();
  EXPECT_EQ(tier.pages_restored(), 1u);
  bm.release(found[0]);
  bm.release(y);
}


TEST(HostTier, GreedyTokensUnchangedInEveryFormat) {
  for (KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::BFloat16, KVCacheDType::Fp8E4M3,
                          KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                          KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load(kStories, dt, kBs);
    check_tier_is_exact(*e);
  }
}

// Tensor parallelism: a page in the tiers is each rank's part of it (its KV heads), rank after
// rank, copied by every rank at once; tokens are those of a pool that keeps everything, also
// through a disk tier and after a restart; exact pages likewise.
TEST(HostTier, TensorParallelRanksKeepTheirPartsOfEachPage) {
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    ModelOptions o;
    o.model_dir = kStories;
    o.cache.kv_cache_dtype = dt;
    o.cache.block_size = kBs;
    o.tensor_parallel_size = 2;
    auto e = LoadedModel::load(o);
    ASSERT_EQ(e->tensor_parallel_size(), 2);
    e->model().allocate_kv(4, kBs);
    EXPECT_EQ(e->model().kv_page_bytes(kBs), kv_page_bytes(e->plan(), kBs)) << "the ranks' parts make the whole page";
    check_tier_is_exact(*e);

    const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "kvlm_tp_disk";
    std::filesystem::remove_all(dir);
    const Workload all = run_conversations(*e, 400, 0, 6, 3);
    const Workload disk = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20);
    EXPECT_EQ(disk.outputs, all.outputs);
    EXPECT_GT(disk.stats.kv_offload_disk_read_total, 0u);
    const Workload again = run_conversations(*e, 20, 12, 6, 3, dir.string(), 64 << 20);  // a restart
    EXPECT_EQ(again.outputs, all.outputs);
    EXPECT_LT(again.stats.prompt_tokens_total, disk.stats.prompt_tokens_total) << "the first run's pages are found";
  }
  // Exact pages: each rank's part of an exact page too.
  ModelOptions o;
  o.model_dir = kStories;
  o.cache.kv_cache_dtype = KVCacheDType::Int4PerTokenHead;
  o.cache.block_size = kBs;
  o.cache.keep_sink = 3;
  o.cache.keep_recent = 11;
  o.tensor_parallel_size = 2;
  auto e = LoadedModel::load(o);
  e->model().allocate_kv(4, kBs, 2);
  EXPECT_EQ(e->model().kv_page_bytes(kBs, PageKind::Exact), kv_exact_page_bytes(e->plan(), kBs));
  check_exact_pages_come_back(*e);
}

// Exact sink / recent tokens without exact pages in the tier: restored pages come back without
// exact copies, so a hit stops before a page a query must read exact; the tokens stay the same.
// In this workload every hit ends that way, even in the large pool: a turn's hit ends in the
// previous turn's last pages, which its recent window reads exact, and their idle exact copies
// have been taken back for other conversations by then — so the tier saves nothing here, and
// copies nothing back that the hit would drop.
TEST(HostTier, GreedyTokensUnchangedWithExactTokens) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11);
  check_tier_is_exact(*e, /*saves=*/false);
}

// With exact pages in the tier (PageKind::Exact beside the pages): an exact copy a cached page
// gives up — its page evicted, or its idle exact page taken back for another sequence — is kept
// there, and a hit whose query reads that page exact takes it back. The hits that ended before
// the previous turn's last pages now go through them: fewer prompt tokens are computed than
// with the large pool alone (whose idle exact copies are lost), and the tokens are the same.
TEST(HostTier, ExactPagesComeBackFromTheTier) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11);
  check_exact_pages_come_back(*e);
}

// A hit that takes several exact copies back from a small exact tier while the exact pool is
// full of idle copies: each idle copy taken back to make room is kept in the tier, and that keep
// must not replace the entry of a page the same hit restores next. Pages A and B give their
// exact copies up to C and D (the tier, of 2 entries, keeps them); then A and B are restored
// together, which takes C's and D's back. Restoring A alone first, C's copy would have replaced
// B's entry (the least recently used one not pinned) and B's restore would fail.
TEST(HostTier, RestoringSeveralExactPagesKeepsTheirEntries) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11);
  auto& runner = dynamic_cast<CpuModelRunner&>(e->model());
  runner.allocate_kv(8, kBs, 2);
  BlockManager bm(8, kBs, true, /*num_exact_pages=*/2);
  HostKVTier pages(runner, kBs, 8);
  HostKVTier exact(runner, kBs, 2, nullptr, PageKind::Exact);
  bm.set_lower_tier(&pages, kv_root("test"), &exact);
  std::vector<BlockId> ids;  // A, B, C, D: one page each, of four different chains
  for (int p = 0; p < 4; ++p) {
    const auto tokens = chain_tokens(1, 1000 * (p + 1));
    const BlockId id = *bm.allocate();
    bm.hold_exact(id, /*fresh=*/true);  // C and D take A's and B's exact pages back
    reg(bm, id, 0, tokens, 0);
    bm.drop_exact(id);
    ids.push_back(id);
  }
  const BlockId a = ids[0], b = ids[1], c = ids[2], d = ids[3];
  ASSERT_LT(bm.exact_of(a), 0);
  ASSERT_LT(bm.exact_of(b), 0);
  ASSERT_GE(bm.exact_of(c), 0);
  ASSERT_GE(bm.exact_of(d), 0);
  ASSERT_EQ(exact.size(), 2u) << "A's and B's exact copies are in the tier";
  ASSERT_TRUE(bm.exact_restorable(a) && bm.exact_restorable(b));
  const BlockId both[] = {a, b};
  EXPECT_TRUE(bm.restore_exact(both));
  EXPECT_GE(bm.exact_of(a), 0);
  EXPECT_GE(bm.exact_of(b), 0);
  EXPECT_LT(bm.exact_of(c), 0);
  EXPECT_LT(bm.exact_of(d), 0);
  EXPECT_EQ(bm.exact_restores(), 2u);
  EXPECT_EQ(exact.pages_restored(), 2u);
  for (BlockId id : ids) bm.release(id);
}

// A per-layer plan: K and V apart, rotations, formats that differ by layer.
TEST(HostTier, GreedyTokensUnchangedWithAMixedPlan) {
  ModelOptions o;
  o.model_dir = kStories;
  o.cache.block_size = kBs;
  KVPlanFile f;
  f.source = "<test>";
  const KVCacheDType k[] = {KVCacheDType::BFloat16, KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead,
                            KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead};
  const KVCacheDType v[] = {KVCacheDType::Int4PerTokenHead, KVCacheDType::Int4PerTokenHead,
                            KVCacheDType::Int4PerTokenHead, KVCacheDType::BFloat16, KVCacheDType::Int8PerTokenHead};
  for (int l = 0; l < 5; ++l)
    f.entries.push_back(KVPlanEntry{.layer = l, .k = k[l], .v = v[l], .rotate_k = l % 2 == 1, .rotate_v = l == 2,
                                    .rotation_seed = uint32_t(l)});
  o.cache.plan_file = f;
  auto e = LoadedModel::load(o);
  check_tier_is_exact(*e);
}

// Preemption under the tier is a swap: a preempted sequence's full pages stay cached, go to the
// tier when the pool needs them, and come back when it resumes; only its last, partial page
// is computed again (without the tier, whatever the pool evicted meanwhile is). Greedy tokens are those of a pool large enough not to preempt.
TEST(HostTier, PreemptedSequencesComeBackFromTheTier) {
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load(kStories, dt, kBs);
    const int vocab = e->config().vocab_size;
    auto run = [&](int num_blocks, int64_t offload_pages) {
      std::mt19937 rng(3);
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 6, .max_num_batched_tokens = 64, .max_model_len = 128,
                                       .enable_prefix_caching = true, .num_blocks = num_blocks,
                                       .kv_offload_pages = offload_pages});
      std::map<std::string, Collected> out;
      for (int i = 0; i < 6; ++i) le.add_request(make("r" + std::to_string(i), random_prompt(rng, 20 + 3 * i, vocab), 40, out));
      run_to_end(le);
      std::vector<std::vector<TokenId>> tokens;
      for (int i = 0; i < 6; ++i) {
        const Collected& c = out["r" + std::to_string(i)];
        EXPECT_EQ(c.reason, FinishReason::Length) << c.error;
        tokens.push_back(c.tokens);
      }
      EXPECT_EQ(le.blocks().num_used(), 0);
      // Tokens found cached, resumed sequences' included (EngineStats counts first admissions).
      return std::tuple(tokens, le.stats(), le.blocks().cache_hits());
    };
    const auto [want, roomy, roomy_hits] = run(200, 0);
    const auto [recomputed, alone, alone_hits] = run(24, 0);
    const auto [swapped, tiered, tiered_hits] = run(24, 200);
    EXPECT_EQ(roomy.preemptions_total, 0u);
    ASSERT_GT(alone.preemptions_total, 0u) << "the small pool must preempt for this test to mean anything";
    EXPECT_GT(tiered.preemptions_total, 0u);
    EXPECT_EQ(recomputed, want);
    EXPECT_EQ(swapped, want);
    EXPECT_GT(tiered.kv_offload_restored_total, 0u);
    // Tokens a resumed sequence found cached instead of computing them again.
    EXPECT_GT(tiered_hits, alone_hits) << "resumed sequences should come back from the tier";
    EXPECT_GT(alone.recomputed_tokens_total, 0u);
    EXPECT_LT(tiered.recomputed_tokens_total, alone.recomputed_tokens_total);
    EXPECT_EQ(roomy.recomputed_tokens_total, 0u);
    EXPECT_EQ(tiered.kv_offload_hit_tokens_total, tiered.kv_offload_restored_total * uint64_t(kBs));
    std::printf("[preemption] %s: %llu / %llu preemptions; tokens found cached (resumes included): %llu without the tier, "
                "%llu with it (%llu pages restored); computed again on resuming: %llu without, %llu with\n",
                std::string(kv_cache_dtype_name(dt)).c_str(), (unsigned long long)alone.preemptions_total,
                (unsigned long long)tiered.preemptions_total, (unsigned long long)alone_hits,
                (unsigned long long)tiered_hits, (unsigned long long)tiered.kv_offload_restored_total,
                (unsigned long long)alone.recomputed_tokens_total, (unsigned long long)tiered.recomputed_tokens_total);
  }
}

// A long randomized workload: conversations that grow turn after turn beside unrelated prompts,
// requests arriving between steps, some aborted mid-way, a pool that preempts and a tier that
// replaces entries all the time. Every page of every tier comes back (none leaked, none held by
// a finished request), the tier never holds more than its capacity, and every request that ran
// to its end gave the tokens it gives alone in a pool that evicts nothing.
// `disk_dir` ("": none): a disk tier of `disk_pages` pages below the host tier of 10.
// `exact`: INT4 with exact sink / recent tokens, and 6 exact pages beside the tier's (their disk
// tier as many pages as the pages').
void randomized_workload(const std::string& disk_dir = "", int disk_pages = 0, bool exact = false) {
  auto e = exact ? load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11) : load(kStories, KVCacheDType::Int8PerTokenHead, kBs);
  const int vocab = e->config().vocab_size;
  const uint64_t file = 56 + 4 * kBs + e->model().kv_page_bytes(kBs) + 8;
  const uint64_t exact_file = 56 + 4 * kBs + e->model().kv_page_bytes(kBs, PageKind::Exact) + 8;
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    if (!disk_dir.empty()) std::filesystem::remove_all(disk_dir);
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 40, .max_model_len = 128,
                                     .enable_prefix_caching = true, .num_blocks = 18, .kv_offload_pages = 10,
                                     .kv_offload_dir = disk_dir, .kv_offload_disk_bytes = file * uint64_t(disk_pages),
                                     .kv_offload_exact_pages = exact ? 6 : 0,
                                     .kv_offload_exact_disk_bytes = exact ? exact_file * uint64_t(disk_pages) : 0});
    const auto system = random_prompt(rng, 2 * kBs + 3, vocab);
    std::vector<std::vector<TokenId>> convs(4, system);
    std::map<std::string, Collected> out;
    std::map<std::string, std::pair<std::vector<TokenId>, int>> asked;  // id -> prompt, max_tokens
    std::vector<std::string> live;
    int next = 0, aborted = 0;
    for (int step = 0; step < 400 && (next < 40 || le.has_work()); ++step) {
      for (int k = int(rng() % 3); k > 0 && next < 40; --k, ++next) {
        std::vector<TokenId> prompt;
        if (rng() % 3 == 0) {
          prompt = random_prompt(rng, 5 + int(rng() % 30), vocab);  // unrelated
        } else {
          auto& h = convs[rng() % convs.size()];
          if (h.size() > 90) h = system;  // a new conversation in its place
          const auto user = random_prompt(rng, 3 + int(rng() % 12), vocab);
          h.insert(h.end(), user.begin(), user.end());
          prompt = h;
        }
        const int max_tokens = 1 + int(rng() % 12);
        const std::string id = "r" + std::to_string(next);
        asked[id] = {prompt, max_tokens};
        le.add_request(make(id, prompt, max_tokens, out));
        live.push_back(id);
      }
      if (!live.empty() && rng() % 20 == 0) {
        const size_t i = rng() % live.size();
        if (out[live[i]].finishes == 0) {
          le.abort(live[i]);
          ++aborted;
        }
        live.erase(live.begin() + long(i));
      }
      if (le.has_work()) le.step();
      const EngineStats st = le.stats();
      ASSERT_LE(st.kv_offload_pages, st.kv_offload_capacity);
      ASSERT_LE(st.kv_offload_disk_pages, st.kv_offload_disk_capacity);
      ASSERT_LE(st.kv_offload_exact_pages, st.kv_offload_exact_capacity);
    }
    run_to_end(le);
    const EngineStats st = le.stats();
    EXPECT_EQ(le.blocks().num_used(), 0) << "a page is still referenced after every request ended";
    EXPECT_EQ(le.blocks().num_free(), le.blocks().num_blocks());
    EXPECT_LE(st.kv_offload_pages, st.kv_offload_capacity);
    EXPECT_GT(st.kv_offload_evictions_total, 0u) << "the tier should have replaced entries";
    EXPECT_GT(st.kv_offload_restored_total, 0u);
    EXPECT_EQ(st.kv_offload_hit_tokens_total, st.kv_offload_restored_total * uint64_t(kBs));
    if (exact) {
      expect_exact_pages_released(le.blocks());
      EXPECT_EQ(st.kv_offload_exact_capacity, 6);
      EXPECT_GT(st.kv_offload_exact_restored_total, 0u) << "exact copies should have come back from the tier";
    }

    LLMEngine ref(*e, SchedulerConfig{.max_num_seqs = 1, .max_num_batched_tokens = 128, .max_model_len = 128,
                                      .enable_prefix_caching = false, .num_blocks = 64});
    int checked = 0;
    for (const auto& [id, c] : out) {
      if (c.reason != FinishReason::Length) continue;
      std::map<std::string, Collected> alone;
      ref.add_request(make(id, asked[id].first, asked[id].second, alone));
      run_to_end(ref);
      EXPECT_EQ(c.tokens, alone[id].tokens) << id;
      ++checked;
    }
    EXPECT_GT(checked, 25);
    if (!disk_dir.empty()) {
      EXPECT_EQ(st.kv_offload_disk_capacity, disk_pages);
      EXPECT_GT(st.kv_offload_disk_read_total, 0u) << "pages should have come back from disk";
      EXPECT_GT(st.kv_offload_disk_evictions_total, 0u) << "the disk tier should have replaced files";
      EXPECT_EQ(st.kv_offload_disk_damaged_total, 0u);
      for (const auto& root : std::filesystem::directory_iterator(disk_dir)) {  // the pages', the exact pages'
        if (!root.is_directory()) continue;
        size_t files = 0;
        for (const auto& d : std::filesystem::directory_iterator(root)) files += d.path().extension() == ".kvpage";
        EXPECT_LE(files, size_t(disk_pages)) << "more page files than the disk tier's size in " << root.path();
      }
    }
    std::printf("[random] seed %u%s: %d requests checked, %d aborted, %llu preemptions; tier: %llu kept, %llu restored, "
                "%llu replaced; exact pages: %llu kept, %llu restored; disk: %llu written, %llu read, %llu replaced\n",
                seed, exact ? " (exact tokens)" : "", checked, aborted, (unsigned long long)st.preemptions_total,
                (unsigned long long)st.kv_offload_stored_total, (unsigned long long)st.kv_offload_restored_total,
                (unsigned long long)st.kv_offload_evictions_total, (unsigned long long)st.kv_offload_exact_stored_total,
                (unsigned long long)st.kv_offload_exact_restored_total, (unsigned long long)st.kv_offload_disk_written_total,
                (unsigned long long)st.kv_offload_disk_read_total, (unsigned long long)st.kv_offload_disk_evictions_total);
  }
}

TEST(HostTier, RandomizedWorkloadLeaksNothingAndKeepsTokens) { randomized_workload(); }

// The same with a disk tier of 30 pages below: written in the background, read back, replaced.
TEST(HostTier, RandomizedWorkloadThroughADiskTier) {
  randomized_workload((std::filesystem::path(::testing::TempDir()) / "kvlm_random_disk").string(), 30);
}

// Exact sink / recent tokens, with exact pages in the host tier and on disk.
TEST(HostTier, RandomizedWorkloadWithExactPages) { randomized_workload("", 0, true); }
TEST(HostTier, RandomizedWorkloadWithExactPagesThroughADiskTier) {
  randomized_workload((std::filesystem::path(::testing::TempDir()) / "kvlm_random_exact_disk").string(), 30, true);
}

// --kv-offload-gib is planned in whole pages and refused where it cannot work.
TEST(HostTier, MemoryPlanCountsPagesAndRefusesWhatCannotWork) {
  auto e = load(kStories, KVCacheDType::Int8PerTokenHead, kBs);
  MemoryOptions o;
  o.kv_cache_memory = 1 << 20;
  o.max_model_len = 256;
  o.kv_offload_bytes = 1 << 20;
  const MemoryPlan mp = plan_kv_memory(*e, o);
  const size_t page = e->model().kv_page_bytes(kBs);
  EXPECT_EQ(mp.offload_pages, int64_t((1 << 20) / page));
  EXPECT_NE(mp.summary.find("host tier (--kv-offload-gib)"), std::string::npos) << mp.summary;
  o.prefix_caching = false;
  try {
    plan_kv_memory(*e, o);
    FAIL() << "expected an error without prefix caching";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("needs prefix caching"), std::string::npos) << err.what();
  }
  o.prefix_caching = true;
  o.kv_offload_bytes = page;  // one page
  try {
    plan_kv_memory(*e, o);
    FAIL() << "expected an error for a tier of one page";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("fewer than 2 pages"), std::string::npos) << err.what();
  }

  // Exact sink / recent tokens: exact pages take the share of the host tier (and of the disk
  // tier) that they have of the pool, out of the same sizes.
  auto x = load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11);
  o.kv_offload_bytes = 4 << 20;
  o.kv_offload_disk_bytes = 64 << 20;
  o.max_num_seqs = 8;
  o.kv_cache_memory = 16 << 20;
  const MemoryPlan xp = plan_kv_memory(*x, o);
  const size_t xpage = x->model().kv_page_bytes(kBs), epage = x->model().kv_page_bytes(kBs, PageKind::Exact);
  ASSERT_GT(epage, 0u);
  ASSERT_GT(xp.num_exact_pages, 0);
  const double share = double(xp.exact_bytes) / double(xp.exact_bytes + uint64_t(xp.num_blocks) * xp.bytes_per_block);
  EXPECT_EQ(xp.offload_exact_pages, int64_t(double(4 << 20) * share / double(epage)));
  EXPECT_GT(xp.offload_exact_pages, 1);
  EXPECT_EQ(xp.offload_pages, int64_t(((4 << 20) - uint64_t(xp.offload_exact_pages) * epage) / xpage));
  EXPECT_LE(xp.offload_bytes + xp.offload_exact_bytes, uint64_t(4 << 20));
  EXPECT_EQ(xp.offload_disk_bytes + xp.offload_exact_disk_bytes, uint64_t(64 << 20));
  EXPECT_GT(xp.offload_exact_disk_bytes, 0u);
  EXPECT_NE(xp.summary.find("exact pages"), std::string::npos) << xp.summary;
  std::printf("[memory plan] %s\n", xp.summary.c_str());
}

// The prefix cache's host tier (engine/host_kv_tier.h, --kv-offload-gib): pages the pool
// evicts are copied out in their stored format and come back, byte for byte, under their own
// serials; the serving engine's greedy tokens are the same with and without the tier in every
// KV format and a mixed per-layer plan, while the tier turns recomputed prompt tokens into
// restored ones.
#include <gtest/gtest.h>

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
  bm.set_lower_tier(&tier);

  const auto chain = chain_tokens(3, 100);
  std::vector<BlockId> ids;
  std::vector<uint64_t> serials;
  std::vector<std::vector<uint8_t>> want;
  uint64_t parent = 0;
  for (int i = 0; i < 3; ++i) {
    const BlockId id = *bm.allocate();
    fill_page(cache, id, uint8_t(i + 1));
    want.push_back(page_of(cache, id));
    parent = bm.register_full(id, parent, std::span(chain).subspan(size_t(i * kBs), kBs));
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
  EXPECT_EQ(bm.lower_tier_hits(), uint64_t(3 * kBs));
  EXPECT_EQ(tier.pages_restored(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(page_of(cache, found[size_t(i)]), want[size_t(i)]) << "page " << i;
  // A chain that starts with a pool page and goes on in the tier: the next page after the
  // chain, registered now, chains to the restored serial.
  const auto longer = chain_tokens(4, 100);
  const BlockId fourth = *bm.allocate();
  EXPECT_GT(bm.register_full(fourth, serials.back(), std::span(longer).subspan(3 * kBs, kBs)), serials.back());
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
  EXPECT_EQ(tier.pages_restored(), 3u);
}

// A restore needs a pool page; with every page referenced the hit stops there and the entry
// stays in the tier for later.
TEST(HostTier, NoFreePageEndsTheHit) {
  auto e = load(kStories, KVCacheDType::Auto, kBs);
  auto& runner = dynamic_cast<CpuModelRunner&>(e->model());
  runner.allocate_kv(2, kBs);
  BlockManager bm(2, kBs, true);
  HostKVTier tier(runner, kBs, 4);
  bm.set_lower_tier(&tier);
  const auto chain = chain_tokens(1, 7);
  const BlockId a = *bm.allocate();
  bm.register_full(a, 0, chain);
  bm.release(a);
  const BlockId x = *bm.allocate(), y = *bm.allocate();  // a is evicted into the tier
  EXPECT_EQ(tier.size(), 1u);
  std::vector<BlockId> found;
  std::vector<uint64_t> serials;
  EXPECT_EQ(bm.match_prefix(chain, found, serials), 0);
  bm.release(x);
  EXPECT_EQ(bm.match_prefix(chain, found, serials), 1);
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

// Exact sink / recent tokens: restored pages come back without exact copies, so a hit stops
// before a page a query must read exact; the tokens stay the same. In this workload every
// hit ends that way, even in the large pool: a turn's hit ends in the previous turn's last
// pages, which its recent window reads exact, and their idle exact copies have been taken
// back for other conversations by then — so the tier cannot save anything here (the tier does
// not keep exact pages yet).
TEST(HostTier, GreedyTokensUnchangedWithExactTokens) {
  auto e = load(kStories, KVCacheDType::Int4PerTokenHead, kBs, 3, 11);
  check_tier_is_exact(*e, /*saves=*/false);
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
}

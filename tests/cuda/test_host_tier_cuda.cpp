// The prefix cache's host tier on the CUDA runner (engine/host_kv_tier.h): pages copied out of
// device memory and back are the same bytes (every KV format, a K != V plan), and the serving
// engine's greedy tokens with the tier equal those of a pool large enough to keep every page.
#include <gtest/gtest.h>

#include <random>

#include "../unit/host_tier_test_util.h"
#include "cuda_test_util.h"
#include "model/cuda/cuda_runner.h"

using namespace kvlm;

namespace {

const std::filesystem::path kModel = std::filesystem::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed";

std::unique_ptr<LoadedModel> load_cuda(KVCacheDType dt, std::optional<KVPlanFile> plan = std::nullopt) {
  ModelOptions o;
  o.model_dir = kModel;
  o.device = Device::Cuda;
  o.cache.kv_cache_dtype = dt;
  o.cache.block_size = kvlm::testing::kTierBlock;
  o.cache.plan_file = std::move(plan);
  return LoadedModel::load(o);
}

}  // namespace

// save_pages then load_pages into other pages gives back the same bytes, and the pages moved
// between hold what was written into them.
TEST(CudaHostTier, PagesRoundTripThroughHostMemory) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load_cuda(dt);
    ModelRunner& r = e->model();
    r.allocate_kv(8, kvlm::testing::kTierBlock);
    const size_t page = r.kv_page_bytes(kvlm::testing::kTierBlock);
    ASSERT_EQ(page, kv_page_bytes(e->plan(), kvlm::testing::kTierBlock));
    std::vector<uint8_t> a(3 * page), b(3 * page), c(3 * page);
    std::mt19937 rng(5);
    for (auto& x : a) x = uint8_t(rng());
    const BlockId src[] = {1, 4, 6}, dst[] = {0, 2, 7};
    r.load_pages(src, a);
    r.save_pages(src, b);
    EXPECT_EQ(a, b);
    r.load_pages(dst, b);
    r.save_pages(dst, c);
    EXPECT_EQ(a, c);
  }
}

TEST(CudaHostTier, GreedyTokensUnchangedInEveryFormat) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Fp8E4M3, KVCacheDType::Fp8PerTokenHead,
                          KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load_cuda(dt);
    kvlm::testing::check_tier_is_exact(*e, /*saves=*/true, /*recompute_equal=*/false);
  }
  KVPlanFile f;
  f.source = "<test>";
  for (int l = 0; l < 4; ++l)
    f.entries.push_back(KVPlanEntry{.layer = l,
                                    .k = l % 2 ? KVCacheDType::Int8PerTokenHead : KVCacheDType::BFloat16,
                                    .v = KVCacheDType::Int4PerTokenHead,
                                    .rotate_k = l == 1,
                                    .rotate_v = true});
  auto e = load_cuda(KVCacheDType::Auto, f);
  kvlm::testing::check_tier_is_exact(*e, /*saves=*/true, /*recompute_equal=*/false);
}

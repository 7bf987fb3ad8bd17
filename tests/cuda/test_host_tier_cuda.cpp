// The prefix cache's host tier on the CUDA runner (engine/host_kv_tier.h): pages copied out of
// device memory and back are the same bytes (every KV format, a K != V plan), and the serving
// engine's greedy tokens with the tier equal those of a pool large enough to keep every page.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "../unit/host_tier_test_util.h"
#include "cuda_test_util.h"
#include "model/cuda/cuda_runner.h"

using namespace kvlm;

namespace {

const std::filesystem::path kModel = std::filesystem::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed";

std::unique_ptr<LoadedModel> load_cuda(KVCacheDType dt, std::optional<KVPlanFile> plan = std::nullopt, int tp = 1,
                                       int keep_sink = 0, int keep_recent = 0) {
  ModelOptions o;
  o.cache.keep_sink = keep_sink;
  o.cache.keep_recent = keep_recent;
  o.model_dir = kModel;
  o.device = Device::Cuda;
  o.cache.kv_cache_dtype = dt;
  o.cache.block_size = kvlm::testing::kTierBlock;
  o.cache.plan_file = std::move(plan);
  o.tensor_parallel_size = tp;
  return LoadedModel::load(o);
}

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace

// save_pages then load_pages into other pages gives back the same bytes, and the pages moved
// between hold what was written into them: through pinned memory (allocate_host) and plain
// memory, more pages than one pass of the staging buffer holds, and pages in any order.
TEST(CudaHostTier, PagesRoundTripThroughHostMemory) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load_cuda(dt);
    ModelRunner& r = e->model();
    const size_t page = r.kv_page_bytes(kvlm::testing::kTierBlock);
    ASSERT_EQ(page, kv_page_bytes(e->plan(), kvlm::testing::kTierBlock));
    // Enough pages that one copy takes several passes of the staging buffer.
    const int n = int(std::min<size_t>(kPageStagingBytes / page + 3, 600));
    r.allocate_kv(2 * n + 1, kvlm::testing::kTierBlock);
    HostBytes a = r.allocate_host(size_t(n) * page), b = r.allocate_host(size_t(n) * page);
    std::vector<uint8_t> c(size_t(n) * page);
    std::mt19937 rng(5);
    for (size_t i = 0; i < size_t(n) * page; ++i) a[i] = uint8_t(rng());
    std::vector<BlockId> src, dst;
    for (int i = 0; i < n; ++i) {
      src.push_back(BlockId(2 * n - 2 * i));  // descending, every other page
      dst.push_back(BlockId(2 * i + 1));
    }
    auto ptrs = [&](uint8_t* base) {
      std::vector<uint8_t*> p;
      for (int i = 0; i < n; ++i) p.push_back(base + size_t(i) * page);
      return p;
    };
    const auto pa = ptrs(a.get()), pb = ptrs(b.get()), pc = ptrs(c.data());
    const std::vector<const uint8_t*> ca(pa.begin(), pa.end()), cb(pb.begin(), pb.end());
    r.load_pages(src, ca);
    r.save_pages(src, pb);
    r.load_pages(dst, cb);
    r.save_pages(dst, pc);
    r.wait_pages();
    EXPECT_EQ(0, std::memcmp(a.get(), b.get(), size_t(n) * page));
    EXPECT_EQ(0, std::memcmp(a.get(), c.data(), size_t(n) * page));
    // Buffers a constant stride apart (a tensor-parallel rank's parts of consecutive slots move
    // as one 2D copy), the stride changing halfway: the same bytes, and nothing between them touched.
    const size_t wide = page + 192;
    HostBytes w = r.allocate_host(size_t(n) * (wide + 64));
    std::memset(w.get(), 0xA5, size_t(n) * (wide + 64));
    std::vector<uint8_t*> pw;
    for (int i = 0; i < n; ++i) pw.push_back(w.get() + size_t(i) * wide + (i >= n / 2 ? size_t(i - n / 2) * 64 : 0));
    const std::vector<const uint8_t*> cw(pw.begin(), pw.end());
    r.save_pages(src, pw);
    r.load_pages(dst, cw);
    r.save_pages(dst, pc);
    r.wait_pages();
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(0, std::memcmp(pw[size_t(i)], a.get() + size_t(i) * page, page)) << "page " << i;
      const uint8_t* gap = pw[size_t(i)] + page;
      const uint8_t* next = i + 1 < n ? pw[size_t(i + 1)] : w.get() + size_t(n) * (wide + 64);
      ASSERT_TRUE(std::all_of(gap, next, [](uint8_t x) { return x == 0xA5; })) << "between pages " << i << " and " << i + 1;
    }
    EXPECT_EQ(0, std::memcmp(a.get(), c.data(), size_t(n) * page));
    // Buffers further apart than a run's stride may be (for_each_run): one copy each.
    ASSERT_GE(n, 8);
    const size_t far = 17 * page;
    HostBytes f = r.allocate_host(8 * far);
    std::vector<uint8_t*> pf;
    for (size_t i = 0; i < 8; ++i) pf.push_back(f.get() + i * far);
    r.save_pages(std::span(src).first(8), pf);
    r.wait_pages();
    for (size_t i = 0; i < 8; ++i) EXPECT_EQ(0, std::memcmp(pf[i], a.get() + i * page, page)) << "page " << i;
  }
}

// Exact pages (exact sink / recent tokens) through host memory, by their own page table: the
// same bytes come back, and the pool's pages are not touched. In the serving engine they come
// back for hits whose queries read them exact, with the tokens of a pool whose exact pages
// are never lost (host_tier_test_util.h).
TEST(CudaHostTier, ExactPagesRoundTripAndComeBack) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int bs = kvlm::testing::kTierBlock;
  auto e = load_cuda(KVCacheDType::Int4PerTokenHead, std::nullopt, 1, 3, 11);
  ModelRunner& r = e->model();
  const size_t epage = r.kv_page_bytes(bs, PageKind::Exact), page = r.kv_page_bytes(bs);
  ASSERT_EQ(epage, kv_exact_page_bytes(e->plan(), bs));
  ASSERT_GT(epage, 0u);
  const int n = 6;
  r.allocate_kv(4, bs, 2 * n);
  HostBytes a = r.allocate_host(size_t(n) * epage), b = r.allocate_host(size_t(n) * epage);
  HostBytes pool0 = r.allocate_host(4 * page), pool1 = r.allocate_host(4 * page);
  std::mt19937 rng(9);
  for (size_t i = 0; i < size_t(n) * epage; ++i) a[i] = uint8_t(rng());
  std::vector<BlockId> src, dst;
  std::vector<uint8_t*> pa, pb, p0, p1;
  for (int i = 0; i < n; ++i) {
    src.push_back(BlockId(2 * n - 1 - 2 * i));
    dst.push_back(BlockId(2 * i));
    pa.push_back(a.get() + size_t(i) * epage);
    pb.push_back(b.get() + size_t(i) * epage);
  }
  for (int i = 0; i < 4; ++i) {
    p0.push_back(pool0.get() + size_t(i) * page);
    p1.push_back(pool1.get() + size_t(i) * page);
  }
  const std::vector<BlockId> pool_ids{0, 1, 2, 3};
  r.save_pages(pool_ids, p0);
  r.load_pages(src, std::vector<const uint8_t*>(pa.begin(), pa.end()), PageKind::Exact);
  r.save_pages(src, pb, PageKind::Exact);
  r.wait_pages();
  EXPECT_EQ(0, std::memcmp(a.get(), b.get(), size_t(n) * epage));
  std::memset(b.get(), 0, size_t(n) * epage);
  r.load_pages(dst, std::vector<const uint8_t*>(pa.begin(), pa.end()), PageKind::Exact);
  r.save_pages(dst, pb, PageKind::Exact);
  r.save_pages(pool_ids, p1);
  r.wait_pages();
  EXPECT_EQ(0, std::memcmp(a.get(), b.get(), size_t(n) * epage));
  EXPECT_EQ(0, std::memcmp(pool0.get(), pool1.get(), 4 * page)) << "exact copies wrote into the pool";
  EXPECT_THROW(r.save_pages(std::vector<BlockId>{BlockId(2 * n)}, std::span(pb).first(1), PageKind::Exact), Error);
  kvlm::testing::check_exact_pages_come_back(*e, /*recompute_equal=*/false);
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

// With a disk tier below a host tier too small for the workload (engine/disk_kv_tier.h): pages
// read back from disk into pinned host memory reach the GPU unchanged (the tokens equal the
// large pool's), and a second engine on the same directory — a restart — finds the pages the
// first left there. (Its tokens are checked against the first's on the CPU, where recomputing
// in other chunks rounds the same; here a prefill split differently may round differently.)
namespace {
void check_disk_tier(LoadedModel& e, const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / name;
  std::filesystem::remove_all(dir);
  using kvlm::testing::run_conversations;
  const auto all = run_conversations(e, 400, 0, 6, 3);
  const auto disk = run_conversations(e, 20, 12, 6, 3, dir.string(), 64 << 20);
  EXPECT_EQ(disk.outputs, all.outputs);
  EXPECT_GT(disk.stats.kv_offload_disk_read_total, 0u);
  EXPECT_EQ(disk.stats.kv_offload_disk_damaged_total, 0u);
  EXPECT_EQ(disk.stats.prompt_tokens_total, all.stats.prompt_tokens_total);
  const auto again = run_conversations(e, 20, 12, 6, 3, dir.string(), 64 << 20);
  EXPECT_GT(again.stats.kv_offload_disk_read_total, disk.stats.kv_offload_disk_read_total);
  EXPECT_LT(again.stats.prompt_tokens_total, all.stats.prompt_tokens_total) << "the restart found nothing on disk";
  std::printf("[cuda disk tier] %s: %llu pages read back from disk; after a restart %llu, prompt tokens computed %llu "
              "(first run %llu)\n",
              describe_kv_resolution(e.plan()).c_str(), (unsigned long long)disk.stats.kv_offload_disk_read_total,
              (unsigned long long)again.stats.kv_offload_disk_read_total,
              (unsigned long long)again.stats.prompt_tokens_total, (unsigned long long)disk.stats.prompt_tokens_total);
  std::filesystem::remove_all(dir);
}
}  // namespace

TEST(CudaHostTier, PagesComeBackFromDiskAndAfterARestart) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load_cuda(dt);
    check_disk_tier(*e, "kvlm_cuda_disk_tier");
  }
}

// Tensor parallelism over two GPUs: each rank copies its heads' part of every page into its
// place in the same pinned host page (portable pinned memory), through a disk tier too; the
// tokens equal those of a pool that keeps every page.
TEST(CudaHostTier, TensorParallelRanksKeepTheirPartsOfEachPage) {
  if (gpu_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto e = load_cuda(dt, std::nullopt, 2);
    kvlm::testing::check_tier_is_exact(*e, /*saves=*/true, /*recompute_equal=*/false);
    check_disk_tier(*e, "kvlm_cuda_tp_disk_tier");
  }
}

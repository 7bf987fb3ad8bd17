// Grouped integer codes on the GPU (ops/cuda/gemm.h IntWeight): gemv_int, dequantize_int and
// embed_rows_int against their definition, over every ggml block type's layout (converted by
// io/grouped_codes.h, as the runner converts them at load: MXFP4's E2M1 codes among them) and
// the zero-point layouts of 4-bit checkpoints (groups of 64 and 128, whole rows).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "act_test_util.h"
#include "core/error.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_int_dp4a.h"
#include "ops/cuda/kernel_switches.h"
#include "../support/ggml_blocks.h"

using namespace kvlm;
using kvlm::test::Dev;
using namespace kvlm::test::act;

namespace {

// A weight [n][k] as grouped codes with its (s, b) words for compute type ab, and the values
// the kernels compute with: s * code + b rounded once to ab.
struct Grouped {
  GroupedLayout layout;
  std::vector<uint8_t> codes;
  std::vector<uint32_t> params;
  std::vector<float> values;  // [n][k], s * code + b rounded to the compute type
  std::vector<float> exact;   // [n][k], s * code + b in fp32
  std::string name;
};

Grouped from_ggml(DType ab, GGMLType type, int n, int k, std::mt19937& rng) {
  Grouped g;
  g.layout = *grouped_layout_of_ggml(uint32_t(type));
  g.name = ggml_type_name(uint32_t(type));
  const auto tr = *ggml_type_traits(uint32_t(type));
  const auto blocks = test::random_ggml_blocks(type, int64_t(n) * k, rng);
  const size_t row_bytes = size_t(k / tr.block * tr.block_bytes), cb = grouped_code_bytes(g.layout, k);
  const size_t ng = size_t(grouped_groups(g.layout, k));
  g.codes.resize(size_t(n) * cb);
  g.params.resize(size_t(n) * ng);
  std::vector<float> s(ng), b(ng);
  for (int r = 0; r < n; ++r) {
    ggml_row_to_grouped(uint32_t(type), blocks.data() + size_t(r) * row_bytes, k, g.codes.data() + size_t(r) * cb,
                        s.data(), b.data());
    for (size_t i = 0; i < ng; ++i)
      g.params[size_t(r) * ng + i] = g.layout.e2m1 ? grouped_param_e2m1(ab, s[i]) : grouped_param(ab, s[i], b[i]);
  }
  return g;
}

// A 4-bit zero-point layout (AWQ / GPTQ style: s (q - z)), random codes: as an offset
// b = -s z rounded to the compute type (`exact_zero` false), or as the zero-point layout that
// subtracts z exactly (grouped_param_zero_point; z up to 16, as GPTQ's format can decode).
Grouped zero_point(DType ab, int group, int n, int k, std::mt19937& rng, bool exact_zero) {
  Grouped g;
  g.layout = {4, group, exact_zero};
  g.name = std::string(exact_zero ? "4-bit zero-point layout" : "4-bit zero point as offsets") + ", group " +
           std::to_string(group);
  g.codes.resize(size_t(n) * size_t(k) / 2);
  for (auto& c : g.codes) c = uint8_t(rng());
  std::uniform_real_distribution<float> us(2e-3f, 1e-2f);
  std::uniform_int_distribution<int> uz(0, 16);
  g.params.resize(size_t(n) * size_t(k / group));
  for (auto& p : g.params) {
    const float s = us(rng);
    const int z = uz(rng);
    p = exact_zero ? grouped_param_zero_point(ab, s, z) : grouped_param(ab, s, -s * float(z));
  }
  return g;
}

void fill_values(DType ab, int n, int k, Grouped& g) {
  g.values.resize(size_t(n) * size_t(k));
  g.exact.resize(size_t(n) * size_t(k));
  const size_t cb = grouped_code_bytes(g.layout, k), ng = size_t(k / g.layout.group);
  std::vector<float> row(static_cast<size_t>(k));
  for (int r = 0; r < n; ++r) {
    grouped_dequantize_row(g.layout, ab, g.codes.data() + size_t(r) * cb, g.params.data() + size_t(r) * ng, k, row);
    for (int c = 0; c < k; ++c) {
      g.values[size_t(r) * k + c] = act_round(ab, row[size_t(c)]);
      g.exact[size_t(r) * k + c] = row[size_t(c)];
    }
  }
}

// A test case's weight: a ggml block type's layout (Q4_0 .. Q6_K, MXFP4), or with type F32 a
// 4-bit zero point of `group` as offsets, F16 the exact zero-point layout.
struct Case {
  GGMLType type;
  int group, n, k;
  bool zero_point_case() const { return type == GGMLType::F32 || type == GGMLType::F16; }
};

// The case's codes with their values filled (fill_values).
Grouped grouped_case(DType ab, const Case& c, std::mt19937& rng) {
  Grouped g = c.zero_point_case() ? zero_point(ab, c.group, c.n, c.k, rng, c.type == GGMLType::F16)
                                  : from_ggml(ab, c.type, c.n, c.k, rng);
  fill_values(ab, c.n, c.k, g);
  return g;
}

// The kernels' view of g's codes uploaded to dc and dp.
cuda::IntWeight int_weight(const Grouped& g, const Dev<uint8_t>& dc, const Dev<uint32_t>& dp) {
  return {.codes = dc.p, .params = dp.p, .bits = g.layout.bits, .group = g.layout.group,
          .zero_point = g.layout.zero_point, .e2m1 = g.layout.e2m1};
}

}  // namespace

// Misuse is an error, not a wrong answer.
TEST(CudaIntWeights, RefusesLayoutsTheKernelsDoNotTake) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(cuda::int_layout_fits(256, 4, 32));
  EXPECT_TRUE(cuda::int_layout_fits(256, 8, 16));
  EXPECT_TRUE(cuda::int_layout_fits(4096, 4, 128));
  EXPECT_FALSE(cuda::int_layout_fits(256, 4, 16));  // a lane's 32 codes would span two groups
  EXPECT_FALSE(cuda::int_layout_fits(48, 4, 48));   // k not a multiple of 32
  EXPECT_FALSE(cuda::int_layout_fits(256, 3, 32));
  EXPECT_FALSE(cuda::int_layout_fits(320, 4, 128));  // groups do not tile the row
  Dev<uint8_t> dc(4096);
  Dev<uint32_t> dp(256);
  Dev<uint16_t> dx(17 * 256), dy(17 * 64);
  const cuda::IntWeight bad{.codes = dc.p, .params = dp.p, .bits = 4, .group = 16};
  EXPECT_THROW(cuda::gemv_int(DType::BF16, DType::BF16, dx.p, bad, nullptr, dy.p, 16, 1, 16, 256, nullptr), Error);
  const cuda::IntWeight zp8{.codes = dc.p, .params = dp.p, .bits = 8, .group = 16, .zero_point = true};
  EXPECT_THROW(cuda::gemv_int(DType::BF16, DType::BF16, dx.p, zp8, nullptr, dy.p, 16, 1, 16, 256, nullptr), Error);
  const cuda::IntWeight ok{.codes = dc.p, .params = dp.p, .bits = 4, .group = 32};
  EXPECT_THROW(cuda::gemv_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 16, 17, 16, 256, nullptr), Error);
  EXPECT_THROW(cuda::gemv_int(DType::F32, DType::F32, dx.p, ok, nullptr, dy.p, 16, 1, 16, 256, nullptr), Error);
  EXPECT_THROW(cuda::gemv_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 8, 1, 16, 256, nullptr), Error);
  if (!cuda::gemm_int_available(128)) return;
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, bad, nullptr, dy.p, 16, 17, 16, 256, nullptr), Error);
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, zp8, nullptr, dy.p, 16, 17, 16, 256, nullptr), Error);
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 16, 65, 16, 256, nullptr), Error);
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 16, 17, 16, 256, nullptr, 64), Error);
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 16, 17, 16, 256, nullptr, 128, 9),
               Error);
  EXPECT_THROW(cuda::gemm_int(DType::BF16, DType::BF16, dx.p, ok, nullptr, dy.p, 8, 17, 16, 256, nullptr), Error);
}

// gemv_int over m = 1..16 (one and two B tiles; 32- and 64-row CTAs, cluster splits where the
// launcher picks them), odd n, k not a multiple of the 128- or 64-column rounds, bias, float32
// output, and a y row stride wider than n (a part of a fused weight): against the sum in double
// of x times the kernels' weight values. The GPU sums fp32 and rounds once, so the bound is the
// 16-bit rounding (none for float32) plus 1e-4 of sum |w x|; nothing outside y[m][0..n) is
// written. At m = 1-4 the layouts gemv_int_dp4a takes run there (x quantized to int8 per 16
// bytes of codes), held to the unrounded weights with x's quantization error added to the bound
// (sum |w| dx / 2, dx = the block's max |x| / 127), and once more with it switched off; at every
// m both tensor-core kernels run (x shared by the CTA, and loaded by each warp). Layouts that scale after the MMA (bf16, 4-bit, groups of 128 and 2048 here) are
// held to the unrounded weights, and the same layouts run once more with the switch off. dequantize_int writes those weight values exactly; embed_rows_int gathers
// s * code + b in fp32.
TEST(CudaIntWeights, GemvDequantizeAndEmbedMatchTheDefinition) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (test::compute_capability() < 80) GTEST_SKIP() << "bf16 tensor cores need sm_80";
  std::mt19937 rng(41);
  const Case cases[] = {
      {GGMLType::Q4_K, 0, 300, 768},  {GGMLType::Q6_K, 0, 129, 4352}, {GGMLType::Q4_0, 0, 7, 96},
      {GGMLType::Q4_1, 0, 1000, 1056}, {GGMLType::Q5_0, 0, 33, 160},   {GGMLType::Q5_1, 0, 61, 2080},
      {GGMLType::Q8_0, 0, 97, 4128},  {GGMLType::Q5_K, 0, 70, 2304},  {GGMLType::Q2_K, 0, 50, 512},
      {GGMLType::Q3_K, 0, 17, 1280},  {GGMLType::F32, 128, 257, 4096}, {GGMLType::F32, 64, 40, 1472},
      {GGMLType::F32, 2048, 9000, 2048}, {GGMLType::F16, 128, 300, 1024}, {GGMLType::F16, 32, 70, 512},
      {GGMLType::F16, 64, 33, 2112}, {GGMLType::MXFP4, 0, 300, 2880}, {GGMLType::MXFP4, 0, 45, 96},
      {GGMLType::Q4_K, 0, 12001, 256}};  // many rows of few columns: a warp (DP4A) or CTA takes several tasks
  constexpr int kM = cuda::kGemvIntMaxM;
  size_t checked = 0;
  const auto saved = cuda::kernel_switches();
  for (const bool sam : {true, false})
  for (DType ab : kActs)
    for (const Case& c : cases) {
      const int n = c.n, k = c.k;
      if (!sam && !(ab == DType::BF16 && c.zero_point_case() && c.group % 128 == 0)) continue;
      auto sw = saved;
      sw.int_scale_after_mma = sam;
      cuda::set_kernel_switches(sw);
      Grouped g = grouped_case(ab, c, rng);
      SCOPED_TRACE(std::string(dtype_name(ab)) + " " + g.name + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                   (sam ? "" : " (scale after the MMA off)"));
      const auto xr = random_act(ab, size_t(kM) * k, rng, 1.0f);
      const auto b = random_act(ab, size_t(n), rng, 0.5f);
      std::vector<double> ref(size_t(kM) * n), mag(size_t(kM) * n);
      // gemv_int_dp4a's reference (rows 0..kGemvIntDp4aMaxM - 1): the unrounded weights, and the
      // bound of x's int8 quantization, which every weight meets (the offsets through the codes'
      // sum): sum over columns of |w| dx / 2.
      constexpr int kQM = cuda::kGemvIntDp4aMaxM;
      std::vector<double> qref(size_t(kQM) * n), qmag(size_t(kQM) * n), qerr(size_t(kQM) * n);
      {
        const int cpb = 128 / g.layout.bits;  // columns per block of x's codes
        std::vector<double> dx(size_t(kQM) * size_t(k / cpb));
        for (int r = 0; r < kQM; ++r)
          for (int bi = 0; bi < k / cpb; ++bi) {
            double amax = 0;
            for (int i = bi * cpb; i < (bi + 1) * cpb; ++i) amax = std::max(amax, std::fabs(double(xr[size_t(r) * k + i])));
            dx[size_t(r) * size_t(k / cpb) + size_t(bi)] = amax / 127.0;
          }
        for (int j = 0; j < n; ++j)
          for (int r = 0; r < kQM; ++r) {
            double acc = 0, a = 0, e = 0;
            for (int i = 0; i < k; ++i) {
              const double w = g.exact[size_t(j) * k + i], p = w * xr[size_t(r) * k + i];
              acc += p;
              a += std::fabs(p);
              e += std::fabs(w) * dx[size_t(r) * size_t(k / cpb) + size_t(i / cpb)] * 0.5;
            }
            qref[size_t(r) * n + j] = acc;
            qmag[size_t(r) * n + j] = a;
            qerr[size_t(r) * n + j] = e;
          }
      }
      // Scaling after the MMA, the GEMV computes with s * code + b unrounded.
      const std::vector<float>& wv =
          cuda::gemv_int_scales_after_mma(ab, g.layout.bits, g.layout.group) ? g.exact : g.values;
      for (int j = 0; j < n; ++j)
        for (int r = 0; r < kM; ++r) {
          double acc = 0, a = 0;
          for (int i = 0; i < k; ++i) {
            const double p = double(wv[size_t(j) * k + i]) * xr[size_t(r) * k + i];
            acc += p;
            a += std::fabs(p);
          }
          ref[size_t(r) * n + j] = acc;
          mag[size_t(r) * n + j] = a;
        }
      Dev<uint8_t> dc(g.codes);
      Dev<uint32_t> dp(g.params);
      Dev<uint16_t> dx(codes(ab, xr)), db(codes(ab, b));
      const int ldy = n + 3;  // wider than n: only columns [0, n) of each row are written
      Dev<uint16_t> dy16(size_t(kM) * ldy);
      Dev<float> dy32(size_t(kM) * ldy);
      const cuda::IntWeight w = int_weight(g, dc, dp);
      ASSERT_TRUE(cuda::int_layout_fits(k, w.bits, w.group));
      for (int m = 1; m <= kM; ++m)
        for (int mode = 0; mode < 6; ++mode) {  // 0, 2, 4: 16-bit out + bias, 1, 3, 5: float32 out
          // 0, 1: the kernel gemv_int picks; 2, 3 (m <= 4): the other one, where both can run;
          // 4, 5: the tensor-core GEMV it does not pick at this m (x shared by the CTA or
          // loaded by each warp: KernelSwitches::int_shared_x_min_m), 128- or 256-row CTAs
          const bool f32 = mode % 2 == 1, bias = !f32, other = mode == 2 || mode == 3, tc_other = mode >= 4;
          // which kernel gemv_int picks under this case's switches (the previous mode may have
          // forced the other one: takes and pays read the switches in force)
          cuda::set_kernel_switches(sw);
          const bool takes = cuda::gemv_int_dp4a_takes(ab, w, m, k);
          bool dp4a = takes && cuda::gemv_int_dp4a_pays(m, n, k);
          auto swm = sw;
          if (other) {
            if (!takes) continue;
            if (dp4a) swm.int_dp4a_max_m = 0;
            else swm.int_dp4a_by_shape = false;
            dp4a = !dp4a;
          }
          if (tc_other) {
            swm.int_dp4a_max_m = 0;
            dp4a = false;
            swm.int_shared_x_min_m = cuda::gemv_int_shares_x(w, m, n, k) ? cuda::kGemvIntMaxM + 1 : 1;
            swm.int_shared_x_by_shape = false;
            swm.int_shared_x_tiles = 1 + m % 2;
          }
          cuda::set_kernel_switches(swm);
          dy16.poison();
          dy32.poison();
          cuda::gemv_int(ab, f32 ? DType::F32 : ab, dx.p, w, bias ? db.p : nullptr,
                         f32 ? static_cast<void*>(dy32.p) : dy16.p, ldy, m, n, k, nullptr);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<float> got(size_t(kM) * ldy);
          if (f32) {
            got = dy32.download();
          } else {
            const auto raw = dy16.download();
            for (size_t i = 0; i < got.size(); ++i) got[i] = act_value(ab, raw[i]);
          }
          size_t bad = 0, outside = 0;
          double worst = 0;
          for (int r = 0; r < kM; ++r)
            for (int j = 0; j < ldy; ++j) {
              const float v = got[size_t(r) * ldy + j];
              if (r >= m || j >= n) {
                outside += !std::isnan(v);
                continue;
              }
              const size_t at = size_t(r) * n + j;
              const double want = (dp4a ? qref[at] : ref[at]) + (bias ? double(b[size_t(j)]) : 0.0);
              const double e = std::isnan(v) ? 1e30 : std::fabs(v - want);
              worst = std::max(worst, e);
              bad += e > (f32 ? 1e-6 : act_rel_tol(ab)) * std::fabs(want) +
                             1e-4 * ((dp4a ? qmag[at] : mag[at]) + (bias ? std::fabs(b[size_t(j)]) : 0.0)) +
                             (dp4a ? 1.01 * qerr[at] : 0.0);
              ++checked;
            }
          EXPECT_EQ(bad, 0u) << "m=" << m << " mode " << mode << (dp4a ? " (DP4A)" : "") << " max err " << worst;
          EXPECT_EQ(outside, 0u) << "m=" << m << " mode " << mode << ": written outside y[m][n]";
        }
      // dequantize_int: the kernels' values, to one rounding (the host rounds s * code + b from
      // fp32, the 4-bit decode from the exact value).
      Dev<uint16_t> dw(size_t(n) * k);
      cuda::dequantize_int(ab, w, dw.p, n, k, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto raw = dw.download();
      size_t off = 0;
      for (size_t i = 0; i < raw.size(); ++i)
        off += std::fabs(act_value(ab, raw[i]) - g.values[i]) > 2 * act_rel_tol(ab) * std::fabs(g.values[i]) + 1e-30;
      EXPECT_EQ(off, 0u) << "dequantize_int values off by more than one rounding";
      // embed_rows_int: rows gathered by token id, s * code + b in fp32, times the scale.
      const std::vector<TokenId> tokens = {TokenId(n - 1), 0, TokenId(n / 2), TokenId(n - 1)};
      Dev<TokenId> dt(tokens);
      Dev<float> de(tokens.size() * size_t(k));
      cuda::embed_rows_int(ab, w, dt.p, int(tokens.size()), k, de.p, nullptr, 2.0f);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto emb = de.download();
      std::vector<float> row(static_cast<size_t>(k));
      const size_t cb = grouped_code_bytes(g.layout, k), ng = size_t(k / g.layout.group);
      for (size_t t = 0; t < tokens.size(); ++t) {
        grouped_dequantize_row(g.layout, ab, g.codes.data() + size_t(tokens[t]) * cb,
                               g.params.data() + size_t(tokens[t]) * ng, k, row);
        for (int i = 0; i < k; ++i)
          ASSERT_NEAR(emb[t * size_t(k) + size_t(i)], 2.0f * row[size_t(i)], 1e-6 * std::fabs(row[size_t(i)]) + 1e-9)
              << "token " << tokens[t] << " column " << i;
      }
    }
  cuda::set_kernel_switches(saved);
  EXPECT_GT(checked, 1000000u);
}

// gemm_int (decode batches of 17-64 rows) over the same layouts: m on both sides of its 32-row
// and 64-row B tiles, both tiles (128 and 256 weight rows), cluster splits forced to 1, 3 and
// 8 or left to the launcher, odd n, k not a multiple of its 128-column chunks (and shorter than
// one), bias, float32 output and a wider y row stride; against the sum in double of x times the
// per-weight decode's values (s * code + b rounded to the compute type), with gemv_int's bound,
// and nothing outside y[m][0..n) written.
TEST(CudaIntWeights, GemmMatchesTheDefinition) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!cuda::gemm_int_available(128)) GTEST_SKIP() << "gemm_int needs sm_80 and its shared memory";
  std::mt19937 rng(43);
  const Case cases[] = {
      {GGMLType::Q4_K, 0, 300, 768},    {GGMLType::Q6_K, 0, 129, 4352}, {GGMLType::Q4_0, 0, 7, 96},
      {GGMLType::Q8_0, 0, 97, 4128},    {GGMLType::Q5_K, 0, 70, 2304},  {GGMLType::Q3_K, 0, 17, 1280},
      {GGMLType::Q4_1, 0, 530, 1056},   {GGMLType::F32, 128, 257, 4096}, {GGMLType::F32, 64, 40, 1472},
      {GGMLType::F32, 2048, 600, 2048}, {GGMLType::F16, 128, 300, 1024}, {GGMLType::F16, 32, 70, 512},
      {GGMLType::F16, 64, 33, 2112}, {GGMLType::MXFP4, 0, 300, 2880}, {GGMLType::MXFP4, 0, 45, 96},
      {GGMLType::Q4_K, 0, 12001, 256}};  // many rows of few columns: a warp (DP4A) or CTA takes several tasks
  constexpr int kM = cuda::kGemmIntMaxM;
  const int ms[] = {17, 24, 32, 33, 47, 64};
  const int split_choices[] = {0, 1, 3, 8};
  const bool big_tiles = cuda::gemm_int_available(256);
  size_t checked = 0;
  for (DType ab : kActs)
    for (const Case& c : cases) {
      const int n = c.n, k = c.k;
      Grouped g = grouped_case(ab, c, rng);
      SCOPED_TRACE(std::string(dtype_name(ab)) + " " + g.name + " n=" + std::to_string(n) + " k=" + std::to_string(k));
      const auto xr = random_act(ab, size_t(kM) * k, rng, 1.0f);
      const auto b = random_act(ab, size_t(n), rng, 0.5f);
      std::vector<double> ref(size_t(kM) * n), mag(size_t(kM) * n);
      for (int j = 0; j < n; ++j)
        for (int r = 0; r < kM; ++r) {
          double acc = 0, a = 0;
          for (int i = 0; i < k; ++i) {
            const double p = double(g.values[size_t(j) * k + i]) * xr[size_t(r) * k + i];
            acc += p;
            a += std::fabs(p);
          }
          ref[size_t(r) * n + j] = acc;
          mag[size_t(r) * n + j] = a;
        }
      Dev<uint8_t> dc(g.codes);
      Dev<uint32_t> dp(g.params);
      Dev<uint16_t> dx(codes(ab, xr)), db(codes(ab, b));
      const int ldy = n + 5;
      Dev<uint16_t> dy16(size_t(kM) * ldy);
      Dev<float> dy32(size_t(kM) * ldy);
      const cuda::IntWeight w = int_weight(g, dc, dp);
      for (size_t mi = 0; mi < std::size(ms); ++mi)
        for (const int tile : {128, 256}) {
          if (tile == 256 && !big_tiles) continue;
          const int m = ms[mi], splits = split_choices[(mi + size_t(tile / 128)) % std::size(split_choices)];
          for (int mode = 0; mode < 2; ++mode) {  // 0: 16-bit out + bias, 1: float32 out
            const bool f32 = mode == 1, bias = mode == 0;
            dy16.poison();
            dy32.poison();
            cuda::gemm_int(ab, f32 ? DType::F32 : ab, dx.p, w, bias ? db.p : nullptr,
                           f32 ? static_cast<void*>(dy32.p) : dy16.p, ldy, m, n, k, nullptr, tile, splits);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<float> got(size_t(kM) * ldy);
            if (f32) {
              got = dy32.download();
            } else {
              const auto raw = dy16.download();
              for (size_t i = 0; i < got.size(); ++i) got[i] = act_value(ab, raw[i]);
            }
            size_t bad = 0, outside = 0;
            double worst = 0;
            for (int r = 0; r < kM; ++r)
              for (int j = 0; j < ldy; ++j) {
                const float v = got[size_t(r) * ldy + j];
                if (r >= m || j >= n) {
                  outside += !std::isnan(v);
                  continue;
                }
                const size_t at = size_t(r) * n + j;
                const double want = ref[at] + (bias ? double(b[size_t(j)]) : 0.0);
                const double e = std::isnan(v) ? 1e30 : std::fabs(v - want);
                worst = std::max(worst, e);
                bad += e > (f32 ? 1e-6 : act_rel_tol(ab)) * std::fabs(want) +
                               1e-4 * (mag[at] + (bias ? std::fabs(b[size_t(j)]) : 0.0));
                ++checked;
              }
            EXPECT_EQ(bad, 0u) << "m=" << m << " tile " << tile << " splits " << splits << " mode " << mode
                               << " max err " << worst;
            EXPECT_EQ(outside, 0u) << "m=" << m << " tile " << tile << ": written outside y[m][n]";
          }
        }
    }
  EXPECT_GT(checked, 1000000u);
}

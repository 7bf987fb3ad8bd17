// FP8 weights on the GPU (ops/cuda/gemm.h): gemv_fp8 and dequantize_fp8 (decode at batch
// 1-16), and above that the per-token activation quantization and the FP8 tensor-core GEMMs
// (gemm_fp8_small for decode batches of row-scaled weights, Gemm::linear_fp8 otherwise; row
// and 128 x 128 block scales), each against its definition in double.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "act_test_util.h"
#include "core/error.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/model_ops.h"

using namespace kvlm;
using kvlm::test::Dev;
using namespace kvlm::test::act;

namespace {

// Random E4M3 codes, none of them NaN (a NaN code is not a weight).
std::vector<uint8_t> random_fp8_codes(size_t n, std::mt19937& rng) {
  std::vector<uint8_t> c(n);
  for (auto& v : c) {
    do v = uint8_t(rng());
    while ((v & 0x7f) == 0x7f);
  }
  return c;
}

// quantize_rows_fp8 as documented: per row of x [m][k] (group = k) or per 128-value group,
// scale = max |x| / 448 (1 when all zero), codes f32_to_e4m3(x / scale); scales [k / group][m].
std::pair<std::vector<uint8_t>, std::vector<float>> quantize_reference(const std::vector<float>& x, int m, int k,
                                                                       int group) {
  const int groups = k / group;
  std::vector<uint8_t> codes(size_t(m) * size_t(k));
  std::vector<float> scales(size_t(groups) * size_t(m));
  for (int r = 0; r < m; ++r)
    for (int g = 0; g < groups; ++g) {
      const size_t b = size_t(r) * size_t(k) + size_t(g) * size_t(group);
      float amax = 0;
      for (int i = 0; i < group; ++i) amax = std::max(amax, std::fabs(x[b + size_t(i)]));
      const float s = amax > 0 ? amax / num::kE4M3Max : 1.0f;
      scales[size_t(g) * size_t(m) + size_t(r)] = s;
      for (int i = 0; i < group; ++i) codes[b + size_t(i)] = num::f32_to_e4m3(x[b + size_t(i)] / s);
    }
  return {codes, scales};
}

// One Gemm::linear_fp8 into a poisoned output of `out`'s type, downloaded into `raw` (call
// under ASSERT_NO_FATAL_FAILURE: a shape without an algorithm fails the test).
void run_linear_fp8(cuda::Gemm& gemm, DType out, const uint8_t* x, const float* x_scales, const cuda::Fp8Weight& w,
                    const void* bias, int m, int n, int k, std::vector<uint8_t>& raw) {
  Dev<uint8_t> dy(size_t(m) * n * (out == DType::F32 ? 4 : 2));
  dy.poison();
  ASSERT_TRUE(gemm.linear_fp8(out, x, x_scales, w, bias, dy.p, m, n, k, nullptr))
      << "no FP8 GEMM (" << (w.block_scales ? "block" : "row") << " scales) for m " << m << " n " << n << " k " << k;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  raw = dy.download();
}

// Element o of a downloaded output of type `out` (fp32, or the 16-bit activation type ab).
float output_at(DType ab, DType out, const std::vector<uint8_t>& raw, size_t o) {
  if (out == DType::F32) {
    float v;
    std::memcpy(&v, raw.data() + 4 * o, 4);
    return v;
  }
  uint16_t c;
  std::memcpy(&c, raw.data() + 2 * o, 2);
  return act_value(ab, c);
}

}  // namespace

// FP8 weights (gemm.h gemv_fp8, dequantize_fp8) against the definition. gemv_fp8's kernels
// (variants 1 and 3: FMA, rows and split k, kGemvMaxM rows of x per pass; variant 2: tensor
// cores, one pass, with CTAs of
// 64, 32 and 16 rows and k split over clusters of 1, 2, 4 and 8 CTAs) over m = 1..16, odd n
// (not multiples of the 16-row tiles or the CTAs' rows) and k (not multiples of the 64-wide
// rounds or of 128), every scaling kind (one scale per row: scale_block = k; 128-column blocks
// with a partial last block; 16-column blocks, which only the FMA kernels take), bias and
// float32 output. The reference sums code * scale * x in double over the same 16-bit x; the GPU
// sums fp32 and rounds once, so the bound is the 16-bit rounding (none for float32 output) plus
// 1e-4 of sum |w x|; rows of y past m must stay unwritten. dequantize_fp8 is code * scale
// rounded once to the compute type: bit-exact.
TEST(CudaModelOps, Fp8GemvAndDequantize) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!cuda::fp8_weights_supported(test::compute_capability())) GTEST_SKIP() << "no FP8 instructions on this GPU";
  std::mt19937 rng(27);
  {  // misuse is an error, not a wrong answer
    Dev<uint8_t> dc(size_t(16) * 48);
    Dev<float> ds(16 * 3);
    Dev<uint16_t> dx(48 * 17), dy(16 * 17);
    const cuda::Fp8Weight bad{.codes = dc.p, .scales = ds.p, .scale_block = 24};
    EXPECT_THROW(cuda::gemv_fp8(DType::BF16, DType::BF16, dx.p, bad, nullptr, dy.p, 1, 16, 24, nullptr), Error);
    EXPECT_THROW(cuda::gemv_fp8(DType::BF16, DType::BF16, dx.p, bad, nullptr, dy.p, 5, 16, 24, nullptr), Error);
    const cuda::Fp8Weight b16{.codes = dc.p, .scales = ds.p, .scale_block = 16};
    EXPECT_THROW(cuda::gemv_fp8(DType::BF16, DType::BF16, dx.p, b16, nullptr, dy.p, 17, 16, 48, nullptr), Error);
    EXPECT_FALSE(cuda::gemv_fp8_mma_fits(48, 16));
    EXPECT_THROW(cuda::gemv_fp8(DType::BF16, DType::BF16, dx.p, b16, nullptr, dy.p, 4, 16, 48, nullptr, 2), Error);
    EXPECT_TRUE(cuda::gemv_fp8_mma_fits(48, 48));
    EXPECT_TRUE(cuda::gemv_fp8_mma_fits(272, 128));
  }
  struct Shape {
    int n, k, block;
  };
  const Shape shapes[] = {{1, 16, 16},     {7, 48, 48},       {33, 272, 272},  {300, 272, 128}, {129, 4096, 128},
                          {61, 1040, 16},  {1000, 1552, 1552}, {70, 8320, 128}, {97, 4160, 4160}, {50, 2496, 128}};
  constexpr int kM = cuda::kGemvFp8MaxM;
  const cuda::KernelSwitches saved = cuda::kernel_switches();
  size_t checked = 0, dequantized = 0;
  for (DType ab : kActs)
    for (const Shape& sh : shapes) {
      const int n = sh.n, k = sh.k, nb = (k + sh.block - 1) / sh.block;
      const std::vector<uint8_t> codes8 = random_fp8_codes(size_t(n) * k, rng);
      std::uniform_real_distribution<float> ud(1e-4f, 2e-3f);
      std::vector<float> sc(size_t(n) * nb);
      for (auto& x : sc) x = ud(rng);
      const auto xr = random_act(ab, size_t(kM) * k, rng, 1.0f);  // up to kM input rows; m takes the first m
      const auto b = random_act(ab, size_t(n), rng, 0.5f);
      // The reference without the bias, and sum |w x|, for every row of x.
      std::vector<double> ref(size_t(kM) * n), mag(size_t(kM) * n);
      {
        std::vector<double> wrow(static_cast<size_t>(k));
        for (int j = 0; j < n; ++j) {
          for (int i = 0; i < k; ++i)
            wrow[size_t(i)] = double(num::e4m3_to_f32(codes8[size_t(j) * k + i])) * sc[size_t(j) * nb + i / sh.block];
          for (int r = 0; r < kM; ++r) {
            double acc = 0, a = 0;
            const float* xp = xr.data() + size_t(r) * k;
            for (int i = 0; i < k; ++i) {
              const double p = wrow[size_t(i)] * xp[i];
              acc += p;
              a += std::fabs(p);
            }
            ref[size_t(r) * n + j] = acc;
            mag[size_t(r) * n + j] = a;
          }
        }
      }
      Dev<uint8_t> dc(codes8);
      Dev<float> ds(sc);
      Dev<uint16_t> dx(codes(ab, xr)), db(codes(ab, b));
      Dev<uint16_t> dy16(size_t(kM) * n);
      Dev<float> dy32(size_t(kM) * n);
      const cuda::Fp8Weight w{.codes = dc.p, .scales = ds.p, .scale_block = sh.block};
      const bool mma = cuda::gemv_fp8_mma_fits(k, sh.block);
      for (int m = 1; m <= kM; ++m)
        for (int mode = 0; mode < 2; ++mode)  // 0: 16-bit out + bias, 1: float32 out
          // 1, 7: the rows and split FMA kernels; 2-6: the tensor-core kernel with CTAs of 64 / 32 /
          // 16 rows / 32 rows split 4 ways / 64 rows split 8 ways (clusters), whatever the launcher
          // would choose.
          for (int variant = 1; variant <= 7; ++variant) {
            if (!mma && variant >= 2 && variant <= 6) continue;
            const bool f32 = mode == 1, bias = mode == 0;
            dy16.poison();
            dy32.poison();
            cuda::KernelSwitches sw = saved;
            const int tiles[] = {0, 0, 4, 2, 1, 2, 4, 0}, splits[] = {0, 0, 0, 0, 0, 4, 8, 0};
            sw.fp8_tc_tiles = tiles[variant];
            sw.fp8_tc_splits = splits[variant];
            cuda::set_kernel_switches(sw);
            cuda::gemv_fp8(ab, f32 ? DType::F32 : ab, dx.p, w, bias ? db.p : nullptr,
                           f32 ? static_cast<void*>(dy32.p) : dy16.p, m, n, k, nullptr, variant == 7 ? 3 : std::min(variant, 2));
            cuda::set_kernel_switches(saved);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<float> got(size_t(kM) * n);
            if (f32) {
              got = dy32.download();
            } else {
              const auto raw = dy16.download();
              for (size_t i = 0; i < got.size(); ++i) got[i] = act_value(ab, raw[i]);
            }
            size_t bad = 0;
            double worst = 0;
            for (int r = 0; r < m; ++r)
              for (int j = 0; j < n; ++j) {
                const size_t at = size_t(r) * n + j;
                const double want = ref[at] + (bias ? double(b[size_t(j)]) : 0.0);
                const double g = got[at], e = std::isnan(g) ? 1e30 : std::fabs(g - want);
                worst = std::max(worst, e);
                bad += e > (f32 ? 1e-6 : act_rel_tol(ab)) * std::fabs(want) + 1e-4 * (mag[at] + (bias ? std::fabs(b[size_t(j)]) : 0.0));
                ++checked;
              }
            // Rows past m stay as poisoned (NaN): nothing is written outside y[m][n].
            size_t outside = 0;
            for (size_t i = size_t(m) * n; i < got.size(); ++i) outside += !std::isnan(got[i]);
            EXPECT_EQ(bad, 0u) << dtype_name(ab) << " n=" << n << " k=" << k << " block=" << sh.block << " m=" << m
                               << " mode " << mode << " variant " << variant << " max err " << worst;
            EXPECT_EQ(outside, 0u) << dtype_name(ab) << " n=" << n << " k=" << k << " m=" << m << " variant " << variant;
          }
      Dev<uint16_t> dd(size_t(n) * k);
      dd.poison();
      cuda::dequantize_fp8(ab, w, dd.p, n, k, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto deq = dd.download();
      size_t diff = 0;
      std::string first;
      for (int j = 0; j < n; ++j)
        for (int i = 0; i < k; ++i) {
          const size_t at = size_t(j) * k + i;
          const uint16_t want = act_code(ab, num::e4m3_to_f32(codes8[at]) * sc[size_t(j) * nb + i / sh.block]);
          if (deq[at] != want && ++diff <= 3)
            first += " (" + std::to_string(j) + "," + std::to_string(i) + "): code " + std::to_string(codes8[at]) +
                     " got " + std::to_string(act_value(ab, deq[at])) + " want " + std::to_string(act_value(ab, want));
        }
      EXPECT_EQ(diff, 0u) << "dequantize_fp8 " << dtype_name(ab) << " n=" << n << " k=" << k << first;
      dequantized += deq.size();
    }
  std::printf("[cuda-fp8] gemv_fp8: %zu outputs within bounds (m = 1..%d, both FMA kernels and five tensor-core CTA shapes); dequantize_fp8 "
              "bit-exact (%zu values)\n",
              checked, kM, dequantized);
}

// Per-token activation quantization (bit-exact against the CPU arithmetic it documents) and
// the FP8 tensor-core GEMM over it (cuBLASLt, outer-vector scales) against a double reference
// on the quantized operands: m above the GEMV's 16, n and k multiples of 16 that are not of
// 64 or 128, with and without a bias, 16-bit and fp32 outputs. Hopper's FP8 MMA adds its
// products in a narrower accumulator than fp32 between cuBLASLt's promotions: the first H100
// run measured a worst error of 3.0e-3 of sum |x w| (a few outputs in 622,080 above 5e-4), so
// the allowance is 4e-3 of it on top of the output's rounding; each case's worst is printed.
TEST(CudaModelOps, Fp8GemmOverPerTokenActivations) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!cuda::fp8_weights_supported(test::compute_capability())) GTEST_SKIP() << "no FP8 instructions on this GPU";
  std::mt19937 rng(31);
  cuda::Gemm gemm;
  Dev<uint8_t> ws(cuda::kGemmWorkspaceBytes);
  gemm.set_workspace(ws.p, ws.n);
  EXPECT_TRUE(cuda::fp8_gemm_fits(400, 1040, 1040));
  EXPECT_FALSE(cuda::fp8_gemm_fits(400, 1040, 128)) << "block scales take the dequantizing path";
  EXPECT_FALSE(cuda::fp8_gemm_fits(401, 1040, 1040));
  EXPECT_FALSE(cuda::fp8_gemm_fits(400, 1048, 1048));
  double worst_rel = 0;
  size_t checked = 0;
  for (DType ab : kActs)
    for (auto [m, n, k] : {std::tuple{17, 384, 256}, {64, 400, 1040}, {200, 112, 4096}, {512, 96, 176}, {20, 64, 8192}}) {
      auto x = random_act(ab, size_t(m) * k, rng, 2.0f);
      for (int i = 0; i < k; ++i) x[size_t(5 % m) * k + i] = 0.0f;  // an all-zero row: scale 1
      x[size_t(k) + 3] = act_round(ab, 300.0f);                      // an outlier in row 1
      const auto [want_codes, want_scales] = quantize_reference(x, m, k, k);
      Dev<uint16_t> dx(codes(ab, x));
      Dev<uint8_t> dxc(size_t(m) * k);
      Dev<float> dxs(static_cast<size_t>(m));
      cuda::quantize_rows_fp8(ab, dx.p, dxc.p, dxs.p, m, k, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(dxs.download(), want_scales) << dtype_name(ab) << " m " << m << " k " << k;
      ASSERT_EQ(dxc.download(), want_codes) << dtype_name(ab) << " m " << m << " k " << k;

      const std::vector<uint8_t> wc = random_fp8_codes(size_t(n) * k, rng);
      std::uniform_real_distribution<float> ud(1e-4f, 2e-3f);
      std::vector<float> wsc(static_cast<size_t>(n));
      for (auto& v : wsc) v = ud(rng);
      const auto b = random_act(ab, size_t(n), rng, 0.5f);
      Dev<uint8_t> dwc(wc);
      Dev<float> dws(wsc);
      Dev<uint16_t> db(codes(ab, b));
      const cuda::Fp8Weight w{.codes = dwc.p, .scales = dws.p, .scale_block = k};
      for (DType out : {ab, DType::F32})
        for (bool bias : {false, true}) {
          if (bias && out == DType::F32) continue;
          std::vector<uint8_t> raw;
          ASSERT_NO_FATAL_FAILURE(run_linear_fp8(gemm, out, dxc.p, dxs.p, w, bias ? db.p : nullptr, m, n, k, raw));
          size_t bad = 0;
          double case_worst = 0;
          for (int r = 0; r < m; ++r)
            for (int j = 0; j < n; ++j) {
              double acc = 0, mag = 0;
              for (int i = 0; i < k; ++i) {
                const double p = double(num::e4m3_to_f32(want_codes[size_t(r) * k + i])) *
                                 double(num::e4m3_to_f32(wc[size_t(j) * k + i]));
                acc += p;
                mag += std::fabs(p);
              }
              const double scale = double(want_scales[size_t(r)]) * double(wsc[size_t(j)]);
              const double ref = acc * scale + (bias ? double(b[size_t(j)]) : 0.0);
              mag = mag * scale + (bias ? std::fabs(double(b[size_t(j)])) : 0.0);
              const float got = output_at(ab, out, raw, size_t(r) * n + j);
              const double e = std::fabs(double(got) - ref);
              if (mag > 0) case_worst = std::max(case_worst, e / mag);
              bad += std::isnan(got) || e > (out == DType::F32 ? 0.0 : act_rel_tol(ab)) * std::fabs(ref) + 4e-3 * mag;
              ++checked;
            }
          EXPECT_EQ(bad, 0u) << dtype_name(ab) << " -> " << dtype_name(out) << (bias ? " + bias" : "") << " m " << m
                             << " n " << n << " k " << k;
          std::printf("[fp8-gemm] %s -> %s%s m %d n %d k %d: worst %.2e of sum |x w|\n", dtype_name(ab).data(),
                      dtype_name(out).data(), bias ? " + bias" : "", m, n, k, case_worst);
          worst_rel = std::max(worst_rel, case_worst);
        }
    }
  std::printf("[fp8-gemm] %zu outputs, worst error %.2e of sum |x w|\n", checked, worst_rel);

  // The block-scaled format (Qwen3-FP8, DeepSeek-V3): the weight per 128 x 128 block, the
  // activations per token and 128-value group ([k / 128][m], token fastest), rows in
  // multiples of 4 (fp8_gemm_rows; CudaOps runs the rest through gemv_fp8).
  EXPECT_EQ(cuda::fp8_gemm_rows(33, 1024, 128), 32);
  EXPECT_EQ(cuda::fp8_gemm_rows(33, 1024, 1024), 33);
  EXPECT_TRUE(cuda::fp8_gemm_fits(384, 1024, 128));
  EXPECT_FALSE(cuda::fp8_gemm_fits(400, 1024, 128));
  EXPECT_FALSE(cuda::fp8_gemm_fits(384, 1040, 128));
  double block_worst = 0;
  for (DType ab : kActs)
    // (k = 4608: 36 groups a row, over 3 CTAs of the group quantizer, the last one partial; k =
    // 384 and 640: rows of 3 and 5 blocks, which cuBLASLt reads padded to 4 and 8)
    for (auto [m, n, k] : {std::tuple{36, 256, 1024}, {132, 384, 512}, {20, 128, 4608}, {36, 640, 384}, {24, 256, 640}}) {
      const int kb = k / 128, nbk = n / 128, ld = cuda::fp8_block_scale_ld(k);
      auto x = random_act(ab, size_t(m) * k, rng, 2.0f);
      x[size_t(k) + 200] = act_round(ab, 300.0f);  // an outlier in row 1, group 1
      const auto [xc, xs] = quantize_reference(x, m, k, 128);
      Dev<uint16_t> dx(codes(ab, x));
      Dev<uint8_t> dxc(size_t(m) * k);
      Dev<float> dxs(xs.size());
      cuda::quantize_rows_fp8(ab, dx.p, dxc.p, dxs.p, m, k, nullptr, 128);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(dxs.download(), xs) << "group scales, " << dtype_name(ab) << " m " << m << " k " << k;
      ASSERT_EQ(dxc.download(), xc) << "group codes, " << dtype_name(ab) << " m " << m << " k " << k;
      const std::vector<uint8_t> wc = random_fp8_codes(size_t(n) * k, rng);
      std::uniform_real_distribution<float> ud(1e-4f, 2e-3f);
      std::vector<float> blocks(size_t(nbk) * ld, 1e30f), rows(size_t(n) * kb);  // (padding: never read)
      for (int bj = 0; bj < nbk; ++bj)
        for (int g = 0; g < kb; ++g) blocks[size_t(bj) * ld + g] = ud(rng);
      for (int j = 0; j < n; ++j)
        for (int g = 0; g < kb; ++g) rows[size_t(j) * kb + g] = blocks[size_t(j / 128) * ld + g];
      Dev<uint8_t> dwc(wc);
      Dev<float> dws(rows), dwb(blocks);
      const cuda::Fp8Weight w{.codes = dwc.p, .scales = dws.p, .scale_block = 128, .block_scales = dwb.p};
      std::vector<uint8_t> raw;
      ASSERT_NO_FATAL_FAILURE(run_linear_fp8(gemm, ab, dxc.p, dxs.p, w, nullptr, m, n, k, raw));
      size_t bad = 0;
      double case_worst = 0;
      for (int r = 0; r < m; ++r)
        for (int j = 0; j < n; ++j) {
          double ref = 0, mag = 0;
          for (int g = 0; g < kb; ++g) {
            const double s = double(xs[size_t(g) * m + r]) * double(blocks[size_t(j / 128) * ld + g]);
            for (int i = g * 128; i < (g + 1) * 128; ++i) {
              const double p = double(num::e4m3_to_f32(xc[size_t(r) * k + i])) * double(num::e4m3_to_f32(wc[size_t(j) * k + i])) * s;
              ref += p;
              mag += std::fabs(p);
            }
          }
          const float got = output_at(ab, ab, raw, size_t(r) * n + j);
          const double e = std::fabs(double(got) - ref);
          if (mag > 0) case_worst = std::max(case_worst, e / mag);
          bad += std::isnan(got) || e > act_rel_tol(ab) * std::fabs(ref) + 4e-3 * mag;
        }
      EXPECT_EQ(bad, 0u) << "block-scaled " << dtype_name(ab) << " m " << m << " n " << n << " k " << k;
      std::printf("[fp8-gemm] block-scaled %s m %d n %d k %d: worst %.2e of sum |x w|\n", dtype_name(ab).data(), m, n, k,
                  case_worst);
      block_worst = std::max(block_worst, case_worst);
    }
  std::printf("[fp8-gemm] block-scaled worst %.2e\n", block_worst);
}

// gemm_fp8_small (decode batches; CudaOps runs it for 17..64 rows) against the definition in
// double: E4M3 codes of x with per-token scales times row-scaled weights, and with per-(token,
// 128-group) scales times 128 x 128 block-scaled weights (Qwen3-FP8's layout: group scales
// that differ by 100x between groups, so a round scaled with its neighbour's scale fails);
// m = 1..64 (both x-tile widths, rows past the tile's used ones), n not a multiple of the
// 128-row CTAs or of 8, k not a multiple of the 128-wide rounds (row scales), every cluster
// split of k (1-8, including CTAs left without a round), bias, float32 output, an all-zero x
// row. Products of two E4M3 values are exact in fp32; the bound is the output's rounding plus
// the FP8 GEMM's allowance above (4e-3 of sum |x w|), the worst figure printed.
TEST(CudaModelOps, Fp8SmallBatchGemm) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (!cuda::gemm_fp8_small_available()) GTEST_SKIP() << "no sm_90a code for this GPU (the kernel is Hopper's wgmma)";
  EXPECT_TRUE(cuda::gemm_fp8_small_fits(64, 1040, 1040));
  EXPECT_FALSE(cuda::gemm_fp8_small_fits(65, 1040, 1040));
  EXPECT_FALSE(cuda::gemm_fp8_small_fits(8, 1048, 1048));
  EXPECT_TRUE(cuda::gemm_fp8_small_fits(8, 1024, 128));
  EXPECT_FALSE(cuda::gemm_fp8_small_fits(8, 1040, 128)) << "block scales need whole 128-column blocks";
  EXPECT_FALSE(cuda::gemm_fp8_small_fits(8, 1024, 64)) << "a round is one 128-column block";
  std::mt19937 rng(53);
  double worst[2] = {0, 0};
  size_t checked[2] = {0, 0};
  for (bool block : {false, true})
    for (auto [m, n, k] : {std::tuple{17, 200, 1040}, {32, 136, 176}, {33, 1000, 528}, {64, 384, 4096}, {1, 72, 256},
                           {5, 130, 2048}, {48, 130, 384}}) {
      if (block) k = (k + 127) / 128 * 128;
      const int groups = block ? k / 128 : 1, rblocks = (n + 127) / 128, ld = cuda::fp8_block_scale_ld(k);
      const std::vector<uint8_t> xc = random_fp8_codes(size_t(m) * k, rng), wc = random_fp8_codes(size_t(n) * k, rng);
      std::vector<uint8_t> xz = xc;
      for (int i = 0; i < k; ++i) xz[size_t(3 % m) * k + i] = 0;  // an all-zero row (its scale stays)
      std::uniform_real_distribution<float> ud(1e-4f, 2e-3f);
      // x scales [groups][m]; weight scales per row [n] or per block [rblocks][groups]
      std::vector<float> xs(size_t(groups) * size_t(m)), ws(block ? size_t(rblocks) * size_t(ld) : size_t(n));
      for (size_t i = 0; i < xs.size(); ++i) xs[i] = ud(rng) * (block && (i / size_t(m)) % 2 ? 1e4f : 100.0f);
      for (size_t i = 0; i < ws.size(); ++i) ws[i] = !block || int(i % size_t(ld)) < groups ? ud(rng) : 1e30f;
      auto wscale = [&](int j, int gi) { return block ? ws[size_t(j / 128) * ld + size_t(gi)] : ws[size_t(j)]; };
      // ref[r][j] and sum |x w| in double
      std::vector<double> ref(size_t(m) * n), mag(size_t(m) * n);
      for (int r = 0; r < m; ++r)
        for (int j = 0; j < n; ++j) {
          double d = 0, dm = 0;
          for (int gi = 0; gi < groups; ++gi) {
            const int len = k / groups;
            double gd = 0, gm = 0;
            for (int i = gi * len; i < (gi + 1) * len; ++i) {
              const double p =
                  double(num::e4m3_to_f32(xz[size_t(r) * k + i])) * double(num::e4m3_to_f32(wc[size_t(j) * k + i]));
              gd += p;
              gm += std::fabs(p);
            }
            const double sc = double(xs[size_t(gi) * m + size_t(r)]) * double(wscale(j, gi));
            d += gd * sc;
            dm += gm * sc;
          }
          ref[size_t(r) * n + j] = d;
          mag[size_t(r) * n + j] = dm;
        }
      Dev<uint8_t> dxc(xz), dwc(wc);
      Dev<float> dxs(xs), dws(ws);
      // Row scales: one per row (the kernel reads .scales). Blocks: .block_scales, and .scales
      // (one row per weight row) left null, which the kernel must not read.
      const cuda::Fp8Weight w = block ? cuda::Fp8Weight{.codes = dwc.p, .scale_block = 128, .block_scales = dws.p}
                                      : cuda::Fp8Weight{.codes = dwc.p, .scales = dws.p, .scale_block = k};
      for (DType ab : kActs) {
        const auto bv = random_act(ab, size_t(n), rng, 0.5f);
        Dev<uint16_t> db(codes(ab, bv));
        for (DType out : {ab, DType::F32})
          for (bool bias : {false, true})
            for (int splits : {0, 1, 2, 4, 8}) {
              if (bias && out == DType::F32) continue;
              Dev<uint8_t> dy(size_t(m) * n * (out == DType::F32 ? 4 : 2));
              dy.poison();
              cuda::gemm_fp8_small(out, dxc.p, dxs.p, w, bias ? db.p : nullptr, dy.p, m, n, k, nullptr, splits);
              ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
              const std::vector<uint8_t> raw = dy.download();
              size_t bad = 0;
              double case_worst = 0;
              for (int r = 0; r < m; ++r)
                for (int j = 0; j < n; ++j) {
                  const size_t o = size_t(r) * n + j;
                  const double want = ref[o] + (bias ? double(bv[size_t(j)]) : 0.0);
                  const double mg = mag[o] + (bias ? std::fabs(double(bv[size_t(j)])) : 0.0);
                  const float got = output_at(ab, out, raw, o);
                  const double e = std::fabs(double(got) - want);
                  if (mg > 0) case_worst = std::max(case_worst, e / mg);
                  bad += std::isnan(got) || e > (out == DType::F32 ? 0.0 : act_rel_tol(ab)) * std::fabs(want) + 4e-3 * mg;
                  ++checked[block];
                }
              EXPECT_EQ(bad, 0u) << (block ? "128 x 128 blocks " : "row scales ") << dtype_name(ab) << " -> "
                                 << dtype_name(out) << (bias ? " + bias" : "") << " m " << m << " n " << n << " k " << k
                                 << " splits " << splits << " (" << cuda::gemm_fp8_small_last_launch() << ")";
              worst[block] = std::max(worst[block], case_worst);
            }
      }
    }
  std::printf("[fp8-small-gemm] row scales: %zu outputs, worst error %.2e of sum |x w|; 128 x 128 blocks: %zu, %.2e\n",
              checked[0], worst[0], checked[1], worst[1]);
  EXPECT_THROW(cuda::gemm_fp8_small(DType::BF16, nullptr, nullptr, cuda::Fp8Weight{.scale_block = 256}, nullptr,
                                    nullptr, 65, 128, 256, nullptr),
               Error)
      << "65 rows";
  EXPECT_THROW(cuda::gemm_fp8_small(DType::BF16, nullptr, nullptr, cuda::Fp8Weight{.scale_block = 64}, nullptr,
                                    nullptr, 8, 128, 256, nullptr),
               Error)
      << "64-column scale blocks";
  EXPECT_THROW(cuda::gemm_fp8_small(DType::BF16, nullptr, nullptr, cuda::Fp8Weight{.scale_block = 128}, nullptr,
                                    nullptr, 8, 128, 256, nullptr),
               Error)
      << "128-column blocks without the per-block scales";
  EXPECT_THROW(cuda::gemm_fp8_small(DType::BF16, nullptr, nullptr, cuda::Fp8Weight{.scale_block = 256}, nullptr,
                                    nullptr, 8, 128, 256, nullptr, 3),
               Error)
      << "a split of k that does not divide the CTA's rows";
}

// The RMSNorm that quantizes its output for the FP8 GEMM after it (add_rmsnorm's codes): the
// output unchanged, and codes and scales equal to quantize_rows_fp8 of that output, per row
// and per 128-value group, bf16 / f16, hidden sizes that take 4, 8 and 16 values per thread and
// CTAs of 128 to 1,024 threads, an outlier (so a group's scale differs from its row's), an
// all-zero row; rmsnorm_fp8_fits refuses the shapes whose groups would straddle warps.
TEST(CudaModelOps, Fp8NormQuantizesItsOutput) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  EXPECT_TRUE(cuda::rmsnorm_fp8_fits(4096, 128));
  EXPECT_TRUE(cuda::rmsnorm_fp8_fits(896, 0));
  EXPECT_FALSE(cuda::rmsnorm_fp8_fits(896, 128)) << "224 threads a row: a 128-value group would straddle warps";
  EXPECT_FALSE(cuda::rmsnorm_fp8_fits(1000, 128)) << "not whole groups";
  EXPECT_FALSE(cuda::rmsnorm_fp8_fits(4100, 0)) << "the quantizer's k % 8";
  EXPECT_FALSE(cuda::rmsnorm_fp8_fits(4096, 64));
  std::mt19937 rng(61);
  size_t values = 0;
  for (DType ab : kActs)
    for (auto [m, H, group] : {std::tuple{17, 4096, 0}, {33, 4096, 128}, {20, 2048, 128}, {5, 5120, 128}, {3, 896, 0},
                               {19, 16384, 128}, {24, 12288, 0}, {2, 512, 128}}) {
      ASSERT_TRUE(cuda::rmsnorm_fp8_fits(H, group)) << H << " / " << group;
      auto delta = random_act(ab, size_t(m) * H, rng, 2.0f);
      delta[size_t(H) + 7] = act_round(ab, 200.0f);                      // an outlier in row 1
      for (int i = 0; i < H; ++i) delta[size_t(2 % m) * H + i] = 0.0f;  // an all-zero row
      std::vector<float> w(static_cast<size_t>(H));
      for (auto& v : w) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
      Dev<uint16_t> ddelta(codes(ab, delta)), plain(size_t(m) * H), fused(size_t(m) * H);
      Dev<float> dw(w);
      const int groups = group ? H / group : 1;
      Dev<uint8_t> got_c(size_t(m) * H), want_c(size_t(m) * H);
      Dev<float> got_s(size_t(groups) * m), want_s(size_t(groups) * m);
      got_c.poison();
      got_s.poison();
      const cuda::AddRmsNormParams p{.act = ab, .rows = m, .hidden = H, .delta = ddelta.p, .weight = dw.p, .eps = 1e-6f,
                                     .out = plain.p};
      cuda::add_rmsnorm(p, nullptr);
      cuda::AddRmsNormParams q = p;
      q.out = fused.p;
      q.codes = got_c.p;
      q.code_scales = got_s.p;
      q.code_group = group;
      cuda::add_rmsnorm(q, nullptr);
      cuda::quantize_rows_fp8(ab, plain.p, want_c.p, want_s.p, m, H, nullptr, group);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::string what = std::string(dtype_name(ab)) + " m " + std::to_string(m) + " H " + std::to_string(H) +
                               " group " + std::to_string(group);
      ASSERT_EQ(fused.download(), plain.download()) << what;
      ASSERT_EQ(got_s.download(), want_s.download()) << what;
      ASSERT_EQ(got_c.download(), want_c.download()) << what;
      values += size_t(m) * H;
    }
  std::printf("[fp8-gemm] add_rmsnorm's codes: %zu equal to quantize_rows_fp8 of its output\n", values);
  uint8_t* c = reinterpret_cast<uint8_t*>(16);
  EXPECT_THROW(cuda::add_rmsnorm({.rows = 1, .hidden = 896, .delta = c, .weight = reinterpret_cast<float*>(16),
                                  .out = c, .codes = c, .code_scales = reinterpret_cast<float*>(16), .code_group = 128},
                                 nullptr),
               Error);
  EXPECT_THROW(cuda::add_rmsnorm({.rows = 1, .hidden = 512, .delta = c, .weight = reinterpret_cast<float*>(16),
                                  .out = c, .codes = c},
                                 nullptr),
               Error)
      << "codes without scales";
}

// The down projection's quantizer with the gated MLP's product fused in: its codes and scales
// equal glu() then quantize_rows_fp8 (whose arithmetic the test above checks against the CPU),
// per row and per 128-value group, bf16 / f16, SiLU and GELU-tanh, gates large enough to
// reach the activation's tails, an all-zero row and m above the GEMV's 16.
TEST(CudaModelOps, Fp8QuantizeFusesTheGatedProduct) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(47);
  size_t values = 0;
  for (DType ab : kActs)
    for (GluActivation f : {GluActivation::Silu, GluActivation::GeluTanh})
      for (auto [m, k, group] : {std::tuple{17, 256, 0}, {64, 1040, 0}, {5, 12288, 0}, {36, 1024, 128}, {3, 128, 128}}) {
        auto gu = random_act(ab, size_t(m) * 2 * k, rng, 6.0f);
        for (int i = 0; i < 2 * k; ++i) gu[size_t(2 % m) * 2 * k + i] = 0.0f;  // an all-zero row: scale 1
        Dev<uint16_t> dgu(codes(ab, gu)), dact(size_t(m) * k);
        const int groups = group == 0 ? 1 : k / group;
        Dev<uint8_t> want_c(size_t(m) * k), got_c(size_t(m) * k);
        Dev<float> want_s(size_t(groups) * m), got_s(size_t(groups) * m);
        cuda::glu(ab, f, dgu.p, dact.p, m, k, nullptr);
        cuda::quantize_rows_fp8(ab, dact.p, want_c.p, want_s.p, m, k, nullptr, group);
        cudaMemset(got_c.p, 0xff, got_c.n);
        cuda::quantize_glu_rows_fp8(ab, f, dgu.p, got_c.p, got_s.p, m, k, nullptr, group);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const std::string what = std::string(dtype_name(ab)) + (f == GluActivation::Silu ? " silu" : " gelu") +
                                 " m " + std::to_string(m) + " k " + std::to_string(k) + " group " + std::to_string(group);
        ASSERT_EQ(got_s.download(), want_s.download()) << what;
        ASSERT_EQ(got_c.download(), want_c.download()) << what;
        values += size_t(m) * k;
      }
  std::printf("[fp8-gemm] quantize_glu_rows_fp8: %zu codes equal to glu + quantize_rows_fp8\n", values);
  EXPECT_THROW(cuda::quantize_glu_rows_fp8(DType::BF16, GluActivation::Silu, nullptr, nullptr, nullptr, 1, 12, nullptr),
               Error);
}

// The CUDA decoder kernels (ops/cuda/model_ops.h) and cuBLASLt GEMMs (ops/cuda/gemm.h)
// against the CPU reference ops (ops/cpu, attention/cpu_backend) on random inputs, for both
// activation dtypes (bfloat16, float16) and every KV format. Inputs are representable in the
// activation dtype, so both sides start from the same numbers; outputs are poisoned (NaN
// bytes) before each run.
//
// Tolerances: the GPU rounds each output once to the 16-bit type (relative error <= 2^-9
// for bf16, 2^-12 for fp16); fp32 work in another order (FMA contraction, sincosf vs
// std::cos, warp-tree sums) moves the pre-rounding value by a few fp32 ulps, which can move
// a result that sits on a rounding boundary to the neighbouring 16-bit value: so outputs
// must be within 2^-8 (bf16) / 2^-10 (fp16) relative of the reference, plus a small
// absolute floor. Quantized K/V pages: codes equal except where the fp32 input differs by
// ulps across a rounding boundary — then the two codes must be neighbours (one step apart),
// in at most 1% of the elements; per-token-head scales agree to fp32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>

#include "attention/cpu_backend.h"
#include "attention/kv_format.h"
#include "config/kv_plan.h"
#include "core/hadamard.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "model/rope.h"
#include "ops/cpu/ops.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/model_ops.h"
#include "ops/cuda/sampling.h"
#include "core/philox.h"
#include "sampling/sampler.h"

using namespace kvlm;
using kvlm::test::Dev;

namespace {

// Rounds to the activation dtype and returns (rounded float, 16-bit code).
float act_round(DType act, float x) {
  return act == DType::BF16 ? num::bf16_to_f32(num::f32_to_bf16(x)) : num::f16_to_f32(num::f32_to_f16(x));
}
uint16_t act_code(DType act, float x) { return act == DType::BF16 ? num::f32_to_bf16(x) : num::f32_to_f16(x); }
float act_value(DType act, uint16_t c) { return act == DType::BF16 ? num::bf16_to_f32(c) : num::f16_to_f32(c); }
double act_rel_tol(DType act) { return act == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -10); }

std::vector<float> random_act(DType act, size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = act_round(act, nd(rng));
  return v;
}
std::vector<uint16_t> codes(DType act, const std::vector<float>& v) {
  std::vector<uint16_t> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = act_code(act, v[i]);
  return c;
}

// max |got - ref| over elements, and how many exceed rel * |ref| + abs.
struct Cmp {
  double max_err = 0;
  size_t bad = 0;
};
Cmp compare(const std::vector<float>& got, const std::vector<float>& ref, double rel, double abs) {
  Cmp c;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::isnan(got[i]) ? 1e30 : std::fabs(double(got[i]) - double(ref[i]));
    c.max_err = std::max(c.max_err, e);
    c.bad += e > rel * std::fabs(double(ref[i])) + abs;
  }
  return c;
}

const DType kActs[] = {DType::BF16, DType::F16};

}  // namespace

TEST(CudaModelOps, EmbedAndAddRmsNorm) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(7);
  for (DType act : kActs) {
    for (int H : {72, 4096}) {
      const int rows = 5, vocab = 11;
      const auto table = random_act(act, size_t(vocab) * H, rng);
      const std::vector<TokenId> tokens{3, 0, 10, 3, 7};
      const auto delta = random_act(act, size_t(rows) * H, rng);
      std::vector<float> w(static_cast<size_t>(H));
      for (auto& x : w) x = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
      Dev<uint16_t> dtable(codes(act, table)), ddelta(codes(act, delta)), dout(size_t(rows) * H);
      Dev<TokenId> dtok(tokens);
      Dev<float> dx(size_t(rows) * H), dw(w);
      dx.poison();
      dout.poison();
      cuda::embed_rows(act, dtable.p, dtok.p, rows, H, dx.p, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> x(size_t(rows) * H);
      for (int r = 0; r < rows; ++r)
        std::copy_n(table.begin() + ptrdiff_t(tokens[size_t(r)]) * H, H, x.begin() + ptrdiff_t(r) * H);
      EXPECT_EQ(dx.download(), x) << "embed_rows";

      // x += delta, then the norm; x is written back.
      cuda::add_rmsnorm({.act = act, .rows = rows, .hidden = H, .x = dx.p, .delta = ddelta.p, .weight = dw.p, .eps = 1e-5f,
                         .out = dout.p},
                        nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
      EXPECT_EQ(dx.download(), x) << "residual write-back (one fp32 add, exact)";
      std::vector<float> ref(x.size());
      ops::cpu::rmsnorm(x, rows, H, w, 1e-5f, ref);
      std::vector<float> got;
      for (uint16_t c : dout.download()) got.push_back(act_value(act, c));
      Cmp c = compare(got, ref, act_rel_tol(act), 1e-6);
      EXPECT_EQ(c.bad, 0u) << dtype_name(act) << " H=" << H << " add_rmsnorm max err " << c.max_err;

      // The final norm: gathered rows (with repeats), x untouched.
      const std::vector<int32_t> map{4, 1, 4};
      Dev<int32_t> dmap(map);
      Dev<uint16_t> dsel(map.size() * size_t(H));
      dsel.poison();
      cuda::add_rmsnorm({.act = act, .rows = int(map.size()), .hidden = H, .x = dx.p, .delta = ddelta.p, .weight = dw.p,
                         .eps = 1e-5f, .out = dsel.p, .row_map = dmap.p},
                        nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dx.download(), x) << "row_map must leave x as it is";
      std::vector<float> xs;
      for (int32_t r : map)
        for (int i = 0; i < H; ++i) xs.push_back(x[size_t(r) * H + i] + delta[size_t(r) * H + i]);
      std::vector<float> ref2(xs.size());
      ops::cpu::rmsnorm(xs, int(map.size()), H, w, 1e-5f, ref2);
      got.clear();
      for (uint16_t c2 : dsel.download()) got.push_back(act_value(act, c2));
      c = compare(got, ref2, act_rel_tol(act), 1e-6);
      EXPECT_EQ(c.bad, 0u) << dtype_name(act) << " H=" << H << " gathered norm max err " << c.max_err;

      // A plain RMSNorm of an act tensor (x null), in place (Gemma's post-norms).
      cuda::add_rmsnorm({.act = act, .rows = rows, .hidden = H, .x = nullptr, .delta = ddelta.p, .weight = dw.p,
                         .eps = 1e-5f, .out = ddelta.p},
                        nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> ref3(delta.size());
      ops::cpu::rmsnorm(delta, rows, H, w, 1e-5f, ref3);
      got.clear();
      for (uint16_t c3 : ddelta.download()) got.push_back(act_value(act, c3));
      c = compare(got, ref3, act_rel_tol(act), 1e-6);
      EXPECT_EQ(c.bad, 0u) << dtype_name(act) << " H=" << H << " in-place rmsnorm max err " << c.max_err;

      // A scaled embedding (Gemma: sqrt(hidden)): one fp32 multiply of an exact value.
      cuda::embed_rows(act, dtable.p, dtok.p, rows, H, dx.p, nullptr, 25.25f);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> xs2(size_t(rows) * H);
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < H; ++i) xs2[size_t(r) * H + i] = table[size_t(tokens[size_t(r)]) * H + i] * 25.25f;
      EXPECT_EQ(dx.download(), xs2) << "embed_rows with a scale";
    }
  }
}

TEST(CudaModelOps, GluAndConvert) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(8);
  for (DType act : kActs) {
    const int rows = 3, inter = 1000;
    const auto gu = random_act(act, size_t(rows) * 2 * inter, rng, 3.0f);
    Dev<uint16_t> dgu(codes(act, gu)), dout(size_t(rows) * inter);
    dout.poison();
    cuda::glu(act, GluActivation::Silu, dgu.p, dout.p, rows, inter, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<float> g, u, ref(size_t(rows) * inter), got;
    for (int r = 0; r < rows; ++r) {
      g.insert(g.end(), gu.begin() + ptrdiff_t(r) * 2 * inter, gu.begin() + ptrdiff_t(r) * 2 * inter + inter);
      u.insert(u.end(), gu.begin() + ptrdiff_t(r) * 2 * inter + inter, gu.begin() + ptrdiff_t(r + 1) * 2 * inter);
    }
    ops::cpu::silu_mul(g, u, ref);
    for (uint16_t c : dout.download()) got.push_back(act_value(act, c));
    Cmp c = compare(got, ref, act_rel_tol(act), 1e-6);
    EXPECT_EQ(c.bad, 0u) << dtype_name(act) << " silu_mul max err " << c.max_err;
    // GELU (tanh) and mul: the CPU reference in fp32, one rounding to act (tanhf's few ulps
    // are far below it).
    dout.poison();
    cuda::glu(act, GluActivation::GeluTanh, dgu.p, dout.p, rows, inter, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ops::cpu::gelu_tanh_mul(g, u, ref);
    got.clear();
    for (uint16_t c2 : dout.download()) got.push_back(act_value(act, c2));
    c = compare(got, ref, act_rel_tol(act), 1e-6);
    EXPECT_EQ(c.bad, 0u) << dtype_name(act) << " gelu_tanh_mul max err " << c.max_err;
  }
  // bf16 -> f16: one rounding of an exact value.
  const auto src = random_act(DType::BF16, 777, rng);
  Dev<uint16_t> din(codes(DType::BF16, src)), dout(src.size());
  dout.poison();
  cuda::bf16_to_act(DType::F16, din.p, dout.p, src.size(), nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dout.download(), codes(DType::F16, src));
}

TEST(CudaModelOps, GemmMatchesCpuLinear) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(9);
  cuda::Gemm gemm;
  Dev<uint8_t> ws(cuda::kGemmWorkspaceBytes);
  gemm.set_workspace(ws.p, ws.n);
  for (DType ab : kActs) {
    for (DType out : {ab, DType::F32}) {
      for (bool bias : {false, true}) {
        if (bias && out == DType::F32) continue;  // logits carry no bias
        // m <= 8: the small-m kernels (odd n: a warp's second row, a CTA's last rows are cut;
        // k = 1320: several k rounds per warp and a last 32-wide block cut); m > 8: cuBLASLt.
        for (auto [m, n, k] : {std::tuple{1, 384, 256}, {2, 383, 256}, {3, 384, 1320}, {4, 383, 256}, {7, 384, 256},
                               {8, 383, 1320}, {9, 384, 256}, {16, 383, 1320}, {17, 384, 256}, {64, 384, 256}}) {
          const auto x = random_act(ab, size_t(m) * k, rng), w = random_act(ab, size_t(n) * k, rng, 0.1f);
          const auto b = random_act(ab, size_t(n), rng);
          Dev<uint16_t> dx(codes(ab, x)), dw(codes(ab, w)), db(codes(ab, b));
          std::vector<float> ref(size_t(m) * n);
          ops::cpu::linear(x, m, k, w, n, bias ? std::span<const float>(b) : std::span<const float>{}, ref);
          // variant -1: Gemm::linear (automatic); 1, 2, 3: each small-m kernel on its own.
          for (int variant : {-1, 1, 2, 3}) {
            if ((variant == 1 || variant == 2) && m > cuda::kGemvMaxM) continue;
            if (variant == 3 && m > cuda::kGemvMmaMaxM) continue;
            Dev<uint8_t> dy(size_t(m) * n * (out == DType::F32 ? 4 : 2));
            dy.poison();
            if (variant < 0) gemm.linear(ab, out, dx.p, dw.p, bias ? db.p : nullptr, dy.p, m, n, k, nullptr);
            else cuda::gemv_small_m(ab, out, dx.p, dw.p, bias ? db.p : nullptr, dy.p, m, n, k, nullptr, variant);
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const auto raw = dy.download();
            std::vector<float> got(ref.size());
            for (size_t i = 0; i < got.size(); ++i) {
              if (out == DType::F32) {
                std::memcpy(&got[i], raw.data() + 4 * i, 4);
              } else {
                uint16_t c;
                std::memcpy(&c, raw.data() + 2 * i, 2);
                got[i] = act_value(ab, c);
              }
            }
            // fp32 accumulation in another order: <= k * 2^-24 * sum|x*w| ~ 2e-5 of the
            // magnitude sum (the floor below is 4x that); 16-bit outputs add their rounding.
            double worst = 0;
            size_t bad = 0;
            for (int r = 0; r < m; ++r)
              for (int j = 0; j < n; ++j) {
                double mag = bias ? std::fabs(b[size_t(j)]) : 0.0;
                for (int i = 0; i < k; ++i) mag += std::fabs(double(x[size_t(r) * k + i]) * w[size_t(j) * k + i]);
                const double ref_v = ref[size_t(r) * n + j], e = std::fabs(got[size_t(r) * n + j] - ref_v);
                worst = std::max(worst, e);
                bad += std::isnan(got[size_t(r) * n + j]) ||
                       e > (out == DType::F32 ? 0.0 : act_rel_tol(ab)) * std::fabs(ref_v) + 1e-4 * mag;
              }
            EXPECT_EQ(bad, 0u) << dtype_name(ab) << " -> " << dtype_name(out) << " bias " << bias << " m=" << m << " n=" << n
                               << " variant " << variant << " max err " << worst;
          }
        }
      }
    }
  }
}

// SiLU-and-mul fused into the small-m GEMV (the down projection at decode): against
// ops::cpu::silu_mul (fp32, unrounded) + ops::cpu::linear, both FMA kernels, with and without
// bias; the tensor-core kernel refuses such an input.
TEST(CudaModelOps, GemvWithSiluMulInput) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(12);
  {
    Dev<uint16_t> dgu(size_t(2) * 2 * 64), dw(size_t(16) * 64), dy(size_t(2) * 16);
    EXPECT_THROW(cuda::gemv_small_m(DType::BF16, DType::BF16, dgu.p, dw.p, nullptr, dy.p, 2, 16, 64, nullptr, 3, true),
                 Error);
  }
  for (DType ab : kActs)
    for (int variant : {1, 2})
      for (bool bias : {false, true})
        for (int m : {1, 3, 4}) {
          const int n = 200, k = 264;
          const auto gu = random_act(ab, size_t(m) * 2 * k, rng, 2.0f), w = random_act(ab, size_t(n) * k, rng, 0.1f);
          const auto b = random_act(ab, size_t(n), rng);
          std::vector<float> g, u, xin(size_t(m) * k);
          for (int r = 0; r < m; ++r) {
            g.insert(g.end(), gu.begin() + ptrdiff_t(r) * 2 * k, gu.begin() + ptrdiff_t(r) * 2 * k + k);
            u.insert(u.end(), gu.begin() + ptrdiff_t(r) * 2 * k + k, gu.begin() + ptrdiff_t(r + 1) * 2 * k);
          }
          ops::cpu::silu_mul(g, u, xin);
          std::vector<float> ref(size_t(m) * n);
          ops::cpu::linear(xin, m, k, w, n, bias ? std::span<const float>(b) : std::span<const float>{}, ref);
          Dev<uint16_t> dgu(codes(ab, gu)), dw(codes(ab, w)), db(codes(ab, b)), dy(size_t(m) * n);
          dy.poison();
          cuda::gemv_small_m(ab, ab, dgu.p, dw.p, bias ? db.p : nullptr, dy.p, m, n, k, nullptr, variant, true);
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const auto raw = dy.download();
          size_t bad = 0;
          double worst = 0;
          for (int r = 0; r < m; ++r)
            for (int j = 0; j < n; ++j) {
              double mag = bias ? std::fabs(b[size_t(j)]) : 0.0;
              for (int i = 0; i < k; ++i) mag += std::fabs(double(xin[size_t(r) * k + i]) * w[size_t(j) * k + i]);
              const double rv = ref[size_t(r) * n + j], gv = act_value(ab, raw[size_t(r) * n + j]);
              const double e = std::isnan(gv) ? 1e30 : std::fabs(gv - rv);
              worst = std::max(worst, e);
              bad += e > act_rel_tol(ab) * std::fabs(rv) + 1e-4 * mag;
            }
          EXPECT_EQ(bad, 0u) << dtype_name(ab) << " variant " << variant << " bias " << bias << " m=" << m << " max err " << worst;
        }
}

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
    for (auto [m, n, k] : {std::tuple{17, 384, 256}, {64, 400, 1040}, {200, 112, 4096}, {512, 96, 176}}) {
      auto x = random_act(ab, size_t(m) * k, rng, 2.0f);
      for (int i = 0; i < k; ++i) x[size_t(5 % m) * k + i] = 0.0f;  // an all-zero row: scale 1
      x[size_t(k) + 3] = act_round(ab, 300.0f);                      // an outlier in row 1
      // The quantization, as documented.
      std::vector<uint8_t> want_codes(size_t(m) * k);
      std::vector<float> want_scales(static_cast<size_t>(m));
      for (int r = 0; r < m; ++r) {
        float amax = 0;
        for (int i = 0; i < k; ++i) amax = std::max(amax, std::fabs(x[size_t(r) * k + i]));
        const float s = amax > 0 ? amax / num::kE4M3Max : 1.0f;
        want_scales[size_t(r)] = s;
        for (int i = 0; i < k; ++i) want_codes[size_t(r) * k + i] = num::f32_to_e4m3(x[size_t(r) * k + i] / s);
      }
      Dev<uint16_t> dx(codes(ab, x));
      Dev<uint8_t> dxc(size_t(m) * k);
      Dev<float> dxs(static_cast<size_t>(m));
      cuda::quantize_rows_fp8(ab, dx.p, dxc.p, dxs.p, m, k, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(dxs.download(), want_scales) << dtype_name(ab) << " m " << m << " k " << k;
      ASSERT_EQ(dxc.download(), want_codes) << dtype_name(ab) << " m " << m << " k " << k;

      std::vector<uint8_t> wc(size_t(n) * k);
      for (auto& c : wc) {
        do c = uint8_t(rng());
        while ((c & 0x7f) == 0x7f);
      }
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
          Dev<uint8_t> dy(size_t(m) * n * (out == DType::F32 ? 4 : 2));
          dy.poison();
          ASSERT_TRUE(gemm.linear_fp8(out, dxc.p, dxs.p, w, bias ? db.p : nullptr, dy.p, m, n, k, nullptr))
              << "no FP8 GEMM for m " << m << " n " << n << " k " << k;
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          const auto raw = dy.download();
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
              float got;
              if (out == DType::F32) {
                std::memcpy(&got, raw.data() + 4 * (size_t(r) * n + j), 4);
              } else {
                uint16_t c;
                std::memcpy(&c, raw.data() + 2 * (size_t(r) * n + j), 2);
                got = act_value(ab, c);
              }
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
    for (auto [m, n, k] : {std::tuple{36, 256, 1024}, {132, 384, 512}}) {
      const int kb = k / 128, nbk = n / 128;
      auto x = random_act(ab, size_t(m) * k, rng, 2.0f);
      x[size_t(k) + 200] = act_round(ab, 300.0f);  // an outlier in row 1, group 1
      std::vector<uint8_t> xc(size_t(m) * k);
      std::vector<float> xs(size_t(kb) * m);
      for (int r = 0; r < m; ++r)
        for (int g = 0; g < kb; ++g) {
          float amax = 0;
          for (int i = g * 128; i < (g + 1) * 128; ++i) amax = std::max(amax, std::fabs(x[size_t(r) * k + i]));
          const float s = amax > 0 ? amax / num::kE4M3Max : 1.0f;
          xs[size_t(g) * m + r] = s;
          for (int i = g * 128; i < (g + 1) * 128; ++i) xc[size_t(r) * k + i] = num::f32_to_e4m3(x[size_t(r) * k + i] / s);
        }
      Dev<uint16_t> dx(codes(ab, x));
      Dev<uint8_t> dxc(size_t(m) * k);
      Dev<float> dxs(xs.size());
      cuda::quantize_rows_fp8(ab, dx.p, dxc.p, dxs.p, m, k, nullptr, 128);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(dxs.download(), xs) << "group scales, " << dtype_name(ab) << " m " << m << " k " << k;
      ASSERT_EQ(dxc.download(), xc) << "group codes, " << dtype_name(ab) << " m " << m << " k " << k;
      std::vector<uint8_t> wc(size_t(n) * k);
      for (auto& c : wc) {
        do c = uint8_t(rng());
        while ((c & 0x7f) == 0x7f);
      }
      std::uniform_real_distribution<float> ud(1e-4f, 2e-3f);
      std::vector<float> blocks(size_t(nbk) * kb), rows(size_t(n) * kb);
      for (auto& v : blocks) v = ud(rng);
      for (int j = 0; j < n; ++j)
        for (int g = 0; g < kb; ++g) rows[size_t(j) * kb + g] = blocks[size_t(j / 128) * kb + g];
      Dev<uint8_t> dwc(wc);
      Dev<float> dws(rows), dwb(blocks);
      const cuda::Fp8Weight w{.codes = dwc.p, .scales = dws.p, .scale_block = 128, .block_scales = dwb.p};
      Dev<uint8_t> dy(size_t(m) * n * 2);
      dy.poison();
      ASSERT_TRUE(gemm.linear_fp8(ab, dxc.p, dxs.p, w, nullptr, dy.p, m, n, k, nullptr))
          << "no block-scaled FP8 GEMM for m " << m << " n " << n << " k " << k;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto raw = dy.download();
      size_t bad = 0;
      double case_worst = 0;
      for (int r = 0; r < m; ++r)
        for (int j = 0; j < n; ++j) {
          double ref = 0, mag = 0;
          for (int g = 0; g < kb; ++g) {
            const double s = double(xs[size_t(g) * m + r]) * double(blocks[size_t(j / 128) * kb + g]);
            for (int i = g * 128; i < (g + 1) * 128; ++i) {
              const double p = double(num::e4m3_to_f32(xc[size_t(r) * k + i])) * double(num::e4m3_to_f32(wc[size_t(j) * k + i])) * s;
              ref += p;
              mag += std::fabs(p);
            }
          }
          uint16_t c;
          std::memcpy(&c, raw.data() + 2 * (size_t(r) * n + j), 2);
          const float got = act_value(ab, c);
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
      std::vector<uint8_t> codes8(size_t(n) * k);
      for (auto& c : codes8) {
        do c = uint8_t(rng());
        while ((c & 0x7f) == 0x7f);  // NaN codes are not weights
      }
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

TEST(CudaModelOps, ArgmaxRows) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(10);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (int vocab : {7, 256, 151936}) {
    const int rows = 5;
    std::vector<float> l(size_t(rows) * size_t(vocab));
    for (auto& x : l) x = nd(rng);
    // Row 1: a tie for the maximum (the lower id must win); row 2: all -inf (id 0, as the host).
    if (vocab > 5) {
      l[size_t(vocab) + 3] = l[size_t(vocab) + size_t(vocab) - 2] = 100.0f;
    }
    std::fill_n(l.begin() + 2 * ptrdiff_t(vocab), vocab, -std::numeric_limits<float>::infinity());
    Dev<float> dl(l);
    Dev<TokenId> dout(static_cast<size_t>(rows));
    dout.poison();
    cuda::argmax_rows(dl.p, rows, vocab, dout.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = dout.download();
    for (int r = 0; r < rows; ++r) {
      int best = 0;
      for (int i = 1; i < vocab; ++i)
        if (l[size_t(r) * size_t(vocab) + size_t(i)] > l[size_t(r) * size_t(vocab) + size_t(best)]) best = i;
      EXPECT_EQ(got[size_t(r)], best) << "vocab " << vocab << " row " << r;
    }
  }
}

// The sampling kernel against its CPU reference sample_gumbel, row by row: the same token,
// except where two kept tokens' Gumbel scores are within float rounding of each other
// (GPU and host logf differ in the last bit), which the test reports and checks is rare.
// Every fourth row has a token mask (a grammar's: a handful of tokens, or most of them), whose
// reference is sample_gumbel over the row with -inf outside the mask.
TEST(CudaModelOps, SampleRowsMatchesTheReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.5f);
  const std::vector<SamplingParams> cases{
      {.temperature = 0.0f},
      {.temperature = 1.0f},
      {.temperature = 0.7f, .top_k = 50},
      {.temperature = 1.0f, .top_k = 1},
      {.temperature = 1.2f, .top_p = 0.9f},
      {.temperature = 1.0f, .top_p = 0.3f},
      {.temperature = 0.8f, .min_p = 0.05f},
      {.temperature = 1.0f, .top_k = 200, .top_p = 0.95f, .min_p = 0.01f},
      {.temperature = 2.0f, .top_k = 5000, .top_p = 0.5f},
  };
  int rows_checked = 0, near_ties = 0;
  for (int vocab : {7, 1000, 32000, 151936}) {
    const int copies = test::reduced() ? 2 : 12;
    const int rows = int(cases.size()) * copies + 1;  // + 1 skipped row
    std::vector<float> l(size_t(rows) * size_t(vocab));
    for (int r = 0; r < rows; ++r) {
      float* row = l.data() + size_t(r) * size_t(vocab);
      for (int i = 0; i < vocab; ++i) row[i] = nd(rng);
      if (r % 3 == 1)  // coarse values: many exact ties, at the top-k / top-p boundaries too
        for (int i = 0; i < vocab; ++i) row[i] = std::round(row[i] * 2.0f) / 2.0f;
      if (r % 5 == 2)  // masked tokens
        for (int i = 0; i < vocab; i += 3) row[i] = -std::numeric_limits<float>::infinity();
    }
    const size_t nrows = static_cast<size_t>(rows);
    std::vector<cuda::SampleRowParams> params(nrows);
    std::vector<SamplingParams> sp(nrows);
    const size_t words = size_t(cuda::mask_words(vocab));
    std::vector<uint64_t> masks;
    std::vector<float> masked_l = l;  // the reference's rows: -inf outside the mask
    for (int r = 0; r < rows; ++r) {
      sp[size_t(r)] = cases[size_t(r) % cases.size()];
      const GumbelParams g = gumbel_params(sp[size_t(r)]);
      params[size_t(r)] = {.inv_temperature = g.inv_temperature, .top_k = g.top_k, .top_p = g.top_p,
                           .min_p_offset = g.min_p_offset, .seed = 1000u + uint64_t(r), .counter = uint64_t(r) * 7u,
                           .skip = r == rows - 1 ? 1 : 0};
      if (r % 4 != 3) continue;
      // Sparse (a few tokens, as inside a JSON key) or dense (most tokens, as inside a string).
      // Token `keep` is always allowed, and finite in every row (the -inf rows above hit every
      // third token from 0): a mask must leave something to draw.
      const bool sparse = (r / 4) % 2 == 0;
      const int keep = vocab / 2 - (vocab / 2) % 3 + 1;
      std::vector<uint64_t> m(words, 0);
      float* row = masked_l.data() + size_t(r) * size_t(vocab);
      for (int i = 0; i < vocab; ++i) {
        const bool on = i == keep || (sparse ? rng() % 997 == 0 : rng() % 8 != 0);
        if (on) m[size_t(i) / 64] |= uint64_t(1) << (i % 64);
        else row[i] = -std::numeric_limits<float>::infinity();
      }
      params[size_t(r)].mask_row = int32_t(masks.size() / words);
      masks.insert(masks.end(), m.begin(), m.end());
    }
    Dev<float> dl(l);
    Dev<cuda::SampleRowParams> dp(params);
    Dev<uint64_t> dm(masks);
    Dev<TokenId> dout(nrows);
    dout.poison();
    cuda::sample_rows(dl.p, rows, vocab, dp.p, dm.p, dout.p, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = dout.download();
    EXPECT_EQ(got[size_t(rows - 1)], TokenId(-1)) << "a skipped row was written";
    for (int r = 0; r + 1 < rows; ++r) {
      const std::span<const float> row(masked_l.data() + size_t(r) * size_t(vocab), size_t(vocab));
      const auto& p = params[size_t(r)];
      if (p.mask_row >= 0 && got[size_t(r)] >= 0 && got[size_t(r)] < vocab)
        EXPECT_TRUE(std::isfinite(row[size_t(got[size_t(r)])]))
            << "vocab " << vocab << " row " << r << ": token " << got[size_t(r)] << " is outside the row's mask";
      const TokenId want = sample_gumbel(row, sp[size_t(r)], p.seed, p.counter);
      const TokenId have = got[size_t(r)];
      ++rows_checked;
      if (have == want) continue;
      ASSERT_TRUE(have >= 0 && have < vocab) << "vocab " << vocab << " row " << r << ": token " << have;
      // Only a near-tie of the two scores may differ.
      auto score = [&](TokenId t) {
        return row[size_t(t)] * p.inv_temperature + rng::gumbel_noise(rng::random_u32(p.seed, p.counter, uint32_t(t)));
      };
      const float a = score(have), b = score(want);
      EXPECT_LE(std::fabs(a - b), 1e-5f * (1.0f + std::fabs(b)))
          << "vocab " << vocab << " row " << r << " (T=" << sp[size_t(r)].temperature << " k=" << p.top_k
          << " p=" << p.top_p << " min_p=" << sp[size_t(r)].min_p << "): GPU " << have << " (score " << a
          << "), reference " << want << " (score " << b << ")";
      ++near_ties;
    }
  }
  std::printf("[cuda-sampling] %d rows checked, %d near-ties resolved differently\n", rows_checked, near_ties);
  EXPECT_LE(near_ties * 100, rows_checked) << "near-ties should be rare";
}

namespace {

struct RopeCase {
  KVCacheDType dt;
  DType act;
  int head_dim;
  bool qk_norm;
  bool rotate = false;  // --kv-cache-rotation hadamard: q, K, V rotated after RoPE (core/hadamard.h)
};

// One fused prologue against CPU rmsnorm + rope + CpuAttentionBackend::store_kv.
void run_rope_store(const RopeCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int d = c.head_dim, nh = 4, kvh = 2, T = 37, bs = 16;
  const DType act = c.act;
  CacheConfig cc;
  cc.kv_cache_dtype = c.dt;
  const AttentionLayerDesc desc{.layer = 0, .kind = AttentionKind::Full, .num_q_heads = nh, .num_kv_heads = kvh, .head_dim = d};
  KVPlan plan = build_kv_plan(cc, {&desc, 1}, act, std::nullopt, {});
  KVLayerSpec& spec = plan.layers[0];
  if (spec.quant == KVQuantMode::Fp8PerTensor) {  // per-kv-head scales, K and V different
    spec.k_scale = {0.5f, 1.75f};
    spec.v_scale = {0.25f, 0.125f};
  }
  KVCache cache(plan, 8, bs);
  LayerKVCache& L = cache.layer(0);
  // Slots: a permutation of the pool's first slots, two of them padding (-1).
  std::vector<SlotId> slots(static_cast<size_t>(T));
  std::vector<SlotId> all(size_t(cache.num_blocks() * bs));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  for (int t = 0; t < T; ++t) slots[size_t(t)] = all[size_t(t)];
  slots[3] = slots[20] = -1;
  std::vector<Position> pos(static_cast<size_t>(T));
  for (auto& p : pos) p = Position(std::uniform_int_distribution<int>(0, 6000)(rng));
  RopeConfig rc;
  rc.type = RopeType::Llama3;
  rc.theta = 500000.0;
  rc.factor = 8.0;
  rc.low_freq_factor = 1.0;
  rc.high_freq_factor = 4.0;
  rc.original_max_position = 8192;
  const auto inv_freq = rope_inv_freq(rc, d);
  const int W = (nh + 2 * kvh) * d;
  auto qkv = random_act(act, size_t(T) * W, rng, 2.0f);
  for (size_t i = 0; i < qkv.size(); i += 53) qkv[i] = act_round(act, qkv[i] * 12.0f);  // outliers
  std::vector<float> qn(static_cast<size_t>(d)), kn(static_cast<size_t>(d));
  for (auto& x : qn) x = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);
  for (auto& x : kn) x = std::uniform_real_distribution<float>(0.5f, 2.0f)(rng);

  // CPU reference.
  std::vector<float> q(size_t(T) * nh * d), k(size_t(T) * kvh * d), v(size_t(T) * kvh * d);
  for (int t = 0; t < T; ++t) {
    const float* row = qkv.data() + size_t(t) * W;
    std::copy_n(row, nh * d, q.begin() + ptrdiff_t(t) * nh * d);
    std::copy_n(row + nh * d, kvh * d, k.begin() + ptrdiff_t(t) * kvh * d);
    std::copy_n(row + (nh + kvh) * d, kvh * d, v.begin() + ptrdiff_t(t) * kvh * d);
  }
  const float eps = 1e-6f;
  if (c.qk_norm) {
    ops::cpu::rmsnorm(q, T * nh, d, qn, eps, q);
    ops::cpu::rmsnorm(k, T * kvh, d, kn, eps, k);
  }
  ops::cpu::rope(q, T, nh, d, pos, inv_freq);
  ops::cpu::rope(k, T, kvh, d, pos, inv_freq);
  if (c.rotate) {  // as CpuOps::attention_prologue
    for (size_t r = 0; r < q.size() / size_t(d); ++r) num::hadamard_rotate(q.data() + r * size_t(d), d);
    for (size_t r = 0; r < k.size() / size_t(d); ++r) {
      num::hadamard_rotate(k.data() + r * size_t(d), d);
      num::hadamard_rotate(v.data() + r * size_t(d), d);
    }
  }
  std::vector<SlotId> cpu_slots;
  std::vector<float> ks, vs;
  for (int t = 0; t < T; ++t) {
    if (slots[size_t(t)] < 0) continue;
    cpu_slots.push_back(slots[size_t(t)]);
    ks.insert(ks.end(), k.begin() + ptrdiff_t(t) * kvh * d, k.begin() + ptrdiff_t(t + 1) * kvh * d);
    vs.insert(vs.end(), v.begin() + ptrdiff_t(t) * kvh * d, v.begin() + ptrdiff_t(t + 1) * kvh * d);
  }
  CpuAttentionBackend().store_kv(L, KVWrite{.k = ks, .v = vs, .slots = cpu_slots});

  // GPU.
  Dev<uint16_t> dqkv(codes(act, qkv)), dq(q.size());
  Dev<float> dqn(qn), dkn(kn), dfreq(inv_freq), dkts(spec.k_scale), dvts(spec.v_scale);
  Dev<Position> dpos(pos);
  Dev<SlotId> dslots(slots);
  Dev<uint8_t> dk(L.k.size()), dv(L.v.size());
  Dev<float> dks(L.k_scale.size()), dvs(L.v_scale.size());
  dq.poison();
  // Pages start as the CPU's do (zero): padding rows and unused slots must stay untouched.
  cudaMemset(dk.p, 0, dk.n);
  cudaMemset(dv.p, 0, dv.n);
  if (dks.n) {
    cudaMemset(dks.p, 0, dks.n * 4);
    cudaMemset(dvs.p, 0, dvs.n * 4);
  }
  cuda::qkv_rope_store({.act = act, .storage = spec.storage, .quant = spec.quant, .num_tokens = T, .num_q_heads = nh,
                        .num_kv_heads = kvh, .head_dim = d, .qkv = dqkv.p, .q_norm = c.qk_norm ? dqn.p : nullptr,
                        .k_norm = c.qk_norm ? dkn.p : nullptr, .eps = eps, .positions = dpos.p, .inv_freq = dfreq.p,
                        .q_out = dq.p, .slots = dslots.p, .block_size = bs, .num_blocks = cache.num_blocks(),
                        .k_cache = dk.p, .v_cache = dv.p, .k_token_scale = dks.p, .v_token_scale = dvs.p,
                        .k_tensor_scale = dkts.p, .v_tensor_scale = dvts.p, .num_tensor_scales = int(spec.k_scale.size()),
                        .rotate = c.rotate},
                       nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::string what = std::string(kv_cache_dtype_name(c.dt)) + " act " + std::string(dtype_name(act)) + " hd " +
                           std::to_string(d) + (c.qk_norm ? " qk_norm" : "") + (c.rotate ? " rotated" : "");

  // q: bf16 of the reference (rounding: 2^-9, a boundary flip: 2^-8).
  std::vector<float> gq;
  for (uint16_t x : dq.download()) gq.push_back(num::bf16_to_f32(x));
  const Cmp cq = compare(gq, q, std::ldexp(1.0, -8), 1e-5);
  EXPECT_EQ(cq.bad, 0u) << what << ": q max err " << cq.max_err;

  // Pages: decode both sides row by row and compare values; count differing codes.
  const auto gk = dk.download(), gv = dv.download();
  const auto gks = dks.download(), gvs = dvs.download();
  size_t diff_codes = 0, far = 0, total = 0;
  double worst_scale = 0;
  kvfmt::dispatch_kv(spec.storage, spec.quant, [&](auto fmt) {
    using Fmt = decltype(fmt);
    constexpr int mant = Fmt::codec::kStorage == DType::BF16     ? 7
                         : Fmt::codec::kStorage == DType::F16    ? 10
                         : Fmt::codec::kStorage == DType::F8E4M3 ? 3
                         : Fmt::codec::kStorage == DType::F8E5M2 ? 2
                                                                 : 0;
    constexpr bool int4 = Fmt::codec::kStorage == DType::I4;
    const size_t bits = dtype_bits(spec.storage), esz = bits / 8;
    // Element i's code on either side (int4: its nibble).
    auto same_code = [&](const uint8_t* x, const uint8_t* y, size_t i) {
      if constexpr (int4) return kvfmt::I4::code(x, i) == kvfmt::I4::code(y, i);
      else return std::memcmp(x + i * esz, y + i * esz, esz) == 0;
    };
    std::vector<float> a(static_cast<size_t>(d)), b(static_cast<size_t>(d));
    for (int side = 0; side < 2; ++side) {
      const auto& gpu = side == 0 ? gk : gv;
      const auto& cpu = side == 0 ? L.k : L.v;
      const auto& gsc = side == 0 ? gks : gvs;
      const auto& csc = side == 0 ? L.k_scale : L.v_scale;
      for (SlotId s : cpu_slots) {
        for (int g = 0; g < kvh; ++g) {
          const int64_t blk = s / bs;
          const int off = int(s % bs);
          const size_t row = L.row_byte(blk, g, off), si = L.scale_index(blk, g, off);
          float sa = 1.0f, sb = 1.0f, step = 0;
          if constexpr (int4) {  // the packed {f16 step, f16 zero}: one f16 rounding apart at most
            sa = gsc[si];
            sb = csc[si];
            float ga, za, gb, zb;
            kvfmt::I4::unpack(sa, ga, za);
            kvfmt::I4::unpack(sb, gb, zb);
            step = gb;
            worst_scale = std::max(worst_scale, std::fabs(double(ga) - gb) / gb * 1e-3);  // (reported against 1e-6)
            EXPECT_LE(std::fabs(double(ga) - gb), std::ldexp(double(gb), -10)) << "int4 step";
            EXPECT_LE(std::fabs(double(za) - zb), std::ldexp(std::fabs(double(zb)), -10) + 1e-7) << "int4 zero";
          } else if constexpr (Fmt::policy == kvfmt::ScalePolicy::PerTokenHead) {
            sa = gsc[si];
            sb = csc[si];
            worst_scale = std::max(worst_scale, std::fabs(double(sa) - sb) / sb);
          } else if constexpr (Fmt::policy == kvfmt::ScalePolicy::PerTensor) {
            sa = sb = side == 0 ? spec.k_scale_for(g) : spec.v_scale_for(g);
          }
          Fmt::decode_row(gpu.data() + row, sa, a);
          Fmt::decode_row(cpu.data() + row, sb, b);
          for (int i = 0; i < d; ++i) {
            ++total;
            if (same_code(gpu.data() + row, cpu.data() + row, size_t(i))) continue;
            ++diff_codes;
            // One step apart: relative 2^-mant for float codes (plus the subnormal step),
            // one integer step (= the scale) for int8, one step (+ the f16 zero's rounding) for int4.
            const double one = int4       ? step * 1.002 + std::ldexp(std::fabs(double(b[size_t(i)])), -10)
                               : mant > 0 ? std::ldexp(std::max(std::fabs(a[size_t(i)]), std::fabs(b[size_t(i)])), -mant) +
                                                std::ldexp(double(sb), -16)
                                          : double(sb) * 1.0001;
            far += std::fabs(double(a[size_t(i)]) - b[size_t(i)]) > one * 1.0001;
          }
        }
      }
    }
  });
  size_t stray = 0;  // bytes the GPU wrote outside the stored rows
  {
    std::vector<char> used(L.k.size(), 0);
    for (SlotId s : cpu_slots)
      for (int g = 0; g < kvh; ++g)
        std::fill_n(used.begin() + ptrdiff_t(L.row_byte(s / bs, g, int(s % bs))), dtype_bytes(spec.storage, size_t(d)), 1);
    for (size_t i = 0; i < used.size(); ++i) stray += !used[i] && (gk[i] != 0 || gv[i] != 0);
  }
  EXPECT_EQ(stray, 0u) << what << ": bytes written outside the stored rows";
  EXPECT_EQ(far, 0u) << what << ": codes more than one step from the CPU's";
  EXPECT_LE(double(diff_codes), 0.01 * double(total)) << what << ": " << diff_codes << " of " << total << " codes differ";
  EXPECT_LE(worst_scale, 1e-6) << what << ": per-token-head scales differ";
  std::printf("[cuda-rope-store] %-40s q_max_err=%.2e codes_differing=%zu/%zu\n", what.c_str(), cq.max_err, diff_codes, total);
}

}  // namespace

TEST(CudaModelOps, QkvRopeStoreMatchesCpu) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const KVCacheDType modes[] = {KVCacheDType::BFloat16,        KVCacheDType::Float16,
                                KVCacheDType::Fp8E4M3,         KVCacheDType::Fp8E5M2,
                                KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                                KVCacheDType::Int4PerTokenHead};
  uint32_t seed = 300;
  for (KVCacheDType dt : modes)
    for (DType act : kActs)
      for (int hd : {8, 32, 64, 128, 256})
        for (bool qk : {false, true}) {
          if (test::reduced() && !(hd == 64 && act == DType::BF16)) continue;
          run_rope_store({dt, act, hd, qk}, seed++);
          // The rotation: every quantized format, one act and q/k-norm setting per head size.
          if (dt != KVCacheDType::BFloat16 && dt != KVCacheDType::Float16 && act == DType::BF16 && !qk)
            run_rope_store({dt, act, hd, qk, true}, seed++);
        }
}

// unrotate_heads: R^T per head row on the GPU equals num::hadamard_rotate(.., inverse) on the
// CPU (same order of operations: bit-equal floats before the final rounding to act).
TEST(CudaModelOps, UnrotateHeadsMatchesCpu) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(77);
  for (DType act : kActs)
    for (int d : {8, 16, 32, 64, 128, 256}) {
      const int rows = 37;
      std::vector<float> x(size_t(rows) * size_t(d));
      for (auto& v : x) v = num::bf16_to_f32(num::f32_to_bf16(std::normal_distribution<float>(0.0f, 3.0f)(rng)));
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = num::f32_to_bf16(x[i]);
      Dev<uint16_t> din(xb), dout(xb.size());
      cuda::unrotate_heads(act, din.p, dout.p, rows, d, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got = dout.download();
      size_t bad = 0;
      for (int r = 0; r < rows; ++r) {
        num::hadamard_rotate(x.data() + size_t(r) * size_t(d), d, /*inverse=*/true);
        for (int i = 0; i < d; ++i) {
          const size_t at = size_t(r) * size_t(d) + size_t(i);
          const uint16_t want = act == DType::BF16 ? num::f32_to_bf16(x[at]) : num::f32_to_f16(x[at]);
          bad += got[at] != want;
        }
      }
      EXPECT_EQ(bad, 0u) << dtype_name(act) << " head_dim " << d;
    }
  EXPECT_THROW(cuda::unrotate_heads(DType::BF16, nullptr, nullptr, 1, 96, nullptr), Error);
}

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
#include <optional>
#include <random>
#include <tuple>

#include "attention/cpu_backend.h"
#include "kv/kv_format.h"
#include "kv/kv_plan.h"
#include "core/hadamard.h"
#include "core/numeric.h"
#include "act_test_util.h"
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
using namespace kvlm::test::act;


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
  // The Hadamard rotation after RoPE (core/hadamard.h): of q and K, of V, with these signs.
  bool rotate_k = false, rotate_v = false;
  uint32_t rotation_seed = 0;
  // Qwen3.5 / Qwen3-Next: RoPE on the first `rotary` dims only (0: all), and a gate of
  // gate_cols columns after v in each row of the projection (the rows' stride grows).
  int rotary = 0, gate_cols = 0;
  std::optional<KVCacheDType> v_dt;  // V's format where it differs from K's (dt)
};

// One fused prologue against CPU rmsnorm + rope + CpuAttentionBackend::store_kv.
void run_rope_store(const RopeCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int d = c.head_dim, nh = 4, kvh = 2, T = 37, bs = 16;
  const DType act = c.act;
  CacheConfig cc;
  cc.kv_cache_dtype = c.dt;
  cc.v_cache_dtype = c.v_dt;
  const AttentionLayerDesc desc{.layer = 0, .kind = AttentionKind::Full, .num_q_heads = nh, .num_kv_heads = kvh, .head_dim = d};
  KVPlan plan = build_kv_plan(cc, {&desc, 1}, act, std::nullopt, {});
  KVLayerSpec& spec = plan.layers[0];
  if (spec.k.mode == KVQuantMode::Fp8PerTensor) {  // per-kv-head scales, K and V different
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
  const auto inv_freq = rope_inv_freq(rc, c.rotary ? c.rotary : d);
  const int W = (nh + 2 * kvh) * d + c.gate_cols;
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
  if (c.rotate_k) {  // as CpuOps::attention_prologue
    for (size_t r = 0; r < q.size() / size_t(d); ++r) num::hadamard_rotate(q.data() + r * size_t(d), d, false, c.rotation_seed);
    for (size_t r = 0; r < k.size() / size_t(d); ++r) num::hadamard_rotate(k.data() + r * size_t(d), d, false, c.rotation_seed);
  }
  if (c.rotate_v)
    for (size_t r = 0; r < v.size() / size_t(d); ++r) num::hadamard_rotate(v.data() + r * size_t(d), d, false, c.rotation_seed);
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
  if (dks.n) cudaMemset(dks.p, 0, dks.n * 4);
  if (dvs.n) cudaMemset(dvs.p, 0, dvs.n * 4);
  cuda::qkv_rope_store({.act = act, .storage = spec.k.storage, .quant = spec.k.mode,
                        .v_format = spec.v != spec.k ? std::optional(spec.v) : std::nullopt, .num_tokens = T, .num_q_heads = nh,
                        .num_kv_heads = kvh, .head_dim = d, .qkv = dqkv.p, .qkv_stride = W,
                        .q_norm = c.qk_norm ? dqn.p : nullptr, .k_norm = c.qk_norm ? dkn.p : nullptr, .eps = eps,
                        .positions = dpos.p, .inv_freq = dfreq.p, .rotary_dim = c.rotary,
                        .q_out = dq.p, .slots = dslots.p, .block_size = bs, .num_blocks = cache.num_blocks(),
                        .k_cache = dk.p, .v_cache = dv.p, .k_token_scale = dks.p, .v_token_scale = dvs.p,
                        .k_tensor_scale = dkts.p, .v_tensor_scale = dvts.p, .num_tensor_scales = int(spec.k_scale.size()),
                        .rotate_k = c.rotate_k, .rotate_v = c.rotate_v, .rotation_seed = c.rotation_seed},
                       nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::string what = std::string(kv_cache_dtype_name(c.dt)) +
                           (c.v_dt ? " V " + std::string(kv_cache_dtype_name(*c.v_dt)) : "") + " act " + std::string(dtype_name(act)) + " hd " +
                           std::to_string(d) + (c.qk_norm ? " qk_norm" : "") + (c.rotate_k ? " K rotated" : "") +
                           (c.rotate_v ? " V rotated" : "") + (c.rotation_seed ? " seed " + std::to_string(c.rotation_seed) : "") +
                           (c.rotary ? " rotary " + std::to_string(c.rotary) : "");

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
  for (int side = 0; side < 2; ++side) {
   const KVStorage fs = spec.format(side == 0 ? KVSide::K : KVSide::V);
   kvfmt::dispatch_kv(fs.storage, fs.mode, [&](auto fmt) {
    using Fmt = decltype(fmt);
    constexpr int mant = Fmt::codec::kStorage == DType::BF16     ? 7
                         : Fmt::codec::kStorage == DType::F16    ? 10
                         : Fmt::codec::kStorage == DType::F8E4M3 ? 3
                         : Fmt::codec::kStorage == DType::F8E5M2 ? 2
                                                                 : 0;
    constexpr bool int4 = Fmt::codec::kStorage == DType::I4;
    // A one-step difference among subnormals is not relative to the value: e4m3's subnormal step
    // is 2^-9 of the scale (a value under 2^-6 of it: per-token-head rows whose small elements sit
    // far below the row's absmax, as a rotated row's can); 2^-16 covers the other formats'.
    constexpr int sub_exp = Fmt::codec::kStorage == DType::F8E4M3 ? -9 : -16;
    const size_t bits = dtype_bits(fs.storage), esz = bits / 8;
    // Element i's code on either side (int4: its nibble).
    auto same_code = [&](const uint8_t* x, const uint8_t* y, size_t i) {
      if constexpr (int4) return kvfmt::I4::code(x, i) == kvfmt::I4::code(y, i);
      else return std::memcmp(x + i * esz, y + i * esz, esz) == 0;
    };
    std::vector<float> a(static_cast<size_t>(d)), b(static_cast<size_t>(d));
    {
      const auto& gpu = side == 0 ? gk : gv;
      const auto& cpu = side == 0 ? L.k : L.v;
      const auto& gsc = side == 0 ? gks : gvs;
      const auto& csc = side == 0 ? L.k_scale : L.v_scale;
      for (SlotId s : cpu_slots) {
        for (int g = 0; g < kvh; ++g) {
          const int64_t blk = s / bs;
          const int off = int(s % bs);
          const size_t row = L.row_byte(side == 0 ? KVSide::K : KVSide::V, blk, g, off), si = L.scale_index(blk, g, off);
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
            // One step apart: relative 2^-mant for float codes (or the subnormal step),
            // one integer step (= the scale) for int8, one step (+ the f16 zero's rounding) for int4.
            const double one = int4       ? step * 1.002 + std::ldexp(std::fabs(double(b[size_t(i)])), -10)
                               : mant > 0 ? std::ldexp(std::max(std::fabs(a[size_t(i)]), std::fabs(b[size_t(i)])), -mant) +
                                                std::ldexp(double(sb), sub_exp)
                                          : double(sb) * 1.0001;
            far += std::fabs(double(a[size_t(i)]) - b[size_t(i)]) > one * 1.0001;
          }
        }
      }
    }
   });
  }
  size_t stray = 0;  // bytes the GPU wrote outside the stored rows
  for (const KVSide side : {KVSide::K, KVSide::V}) {
    const auto& gpu = side == KVSide::K ? gk : gv;
    std::vector<char> used(gpu.size(), 0);
    for (SlotId s : cpu_slots)
      for (int g = 0; g < kvh; ++g)
        std::fill_n(used.begin() + ptrdiff_t(L.row_byte(side, s / bs, g, int(s % bs))),
                    dtype_bytes(spec.format(side).storage, size_t(d)), 1);
    for (size_t i = 0; i < used.size(); ++i) stray += !used[i] && gpu[i] != 0;
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
          // The rotation: every quantized format, one act and q/k-norm setting per head size;
          // both sides, then each side alone with another seed's signs.
          if (dt != KVCacheDType::BFloat16 && dt != KVCacheDType::Float16 && act == DType::BF16 && !qk) {
            run_rope_store({dt, act, hd, qk, true, true}, seed++);
            run_rope_store({dt, act, hd, qk, true, false, 7}, seed++);
            run_rope_store({dt, act, hd, qk, false, true, 7}, seed++);
          }
        }
  // K and V in two formats (kv/kv_formats.h's CUDA pairs), rotated apart, each side's pages
  // against the CPU's.
  const KVCacheDType split[] = {KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                                KVCacheDType::Int4PerTokenHead};
  for (KVCacheDType k : split)
    for (KVCacheDType v : split)
      for (int hd : {32, 128}) {
        if (k == v || (test::reduced() && hd != 128)) continue;
        const bool rk = k != KVCacheDType::BFloat16, rv = v != KVCacheDType::BFloat16;
        run_rope_store({.dt = k, .act = DType::BF16, .head_dim = hd, .qk_norm = true, .rotate_k = rk, .rotate_v = rv,
                        .rotation_seed = 3, .v_dt = v},
                       seed++);
      }
  // Partial rotary (a quarter of the head, as Qwen3.5 and Qwen3-Next) with the gated
  // attention's gate columns after v.
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Int8PerTokenHead})
    for (int hd : {64, 128, 256}) run_rope_store({dt, DType::BF16, hd, true, false, false, 0, hd / 4, 4 * hd}, seed++);
}

// unrotate_heads: R^T per head row on the GPU equals num::hadamard_rotate(.., inverse) on the
// CPU (same order of operations: bit-equal floats before the final rounding to act).
TEST(CudaModelOps, UnrotateHeadsMatchesCpu) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(77);
  for (DType act : kActs)
    for (int d : {8, 16, 32, 64, 128, 256})
      for (uint32_t rs : {0u, 5u}) {
      const int rows = 37;
      std::vector<float> x(size_t(rows) * size_t(d));
      for (auto& v : x) v = num::bf16_to_f32(num::f32_to_bf16(std::normal_distribution<float>(0.0f, 3.0f)(rng)));
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = num::f32_to_bf16(x[i]);
      Dev<uint16_t> din(xb), dout(xb.size());
      cuda::unrotate_heads(act, din.p, dout.p, rows, d, rs, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got = dout.download();
      size_t bad = 0;
      for (int r = 0; r < rows; ++r) {
        num::hadamard_rotate(x.data() + size_t(r) * size_t(d), d, /*inverse=*/true, rs);
        for (int i = 0; i < d; ++i) {
          const size_t at = size_t(r) * size_t(d) + size_t(i);
          const uint16_t want = act == DType::BF16 ? num::f32_to_bf16(x[at]) : num::f32_to_f16(x[at]);
          bad += got[at] != want;
        }
      }
      EXPECT_EQ(bad, 0u) << dtype_name(act) << " head_dim " << d << " seed " << rs;
      }
  EXPECT_THROW(cuda::unrotate_heads(DType::BF16, nullptr, nullptr, 1, 96, 0, nullptr), Error);
}

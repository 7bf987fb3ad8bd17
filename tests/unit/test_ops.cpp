#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <numbers>
#include <numeric>
#include <random>

#include <omp.h>

#include "model/rope.h"
#include "ops/cpu/ops.h"

using namespace kvlm;

TEST(Ops, LinearMatchesNaive) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  const int m = 3, k = 5, n = 4;
  std::vector<float> x(m * k), w(n * k), b(n), y(m * n);
  for (auto* v : {&x, &w, &b})
    for (auto& e : *v) e = nd(rng);
  ops::cpu::linear(x, m, k, w, n, b, y);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = b[size_t(j)];
      for (int t = 0; t < k; ++t) acc += double(x[size_t(i * k + t)]) * w[size_t(j * k + t)];
      EXPECT_NEAR(y[size_t(i * n + j)], acc, 1e-5);
    }
}

// The linear splits its output columns over the OpenMP team: any team size gives what one
// thread gives, to rounding (OpenBLAS's kernels for a block's edge columns may sum in another
// order). Set here, whatever OMP_NUM_THREADS the harness runs with (one per test under ctest -j).
TEST(Ops, LinearSplitOverThreadsMatchesOneThread) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  const int m = 5, k = 256, n = 1000;  // m x n x k over the split's threshold, n not a multiple of 16
  std::vector<float> x(size_t(m) * k), w(size_t(n) * k), b(n);
  for (auto* v : {&x, &w, &b})
    for (auto& e : *v) e = nd(rng);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  std::vector<float> one(size_t(m) * n);
  ops::cpu::linear(x, m, k, w, n, b, one);
  for (int threads : {2, 3, 7}) {
    omp_set_num_threads(threads);
    std::vector<float> split(size_t(m) * n, -1.0f);
    ops::cpu::linear(x, m, k, w, n, b, split);
    for (size_t i = 0; i < one.size(); ++i)
      ASSERT_NEAR(split[i], one[i], 1e-4f * (1.0f + std::fabs(one[i]))) << threads << " threads, element " << i;
  }
  omp_set_num_threads(saved);
}

TEST(Ops, RmsNormSiluAdd) {
  const std::vector<float> x{1, 2, 3, 4, -1, -1, -1, -1}, w{1, 0.5f, 2, 1};
  std::vector<float> out(8);
  ops::cpu::rmsnorm(x, 2, 4, w, 0.0f, out);
  const float r = 1.0f / std::sqrt(7.5f);
  EXPECT_NEAR(out[0], 1 * r, 1e-6);
  EXPECT_NEAR(out[1], 2 * r * 0.5f, 1e-6);
  EXPECT_NEAR(out[2], 3 * r * 2, 1e-6);
  EXPECT_NEAR(out[4], -1.0f, 1e-6);
  std::vector<float> g{0.0f, 1.0f, -2.0f}, u{3.0f, 2.0f, 1.0f}, s(3);
  ops::cpu::silu_mul(g, u, s);
  EXPECT_NEAR(s[0], 0.0f, 1e-7);
  EXPECT_NEAR(s[1], 2.0f / (1 + std::exp(-1.0f)), 1e-6);
  EXPECT_NEAR(s[2], -2.0f / (1 + std::exp(2.0f)), 1e-6);
  std::vector<float> a{1, 2};
  ops::cpu::add_inplace(a, std::vector<float>{0.5f, -2});
  EXPECT_EQ(a, (std::vector<float>{1.5f, 0}));
}

// PyTorch's gelu(approximate="tanh"), worked in double: gelu_tanh(1) = 0.841191990...,
// gelu_tanh(-2) = -0.045402305..., gelu_tanh(0) = 0.
TEST(Ops, GeluTanhMul) {
  std::vector<float> g{0.0f, 1.0f, -2.0f, 3.5f}, u{3.0f, 2.0f, 1.0f, -1.0f}, s(4), via_glu(4);
  ops::cpu::gelu_tanh_mul(g, u, s);
  EXPECT_NEAR(s[0], 0.0f, 1e-7);
  EXPECT_NEAR(s[1], 2 * 0.8411919906, 1e-6);
  EXPECT_NEAR(s[2], -0.0454023059, 1e-6);
  const double x = 3.5, ref = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
  EXPECT_NEAR(s[3], -ref, 1e-5);
  ops::cpu::glu(GluActivation::GeluTanh, g, u, via_glu);
  EXPECT_EQ(via_glu, s);
  ops::cpu::glu(GluActivation::Silu, g, u, via_glu);
  EXPECT_NEAR(via_glu[1], 2.0f / (1 + std::exp(-1.0f)), 1e-6);
  // It is not libm's tanh (a vectorizable exp): within float rounding (relative) of the double-precision
  // GELU, over every magnitude from 1e-6 to beyond where tanh saturates, the negative tail too
  // (where 1 + tanh(z) in float would cancel to nothing: the reference is the exact x sigmoid(2z)
  // form), and NaN stays NaN.
  std::vector<float> xs, ones;
  for (float x = 1e-6f; x < 40.0f; x *= 1.01f) xs.insert(xs.end(), {x, -x});
  xs.push_back(0.0f);
  ones.assign(xs.size(), 1.0f);
  std::vector<float> y(xs.size());
  ops::cpu::gelu_tanh_mul(xs, ones, y);
  for (size_t i = 0; i < xs.size(); ++i) {
    // (float's rounding of the argument 2z alone moves e^2z by |2z| 2^-24 relative per rounding)
    const double x = xs[i], z2 = 2 * std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x);
    const double want = x / (1 + std::exp(-z2));
    EXPECT_NEAR(y[i], want, (5e-7 + 2.4e-7 * std::fabs(z2)) * std::fabs(want) + 1e-30) << x;
  }
  std::vector<float> nan{std::nanf("")}, one{1.0f}, nan_out(1);
  ops::cpu::gelu_tanh_mul(nan, one, nan_out);
  EXPECT_TRUE(std::isnan(nan_out[0]));
}

TEST(Ops, RopeRotatesHalves) {
  // One head of 4: pairs (x0, x2) and (x1, x3) rotate by pos * inv_freq[i].
  std::vector<float> x{1, 0, 0, 1};
  const std::vector<float> inv{1.0f, 0.5f};
  const std::vector<Position> pos{3};
  ops::cpu::rope(x, 1, 1, 4, pos, inv);
  EXPECT_NEAR(x[0], std::cos(3.0f), 1e-6);
  EXPECT_NEAR(x[2], std::sin(3.0f), 1e-6);
  EXPECT_NEAR(x[1], -std::sin(1.5f), 1e-6);
  EXPECT_NEAR(x[3], std::cos(1.5f), 1e-6);
  // Rotation preserves each pair's norm.
  EXPECT_NEAR(x[0] * x[0] + x[2] * x[2], 1.0, 1e-6);
}

TEST(Rope, InvFreqPerType) {
  RopeConfig r;
  r.theta = 10000;
  auto d = rope_inv_freq(r, 8);
  ASSERT_EQ(d.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(d[size_t(i)], 1.0 / std::pow(10000.0, 2.0 * i / 8), 1e-7);
  r.type = RopeType::Linear;
  r.factor = 4;
  auto l = rope_inv_freq(r, 8);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(l[size_t(i)], d[size_t(i)] / 4, 1e-8);
  // llama3 with original context 64: wavelengths below 16 kept, above 64 divided by 8,
  // in between interpolated (numbers from transformers' inv_freq for the golden model).
  RopeConfig l3{.type = RopeType::Llama3, .theta = 500000, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                .original_max_position = 64};
  RopeConfig base = l3;
  base.type = RopeType::Default;
  auto a = rope_inv_freq(l3, 16), b = rope_inv_freq(base, 16);
  EXPECT_FLOAT_EQ(a[0], b[0]);
  const double wl1 = 2 * std::numbers::pi / b[1];
  const double smooth = (64 / wl1 - 1) / 3;
  EXPECT_NEAR(a[1], (1 - smooth) * b[1] / 8 + smooth * b[1], 1e-7);
  EXPECT_NEAR(a[1] / b[1], 0.409, 1e-3);  // transformers 5.17 gives 0.409 for this band
  for (size_t i = 2; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i] / 8, 1e-9);
}

// YaRN: transformers 5.24's _compute_yarn_parameters for head_dim 16, theta 1.5e5, factor 4,
// original length 32, beta 32 / 1, with and without truncation (GPT-OSS's truncate false);
// attention_factor 0.1 ln 4 + 1 reaches the scores squared.
TEST(Rope, Yarn) {
  RopeConfig y{.type = RopeType::Yarn, .theta = 150000, .factor = 4, .original_max_position = 32, .beta_fast = 32,
               .beta_slow = 1, .truncate = false, .attention_factor = 0.1 * std::log(4.0) + 1.0};
  const double hf[] = {1.0, 0.07069291174411774, 0.012703318148851395, 0.0028635566122829914,
                       0.0006454972317442298, 0.00014550669584423304, 3.2799827749840915e-05, 7.3936716944444925e-06};
  auto a = rope_inv_freq(y, 16);
  ASSERT_EQ(a.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(a[i], hf[i], 1e-6 * hf[i]) << i;
  y.truncate = true;
  a = rope_inv_freq(y, 16);
  EXPECT_NEAR(a[1], 0.14088624715805054, 1e-6 * 0.14);
  EXPECT_NEAR(a[2], hf[2], 1e-6 * hf[2]);
  EXPECT_NEAR(rope_score_scale(y), 1.138629436111989 * 1.138629436111989, 1e-6);
  y.type = RopeType::Llama3;
  EXPECT_EQ(rope_score_scale(y), 1.0f);
}

// GPT-OSS's clamped SwiGLU: gate clamped above at the limit, up to +-limit, then
// g sigmoid(alpha g) (u + 1).
TEST(Ops, SwigluClamp) {
  const std::vector<float> gate{-3.0f, 0.5f, 9.0f, 2.0f}, up{0.25f, -8.0f, 1.0f, 20.0f};
  std::vector<float> out(4);
  ops::cpu::glu(GluActivation::SwigluClamp, gate, up, out, 1.702f, 7.0f);
  auto ref = [](double g, double u) {
    g = std::min(g, 7.0);
    u = std::clamp(u, -7.0, 7.0);
    return g / (1 + std::exp(-1.702 * g)) * (u + 1);
  };
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(out[i], ref(gate[i], up[i]), 1e-5) << i;
}

// The router: top k by logit (the lower index on ties), weights a softmax over the k chosen
// (norm_topk) or over every expert.
TEST(Ops, MoeRoute) {
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 2.0f, 1.0f,   // a tie between experts 1 and 3
                                  -3.0f, -2.0f, -1.0f, 0.0f, 4.0f};
  std::vector<int32_t> ids(6);
  std::vector<float> w(6);
  ops::cpu::moe_route(logits, 2, 5, 3, /*norm_topk=*/true, ids, w);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 4, 4, 3, 2}));
  const double s0 = 2 * std::exp(2.0) + std::exp(1.0);
  EXPECT_NEAR(w[0], std::exp(2.0) / s0, 1e-6);
  EXPECT_NEAR(w[2], std::exp(1.0) / s0, 1e-6);
  EXPECT_NEAR(w[3] + w[4] + w[5], 1.0, 1e-6);
  ops::cpu::moe_route(logits, 2, 5, 3, /*norm_topk=*/false, ids, w);
  double all = 0;
  for (int e = 5; e < 10; ++e) all += std::exp(double(logits[size_t(e)]));
  EXPECT_NEAR(w[3], std::exp(4.0) / all, 1e-6);
  EXPECT_LT(w[3] + w[4] + w[5], 1.0);
  // top_k = experts: every expert, weights summing to 1 either way.
  std::vector<int32_t> all_ids(5);
  std::vector<float> all_w(5);
  ops::cpu::moe_route(std::span<const float>(logits).first(5), 1, 5, 5, false, all_ids, all_w);
  EXPECT_NEAR(std::accumulate(all_w.begin(), all_w.end(), 0.0), 1.0, 1e-6);
}

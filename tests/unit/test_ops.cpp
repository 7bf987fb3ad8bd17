#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
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

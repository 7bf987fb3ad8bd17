#include "ops/cpu/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/error.h"

namespace kvlm::ops::cpu {

namespace {

// OpenBLAS runs single-threaded and kvlm's OpenMP team splits the output columns instead: one
// pool of threads, not two. OpenBLAS's own pthreads spin between calls, and beside the OpenMP
// team on the same cores each pool waited for the other's spinning: on 2 cores beside one busy
// process, decode fell to 5.6 tokens/s (139 with OpenBLAS on one thread).
const bool kBlasSingleThreaded = [] {
  openblas_set_num_threads(1);
  return true;
}();

}  // namespace

// One row (decode at batch 1): a matrix-vector product. OpenBLAS's sgemm with m = 1 packs the
// weights on some CPUs (its SKYLAKEX kernels copy every matrix before multiplying), which reads
// them twice and writes them once: sgemv streams them once, 1.2-3x faster from the
// embedding-sized LM heads down to MLP matrices (tools/gguf_cpu_bench.py).
void linear_columns(const float* x, int m, int k, const float* w, int c0, int c1, int n, float* y) {
  (void)kBlasSingleThreaded;
  const float* wc = w + size_t(c0) * size_t(k);
  if (m == 1) cblas_sgemv(CblasRowMajor, CblasNoTrans, c1 - c0, k, 1.0f, wc, k, x, 1, 0.0f, y + c0, 1);
  else cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, c1 - c0, k, 1.0f, x, k, wc, k, 0.0f, y + c0, n);
}

void linear(std::span<const float> x, int m, int k, std::span<const float> w, int n, std::span<const float> bias,
            std::span<float> y) {
  KVLM_CHECK(x.size() == size_t(m) * size_t(k) && w.size() == size_t(n) * size_t(k) && y.size() == size_t(m) * size_t(n),
             "linear: shape mismatch");
  if (m == 0) return;
  (void)kBlasSingleThreaded;
  int teams = 1;
#ifdef _OPENMP
  // Small products stay on one thread (waking the team costs more); blocks of 64 columns.
  if (!omp_in_parallel() && size_t(m) * size_t(n) * size_t(k) >= (size_t(1) << 18))
    teams = std::clamp(std::min(omp_get_max_threads(), n / 64), 1, 64);
#endif
  if (teams == 1) {
    linear_columns(x.data(), m, k, w.data(), 0, n, n, y.data());
  } else {
#pragma omp parallel for schedule(static) num_threads(teams)
    for (int t = 0; t < teams; ++t) {
      // Column blocks aligned to 16 (whole cache lines of y's rows) where the split allows.
      const int c0 = t == 0 ? 0 : (int(int64_t(n) * t / teams) & ~15);
      const int c1 = t == teams - 1 ? n : (int(int64_t(n) * (t + 1) / teams) & ~15);
      if (c1 > c0) linear_columns(x.data(), m, k, w.data(), c0, c1, n, y.data());
    }
  }
  if (!bias.empty()) {
    KVLM_CHECK(bias.size() == size_t(n), "linear: bias size mismatch");
    for (int r = 0; r < m; ++r)
      for (int c = 0; c < n; ++c) y[size_t(r) * size_t(n) + size_t(c)] += bias[size_t(c)];
  }
}

void rmsnorm(std::span<const float> x, int rows, int dim, std::span<const float> w, float eps, std::span<float> out) {
  KVLM_CHECK(x.size() == size_t(rows) * size_t(dim) && out.size() == x.size() && w.size() == size_t(dim), "rmsnorm: shape mismatch");
  for (int r = 0; r < rows; ++r) {
    const float* xr = x.data() + size_t(r) * size_t(dim);
    float* orow = out.data() + size_t(r) * size_t(dim);
    double ss = 0.0;
    for (int i = 0; i < dim; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = 1.0f / std::sqrt(float(ss / dim) + eps);
    for (int i = 0; i < dim; ++i) orow[i] = w[size_t(i)] * (xr[i] * inv);
  }
}

void silu_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out) {
  KVLM_CHECK(gate.size() == up.size() && out.size() == up.size(), "silu_mul: shape mismatch");
  for (size_t i = 0; i < out.size(); ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

namespace {

// exp(x) for x <= 0 in plain arithmetic the compiler vectorizes (libm's expf and tanhf are
// scalar calls: a 128-token Gemma 3 prefill spent 30% of its linears' time in GELU's tanh).
// x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, so r is exact to ~1 ulp), e^r by its
// degree-6 Taylor polynomial (error < 2e-8 relative), 2^n by the exponent bits. Below -87 the
// result is about 0 (e^-87 = 1.6e-38, the smallest normal float).
inline float exp_nonpositive(float x) {
  x = x > -87.0f ? x : -87.0f;  // NaN too: the integer conversion below must see a number
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// (1 + tanh(z)) / 2 = sigmoid(2 z), as 1 / (1 + e) for z >= 0 and e / (1 + e) below, e =
// exp(-2 |z|) <= 1: no cancellation, so the result keeps ~1e-7 relative error where 1 + tanh(z)
// is tiny (z << 0), where forming 1 + tanh(z) would lose every digit (tanh's last ulp is 6e-8).
inline float half_one_plus_tanh(float z) {
  const float e = exp_nonpositive(-2.0f * std::fabs(z));
  return (z >= 0.0f ? 1.0f : e) / (1.0f + e);
}

}  // namespace

void gelu_tanh_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out) {
  KVLM_CHECK(gate.size() == up.size() && out.size() == up.size(), "gelu_tanh_mul: shape mismatch");
  const float k = std::sqrt(2.0f / 3.14159265358979f);
  const float* g = gate.data();
  const float* u = up.data();
  float* o = out.data();
#pragma omp simd
  for (size_t i = 0; i < out.size(); ++i)
    o[i] = g[i] * half_one_plus_tanh(k * (g[i] + 0.044715f * g[i] * g[i] * g[i])) * u[i];
}

void swiglu_clamp_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out, float alpha,
                      float limit) {
  KVLM_CHECK(gate.size() == up.size() && out.size() == up.size(), "swiglu_clamp_mul: shape mismatch");
  for (size_t i = 0; i < out.size(); ++i) {
    const float g = std::min(gate[i], limit), u = std::clamp(up[i], -limit, limit);
    out[i] = g / (1.0f + std::exp(-alpha * g)) * (u + 1.0f);
  }
}

void glu(GluActivation f, std::span<const float> gate, std::span<const float> up, std::span<float> out, float alpha,
         float limit) {
  switch (f) {
    case GluActivation::Silu: return silu_mul(gate, up, out);
    case GluActivation::GeluTanh: return gelu_tanh_mul(gate, up, out);
    case GluActivation::SwigluClamp: return swiglu_clamp_mul(gate, up, out, alpha, limit);
  }
  KVLM_CHECK(false, "glu: unknown activation");
}

void moe_route(std::span<const float> logits, int rows, int experts, int top_k, bool norm_topk, std::span<int32_t> ids,
               std::span<float> weights) {
  KVLM_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k outside 1..experts");
  KVLM_CHECK(logits.size() == size_t(rows) * size_t(experts) && ids.size() == size_t(rows) * size_t(top_k) &&
                 weights.size() == ids.size(),
             "moe_route: shape mismatch");
  std::vector<int32_t> order(static_cast<size_t>(experts));
  for (int r = 0; r < rows; ++r) {
    const float* l = logits.data() + size_t(r) * size_t(experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    const float mx = l[order[0]];
    float sum = 0.0f;
    if (norm_topk) {
      for (int k = 0; k < top_k; ++k) sum += std::exp(l[order[size_t(k)]] - mx);
    } else {
      for (int e = 0; e < experts; ++e) sum += std::exp(l[e] - mx);
    }
    for (int k = 0; k < top_k; ++k) {
      ids[size_t(r) * size_t(top_k) + size_t(k)] = order[size_t(k)];
      weights[size_t(r) * size_t(top_k) + size_t(k)] = std::exp(l[order[size_t(k)]] - mx) / sum;
    }
  }
}

void rope(std::span<float> x, int tokens, int heads, int head_dim, std::span<const Position> positions,
          std::span<const float> inv_freq) {
  const int half = int(inv_freq.size());  // head_dim / 2, or fewer: partial rotary
  KVLM_CHECK(x.size() == size_t(tokens) * size_t(heads) * size_t(head_dim) && positions.size() == size_t(tokens) &&
                 half >= 1 && 2 * half <= head_dim,
             "rope: shape mismatch");
  for (int t = 0; t < tokens; ++t) {
    for (int i = 0; i < half; ++i) {
      const float angle = float(positions[size_t(t)]) * inv_freq[size_t(i)];
      const float c = std::cos(angle), s = std::sin(angle);
      for (int h = 0; h < heads; ++h) {
        float* row = x.data() + (size_t(t) * size_t(heads) + size_t(h)) * size_t(head_dim);
        const float a = row[i], b = row[i + half];
        row[i] = a * c - b * s;
        row[i + half] = b * c + a * s;
      }
    }
  }
}

void add_inplace(std::span<float> y, std::span<const float> x) {
  KVLM_CHECK(y.size() == x.size(), "add: shape mismatch");
  for (size_t i = 0; i < y.size(); ++i) y[i] += x[i];
}

}  // namespace kvlm::ops::cpu

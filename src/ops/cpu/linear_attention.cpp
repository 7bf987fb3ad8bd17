#include "ops/cpu/linear_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"

namespace kvlm::ops::cpu {

namespace {

void check_shapes(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                  std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                  std::span<const float> state, std::span<const float> out) {
  KVLM_CHECK(s.k_heads > 0 && s.v_heads > 0 && s.v_heads % s.k_heads == 0 && s.dk > 0 && s.dv > 0 && tokens >= 0,
             "delta rule: value heads must be a multiple of key heads");
  const size_t T = size_t(tokens), qk = T * size_t(s.k_heads) * size_t(s.dk), vo = T * size_t(s.v_heads) * size_t(s.dv);
  KVLM_CHECK(q.size() == qk && k.size() == qk && v.size() == vo && out.size() == vo &&
                 g.size() == T * size_t(s.v_heads) && beta.size() == g.size() &&
                 state.size() == size_t(s.v_heads) * size_t(s.dk) * size_t(s.dv),
             "delta rule: shape mismatch");
}

// q and k rows L2-normalized (x / sqrt(sum x^2 + 1e-6), as flash-linear-attention's l2norm),
// q also scaled by dk^-0.5: [tokens][k_heads][dk] each.
void normalize_qk(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                  std::vector<float>& qn, std::vector<float>& kn) {
  qn.resize(q.size());
  kn.resize(k.size());
  const float scale = 1.0f / std::sqrt(float(s.dk));
  const size_t rows = size_t(tokens) * size_t(s.k_heads), d = size_t(s.dk);
  for (size_t r = 0; r < rows; ++r) {
    const float* qr = q.data() + r * d;
    const float* kr = k.data() + r * d;
    float sq = 0.0f, sk = 0.0f;
    for (size_t i = 0; i < d; ++i) {
      sq += qr[i] * qr[i];
      sk += kr[i] * kr[i];
    }
    const float iq = scale / std::sqrt(sq + 1e-6f), ik = 1.0f / std::sqrt(sk + 1e-6f);
    for (size_t i = 0; i < d; ++i) {
      qn[r * d + i] = qr[i] * iq;
      kn[r * d + i] = kr[i] * ik;
    }
  }
}

}  // namespace

void delta_rule_recurrent(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                          std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                          std::span<float> state, std::span<float> out) {
  check_shapes(s, tokens, q, k, v, g, beta, state, out);
  std::vector<float> qn, kn;
  normalize_qk(s, tokens, q, k, qn, kn);
  const int ratio = s.v_heads / s.k_heads;
  const size_t dk = size_t(s.dk), dv = size_t(s.dv), H = size_t(s.v_heads), KH = size_t(s.k_heads);
  std::vector<float> delta(dv);
  for (size_t h = 0; h < H; ++h) {
    float* S = state.data() + h * dk * dv;
    const size_t kh = h / size_t(ratio);
    for (size_t t = 0; t < size_t(tokens); ++t) {
      const float* qt = qn.data() + (t * KH + kh) * dk;
      const float* kt = kn.data() + (t * KH + kh) * dk;
      const float* vt = v.data() + (t * H + h) * dv;
      const float decay = std::exp(g[t * H + h]), b = beta[t * H + h];
      for (size_t i = 0; i < dk * dv; ++i) S[i] *= decay;
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (size_t i = 0; i < dk; ++i)
        for (size_t j = 0; j < dv; ++j) delta[j] += S[i * dv + j] * kt[i];
      for (size_t j = 0; j < dv; ++j) delta[j] = (vt[j] - delta[j]) * b;
      for (size_t i = 0; i < dk; ++i)
        for (size_t j = 0; j < dv; ++j) S[i * dv + j] += kt[i] * delta[j];
      float* ot = out.data() + (t * H + h) * dv;
      std::fill(ot, ot + dv, 0.0f);
      for (size_t i = 0; i < dk; ++i)
        for (size_t j = 0; j < dv; ++j) ot[j] += S[i * dv + j] * qt[i];
    }
  }
}

// Per chunk of n rows (positions i, j < n; gc = the cumulative sum of g over the chunk; k, q
// normalized; S the state before the chunk):
//   A[i][j] = -beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i, then T = (I - A)^-1 by forward
//   substitution (row i: A[i][j] += sum_m A[i][m] T'[m][j], rows m < i already done), T = A + I;
//   U = T (beta v), W = T (beta k exp(gc))            — the chunk's rows as if S were zero,
//   v_new = U - W S                                    — corrected for the state before it,
//   o_i = exp(gc_i) q_i S + sum_{j <= i} (q_i . k_j) exp(gc_i - gc_j) v_new_j,
//   S <- exp(gc_last) S + sum_i exp(gc_last - gc_i) k_i v_new_i^T.
void delta_rule_chunked(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                        std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                        std::span<float> state, std::span<float> out, int chunk) {
  check_shapes(s, tokens, q, k, v, g, beta, state, out);
  KVLM_CHECK(chunk > 0, "delta rule: chunk size must be positive");
  std::vector<float> qn, kn;
  normalize_qk(s, tokens, q, k, qn, kn);
  const int ratio = s.v_heads / s.k_heads;
  const size_t dk = size_t(s.dk), dv = size_t(s.dv), H = size_t(s.v_heads), KH = size_t(s.k_heads), C = size_t(chunk);
  std::vector<float> gc(C), A(C * C), U(C * dv), W(C * dk), vnew(C * dv), acc(dv);
  for (size_t h = 0; h < H; ++h) {
    float* S = state.data() + h * dk * dv;
    const size_t kh = h / size_t(ratio);
    auto krow = [&](size_t t) { return kn.data() + (t * KH + kh) * dk; };
    auto qrow = [&](size_t t) { return qn.data() + (t * KH + kh) * dk; };
    for (size_t c0 = 0; c0 < size_t(tokens); c0 += C) {
      const size_t n = std::min(C, size_t(tokens) - c0);
      float run = 0.0f;
      for (size_t i = 0; i < n; ++i) gc[i] = run += g[(c0 + i) * H + h];
      auto b = [&](size_t i) { return beta[(c0 + i) * H + h]; };
      auto dot = [&](const float* x, const float* y) {
        float r = 0.0f;
        for (size_t e = 0; e < dk; ++e) r += x[e] * y[e];
        return r;
      };
      // A, strictly lower, then the forward substitution into T (unit diagonal).
      for (size_t i = 0; i < n; ++i)
        for (size_t j = 0; j < n; ++j)
          A[i * C + j] = j < i ? -b(i) * dot(krow(c0 + i), krow(c0 + j)) * std::exp(gc[i] - gc[j]) : 0.0f;
      std::vector<float> row(n);
      for (size_t i = 1; i < n; ++i) {
        std::copy_n(A.data() + i * C, i, row.data());
        for (size_t j = 0; j < i; ++j) {
          float add = 0.0f;
          for (size_t m = j + 1; m < i; ++m) add += row[m] * A[m * C + j];
          A[i * C + j] = row[j] + add;
        }
      }
      for (size_t i = 0; i < n; ++i) A[i * C + i] = 1.0f;
      // U = T (beta v), W = T (beta k exp(gc)); then v_new = U - W S.
      for (size_t i = 0; i < n; ++i) {
        float* u = U.data() + i * dv;
        float* w = W.data() + i * dk;
        std::fill(u, u + dv, 0.0f);
        std::fill(w, w + dk, 0.0f);
        for (size_t j = 0; j <= i; ++j) {
          const float t = A[i * C + j] * b(j);
          const float* vj = v.data() + ((c0 + j) * H + h) * dv;
          const float* kj = krow(c0 + j);
          const float te = t * std::exp(gc[j]);
          for (size_t e = 0; e < dv; ++e) u[e] += t * vj[e];
          for (size_t e = 0; e < dk; ++e) w[e] += te * kj[e];
        }
        float* vn = vnew.data() + i * dv;
        std::copy_n(u, dv, vn);
        for (size_t e = 0; e < dk; ++e)
          for (size_t f = 0; f < dv; ++f) vn[f] -= w[e] * S[e * dv + f];
      }
      // Outputs: the state's part, then the chunk's own.
      for (size_t i = 0; i < n; ++i) {
        const float* qi = qrow(c0 + i);
        const float eg = std::exp(gc[i]);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (size_t e = 0; e < dk; ++e) {
          const float qe = qi[e] * eg;
          for (size_t f = 0; f < dv; ++f) acc[f] += qe * S[e * dv + f];
        }
        for (size_t j = 0; j <= i; ++j) {
          const float a = dot(qi, krow(c0 + j)) * std::exp(gc[i] - gc[j]);
          const float* vn = vnew.data() + j * dv;
          for (size_t f = 0; f < dv; ++f) acc[f] += a * vn[f];
        }
        std::copy_n(acc.data(), dv, out.data() + ((c0 + i) * H + h) * dv);
      }
      // The state after the chunk.
      const float glast = gc[n - 1], el = std::exp(glast);
      for (size_t e = 0; e < dk * dv; ++e) S[e] *= el;
      for (size_t i = 0; i < n; ++i) {
        const float* ki = krow(c0 + i);
        const float d = std::exp(glast - gc[i]);
        const float* vn = vnew.data() + i * dv;
        for (size_t e = 0; e < dk; ++e) {
          const float ke = ki[e] * d;
          for (size_t f = 0; f < dv; ++f) S[e * dv + f] += ke * vn[f];
        }
      }
    }
  }
}

void causal_conv_silu(int tokens, int channels, int kernel, std::span<const float> x, std::span<const float> w,
                      std::span<float> state, std::span<float> out) {
  const size_t T = size_t(tokens), Cn = size_t(channels), K = size_t(kernel);
  KVLM_CHECK(kernel >= 1 && x.size() == T * Cn && out.size() == x.size() && w.size() == Cn * K &&
                 state.size() == (K - 1) * Cn,
             "causal conv: shape mismatch");
  // The last K - 1 inputs, oldest first (a copy: out may alias x).
  std::vector<float> prev(state.begin(), state.end()), cur(Cn);
  for (size_t t = 0; t < T; ++t) {
    std::copy_n(x.data() + t * Cn, Cn, cur.data());
    for (size_t c = 0; c < Cn; ++c) {
      const float* wc = w.data() + c * K;
      float a = 0.0f;
      for (size_t j = 0; j + 1 < K; ++j) a += wc[j] * prev[j * Cn + c];
      a += wc[K - 1] * cur[c];
      out[t * Cn + c] = a / (1.0f + std::exp(-a));
    }
    if (K > 1) {
      std::copy(prev.begin() + std::ptrdiff_t(Cn), prev.end(), prev.begin());
      std::copy(cur.begin(), cur.end(), prev.end() - std::ptrdiff_t(Cn));
    }
  }
  std::copy(prev.begin(), prev.end(), state.begin());
}

void delta_rule_gates(int rows, int heads, std::span<const float> a_log, std::span<const float> dt_bias,
                      std::span<float> a_to_g, std::span<float> b_to_beta) {
  const size_t R = size_t(rows), Hn = size_t(heads);
  KVLM_CHECK(a_log.size() == Hn && dt_bias.size() == Hn && a_to_g.size() == R * Hn && b_to_beta.size() == R * Hn,
             "delta rule gates: shape mismatch");
  for (size_t r = 0; r < R; ++r)
    for (size_t h = 0; h < Hn; ++h) {
      float& a = a_to_g[r * Hn + h];
      const float x = a + dt_bias[h];
      const float sp = x > 20.0f ? x : std::log1p(std::exp(x));
      a = -std::exp(a_log[h]) * sp;
      float& b = b_to_beta[r * Hn + h];
      b = 1.0f / (1.0f + std::exp(-b));
    }
}

void rmsnorm_gated(std::span<const float> x, std::span<const float> z, int rows, int dim, std::span<const float> w,
                   float eps, std::span<float> out) {
  const size_t D = size_t(dim);
  KVLM_CHECK(x.size() == size_t(rows) * D && z.size() == x.size() && out.size() == x.size() && w.size() == D,
             "gated rmsnorm: shape mismatch");
  for (size_t r = 0; r < size_t(rows); ++r) {
    const float* xr = x.data() + r * D;
    const float* zr = z.data() + r * D;
    double ss = 0.0;
    for (size_t i = 0; i < D; ++i) ss += double(xr[i]) * double(xr[i]);
    const float inv = 1.0f / std::sqrt(float(ss / double(D)) + eps);
    float* o = out.data() + r * D;
    for (size_t i = 0; i < D; ++i) o[i] = w[i] * (xr[i] * inv) * (zr[i] / (1.0f + std::exp(-zr[i])));
  }
}

}  // namespace kvlm::ops::cpu

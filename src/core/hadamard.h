// The KV cache's rotation (--kv-cache-rotation hadamard): a fixed randomized Walsh-Hadamard
// transform over one head's head_dim values,
//
//   R x = H (s * x) / sqrt(d),   H the d x d Sylvester-Hadamard matrix, s_i = +-1 fixed signs,
//
// an orthogonal matrix, so q.k = (Rq).(Rk) exactly in real arithmetic, while a channel whose
// magnitude dwarfs the others (the outliers of K after RoPE) is spread over all d values
// before a per-(token, head) scale is taken. Applied to q, K and V after RoPE; the attention
// output, a weighted sum of rotated V rows, is rotated back with R^-1 = R^T = diag(s) H / sqrt(d).
//
// The CPU ops and the CUDA kernels compute it in the same order — sign flips, butterflies
// of strides 1, 2, 4, ... (a + b, a - b), then one multiply by hadamard_scale(d) — so both
// produce the same floats from the same input. d must be a power of two.
#pragma once

#include <cstdint>

#include "core/numeric.h"

namespace kvlm::num {

KVLM_HD bool is_pow2(int d) { return d > 0 && (d & (d - 1)) == 0; }

// s_i = -1 when this is true: the top bit of splitmix64(seed * 2^32 + i + 1). Seed 0 (the
// default) gives the same signs for every layer, head and model, so a page written by one
// process reads the same in another; a KV plan file may give a layer another seed
// (KVLayerSpec::rotation_seed), which `kvlm calibrate` picks where the signs matter. (A first choice,
// a 32-bit multiply-xorshift hash's low bit, gave Gemma 3 270M a 2.4x higher int4 KLD than any
// of seven random sign vectors — 0.36 against 0.10-0.16 — while splitmix64's falls among them,
// 0.13: with a few very large K channels the signs decide where they collide;
// docs/results/accuracy-real.md.)
KVLM_HD bool hadamard_sign_negative(uint32_t i, uint32_t seed = 0) {
  uint64_t z = ((uint64_t(seed) << 32) + uint64_t(i) + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (z >> 63) != 0;
}

// 1 / sqrt(d) for d = 2^k, rounded once: an exact power of two times 1 or 1/sqrt(2).
KVLM_HD float hadamard_scale(int d) {
  int k = 0;
  while ((1 << k) < d) ++k;
  float s = 1.0f;
  for (int i = 0; i < k / 2; ++i) s *= 0.5f;
  return (k & 1) ? s * 0.70710678118654752f : s;
}

// x <- R x (forward) or x <- R^T x (inverse), in place; d a power of two; `seed` picks the signs.
inline void hadamard_rotate(float* x, int d, bool inverse = false, uint32_t seed = 0) {
  if (!inverse)
    for (int i = 0; i < d; ++i)
      if (hadamard_sign_negative(uint32_t(i), seed)) x[i] = -x[i];
  for (int s = 1; s < d; s *= 2)
    for (int i = 0; i < d; i += 2 * s)
      for (int j = i; j < i + s; ++j) {
        const float a = x[j], b = x[j + s];
        x[j] = a + b;
        x[j + s] = a - b;
      }
  const float scale = hadamard_scale(d);
  for (int i = 0; i < d; ++i) {
    x[i] *= scale;
    if (inverse && hadamard_sign_negative(uint32_t(i), seed)) x[i] = -x[i];
  }
}

}  // namespace kvlm::num

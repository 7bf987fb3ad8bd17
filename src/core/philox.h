// Counter-based random numbers for sampling on any device: Philox4x32-10 (Salmon et al.,
// "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the Gumbel noise that
// Gumbel-max sampling adds to each logit.
//
// A counter-based generator gives the value for (key, counter) directly, with no state to
// carry between steps, so token t of request r gets the same noise on the CPU and on the GPU,
// whatever the batch it runs in and whatever thread draws it. Host and device share this
// code (KVLM_HD, as core/numeric.h); the CUDA sampling kernel and its CPU reference
// (sampling/sampler.h, sample_gumbel) both call gumbel_noise.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/numeric.h"  // KVLM_HD

namespace kvlm::rng {

struct U32x4 {
  uint32_t v[4];
};

KVLM_HD void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// Philox4x32 with 10 rounds: the constants of the paper (and of cuRAND / PyTorch).
KVLM_HD U32x4 philox4x32_10(U32x4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, c.v[0], hi0, lo0);
    mulhilo(kM1, c.v[2], hi1, lo1);
    c = U32x4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

// 32 random bits for (seed, counter, index): seed keys the generator, (index, counter) is
// the Philox counter. Sampling uses counter = the position of the token being generated in
// its request's output and index = the candidate token id.
KVLM_HD uint32_t random_u32(uint64_t seed, uint64_t counter, uint32_t index) {
  const U32x4 c{{index, uint32_t(counter), uint32_t(counter >> 32), 0x6b766c6du /* "kvlm" */}};
  return philox4x32_10(c, uint32_t(seed), uint32_t(seed >> 32)).v[0];
}

// Gumbel(0, 1) noise, -log(E) with E = -log(U) an Exponential(1) variate and U uniform in
// (0, 1) from 32 bits. For U above 1/2, E = -log1p(-(1 - U)) keeps E's precision where U is
// close to 1 (a float U cannot get closer to 1 than 2^-24; this way E reaches ~1e-10, so the
// noise is exact up to ~23 and tokens up to ~23 nats below the best can still be drawn).
KVLM_HD float gumbel_noise(uint32_t bits) {
  constexpr float kTwoM32 = 2.3283064365386963e-10f;  // 2^-32
  float e;
  if (bits < 0x80000000u) {
    e = -logf((float(bits) + 0.5f) * kTwoM32);          // U in (0, 1/2)
  } else {
    e = -log1pf(-((float(~bits) + 0.5f) * kTwoM32));    // 1 - U in (0, 1/2]
  }
  return -logf(e);
}

}  // namespace kvlm::rng

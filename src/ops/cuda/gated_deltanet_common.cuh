// What gated_deltanet.cu (conv, recurrent delta rule, gated norm) and gated_deltanet_chunked.cu
// (the chunked delta rule of prompts) share: the sizes every kernel derives from the params,
// how a state matrix element is held, and the chunked form's launcher.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "ops/cuda/gated_deltanet.h"
#include "ops/cuda/kernel_util.cuh"

namespace kvlm::cuda::gdn {

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// The log decay g = -exp(A_log) softplus(a + dt_bias) (PyTorch's softplus: x past 20 is x).
__device__ __forceinline__ float log_decay(float neg_a, float a, float dt_bias) {
  const float x = a + dt_bias;
  return neg_a * (x > 20.0f ? x : log1pf(expf(x)));
}

// One row's q and k of a key head of DK, in a warp (lane holds values lane + 32 c), L2-normalized
// (x / sqrt(sum x^2 + 1e-6), as flash-linear-attention's l2norm), q also scaled by DK^-0.5.
template <int DK>
struct NormedQk {
  static constexpr int kPer = (DK + 31) / 32;
  float q[kPer], k[kPer];
  __device__ __forceinline__ NormedQk(const float* qrow, const float* krow, int lane) {
    float sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      q[c] = i < DK ? qrow[i] : 0.0f;
      k[c] = i < DK ? krow[i] : 0.0f;
      sq += q[c] * q[c];
      sk += k[c] * k[c];
    }
    const float iq = (1.0f / sqrtf(float(DK))) / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      q[c] *= iq;
      k[c] *= ik;
    }
  }
  // Both into q_out[i], k_out[i] for i < DK.
  __device__ __forceinline__ void store(float* q_out, float* k_out, int lane) const {
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      if (i < DK) {
        q_out[i] = q[c];
        k_out[i] = k[c];
      }
    }
  }
};

struct Dims {
  int kd, vd, cd, in_dim;
  size_t conv_n;  // conv window values (fp32) at the start of a slot; the matrices follow
};

inline Dims dims_of(const GatedDeltaNetParams& p) {
  Dims d{};
  d.kd = p.k_heads * p.dk;
  d.vd = p.v_heads * p.dv;
  d.cd = 2 * d.kd + d.vd;
  d.in_dim = d.cd + d.vd + 2 * p.v_heads;
  d.conv_n = size_t(p.conv_kernel - 1) * size_t(d.cd);
  return d;
}

// A state matrix element held as fp32 or bf16 (GatedDeltaNetParams::state_dtype).
struct StateF32 {
  using T = float;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
struct StateBF16 {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};

// The delta rule over every sequence of the step in the chunked form, after the conv kernel
// has left qkv (gated_deltanet_chunked.cu): core gets the rule's output, the states the state
// after each sequence's last row. Needs p.scratch (gated_delta_net_scratch_floats).
void delta_rule_chunked(const GatedDeltaNetParams& p, const Dims& d, int max_q, cudaStream_t st);

}  // namespace kvlm::cuda::gdn

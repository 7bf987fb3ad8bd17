// What the small-m linear kernels share (gemv.cu: 16-bit weights, gemv_fp8.cu and
// gemm_fp8_small.cu: FP8 weights): the streaming load of weights, the 16-bit activation types,
// the input row (optionally SiLU-and-mul of a fused gate/up projection), the output store, and
// the split of k over a thread-block cluster.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {
namespace {

constexpr int kGemvThreads = 256;

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

struct VecBF16 {
  static constexpr bool kBF16 = true;
  static __device__ __forceinline__ void decode8(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ float load(uint16_t x) { return __uint_as_float(uint32_t(x) << 16); }
  static __device__ __forceinline__ uint16_t store(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
struct VecF16 {
  static constexpr bool kBF16 = false;
  static __device__ __forceinline__ void decode8(const uint4& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 p = __half22float2(h);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  static __device__ __forceinline__ float load(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  static __device__ __forceinline__ uint16_t store(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// x row r, 16-byte vector i, as 8 floats. With kGlu, x is the fused gate/up projection
// gu [m][2k] and the row is silu(gate) * up, computed here in fp32 (the down projection's
// input never goes to memory).
template <class V, bool kGlu>
__device__ __forceinline__ void load_x(const uint4* xv, int kv, int r, int i, float* xf) {
  if constexpr (kGlu) {
    float g[8], u[8];
    V::decode8(__ldg(xv + size_t(r) * 2 * size_t(kv) + size_t(i)), g);
    V::decode8(__ldg(xv + size_t(r) * 2 * size_t(kv) + size_t(kv) + size_t(i)), u);
#pragma unroll
    for (int e = 0; e < 8; ++e) xf[e] = g[e] / (1.0f + expf(-g[e])) * u[e];
  } else {
    V::decode8(__ldg(xv + size_t(r) * size_t(kv) + size_t(i)), xf);
  }
}

template <class V, int M, bool kF32Out>
__device__ __forceinline__ void store_out(void* y, int n, int col, int r, float v, const uint16_t* bias) {
  if (bias) v += V::load(bias[col]);
  if constexpr (kF32Out) static_cast<float*>(y)[size_t(r) * size_t(n) + size_t(col)] = v;
  else static_cast<uint16_t*>(y)[size_t(r) * size_t(n) + size_t(col)] = V::store(v);
}

// The small-m FP8 kernels split k over the CTAs of a thread-block cluster and add their sums
// through distributed shared memory. Clusters exist from sm_90 on; before Hopper the launches
// ask for one CTA per cluster, so a "cluster" is the CTA itself (these compile for sm_80 /
// sm_89 too).
__device__ __forceinline__ void cluster_sync(int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) {
    cooperative_groups::this_cluster().sync();
    return;
  }
#endif
  (void)splits;
  __syncthreads();
}
__device__ __forceinline__ int cluster_rank(int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (splits > 1) return int(cooperative_groups::this_cluster().block_rank());
#endif
  (void)splits;
  return 0;
}
__device__ __forceinline__ float* cluster_peer(float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  (void)rank;
  return p;
#endif
}

// The CTAs of Kernel that fit on the GPU at once (its occupancy times the SMs), after opting it
// in to kSmem bytes of shared memory (once per kernel and device; every launch calls this first).
template <auto Kernel, int kSmem>
int resident_ctas() {
  static PerDevice<int> slots;
  return slots.get([] {
    KVLM_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
    // Ask for the whole carve-out for shared memory (the default may leave room for one CTA).
    if (kernel_switches().fp8_tc_carveout)
      KVLM_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    int per_sm = 0;
    KVLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kGemvThreads, kSmem));
    return std::max(1, per_sm) * sm_count();
  });
}

}  // namespace
}  // namespace kvlm::cuda

// Per-token (and per-128-value-group) activation quantization for the FP8 tensor-core GEMM
// (gemm.h: quantize_rows_fp8, quantize_glu_rows_fp8). The codes follow the CPU reference's
// arithmetic (x / scale, then f32_to_e4m3), so they are bit-exact. A row's values come either
// from x itself or, for the gated MLP's down projection, from f(gate) * up computed on the fly
// (rounded to the activation type exactly as glu() stores it), so that input is never written.
#include <algorithm>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "core/numeric.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

namespace {

// Eight values to their eight E4M3 codes.
__device__ __forceinline__ uint2 encode8_e4m3(const float* f, float scale) {
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    lo |= uint32_t(num::f32_to_e4m3(f[e] / scale)) << (8 * e);
    hi |= uint32_t(num::f32_to_e4m3(f[4 + e] / scale)) << (8 * e);
  }
  return make_uint2(lo, hi);
}
__device__ __forceinline__ float e4m3_scale(float amax) { return amax > 0.0f ? amax / num::kE4M3Max : 1.0f; }

// Where a row's values come from: load8(row, k8, i, f) gives the 8 values of 16-byte vector i
// of a k8-vector row that starts at `row`; kWidth: input vectors per row per value vector.
template <class V>
struct FromX {
  static constexpr int kWidth = 1;
  static __device__ __forceinline__ void load8(const uint4* row, int, int i, float* f) { V::decode8(row[i], f); }
};
template <class V, GluActivation F>
struct FromGatedProduct {  // gu = [gate | up]
  static constexpr int kWidth = 2;
  static __device__ __forceinline__ void load8(const uint4* row, int k8, int i, float* f) {
    float g[8], u[8];
    V::decode8(row[i], g);
    V::decode8(row[k8 + i], u);
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = V::load(V::store(glu_gate<F>(g[e]) * u[e]));
  }
};

// One CTA of T threads per row: the row's absolute maximum (16-byte loads), then its codes
// (the row is in L1/L2 by then; a computed row is computed again). Rows of 8,192 values or more
// get 1,024 threads: at decode batches (m = 17-64 CTAs) the gated product of a 12,288-wide row
// took 16 µs with 256 (each thread computing 48 SiLUs, twice).
constexpr int kQuantThreads = 256, kQuantWideThreads = 1024;
template <class Src, int T>
__global__ void __launch_bounds__(T) quantize_rows_fp8_kernel(const uint4* in, uint2* codes, float* scales, int k8) {
  __shared__ float red[T / 32];
  pdl_wait();
  const size_t row = blockIdx.x;
  const uint4* r = in + row * Src::kWidth * size_t(k8);
  float amax = 0.0f;
  for (int i = int(threadIdx.x); i < k8; i += T) {
    float f[8];
    Src::load8(r, k8, i, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int w = 1; w < T / 32; ++w) amax = fmaxf(amax, red[w]);
  const float scale = e4m3_scale(amax);
  if (threadIdx.x == 0) scales[row] = scale;
  for (int i = int(threadIdx.x); i < k8; i += T) {
    float f[8];
    Src::load8(r, k8, i, f);
    codes[row * size_t(k8) + size_t(i)] = encode8_e4m3(f, scale);
  }
}

// Per 128-value group: a half-warp per group (16 lanes x 8 values), its scale at
// scales[group * m + row] (token fastest). A row's groups are spread over gridDim.y CTAs, one
// group per half-warp: with one CTA per row, each half-warp walked 6 of a 12,288-wide row's
// groups one after the other (load, reduce, encode), 7.8 µs at m = 32 against 4.5 for the
// per-row kernel on an H200.
template <class Src>
__global__ void __launch_bounds__(kQuantThreads) quantize_groups_fp8_kernel(const uint4* in, uint2* codes, float* scales,
                                                                             int k8, int m) {
  pdl_wait();
  const size_t row = blockIdx.x;
  const uint4* r = in + row * Src::kWidth * size_t(k8);
  const int half = int(threadIdx.x) / 16, lane = int(threadIdx.x) % 16;
  for (int g = int(blockIdx.y) * (kQuantThreads / 16) + half; g < k8 / 16; g += int(gridDim.y) * (kQuantThreads / 16)) {
    const int i = g * 16 + lane;
    float f[8];
    Src::load8(r, k8, i, f);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = e4m3_scale(amax);
    if (lane == 0) scales[size_t(g) * size_t(m) + row] = scale;
    codes[row * size_t(k8) + size_t(i)] = encode8_e4m3(f, scale);
  }
}

// The checks, then the kernel for the layout: per 128-value group, or one group per row (k =
// 128 included: the layouts agree).
template <class Src>
void launch_quantize(const char* what, DType ab, const void* in, uint8_t* codes, float* scales, int m, int k,
                     void* stream, int group) {
  if (m <= 0) return;
  const std::string w(what);
  if (k <= 0 || k % 8 != 0) throw Error(w + ": needs k % 8 == 0 (k " + std::to_string(k) + ")");
  if (group != 0 && group != k && (group != 128 || k % 128 != 0))
    throw Error(w + ": a group is a whole row or 128 values of a row whose length is a multiple of 128");
  if (reinterpret_cast<uintptr_t>(in) % 16 != 0 || reinterpret_cast<uintptr_t>(codes) % 16 != 0)
    throw Error(w + ": x and the codes must be 16-byte aligned");
  if (ab != DType::BF16 && ab != DType::F16) throw Error(w + ": x must be bfloat16 or float16");
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* iv = static_cast<const uint4*>(in);
  auto* cv = reinterpret_cast<uint2*>(codes);
  if (group == 128 && k > 128) {
    const unsigned per_row = unsigned(std::min(65535, (k / 128 + kQuantThreads / 16 - 1) / (kQuantThreads / 16)));
    KVLM_CUDA_CHECK(launch_pdl<quantize_groups_fp8_kernel<Src>>(dim3(unsigned(m), per_row), dim3(kQuantThreads), 0, st,
                                                                 iv, cv, scales, k / 8, m));
  }
  else if (k >= 8192)
    KVLM_CUDA_CHECK(launch_pdl<quantize_rows_fp8_kernel<Src, kQuantWideThreads>>(
        dim3(unsigned(m)), dim3(kQuantWideThreads), 0, st, iv, cv, scales, k / 8));
  else
    KVLM_CUDA_CHECK(launch_pdl<quantize_rows_fp8_kernel<Src, kQuantThreads>>(dim3(unsigned(m)), dim3(kQuantThreads), 0,
                                                                              st, iv, cv, scales, k / 8));
}

template <class V>
void launch_quantize_glu(DType ab, GluActivation f, const void* gu, uint8_t* codes, float* scales, int m, int k,
                         void* stream, int group) {
  constexpr const char* what = "quantize_glu_rows_fp8";
  KVLM_CHECK(f == GluActivation::Silu || f == GluActivation::GeluTanh, "quantize_glu_rows_fp8: SiLU or GELU only");
  if (f == GluActivation::Silu)
    launch_quantize<FromGatedProduct<V, GluActivation::Silu>>(what, ab, gu, codes, scales, m, k, stream, group);
  else
    launch_quantize<FromGatedProduct<V, GluActivation::GeluTanh>>(what, ab, gu, codes, scales, m, k, stream, group);
}

}  // namespace

void quantize_rows_fp8(DType ab, const void* x, uint8_t* codes, float* scales, int m, int k, void* stream, int group) {
  if (ab == DType::F16) launch_quantize<FromX<VecF16>>("quantize_rows_fp8", ab, x, codes, scales, m, k, stream, group);
  else launch_quantize<FromX<VecBF16>>("quantize_rows_fp8", ab, x, codes, scales, m, k, stream, group);
}

void quantize_glu_rows_fp8(DType ab, GluActivation f, const void* gu, uint8_t* codes, float* scales, int m, int k,
                           void* stream, int group) {
  if (ab == DType::F16) launch_quantize_glu<VecF16>(ab, f, gu, codes, scales, m, k, stream, group);
  else launch_quantize_glu<VecBF16>(ab, f, gu, codes, scales, m, k, stream, group);
}

}  // namespace kvlm::cuda

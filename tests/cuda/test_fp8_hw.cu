// FP8 conversion: kvlm's software encoder (core/numeric.h, used by the CPU backend and
// on GPUs without FP8 hardware) against the hardware conversion of __nv_cvt_float_to_fp8
// with __NV_SATFINITE, for all 2^32 float inputs; and the kernels' decoder (kv_codec.cuh:
// the software one of sm_80, and whichever path this build's kernels take) against
// cvt.rn.f16x2.e4m3x2 for every pair of codes. cuda_fp8.h's functions are the instructions
// on sm_89+ (and a software emulation on sm_80, where these tests compare software with
// software), so run them on an sm_89+ GPU. Skipped without a CUDA device.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>

#include "core/numeric.h"
#include "ops/cuda/kv_codec.cuh"

namespace {

__global__ void compare_all(uint32_t begin, uint32_t count, unsigned long long* mismatches, uint32_t* first_bad) {
  const uint32_t stride = blockDim.x * gridDim.x;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const uint32_t bits = begin + i;
    const float x = __uint_as_float(bits);
    const uint8_t hw4 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    const uint8_t hw5 = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
    const uint8_t sw4 = kvlm::num::f32_to_e4m3(x);
    const uint8_t sw5 = kvlm::num::f32_to_e5m2(x);
    // The kernels' encoders (kv_store, qkv_rope_store): hardware or software per build.
    const uint8_t k4 = kvlm::cuda::fp8::f32_to_e4m3(x);
    const uint8_t k5 = kvlm::cuda::fp8::f32_to_e5m2(x);
    if (hw4 != sw4 || hw5 != sw5 || k4 != hw4 || k5 != hw5) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, bits);
    }
  }
}

// Every pair of e4m3 codes p (0..65535): the software decode and the kernels' 4-code decode
// (fed p twice, byte-swapped the second time, so both output words are checked) against the
// instruction. Outputs compared as bits: NaN codes must give the instruction's NaN.
__global__ void compare_decode(unsigned long long* mismatches, uint32_t* first_bad) {
  const uint32_t p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= 65536u) return;
  const __half2_raw hw = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(p), __NV_E4M3);
  uint32_t want;
  memcpy(&want, &hw, 4);
  const uint32_t swapped = ((p & 0xffu) << 8) | (p >> 8);
  const uint32_t want_swapped = (want << 16) | (want >> 16);
  const uint32_t soft = kvlm::cuda::fp8::e4m3x2_hi_to_f16x2_soft(__byte_perm(p, 0u, 0x1404));
  uint32_t lo = 0, hi = 0;
  kvlm::cuda::fp8::e4m3x4_to_f16x2x2(p | (swapped << 16), lo, hi);
  if (soft != want || lo != want || hi != want_swapped) {
    atomicAdd(mismatches, 1ull);
    atomicMin(first_bad, p);
  }
}

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace

TEST(Fp8Hardware, SoftwareEncoderMatchesCvtForAllFloats) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  unsigned long long* d_mis;
  uint32_t* d_first;
  ASSERT_EQ(cudaMalloc(&d_mis, sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_first, sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_mis, 0, sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_first, 0xff, sizeof(uint32_t)), cudaSuccess);
  const uint32_t chunk = 1u << 30;
  for (uint64_t begin = 0; begin < (uint64_t(1) << 32); begin += chunk) {
    compare_all<<<1024, 256>>>(uint32_t(begin), chunk, d_mis, d_first);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  unsigned long long mis = 0;
  uint32_t first = 0;
  cudaMemcpy(&mis, d_mis, sizeof mis, cudaMemcpyDeviceToHost);
  cudaMemcpy(&first, d_first, sizeof first, cudaMemcpyDeviceToHost);
  cudaFree(d_mis);
  cudaFree(d_first);
  EXPECT_EQ(mis, 0ull) << "first mismatching float bits: 0x" << std::hex << first;
}

TEST(Fp8Hardware, SoftwareDecoderMatchesCvtForAllPairs) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  unsigned long long* d_mis;
  uint32_t* d_first;
  ASSERT_EQ(cudaMalloc(&d_mis, sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_first, sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_mis, 0, sizeof(unsigned long long)), cudaSuccess);
  ASSERT_EQ(cudaMemset(d_first, 0xff, sizeof(uint32_t)), cudaSuccess);
  compare_decode<<<256, 256>>>(d_mis, d_first);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  unsigned long long mis = 0;
  uint32_t first = 0;
  cudaMemcpy(&mis, d_mis, sizeof mis, cudaMemcpyDeviceToHost);
  cudaMemcpy(&first, d_first, sizeof first, cudaMemcpyDeviceToHost);
  cudaFree(d_mis);
  cudaFree(d_first);
  EXPECT_EQ(mis, 0ull) << "first mismatching pair of e4m3 codes: 0x" << std::hex << first;
}

// FP8 conversion: kvlm's software encoder (core/numeric.h, used by the CPU backend and
// on GPUs without FP8 hardware) against the hardware conversion of __nv_cvt_float_to_fp8
// with __NV_SATFINITE, for all 2^32 float inputs. Skipped without a CUDA device.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "core/numeric.h"

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
    if (hw4 != sw4 || hw5 != sw5) {
      atomicAdd(mismatches, 1ull);
      atomicMin(first_bad, bits);
    }
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

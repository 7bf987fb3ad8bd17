// The two activation dtypes of the CUDA decoder kernels as types (model_ops.cu, moe.cu): 16-bit
// codes loaded to and stored from fp32, and the dispatch from a runtime DType to them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace kvlm::cuda::act {

struct BF16 {
  static constexpr bool kBF16 = true;
  static __device__ __forceinline__ float load(uint16_t x) { return __uint_as_float(uint32_t(x) << 16); }
  static __device__ __forceinline__ uint16_t store(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
struct F16 {
  static constexpr bool kBF16 = false;
  static __device__ __forceinline__ float load(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  static __device__ __forceinline__ uint16_t store(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// f(BF16{}) or f(F16{}); `who` names the kernels in the error for another dtype.
template <class F>
void dispatch(DType act, const char* who, F&& f) {
  if (act == DType::BF16) return f(BF16{});
  if (act == DType::F16) return f(F16{});
  throw Error(std::string(who) + ": activations must be bfloat16 or float16, not " + std::string(dtype_name(act)));
}

}  // namespace kvlm::cuda::act

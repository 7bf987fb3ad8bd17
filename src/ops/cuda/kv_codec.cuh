// Device-side KV page formats: the CUDA twin of attention/kv_format.h. One struct per
// (storage, quant mode) pair, each with
//   Vec            the raw type of 8 consecutive elements (one 16 B or 8 B load),
//   decode8(v, f)  8 codes -> 8 floats, in registers, WITHOUT the scale (scales are folded
//                  into the query / the softmax weight by the kernels, see paged_attention.cu),
//   encode(x)      one float (already divided by its scale) -> one code, bit-identical to the
//                  CPU codec (kvfmt::*::encode), so pages written on either side are equal.
// dispatch_cuda_kv() is the single (storage, mode) switch of the CUDA kernels; a pair
// outside the set throws kvlm::Error naming the set.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace kvlm::cuda {

enum class Scale { None, PerTensor, PerTokenHead };

struct FmtBF16 {
  using Vec = uint4;  // 8 x bf16
  using Code = uint16_t;
  static constexpr Scale kScale = Scale::None;
  static constexpr float kMax = 0.0f;
  // bf16 -> f32 is a 16-bit shift: no conversion instruction at all.
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ Code encode(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};

struct FmtF16 {
  using Vec = uint4;
  using Code = uint16_t;
  static constexpr Scale kScale = Scale::None;
  static constexpr float kMax = 0.0f;
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
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
  static __device__ __forceinline__ Code encode(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

// FP8 E4M3: two codes at a time through the sm_89+ cvt.rn.f16x2.e4m3x2 instruction (exact:
// every e4m3 value is a half), then half2 -> float2.
template <Scale S>
struct FmtE4M3 {
  using Vec = uint2;  // 8 x fp8
  using Code = uint8_t;
  static constexpr Scale kScale = S;
  static constexpr float kMax = 448.0f;
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w[i] >> (16 * j)), __NV_E4M3);
        __half2 h;
        memcpy(&h, &r, 4);
        const float2 p = __half22float2(h);
        f[4 * i + 2 * j] = p.x;
        f[4 * i + 2 * j + 1] = p.y;
      }
    }
  }
  static __device__ __forceinline__ Code encode(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
};

// FP8 E5M2 is the top byte of an IEEE half: one byte permute builds two halves, no cvt.
struct FmtE5M2 {
  using Vec = uint2;
  using Code = uint8_t;
  static constexpr Scale kScale = Scale::PerTensor;
  static constexpr float kMax = 57344.0f;
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t lo = __byte_perm(w[i], 0u, 0x1404), hi = __byte_perm(w[i], 0u, 0x3424);
      __half2 a, b;
      memcpy(&a, &lo, 4);
      memcpy(&b, &hi, 4);
      const float2 pa = __half22float2(a), pb = __half22float2(b);
      f[4 * i] = pa.x;
      f[4 * i + 1] = pa.y;
      f[4 * i + 2] = pb.x;
      f[4 * i + 3] = pb.y;
    }
  }
  static __device__ __forceinline__ Code encode(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2); }
};

struct FmtI8 {
  using Vec = uint2;
  using Code = uint8_t;
  static constexpr Scale kScale = Scale::PerTokenHead;
  static constexpr float kMax = 127.0f;
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) f[4 * i + j] = float(int8_t(uint8_t(w[i] >> (8 * j))));
  }
  // Round half to even (rintf), saturate symmetrically: kvfmt::I8::encode exactly.
  static __device__ __forceinline__ Code encode(float x) {
    return uint8_t(int8_t(rintf(fminf(fmaxf(x, -127.0f), 127.0f))));
  }
};

inline constexpr const char* kSupportedCudaKV =
    "bfloat16/float16 with none, fp8_e4m3/fp8_e5m2 with fp8_per_tensor, fp8_e4m3 with fp8_per_token_head, int8 "
    "with int8_per_token_head";

// The one (storage, mode) switch of the CUDA kernels.
template <class F>
void dispatch_cuda_kv(DType storage, KVQuantMode mode, F&& f) {
  switch (mode) {
    case KVQuantMode::None:
      if (storage == DType::BF16) return f(FmtBF16{});
      if (storage == DType::F16) return f(FmtF16{});
      break;
    case KVQuantMode::Fp8PerTensor:
      if (storage == DType::F8E4M3) return f(FmtE4M3<Scale::PerTensor>{});
      if (storage == DType::F8E5M2) return f(FmtE5M2{});
      break;
    case KVQuantMode::Fp8PerTokenHead:
      if (storage == DType::F8E4M3) return f(FmtE4M3<Scale::PerTokenHead>{});
      break;
    case KVQuantMode::Int8PerTokenHead:
      if (storage == DType::I8) return f(FmtI8{});
      break;
  }
  throw Error("CUDA attention: unsupported KV format: storage " + std::string(dtype_name(storage)) + " with quant mode " +
              std::string(kv_quant_mode_name(mode)) + "; supported: " + kSupportedCudaKV);
}

// A failed launch or API call: kvlm::Error with the CUDA error string.
inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace kvlm::cuda

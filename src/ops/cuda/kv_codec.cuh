// Device-side KV page formats: the CUDA twin of kv/kv_format.h. One struct per
// (storage, quant mode) pair of the format table (kv/kv_formats.h) marked `cuda`, each with
//   kKV            its (storage, quant mode) pair,
//   Vec            the raw type of 8 consecutive elements (one 16, 8 or 4 B load),
//   kBits          bits per code (16, 8; 4 for int4, which has no per-element Code type),
//   decode8(v, f)  8 codes -> 8 floats, in registers, WITHOUT the scale (scales are folded
//                  into the query / the softmax weight by the kernels, see paged_attention.cu),
//   encode(x)      one float (already divided by its scale) -> one code, bit-identical to the
//                  CPU codec (kvfmt::*::encode), so pages written on either side are equal.
// dispatch_cuda_kv() is the single (storage, mode) switch of the CUDA kernels; a pair
// outside the table's CUDA rows throws kvlm::Error naming them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "core/dtype.h"
#include "core/error.h"
#include "core/numeric.h"
#include "kv/kv_formats.h"

// FP8 conversions: sm_89 and later have instructions for them (cvt.rn.f16x2.e4m3x2,
// cvt.rn.satfinite.e4m3x2.f32 / .e5m2x2.f32); sm_80 — also what compute capability 8.6 and
// 8.7 run — has none, and there the kernels convert in software (fp8:: below), bit-identical
// to the instructions. KVLM_FORCE_SOFTWARE_FP8 (CMake option of the same name) selects the
// software path on every architecture: the build that tests sm_80's path on an sm_90 GPU.
// The capability table (attention/cuda_backend_caps.cpp) says which GPUs get which.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 890 || defined(KVLM_FORCE_SOFTWARE_FP8))
#define KVLM_SOFTWARE_FP8 1
#else
#define KVLM_SOFTWARE_FP8 0
#endif

namespace kvlm::cuda {

namespace fp8 {

// Two e4m3 codes, each in the high byte of one 16-bit half of x (x = c0 << 8 | c1 << 24),
// -> the two f16 values (low half: c0), in software. The code's 7 magnitude bits moved to
// bits 7..13 of an f16 read as the code's value times 2^-8, subnormals included (e4m3's
// exponent bias is 7, f16's 15; their mantissa fields are aligned at the top), so one exact
// f16 multiply by 2^8 finishes (f16 arithmetic keeps subnormals). The NaN codes 0x7f / 0xff
// would read +-480 (not an e4m3 value): they become 0x7fff, the NaN cvt.rn.f16x2.e4m3x2
// returns (sign dropped; cuda_fp8.hpp's emulation does the same). 5 instructions per pair.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2_soft(uint32_t x) {
  const uint32_t bits = ((x >> 1) & 0x3f803f80u) | (x & 0x80008000u);
  __half2 h;
  memcpy(&h, &bits, 4);
  const __half2 k256 = __halves2half2(__ushort_as_half(0x5c00), __ushort_as_half(0x5c00));
  const __half2 k480 = __halves2half2(__ushort_as_half(0x5f80), __ushort_as_half(0x5f80));
  h = __hmul2(h, k256);
  const uint32_t nan = __heq2_mask(__habs2(h), k480);
  uint32_t r;
  memcpy(&r, &h, 4);
  return (r & ~nan) | (0x7fff7fffu & nan);
}

// Four e4m3 codes (one 32-bit word, first code in the low byte) -> two f16x2: lo holds codes
// 0 and 1, hi codes 2 and 3. Hardware cvt on sm_89+, the software decode above otherwise.
__device__ __forceinline__ void e4m3x4_to_f16x2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
#if KVLM_SOFTWARE_FP8
  lo = e4m3x2_hi_to_f16x2_soft(__byte_perm(w, 0u, 0x1404));
  hi = e4m3x2_hi_to_f16x2_soft(__byte_perm(w, 0u, 0x3424));
#else
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3);
  memcpy(&lo, &a, 4);
  memcpy(&hi, &b, 4);
#endif
}

// float -> fp8 with saturation to the largest finite value (NaN -> 0x7f): the instruction on
// sm_89+, core/numeric.h's encoder (checked against it for all 2^32 floats) otherwise.
__device__ __forceinline__ uint8_t f32_to_e4m3(float x) {
#if KVLM_SOFTWARE_FP8
  return num::f32_to_e4m3(x);
#else
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
#endif
}
__device__ __forceinline__ uint8_t f32_to_e5m2(float x) {
#if KVLM_SOFTWARE_FP8
  return num::f32_to_e5m2(x);
#else
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2);
#endif
}

}  // namespace fp8

enum class Scale { None, PerTensor, PerTokenHead };

struct FmtBF16 {
  using Vec = uint4;  // 8 x bf16
  static constexpr KVStorage kKV{DType::BF16, KVQuantMode::None};
  using Code = uint16_t;
  static constexpr int kBits = 16;
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
  static constexpr KVStorage kKV{DType::F16, KVQuantMode::None};
  using Code = uint16_t;
  static constexpr int kBits = 16;
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

// FP8 E4M3: two codes at a time to f16 (exact: every e4m3 value is a half) — the sm_89+
// cvt.rn.f16x2.e4m3x2 instruction or its software twin (fp8:: above) — then half2 -> float2.
template <Scale S>
struct FmtE4M3 {
  using Vec = uint2;  // 8 x fp8
  static constexpr KVStorage kKV{DType::F8E4M3, S == Scale::PerTensor ? KVQuantMode::Fp8PerTensor : KVQuantMode::Fp8PerTokenHead};
  using Code = uint8_t;
  static constexpr int kBits = 8;
  static constexpr Scale kScale = S;
  static constexpr float kMax = 448.0f;
  static __device__ __forceinline__ void decode8(const Vec& v, float* f) {
    const uint32_t w[2] = {v.x, v.y};
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t r[2];
      fp8::e4m3x4_to_f16x2x2(w[i], r[0], r[1]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        __half2 h;
        memcpy(&h, &r[j], 4);
        const float2 p = __half22float2(h);
        f[4 * i + 2 * j] = p.x;
        f[4 * i + 2 * j + 1] = p.y;
      }
    }
  }
  static __device__ __forceinline__ Code encode(float x) { return fp8::f32_to_e4m3(x); }
};

// FP8 E5M2 is the top byte of an IEEE half: one byte permute builds two halves, no cvt (the
// same code on every architecture; only encode needs fp8::).
struct FmtE5M2 {
  using Vec = uint2;
  static constexpr KVStorage kKV{DType::F8E5M2, KVQuantMode::Fp8PerTensor};
  using Code = uint8_t;
  static constexpr int kBits = 8;
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
  static __device__ __forceinline__ Code encode(float x) { return fp8::f32_to_e5m2(x); }
};

struct FmtI8 {
  using Vec = uint2;
  static constexpr KVStorage kKV{DType::I8, KVQuantMode::Int8PerTokenHead};
  using Code = uint8_t;
  static constexpr int kBits = 8;
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

// INT4 with a step and a zero point per (token, kv head) (kv/kv_format.h: kvfmt::I4):
// 8 codes per 32-bit word, byte k = element k (low nibble) | element k + 4 (high nibble),
// offset-binary 0..15; the row's scale slot holds {f16 step, f16 zero}. decode8 returns the
// codes (0..15) as floats; a key's value is code * step + zero, which the kernels apply as
// step * (q . codes) + zero * sum(q) for K and as weight * step on the codes plus
// weight * zero on every output dimension for V. Codes come from the rounded f16 step and
// zero, exactly as the CPU codec computes them.
struct FmtI4 {
  using Vec = uint32_t;  // 8 x int4
  static constexpr KVStorage kKV{DType::I4, KVQuantMode::Int4PerTokenHead};
  static constexpr int kBits = 4;
  static constexpr Scale kScale = Scale::PerTokenHead;
  static constexpr float kLevels = 15.0f;
  static __device__ __forceinline__ void decode8(const Vec& w, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = float((w >> (8 * i)) & 0xfu);
      f[i + 4] = float((w >> (8 * i + 4)) & 0xfu);
    }
  }
  // The packed slot -> step and zero.
  static __device__ __forceinline__ void unpack(uint32_t slot, float& step, float& zero) {
    step = __half2float(__ushort_as_half(uint16_t(slot & 0xffffu)));
    zero = __half2float(__ushort_as_half(uint16_t(slot >> 16)));
  }
};
// Encoding one row, as kvfmt::Format<I4, PerTokenHead>::encode_row does: the row's min and
// max -> the f16 step and zero (packed into `slot`), then 8 values -> one word of codes.
struct I4Encoder {
  float step, zero;
  uint32_t slot;
  __device__ __forceinline__ I4Encoder(float lo, float hi) {
    const __half s16 = __float2half_rn(fminf(fmaxf(__fdiv_rn(hi - lo, 15.0f), 6.103515625e-05f), 65504.0f));
    __half z16 = __float2half_rn(fminf(fmaxf(lo, -65504.0f), 65504.0f));
    if (__half_as_ushort(z16) == 0x8000u) z16 = __ushort_as_half(0);  // -0 -> +0, as the CPU stores it
    step = __half2float(s16);
    zero = __half2float(z16);
    slot = uint32_t(__half_as_ushort(s16)) | uint32_t(__half_as_ushort(z16)) << 16;
  }
  __device__ __forceinline__ uint32_t code(float x) const {
    return uint32_t(rintf(fminf(fmaxf(__fdiv_rn(x - zero, step), 0.0f), 15.0f)));
  }
  // The encoder of a row spread over a warp: each lane's own min and max, combined.
  static __device__ __forceinline__ I4Encoder over_warp(float lo, float hi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    return I4Encoder(lo, hi);
  }
  // x[0..7]: elements 8w .. 8w + 7 of the row -> word w.
  __device__ __forceinline__ uint32_t word(const float* x) const {
    uint32_t w = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) w |= (code(x[k]) | code(x[k + 4]) << 4) << (8 * k);
    return w;
  }
};

template <class Fmt>
inline constexpr bool kIsInt4 = false;
template <>
inline constexpr bool kIsInt4<FmtI4> = true;

// The CUDA codecs: the table's `cuda` rows (kv/kv_formats.h), checked here at compile time.
using CudaCodecs = KVCodecList<FmtF16, FmtBF16, FmtE4M3<Scale::PerTensor>, FmtE5M2, FmtE4M3<Scale::PerTokenHead>, FmtI8,
                               FmtI4>;
static_assert(check_codecs(CudaCodecs{}, KVFormatSet::Cuda), "a CUDA row of kKVFormats without a codec, or a codec outside it");

// The one (storage, mode) switch of the CUDA kernels.
template <class F>
void dispatch_cuda_kv(DType storage, KVQuantMode mode, F&& f) {
  dispatch_kv_codec(CudaCodecs{}, KVStorage{storage, mode}, KVFormatSet::Cuda, "CUDA attention", f);
}

// K and V in two formats (kv/kv_formats.h's kCudaSplitFormats): the kernels take one format
// parameter, either one codec (K and V alike: the instantiations of a uniform cache) or a
// KVPair, and read K through KOf<F> and V through VOf<F>.
template <class KF, class VF>
struct KVPair {};
template <class F>
struct KVSides {
  using K = F;
  using V = F;
};
template <class KF, class VF>
struct KVSides<KVPair<KF, VF>> {
  using K = KF;
  using V = VF;
};
template <class F>
using KOf = typename KVSides<F>::K;
template <class F>
using VOf = typename KVSides<F>::V;

// K's and V's formats of the params of kv_store, qkv_rope_store or paged_attention (storage and
// quant: K's, and V's unless v_format is set).
template <class P>
KVStorage k_format_of(const P& p) {
  return {p.storage, p.quant};
}
template <class P>
KVStorage v_format_of(const P& p) {
  return p.v_format.value_or(KVStorage{p.storage, p.quant});
}

// The (K, V) switch: f(Codec{}) where the formats are equal, f(KVPair<KF, VF>{}) for a pair of
// the CUDA list; any other pair is a kvlm::Error naming `who` and the pairs that work.
template <class F>
void dispatch_cuda_kv_pair(KVStorage k, KVStorage v, std::string_view who, F&& f) {
  if (k == v) return dispatch_kv_codec(CudaCodecs{}, k, KVFormatSet::Cuda, who, f);
  auto refuse = [&] {
    throw Error(std::string(who) + ": K " + kv_format_name(k) + " with V " + kv_format_name(v) +
                " is not a pair the CUDA kernels read; they read " + describe_kv_pairs(KVFormatSet::Cuda) +
                ", or K and V in one format");
  };
  if (!kv_pair_in(k, v, KVFormatSet::Cuda)) refuse();
  dispatch_kv_codec(CudaCodecs{}, k, KVFormatSet::Cuda, who, [&](auto kf) {
    dispatch_kv_codec(CudaCodecs{}, v, KVFormatSet::Cuda, who, [&](auto vf) {
      using KF = std::remove_cvref_t<decltype(kf)>;
      using VF = std::remove_cvref_t<decltype(vf)>;
      if constexpr (!std::is_same_v<KF, VF> && kv_pair_in(KF::kKV, VF::kKV, KVFormatSet::Cuda)) f(KVPair<KF, VF>{});
      else refuse();
    });
  });
}

// The scale pages and the head size each side's format needs, checked before a launch (for the
// params of kv_store, qkv_rope_store and paged_attention alike).
template <class Fmt, class P>
void check_kv_pages(const P& p, std::string_view who) {
  using KF = KOf<Fmt>;
  using VF = VOf<Fmt>;
  constexpr bool kk = KF::kScale == Scale::PerTensor, vk = VF::kScale == Scale::PerTensor;
  if ((kk && !p.k_tensor_scale) || (vk && !p.v_tensor_scale) ||
      ((kk || vk) && p.num_tensor_scales != 1 && p.num_tensor_scales != p.num_kv_heads))
    throw Error(std::string(who) + ": fp8_per_tensor needs 1 or num_kv_heads K and V scales");
  if ((KF::kScale == Scale::PerTokenHead && !p.k_token_scale) || (VF::kScale == Scale::PerTokenHead && !p.v_token_scale))
    throw Error(std::string(who) + ": per-token-head modes need the scale pages");
  if ((kIsInt4<KF> || kIsInt4<VF>) && p.head_dim % 8 != 0)
    throw Error(std::string(who) + ": int4 rows need head_dim % 8 == 0");
}

// A failed launch or API call: kvlm::Error with the CUDA error string.
inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace kvlm::cuda

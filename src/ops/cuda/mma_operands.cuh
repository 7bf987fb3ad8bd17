// KV codes as tensor-core operands, shared by the decode (paged_attention_mma.cuh) and the
// prefill (paged_attention_prefill.cuh) attention kernels: the 16-bit pair packing of P, each
// format's expansion of its codes into mma.sync inputs, and the online-softmax step on the mma
// accumulator layout. Included after paged_attention_rows.cuh (the formats).
#pragma once

#include "ops/cuda/mma_sync.cuh"

namespace kvlm::cuda::mma {

// Two floats -> one register of two 16-bit values of the mma type (low half = first).
template <bool kBF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}
template <bool kBF16>
__device__ __forceinline__ float2 unpack2(uint32_t r) {
  if constexpr (kBF16) {
    return make_float2(__uint_as_float(r << 16), __uint_as_float(r & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &r, 4);
    return __half22float2(h);
  }
}

// Per format: the mma input type and 4 codes (one 32-bit word) -> 2 registers of 2 x 16-bit.
// 2-byte formats are already mma operands (no conversion instruction at all); FP8/INT8
// expand exactly into f16 (every e4m3, e5m2 and int8 value is an f16).
template <class Fmt>
struct MmaCodec;
template <>
struct MmaCodec<FmtBF16> {
  static constexpr bool kBF16 = true;
};
template <>
struct MmaCodec<FmtF16> {
  static constexpr bool kBF16 = false;
};
template <Scale S>
struct MmaCodec<FmtE4M3<S>> {
  static constexpr bool kBF16 = false;
  // cvt.rn.f16x2.e4m3x2 on sm_89+, the software decode on sm_80 (kv_codec.cuh: fp8::).
  static __device__ __forceinline__ void expand(uint32_t w, uint32_t& a, uint32_t& b) { fp8::e4m3x4_to_f16x2x2(w, a, b); }
};
template <>
struct MmaCodec<FmtE5M2> {
  static constexpr bool kBF16 = false;
  // e5m2 is the high byte of an f16: one byte permute per pair.
  static __device__ __forceinline__ void expand(uint32_t w, uint32_t& a, uint32_t& b) {
    a = __byte_perm(w, 0u, 0x1404);
    b = __byte_perm(w, 0u, 0x3424);
  }
};
// int4 (kv_codec.cuh FmtI4): a word of 8 codes -> 4 pairs of consecutive codes as f16
// 0..15 (the step and zero point are applied per key outside the mma): the low nibbles are
// elements 0-3, the high nibbles 4-7; each byte goes under exponent 0x64 (f16 1024 + code)
// and one subtraction of 1024 per pair finishes (exact).
template <>
struct MmaCodec<FmtI4> {
  static constexpr bool kBF16 = false;
  static __device__ __forceinline__ void expand4(uint32_t w, uint32_t* p) {
    const uint32_t lo = w & 0x0f0f0f0fu, hi = (w >> 4) & 0x0f0f0f0fu;
    const uint32_t r[4] = {__byte_perm(lo, 0x64646464u, 0x4140), __byte_perm(lo, 0x64646464u, 0x4342),
                           __byte_perm(hi, 0x64646464u, 0x4140), __byte_perm(hi, 0x64646464u, 0x4342)};
    const __half2 k1024 = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h;
      memcpy(&h, &r[i], 4);
      h = __hsub2(h, k1024);
      memcpy(&p[i], &h, 4);
    }
  }
};
template <>
struct MmaCodec<FmtI8> {
  static constexpr bool kBF16 = false;
  // int8 x -> f16 1024 + (x + 128) by placing the biased byte under exponent 0x64, then one
  // subtraction of 1152 per pair (exact): 3 instructions per 2 values, no I2F.
  static __device__ __forceinline__ void expand(uint32_t w, uint32_t& a, uint32_t& b) {
    const uint32_t u = w ^ 0x80808080u;
    const uint32_t ra = __byte_perm(u, 0x64646464u, 0x4140), rb = __byte_perm(u, 0x64646464u, 0x4342);
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));  // 1152
    __half2 ha, hb;
    memcpy(&ha, &ra, 4);
    memcpy(&hb, &rb, 4);
    ha = __hsub2(ha, bias);
    hb = __hsub2(hb, bias);
    memcpy(&a, &ha, 4);
    memcpy(&b, &hb, 4);
  }
};

// `n` raw bytes (held in uint4s, n % 4 == 0) -> their codes as 16-bit pairs, in order.
template <class Fmt, int NBYTES>
__device__ __forceinline__ void to_pairs(const uint4* raw, uint32_t* pairs) {
  constexpr int kWords = NBYTES / 4;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(raw);
  if constexpr (Fmt::kBits == 16) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) pairs[i] = w[i];
  } else if constexpr (Fmt::kBits == 4) {
#pragma unroll
    for (int i = 0; i < kWords; ++i) MmaCodec<Fmt>::expand4(w[i], pairs + 4 * i);
  } else {
#pragma unroll
    for (int i = 0; i < kWords; ++i) MmaCodec<Fmt>::expand(w[i], pairs[2 * i], pairs[2 * i + 1]);
  }
}

// One M row's step of the online softmax (mma accumulator layout: the row's values in a
// thread are o[n][2i], o[n][2i + 1]), shared by the decode and the prefill kernels. `mx` is
// this tile's max of the thread's scores of the row; it is combined over the row's 4
// threads, folded into the running max and sum, and o is rescaled — only when some row of
// the warp moved its max (rare after the first tiles; the N * 2 multiplies are a large share
// of a tile's instructions for 1-byte codes). Returns the max to subtract from the tile's
// scores before exp2. Warp-uniform call.
// `z`, when given, is rescaled with the sum (int4's zero-point accumulator).
template <int N>
__device__ __forceinline__ float online_max(float mx, float& m_run, float& l_run, float (&o)[N][4], int i,
                                           float* z = nullptr) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m_run, mx);
  const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // no NaN from -inf - -inf
  const float corr = exp2f(m_run - m_use);
  m_run = m_new;
  l_run *= corr;
  if (z) *z *= corr;
  if (__any_sync(0xffffffffu, corr != 1.0f)) {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      o[n][2 * i] *= corr;
      o[n][2 * i + 1] *= corr;
    }
  }
  return m_use;
}

}  // namespace kvlm::cuda::mma

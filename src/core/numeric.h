// Software conversions between float and the storage formats kvlm keeps tensors and KV
// pages in: bfloat16, float16, FP8 E4M3 ("fn": no infinities, max 448) and FP8 E5M2 (max
// 57344).
//
// The FP8 encoders round to nearest even and saturate exactly as CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, fmt) does: finite values beyond the largest
// finite code and +-inf become +-max, every NaN becomes 0x7F in both formats, whatever
// its sign and payload (what both the sm_90 instruction and CUDA 13's host emulation
// return: checked on an H200, see docs/results/gpu-check.md), magnitudes at or below half
// the smallest subnormal become signed zero. tests/unit/test_numeric.cpp checks every code
// and the edges; tests/cuda compares against the hardware conversion for all 2^32 floats.
//
// Everything is constexpr-friendly and usable from CUDA device code (KVLM_HD), without
// including any CUDA header.
#pragma once

#include <bit>
#include <cstdint>

#if defined(__CUDACC__)
#define KVLM_HD __host__ __device__ __forceinline__
#else
#define KVLM_HD inline
#endif

namespace kvlm::num {

KVLM_HD uint32_t f32_bits(float x) { return std::bit_cast<uint32_t>(x); }
KVLM_HD float f32_from_bits(uint32_t b) { return std::bit_cast<float>(b); }

// ---- bfloat16 -------------------------------------------------------------------------
KVLM_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(uint32_t(h) << 16); }

KVLM_HD uint16_t f32_to_bf16(float x) {
  uint32_t b = f32_bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return uint16_t((b >> 16) | 0x0040u);  // quiet NaN
  // Round to nearest even on the 16 discarded bits.
  b += 0x7fffu + ((b >> 16) & 1u);
  return uint16_t(b >> 16);
}

// ---- float16 (IEEE binary16) ----------------------------------------------------------
KVLM_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp == 0) {
    if (man == 0) return f32_from_bits(sign);
    // Subnormal: value = man * 2^-24; normalise it.
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    return f32_from_bits(sign | uint32_t(127 - 15 - e) << 23 | (man & 0x3ffu) << 13);
  }
  return f32_from_bits(sign | (exp + 112u) << 23 | man << 13);
}

KVLM_HD uint16_t f32_to_f16(float x) {
  const uint32_t b = f32_bits(x);
  const uint16_t sign = uint16_t((b >> 16) & 0x8000u);
  const uint32_t abs = b & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 2^16: inf
  const int exp = int(abs >> 23) - 127;
  if (exp >= -14) {  // normal half
    uint32_t man = abs & 0x7fffffu;
    uint32_t h = uint32_t(exp + 15) << 10 | (man >> 13);
    const uint32_t rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // carries into exponent
    return uint16_t(sign | h);
  }
  // Subnormal half: value / 2^-24, rounded to nearest even.
  const int shift = -exp - 14 + 13;  // bits of the 24-bit significand dropped
  if (shift > 24) return sign;
  const uint32_t sig = (abs & 0x7fffffu) | 0x800000u;
  uint32_t h = sig >> shift;
  const uint32_t rest = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (h & 1u))) ++h;
  return uint16_t(sign | h);
}

// ---- FP8 ------------------------------------------------------------------------------
// Generic encoder for a format with `kMan` mantissa bits and exponent bias `kBias`.
// kMaxCode: the largest finite magnitude code; kOverflow: float bits of the smallest
// magnitude that saturates (strictly greater for E4M3, >= for E5M2, see below).
template <int kMan, int kBias, uint8_t kMaxCode>
KVLM_HD uint8_t f32_to_fp8_sat(float x, uint32_t overflow_bits) {
  const uint32_t b = f32_bits(x);
  const uint8_t sign = uint8_t((b >> 24) & 0x80u);
  const uint32_t abs = b & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fu;  // NaN: canonical positive NaN code
  if (abs > overflow_bits) return uint8_t(sign | kMaxCode);  // includes +-inf
  const int exp = int(abs >> 23) - 127;
  constexpr int kDrop = 23 - kMan;  // float mantissa bits below the fp8 mantissa
  if (exp >= 1 - kBias) {           // normal fp8
    uint32_t code = uint32_t(exp + kBias) << kMan | ((abs & 0x7fffffu) >> kDrop);
    const uint32_t rest = abs & ((1u << kDrop) - 1u);
    const uint32_t half = 1u << (kDrop - 1);
    if (rest > half || (rest == half && (code & 1u))) ++code;
    return uint8_t(sign | code);
  }
  // Subnormal fp8: code = value / 2^(1-kBias-kMan), rounded to nearest even. The float's
  // 24-bit significand is shifted right by `shift`.
  const int shift = kDrop + (1 - kBias) - exp;
  if (shift > 25 || abs == 0) return sign;  // below half the smallest subnormal
  const uint32_t sig = (abs & 0x7fffffu) | (abs >= 0x00800000u ? 0x800000u : 0u);
  uint32_t code = shift >= 32 ? 0u : sig >> shift;
  const uint64_t rest = uint64_t(sig) & ((uint64_t(1) << shift) - 1u);
  const uint64_t half = uint64_t(1) << (shift - 1);
  if (rest > half || (rest == half && (code & 1u))) ++code;
  return uint8_t(sign | code);
}

// E4M3: max finite 448 = 0x7E; 448 + half an ulp (464) still rounds (to even) to 448, so
// the saturating branch starts strictly above 464 — the result is the same as clamping.
KVLM_HD uint8_t f32_to_e4m3(float x) { return f32_to_fp8_sat<3, 7, 0x7e>(x, 0x43e80000u); }
// E5M2: max finite 57344 = 0x7B; at 57344 + half an ulp (61440) RNE would round up to
// infinity, so 61440 itself already saturates (threshold = 61440's bits - 1).
KVLM_HD uint8_t f32_to_e5m2(float x) { return f32_to_fp8_sat<2, 15, 0x7b>(x, 0x476fffffu); }

KVLM_HD float e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xfu;
  const uint32_t man = c & 0x7u;
  if (exp == 0xf && man == 0x7) return f32_from_bits(sign | 0x7fc00000u);  // NaN
  if (exp == 0) {                                                          // subnormal: man * 2^-9
    const float v = float(man) * (1.0f / 512.0f);
    return sign ? -v : v;
  }
  return f32_from_bits(sign | (exp + 120u) << 23 | man << 20);
}

KVLM_HD float e5m2_to_f32(uint8_t c) {
  // E5M2 is the top byte of an IEEE half.
  return f16_to_f32(uint16_t(uint16_t(c) << 8));
}

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kInt8Max = 127.0f;

}  // namespace kvlm::num

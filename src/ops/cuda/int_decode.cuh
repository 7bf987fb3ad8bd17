// The in-register decode of grouped integer codes (gemm.h IntWeight; io/grouped_codes.h) to
// 16-bit pairs for the tensor cores, shared by gemv_int.cu (m <= 16) and gemm_int.cu (m <= 64);
// MXFP4's E2M1 codes too (e2m1x8_to_pairs).
// gemv_int.cu's header comment says how each decode is exact up to the one rounding of
// s * code + b. A decode's pairs are a 32-bit word's 4-bit codes (j, j + 4) or 8-bit codes
// (0, 2) and (1, 3), which the codes' order (io/grouped_codes.h grouped_code) makes adjacent
// columns: (0, 1), (2, 3), ... of the word, so that x's own 32-bit words are the B fragments
// that meet them. Also the host's check of a weight both kernels take.
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/gemm.h"

namespace kvlm::cuda {
namespace {

// Throws kvlm::Error, prefixed with `what`, for a weight of grouped codes the kernels cannot
// read: a layout that does not fit rows of k, a compute type other than bf16 / f16, an 8-bit
// zero-point or E2M1 layout, or misaligned codes or parameters.
void check_int(const char* what, DType ab, const IntWeight& w, int k) {
  if (!int_layout_fits(k, w.bits, w.group))
    throw Error(std::string(what) + ": grouped codes of " + std::to_string(w.bits) + " bits in groups of " +
                std::to_string(w.group) + " do not fit a row of " + std::to_string(k) +
                " (4-bit: groups and rows multiples of 32; 8-bit: of 16)");
  if (ab != DType::BF16 && ab != DType::F16) throw Error(std::string(what) + ": the compute type must be bf16 or f16");
  if ((w.zero_point || w.e2m1) && w.bits != 4)
    throw Error(std::string(what) + ": zero-point and E2M1 layouts are 4-bit");
  if (w.zero_point && w.e2m1) throw Error(std::string(what) + ": E2M1 codes have no zero point");
  if (reinterpret_cast<uintptr_t>(w.codes) % 16 != 0 || reinterpret_cast<uintptr_t>(w.params) % 4 != 0)
    throw Error(std::string(what) + ": the codes must be 16-byte aligned, the parameters 4-byte aligned");
}


template <bool kBF16>
inline constexpr uint32_t kNegMagic2 = kBF16 ? 0xc300c300u : 0xe400e400u;  // -128.0 / -1024.0 in both halves

// A 4-bit group's word as the decode's three pairs: a2 the first fma's addend (minus the magic
// number, or -(magic + z) for a zero-point layout), s2 the scale, b2 the offset (0 for a
// zero-point layout).
template <bool kBF16>
__device__ __forceinline__ void int4_param_pairs(uint32_t p, bool zp, uint32_t& a2, uint32_t& s2, uint32_t& b2) {
  s2 = __byte_perm(p, 0, 0x1010);
  const uint32_t hi = __byte_perm(p, 0, 0x3232);
  a2 = zp ? hi : kNegMagic2<kBF16>;
  b2 = zp ? 0u : hi;
}

// 8 4-bit codes (code j in bits 4j..4j+3) -> the weights of codes (0, 4), (1, 5), (2, 6), (3, 7)
// (columns (0, 1) .. (6, 7) of the word) as 16-bit pairs, (code + magic + a) s + b with a2, s2 and b2 from int4_param_pairs: s code + b,
// or s (code - z), each rounded once.
template <bool kBF16>
__device__ __forceinline__ void int4x8_to_pairs(uint32_t w, uint32_t a2, uint32_t s2, uint32_t b2, uint32_t (&p)[4]) {
  constexpr uint32_t kMagic = kBF16 ? 0x43004300u : 0x64006400u;  // 128.0 / 1024.0 in both halves
  constexpr uint32_t kOne = kBF16 ? 0x3f803f80u : 0x3c003c00u;
  // (w >> 4j) & mask | magic as one LOP3: written out, because LOP3 takes one immediate and
  // ptxas otherwise splits the mask-and-or of two constants into two instructions.
  const uint32_t magic = kMagic;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t v;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(v) : "r"(w >> (4 * j)), "n"(0x000f000f), "r"(magic));
    uint32_t q;
    if constexpr (kBF16) {
      asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(v), "r"(kOne), "r"(a2));
      asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(p[j]) : "r"(q), "r"(s2), "r"(b2));
    } else {
      asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(v), "r"(kOne), "r"(a2));
      asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(p[j]) : "r"(q), "r"(s2), "r"(b2));
    }
  }
}

// 4 signed 8-bit codes (code 0 in the low byte) -> the weights of codes (0, 2) and (1, 3)
// (columns (0, 1) and (2, 3)) as 16-bit pairs, s * code + b with s2 = (s, s) and b2 = (b, b) in the compute type. A byte goes
// to the low byte of a 16-bit half (one PRMT per pair), then:
//  - bf16 (8 significant bits: no magic number covers 256 codes): (half & 0x7f) | bits of
//    128.0 is 128 + (code & 127), (half & 0x80) | bits of 128.0 is 128 or 256 (the sign bit),
//    and their difference is the code, exact;
//  - f16: the byte of code ^ 0x80 under the bits of 1024.0 is 1024 + code + 128, minus 1152.
template <bool kBF16>
__device__ __forceinline__ void int8x4_to_pairs(uint32_t w, uint32_t s2, uint32_t b2, uint32_t& even, uint32_t& odd) {
  uint32_t* out[2] = {&even, &odd};
  if constexpr (kBF16) {
    const uint32_t magic = 0x43004300u, neg_one = 0xbf80bf80u;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t x = __byte_perm(w, 0, h ? 0x4341 : 0x4240);  // bytes h, h + 2 in the halves' low bytes
      uint32_t v, c, q;
      asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(v) : "r"(x), "n"(0x007f007f), "r"(magic));
      asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(c) : "r"(x), "n"(0x00800080), "r"(magic));
      asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(c), "r"(neg_one), "r"(v));
      asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(*out[h]) : "r"(q), "r"(s2), "r"(b2));
    }
  } else {
    const uint32_t u = w ^ 0x80808080u, one = 0x3c003c00u, neg = 0xe480e480u;  // -1152.0
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t v = __byte_perm(u, 0x64646464u, h ? 0x4341 : 0x4240);
      uint32_t q;
      asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(v), "r"(one), "r"(neg));
      asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(*out[h]) : "r"(q), "r"(s2), "r"(b2));
    }
  }
}

// 8 E2M1 codes (MXFP4's; code j in bits 4j..4j+3: sign, 2-bit exponent, 1-bit mantissa) -> the
// weights of codes (0, 4), (1, 5), (2, 6), (3, 7) (columns (0, 1) .. (6, 7)) as 16-bit pairs, value * 2^(e - 127) with s2
// the word's multiplier in both halves. The code's exponent and mantissa bits placed at the
// bottom of the 16-bit type's exponent (bf16: bits 6-8; f16: bits 9-11) and its sign at bit 15
// read as the E2M1 value times 2^-126 (bf16) or 2^-14 (f16), exactly (exponent 0 and mantissa 1,
// E2M1's 0.5, is the type's subnormal of the same ratio), so one multiply by the multiplier
// 2^(e - 127 + 126) or 2^(e - 127 + 14) (io/grouped_codes.h grouped_param_e2m1) gives the weight,
// exact (a power of two) unless the product leaves the type's range. Two shifts, two logic ops
// and a multiply a pair.
template <bool kBF16>
__device__ __forceinline__ void e2m1x8_to_pairs(uint32_t w, uint32_t s2, uint32_t (&p)[4]) {
  constexpr int kPos = kBF16 ? 6 : 9;
  constexpr uint32_t kMag = 0x7u << kPos | 0x7u << (kPos + 16), kSign = 0x80008000u, kNegZero = 0x80008000u;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t mag = kPos >= 4 * j ? w << (kPos - 4 * j) : w >> (4 * j - kPos);  // code j's bits 0-2 at kPos
    const uint32_t sign = (w << (12 - 4 * j)) & kSign;                                // its bit 3 at bit 15
    uint32_t v;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(v) : "r"(mag), "n"(kMag), "r"(sign));  // (mag & kMag) | sign
    if constexpr (kBF16) asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(p[j]) : "r"(v), "r"(s2), "r"(kNegZero));
    else asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(p[j]) : "r"(v), "r"(s2), "r"(kNegZero));
  }
}

// One E2M1 code's bits as e2m1x8_to_pairs places them in the 16-bit type: the value times
// 2^-126 (bf16) or 2^-14 (f16), which the group's multiplier undoes (the scalar paths).
template <bool kBF16>
__device__ __forceinline__ uint16_t e2m1_bits(int code) {
  return uint16_t((code & 7) << (kBF16 ? 6 : 9) | (code & 8) << 12);
}

// The three kinds of 4-bit codes (IntWeight): affine s * code + b, a zero point s * (code - z),
// E2M1 values times a power of two (e2m1). A kernel's template parameter: a runtime choice costs
// the GEMV's larger variants spills.
enum class Int4Kind : int { Affine, ZeroPoint, E2M1 };
// Calls f with the weight's kind as a std::integral_constant (for a kernel's template argument).
template <class F>
decltype(auto) with_int4_kind(const IntWeight& w, F&& f) {
  if (w.zero_point) return f(std::integral_constant<Int4Kind, Int4Kind::ZeroPoint>{});
  if (w.e2m1) return f(std::integral_constant<Int4Kind, Int4Kind::E2M1>{});
  return f(std::integral_constant<Int4Kind, Int4Kind::Affine>{});
}

// A 4-bit group's word as the decode's pairs (int4_param_pairs; E2M1: s2 the multiplier).
template <bool kBF16, Int4Kind K>
__device__ __forceinline__ void int4_params(uint32_t p, uint32_t& a2, uint32_t& s2, uint32_t& b2) {
  if constexpr (K == Int4Kind::E2M1) {
    s2 = __byte_perm(p, 0, 0x1010);
    a2 = b2 = 0;
  } else {
    int4_param_pairs<kBF16>(p, K == Int4Kind::ZeroPoint, a2, s2, b2);
  }
}

// 8 4-bit codes of kind K as int4x8_to_pairs orders them.
template <bool kBF16, Int4Kind K>
__device__ __forceinline__ void int4x8_decode(uint32_t w, uint32_t a2, uint32_t s2, uint32_t b2, uint32_t (&p)[4]) {
  if constexpr (K == Int4Kind::E2M1) e2m1x8_to_pairs<kBF16>(w, s2, p);
  else int4x8_to_pairs<kBF16>(w, a2, s2, b2, p);
}

template <class V>
__device__ __forceinline__ float param_lo(uint32_t p) {
  return V::load(uint16_t(p & 0xffffu));
}
template <class V>
__device__ __forceinline__ float param_hi(uint32_t p) {
  return V::load(uint16_t(p >> 16));
}

}  // namespace
}  // namespace kvlm::cuda

// Kernels for products with ggml blocks (quant_matmul.h). Layout of this file:
//   1. types and the Int8 activations (x quantized once per call, per run of 32 values);
//   2. scalar kernels: every type unpacks a block into int8 codes plus, per 16 values, a scale
//      and an offset (w = a q + b: io/ggml_unpack.h); one scalar dot serves them all (the
//      fallback, and what the tests hold the AVX2 kernels to);
//   3. AVX2 kernels: every type unpacks in registers, one kernel over groups of 256 values takes
//      four weight rows against one x row or two against up to four x rows; AVX2
//      dequantization (the Exact path), bit-exact with io/ggml_dequant;
//   3b. AVX-512 VNNI kernels for 8 rows of x or more: tiles of 32 weight rows unpacked (by the
//      AVX2 unpacking) into vpdpbusd's layout, then every x row against the tile;
//   4. the Exact path (tiles of dequantized rows into OpenBLAS) and the split over threads.
//
// AVX2 code lives in functions marked KVLM_AVX2, AVX-512 code in KVLM_VNNI ones (the build has
// no -march); they run only after __builtin_cpu_supports says the CPU has those extensions.
#include "ops/cpu/quant_matmul.h"

#include <cblas.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/ggml_dequant.h"
#include "io/ggml_unpack.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"

#define KVLM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvlm::ops::cpu {

namespace {

using T = GGMLType;
constexpr int QK = 32, QK_K = 256;
constexpr int kMaxRows = kBlockInt8MaxRows;

// ---- 1. types and activations ------------------------------------------------------------

bool supported(uint32_t type) {
  switch (GGMLType(type)) {
    case T::Q4_0: case T::Q4_1: case T::Q5_0: case T::Q5_1: case T::Q8_0: case T::MXFP4:
    case T::Q2_K: case T::Q3_K: case T::Q4_K: case T::Q5_K: case T::Q6_K:
      return true;
    default:
      return false;
  }
}

// x quantized for the Int8 kernels: per row, runs of 32 codes with a scale d; per run and
// per half run, d times the sum of the codes, so that a weight offset b costs one product.
struct QActs {
  int m = 0;
  int64_t k = 0;
  std::vector<int8_t> qv;   // [m][k] from qbase, 64-byte aligned (32-byte loads never split a cache line)
  size_t qbase = 0;
  std::vector<float> dv;    // [m][k / 32]
  std::vector<float> s32v;  // [m][k / 32]
  std::vector<float> s16v;  // [m][k / 16]
  const int8_t* q(int r) const { return qv.data() + qbase + size_t(r) * size_t(k); }
  const float* d(int r) const { return dv.data() + size_t(r) * size_t(k / QK); }
  const float* s32(int r) const { return s32v.data() + size_t(r) * size_t(k / QK); }
  const float* s16(int r) const { return s16v.data() + size_t(r) * size_t(k / 16); }
};

// The header's rule: d = absmax / 127, q = round-half-even(x / d). A division, not a
// product with 127 / absmax, so the code is the correctly rounded quotient and a test can
// reproduce it with one line of scalar code; x is quantized once per call, so its cost is nil.
void quantize_run_scalar(const float* x, int8_t* q, float* d, float* s32, float* s16) {
  float amax = 0.0f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  int sum[2] = {0, 0};
  for (int i = 0; i < QK; ++i) {
    const int c = scale == 0.0f ? 0 : int(std::nearbyint(x[i] / scale));
    q[i] = int8_t(c);
    sum[i / 16] += c;
  }
  *d = scale;
  *s32 = scale * float(sum[0] + sum[1]);
  s16[0] = scale * float(sum[0]);
  s16[1] = scale * float(sum[1]);
}

KVLM_AVX2 int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

KVLM_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Same codes as quantize_run_scalar: the division is IEEE in both, and cvtps rounds half to
// even under the default MXCSR as nearbyint does under the default rounding mode.
KVLM_AVX2 void quantize_run_avx2(const float* x, int8_t* q, float* d, float* s32, float* s16) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float scale = _mm_cvtss_f32(m4) / 127.0f;
  *d = scale;
  if (scale == 0.0f) {
    std::memset(q, 0, QK);
    *s32 = s16[0] = s16[1] = 0.0f;
    return;
  }
  const __m256 sv = _mm256_set1_ps(scale);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], sv));
  const int sum0 = hsum_epi32(_mm256_add_epi32(c[0], c[1])), sum1 = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
  // packs interleave the 128-bit lanes: dwords come out as runs 0,2,4,6,1,3,5,7 of 4 codes.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *s32 = scale * float(sum0 + sum1);
  s16[0] = scale * float(sum0);
  s16[1] = scale * float(sum1);
}

void quantize_acts(const float* x, int m, int64_t k, QActs& a, bool avx2) {
  a.m = m;
  a.k = k;
  const size_t runs = size_t(m) * size_t(k / QK);
  a.qv.resize(size_t(m) * size_t(k) + 64);
  a.qbase = size_t(-reinterpret_cast<uintptr_t>(a.qv.data()) & 63);
  a.dv.resize(runs);
  a.s32v.resize(runs);
  a.s16v.resize(2 * runs);
  for (size_t i = 0; i < runs; ++i) {
    const float* xr = x + i * QK;
    int8_t* q = a.qv.data() + a.qbase + i * QK;
    if (avx2) quantize_run_avx2(xr, q, &a.dv[i], &a.s32v[i], &a.s16v[2 * i]);
    else quantize_run_scalar(xr, q, &a.dv[i], &a.s32v[i], &a.s16v[2 * i]);
  }
}

// ---- 2. scalar kernels -------------------------------------------------------------------

using Unpacked = GgmlUnpacked;

struct Layout {
  int block, bytes;
};

Layout layout(uint32_t type) {
  if (!supported(type)) throw Error("no block kernels for ggml " + ggml_type_name(type));
  const auto t = *ggml_type_traits(type);
  return {int(t.block), int(t.block_bytes)};
}

// Rows [j0, j1) of W against every row of x, in plain C++: unpack each block once and take it
// through all m rows.
using Int8Fn = void (*)(const BlockMatrix& w, int64_t j0, int64_t j1, const QActs& x, float* y, int64_t ldy);

template <GgmlUnpackFn kUnpack, int kBlock, int kBytes>
void int8_rows_scalar(const BlockMatrix& w, int64_t j0, int64_t j1, const QActs& x, float* y, int64_t ldy) {
  const int64_t nb = x.k / kBlock;
  Unpacked u;
  float acc[kMaxRows];
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* wr = w.data + size_t(j) * w.row_bytes;
    std::fill(acc, acc + x.m, 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      kUnpack(wr + size_t(b) * kBytes, u);
      for (int r = 0; r < x.m; ++r) {
        const int8_t* xq = x.q(r) + b * kBlock;
        const float* xd = x.d(r) + b * (kBlock / QK);
        const float* xs = x.s16(r) + b * (kBlock / 16);
        float s = 0.0f;
        for (int g = 0; g < kBlock / 16; ++g) {
          int dot = 0;
          for (int l = 0; l < 16; ++l) dot += int(u.q[16 * g + l]) * int(xq[16 * g + l]);
          s += xd[g / 2] * (u.a[g] * float(dot)) + u.b[g] * xs[g];
        }
        acc[r] += s;
      }
    }
    for (int r = 0; r < x.m; ++r) y[size_t(r) * size_t(ldy) + size_t(j)] = acc[r];
  }
}

Int8Fn scalar_int8_kernel(uint32_t type) {
  switch (GGMLType(type)) {
    case T::Q4_0: return int8_rows_scalar<ggml_unpack_q4_0, QK, 18>;
    case T::Q4_1: return int8_rows_scalar<ggml_unpack_q4_1, QK, 20>;
    case T::Q5_0: return int8_rows_scalar<ggml_unpack_q5_0, QK, 22>;
    case T::Q5_1: return int8_rows_scalar<ggml_unpack_q5_1, QK, 24>;
    case T::Q8_0: return int8_rows_scalar<ggml_unpack_q8_0, QK, 34>;
    case T::MXFP4: return int8_rows_scalar<ggml_unpack_mxfp4, QK, 17>;
    case T::Q2_K: return int8_rows_scalar<ggml_unpack_q2_k, QK_K, 84>;
    case T::Q3_K: return int8_rows_scalar<ggml_unpack_q3_k, QK_K, 110>;
    case T::Q4_K: return int8_rows_scalar<ggml_unpack_q4_k, QK_K, 144>;
    case T::Q5_K: return int8_rows_scalar<ggml_unpack_q5_k, QK_K, 176>;
    case T::Q6_K: return int8_rows_scalar<ggml_unpack_q6_k, QK_K, 210>;
    default: return nullptr;
  }
}

// ---- 3. AVX2 kernels ---------------------------------------------------------------------

KVLM_AVX2 inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

KVLM_AVX2 inline int load32(const uint8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

KVLM_AVX2 inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// Sums over each 4 bytes of q * x as 8 int32 lanes (lanes 0-3: bytes 0-15, lanes 4-7: bytes
// 16-31). q unsigned and at most 63, so maddubs cannot saturate (2 * 63 * 127 < 32767).
KVLM_AVX2 inline __m256i dot_u8s8(__m256i q, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
}

// Q8_0's codes are signed: maddubs takes |q| (|-128| reads as unsigned 128) and x with q's
// sign. 2 * 128 * 127 < 32767, and x's codes are never -128.
KVLM_AVX2 inline __m256i dot_s8s8(__m256i q, __m256i x) {
  return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
}

// Byte j = 0xFF where bit j of `bits` is set (Q5's fifth bits).
KVLM_AVX2 inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
}

// 16-bit shifts by a constant (bits of one byte move into the next; the callers' masks keep
// only bits that stayed in their byte). Negative S shifts right.
template <int S>
KVLM_AVX2 inline __m256i shift16(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi16(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
  else return v;
}

// MXFP4's scale 2^(e - 128) for 8 E8M0 bytes e (one per lane), exact for every e, 0 and 1 too
// (subnormal): the product of 2^(e / 2 - 64) and 2^(e - e / 2 - 64), both normal.
KVLM_AVX2 inline __m256 e8m0_half(__m256i e) {
  const __m256i h = _mm256_srli_epi32(e, 1), l = _mm256_sub_epi32(e, h), b = _mm256_set1_epi32(63);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, b), 23)),
                       _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(l, b), 23)));
}

// The weight types of the register kernels. Each works on groups of 256 values (8 blocks of
// 32, or one super-block) of kGroupBytes and gives:
//   scales(g, a, b): w = a q + b for the group's 8 runs of 32 (a[0], b[0]), or with kPer16 for
//                    its 16 groups of 16 (a[0], b[0]: groups 0-7; a[1], b[1]: groups 8-15);
//   codes<P>(g, q0, q1): the codes of runs 2P and 2P + 1, unsigned (kSigned: Q8_0's signed);
//   kBias, kMin: the dequantization's view, ggml's integer being code - kBias and ggml adding
//                b only where kMin (elsewhere b = -kBias a is this file's algebra).
// 32-value types also give the per-block forms for the blocks after the last whole group.
// MXFP4 (one E8M0 byte, then E2M1 codes as Q4_0's nibbles) looks its codes up as twice the
// E2M1 values, signed integers (-12..12) as Q8_0's codes, with scale 2^(e - 128): the weights
// exactly, 4.25 bits each.
template <GGMLType kT>
struct W32 {
  static constexpr bool kMx = kT == T::MXFP4;
  static constexpr int kBlock = QK;
  static constexpr int kBytes =
      kT == T::Q4_0 ? 18 : kT == T::Q4_1 ? 20 : kT == T::Q5_0 ? 22 : kT == T::Q5_1 ? 24 : kMx ? 17 : 34;
  static constexpr int kGroupBytes = 8 * kBytes;
  static constexpr bool kPer16 = false, kSigned = kT == T::Q8_0 || kMx, kOffset = !kSigned;
  static constexpr bool kMin = kT == T::Q4_1 || kT == T::Q5_1, kFive = kT == T::Q5_0 || kT == T::Q5_1;
  static constexpr int kBias = kT == T::Q4_0 ? 8 : kT == T::Q5_0 ? 16 : 0;

  KVLM_AVX2 static __m256i block_codes(const uint8_t* blk) {
    if constexpr (kT == T::Q8_0) {
      return load256(blk + 2);
    } else if constexpr (kMx) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1));
      const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
      const __m256i twice_e2m1 = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                                                  0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
      return _mm256_shuffle_epi8(twice_e2m1, nib);
    } else {
      const uint8_t* p = blk + (kMin ? 4 : 2) + (kFive ? 4 : 0);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
      if constexpr (kFive) {
        const uint32_t qh = uint32_t(load32(blk + (kMin ? 4 : 2)));
        q = _mm256_or_si256(q, _mm256_and_si256(bits_to_bytes(qh), _mm256_set1_epi8(0x10)));
      }
      return q;
    }
  }
  KVLM_AVX2 static void block_scales(const uint8_t* blk, float& a, float& b) {
    a = kMx ? std::ldexp(1.0f, int(blk[0]) - 128) : h2f(blk);
    b = kMin ? h2f(blk + 2) : -float(kBias) * a;
  }
  // d (and m) of 8 blocks: each block's first 4 bytes (d, then m or codes) into one vector.
  KVLM_AVX2 static void scales(const uint8_t* g, __m256* a, __m256* b) {
    if constexpr (kMx) {
      a[0] = e8m0_half(_mm256_setr_epi32(g[0], g[kBytes], g[2 * kBytes], g[3 * kBytes], g[4 * kBytes], g[5 * kBytes],
                                         g[6 * kBytes], g[7 * kBytes]));
      b[0] = _mm256_mul_ps(a[0], _mm256_set1_ps(-0.0f));
      return;
    }
    __m128i lo = _mm_cvtsi32_si128(load32(g)), hi = _mm_cvtsi32_si128(load32(g + 4 * kBytes));
    lo = _mm_insert_epi32(lo, load32(g + kBytes), 1);
    hi = _mm_insert_epi32(hi, load32(g + 5 * kBytes), 1);
    lo = _mm_insert_epi32(lo, load32(g + 2 * kBytes), 2);
    hi = _mm_insert_epi32(hi, load32(g + 6 * kBytes), 2);
    lo = _mm_insert_epi32(lo, load32(g + 3 * kBytes), 3);
    hi = _mm_insert_epi32(hi, load32(g + 7 * kBytes), 3);
    const __m128i low16 = _mm_set1_epi32(0xFFFF);
    a[0] = _mm256_cvtph_ps(_mm_packus_epi32(_mm_and_si128(lo, low16), _mm_and_si128(hi, low16)));
    if constexpr (kMin) b[0] = _mm256_cvtph_ps(_mm_packus_epi32(_mm_srli_epi32(lo, 16), _mm_srli_epi32(hi, 16)));
    else b[0] = _mm256_mul_ps(a[0], _mm256_set1_ps(-float(kBias)));
  }
  template <int P>
  KVLM_AVX2 static void codes(const uint8_t* g, __m256i& q0, __m256i& q1) {
    q0 = block_codes(g + 2 * P * kBytes);
    q1 = block_codes(g + (2 * P + 1) * kBytes);
  }
};

// Q4_K / Q5_K: 64 values per 32 bytes, run 2P in the low nibbles and 2P + 1 in the high ones;
// Q5_K's fifth bit of run j is bit j of the 32 high-bit bytes. The twelve scale bytes: bytes
// 0-3 hold the low 6 bits of scales 0-3 and, in their top 2 bits, bits 4-5 of scales 4-7
// (likewise bytes 4-7 for the mins); bytes 8-11 hold the low 4 bits of scales and mins 4-7.
template <bool kFive>
struct WK45 {
  static constexpr int kBlock = QK_K;
  static constexpr int kGroupBytes = kFive ? 176 : 144;
  static constexpr bool kPer16 = false, kSigned = false, kOffset = true, kMin = true;
  static constexpr int kBias = 0;

  KVLM_AVX2 static void scales(const uint8_t* g, __m256* a, __m256* b) {
    const uint32_t w0 = uint32_t(load32(g + 4)), w1 = uint32_t(load32(g + 8)), w2 = uint32_t(load32(g + 12));
    const uint32_t sc_lo = w0 & 0x3F3F3F3Fu, mn_lo = w1 & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u);
    const uint32_t mn_hi = ((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(int(sc_lo), int(sc_hi), 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32(int(mn_lo), int(mn_hi), 0, 0)));
    a[0] = _mm256_mul_ps(_mm256_set1_ps(h2f(g)), sc);
    b[0] = _mm256_mul_ps(_mm256_set1_ps(-h2f(g + 2)), mn);  // -(dmin m): the negation is exact
  }
  template <int P>
  KVLM_AVX2 static void codes(const uint8_t* g, __m256i& q0, __m256i& q1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i raw = load256(g + (kFive ? 48 : 16) + 32 * P);
    q0 = _mm256_and_si256(raw, m4);
    q1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    if constexpr (kFive) {
      const __m256i qh = load256(g + 16), b4 = _mm256_set1_epi8(0x10);
      q0 = _mm256_or_si256(q0, _mm256_and_si256(shift16<4 - 2 * P>(qh), b4));  // bit 2P to bit 4
      q1 = _mm256_or_si256(q1, _mm256_and_si256(shift16<3 - 2 * P>(qh), b4));  // bit 2P + 1 to bit 4
    }
  }
};

// Q2_K: run j of half n is bits 2 (j % 4) of the 32 code bytes of half n; scale byte g holds
// group g's scale (low nibble) and min (high nibble).
struct WQ2K {
  static constexpr int kBlock = QK_K;
  static constexpr int kGroupBytes = 84;
  static constexpr bool kPer16 = true, kSigned = false, kOffset = true, kMin = true;
  static constexpr int kBias = 0;

  KVLM_AVX2 static void scales(const uint8_t* g, __m256* a, __m256* b) {
    const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(s, m4), hi = _mm_and_si128(_mm_srli_epi16(s, 4), m4);
    const __m256 d = _mm256_set1_ps(h2f(g + 80)), nmin = _mm256_set1_ps(-h2f(g + 82));
    a[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    a[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    b[0] = _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    b[1] = _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
  }
  template <int P>
  KVLM_AVX2 static void codes(const uint8_t* g, __m256i& q0, __m256i& q1) {
    const __m256i raw = load256(g + 16 + 32 * (P / 2)), m3 = _mm256_set1_epi8(3);
    q0 = _mm256_and_si256(shift16<-4 * (P % 2)>(raw), m3);
    q1 = _mm256_and_si256(shift16<-4 * (P % 2) - 2>(raw), m3);
  }
};

// Q3_K: codes 0-7, the two low bits as Q2_K's plus 4 where bit 4 n + j of mask byte l is set
// (ggml's integer is code - 4); sixteen 6-bit scales biased by 32: scale g has its low nibble
// in byte g % 8 (nibble g / 8) and its top 2 bits in byte 8 + g % 4 (bits 2 (g / 4)).
struct WQ3K {
  static constexpr int kBlock = QK_K;
  static constexpr int kGroupBytes = 110;
  static constexpr bool kPer16 = true, kSigned = false, kOffset = true, kMin = false;
  static constexpr int kBias = 4;

  KVLM_AVX2 static void scales(const uint8_t* g, __m256* a, __m256* b) {
    // Low nibbles: bytes 0-7 for scales 0-7, their high nibbles for 8-15. Top bits: lane L of
    // byte 8-11's word shifted right by 2 L puts scale 4 L + j's two bits at byte j's bits 0-1.
    const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 96)), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(s8, m4), _mm_and_si128(_mm_srli_epi16(s8, 4), m4));
    const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(load32(g + 104)), _mm_setr_epi32(0, 2, 4, 6)),
                                      _mm_set1_epi8(3));
    const __m128i v = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(top, 4)), _mm_set1_epi8(32));
    const __m256 d = _mm256_set1_ps(h2f(g + 108)), n4 = _mm256_set1_ps(-4.0f);
    a[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    a[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
    b[0] = _mm256_mul_ps(a[0], n4);
    b[1] = _mm256_mul_ps(a[1], n4);
  }
  template <int P>
  KVLM_AVX2 static void codes(const uint8_t* g, __m256i& q0, __m256i& q1) {
    constexpr int n = P / 2, j = 2 * (P % 2);
    const __m256i raw = load256(g + 32 + 32 * n), hm = load256(g), m3 = _mm256_set1_epi8(3);
    const __m256i four = _mm256_set1_epi8(4), zero = _mm256_setzero_si256();
    const __m256i clear0 = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8(char(1 << (4 * n + j)))), zero);
    const __m256i clear1 = _mm256_cmpeq_epi8(_mm256_and_si256(hm, _mm256_set1_epi8(char(1 << (4 * n + j + 1)))), zero);
    q0 = _mm256_or_si256(_mm256_and_si256(shift16<-2 * j>(raw), m3), _mm256_andnot_si256(clear0, four));
    q1 = _mm256_or_si256(_mm256_and_si256(shift16<-2 * j - 2>(raw), m3), _mm256_andnot_si256(clear1, four));
  }
};

// Q6_K: per half n of 128 values, runs 0 and 1 are the low nibbles of ql bytes 64 n + 0..31 and
// 64 n + 32..63 with bits 0-1 and 2-3 of qh bytes 32 n + l; runs 2 and 3 the high nibbles with
// bits 4-5 and 6-7. Codes 0-63, ggml's integer code - 32, int8 scales per 16.
struct WQ6K {
  static constexpr int kBlock = QK_K;
  static constexpr int kGroupBytes = 210;
  static constexpr bool kPer16 = true, kSigned = false, kOffset = true, kMin = false;
  static constexpr int kBias = 32;

  KVLM_AVX2 static void scales(const uint8_t* g, __m256* a, __m256* b) {
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + 192));
    const __m256 d = _mm256_set1_ps(h2f(g + 208)), n32 = _mm256_set1_ps(-32.0f);
    a[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    a[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    b[0] = _mm256_mul_ps(a[0], n32);
    b[1] = _mm256_mul_ps(a[1], n32);
  }
  template <int P>
  KVLM_AVX2 static void codes(const uint8_t* g, __m256i& q0, __m256i& q1) {
    constexpr int n = P / 2;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i l0 = load256(g + 64 * n), l1 = load256(g + 64 * n + 32), h = load256(g + 128 + 32 * n);
    if constexpr (P % 2 == 0) {
      q0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(shift16<4>(h), m30));
      q1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(shift16<2>(h), m30));
    } else {
      q0 = _mm256_or_si256(_mm256_and_si256(shift16<-4>(l0), m4), _mm256_and_si256(h, m30));
      q1 = _mm256_or_si256(_mm256_and_si256(shift16<-4>(l1), m4), _mm256_and_si256(shift16<-2>(h), m30));
    }
  }
};

#define KVLM_THROUGH_MEMORY(v) __asm__("" : "+m"(v))

template <int... P, class F>
KVLM_AVX2 inline void for_pairs(std::integer_sequence<int, P...>, F&& f) {
  (f(std::integral_constant<int, P>{}), ...);
}

// The register kernel: NW weight rows, `stride` bytes apart, against x rows r0..r0+MR-1;
// out[w MR + r].
// Per group of 256 values, each (weight row, x row) gets its 8 factors a dx (per 16 values:
// 8 vectors of lanes) and its offsets b (d sum(q_x)) in one vector product each; then every
// unpacked pair of runs serves all MR rows. NW x MR chains of fmas (twice that when there
// are few) keep the fma latency hidden. Factors go through memory on purpose: kept in
// registers they crowd out the accumulators, and a broadcast from memory is a plain load.
template <class K, int NW, int MR>
KVLM_AVX2 void kernel(const uint8_t* w, size_t stride, const QActs& x, int r0, float* out) {
  constexpr int NA = NW * MR <= 4 ? 2 : 1;
  constexpr int FN = K::kPer16 ? 64 : 8;
  const int64_t ng = x.k / QK_K;
  const int8_t* xq = x.q(r0);
  const size_t xstride = size_t(x.k);
  __m256 acc[NA][NW][MR], off[NW][MR];
  alignas(32) float f[NW][MR][FN];
  for (int wi = 0; wi < NW; ++wi)
    for (int r = 0; r < MR; ++r) {
      for (int c = 0; c < NA; ++c) acc[c][wi][r] = _mm256_setzero_ps();
      off[wi][r] = _mm256_setzero_ps();
    }
  for (int64_t gi = 0; gi < ng; ++gi) {
    const uint8_t* g = w + gi * K::kGroupBytes;
    for (int wi = 0; wi < NW; ++wi) {
      __m256 a[2], b[2];
      K::scales(g + wi * stride, a, b);
      for (int r = 0; r < MR; ++r) {
        const __m256 dx = _mm256_loadu_ps(x.d(r0 + r) + 8 * gi);
        if constexpr (!K::kPer16) {
          _mm256_store_ps(f[wi][r], _mm256_mul_ps(a[0], dx));
          if constexpr (K::kOffset)
            off[wi][r] = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(x.s32(r0 + r) + 8 * gi), off[wi][r]);
        } else {
          // Group g of 16 values lies in x's run g / 2; run t's lanes 0-3 take group 2t, lanes
          // 4-7 group 2t + 1.
          const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
          const __m256 fa = _mm256_mul_ps(a[0], _mm256_permutevar8x32_ps(dx, lo));
          const __m256 fb = _mm256_mul_ps(a[1], _mm256_permutevar8x32_ps(dx, hi));
          for (int t = 0; t < 4; ++t) {
            const int e = 2 * t, o = 2 * t + 1;
            const __m256i idx = _mm256_setr_epi32(e, e, e, e, o, o, o, o);
            _mm256_store_ps(f[wi][r] + 8 * t, _mm256_permutevar8x32_ps(fa, idx));
            _mm256_store_ps(f[wi][r] + 32 + 8 * t, _mm256_permutevar8x32_ps(fb, idx));
          }
          const float* s16 = x.s16(r0 + r) + 16 * gi;
          off[wi][r] = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(s16), off[wi][r]);
          off[wi][r] = _mm256_fmadd_ps(b[1], _mm256_loadu_ps(s16 + 8), off[wi][r]);
        }
      }
    }
    KVLM_THROUGH_MEMORY(f);
    for_pairs(std::make_integer_sequence<int, 4>{}, [&](auto pc) KVLM_AVX2 {
      constexpr int P = decltype(pc)::value;
      for (int wi = 0; wi < NW; ++wi) {
        __m256i q0, q1;
        K::template codes<P>(g + wi * stride, q0, q1);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xp = xq + r * xstride + QK_K * gi + 64 * P;
          const __m256i x0 = load256(xp), x1 = load256(xp + 32);
          const __m256i p0 = K::kSigned ? dot_s8s8(q0, x0) : dot_u8s8(q0, x0);
          const __m256i p1 = K::kSigned ? dot_s8s8(q1, x1) : dot_u8s8(q1, x1);
          const __m256 f0 = K::kPer16 ? _mm256_load_ps(f[wi][r] + 16 * P) : _mm256_set1_ps(f[wi][r][2 * P]);
          const __m256 f1 = K::kPer16 ? _mm256_load_ps(f[wi][r] + 16 * P + 8) : _mm256_set1_ps(f[wi][r][2 * P + 1]);
          acc[0][wi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), f0, acc[0][wi][r]);
          acc[NA - 1][wi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), f1, acc[NA - 1][wi][r]);
        }
      }
    });
  }
  float tail[NW][MR] = {};
  if constexpr (K::kBlock == QK) {
    // Blocks after the last whole group, one at a time.
    for (int64_t i = ng * 8; i < x.k / QK; ++i)
      for (int wi = 0; wi < NW; ++wi) {
        const uint8_t* blk = w + wi * stride + i * K::kBytes;
        float a, b;
        K::block_scales(blk, a, b);
        const __m256i q = K::block_codes(blk);
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = load256(xq + r * xstride + QK * i);
          const __m256i p = K::kSigned ? dot_s8s8(q, xv) : dot_u8s8(q, xv);
          acc[0][wi][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(a * x.d(r0 + r)[i]), acc[0][wi][r]);
          if constexpr (K::kOffset) tail[wi][r] += b * x.s32(r0 + r)[i];
        }
      }
  }
  for (int wi = 0; wi < NW; ++wi)
    for (int r = 0; r < MR; ++r) {
      __m256 t = _mm256_add_ps(acc[0][wi][r], off[wi][r]);
      if constexpr (NA == 2) t = _mm256_add_ps(t, acc[NA - 1][wi][r]);
      out[wi * MR + r] = hsum(t) + tail[wi][r];
    }
}

template <class K, int NW>
KVLM_AVX2 void kernel_rows(const uint8_t* w, size_t stride, const QActs& x, int r0, int mr, float* out) {
  switch (mr) {
    case 1: kernel<K, NW, 1>(w, stride, x, r0, out); break;
    case 2: kernel<K, NW, 2>(w, stride, x, r0, out); break;
    case 3: kernel<K, NW, 3>(w, stride, x, r0, out); break;
    default: kernel<K, NW, 4>(w, stride, x, r0, out); break;
  }
}

// Rows [j0, j1) of W. One x row takes four weight rows per kernel call, more x rows two (and x
// rows in groups of up to four, the weight rows staying in L1 meanwhile). The rows of one call
// come from NW regions of [j0, j1), each walked in order: NW sequential streams. With adjacent
// rows instead, the hardware prefetchers saw one stream with jumps, and matrices not in cache
// with rows of 1 KB or more fell to a third of the bandwidth (5 GB/s instead of 16 on one core).
template <class K>
KVLM_AVX2 void int8_rows_avx2(const BlockMatrix& w, int64_t j0, int64_t j1, const QActs& x, float* y, int64_t ldy) {
  float out[16] = {};
  const size_t rb = w.row_bytes;
  const int nw = x.m == 1 ? 4 : 2;
  const int64_t per = (j1 - j0) / nw;  // rows per region
  for (int64_t t = 0; t < per; ++t) {
    const uint8_t* wr = w.data + size_t(j0 + t) * rb;
    for (int r = 0; r < x.m; r += 4) {
      const int mr = std::min(4, x.m - r);
      if (nw == 4) kernel<K, 4, 1>(wr, size_t(per) * rb, x, 0, out);
      else kernel_rows<K, 2>(wr, size_t(per) * rb, x, r, mr, out);
      for (int wi = 0; wi < nw; ++wi)
        for (int i = 0; i < mr; ++i) y[size_t(r + i) * size_t(ldy) + size_t(j0 + t + wi * per)] = out[wi * mr + i];
    }
  }
  for (int64_t j = j0 + nw * per; j < j1; ++j)
    for (int r = 0; r < x.m; r += 4) {
      const int mr = std::min(4, x.m - r);
      kernel_rows<K, 1>(w.data + size_t(j) * rb, rb, x, r, mr, out);
      for (int i = 0; i < mr; ++i) y[size_t(r + i) * size_t(ldy) + size_t(j)] = out[i];
    }
}

Int8Fn avx2_kernel(uint32_t type) {
  switch (GGMLType(type)) {
    case T::Q4_0: return int8_rows_avx2<W32<T::Q4_0>>;
    case T::Q4_1: return int8_rows_avx2<W32<T::Q4_1>>;
    case T::Q5_0: return int8_rows_avx2<W32<T::Q5_0>>;
    case T::Q5_1: return int8_rows_avx2<W32<T::Q5_1>>;
    case T::Q8_0: return int8_rows_avx2<W32<T::Q8_0>>;
    case T::MXFP4: return int8_rows_avx2<W32<T::MXFP4>>;
    case T::Q2_K: return int8_rows_avx2<WQ2K>;
    case T::Q3_K: return int8_rows_avx2<WQ3K>;
    case T::Q4_K: return int8_rows_avx2<WK45<false>>;
    case T::Q5_K: return int8_rows_avx2<WK45<true>>;
    case T::Q6_K: return int8_rows_avx2<WQ6K>;
    default: return nullptr;
  }
}

// -- AVX2 dequantization, bit-exact with io/ggml_dequant: every value is ggml's
// fl(fl(A Q) + B) with ggml's integer Q = code - kBias and factors A, B rounded as ggml rounds
// them: A = a (d, or d sc as one product), B = b where ggml adds a min (kMin), else -0 (x + -0
// == x for every x, +0 included). The product passes through an empty asm so that the compiler
// cannot fuse it with the sum (this file is not compiled with -ffp-contract=off, and a fused
// multiply-add rounds once where ggml rounds twice).
KVLM_AVX2 inline __m256 rounded(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

// 16 signed integers to out[0..15] as fl(fl(A Q) + B).
KVLM_AVX2 inline void store16(__m128i q, float a, float b, float* out) {
  const __m256 av = _mm256_set1_ps(a), bv = _mm256_set1_ps(b);
  const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
  const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
  _mm256_storeu_ps(out, _mm256_add_ps(rounded(_mm256_mul_ps(f0, av)), bv));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(rounded(_mm256_mul_ps(f1, av)), bv));
}

// One run of 32 codes with the factors of its two groups of 16.
template <class K>
KVLM_AVX2 inline void store_run(__m256i q, float a0, float a1, float b0, float b1, float* out) {
  const __m256i s = _mm256_sub_epi8(q, _mm256_set1_epi8(char(K::kBias)));
  store16(_mm256_castsi256_si128(s), a0, K::kMin ? b0 : -0.0f, out);
  store16(_mm256_extracti128_si256(s, 1), a1, K::kMin ? b1 : -0.0f, out + 16);
}

// A group's factors as arrays: a[e], b[e] per run e (8 runs of 32, or 16 of 16 for kPer16 types).
template <class K>
KVLM_AVX2 inline void group_factors(const uint8_t* group, float* a, float* b) {
  __m256 av[2], bv[2];
  K::scales(group, av, bv);
  _mm256_storeu_ps(a, av[0]);
  _mm256_storeu_ps(b, bv[0]);
  if constexpr (K::kPer16) {
    _mm256_storeu_ps(a + 8, av[1]);
    _mm256_storeu_ps(b + 8, bv[1]);
  }
}

template <class K>
KVLM_AVX2 void dequant_avx2(const uint8_t* row, int64_t k, float* out) {
  const int64_t ng = k / QK_K;
  for (int64_t gi = 0; gi < ng; ++gi, row += K::kGroupBytes) {
    alignas(32) float a[16], b[16];
    group_factors<K>(row, a, b);
    for_pairs(std::make_integer_sequence<int, 4>{}, [&](auto pc) KVLM_AVX2 {
      constexpr int P = decltype(pc)::value;
      __m256i q0, q1;
      K::template codes<P>(row, q0, q1);
      float* o = out + 256 * gi + 64 * P;
      if constexpr (K::kPer16) {
        store_run<K>(q0, a[4 * P], a[4 * P + 1], b[4 * P], b[4 * P + 1], o);
        store_run<K>(q1, a[4 * P + 2], a[4 * P + 3], b[4 * P + 2], b[4 * P + 3], o + 32);
      } else {
        store_run<K>(q0, a[2 * P], a[2 * P], b[2 * P], b[2 * P], o);
        store_run<K>(q1, a[2 * P + 1], a[2 * P + 1], b[2 * P + 1], b[2 * P + 1], o + 32);
      }
    });
  }
  if constexpr (K::kBlock == QK) {
    for (int64_t i = ng * 8; i < k / QK; ++i, row += K::kBytes) {
      float a, b;
      K::block_scales(row, a, b);
      store_run<K>(K::block_codes(row), a, a, b, b, out + QK * i);
    }
  }
}

// ---- 3b. AVX-512 VNNI kernels (8 rows of x or more) -------------------------------------

// For kVnniMinRows rows of x or more, where vpdpbusd (64 products u8 x s8 -> s32 per
// instruction) is available. W is taken in tiles of kTileRows rows: each tile is unpacked once
// into codes laid out for vpdpbusd, [k / 4][kTileRows][4] bytes (one 64-byte vector holds 4
// consecutive codes of 16 rows), and factors a, b [group][kTileRows]; then every row of x meets
// the tile, kVnniRows rows at a time: per group of 16 or 32 values (the type's scale groups),
// broadcasts of 4 codes of x against the tile's vectors sum q x_q per weight row in int32, and
// the group ends with a conversion, a product and an fma per (x row, 16 weight rows):
//     y += (a d) dot + b d sum(x_q)   (the second term only for types with a min).
// Signed codes (Q8_0's, MXFP4's) enter as q + 128 (b = -128 a). Where b = -bias a (types without a min),
// the integer sum starts at -bias sum(x_q) instead, so the group costs no offset product.
constexpr int kTileRows = 32;
constexpr int kVnniRows = 6;
// From this many rows of x the VNNI kernels beat the AVX2 ones (one Zen 4 core, m = 8: 1.1-2x
// with the blocks in cache, about even when they stream from memory; m = 6: the AVX2 kernels
// 1.1-1.6x ahead from memory; m = 12: VNNI 1.2-1.45x ahead from memory).
constexpr int kVnniMinRows = 8;
static_assert(kVnniMinRows <= kMaxRows + 1);

#define KVLM_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// The bias folded into the integer sums (0 for types with a min, which keep b).
template <class K>
constexpr int vnni_bias() {
  return K::kMin ? 0 : K::kSigned ? 128 : K::kBias;
}

template <class K>
constexpr int vnni_group() {
  return K::kPer16 ? 16 : QK;
}

// One tile of W unpacked: codes [k / 4][kTileRows] dwords, a and b [groups][kTileRows].
struct VnniTile {
  std::vector<int32_t> codes_v;
  std::vector<float> a_v, b_v;
  int32_t* codes = nullptr;  // the vectors' first 64-byte aligned elements
  float *a = nullptr, *b = nullptr;
};

template <class V>
auto* aligned64(V& v, size_t n) {
  v.resize(n + 16);
  return v.data() + (size_t(-reinterpret_cast<uintptr_t>(v.data())) & 63) / sizeof(v[0]);
}

// Eight runs of 32 codes (of rows jb .. jb + 7, run t) into their dword columns: an 8 x 8
// transpose of dwords, then vector i (dword i of the eight rows) to quad 8 t + i.
KVLM_VNNI inline void put_runs(__m256i* q, int32_t* codes, int64_t t, int jb) {
  __m256i u[8], v[8];
  for (int i = 0; i < 8; i += 2) {
    u[i] = _mm256_unpacklo_epi32(q[i], q[i + 1]);
    u[i + 1] = _mm256_unpackhi_epi32(q[i], q[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int h = 0; h < 2; ++h) {
      v[i + h] = _mm256_unpacklo_epi64(u[i + h], u[i + 2 + h]);
      v[i + 2 + h] = _mm256_unpackhi_epi64(u[i + h], u[i + 2 + h]);
    }
  // v[0..3]: dwords 0, 2, 1, 3 (lane 0) and 4, 6, 5, 7 (lane 1) of rows 0-3; v[4..7] of rows 4-7.
  const int order[4] = {0, 2, 1, 3};
  int32_t* c = codes + size_t(t) * 8 * kTileRows + jb;
  for (int i = 0; i < 4; ++i) {
    const __m256i lo = _mm256_permute2x128_si256(v[order[i]], v[4 + order[i]], 0x20);
    const __m256i hi = _mm256_permute2x128_si256(v[order[i]], v[4 + order[i]], 0x31);
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + i * kTileRows), lo);
    _mm256_store_si256(reinterpret_cast<__m256i*>(c + (4 + i) * kTileRows), hi);
  }
}

// Rows w0 .. w0 + nv - 1 (rb bytes apart) into the tile, eight at a time (rows past nv in the
// last eight repeat row nv - 1). The lanes of rows past those hold what the buffer held: their
// outputs are never stored.
template <class K>
KVLM_VNNI void vnni_pack(const uint8_t* w0, size_t rb, int nv, int64_t k, VnniTile& tile) {
  constexpr int GS = vnni_group<K>();
  const int64_t groups = k / GS;
  int32_t* codes = tile.codes = aligned64(tile.codes_v, size_t(k / 4) * kTileRows);
  float* a = tile.a = aligned64(tile.a_v, size_t(groups) * kTileRows);
  float* b = tile.b = aligned64(tile.b_v, size_t(groups) * kTileRows);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int jb = 0; jb < nv; jb += 8) {
    const uint8_t* row[8];
    for (int i = 0; i < 8; ++i) row[i] = w0 + size_t(std::min(jb + i, nv - 1)) * rb;
    if constexpr (K::kBlock == QK) {
      for (int64_t t = 0; t < k / QK; ++t) {
        __m256i q[8];
        for (int i = 0; i < 8; ++i) {
          const uint8_t* blk = row[i] + t * K::kBytes;
          K::block_scales(blk, a[t * kTileRows + jb + i], b[t * kTileRows + jb + i]);
          q[i] = K::block_codes(blk);
          if constexpr (K::kSigned) q[i] = _mm256_xor_si256(q[i], flip);
        }
        put_runs(q, codes, t, jb);
      }
    } else {
      constexpr int NG = QK_K / GS;
      for (int64_t gi = 0; gi < k / QK_K; ++gi) {
        for (int i = 0; i < 8; ++i) {
          alignas(32) float fa[16], fb[16];
          group_factors<K>(row[i] + gi * K::kGroupBytes, fa, fb);
          for (int e = 0; e < NG; ++e) {
            a[(gi * NG + e) * kTileRows + jb + i] = fa[e];
            b[(gi * NG + e) * kTileRows + jb + i] = fb[e];
          }
        }
        for_pairs(std::make_integer_sequence<int, 4>{}, [&](auto pc) KVLM_VNNI {
          constexpr int P = decltype(pc)::value;
          __m256i q0[8], q1[8];
          for (int i = 0; i < 8; ++i) K::template codes<P>(row[i] + gi * K::kGroupBytes, q0[i], q1[i]);
          put_runs(q0, codes, gi * 8 + 2 * P, jb);
          put_runs(q1, codes, gi * 8 + 2 * P + 1, jb);
        });
      }
    }
  }
}

// What the x side needs beyond QActs: per row and group, -bias sum(x_q) as the integer sums'
// start (types without a min).
void vnni_x_starts(const QActs& x, int gs, int bias, std::vector<int32_t>& out) {
  const int64_t groups = x.k / gs;
  out.resize(size_t(x.m) * size_t(groups));
  for (int r = 0; r < x.m; ++r) {
    const int8_t* q = x.q(r);
    for (int64_t g = 0; g < groups; ++g) {
      int s = 0;
      for (int i = 0; i < gs; ++i) s += q[g * gs + i];
      out[size_t(r) * size_t(groups) + size_t(g)] = -bias * s;
    }
  }
}

// int32 to fp32 (the masked form: GCC 12's _mm512_cvtepi32_ps warns of its undefined source).
KVLM_VNNI inline __m512 to_float(__m512i v) { return _mm512_maskz_cvtepi32_ps(__mmask16(0xFFFF), v); }

// x rows r0 .. r0 + MR - 1 against the tile; y columns j .. j + nv - 1.
template <class K, int MR>
KVLM_VNNI void vnni_rows(const VnniTile& tile, const QActs& x, const int32_t* starts, int r0, float* y, int64_t ldy,
                         int64_t j, int nv) {
  constexpr int GS = vnni_group<K>(), QPG = GS / 4;
  const int64_t k = x.k, groups = k / GS;
  const int32_t* codes = tile.codes;
  const float* a = tile.a;
  const float* b = tile.b;
  const int8_t* xq = x.q(r0);
  const size_t xs = size_t(k);
  const float* xd = x.d(r0);
  const size_t ds = size_t(k / QK);
  const float* xsum = GS == 16 ? x.s16(r0) : x.s32(r0);
  const size_t ss = size_t(groups);
  const int32_t* st = starts + size_t(r0) * size_t(groups);
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i s[MR][2];
    for (int r = 0; r < MR; ++r) {
      const __m512i init = K::kMin ? _mm512_setzero_si512() : _mm512_set1_epi32(st[size_t(r) * ss + size_t(g)]);
      s[r][0] = s[r][1] = init;
    }
    const int32_t* c = codes + size_t(g) * QPG * kTileRows;
    const int8_t* xg = xq + g * GS;
#pragma GCC unroll 8
    for (int qd = 0; qd < QPG; ++qd) {
      const __m512i w0 = _mm512_load_si512(c + qd * kTileRows), w1 = _mm512_load_si512(c + qd * kTileRows + 16);
      for (int r = 0; r < MR; ++r) {
        const __m512i xv = _mm512_set1_epi32(load32(reinterpret_cast<const uint8_t*>(xg + size_t(r) * xs + 4 * qd)));
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], w0, xv);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], w1, xv);
      }
    }
    const __m512 a0 = _mm512_load_ps(a + g * kTileRows), a1 = _mm512_load_ps(a + g * kTileRows + 16);
    const int64_t run = GS == 16 ? g / 2 : g;
    for (int r = 0; r < MR; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[size_t(r) * ds + size_t(run)]);
      acc[r][0] = _mm512_fmadd_ps(to_float(s[r][0]), _mm512_mul_ps(a0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(to_float(s[r][1]), _mm512_mul_ps(a1, dx), acc[r][1]);
    }
    if constexpr (K::kMin) {
      const __m512 b0 = _mm512_load_ps(b + g * kTileRows), b1 = _mm512_load_ps(b + g * kTileRows + 16);
      for (int r = 0; r < MR; ++r) {
        const __m512 sx = _mm512_set1_ps(xsum[size_t(r) * ss + size_t(g)]);
        acc[r][0] = _mm512_fmadd_ps(b0, sx, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(b1, sx, acc[r][1]);
      }
    }
  }
  const __mmask16 m0 = __mmask16(nv >= 16 ? 0xFFFF : (1u << nv) - 1);
  const __mmask16 m1 = __mmask16(nv >= 32 ? 0xFFFF : nv <= 16 ? 0 : (1u << (nv - 16)) - 1);
  for (int r = 0; r < MR; ++r) {
    float* yr = y + size_t(r0 + r) * size_t(ldy) + size_t(j);
    _mm512_mask_storeu_ps(yr, m0, acc[r][0]);
    _mm512_mask_storeu_ps(yr + 16, m1, acc[r][1]);
  }
}

// Rows [j0, j1) of W against every row of x.
template <class K>
KVLM_VNNI void int8_rows_vnni(const BlockMatrix& w, int64_t j0, int64_t j1, const QActs& x, const int32_t* starts,
                              float* y, int64_t ldy) {
  thread_local VnniTile tile;
  for (int64_t j = j0; j < j1; j += kTileRows) {
    const int nv = int(std::min<int64_t>(kTileRows, j1 - j));
    vnni_pack<K>(w.data + size_t(j) * w.row_bytes, w.row_bytes, nv, x.k, tile);
    int r = 0;
    for (; r + kVnniRows <= x.m; r += kVnniRows) vnni_rows<K, kVnniRows>(tile, x, starts, r, y, ldy, j, nv);
    static_assert(kVnniRows == 6, "the cases below take the rows left over");
    switch (x.m - r) {
      case 1: vnni_rows<K, 1>(tile, x, starts, r, y, ldy, j, nv); break;
      case 2: vnni_rows<K, 2>(tile, x, starts, r, y, ldy, j, nv); break;
      case 3: vnni_rows<K, 3>(tile, x, starts, r, y, ldy, j, nv); break;
      case 4: vnni_rows<K, 4>(tile, x, starts, r, y, ldy, j, nv); break;
      case 5: vnni_rows<K, 5>(tile, x, starts, r, y, ldy, j, nv); break;
      default: break;
    }
  }
}

using VnniFn = void (*)(const BlockMatrix& w, int64_t j0, int64_t j1, const QActs& x, const int32_t* starts, float* y,
                        int64_t ldy);

struct VnniKernel {
  VnniFn f = nullptr;
  int group = 0, bias = 0;
};

template <class K>
VnniKernel vnni_of() {
  return {int8_rows_vnni<K>, vnni_group<K>(), vnni_bias<K>()};
}

VnniKernel vnni_kernel(uint32_t type) {
  switch (GGMLType(type)) {
    case T::Q4_0: return vnni_of<W32<T::Q4_0>>();
    case T::Q4_1: return vnni_of<W32<T::Q4_1>>();
    case T::Q5_0: return vnni_of<W32<T::Q5_0>>();
    case T::Q5_1: return vnni_of<W32<T::Q5_1>>();
    case T::Q8_0: return vnni_of<W32<T::Q8_0>>();
    case T::MXFP4: return vnni_of<W32<T::MXFP4>>();
    case T::Q2_K: return vnni_of<WQ2K>();
    case T::Q3_K: return vnni_of<WQ3K>();
    case T::Q4_K: return vnni_of<WK45<false>>();
    case T::Q5_K: return vnni_of<WK45<true>>();
    case T::Q6_K: return vnni_of<WQ6K>();
    default: return {};
  }
}

// ---- 4. dispatch, the Exact path, threads ------------------------------------------------

using DequantFn = void (*)(const uint8_t* row, int64_t k, float* out);

DequantFn avx2_dequant(uint32_t type) {
  switch (GGMLType(type)) {
    case T::Q4_0: return dequant_avx2<W32<T::Q4_0>>;
    case T::Q4_1: return dequant_avx2<W32<T::Q4_1>>;
    case T::Q5_0: return dequant_avx2<W32<T::Q5_0>>;
    case T::Q5_1: return dequant_avx2<W32<T::Q5_1>>;
    case T::Q8_0: return dequant_avx2<W32<T::Q8_0>>;
    case T::MXFP4: return dequant_avx2<W32<T::MXFP4>>;
    case T::Q2_K: return dequant_avx2<WQ2K>;
    case T::Q3_K: return dequant_avx2<WQ3K>;
    case T::Q4_K: return dequant_avx2<WK45<false>>;
    case T::Q5_K: return dequant_avx2<WK45<true>>;
    case T::Q6_K: return dequant_avx2<WQ6K>;
    default: return nullptr;
  }
}

std::atomic<BlockKernels> g_kernels{BlockKernels::Fastest};

bool use_avx2() {
  static const bool cpu = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return cpu && g_kernels.load(std::memory_order_relaxed) != BlockKernels::Scalar;
}

bool use_vnni() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return cpu && use_avx2() && g_kernels.load(std::memory_order_relaxed) == BlockKernels::Fastest;
}

// As ops.cpp: OpenBLAS on one thread, kvlm's OpenMP team splits the work (set here too so
// this file does not depend on ops.cpp being linked).
const bool kBlasSingleThreaded = [] {
  openblas_set_num_threads(1);
  return true;
}();

void dequant_row(const BlockMatrix& w, const Layout& l, int64_t row, float* out, bool avx2) {
  const uint8_t* p = w.data + size_t(row) * w.row_bytes;
  if (avx2) {
    if (const DequantFn f = avx2_dequant(w.type)) {
      f(p, w.cols, out);
      return;
    }
  }
  dequantize_ggml(w.type, std::span(p, size_t(w.cols / l.block) * size_t(l.bytes)), std::span(out, size_t(w.cols)));
}

// Rows [j0, j1) of the Exact product: tiles of rows dequantized into a buffer of this thread,
// each tile one sgemm (sgemv for one row of x). A tile of about 512 KB stays in L2 while
// OpenBLAS packs it.
void exact_rows(const float* x, int m, int64_t k, const BlockMatrix& w, const Layout& l, int64_t j0, int64_t j1,
                float* y, int64_t ldy, bool avx2) {
  const int64_t tile = std::clamp<int64_t>((int64_t(1) << 17) / std::max<int64_t>(k, 1) / 16 * 16, 16, 128);
  thread_local std::vector<float> buf;
  if (buf.size() < size_t(tile) * size_t(k)) buf.resize(size_t(tile) * size_t(k));
  for (int64_t t0 = j0; t0 < j1; t0 += tile) {
    const int n = int(std::min(tile, j1 - t0));
    for (int i = 0; i < n; ++i) dequant_row(w, l, t0 + i, buf.data() + size_t(i) * size_t(k), avx2);
    if (m == 1)
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, int(k), 1.0f, buf.data(), int(k), x, 1, 0.0f, y + t0, 1);
    else
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, int(k), 1.0f, x, int(k), buf.data(), int(k), 0.0f,
                  y + t0, int(ldy));
  }
}

// Smallest products split over the team. Exact work is m x rows x k multiply-adds, as ops.cpp's
// linear counts them. Int8 work is counted in bytes of blocks (~17 GB/s on one core), and the
// split pays only when the product outlasts waking the team. With the team spinning between
// products (OMP_WAIT_POLICY=active), 256 KB (~15 us): decode of SmolLM2-135M Q4_1 176 tok/s and
// Gemma 3 270M 99 (64 KB: 132 / 99.5; 1 MB: 145 / 83). With kvlm's default passive team each
// split costs a futex wake-up, ~40 us here, paid ~240 times per SmolLM2 token: 1 MB, so that
// only the LM head and large models' matrices split (SmolLM2 151 tok/s; 64 KB: 62).
constexpr double kExactMinWork = double(1 << 18);
const double kInt8MinWork = [] {
  const char* p = std::getenv("OMP_WAIT_POLICY");  // what libgomp read as it loaded (main sets it)
  return p && (p[0] == 'p' || p[0] == 'P') ? double(1 << 20) : double(1 << 18);
}();

// VNNI work is counted in multiply-adds as Exact's, done at ~130 G/s a core: 1M (~8 us) with
// a spinning team, 8M (~60 us) with a passive one.
const double kVnniMinWork = kInt8MinWork > double(1 << 18) ? double(1 << 23) : double(1 << 20);

// Runs f(j0, j1) over W's rows: on this thread when the product is small (below min_work) or
// a team already runs, else in one contiguous part per thread, boundaries on multiples of 16
// rows (whole cache lines of y).
template <class F>
void split_rows(int64_t rows, double work, double min_work, F&& f) {
  int teams = 1;
  if (!omp_in_parallel() && work >= min_work)
    teams = int(std::clamp<int64_t>(std::min<int64_t>(omp_get_max_threads(), rows / 16), 1, 64));
  if (teams == 1) {
    f(int64_t(0), rows);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(teams)
  for (int t = 0; t < teams; ++t) {
    const int64_t j0 = t == 0 ? 0 : (rows * t / teams) & ~int64_t(15);
    const int64_t j1 = t == teams - 1 ? rows : (rows * (t + 1) / teams) & ~int64_t(15);
    if (j1 > j0) f(j0, j1);
  }
}

}  // namespace

bool block_kernels_support(uint32_t type) { return supported(type); }

uint32_t held_block_type(uint32_t type) {
  if (supported(type)) return type;
  if (is_grouped_rows_type(type)) return uint32_t(GGMLType::Q4_1);
  return 0;
}

size_t block_row_bytes(uint32_t type, int64_t cols) {
  const Layout l = layout(type);
  if (cols < 0 || cols % l.block != 0)
    throw Error("ggml " + ggml_type_name(type) + " rows of " + std::to_string(cols) +
                " values: not a multiple of its block of " + std::to_string(l.block));
  return size_t(cols / l.block) * size_t(l.bytes);
}

void block_linear(const float* x, int m, int64_t k, const BlockMatrix& w, float* y, int64_t ldy, BlockMath math) {
  const Layout l = layout(w.type);
  KVLM_CHECK(k == w.cols && k % l.block == 0 && w.row_bytes >= size_t(k / l.block) * size_t(l.bytes) &&
                 (m <= 1 || ldy >= w.rows) && m >= 0,
             "block_linear: shapes disagree");
  (void)kBlasSingleThreaded;
  if (m == 0 || w.rows == 0) return;
  const bool avx2 = use_avx2();
  if (k == 0) {
    for (int r = 0; r < m; ++r) std::fill_n(y + size_t(r) * size_t(ldy), w.rows, 0.0f);
    return;
  }
  if (math == BlockMath::Int8 && m >= kVnniMinRows && use_vnni()) {
    thread_local QActs acts;
    thread_local std::vector<int32_t> starts;
    quantize_acts(x, m, k, acts, avx2);
    const VnniKernel kern = vnni_kernel(w.type);
    vnni_x_starts(acts, kern.group, kern.bias, starts);
    const QActs& a = acts;
    const int32_t* st = starts.data();
    const double work = double(m) * double(w.rows) * double(k);
    split_rows(w.rows, work, kVnniMinWork, [&](int64_t j0, int64_t j1) { kern.f(w, j0, j1, a, st, y, ldy); });
    return;
  }
  if (math == BlockMath::Int8 && m <= kMaxRows) {
    thread_local QActs acts;
    quantize_acts(x, m, k, acts, avx2);
    const Int8Fn f = avx2 ? avx2_kernel(w.type) : scalar_int8_kernel(w.type);
    // Work in bytes of blocks: one x row streams them at ~18 GB/s a core; each more row adds
    // about 2/3 of that in integer work on blocks already in L1 (16 rows: ~1.7 GB/s).
    const double work = double(w.rows) * double(w.row_bytes) * (1.0 + 0.65 * (m - 1));
    const QActs& a = acts;
    split_rows(w.rows, work, kInt8MinWork, [&](int64_t j0, int64_t j1) { f(w, j0, j1, a, y, ldy); });
    return;
  }
  const double work = double(m) * double(w.rows) * double(k);
  split_rows(w.rows, work, kExactMinWork,
             [&](int64_t j0, int64_t j1) { exact_rows(x, m, k, w, l, j0, j1, y, ldy, avx2); });
}

void block_dequantize_row(const BlockMatrix& w, int64_t row, float* out) {
  const Layout l = layout(w.type);
  KVLM_CHECK(row >= 0 && row < w.rows && w.cols % l.block == 0, "block_dequantize_row: bad row or shape");
  dequant_row(w, l, row, out, use_avx2());
}

int block_int8_max_rows() { return use_vnni() ? std::numeric_limits<int>::max() : kBlockInt8MaxRows; }

void set_block_kernels(BlockKernels kernels) { g_kernels.store(kernels, std::memory_order_relaxed); }

void set_block_kernels_scalar(bool scalar) { set_block_kernels(scalar ? BlockKernels::Scalar : BlockKernels::Fastest); }

}  // namespace kvlm::ops::cpu

#include "io/ggml_unpack.h"

#include <cmath>
#include <cstring>

#include "io/ggml_dequant.h"
#include "io/gguf.h"

namespace kvlm {

namespace {

constexpr int QK = 32, QK_K = 256;
constexpr auto half = ggml_half;

template <bool kWithMin, bool kFive>
void unpack_q45(const uint8_t* blk, GgmlUnpacked& u) {
  const float d = half(blk);
  const uint8_t* p = blk + (kWithMin ? 4 : 2);
  uint32_t qh = 0;
  if (kFive) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  for (int j = 0; j < 16; ++j) {
    u.q[j] = int8_t((p[j] & 0x0F) | (kFive ? ((qh >> j) & 1) << 4 : 0));
    u.q[j + 16] = int8_t((p[j] >> 4) | (kFive ? ((qh >> (j + 16)) & 1) << 4 : 0));
  }
  u.a[0] = u.a[1] = d;
  u.b[0] = u.b[1] = kWithMin ? half(blk + 2) : (kFive ? -16.0f : -8.0f) * d;
}

void unpack_q8_0(const uint8_t* blk, GgmlUnpacked& u) {
  std::memcpy(u.q, blk + 2, QK);
  u.a[0] = u.a[1] = half(blk);
  u.b[0] = u.b[1] = 0.0f;
}

// Q2_K: element e is bits 2 ((e % 128) / 32) of byte 32 (e / 128) + e % 32; scale byte e / 16
// holds the scale in its low nibble and the min in its high one.
void unpack_q2_k(const uint8_t* blk, GgmlUnpacked& u) {
  const uint8_t* qs = blk + 16;
  const float d = half(blk + 80), dmin = half(blk + 82);
  for (int e = 0; e < QK_K; ++e) u.q[e] = int8_t((qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3);
  for (int g = 0; g < 16; ++g) {
    u.a[g] = d * float(blk[g] & 0x0F);
    u.b[g] = -(dmin * float(blk[g] >> 4));
  }
}

// Q3_K: code = 2 low bits (as Q2_K) + 4 when the mask bit 4 (e / 128) + (e % 128) / 32 of
// byte e % 32 is set, value (code - 4) scale; sixteen 6-bit scales biased by 32.
void unpack_q3_k(const uint8_t* blk, GgmlUnpacked& u) {
  const uint8_t* hm = blk;
  const uint8_t* qs = blk + 32;
  const uint8_t* s = blk + 96;
  const float d = half(blk + 108);
  for (int e = 0; e < QK_K; ++e) {
    const int n = e / 128, j = (e % 128) / 32, l = e % 32;
    u.q[e] = int8_t(((qs[32 * n + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2));
  }
  for (int g = 0; g < 16; ++g) {
    const int lo = (s[g % 8] >> (4 * (g / 8))) & 0x0F, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    u.a[g] = d * float((lo | hi << 4) - 32);
    u.b[g] = -4.0f * u.a[g];
  }
}

// Q4_K / Q5_K: 64 values per 32 bytes, sub-block 2c in the low nibbles and 2c + 1 in the
// high ones; Q5_K's fifth bit of element e is bit e / 32 of high-bit byte e % 32.
template <bool kFive>
void unpack_q45_k(const uint8_t* blk, GgmlUnpacked& u) {
  const float d = half(blk), dmin = half(blk + 2);
  const uint8_t* qh = blk + 16;
  const uint8_t* ql = blk + (kFive ? 48 : 16);
  for (int e = 0; e < QK_K; ++e) {
    const int c = e / 64, hi = (e % 64) / 32, l = e % 32;
    const int nib = hi ? ql[32 * c + l] >> 4 : ql[32 * c + l] & 0x0F;
    u.q[e] = int8_t(nib | (kFive ? ((qh[l] >> (e / 32)) & 1) << 4 : 0));
  }
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    ggml_k4_scale_min(blk + 4, j, sc, mn);
    u.a[2 * j] = u.a[2 * j + 1] = d * float(sc);
    u.b[2 * j] = u.b[2 * j + 1] = -(dmin * float(mn));
  }
}

// Q6_K: per 128 values n, quarter qd takes the low (qd < 2) or high nibble of ql byte
// 64 n + 32 (qd % 2) + l and bits 2 qd of qh byte 32 n + l; value (code - 32) d sc[e / 16].
void unpack_q6_k(const uint8_t* blk, GgmlUnpacked& u) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = half(blk + 208);
  for (int e = 0; e < QK_K; ++e) {
    const int n = e / 128, qd = (e % 128) / 32, l = e % 32;
    const uint8_t lb = ql[64 * n + 32 * (qd & 1) + l];
    u.q[e] = int8_t((qd >= 2 ? lb >> 4 : lb & 0x0F) | (((qh[32 * n + l] >> (2 * qd)) & 3) << 4));
  }
  for (int g = 0; g < 16; ++g) {
    u.a[g] = d * float(sc[g]);
    u.b[g] = -32.0f * u.a[g];
  }
}

}  // namespace

void ggml_unpack_q4_0(const uint8_t* b, GgmlUnpacked& u) { unpack_q45<false, false>(b, u); }
void ggml_unpack_q4_1(const uint8_t* b, GgmlUnpacked& u) { unpack_q45<true, false>(b, u); }
void ggml_unpack_q5_0(const uint8_t* b, GgmlUnpacked& u) { unpack_q45<false, true>(b, u); }
void ggml_unpack_q5_1(const uint8_t* b, GgmlUnpacked& u) { unpack_q45<true, true>(b, u); }
void ggml_unpack_q8_0(const uint8_t* b, GgmlUnpacked& u) { unpack_q8_0(b, u); }
void ggml_unpack_q2_k(const uint8_t* b, GgmlUnpacked& u) { unpack_q2_k(b, u); }
void ggml_unpack_q3_k(const uint8_t* b, GgmlUnpacked& u) { unpack_q3_k(b, u); }
void ggml_unpack_q4_k(const uint8_t* b, GgmlUnpacked& u) { unpack_q45_k<false>(b, u); }
void ggml_unpack_q5_k(const uint8_t* b, GgmlUnpacked& u) { unpack_q45_k<true>(b, u); }
void ggml_unpack_q6_k(const uint8_t* b, GgmlUnpacked& u) { unpack_q6_k(b, u); }
void ggml_unpack_mxfp4(const uint8_t* b, GgmlUnpacked& u) {
  for (int j = 0; j < 16; ++j) {
    u.q[j] = int8_t(2.0f * kE2M1[b[1 + j] & 0x0F]);
    u.q[j + 16] = int8_t(2.0f * kE2M1[b[1 + j] >> 4]);
  }
  u.a[0] = u.a[1] = std::ldexp(1.0f, int(b[0]) - 128);
  u.b[0] = u.b[1] = 0.0f;
}

GgmlUnpackFn ggml_unpacker(uint32_t type) {
  switch (GGMLType(type)) {
    case GGMLType::Q4_0: return ggml_unpack_q4_0;
    case GGMLType::Q4_1: return ggml_unpack_q4_1;
    case GGMLType::Q5_0: return ggml_unpack_q5_0;
    case GGMLType::Q5_1: return ggml_unpack_q5_1;
    case GGMLType::Q8_0: return ggml_unpack_q8_0;
    case GGMLType::Q2_K: return ggml_unpack_q2_k;
    case GGMLType::Q3_K: return ggml_unpack_q3_k;
    case GGMLType::Q4_K: return ggml_unpack_q4_k;
    case GGMLType::Q5_K: return ggml_unpack_q5_k;
    case GGMLType::Q6_K: return ggml_unpack_q6_k;
    case GGMLType::MXFP4: return ggml_unpack_mxfp4;
    default: return nullptr;
  }
}

}  // namespace kvlm

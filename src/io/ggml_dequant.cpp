// Compiled with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would round once
// where ggml rounds twice.
#include "io/ggml_dequant.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/numeric.h"
#include "io/gguf.h"

namespace kvlm {

void ggml_k4_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

float ggml_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return num::f16_to_f32(h);
}

namespace {

constexpr int QK = 32, QK_K = 256;

float half(const uint8_t* p) { return ggml_half(p); }

void q4_0(const uint8_t* b, float* y) {
  const float d = half(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = float(int(qs[j] & 0x0F) - 8) * d;
    y[j + QK / 2] = float(int(qs[j] >> 4) - 8) * d;
  }
}

void q4_1(const uint8_t* b, float* y) {
  const float d = half(b), m = half(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = float(qs[j] & 0x0F) * d + m;
    y[j + QK / 2] = float(qs[j] >> 4) * d + m;
  }
}

// Q5_0 / Q5_1: bit j of the 32 high bits belongs to element j.
void q5(const uint8_t* b, float* y, bool with_min) {
  const float d = half(b), m = with_min ? half(b + 2) : 0.0f;
  const uint8_t* p = b + (with_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* qs = p + 4;
  for (int j = 0; j < QK / 2; ++j) {
    const int h0 = int((qh >> j) & 1) << 4, h1 = int((qh >> (j + QK / 2)) & 1) << 4;
    const int x0 = int(qs[j] & 0x0F) | h0, x1 = int(qs[j] >> 4) | h1;
    if (with_min) {
      y[j] = float(x0) * d + m;
      y[j + QK / 2] = float(x1) * d + m;
    } else {
      y[j] = float(x0 - 16) * d;
      y[j + QK / 2] = float(x1 - 16) * d;
    }
  }
}

void q8(const uint8_t* qs, float d, float* y, int n) {
  for (int j = 0; j < n; ++j) y[j] = float(int8_t(qs[j])) * d;
}

void q2_k(const uint8_t* b, float* y) {
  const uint8_t* scales = b;
  const uint8_t* q = b + 16;
  const float d = half(b + 80), dmin = half(b + 82);
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half_ = 0; half_ < 2; ++half_) {
        const uint8_t sc = scales[is++];
        const float dl = d * float(sc & 0x0F), ml = dmin * float(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * float((q[l + 16 * half_] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}

void q3_k(const uint8_t* b, float* y) {
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const uint8_t* s = b + 96;
  const float d = half(b + 108);
  // Sixteen 6-bit scales: low 4 bits in bytes 0-7 (scale i: byte i % 8, nibble i / 8), high
  // 2 bits in bytes 8-11 (scale i: byte 8 + i % 4, bits 2 (i / 4)).
  int sc[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = (s[i % 8] >> (4 * (i / 8))) & 0x0F, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 0x03;
    sc[i] = (lo | hi << 4) - 32;
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half_ = 0; half_ < 2; ++half_) {
        const float dl = d * float(sc[is++]);
        for (int l = 0; l < 16; ++l) {
          const int k = l + 16 * half_;
          *y++ = dl * float(int((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4));
        }
      }
      m = uint8_t(m << 1);
    }
    q += 32;
  }
}


void q45_k(const uint8_t* b, float* y, bool five) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = five ? b + 48 : b + 16;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2) {
    int sc1, m1, sc2, m2;
    ggml_k4_scale_min(scales, is, sc1, m1);
    ggml_k4_scale_min(scales, is + 1, sc2, m2);
    const float d1 = d * float(sc1), dm1 = dmin * float(m1), d2 = d * float(sc2), dm2 = dmin * float(m2);
    const int bit = j / 32;  // Q5_K: high bits of this pair of sub-blocks are bits `bit` and `bit + 1`
    for (int l = 0; l < 32; ++l) {
      const int h = five ? ((qh[l] >> bit) & 1) << 4 : 0;
      *y++ = d1 * float((ql[l] & 0x0F) | h) - dm1;
    }
    for (int l = 0; l < 32; ++l) {
      const int h = five ? ((qh[l] >> (bit + 1)) & 1) << 4 : 0;
      *y++ = d2 * float((ql[l] >> 4) | h) - dm2;
    }
    ql += 32;
  }
}

void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < QK_K; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * float(sc[is]) * float(q1);
      y[l + 32] = d * float(sc[is + 2]) * float(q2);
      y[l + 64] = d * float(sc[is + 4]) * float(q3);
      y[l + 96] = d * float(sc[is + 6]) * float(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// E2M1 values times an E8M0 exponent 2^(e - 127), exact in fp32 for every e.
void mxfp4(const uint8_t* b, float* y) {
  const float d = std::ldexp(1.0f, int(b[0]) - 127);
  const uint8_t* qs = b + 1;
  for (int j = 0; j < QK / 2; ++j) {
    y[j] = kE2M1[qs[j] & 0x0F] * d + 0.0f;  // + 0: -0 becomes +0, as ggml's integer 0 gives
    y[j + QK / 2] = kE2M1[qs[j] >> 4] * d + 0.0f;
  }
}

}  // namespace

void dequantize_ggml(uint32_t type, std::span<const uint8_t> src, std::span<float> dst) {
  const auto t = ggml_type_traits(type);
  if (!t) throw Error("cannot dequantize ggml " + ggml_type_name(type) + ": kvlm does not read that type");
  const int64_t n = int64_t(dst.size());
  if (n % t->block != 0 || uint64_t(n / t->block) * uint64_t(t->block_bytes) != src.size())
    throw Error("dequantize " + std::string(t->name) + ": " + std::to_string(src.size()) + " bytes for " +
                std::to_string(n) + " elements");
  const uint8_t* b = src.data();
  float* y = dst.data();
  const int64_t blocks = n / t->block;
  for (int64_t i = 0; i < blocks; ++i, b += t->block_bytes, y += t->block) {
    switch (GGMLType(type)) {
      case GGMLType::F32: std::memcpy(y, b, 4); break;
      case GGMLType::F16: *y = half(b); break;
      case GGMLType::BF16: {
        uint16_t h;
        std::memcpy(&h, b, 2);
        *y = num::bf16_to_f32(h);
        break;
      }
      case GGMLType::Q4_0: q4_0(b, y); break;
      case GGMLType::Q4_1: q4_1(b, y); break;
      case GGMLType::Q5_0: q5(b, y, false); break;
      case GGMLType::Q5_1: q5(b, y, true); break;
      case GGMLType::Q8_0: q8(b + 2, half(b), y, QK); break;
      case GGMLType::Q2_K: q2_k(b, y); break;
      case GGMLType::Q3_K: q3_k(b, y); break;
      case GGMLType::Q4_K: q45_k(b, y, false); break;
      case GGMLType::Q5_K: q45_k(b, y, true); break;
      case GGMLType::Q6_K: q6_k(b, y); break;
      case GGMLType::MXFP4: mxfp4(b, y); break;
    }
  }
}

}  // namespace kvlm

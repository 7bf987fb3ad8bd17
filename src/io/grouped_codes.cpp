#include "io/grouped_codes.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/ggml_dequant.h"
#include "io/gguf.h"

namespace kvlm {

namespace {

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return num::f16_to_f32(h);
}

// One block's codes (one int per value) and its groups' scales and offsets, in ggml's order
// of values (io/ggml_dequant.cpp states the same formulas as values).
struct BlockOut {
  int* code;
  float* s;
  float* b;
};

void q4_0(const uint8_t* p, BlockOut o) {
  const float d = half_at(p);
  for (int j = 0; j < 16; ++j) o.code[j] = p[2 + j] & 0x0F, o.code[j + 16] = p[2 + j] >> 4;
  o.s[0] = d, o.b[0] = -8.0f * d;
}

void q4_1(const uint8_t* p, BlockOut o) {
  for (int j = 0; j < 16; ++j) o.code[j] = p[4 + j] & 0x0F, o.code[j + 16] = p[4 + j] >> 4;
  o.s[0] = half_at(p), o.b[0] = half_at(p + 2);
}

void q5(const uint8_t* p, BlockOut o, bool with_min) {
  const uint8_t* h = p + (with_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, h, 4);
  const uint8_t* qs = h + 4;
  const int bias = with_min ? 0 : 16;
  for (int j = 0; j < 16; ++j) {
    o.code[j] = (int(qs[j] & 0x0F) | int((qh >> j) & 1) << 4) - bias;
    o.code[j + 16] = (int(qs[j] >> 4) | int((qh >> (j + 16)) & 1) << 4) - bias;
  }
  o.s[0] = half_at(p), o.b[0] = with_min ? half_at(p + 2) : 0.0f;
}

void q8_0(const uint8_t* p, BlockOut o) {
  for (int j = 0; j < 32; ++j) o.code[j] = int8_t(p[2 + j]);
  o.s[0] = half_at(p), o.b[0] = 0.0f;
}

void q2_k(const uint8_t* p, BlockOut o) {
  const uint8_t* q = p + 16;
  const float d = half_at(p + 80), dmin = half_at(p + 82);
  int is = 0, y = 0;
  for (int n = 0; n < 256; n += 128, q += 32)
    for (int shift = 0; shift < 8; shift += 2)
      for (int h = 0; h < 2; ++h, ++is) {
        o.s[is] = d * float(p[is] & 0x0F), o.b[is] = -(dmin * float(p[is] >> 4));
        for (int l = 0; l < 16; ++l) o.code[y++] = (q[l + 16 * h] >> shift) & 3;
      }
}

void q3_k(const uint8_t* p, BlockOut o) {
  const uint8_t* hm = p;
  const uint8_t* q = p + 32;
  const uint8_t* s = p + 96;
  const float d = half_at(p + 108);
  int is = 0, y = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128, q += 32)
    for (int shift = 0; shift < 8; shift += 2, m = uint8_t(m << 1))
      for (int h = 0; h < 2; ++h, ++is) {
        const int lo = (s[is % 8] >> (4 * (is / 8))) & 0x0F, hi = (s[8 + is % 4] >> (2 * (is / 4))) & 0x03;
        o.s[is] = d * float((lo | hi << 4) - 32), o.b[is] = 0.0f;
        for (int l = 0; l < 16; ++l) {
          const int k = l + 16 * h;
          o.code[y++] = int((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4);
        }
      }
}

void q45_k(const uint8_t* p, BlockOut o, bool five) {
  const float d = half_at(p), dmin = half_at(p + 2);
  const uint8_t* qh = p + 16;
  const uint8_t* ql = five ? p + 48 : p + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
    for (int half = 0; half < 2; ++half) {
      int sc, mn;
      ggml_k4_scale_min(p + 4, is + half, sc, mn);
      o.s[is + half] = d * float(sc), o.b[is + half] = -(dmin * float(mn));
      const int bit = j / 32 + half;
      for (int l = 0; l < 32; ++l) {
        const int lo = half ? ql[l] >> 4 : ql[l] & 0x0F;
        o.code[j + 32 * half + l] = lo | (five ? ((qh[l] >> bit) & 1) << 4 : 0);
      }
    }
  }
}

void q6_k(const uint8_t* p, BlockOut o) {
  const uint8_t* ql = p;
  const uint8_t* qh = p + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(p + 192);
  const float d = half_at(p + 208);
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      o.code[n + l] = int((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) - 32;
      o.code[n + l + 32] = int((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      o.code[n + l + 64] = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      o.code[n + l + 96] = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
    }
    for (int g = 0; g < 8; ++g) o.s[n / 16 + g] = d * float(sc[g]), o.b[n / 16 + g] = 0.0f;
  }
}

}  // namespace

std::optional<GroupedLayout> grouped_layout_of_ggml(uint32_t type) {
  switch (GGMLType(type)) {
    case GGMLType::Q4_0:
    case GGMLType::Q4_1:
    case GGMLType::Q4_K: return GroupedLayout{4, 32};
    case GGMLType::Q5_0:
    case GGMLType::Q5_1:
    case GGMLType::Q5_K:
    case GGMLType::Q8_0: return GroupedLayout{8, 32};
    case GGMLType::Q2_K:
    case GGMLType::Q3_K:
    case GGMLType::Q6_K: return GroupedLayout{8, 16};
    default: return std::nullopt;
  }
}

void ggml_row_to_grouped(uint32_t type, const uint8_t* blocks, int64_t cols, uint8_t* codes, float* scales,
                         float* offsets) {
  const auto layout = grouped_layout_of_ggml(type);
  const auto traits = ggml_type_traits(type);
  if (!layout || !traits) throw Error("ggml type " + ggml_type_name(type) + " has no grouped-code layout");
  if (cols % traits->block != 0)
    throw Error("a row of " + std::to_string(cols) + " values is not whole " + std::string(traits->name) + " blocks");
  const int per = int(traits->block), groups = per / layout->group;
  std::vector<int> code(size_t(per), 0);
  for (int64_t blk = 0; blk < cols / per; ++blk) {
    const uint8_t* p = blocks + size_t(blk) * size_t(traits->block_bytes);
    const BlockOut o{code.data(), scales + blk * groups, offsets + blk * groups};
    switch (GGMLType(type)) {
      case GGMLType::Q4_0: q4_0(p, o); break;
      case GGMLType::Q4_1: q4_1(p, o); break;
      case GGMLType::Q5_0: q5(p, o, false); break;
      case GGMLType::Q5_1: q5(p, o, true); break;
      case GGMLType::Q8_0: q8_0(p, o); break;
      case GGMLType::Q2_K: q2_k(p, o); break;
      case GGMLType::Q3_K: q3_k(p, o); break;
      case GGMLType::Q4_K: q45_k(p, o, false); break;
      case GGMLType::Q5_K: q45_k(p, o, true); break;
      case GGMLType::Q6_K: q6_k(p, o); break;
      default: break;  // (no layout: refused above)
    }
    const int64_t c0 = blk * per;
    if (layout->bits == 4) {
      for (int j = 0; j < per; j += 2)
        codes[(c0 + j) / 2] = uint8_t((code[size_t(j)] & 0x0F) | (code[size_t(j) + 1] & 0x0F) << 4);
    } else {
      for (int j = 0; j < per; ++j) codes[c0 + j] = uint8_t(int8_t(code[size_t(j)]));
    }
  }
}

uint32_t grouped_param(DType type, float scale, float offset) {
  auto to16 = [&](float v) -> uint32_t {
    if (type == DType::BF16) return num::f32_to_bf16(v);
    if (type == DType::F16) return num::f32_to_f16(v);
    throw Error("grouped codes keep their scales in bfloat16 or float16, not " + std::string(dtype_name(type)));
  };
  const uint32_t s = to16(scale), b = to16(offset);
  auto back = [&](uint32_t h) {
    return type == DType::BF16 ? num::bf16_to_f32(uint16_t(h)) : num::f16_to_f32(uint16_t(h));
  };
  if (!std::isfinite(back(s)) || !std::isfinite(back(b)))
    throw Error("a weight group's scale " + std::to_string(scale) + " or offset " + std::to_string(offset) +
                " does not fit " + std::string(dtype_name(type)));
  return s | b << 16;
}

void grouped_dequantize_row(GroupedLayout l, DType param_type, const uint8_t* codes, const uint32_t* params,
                            int64_t cols, std::span<float> out) {
  KVLM_CHECK(out.size() == size_t(cols) && cols % l.group == 0 && (l.bits == 4 || l.bits == 8),
             "grouped_dequantize_row: bad shape");
  auto f = [&](uint32_t h) {
    return param_type == DType::BF16 ? num::bf16_to_f32(uint16_t(h)) : num::f16_to_f32(uint16_t(h));
  };
  for (int64_t c = 0; c < cols; ++c) {
    const uint32_t p = params[c / l.group];
    const int code = l.bits == 4 ? (codes[c / 2] >> (4 * (c % 2))) & 0x0F : int(int8_t(codes[c]));
    out[size_t(c)] = f(p & 0xFFFF) * float(code) + f(p >> 16);
  }
}

}  // namespace kvlm

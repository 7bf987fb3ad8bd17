#include "io/grouped_codes.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/numeric.h"
#include "io/ggml_dequant.h"
#include "io/ggml_unpack.h"
#include "io/gguf.h"

namespace kvlm {

std::optional<GroupedLayout> grouped_layout_of_ggml(uint32_t type) {
  if (is_grouped_rows_type(type)) return GroupedLayout{4, int(type & 0xFFFFu), true};
  switch (GGMLType(type)) {
    case GGMLType::Q4_0:
    case GGMLType::Q4_1:
    case GGMLType::Q4_K: return GroupedLayout{4, 32};
    case GGMLType::Q5_0:
    case GGMLType::Q5_1:
    case GGMLType::Q5_K:
    case GGMLType::Q8_0: return GroupedLayout{8, 32};
    case GGMLType::MXFP4: return GroupedLayout{.bits = 4, .group = 32, .e2m1 = true};
    case GGMLType::Q2_K:
    case GGMLType::Q3_K:
    case GGMLType::Q6_K: return GroupedLayout{8, 16};
    default: return std::nullopt;
  }
}

std::string block_type_name(uint32_t type) {
  if (is_grouped_rows_type(type)) return "4-bit g" + std::to_string(type & 0xFFFFu);
  return ggml_type_name(type);
}

void ggml_row_to_grouped(uint32_t type, const uint8_t* blocks, int64_t cols, uint8_t* codes, float* scales,
                         float* offsets) {
  if (is_grouped_rows_type(type)) {  // codes, then (s, z) per group as fp32
    const int group = int(type & 0xFFFFu);
    if (group <= 0 || cols % group != 0 || cols % 2 != 0)
      throw Error("a row of " + std::to_string(cols) + " values is not whole groups of " + std::to_string(group));
    const size_t cb = size_t(cols) / 2;
    for (int64_t c = 0; c < cols; ++c) set_grouped_code(4, codes, c, blocks[c / 2] >> (4 * (c % 2)));  // column order in
    for (int64_t g = 0; g < cols / group; ++g) {
      std::memcpy(&scales[g], blocks + cb + size_t(8 * g), 4);
      std::memcpy(&offsets[g], blocks + cb + size_t(8 * g + 4), 4);
    }
    return;
  }
  if (type == uint32_t(GGMLType::MXFP4)) {  // the E2M1 codes as they are, 2^(e - 127) per block
    if (cols % 32 != 0) throw Error("a row of " + std::to_string(cols) + " values is not whole MXFP4 blocks");
    for (int64_t blk = 0; blk < cols / 32; ++blk) {
      const uint8_t* b = blocks + size_t(blk) * 17;  // e, then byte j: values j (low), j + 16 (high)
      scales[blk] = std::ldexp(1.0f, int(b[0]) - 127);
      offsets[blk] = 0.0f;
      for (int c = 0; c < 32; ++c) set_grouped_code(4, codes, 32 * blk + c, b[1 + c % 16] >> (4 * (c / 16)));
    }
    return;
  }
  const auto layout = grouped_layout_of_ggml(type);
  const auto traits = ggml_type_traits(type);
  if (!layout || !traits) throw Error("ggml type " + ggml_type_name(type) + " has no grouped-code layout");
  if (cols % traits->block != 0)
    throw Error("a row of " + std::to_string(cols) + " values is not whole " + std::string(traits->name) + " blocks");
  const GgmlUnpackFn unpack = ggml_unpacker(type);
  const int per = int(traits->block), groups = per / layout->group, sub = layout->group / 16;
  GgmlUnpacked u;
  for (int64_t blk = 0; blk < cols / per; ++blk) {
    unpack(blocks + size_t(blk) * size_t(traits->block_bytes), u);
    for (int g = 0; g < groups; ++g) {
      // a group of 32 is two of the unpacker's 16-value runs, which every 32-value type scales alike
      for (int h = 1; h < sub; ++h)
        KVLM_CHECK(u.a[g * sub + h] == u.a[g * sub] && u.b[g * sub + h] == u.b[g * sub],
                   "ggml_row_to_grouped: a group's 16-value runs differ in scale");
      scales[blk * groups + g] = u.a[g * sub];
      offsets[blk * groups + g] = u.b[g * sub];
    }
    const int64_t c0 = blk * per;
    for (int j = 0; j < per; ++j) set_grouped_code(layout->bits, codes, c0 + j, u.q[j]);
  }
}

bool grouped_row_to_q4_1(int group, const uint8_t* row, int64_t cols, uint8_t* out) {
  KVLM_CHECK(group > 0 && group % 32 == 0 && cols % group == 0, "grouped_row_to_q4_1: groups that are not whole blocks");
  const size_t cb = size_t(cols) / 2;
  for (int64_t blk = 0; blk < cols / 32; ++blk) {
    const int64_t g = blk * 32 / group;
    float sc, z;
    std::memcpy(&sc, row + cb + size_t(8 * g), 4);
    std::memcpy(&z, row + cb + size_t(8 * g + 4), 4);
    const uint16_t d = num::f32_to_f16(sc), m = num::f32_to_f16(-z * sc);
    if (num::f16_to_f32(d) != sc || !std::isfinite(num::f16_to_f32(m))) return false;
    uint8_t* b = out + size_t(blk) * 20;
    std::memcpy(b, &d, 2);
    std::memcpy(b + 2, &m, 2);
    const uint8_t* q = row + size_t(blk) * 16;  // columns 32 blk + 2 i (low), + 2 i + 1 (high)
    auto code = [&](int c) { return (q[c / 2] >> (4 * (c % 2))) & 0x0F; };
    for (int j = 0; j < 16; ++j) b[4 + j] = uint8_t(code(j) | code(j + 16) << 4);  // ggml: j and j + 16
  }
  return true;
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

uint32_t grouped_param_zero_point(DType type, float scale, int zero) {
  // 16: GPTQ's format stores z - 1, and a stored 15 (-1) decodes as 16, as its kernels do
  if (zero < 0 || zero > 16) throw Error("a 4-bit zero point of " + std::to_string(zero) + " is outside 0..16");
  const float magic = type == DType::BF16 ? 128.0f : 1024.0f;
  return grouped_param(type, scale, -(magic + float(zero)));  // exact in either type
}

uint32_t grouped_param_e2m1(DType type, float scale) {
  const float m = scale * (type == DType::BF16 ? 0x1p126f : 0x1p14f);
  if (!std::isfinite(m) || (type == DType::BF16 ? !std::isfinite(num::bf16_to_f32(num::f32_to_bf16(m)))
                                                : !std::isfinite(num::f16_to_f32(num::f32_to_f16(m)))))
    throw Error("an MXFP4 block scale of " + std::to_string(scale) +
                " (above 2) is beyond what the 4-bit E2M1 decode holds in " + std::string(dtype_name(type)));
  return grouped_param(type, m, 0.0f);
}

void grouped_dequantize_row(GroupedLayout l, DType param_type, const uint8_t* codes, const uint32_t* params,
                            int64_t cols, std::span<float> out) {
  KVLM_CHECK(out.size() == size_t(cols) && cols % l.group == 0 && (l.bits == 4 || l.bits == 8) &&
                 (!l.zero_point || l.bits == 4) && (!l.e2m1 || (l.bits == 4 && !l.zero_point)),
             "grouped_dequantize_row: bad shape");
  auto f = [&](uint32_t h) {
    return param_type == DType::BF16 ? num::bf16_to_f32(uint16_t(h)) : num::f16_to_f32(uint16_t(h));
  };
  const float magic = param_type == DType::BF16 ? 128.0f : 1024.0f;
  const float unit = param_type == DType::BF16 ? 0x1p-126f : 0x1p-14f;  // grouped_param_e2m1's factor, undone
  for (int64_t c = 0; c < cols; ++c) {
    const uint32_t p = params[c / l.group];
    const int code = grouped_code(l.bits, codes, c);
    out[size_t(c)] = l.e2m1         ? kE2M1[code] * (f(p & 0xFFFF) * unit)
                     : l.zero_point ? f(p & 0xFFFF) * (float(code) + magic + f(p >> 16))  // s (code - z)
                                    : f(p & 0xFFFF) * float(code) + f(p >> 16);
  }
}

}  // namespace kvlm

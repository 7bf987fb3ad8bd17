// Grouped integer codes (io/grouped_codes.h): every ggml block type converts to codes and
// group parameters whose values equal ggml's dequantization, and the 16-bit parameters the GPU
// reads stay within their rounding of it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/ggml_dequant.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "../support/ggml_blocks.h"

namespace kvlm {
namespace {

constexpr GGMLType kTypes[] = {GGMLType::Q4_0, GGMLType::Q4_1, GGMLType::Q5_0, GGMLType::Q5_1, GGMLType::Q8_0,
                               GGMLType::Q2_K, GGMLType::Q3_K, GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K};

TEST(GroupedCodes, EveryGgmlTypeConvertsToItsValues) {
  std::mt19937 rng(7);
  constexpr int64_t cols = 512;
  for (GGMLType type : kTypes) {
    SCOPED_TRACE(ggml_type_name(uint32_t(type)));
    const auto l = grouped_layout_of_ggml(uint32_t(type));
    ASSERT_TRUE(l);
    const std::vector<uint8_t> blocks = test::random_ggml_blocks(type, cols, rng);
    std::vector<float> ref(cols);
    dequantize_ggml(uint32_t(type), blocks, ref);
    std::vector<uint8_t> codes(grouped_code_bytes(*l, cols));
    std::vector<float> s(size_t(grouped_groups(*l, cols))), b(s.size());
    ggml_row_to_grouped(uint32_t(type), blocks.data(), cols, codes.data(), s.data(), b.data());
    for (int64_t c = 0; c < cols; ++c) {
      const int code = grouped_code(l->bits, codes.data(), c);
      const size_t g = size_t(c / l->group);
      // ggml rounds (q - 8) d or d q - m in its own order; s q + b agrees to fp32 rounding.
      const double v = double(s[g]) * code + double(b[g]);
      ASSERT_NEAR(v, ref[size_t(c)], 1e-6 * (std::fabs(s[g]) * 16 + std::fabs(b[g])) + 1e-12) << "column " << c;
    }
    // The kernels' 16-bit parameters: within their rounding (2^-9 relative for bf16).
    for (DType pt : {DType::BF16, DType::F16}) {
      std::vector<uint32_t> params(s.size());
      for (size_t g = 0; g < s.size(); ++g) params[g] = grouped_param(pt, s[g], b[g]);
      std::vector<float> got(cols);
      grouped_dequantize_row(*l, pt, codes.data(), params.data(), cols, got);
      const double rel = pt == DType::BF16 ? 1.0 / 256 : 1.0 / 2048;
      for (int64_t c = 0; c < cols; ++c) {
        const size_t g = size_t(c / l->group);
        const double code_max = l->bits == 4 ? 15 : 128;
        ASSERT_NEAR(got[size_t(c)], ref[size_t(c)], rel * (std::fabs(s[g]) * code_max + std::fabs(b[g])))
            << dtype_name(pt) << " column " << c;
      }
    }
  }
}

// MXFP4 keeps its E2M1 codes (the 4-bit layout's E2M1 variant) and each block's scale
// 2^(e - 127): the values are ggml's exactly, and so are the 16-bit words the GPU multiplies
// by, for every scale real checkpoints hold. The decode's bit placement (int_decode.cuh
// e2m1x8_to_pairs: the code's exponent and mantissa at the bottom of the 16-bit type's
// exponent, its sign at bit 15) reads every code as its value times 2^-126 (bf16) or 2^-14
// (f16), which the word's factor undoes.
TEST(GroupedCodes, Mxfp4KeepsItsE2M1Codes) {
  const auto l = grouped_layout_of_ggml(uint32_t(GGMLType::MXFP4));
  ASSERT_TRUE(l);
  EXPECT_EQ(*l, (GroupedLayout{.bits = 4, .group = 32, .e2m1 = true}));
  for (int code = 0; code < 16; ++code) {
    const uint16_t bf = uint16_t((code & 7) << 6 | (code & 8) << 12), h = uint16_t((code & 7) << 9 | (code & 8) << 12);
    EXPECT_EQ(num::bf16_to_f32(bf) * 0x1p126f, kE2M1[code]) << code;
    EXPECT_EQ(num::f16_to_f32(h) * 0x1p14f, kE2M1[code]) << code;
  }
  std::mt19937 rng(11);
  constexpr int64_t cols = 256;
  std::vector<uint8_t> blocks = test::random_ggml_blocks(GGMLType::MXFP4, cols, rng);
  const uint8_t es[8] = {0, 1, 104, 117, 127, 128, 120, 90};  // block scales 2^-127 .. 2
  for (int i = 0; i < 8; ++i) blocks[size_t(17 * i)] = es[i];
  std::vector<float> ref(cols);
  dequantize_ggml(uint32_t(GGMLType::MXFP4), blocks, ref);
  std::vector<uint8_t> codes(grouped_code_bytes(*l, cols));
  std::vector<float> sc(8), off(8);
  ggml_row_to_grouped(uint32_t(GGMLType::MXFP4), blocks.data(), cols, codes.data(), sc.data(), off.data());
  for (int64_t c = 0; c < cols; ++c) {
    const int code = grouped_code(4, codes.data(), c);
    ASSERT_EQ(kE2M1[code] * sc[size_t(c / 32)], ref[size_t(c)]) << "column " << c;
    ASSERT_EQ(off[size_t(c / 32)], 0.0f);
  }
  for (DType pt : {DType::BF16, DType::F16}) {
    std::vector<uint32_t> params(8);
    for (size_t g = 0; g < 8; ++g) params[g] = grouped_param_e2m1(pt, sc[g]);
    std::vector<float> got(cols);
    grouped_dequantize_row(*l, pt, codes.data(), params.data(), cols, got);
    for (int64_t c = 0; c < cols; ++c) {
      const int e = es[c / 32];
      if (pt == DType::F16 && e < 104) continue;  // below f16's range: rounded as an f16 copy would be
      ASSERT_EQ(got[size_t(c)], ref[size_t(c)]) << dtype_name(pt) << " column " << c;
    }
    // e = 90: the factor 2^(e - 1) in bf16, 2^(e - 113) in f16 (a subnormal)
    EXPECT_EQ(params[7], pt == DType::BF16 ? num::f32_to_bf16(0x1p89f) : num::f32_to_f16(0x1p-23f));
    // A block scale above 2 leaves the decode's range: refused, not rounded.
    EXPECT_THROW(grouped_param_e2m1(pt, 4.0f), Error);
  }
}

// The kernels' order inside a 32-bit word (int_decode.cuh decodes nibbles j and j + 4, or
// bytes 0 and 2 and bytes 1 and 3, as one pair): those pairs are adjacent columns.
TEST(GroupedCodes, DecodePairsAreAdjacentColumns) {
  std::vector<uint8_t> four(4), eight(4);
  for (int c = 0; c < 8; ++c) set_grouped_code(4, four.data(), c, c + 1);
  for (int c = 0; c < 4; ++c) set_grouped_code(8, eight.data(), c, -(c + 1));
  uint32_t w4, w8;
  std::memcpy(&w4, four.data(), 4);
  std::memcpy(&w8, eight.data(), 4);
  for (int j = 0; j < 4; ++j) {
    EXPECT_EQ(int((w4 >> (4 * j)) & 0xF), 2 * j + 1) << "nibble " << j;           // column 2j
    EXPECT_EQ(int((w4 >> (4 * j + 16)) & 0xF), 2 * j + 2) << "nibble " << j + 4;  // column 2j + 1
  }
  const int byte_column[4] = {0, 2, 1, 3};  // pairs (byte 0, byte 2) and (byte 1, byte 3)
  for (int b = 0; b < 4; ++b) EXPECT_EQ(int(int8_t(w8 >> (8 * b))), -(byte_column[b] + 1)) << "byte " << b;
  for (int c = 0; c < 8; ++c) EXPECT_EQ(grouped_code(4, four.data(), c), c + 1);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(grouped_code(8, eight.data(), c), -(c + 1));
}

TEST(GroupedCodes, RefusesWhatHasNoLayout) {
  EXPECT_FALSE(grouped_layout_of_ggml(uint32_t(GGMLType::F16)));
  EXPECT_FALSE(grouped_layout_of_ggml(23));  // an IQ type
  std::vector<uint8_t> codes(64);
  std::vector<float> s(4), b(4);
  std::vector<uint8_t> blocks(144);
  EXPECT_THROW(ggml_row_to_grouped(uint32_t(GGMLType::F16), blocks.data(), 32, codes.data(), s.data(), b.data()),
               Error);
  EXPECT_THROW(ggml_row_to_grouped(uint32_t(GGMLType::Q4_K), blocks.data(), 128, codes.data(), s.data(), b.data()),
               Error);  // half a block
  EXPECT_THROW(grouped_param(DType::F16, 1e6f, 0.0f), Error);  // past f16's range
  EXPECT_THROW(grouped_param(DType::F32, 1.0f, 0.0f), Error);
  EXPECT_NO_THROW(grouped_param(DType::BF16, 1e6f, 0.0f));
}

}  // namespace
}  // namespace kvlm

namespace kvlm {
namespace {

// The zero-point layout's word holds the scale and -(M + z), M the 4-bit decode's magic number:
// exact in bf16 and f16 for every z in 0..16, and its values are s (code - z) exactly.
TEST(GroupedCodes, ZeroPointLayoutSubtractsTheZeroExactly) {
  const GroupedLayout l{4, 32, true};
  std::vector<uint8_t> codes(16);
  for (int c = 0; c < 32; ++c) set_grouped_code(4, codes.data(), c, c % 2 ? 15 - c / 2 : c / 2);
  for (DType t : {DType::BF16, DType::F16})
    for (int z = 0; z <= 16; ++z) {
      const float s = 0.0078125f;  // exact in both types
      const uint32_t p = grouped_param_zero_point(t, s, z);
      const float hi = t == DType::BF16 ? num::bf16_to_f32(uint16_t(p >> 16)) : num::f16_to_f32(uint16_t(p >> 16));
      EXPECT_EQ(hi, -((t == DType::BF16 ? 128.0f : 1024.0f) + float(z)));
      std::vector<float> out(32);
      grouped_dequantize_row(l, t, codes.data(), &p, 32, out);
      for (int c = 0; c < 32; ++c) {
        const int code = c % 2 ? 15 - c / 2 : c / 2;
        EXPECT_EQ(out[size_t(c)], s * float(code - z)) << dtype_name(t) << " z=" << z << " column " << c;
      }
    }
  EXPECT_THROW(grouped_param_zero_point(DType::BF16, 1.0f, 17), Error);
  EXPECT_THROW(grouped_param_zero_point(DType::BF16, 1.0f, -1), Error);
  // Rows of kvlm's own block type (4-bit checkpoints) carry (s, z) and take the zero-point layout.
  const auto rows = grouped_layout_of_ggml(grouped_rows_type(128));
  ASSERT_TRUE(rows);
  EXPECT_EQ(*rows, (GroupedLayout{4, 128, true}));
  EXPECT_FALSE(grouped_layout_of_ggml(uint32_t(GGMLType::Q4_1))->zero_point);
}

}  // namespace
}  // namespace kvlm

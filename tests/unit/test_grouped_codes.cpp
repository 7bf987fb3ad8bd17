// Grouped integer codes (io/grouped_codes.h): every ggml block type converts to codes and
// group parameters whose values equal ggml's dequantization, and the 16-bit parameters the GPU
// reads stay within their rounding of it.
#include <gtest/gtest.h>

#include <cmath>
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
      const int code = l->bits == 4 ? (codes[size_t(c) / 2] >> (4 * (c % 2))) & 0x0F : int(int8_t(codes[size_t(c)]));
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
  for (int c = 0; c < 32; c += 2) codes[size_t(c / 2)] = uint8_t((c / 2) | (15 - c / 2) << 4);
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

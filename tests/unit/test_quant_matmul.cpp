// Products with ggml blocks (ops/cpu/quant_matmul.h) against io/ggml_dequant's values and a
// dot product in double: every type, both kinds of arithmetic, scalar, AVX2 and (where the CPU
// has it) AVX-512 VNNI kernels.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/ggml_dequant.h"
#include "io/gguf.h"
#include "ops/cpu/quant_matmul.h"

using namespace kvlm;
using ops::cpu::BlockMath;
using ops::cpu::BlockMatrix;

namespace {

const GGMLType kTypes[] = {GGMLType::Q4_0, GGMLType::Q4_1, GGMLType::Q5_0, GGMLType::Q5_1, GGMLType::Q8_0,
                           GGMLType::MXFP4, GGMLType::Q2_K, GGMLType::Q3_K, GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K};

// Byte offsets of a block's fp16 scales (d, and the min or dmin where there is one).
std::vector<int> half_fields(GGMLType t) {
  switch (t) {
    case GGMLType::Q4_1: case GGMLType::Q5_1: case GGMLType::Q4_K: case GGMLType::Q5_K: return {0, 2};
    case GGMLType::Q2_K: return {80, 82};
    case GGMLType::Q3_K: return {108};
    case GGMLType::Q6_K: return {208};
    case GGMLType::MXFP4: return {};  // an E8M0 byte (random_blocks)
    default: return {0};
  }
}

int64_t block_of(GGMLType t) { return ggml_type_traits(uint32_t(t))->block; }

// Random codes and scales, every fp16 field a finite value of magnitude in [1e-3, 1e-1] and
// random sign (so no NaN or Inf pattern); MXFP4's E8M0 exponents e (scale 2^(e - 127)) half
// around 1 (118-134), half anywhere from 0 (subnormal scales) to 140, finite products all.
std::vector<uint8_t> random_blocks(GGMLType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const auto tr = *ggml_type_traits(uint32_t(t));
  const int64_t blocks = rows * cols / tr.block;
  std::vector<uint8_t> data(size_t(blocks * tr.block_bytes));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(1e-3f, 1e-1f);
  for (auto& b : data) b = uint8_t(byte(rng));
  for (int64_t i = 0; i < blocks; ++i)
    for (int off : half_fields(t)) {
      const uint16_t h = num::f32_to_f16(byte(rng) & 1 ? mag(rng) : -mag(rng));
      std::memcpy(data.data() + i * tr.block_bytes + off, &h, 2);
    }
  if (t == GGMLType::MXFP4) {
    std::uniform_int_distribution<int> near(118, 134), any(0, 140);
    for (int64_t i = 0; i < blocks; ++i) data[size_t(i * tr.block_bytes)] = uint8_t(byte(rng) & 1 ? near(rng) : any(rng));
  }
  return data;
}

std::vector<float> dequantized(GGMLType t, const std::vector<uint8_t>& data, int64_t n) {
  std::vector<float> w(static_cast<size_t>(n));
  dequantize_ggml(uint32_t(t), data, w);
  return w;
}

// The header's rule for Int8 activations, in plain scalar code: per 32 values
// d = absmax / 127, q = round-half-even(x / d); returns d q.
std::vector<double> int8_activations(const std::vector<float>& x) {
  std::vector<double> out(x.size());
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0.0f;
    for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    for (size_t i = b; i < b + 32; ++i) out[i] = d == 0.0f ? 0.0 : double(d) * std::nearbyint(x[i] / d);
  }
  return out;
}

// The most x's int8 quantization can move y[r][j]: sum_i |w[j][i]| d / 2, d the scale of x's
// run of 32 holding column i (each code is x / d rounded to the nearest integer).
std::vector<double> int8_error_bound(const std::vector<float>& x, int m, int64_t k, const std::vector<float>& w,
                                     int64_t rows) {
  std::vector<double> half_d(x.size() / 32);
  for (size_t b = 0; b < half_d.size(); ++b) {
    float amax = 0.0f;
    for (size_t i = 32 * b; i < 32 * b + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    half_d[b] = double(amax / 127.0f) / 2;
  }
  std::vector<double> bound(size_t(m * rows), 0.0);
  for (int r = 0; r < m; ++r)
    for (int64_t j = 0; j < rows; ++j)
      for (int64_t i = 0; i < k; ++i)
        bound[size_t(r * rows + j)] += std::fabs(double(w[size_t(j * k + i)])) * half_d[size_t((r * k + i) / 32)];
  return bound;
}

// ref[r][j] = sum_i x[r][i] w[j][i] in double, and mag[r][j] = sum_i |x[r][i] w[j][i]|.
template <class X>
void reference(const std::vector<X>& x, int m, int64_t k, const std::vector<float>& w, int64_t rows,
               std::vector<double>& ref, std::vector<double>& mag) {
  ref.assign(size_t(m * rows), 0.0);
  mag.assign(size_t(m * rows), 0.0);
  for (int r = 0; r < m; ++r)
    for (int64_t j = 0; j < rows; ++j) {
      double s = 0, a = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double p = double(x[size_t(r * k + i)]) * double(w[size_t(j * k + i)]);
        s += p;
        a += std::fabs(p);
      }
      ref[size_t(r * rows + j)] = s;
      mag[size_t(r * rows + j)] = a;
    }
}

struct Restore {
  ~Restore() { ops::cpu::set_block_kernels(ops::cpu::BlockKernels::Fastest); }
};

using ops::cpu::BlockKernels;
const BlockKernels kKernelSets[] = {BlockKernels::Scalar, BlockKernels::Avx2, BlockKernels::Fastest};

const char* kernels_name(BlockKernels k) {
  return k == BlockKernels::Scalar ? " scalar" : k == BlockKernels::Avx2 ? " avx2" : " fastest";
}

constexpr float kSentinel = -7777.0f;

class QuantMatmulType : public ::testing::TestWithParam<GGMLType> {};

// Every shape of the brief through both kinds of arithmetic and every kernel set (Fastest
// takes m > 16 through the VNNI kernels where the CPU has them, else through Exact). y is a
// window (column offset 2, row stride rows + 5) into a larger buffer: only the window's entries
// may change.
TEST_P(QuantMatmulType, MatchesDequantizedReference) {
  const GGMLType t = GetParam();
  const int64_t blk = block_of(t);
  const std::vector<int64_t> ks = blk == 256 ? std::vector<int64_t>{256, 512, 768} : std::vector<int64_t>{32, 96, 576};
  const int ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 23, 31, 33, 64, 129, 200};
  std::mt19937 rng(uint32_t(t) * 7919u + 1);
  std::normal_distribution<float> nd;
  Restore restore;
  for (const int64_t rows : {1, 7, 33, 100}) {
    for (const int64_t k : ks) {
      const auto data = random_blocks(t, rows, k, rng);
      const auto w = dequantized(t, data, rows * k);
      const BlockMatrix bm{uint32_t(t), data.data(), ops::cpu::block_row_bytes(uint32_t(t), k), rows, k};
      for (const int m : ms) {
        std::vector<float> x(size_t(m * k));
        for (auto& v : x) v = nd(rng);
        if (k >= 64)
          for (int i = 32; i < 64; ++i) x[size_t(i)] = 0.0f;  // an all-zero run: scale 0
        std::vector<double> ref, mag, ref8, mag8;
        reference(x, m, k, w, rows, ref, mag);
        reference(int8_activations(x), m, k, w, rows, ref8, mag8);
        const std::vector<double> qbound = int8_error_bound(x, m, k, w, rows);
        const int64_t ldy = rows + 5;
        for (const BlockKernels kernels : kKernelSets) {
          ops::cpu::set_block_kernels(kernels);
          for (const BlockMath math : {BlockMath::Exact, BlockMath::Int8}) {
            std::vector<float> ybuf(size_t(m * ldy + 8), kSentinel);
            float* y = ybuf.data() + 2;
            ops::cpu::block_linear(x.data(), m, k, bm, y, ldy, math);
            const bool int8 = math == BlockMath::Int8 && m <= ops::cpu::block_int8_max_rows();
            for (size_t i = 0; i < ybuf.size(); ++i) {
              const int64_t p = int64_t(i) - 2, r = p / ldy, j = p % ldy;
              const auto where = [&] {  // built only for a failure's message
                return ggml_type_name(uint32_t(t)) + kernels_name(kernels) +
                       (math == BlockMath::Int8 ? " int8" : " exact") + " m=" + std::to_string(m) +
                       " rows=" + std::to_string(rows) + " k=" + std::to_string(k) + " r=" + std::to_string(r) +
                       " j=" + std::to_string(j);
              };
              if (p < 0 || r >= m || j >= rows) {
                ASSERT_EQ(ybuf[i], kSentinel) << where() << ": written outside the window";
                continue;
              }
              const size_t o = size_t(r * rows + j);
              if (int8) {
                ASSERT_NEAR(y[p], ref8[o], 1e-5 * mag8[o] + 1e-30) << where();
                // x's rounding to its codes moves y by at most qbound (MXFP4's few large weights
                // beside zeros reach 1% of mag, which the other types stay under)
                ASSERT_NEAR(y[p], ref[o], qbound[o] + 1e-5 * mag8[o] + 1e-30) << where() << " (against unquantized x)";
              } else {
                ASSERT_NEAR(y[p], ref[o], 1e-5 * mag[o] + 1e-30) << where();
              }
            }
          }
        }
      }
    }
  }
}

// The embedding lookup: each row bit for bit io/ggml_dequant's, scalar and AVX2.
TEST_P(QuantMatmulType, DequantizeRowIsBitExact) {
  const GGMLType t = GetParam();
  const int64_t k = 3 * block_of(t), rows = 9;
  std::mt19937 rng(uint32_t(t) + 17u);
  const auto data = random_blocks(t, rows, k, rng);
  const auto w = dequantized(t, data, rows * k);
  const BlockMatrix bm{uint32_t(t), data.data(), ops::cpu::block_row_bytes(uint32_t(t), k), rows, k};
  Restore restore;
  for (const bool scalar : {true, false}) {
    ops::cpu::set_block_kernels_scalar(scalar);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<float> out(size_t(k), kSentinel);
      ops::cpu::block_dequantize_row(bm, r, out.data());
      ASSERT_EQ(std::memcmp(out.data(), w.data() + r * k, size_t(k) * 4), 0)
          << ggml_type_name(uint32_t(t)) << (scalar ? " scalar" : " simd") << " row " << r;
    }
  }
}

// Rows stored with padding after their blocks (row_bytes larger than the blocks need).
TEST_P(QuantMatmulType, PaddedRows) {
  const GGMLType t = GetParam();
  const int64_t k = 2 * block_of(t), rows = 19, pad = 13;
  std::mt19937 rng(uint32_t(t) + 99u);
  const size_t rb = ops::cpu::block_row_bytes(uint32_t(t), k);
  const auto dense = random_blocks(t, rows, k, rng);
  std::vector<uint8_t> padded(size_t(rows) * (rb + pad), 0xA5);
  for (int64_t j = 0; j < rows; ++j) std::memcpy(padded.data() + j * (rb + pad), dense.data() + j * rb, rb);
  const auto w = dequantized(t, dense, rows * k);
  const BlockMatrix bm{uint32_t(t), padded.data(), rb + pad, rows, k};
  std::normal_distribution<float> nd;
  Restore restore;
  for (const int m : {3, 40}) {
    std::vector<float> x(size_t(m * k));
    for (auto& v : x) v = nd(rng);
    std::vector<double> ref, mag;
    reference(x, m, k, w, rows, ref, mag);
    for (const BlockKernels kernels : kKernelSets) {
      ops::cpu::set_block_kernels(kernels);
      for (const BlockMath math : {BlockMath::Exact, BlockMath::Int8}) {
        std::vector<float> y(size_t(m * rows));
        ops::cpu::block_linear(x.data(), m, k, bm, y.data(), rows, math);
        for (size_t i = 0; i < y.size(); ++i)
          ASSERT_NEAR(y[i], ref[i], (math == BlockMath::Exact ? 1e-5 : 1e-2) * mag[i]) << kernels_name(kernels) << " " << i;
      }
      std::vector<float> out(static_cast<size_t>(k));
      ops::cpu::block_dequantize_row(bm, rows - 1, out.data());
      ASSERT_EQ(std::memcmp(out.data(), w.data() + (rows - 1) * k, size_t(k) * 4), 0);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, QuantMatmulType, ::testing::ValuesIn(kTypes),
                         [](const ::testing::TestParamInfo<GGMLType>& info) {
                           return ggml_type_name(uint32_t(info.param));
                         });

TEST(QuantMatmul, SupportAndRowBytes) {
  for (const GGMLType t : kTypes) {
    const auto tr = *ggml_type_traits(uint32_t(t));
    EXPECT_TRUE(ops::cpu::block_kernels_support(uint32_t(t))) << tr.name;
    EXPECT_EQ(ops::cpu::block_row_bytes(uint32_t(t), 3 * tr.block), size_t(3 * tr.block_bytes)) << tr.name;
    EXPECT_THROW(ops::cpu::block_row_bytes(uint32_t(t), tr.block + 16), Error) << tr.name;
  }
  EXPECT_EQ(ops::cpu::block_row_bytes(uint32_t(GGMLType::Q4_K), 2048), size_t(8 * 144));
  for (const GGMLType t : {GGMLType::F32, GGMLType::F16, GGMLType::BF16}) {
    EXPECT_FALSE(ops::cpu::block_kernels_support(uint32_t(t)));
    EXPECT_THROW(ops::cpu::block_row_bytes(uint32_t(t), 64), Error);
  }
  EXPECT_FALSE(ops::cpu::block_kernels_support(23));  // an IQ type
}

// The Int8 rule's rounding, halves included: a run with absmax 127 has d = 1, so x itself is
// x / d, and ties go to the even code in both kernel sets. W is one Q8_0 row of ones (d = 1),
// so y is the sum of the codes.
TEST(QuantMatmul, Int8RoundsHalfToEven) {
  std::vector<uint8_t> row(34, 1);
  const uint16_t one = num::f32_to_f16(1.0f);
  std::memcpy(row.data(), &one, 2);
  const BlockMatrix bm{uint32_t(GGMLType::Q8_0), row.data(), 34, 1, 32};
  std::vector<float> x(32, 0.0f);
  const float ties[] = {127.0f, 0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.5f, 126.5f, 0.49999997f, 2.5000002f};
  const int codes[] = {127, 0, 2, 2, 0, -2, -2, 4, 126, 0, 3};
  int expect = 0;
  for (size_t i = 0; i < std::size(ties); ++i) {
    x[i] = ties[i];
    expect += codes[i];
  }
  Restore restore;
  for (const bool scalar : {true, false}) {
    ops::cpu::set_block_kernels_scalar(scalar);
    float y = 0.0f;
    ops::cpu::block_linear(x.data(), 1, 32, bm, &y, 1, BlockMath::Int8);
    EXPECT_EQ(y, float(expect)) << (scalar ? "scalar" : "simd");
  }
}

// Products big enough to split W's rows over the team: the same values as on one thread
// (bit for bit for Int8, whose outputs do not depend on the split; to rounding for Exact,
// whose sgemm tiles do: each within 1e-5 of sum |x w|). m = 40 and 100 take the VNNI kernels
// where the CPU has them.
TEST(QuantMatmul, SplitOverThreadsMatchesOneThread) {
  const int saved = omp_get_max_threads();
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (const GGMLType t : {GGMLType::Q4_1, GGMLType::Q4_K, GGMLType::Q6_K}) {
    const int64_t rows = 1000, k = block_of(t) == 256 ? 768 : 576;
    const auto data = random_blocks(t, rows, k, rng);
    const BlockMatrix bm{uint32_t(t), data.data(), ops::cpu::block_row_bytes(uint32_t(t), k), rows, k};
    const auto w = dequantized(t, data, rows * k);
    for (const int m : {1, 5, 16, 40, 100}) {
      std::vector<float> x(size_t(m * k));
      for (auto& v : x) v = nd(rng);
      std::vector<double> ref, mag;
      reference(x, m, k, w, rows, ref, mag);
      for (const BlockMath math : {BlockMath::Exact, BlockMath::Int8}) {
        omp_set_num_threads(1);
        std::vector<float> one(size_t(m * rows));
        ops::cpu::block_linear(x.data(), m, k, bm, one.data(), rows, math);
        for (const int threads : {2, 3}) {
          omp_set_num_threads(threads);
          std::vector<float> split(size_t(m * rows), kSentinel);
          ops::cpu::block_linear(x.data(), m, k, bm, split.data(), rows, math);
          for (size_t i = 0; i < one.size(); ++i) {
            if (math == BlockMath::Int8 && m <= ops::cpu::block_int8_max_rows())
              ASSERT_EQ(split[i], one[i]) << threads << " threads, element " << i;
            else
              ASSERT_NEAR(split[i], one[i], 2e-5 * mag[i])
                  << (math == BlockMath::Int8 ? "int8 " : "exact ") << "m=" << m << ", " << threads << " threads, element " << i;
          }
        }
      }
    }
  }
  omp_set_num_threads(saved);
}

}  // namespace

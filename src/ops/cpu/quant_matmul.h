// Products with weight matrices kept in ggml's quantization blocks (GGUF tensors as stored,
// io/ggml_dequant.h documents the layouts), so a quantized model holds its weights in their
// file size instead of four bytes per value, and decode reads the blocks once per token.
//
// Two kinds of arithmetic (BlockMath):
//   Exact: tiles of W rows dequantized to fp32 (io/ggml_dequant's values, bit for bit) and
//          multiplied by OpenBLAS. Equals dequantize-then-sgemm up to fp32 summation order.
//   Int8:  every m where the CPU has AVX-512 VNNI (decode, speculative verification and
//          prompts alike), else m <= kBlockInt8MaxRows. Each run of 32 values of an x row is
//          quantized to int8 codes with one fp32 scale:
//              d = absmax / 127,  q_i = round_half_even(x_i / d)  (all 0 when d is 0),
//          and W's codes meet them in integer dot products. Every block type is, per run of
//          16 or 32 values, w_i = a q_i + b with integer q_i, so a run contributes
//          d (a sum(q x_q) + b sum(x_q)). The only error beyond fp32 rounding is x's
//          quantization, at most d / 2 per value of x. Without VNNI, larger m takes Exact
//          (there the AVX2 integer kernels lose to sgemm).
// Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 (blocks of 32), Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256).
// MXFP4's codes are E2M1 values, not integers, but twice each is one (-12..12) and its scale a
// power of two, so it takes the integer kernels as Q8_0 does, from its 4-bit codes.
// Kernels are chosen at run time (the build has no -march): AVX-512 VNNI ones for m >= 8 where
// the CPU has AVX-512 F/BW/VL/VNNI (vpdpbusd on tiles of W unpacked once per product: ~3x the
// Exact path's GFLOP/s at m = 128 on a Zen 4 core); AVX2 ones where it has AVX2, FMA and F16C;
// portable scalar ones otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvlm::ops::cpu {

// A matrix [rows][cols] (PyTorch Linear layout [out][in]) kept in ggml blocks: row r is
// cols / block_elements consecutive blocks starting at data + r * row_bytes.
struct BlockMatrix {
  uint32_t type = 0;  // ggml type id (io/gguf.h GGMLType)
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
  int64_t rows = 0, cols = 0;
};

// Whether `type` has kernels here (the eleven types above).
bool block_kernels_support(uint32_t type);
// The type a checkpoint's blocks of `type` are held as for these kernels: itself when they
// read it, Q4_1 for a 4-bit checkpoint's grouped rows (io/grouped_codes.h); 0 when they are
// dequantized instead.
uint32_t held_block_type(uint32_t type);

// Bytes of one row of `cols` elements; throws kvlm::Error for a type without kernels here or
// when cols is not a multiple of the block.
size_t block_row_bytes(uint32_t type, int64_t cols);

// How the activations meet the blocks.
enum class BlockMath : uint8_t {
  Exact,  // the reference: weights dequantized to fp32 (exactly io/ggml_dequant's values), fp32 products
  Int8,   // activations quantized per 32 values to int8 with an fp32 scale, integer dot products
};

// Where the CPU lacks AVX-512 VNNI (or set_block_kernels leaves it out): the most rows of x
// that BlockMath::Int8 takes through the integer kernels; more take Exact. With VNNI, Int8
// takes every m through integer kernels.
inline constexpr int kBlockInt8MaxRows = 16;

// The most rows of x that BlockMath::Int8 takes through integer kernels on this CPU with the
// kernels set now: kBlockInt8MaxRows, or INT_MAX with AVX-512 VNNI.
int block_int8_max_rows();

// y[r * ldy + j] = sum_i x[r * k + i] * W[j][i]   for r < m, j < w.rows   (k == w.cols).
// Writes exactly those entries (the caller places the part's columns: y may point at column
// offset c0 of a wider row with ldy = its width). Splits W's rows over the OpenMP team when
// the product is big enough and no team is running (omp_in_parallel()), otherwise runs on the
// calling thread.
void block_linear(const float* x, int m, int64_t k, const BlockMatrix& w, float* y, int64_t ldy, BlockMath math);

// fp32 values of row `row` (the embedding lookup), exactly io/ggml_dequant's.
void block_dequantize_row(const BlockMatrix& w, int64_t row, float* out);

// Testing: which kernels run. Fastest picks at run time (AVX-512 VNNI, else AVX2, else
// scalar); Avx2 leaves VNNI out; Scalar forces the portable kernels. Process-wide; not for use
// while products run on other threads.
enum class BlockKernels : uint8_t { Fastest, Avx2, Scalar };
void set_block_kernels(BlockKernels kernels);
// set_block_kernels(scalar ? Scalar : Fastest).
void set_block_kernels_scalar(bool scalar);

}  // namespace kvlm::ops::cpu

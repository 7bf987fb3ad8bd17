// Grouped integer codes: the one layout of quantized weights the GPU's kernels read
// (ops/cuda/gemm.h IntWeight), and its conversion from GGUF's ggml blocks.
//
// A matrix [rows][cols] of `bits`-bit codes (4 or 8) in groups of `group` consecutive columns
// of a row; each group has a scale s and an offset b, and the value at (r, c) is
//     w = s * code + b
// with 4-bit codes unsigned (0..15) and 8-bit codes signed (-128..127). Every format kvlm keeps
// 4-bit or 8-bit on the GPU maps onto it without loss beyond rounding s and b to 16 bits:
// ggml's scales and minimums (Q4_K: s = d sc, b = -dmin m per 32 values), symmetric codes
// (Q4_0: b = -8 d; Q8_0 and Q6_K: b = 0); zero points (s (q - z): AWQ, GPTQ) take the
// zero-point variant of the 4-bit layout, whose groups hold z in place of b so that the decode
// subtracts it exactly (b = -s z rounded to 16 bits would shift a whole group). One layout
// means one kernel family, and the kernels decode a code to the compute type with two
// instructions instead of each block type's own bit layout.
//
// ggml types: Q4_0, Q4_1, Q4_K -> 4-bit codes in groups of 32; Q5_0, Q5_1, Q5_K, Q8_0 -> 8-bit
// codes in groups of 32; Q6_K, Q2_K, Q3_K -> 8-bit codes in groups of 16 (their scales cover
// 16 values; Q2_K and Q3_K would fit 4 bits, but the 4-bit kernels take groups of 32 and more);
// MXFP4 -> the E2M1 variant of the 4-bit layout in groups of 32 (E2M1 is not evenly spaced, so
// affine codes cannot hold it: the codes are E2M1's own, w = E2M1(code) * 2^(e - 127), and the
// group's word a power-of-two multiplier: grouped_param_e2m1). So a Q4_K matrix takes 5 bits per
// weight (its file 4.5), Q6_K 10 (6.56), Q8_0 10 (8.5), MXFP4 5 (4.25).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "core/dtype.h"
#include "core/numeric.h"

namespace kvlm {

struct GroupedLayout {
  int bits = 0;   // 4 or 8
  int group = 0;  // columns per (scale, offset)
  // 4-bit only: each group holds a zero point z instead of an offset, w = s * (code - z), so
  // that the decode subtracts it exactly (AWQ / GPTQ / compressed-tensors; grouped_param_zero_point)
  bool zero_point = false;
  // 4-bit only: the codes are E2M1 values (MXFP4: sign, 2-bit exponent, 1-bit mantissa), each
  // group's scale a power of two and its offset 0 (grouped_param_e2m1)
  bool e2m1 = false;
  bool operator==(const GroupedLayout&) const = default;
};

// kvlm's own block type beside ggml's, for rows that are already grouped codes of a zero-point
// layout: 4-bit codes (grouped_code_bytes) followed by each group's fp32 scale and zero point,
// `grouped_rows_bytes` a row. 4-bit integer checkpoints (AWQ, GPTQ, compressed-tensors:
// w = (q - z) s) hand their modules over as these (io/int4_checkpoint.h), and the weight
// loaders take them as any kept block type. Its ids lie above every ggml type's.
constexpr uint32_t kGroupedRowsType = 0x4B560000u;
inline uint32_t grouped_rows_type(int group) { return kGroupedRowsType | uint32_t(group); }
inline bool is_grouped_rows_type(uint32_t type) { return (type & 0xFFFF0000u) == kGroupedRowsType; }
inline size_t grouped_rows_bytes(int group, int64_t cols) { return size_t(cols) / 2 + size_t(cols / group) * 8; }

// One grouped_rows_type row (zero-point layout, groups a multiple of 32) as ggml Q4_1 blocks
// (d = s, m = -z s as fp16: w = d q + m), what the CPU's block kernels read. m is rounded to
// fp16 (at most 2^-12 of z s, shared by the block's 32 weights); returns false, leaving `out`
// unspecified, when a scale is not exact in fp16 (a bf16 scale below fp16's normal range).
bool grouped_row_to_q4_1(int group, const uint8_t* row, int64_t cols, uint8_t* out);

// The layout a ggml type's blocks (or a grouped_rows_type's rows) convert to; nullopt for
// F32/F16/BF16 and unknown types.
std::optional<GroupedLayout> grouped_layout_of_ggml(uint32_t type);
// A block type's name: ggml's ("Q4_K"), or "4-bit g128" for a grouped_rows_type.
std::string block_type_name(uint32_t type);

// The codes' order inside each 32-bit word of a row (little-endian), which the kernels decode
// in pairs of adjacent columns so that x's 32-bit words (two adjacent columns) are their B
// fragments as loaded, with no permutes (ops/cuda/int_decode.cuh): 4-bit, nibble j (bits 4j ..
// 4j + 3) holds column 2j of the word's 8 for j < 4 and column 2(j - 4) + 1 for j >= 4, so that
// nibbles j and j + 4 are columns 2j and 2j + 1; 8-bit, bytes 0-3 hold columns 0, 2, 1, 3.
// grouped_code / set_grouped_code read and write column c of a row in that order (grouped_code
// on the GPU too: the embedding lookup).
KVLM_HD size_t grouped_code_byte(int bits, int64_t c, int& shift) {
  const size_t word = size_t(c) / (32 / size_t(bits)) * 4;
  if (bits == 4) {
    const int p = int(c % 8), nib = (p % 2) * 4 + p / 2;
    shift = 4 * (nib % 2);
    return word + size_t(nib / 2);
  }
  shift = 0;
  const int p = int(c % 4);
  return word + size_t(p == 1 ? 2 : p == 2 ? 1 : p);
}
// Column c's code: 4-bit unsigned (0..15), 8-bit signed (-128..127).
KVLM_HD int grouped_code(int bits, const uint8_t* codes, int64_t c) {
  int shift;
  const uint8_t b = codes[grouped_code_byte(bits, c, shift)];
  return bits == 4 ? (b >> shift) & 0x0F : int(int8_t(b));
}
// Writes column c's code (the low 4 or 8 bits of q) into a row being filled.
inline void set_grouped_code(int bits, uint8_t* codes, int64_t c, int q) {
  int shift;
  uint8_t& b = codes[grouped_code_byte(bits, c, shift)];
  if (bits == 4) b = uint8_t((b & ~(0x0F << shift)) | (q & 0x0F) << shift);
  else b = uint8_t(q);
}

// Bytes of one row's codes (cols * bits / 8) and its number of groups.
inline size_t grouped_code_bytes(GroupedLayout l, int64_t cols) { return size_t(cols) * size_t(l.bits) / 8; }
inline int64_t grouped_groups(GroupedLayout l, int64_t cols) { return cols / l.group; }
// Bytes one row holds on a device: its codes and a 32-bit (scale, offset) word per group.
inline size_t grouped_row_bytes(GroupedLayout l, int64_t cols) {
  return grouped_code_bytes(l, cols) + size_t(grouped_groups(l, cols)) * sizeof(uint32_t);
}

// One row of `cols` values of ggml type `type` (its blocks, row_bytes of them) as codes
// (`grouped_code_bytes`: 4-bit codes two per byte, 8-bit codes one signed byte each, in the
// kernels' order: grouped_code) and the fp32 scale and offset of each group (`grouped_groups`
// of each; for a zero-point layout, the zero point in place of the offset; for E2M1 codes the
// scale 2^(e - 127) and offset 0). Throws kvlm::Error for a type without a layout or cols not a whole number of blocks.
void ggml_row_to_grouped(uint32_t type, const uint8_t* blocks, int64_t cols, uint8_t* codes, float* scales,
                         float* offsets);

// One group's scale and offset in a 16-bit type (bf16 or f16, `type`) as the kernels read
// them: one 32-bit word, the scale in the low half. Rounds to nearest even; throws kvlm::Error
// when either is not finite in that type (an f16 overflow).
uint32_t grouped_param(DType type, float scale, float offset);
// A zero-point layout's word: the scale, and -(M + z) where M is the 4-bit decode's magic
// number (128 in bf16, 1024 in f16), which the decode's first fma adds to M + code: code - z
// exactly, then times s, one rounding. z in 0..16 (GPTQ's stored z - 1 of 15 decodes as 16).
uint32_t grouped_param_zero_point(DType type, float scale, int zero);

// An E2M1 group's word: its scale 2^(e - 127) times 2^126 (bf16) or 2^14 (f16), the factor
// that turns the code's bits, placed in the 16-bit type's exponent and mantissa, into the
// weight (ops/cuda/int_decode.cuh e2m1x8_to_pairs), offset 0. Throws kvlm::Error when that
// multiplier overflows the type (a block scale above 2: E8M0 e > 128, weights up to 24 and
// more, which real MXFP4 checkpoints do not hold); one below f16's range rounds to 0 as the
// weights themselves would in f16.
uint32_t grouped_param_e2m1(DType type, float scale);

// The reference the kernels are tested against: a row of grouped codes with its 32-bit
// parameters (grouped_param) as fp32 values, s * code + b in fp32.
void grouped_dequantize_row(GroupedLayout l, DType param_type, const uint8_t* codes, const uint32_t* params,
                            int64_t cols, std::span<float> out);

}  // namespace kvlm

// Dequantization of ggml's tensor types (the blocks GGUF files store, io/gguf.h) into fp32,
// with the arithmetic of ggml's reference code in the same order (fp32 products, no fused
// multiply-add), so the values equal llama.cpp's and the `gguf` Python package's bit for bit.
//
// Blocks (QK_K = 256), each scale an IEEE half unless noted:
//   Q4_0 {d, 16 bytes of 4-bit q}:        x = (q - 8) d
//   Q4_1 {d, m, 16 bytes of q}:           x = q d + m
//   Q5_0 {d, 32 high bits, 16 bytes}:     x = (q | h << 4) - 16) d
//   Q5_1 {d, m, 32 high bits, 16 bytes}:  x = (q | h << 4) d + m
//   Q8_0 {d, 32 int8}:                    x = q d
//   Q2_K {16 scale/min nibbles, 64 bytes of 2-bit q, d, dmin}: x = (d sc) q - (dmin m)
//   Q3_K {32 bytes high-bit mask, 64 bytes of 2-bit q, 12 bytes of 6-bit scales, d}:
//        x = (d (sc - 32)) (q - (mask bit ? 0 : 4))
//   Q4_K {d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of 4-bit q}, Q5_K (plus 32
//        bytes of high bits): x = (d sc) q - (dmin m), eight sub-blocks of 32
//   Q6_K {128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d}: x = (d sc) (q - 32)
//   MXFP4 {E8M0 byte e, 16 bytes of E2M1 codes}: x = kE2M1[q] 2^(e - 127), exact (code 8, -0,
//        as +0: ggml multiplies the integer twice the value, 0)
#pragma once

#include <cstdint>
#include <span>

namespace kvlm {

// An E2M1 code (sign, 2-bit exponent, 1-bit mantissa; MXFP4's elements) as its value. Twice
// each is an integer, which the CPU's block kernels multiply (ops/cpu/quant_matmul.cpp).
inline constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// Dequantizes `dst.size()` elements of ggml type `type` (a multiple of its block) from
// `src` (exactly their blocks' bytes). F32, F16 and BF16 convert. Throws kvlm::Error for a
// type kvlm does not read or sizes that disagree.
void dequantize_ggml(uint32_t type, std::span<const uint8_t> src, std::span<float> dst);

// Q4_K / Q5_K: scale and min of sub-block j (0-7) from a block's 12 bytes of 6-bit values.
void ggml_k4_scale_min(const uint8_t* scales, int j, int& sc, int& m);
// A block's IEEE half at p (unaligned), as fp32.
float ggml_half(const uint8_t* p);

}  // namespace kvlm

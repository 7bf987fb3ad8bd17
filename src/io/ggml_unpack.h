// Every ggml block type kvlm reads, as one view: a block's integer codes and, per 16 values, a
// scale a and an offset b with w = a q + b. The CPU's scalar block kernels (ops/cpu/quant_matmul)
// compute from it, and the GPU's grouped integer codes (io/grouped_codes.h) are made from it,
// so each type's bit layout is written here once (io/ggml_dequant.cpp states the same layouts
// as values, in ggml's own arithmetic order, which its bit-exact dequantization needs).
#pragma once

#include <cstdint>

namespace kvlm {

// One block (QK_K = 256 values at most): codes in [0, 63], Q8_0's signed; per 16 values w =
// a[g] q + b[g] (Q4_0: a = d, b = -8 d; Q6_K: a = d sc, b = -32 a; Q4_K: b = -dmin m; ...).
struct GgmlUnpacked {
  alignas(32) int8_t q[256];
  alignas(32) float a[16];
  alignas(32) float b[16];
};
using GgmlUnpackFn = void (*)(const uint8_t* block, GgmlUnpacked& u);

void ggml_unpack_q4_0(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q4_1(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q5_0(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q5_1(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q8_0(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q2_k(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q3_k(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q4_k(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q5_k(const uint8_t* block, GgmlUnpacked& u);
void ggml_unpack_q6_k(const uint8_t* block, GgmlUnpacked& u);
// MXFP4: q = 2 x the E2M1 value (an integer in -12..12), a = 2^(e - 128), b = 0: exact.
void ggml_unpack_mxfp4(const uint8_t* block, GgmlUnpacked& u);

// The unpacker of ggml type `type`; nullptr for F32/F16/BF16 and types kvlm does not read.
GgmlUnpackFn ggml_unpacker(uint32_t type);

}  // namespace kvlm

// gemv_int's variant for 1-4 rows of x on the integer pipes (gemv_int_dp4a.cu): x quantized
// to int8 per block of the codes' 16 bytes, the 4- and 8-bit codes multiplied as stored with
// DP4A, each block's sum scaled in fp32. gemv_int calls it where it takes the call
// (KernelSwitches::int_dp4a_max_m); its values differ from the tensor-core GEMV's by x's
// quantization, at most |w| dx / 2 per weight w (dx = a block's max |x| / 127).
#pragma once

#include "core/dtype.h"
#include "ops/cuda/gemm.h"

namespace kvlm::cuda {

inline constexpr int kGemvIntDp4aMaxM = 4;
// A CTA's shared memory for x's codes at most (so that two CTAs share an SM): k up to 81k
// columns at m = 1, 20k at m = 3-4.
inline constexpr size_t kGemvIntDp4aMaxSmem = 100 * 1024;

// Whether gemv_int_dp4a can take this call: 1 <= m <= the switch's maximum, bf16 / f16, 4-bit
// codes (affine, zero point, E2M1) or 8-bit ones, groups a power of two of 16-byte vectors, x's
// codes within kGemvIntDp4aMaxSmem, DP4A (sm_61+).
bool gemv_int_dp4a_takes(DType ab, const IntWeight& w, int m, int k);
// Whether it is the faster kernel for m rows of x and an n x k weight (what gemv_int and
// gemv_int_experts run where it can take the call). Each CTA quantizes all of x, which long rows
// at several rows of x pay for: on the H200's Qwen3-8B shapes it wins at m = 1 up to k = 12288
// (1.1-1.5x; 8192 x 16384 0.92x), and at m = 3-4 only for wide matrices (n >= 4k: gate_up, the
// LM head; qkv, o and down lose 15-60%). m = 2 takes m = 1's rule: alone, down (k = 12288) was
// 10% faster on the tensor cores, but the Q4_K_M Qwen3-8B step at batch 2 measured 2.95 ms with
// DP4A there and 3.29 ms without (docs/results/weights-4bit.md). Always true with
// KernelSwitches::int_dp4a_by_shape off.
bool gemv_int_dp4a_pays(int m, int n, int k);
// gemv_int's contract (x, bias, y, ldy, out) for a call gemv_int_dp4a_takes; throws otherwise.
// With ex.expert set, gemv_int_experts' (m: the most rows a tile holds; y [*][ldy]).
void gemv_int_dp4a(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
                   int n, int k, void* stream, const IntExpertTiles& ex = {});

}  // namespace kvlm::cuda

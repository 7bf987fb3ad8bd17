// Warp-level tensor-core and async-copy primitives shared by the attention kernels
// (paged_attention_mma.cuh, paged_attention_prefill.cu) and the small-m GEMV (gemv.cu).
#pragma once

#include <cstdint>

namespace kvlm::cuda::mma {

// c += a . b, mma.sync m16n8k16 with fp32 accumulation; a: 4 registers (A fragment), b0, b1:
// the B fragment, each register two 16-bit values (bf16 when kBF16, else f16).
template <bool kBF16>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// c += a . b, mma.sync m16n8k32 over 8-bit integers with exact int32 accumulation: a (A
// fragment, 4 registers of 4 unsigned bytes: rows g / g + 8, k = 4t.. and 16 + 4t..), b0, b1
// (B fragment, 4 signed bytes each: k = 4t.. and 16 + 4t.., n = g).
__device__ __forceinline__ void imma16832_u8s8(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The transpose of an 8x8 matrix of 16-bit values held as a warp's fragment (thread lane holds
// row lane / 4, columns 2 (lane % 4) and 2 (lane % 4) + 1, low half first): after the call it
// holds the same positions of the transpose (movmatrix, sm_75+).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
  return r;
}

// 16 bytes global -> shared (cp.async.cg: through L2 only); src_bytes < 16 zero-fills the rest
// (0: the source is not read). dst is a shared-memory address (__cvta_generic_to_shared).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, src_bytes);
}
// 4 bytes global -> shared (cp.async.ca; 4-byte aligned).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
// The same with src_bytes 0 or 4: 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// A whole 16-byte copy at constant offsets from a shared-memory address and a global pointer
// held in registers: the offsets go into the instruction, so a run of copies costs one
// instruction each (no per-copy address arithmetic, no source-size operand).
template <int DOFF, int SOFF>
__device__ __forceinline__ void cp_async16_at(uint32_t dst, const char* src) {
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%3], 16;\n" ::"r"(dst), "l"(src), "n"(DOFF), "n"(SOFF));
}

// Four 8x8 matrices of 16-bit values from shared memory (ldmatrix .x4): lanes 8i..8i+7 give
// the 16-byte rows of matrix i, and register i receives matrix i as an mma fragment (lane l:
// row l / 4, values 2 (l % 4) and 2 (l % 4) + 1). _trans: each matrix transposed.
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

}  // namespace kvlm::cuda::mma

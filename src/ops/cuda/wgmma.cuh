// Hopper warpgroup MMA (wgmma, sm_90a only) wrappers for the tiled prefill kernel
// (paged_attention_prefill_wgmma.cu) and the small-batch FP8 GEMM (gemm_fp8_small.cu). Callers compile them only where __CUDA_ARCH_FEAT_SM90_ALL is
// defined (sm_90a code); the PTX is in the PTX ISA's "Asynchronous Warpgroup Level Matrix
// Multiply-Accumulate" chapter.
//
// Shared-memory operands are described by 64-bit matrix descriptors; every tile here uses
// the 128-byte swizzle: rows of 64 16-bit values (128 B), 8-row groups of 1024 B (1024-B
// aligned), the 16-byte chunk c of row r stored at c ^ (r % 8). A K-major operand (rows x
// 16 contiguous k values per instruction) is addressed by its start (advanced by 32 B per
// k-step inside a 128-B row, by a whole 64-column block beyond) and the 8-row group stride
// (SBO, 1024 B); an MN-major operand (k rows of N contiguous values, transposed on read)
// also needs the stride between 64-wide N blocks (LBO).
#pragma once

#include <cstdint>

namespace kvlm::cuda::wgmma {

__device__ __forceinline__ uint64_t desc_sw128(const void* smem, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t d = uint64_t((a & 0x3FFFFu) >> 4);
  d |= uint64_t((lbo_bytes >> 4) & 0x3FFFu) << 16;
  d |= uint64_t((sbo_bytes >> 4) & 0x3FFFu) << 32;
  d |= uint64_t(1) << 62;  // swizzle mode 1: 128 B
  return d;
}

// Orders this thread's register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to the async
// proxy wgmma reads through: each writing thread, before the barrier that publishes them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// The compiler sees a wgmma's accumulators written when the instruction issues; they are
// written when wait() returns. Passing each register through an empty asm after wait() (and
// the A fragments, which must stay untouched until then) pins the order.
__device__ __forceinline__ void fence_operand(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_operand(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// D[64 x N] (+)= A[64 x 16] B[16 x N], fp32 accumulators (N / 2 per thread), operands
// bf16 (kBF) or f16. ss: A and B from shared memory through descriptors, B K-major (the K
// tile: keys x dims). rs: A from registers (the P fragments), B MN-major through a transposed
// descriptor (the V tile: keys x dims, dims contiguous). scale_d = 0 overwrites D.
// The accumulator operand lists, %0 .. %15, %0 .. %31 or %0 .. %63:
#define KVLM_WGMMA_D16                                                                                                 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),          \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define KVLM_WGMMA_D32                                                                                                 \
  KVLM_WGMMA_D16, "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]),         \
      "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),         \
      "+f"(d[31])
#define KVLM_WGMMA_D64                                                                                                 \
  KVLM_WGMMA_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),         \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),         \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),         \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),         \
      "+f"(d[63])
#define KVLM_WGMMA_R16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KVLM_WGMMA_R32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KVLM_WGMMA_R64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
// One instruction as PTX text: SHAPE (m64nNk16), TYPE (bf16 / f16), R the accumulators'
// register list, PRED the operand holding scale_d, OPS the A and B operands and immediates.
#define KVLM_WGMMA(SHAPE, TYPE, R, PRED, OPS) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\nwgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " " R ", " OPS ";\n}\n"

// The instruction for the operand type kBF picks (bf16 or f16), the operands the same either
// way: OUTS the accumulator list, the rest the inputs.
#define KVLM_WGMMA_TYPED(SHAPE, R, PRED, OPS, OUTS, ...)                                     \
  if constexpr (kBF) asm volatile(KVLM_WGMMA(SHAPE, "bf16", R, PRED, OPS) : OUTS : __VA_ARGS__); \
  else asm volatile(KVLM_WGMMA(SHAPE, "f16", R, PRED, OPS) : OUTS : __VA_ARGS__)

template <int N, bool kBF>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int scale_d) {
  static_assert(N == 64 || N == 128, "S tiles are 64 or 128 keys wide");
  if constexpr (N == 64) {
    KVLM_WGMMA_TYPED("m64n64k16", KVLM_WGMMA_R32, "%34", "%32, %33, p, 1, 1, 0, 0", KVLM_WGMMA_D32, "l"(da), "l"(db),
                     "r"(scale_d));
  } else {
    KVLM_WGMMA_TYPED("m64n128k16", KVLM_WGMMA_R64, "%66", "%64, %65, p, 1, 1, 0, 0", KVLM_WGMMA_D64, "l"(da), "l"(db),
                     "r"(scale_d));
  }
}
template <int N, bool kBF>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db, int scale_d) {
  static_assert(N == 64 || N == 128, "head sizes 64 and 128");
  if constexpr (N == 64) {
    KVLM_WGMMA_TYPED("m64n64k16", KVLM_WGMMA_R32, "%37", "{%32, %33, %34, %35}, %36, p, 1, 1, 1", KVLM_WGMMA_D32,
                     "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  } else {
    KVLM_WGMMA_TYPED("m64n128k16", KVLM_WGMMA_R64, "%69", "{%64, %65, %66, %67}, %68, p, 1, 1, 1", KVLM_WGMMA_D64,
                     "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
  }
}

// D[64 x N] (+)= A[64 x 32] B[32 x N] over FP8 E4M3 codes, fp32 accumulators (N / 2 per
// thread, laid out as for 16-bit operands): A and B both K-major in shared memory (FP8 wgmma
// takes no transposed operand; rows of 128 codes, 128-byte swizzle), scale_d = 0 overwrites D.
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float* d, uint64_t da, uint64_t db, int scale_d) {
  static_assert(N == 32 || N == 64, "x tiles of 32 or 64 rows");
  if constexpr (N == 32)
    asm volatile(KVLM_WGMMA("m64n32k32", "e4m3", KVLM_WGMMA_R16, "%18", "%16, %17, p, 1, 1")
                 : KVLM_WGMMA_D16
                 : "l"(da), "l"(db), "r"(scale_d));
  else
    asm volatile(KVLM_WGMMA("m64n64k32", "e4m3", KVLM_WGMMA_R32, "%34", "%32, %33, p, 1, 1")
                 : KVLM_WGMMA_D32
                 : "l"(da), "l"(db), "r"(scale_d));
}

#undef KVLM_WGMMA_TYPED
#undef KVLM_WGMMA
#undef KVLM_WGMMA_R64
#undef KVLM_WGMMA_R32
#undef KVLM_WGMMA_R16
#undef KVLM_WGMMA_D64
#undef KVLM_WGMMA_D32
#undef KVLM_WGMMA_D16

}  // namespace kvlm::cuda::wgmma

// Linear layers over FP8 E4M3 weights (gemm.h: Fp8Weight).
//
// Three kernels stream the weight's codes, one byte per weight, for m <= kGemvFp8MaxM rows of x
// (decode at batch 1-16): at small batches a decode step is the weight stream, so reading half
// of a bf16 weight's bytes is the whole speed-up FP8 weights promise.
//
// - The FMA kernels (m <= kGemvMaxM per pass): like gemv.cu's rows kernel, a warp owns 2 rows
//   and walks their k range with 16-byte loads that bypass L1, 4 per row per lane in flight; or,
//   like its split kernel, a CTA owns 8 rows and its threads split k. Codes
//   expand to f16 pairs (cvt.rn.f16x2.e4m3x2 on sm_89+), then fp32; sums are fp32. A row's
//   scale (per tensor or per channel: scale_block = k) multiplies its sum once at the end;
//   block scales (scale_block = 128 for the block-wise formats) multiply each 16-value partial
//   as it is added (scale_block % 16 == 0; the last block of a row may be partial). It does m
//   multiply-adds per weight, so it slows down as m grows, and above 4 rows it takes several
//   passes over the weight (the fallback for layouts the tensor-core kernel does not take).
// - The tensor-core kernel (m <= 16, one pass): see gemv_fp8_mma_kernel below.
// Larger m: fp8_quantize.cu quantizes the activations per token (per 128-value group for block
// scales) for an FP8 tensor-core GEMM (gemm_fp8_small.cu up to m = 64 for row-scaled weights on
// Hopper, else Gemm::linear_fp8, cuBLASLt); where neither fits, dequantize_fp8 writes the weight
// in the compute type into a scratch buffer and the 16-bit GEMM runs on it.
#include <cuda_fp8.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/numeric.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/kv_codec.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kFp8Rows = 2, kFp8Unroll = 4;  // 4 vectors of 16 codes per row per lane in flight (8: slower, H200)

// 16 e4m3 codes -> 16 floats (exact), by the KV codec's decoder (kv_codec.cuh FmtE4M3).
__device__ __forceinline__ void decode16(const uint4& v, float* f) {
  using E4M3 = FmtE4M3<Scale::None>;
  E4M3::decode8(make_uint2(v.x, v.y), f);
  E4M3::decode8(make_uint2(v.z, v.w), f + 8);
}

template <class V, int M, bool kF32Out, bool kBlock>
__global__ void __launch_bounds__(kGemvThreads) gemv_fp8_kernel(const uint16_t* x, const uint8_t* w, const float* scales,
                                                                int scale_block, const uint16_t* bias, void* y, int n, int k) {
  constexpr int R = kFp8Rows, U = kFp8Unroll;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (int(blockIdx.x) * (kGemvThreads / 32) + warp) * R;
  if (row0 >= n) return;  // warp-uniform
  const int nrows = min(R, n - row0);
  const int kv = k / 16;                 // 16-byte vectors of codes per row
  const int nb = (k + scale_block - 1) / scale_block;  // scales per row (the last block may be partial)
  const int vpb = scale_block / 16;      // vectors per scale block
  const uint4* wr[R];
  const float* sr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = row0 + min(j, nrows - 1);
    wr[j] = reinterpret_cast<const uint4*>(w + size_t(row) * size_t(k));
    sr[j] = scales + size_t(row) * size_t(nb);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[R][M] = {};
  for (int base = lane; base < kv; base += 32 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < R; ++j) wv[u][j] = base + u * 32 < kv ? ld_stream(wr[j] + base + u * 32) : make_uint4(0, 0, 0, 0);
    if (base == lane) pdl_wait();  // x is the previous kernel's output; w is not
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * 32;
      if (i >= kv) break;
      float wf[R][16];
#pragma unroll
      for (int j = 0; j < R; ++j) decode16(wv[u][j], wf[j]);
      float bs[R];
      if constexpr (kBlock)
#pragma unroll
        for (int j = 0; j < R; ++j) bs[j] = __ldg(sr[j] + i / vpb);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float xf[16];
        load_x<V, false>(xv, k / 8, r, 2 * i, xf);
        load_x<V, false>(xv, k / 8, r, 2 * i + 1, xf + 8);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < 16; ++e) part = fmaf(wf[j][e], xf[e], part);
          acc[j][r] = kBlock ? fmaf(part, bs[j], acc[j][r]) : acc[j][r] + part;
        }
      }
    }
  }
  allow_dependents();  // the weights are read: let the next kernel launch
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], o);
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (j < nrows) {
        const float s = kBlock ? 1.0f : __ldg(sr[j]);
#pragma unroll
        for (int r = 0; r < M; ++r) store_out<V, M, kF32Out>(y, n, row0 + j, r, acc[j][r] * s, bias);
      }
}

// The split FMA kernel (as gemv.cu's split kernel): a CTA owns 8 rows and its 256 threads split
// their k range, 16 codes per row per thread, 2 vectors per row in flight (16 loads per thread),
// then add across warps in shared memory. For few rows of long k (qkv, o, down at m = 1), where
// the rows kernel's warps walk long dependent chains over too few CTAs.
constexpr int kFp8SplitRows = 8, kFp8SplitUnroll = 2;

template <class V, int M, bool kF32Out, bool kBlock>
__global__ void __launch_bounds__(kGemvThreads) gemv_fp8_split_kernel(const uint16_t* x, const uint8_t* w,
                                                                      const float* scales, int scale_block,
                                                                      const uint16_t* bias, void* y, int n, int k) {
  constexpr int R = kFp8SplitRows, U = kFp8SplitUnroll;
  const int row0 = int(blockIdx.x) * R;
  const int nrows = min(R, n - row0);
  const int kv = k / 16;
  const int nb = (k + scale_block - 1) / scale_block;
  const int vpb = scale_block / 16;
  const uint4* wr[R];
  const float* sr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = row0 + min(j, nrows - 1);
    wr[j] = reinterpret_cast<const uint4*>(w + size_t(row) * size_t(k));
    sr[j] = scales + size_t(row) * size_t(nb);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[R][M] = {};
  for (int base = threadIdx.x; base < kv; base += kGemvThreads * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < R; ++j)
        wv[u][j] = base + u * kGemvThreads < kv ? ld_stream(wr[j] + base + u * kGemvThreads) : make_uint4(0, 0, 0, 0);
    if (base == int(threadIdx.x)) pdl_wait();
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * kGemvThreads;
      if (i >= kv) break;
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float xf[16];
        load_x<V, false>(xv, k / 8, r, 2 * i, xf);
        load_x<V, false>(xv, k / 8, r, 2 * i + 1, xf + 8);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          float wf[16];
          decode16(wv[u][j], wf);
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < 16; ++e) part = fmaf(wf[e], xf[e], part);
          acc[j][r] = kBlock ? fmaf(part, __ldg(sr[j] + i / vpb), acc[j][r]) : acc[j][r] + part;
        }
      }
    }
  }
  allow_dependents();
  __shared__ float part[kGemvThreads / 32][R * M];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int r = 0; r < M; ++r) {
      float v = acc[j][r];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) part[warp][j * M + r] = v;
    }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int j = threadIdx.x / M, r = threadIdx.x % M;
    if (j < nrows) {
      float v = 0.0f;
#pragma unroll
      for (int wi = 0; wi < kGemvThreads / 32; ++wi) v += part[wi][threadIdx.x];
      if constexpr (!kBlock) v *= __ldg(scales + size_t(row0 + j));  // one scale per row (nb == 1)
      store_out<V, M, kF32Out>(y, n, row0 + j, r, v, bias);
    }
  }
}

template <class V, bool kF32Out, bool kBlock>
void launch_fp8(bool split, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k,
                cudaStream_t st) {
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* bs = static_cast<const uint16_t*>(bias);
  const dim3 grid = split ? dim3(unsigned((n + kFp8SplitRows - 1) / kFp8SplitRows))
                          : dim3(unsigned((n + kFp8Rows * kGemvThreads / 32 - 1) / (kFp8Rows * kGemvThreads / 32)));
  const dim3 block(kGemvThreads);
  switch (m) {
#define KVLM_FP8_M(M)                                                                                                 \
  case M:                                                                                                            \
    if (split)                                                                                                       \
      KVLM_CUDA_CHECK(launch_pdl<gemv_fp8_split_kernel<V, M, kF32Out, kBlock>>(grid, block, 0, st, xs, w.codes,      \
                                                                               w.scales, w.scale_block, bs, y, n, k)); \
    else                                                                                                             \
      KVLM_CUDA_CHECK(launch_pdl<gemv_fp8_kernel<V, M, kF32Out, kBlock>>(grid, block, 0, st, xs, w.codes, w.scales,  \
                                                                         w.scale_block, bs, y, n, k));               \
    break;
    KVLM_FP8_M(1)
    KVLM_FP8_M(2)
    KVLM_FP8_M(3)
    KVLM_FP8_M(4)
#undef KVLM_FP8_M
  }
}

template <class V>
void launch_fp8_any(bool split, bool f32, bool block, const void* x, const Fp8Weight& w, const void* bias, void* y,
                    int m, int n, int k, cudaStream_t st) {
  if (f32) {
    if (block) launch_fp8<V, true, true>(split, x, w, bias, y, m, n, k, st);
    else launch_fp8<V, true, false>(split, x, w, bias, y, m, n, k, st);
  } else {
    if (block) launch_fp8<V, false, true>(split, x, w, bias, y, m, n, k, st);
    else launch_fp8<V, false, false>(split, x, w, bias, y, m, n, k, st);
  }
}

// The tensor-core kernel (m = 1-16 in one pass): y^T = w . x^T as mma.sync m16n8k16 with
// 16-row tiles of the weight as A and the rows of x as B (one 8-column B tile for m <= 8, two
// for m <= 16), in the activations' own type: bf16 MMAs for bf16 x (every e4m3 value is exact
// in bf16, and bf16 keeps x's range: Gemma's activations overflow f16), f16 MMAs for f16 x;
// fp32 accumulators. Layout of the work:
//  - A CTA owns 64 weight rows (4 tiles), so the x fragments a warp loads serve 64 rows: x's
//    traffic from L2 is a quarter of the weights' at m <= 8, half at m = 16 (with 16-row CTAs,
//    as the bf16 kernel in gemv.cu has, it would equal the weights' at m = 8: FP8 weights are
//    half the bytes per row). Its 8 warps, and the CTAs of a thread-block cluster along
//    gridDim.y (1-8, chosen so that the grid fills the GPU: the 4096-row matrices have only 64
//    row blocks), split k in 64-wide rounds: worker (CTA of the cluster, warp) takes rounds
//    worker + i * workers.
//  - Each warp streams its rounds through a 3-deep cp.async ring in shared memory, 4 KB a
//    round, 2 rounds in flight: lane (g = lane / 4, t = lane % 4) copies, for each tile, the 16
//    codes at k0 + 16 t of rows g and g + 8 (a warp's copy instruction covers 8 rows x 64
//    contiguous bytes) and reads back exactly what it copied (512 contiguous bytes per warp
//    instruction: no bank conflicts), so the ring only holds bytes in flight.
//  - A dot product is invariant under a permutation of k applied to both sides, so each 32-bit
//    word of 4 codes (k0 + 16 t + 4 v + 0..3) is one MMA's k slice for its lane: the codes go
//    to 16-bit pairs by bit moves (sign and exponent/mantissa shifted into place: codes 0 and
//    2 of the word form one register, 1 and 3 the other), then one multiply by 2^120 (bf16) or
//    2^8 (f16) restores the exponent bias (exact: every e4m3 value, subnormals included, is a
//    normal bf16 / f16); x's matching pairs are two byte permutes of its 16-byte loads.
//  - Scales: one per row multiplies the finished sum; block scales (a multiple of 64 columns,
//    so a round lies in one block: the 128 x 128 formats) multiply each round's partial tile
//    as it is added to the total.
//  - The 8 warps add their partial tiles in shared memory; the cluster's CTAs then each finish
//    64 / splits rows, reading the other CTAs' sums through distributed shared memory.
constexpr int kTcRound = 64;     // k per round
constexpr int kTcWarps = kGemvThreads / 32;
constexpr int kTcMaxSplits = 8;  // the portable cluster size

// RT 16-row tiles per CTA (4: 64 rows, 3 ring stages of 4 KB per warp, 2 CTAs per SM; 2: 32
// rows, 4 stages of 2 KB, 3 CTAs per SM; 1: 16 rows, 4 stages of 1 KB, 4 CTAs per SM).
template <int RT>
struct TcCfg {
  static constexpr int kRows = 16 * RT, kStages = RT >= 4 ? 3 : 4, kStageBytes = RT * 2 * 32 * 16;
  static constexpr int kSmem = kTcWarps * kStages * kStageBytes;
};
// CTAs per SM the register budget is cut for (the ring allows 2 / 3 / 4 at RT 4 / 2 / 1; a
// second B tile, m > 8, needs more registers: one CTA fewer where that avoids spills).
constexpr int tc_min_blocks(int rt, int nt) { return rt >= 4 ? 2 : rt == 2 ? (nt == 2 ? 2 : 3) : (nt == 2 ? 3 : 4); }

// 4 e4m3 codes (code 0 in the low byte) -> 16-bit pairs {code 0, code 2} and {code 1, code 3},
// exact: bf16 (kBF16) or f16.
template <bool kBF16>
__device__ __forceinline__ void e4m3x4_to_pairs(uint32_t q, uint32_t& even, uint32_t& odd) {
  // A code in the high byte of a 16-bit half, s eeee mmm, becomes s 0..0eeee mmm0..0: the value
  // times 2^-120 (bf16: 8 exponent bits, bias 127) or 2^-8 (f16: 5, bias 15), subnormals too.
  constexpr int kShift = kBF16 ? 4 : 1;
  const uint32_t q8 = q << 8;
  const uint32_t o = (q & 0x80008000u) | ((q & 0x7f007f00u) >> kShift);
  const uint32_t e = (q8 & 0x80008000u) | ((q8 & 0x7f007f00u) >> kShift);
  constexpr uint32_t kBias = kBF16 ? 0x7b807b80u : 0x5c005c00u;  // 2^120 / 2^8 in both halves
  constexpr uint32_t kNegZero = 0x80008000u;
  if constexpr (kBF16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(even) : "r"(e), "r"(kBias), "r"(kNegZero));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(odd) : "r"(o), "r"(kBias), "r"(kNegZero));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(even) : "r"(e), "r"(kBias), "r"(kNegZero));
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(odd) : "r"(o), "r"(kBias), "r"(kNegZero));
  }
}

template <class V, int NT, int RT, bool kF32Out, bool kBlock>
__global__ void __launch_bounds__(kGemvThreads, tc_min_blocks(RT, NT))
    gemv_fp8_mma_kernel(const uint16_t* x, const uint8_t* w, const float* scales, int scale_block, const uint16_t* bias,
                        void* y, int m, int n, int k) {
  using Cfg = TcCfg<RT>;
  constexpr int S = Cfg::kStages, NW = kTcWarps, C = NT * 8, kTcRows = Cfg::kRows, kTcStageBytes = Cfg::kStageBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = int(blockIdx.x) * kTcRows;
  const int splits = int(gridDim.y), workers = splits * NW, worker = int(blockIdx.y) * NW + warp;
  const int kr = (k + kTcRound - 1) / kTcRound;
  const int rounds = worker < kr ? (kr - worker + workers - 1) / workers : 0;
  const int nb = (k + scale_block - 1) / scale_block;
  extern __shared__ uint4 gemv_fp8_smem[];
  char* const ring = reinterpret_cast<char*>(gemv_fp8_smem) + warp * S * kTcStageBytes;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  int rows[RT][2];  // the lane's weight rows (clamped to n - 1: rows past n are read, never stored)
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) rows[j][h] = min(row0 + 16 * j + 8 * h + g, n - 1);
  // The lane's rows at its first code (k = 16 t), computed once: a round's copies then cost one
  // 64-bit add each (the full address per copy was a third of the loop's instructions).
  const uint8_t* src[RT][2];
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) src[j][h] = w + size_t(rows[j][h]) * size_t(k) + min(16 * t, k - 16);  // in bounds
  auto issue = [&](int i) {
    if (i < rounds) {
      const int k0 = (worker + i * workers) * kTcRound;
      const bool ok = k0 + 16 * t < k;  // k % 16 == 0: a lane's 16 codes are all in or all out
      const int off = ok ? k0 : 0;      // (a copy of 0 bytes reads nothing, but keep it in bounds)
      const uint32_t dst = ring_s + (i % S) * kTcStageBytes;
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma::cp_async16(dst + (2 * j + h) * 512, src[j][h] + off, ok ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  pdl_wait();  // x is the previous kernel's output; w is not
  const uint16_t* xr[NT];
  bool xon[NT];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    xon[q] = g + 8 * q < m;
    xr[q] = x + size_t(min(g + 8 * q, m - 1)) * size_t(k) + 16 * t;
  }
  // x's 16 values at the lane's codes of round i, and round i's block scales of the lane's rows:
  // loaded one round ahead (their L2 latency would otherwise stall every round).
  auto load_x = [&](int i, uint32_t (&xw)[NT][8]) {
    const int k0 = (worker + i * workers) * kTcRound;
    const bool ok = i < rounds && k0 + 16 * t < k;
#pragma unroll
    for (int q = 0; q < NT; ++q) {
      uint4 a = make_uint4(0, 0, 0, 0), b = a;
      if (xon[q] && ok) {
        a = __ldg(reinterpret_cast<const uint4*>(xr[q] + k0));
        b = __ldg(reinterpret_cast<const uint4*>(xr[q] + k0 + 8));
      }
      xw[q][0] = a.x, xw[q][1] = a.y, xw[q][2] = a.z, xw[q][3] = a.w;
      xw[q][4] = b.x, xw[q][5] = b.y, xw[q][6] = b.z, xw[q][7] = b.w;
    }
  };
  auto load_sc = [&](int i, float (&sc)[kBlock ? RT : 1][2]) {
    if constexpr (kBlock) {
      // scale_block % kTcRound == 0: the round is in one block
      const int blk = i < rounds ? (worker + i * workers) * kTcRound / scale_block : 0;
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) sc[j][h] = __ldg(scales + size_t(rows[j][h]) * size_t(nb) + size_t(blk));
    }
  };
  float acc[RT][NT][4] = {}, tot[kBlock ? RT : 1][NT][4] = {};
  uint32_t xw[NT][8];
  float sc[kBlock ? RT : 1][2];
  load_x(0, xw);
  load_sc(0, sc);
  for (int i = 0; i < rounds; ++i) {
    uint32_t xn[NT][8];
    float sn[kBlock ? RT : 1][2];
    load_x(i + 1, xn);
    load_sc(i + 1, sn);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncwarp();
    issue(i + S - 1);  // refills the slot read in round i - 1
    // x's B fragments: word v of the lane's codes is k0 + 16 t + 4 v + (0, 1, 2, 3); the even
    // register pairs codes 0 and 2, the odd one 1 and 3, and so must x.
    uint32_t bx[NT][4][2];
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        bx[q][v][0] = __byte_perm(xw[q][2 * v], xw[q][2 * v + 1], 0x5410);
        bx[q][v][1] = __byte_perm(xw[q][2 * v], xw[q][2 * v + 1], 0x7632);
      }
    const char* slot = ring + (i % S) * kTcStageBytes + lane * 16;
#pragma unroll
    for (int j = 0; j < RT; ++j) {
      const uint4 lo = *reinterpret_cast<const uint4*>(slot + (2 * j) * 512);
      const uint4 hi = *reinterpret_cast<const uint4*>(slot + (2 * j + 1) * 512);
      const uint32_t lw[4] = {lo.x, lo.y, lo.z, lo.w}, hw[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint32_t a[4];  // A fragment: row g (k 2t..), row g + 8, row g (k 2t + 8..), row g + 8
        e4m3x4_to_pairs<V::kBF16>(lw[v], a[0], a[2]);
        e4m3x4_to_pairs<V::kBF16>(hw[v], a[1], a[3]);
#pragma unroll
        for (int q = 0; q < NT; ++q) mma::mma16816<V::kBF16>(acc[j][q], a, bx[q][v][0], bx[q][v][1]);
      }
    }
    if constexpr (kBlock) {
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int q = 0; q < NT; ++q)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            tot[j][q][e] = fmaf(acc[j][q][e], sc[j][e >> 1], tot[j][q][e]);
            acc[j][q][e] = 0.0f;
          }
    }
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 8; ++e) xw[q][e] = xn[q][e];
    if constexpr (kBlock)
#pragma unroll
      for (int j = 0; j < RT; ++j) sc[j][0] = sn[j][0], sc[j][1] = sn[j][1];
    __syncwarp();  // every lane has read this slot before it is refilled
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the weights are read
  // acc[j][q][e]: weight row 16 j + g + 8 (e >> 1), x row 8 q + 2 t + (e & 1). The warps'
  // partial tiles reuse the ring, then their sum goes to red [kTcRows][C].
  __syncthreads();
  float* const part = reinterpret_cast<float*>(gemv_fp8_smem);
  float* const red = part + NW * kTcRows * C;
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        part[(warp * kTcRows + 16 * j + g + 8 * (e >> 1)) * C + 8 * q + 2 * t + (e & 1)] =
            kBlock ? tot[kBlock ? j : 0][q][e] : acc[j][q][e];
  __syncthreads();
  for (int idx = int(threadIdx.x); idx < kTcRows * C; idx += kGemvThreads) {
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < NW; ++wi) v += part[wi * kTcRows * C + idx];
    red[idx] = v;
  }
  cluster_sync(splits);  // every CTA's sums are in its shared memory
  const int rank = cluster_rank(splits), per = kTcRows / splits;
  for (int idx = int(threadIdx.x); idx < per * m; idx += kGemvThreads) {
    const int rr = rank * per + idx / m, r = idx % m, row = row0 + rr;
    if (row >= n) continue;
    float v = red[rr * C + r];
    for (int s = 0; s < splits; ++s)
      if (s != rank) v += cluster_peer(red, s)[rr * C + r];
    if constexpr (!kBlock) v *= __ldg(scales + size_t(row));  // one scale per row (nb == 1)
    store_out<V, 1, kF32Out>(y, n, row, r, v, bias);
  }
  if (splits > 1) cluster_sync(splits);  // no CTA leaves while another reads its sums
}

struct TcLaunch {
  int tiles = 0, splits = 0, slots = 0, row_blocks = 0;
};
thread_local TcLaunch g_last_tc;  // this thread's last tensor-core launch (gemv_fp8_last_launch, for the lab)

// The cluster split for n x k (KernelSwitches::fp8_tc_splits forces one). Measured on an H200
// (docs/results/kernel-lab.md, "FP8 tensor-core GEMV"), a split costs more than the idle SMs
// of a grid under one wave it would fill: 8 CTAs per cluster ran every Qwen3-8B shape slowest,
// and even the 64 x 4096-row blocks of o / down ran best split 2 ways, not 4. So: 2 where the
// grid has fewer row blocks than SMs and each warp keeps at least 2 rounds, else 1.
int tc_splits(int rows_per_cta, int n, int k) {
  if (compute_capability() < 90) return 1;  // no thread-block clusters
  if (const int forced = kernel_switches().fp8_tc_splits; forced > 0) return std::min(forced, kTcMaxSplits);
  const int blocks = (n + rows_per_cta - 1) / rows_per_cta, kr = (k + kTcRound - 1) / kTcRound;
  return blocks < sm_count() && kr >= 2 * kTcWarps * 2 ? 2 : 1;
}

template <class V, int NT, int RT, bool kF32Out, bool kBlock>
void launch_fp8_mma(const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k, cudaStream_t st) {
  using Cfg = TcCfg<RT>;
  constexpr auto kernel = gemv_fp8_mma_kernel<V, NT, RT, kF32Out, kBlock>;
  const int slots = resident_ctas<kernel, Cfg::kSmem>();  // also opts the kernel in to its shared memory
  const int splits = tc_splits(Cfg::kRows, n, k);
  const dim3 grid(unsigned((n + Cfg::kRows - 1) / Cfg::kRows), unsigned(splits));
  KVLM_CUDA_CHECK(launch_pdl_cluster<kernel>(grid, dim3(kGemvThreads), Cfg::kSmem, st, splits,
                                             static_cast<const uint16_t*>(x), w.codes, w.scales, w.scale_block,
                                             static_cast<const uint16_t*>(bias), y, m, n, k));
  g_last_tc = {RT, splits, slots, int(grid.x)};
}

template <class V>
void launch_fp8_mma_any(bool f32, bool block, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n,
                        int k, cudaStream_t st) {
  auto go = [&](auto nt, auto rt) {
    constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
    if (f32) {
      if (block) launch_fp8_mma<V, NT, RT, true, true>(x, w, bias, y, m, n, k, st);
      else launch_fp8_mma<V, NT, RT, true, false>(x, w, bias, y, m, n, k, st);
    } else {
      if (block) launch_fp8_mma<V, NT, RT, false, true>(x, w, bias, y, m, n, k, st);
      else launch_fp8_mma<V, NT, RT, false, false>(x, w, bias, y, m, n, k, st);
    }
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  // Tiles (measured as for tc_splits): 32-row CTAs where they give 1.4 CTAs per SM or more
  // (qkv, gate_up, lm_head), else 64-row CTAs split 2 ways (o, down).
  int tiles = kernel_switches().fp8_tc_tiles;
  if (tiles == 0) tiles = (n + 31) / 32 >= sm_count() * 7 / 5 ? 2 : 4;
  if (m <= 8) tiles == 1 ? go(I1{}, I1{}) : tiles == 2 ? go(I1{}, I2{}) : go(I1{}, I4{});
  else tiles == 1 ? go(I2{}, I1{}) : tiles == 2 ? go(I2{}, I2{}) : go(I2{}, I4{});
}

// One thread per 16 codes (vector i of the row-major [n][k] codes, 32-bit indices: n * k / 16
// fits): out = code * scale of (row, column block), rounded once to the compute type, stored as
// two 16-byte vectors.
template <bool kBF>
__global__ void dequantize_fp8_kernel(const uint4* codes, const float* scales, int nb, int scale_block, uint4* out,
                                      int total, int kv) {
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= total) return;
  const int row = i / kv, c0 = (i - row * kv) * 16;
  const float s = scales[size_t(row) * size_t(nb) + size_t(c0 / scale_block)];
  float f[16];
  decode16(codes[i], f);
  uint32_t p[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float a = f[2 * e] * s, b = f[2 * e + 1] * s;
    const uint32_t lo = kBF ? __bfloat16_as_ushort(__float2bfloat16_rn(a)) : __half_as_ushort(__float2half_rn(a));
    const uint32_t hi = kBF ? __bfloat16_as_ushort(__float2bfloat16_rn(b)) : __half_as_ushort(__float2half_rn(b));
    p[e] = lo | hi << 16;
  }
  out[2 * size_t(i)] = make_uint4(p[0], p[1], p[2], p[3]);
  out[2 * size_t(i) + 1] = make_uint4(p[4], p[5], p[6], p[7]);
}

}  // namespace

bool fp8_weights_supported(int compute_capability) { return compute_capability >= 89; }

bool fp8_layout_fits(int k, int scale_block) { return k > 0 && k % 16 == 0 && scale_block > 0 && scale_block % 16 == 0; }

std::string gemv_fp8_last_launch() {
  const TcLaunch& l = g_last_tc;
  return "tiles " + std::to_string(l.tiles) + ", splits " + std::to_string(l.splits) + ", grid " +
         std::to_string(l.row_blocks) + " x " + std::to_string(l.splits) + ", " + std::to_string(l.slots) +
         " resident CTAs";
}

bool gemv_fp8_mma_fits(int k, int scale_block) {
  return fp8_layout_fits(k, scale_block) && (scale_block >= k || scale_block % kTcRound == 0);
}

void gemv_fp8(DType ab, DType out, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k,
              void* stream, int variant) {
  if (m <= 0 || n <= 0) return;
  if (m > kGemvFp8MaxM)
    throw Error("gemv_fp8: takes m <= " + std::to_string(kGemvFp8MaxM) + " (dequantize_fp8 + the GEMM above)");
  if (!fp8_layout_fits(k, w.scale_block))
    throw Error("gemv_fp8: needs k % 16 == 0 and a scale block that is a multiple of 16 (k " + std::to_string(k) +
                ", scale block " + std::to_string(w.scale_block) + ")");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(w.codes) % 16 != 0)
    throw Error("gemv_fp8: x and the codes must be 16-byte aligned");
  if (ab != DType::BF16 && ab != DType::F16) throw Error("gemv_fp8: inputs must be bfloat16 or float16");
  if (out != ab && out != DType::F32) throw Error("gemv_fp8: output must be the input type or float32");
  if (variant < 0 || variant > 3)
    throw Error("gemv_fp8: variant must be 0 (automatic), 1 (FMA, rows), 2 (tensor cores) or 3 (FMA, split k)");
  const bool mma_fits = gemv_fp8_mma_fits(k, w.scale_block);
  if (variant == 2 && !mma_fits)
    throw Error("gemv_fp8: the tensor-core kernel needs one scale per row or a scale block that is a multiple of " +
                std::to_string(kTcRound) + " (scale block " + std::to_string(w.scale_block) + ")");
  const auto st = static_cast<cudaStream_t>(stream);
  const bool f32 = out == DType::F32, block = w.scale_block < k;
  // Automatic: the tensor-core kernel from m = 2 (one pass over the codes whatever m); the FMA
  // kernels at m = 1 and where the scale blocks do not fit the tensor-core rounds: the rows
  // kernel for many rows of short k, else the split kernel (as gemv_small_m chooses).
  const bool mma = variant == 2 || (variant == 0 && m > kernel_switches().fp8_fma_max_m && mma_fits);
  const bool split = variant == 3 || (variant == 0 && !(n >= 16384 && k <= 8192));
  if (mma) {
    if (ab == DType::BF16) launch_fp8_mma_any<VecBF16>(f32, block, x, w, bias, y, m, n, k, st);
    else launch_fp8_mma_any<VecF16>(f32, block, x, w, bias, y, m, n, k, st);
    return;
  }
  // An FMA kernel, kGemvMaxM rows of x per pass over the codes.
  const size_t xrow = size_t(k) * 2, yrow = size_t(n) * (f32 ? 4 : 2);
  for (int r0 = 0; r0 < m; r0 += kGemvMaxM) {
    const void* xp = static_cast<const uint8_t*>(x) + size_t(r0) * xrow;
    void* yp = static_cast<uint8_t*>(y) + size_t(r0) * yrow;
    const int mr = std::min(kGemvMaxM, m - r0);
    if (ab == DType::BF16) launch_fp8_any<VecBF16>(split, f32, block, xp, w, bias, yp, mr, n, k, st);
    else launch_fp8_any<VecF16>(split, f32, block, xp, w, bias, yp, mr, n, k, st);
  }
}

void dequantize_fp8(DType to, const Fp8Weight& w, void* out, int n, int k, void* stream) {
  if (!fp8_layout_fits(k, w.scale_block)) throw Error("dequantize_fp8: unsupported layout");
  if (to != DType::BF16 && to != DType::F16) throw Error("dequantize_fp8: the output must be bfloat16 or float16");
  const size_t vectors = size_t(n) * size_t(k / 16);
  if (vectors == 0) return;
  if (vectors > size_t(INT32_MAX)) throw Error("dequantize_fp8: the weight is too large (over 2^35 values)");
  const int nb = (k + w.scale_block - 1) / w.scale_block;
  const unsigned blocks = unsigned((vectors + 255) / 256);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* c = reinterpret_cast<const uint4*>(w.codes);
  auto* o = static_cast<uint4*>(out);
  if (to == DType::BF16)
    dequantize_fp8_kernel<true><<<blocks, 256, 0, st>>>(c, w.scales, nb, w.scale_block, o, int(vectors), k / 16);
  else
    dequantize_fp8_kernel<false><<<blocks, 256, 0, st>>>(c, w.scales, nb, w.scale_block, o, int(vectors), k / 16);
  KVLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvlm::cuda

// The small-m linear layer (gemm.h: gemv_small_m): y[m][n] = x[m][k] . w[n][k]^T (+ bias),
// m <= 8, the shape of a decode step at batch 1-8, where the whole cost is reading w once.
// Two FMA kernels (m <= 4; the automatic choice at m = 1) stream w with 16-byte loads that
// bypass L1 (ld.global.nc.L1::no_allocate: read exactly once), several per thread in flight
// before any math; x (a few KB, read by every CTA) comes through L1; sums are fp32. One shape
// of work does not fit all:
//  - rows: a warp owns 2 rows and walks their whole k range (4 vectors per row per lane in
//    flight); 8 warps per CTA. Best for many rows of short k (gate/up, lm_head): n / 16
//    CTAs, short dependency chains.
//  - split: a CTA owns 8 rows and its 256 threads split their k range (2 vectors per row per
//    thread in flight), then reduce across warps in shared memory. Best for few rows of long
//    k (o, down, qkv projections of a 4096-wide model): the rows kernel gives those only
//    ~2 CTAs per SM whose warps each walk 12 dependent rounds of loads (measured 2.8 TB/s).
// From m = 2 the tensor-core kernel (below) runs instead: the FMA kernels' work grows with m.
// All are launched with programmatic dependent launch (pdl.cuh, sm_90): a CTA issues its first
// loads of w, which do not depend on the previous kernel, before griddepcontrol.wait, so the
// weight stream starts while the producer of x (a norm, SiLU-and-mul, attention) is still
// running and the launch latency between the two is hidden. A CTA lets the next kernel launch
// once it has read its weights, not as it starts: a successor launched that early (the next
// GEMV's prefetch, a norm's CTA waiting) slowed the step by 1% (batch 1 x 512, Qwen3-8B shape:
// 4.50 -> 4.45 ms with the later trigger).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kRowsWarp = 2, kRowsUnroll = 4;    // rows kernel
constexpr int kSplitRows = 8, kSplitUnroll = 2;  // split kernel

template <class V, int M, bool kF32Out, bool kGlu>
__global__ void __launch_bounds__(kGemvThreads) gemv_rows_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                                                 void* y, int n, int k) {
  constexpr int R = kRowsWarp, U = kRowsUnroll;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (int(blockIdx.x) * (kGemvThreads / 32) + warp) * R;
  if (row0 >= n) return;  // warp-uniform
  const int nrows = min(R, n - row0);
  const int kv = k / 8;  // 16-byte vectors per row
  const uint4* wr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) wr[j] = reinterpret_cast<const uint4*>(w + size_t(row0 + min(j, nrows - 1)) * size_t(k));
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
      float wf[R][8];
#pragma unroll
      for (int j = 0; j < R; ++j) V::decode8(wv[u][j], wf[j]);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float xf[8];
        load_x<V, kGlu>(xv, kv, r, i, xf);
#pragma unroll
        for (int j = 0; j < R; ++j)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][r] = fmaf(wf[j][e], xf[e], acc[j][r]);
      }
    }
  }
  allow_dependents();  // the weights are read: let the next kernel launch (see the header)
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], o);
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (j < nrows)
#pragma unroll
        for (int r = 0; r < M; ++r) store_out<V, M, kF32Out>(y, n, row0 + j, r, acc[j][r], bias);
}

template <class V, int M, bool kF32Out, bool kGlu>
__global__ void __launch_bounds__(kGemvThreads) gemv_split_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                                                  void* y, int n, int k) {
  constexpr int R = kSplitRows, U = kSplitUnroll;
  const int row0 = int(blockIdx.x) * R;
  const int nrows = min(R, n - row0);
  const int kv = k / 8;
  const uint4* wr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) wr[j] = reinterpret_cast<const uint4*>(w + size_t(row0 + min(j, nrows - 1)) * size_t(k));
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
        float xf[8];
        load_x<V, kGlu>(xv, kv, r, i, xf);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          float wf[8];
          V::decode8(wv[u][j], wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j][r] = fmaf(wf[e], xf[e], acc[j][r]);
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
      store_out<V, M, kF32Out>(y, n, row0 + j, r, v, bias);
    }
  }
}

// The tensor-core kernel (m = 2-8): y^T = w . x^T as mma.sync m16n8k16 with a 16-row tile of
// w as A and the m rows of x as B. The FMA kernels above do m multiply-adds per weight and slow
// down as m grows (m = 4: one CTA per SM, 2.5 TB/s); one mma covers 16 x 16 weights for 8 rows
// of x, so the weight stream stays the whole cost.
// A CTA owns 16 rows of w; its 8 warps split k in 128-wide rounds (warp w takes k0 = 128 w +
// 1024 i). Each warp streams its rounds' 16 x 256-byte tiles through a 3-deep cp.async ring in
// shared memory (as the decode attention streams pages): every copy instruction covers two
// rows' 256 contiguous bytes, and two rounds are always in flight. The mma operands then need
// no conversion: a dot product is invariant under a permutation of k applied to both sides, so
// lane (g = lane / 4, t = lane % 4) reads 8 consecutive k of rows g and g + 8 from the tile and
// of x row g from global memory (16 bytes each), and their 32-bit words are the A and B
// registers of two mmas (word j: physical k 8t + 2j, 2j + 1). The tile's 16-byte columns are
// XOR-swizzled by row parity so those reads are free of bank conflicts. The warps add their
// partial tiles in shared memory at the end.
constexpr int kMmaGemvStages = 3;
constexpr int kMmaGemvTile = 16 * 256;  // bytes of one round of one warp

// Byte offset of (row, 16-byte column c) in a round's tile.
__device__ __forceinline__ int mma_gemv_swz(int row, int c) { return row * 256 + ((c ^ ((row & 1) << 2)) << 4); }

template <class V, bool kF32Out>
__global__ void __launch_bounds__(kGemvThreads) gemv_mma_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                                                void* y, int m, int n, int k) {
  constexpr int NW = kGemvThreads / 32, S = kMmaGemvStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = int(blockIdx.x) * 16;
  const int first = warp * 128, rounds = first < k ? (k - first + NW * 128 - 1) / (NW * 128) : 0;
  extern __shared__ uint4 gemv_smem[];  // [NW][S][kMmaGemvTile] bytes (dynamic: > 48 KB)
  auto ring = reinterpret_cast<char(*)[S][kMmaGemvTile]>(gemv_smem);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(&ring[warp][0][0]));
  // Copy c = lane + 32 j of a round: row c / 16 (rows past n clamped, never stored), column c % 16.
  auto issue = [&](int i) {
    if (i < rounds) {
      const int k0 = first + i * NW * 128;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = lane + 32 * j, row = c / 16, col = c % 16, kk = k0 + col * 8;
        const uint16_t* src = w + size_t(min(row0 + row, n - 1)) * size_t(k) + (kk < k ? kk : 0);
        mma::cp_async16(ring_s + (i % S) * kMmaGemvTile + mma_gemv_swz(row, col), src, kk < k ? 16 : 0);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  pdl_wait();  // x is the previous kernel's output; w is not
  const uint16_t* xr = x + size_t(min(g, m - 1)) * size_t(k) + 8 * t;
  float acc[4] = {};
  for (int i = 0; i < rounds; ++i) {
    const int k0 = first + i * NW * 128;
    uint4 xv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
      xv[u] = g < m && k0 + 32 * u + 8 * t < k ? __ldg(reinterpret_cast<const uint4*>(xr + k0 + 32 * u))
                                              : make_uint4(0, 0, 0, 0);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncwarp();
    issue(i + S - 1);  // refills the slot read in round i - 1
    const char* tile = &ring[warp][i % S][0];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint4 a = *reinterpret_cast<const uint4*>(tile + mma_gemv_swz(g, 4 * u + t));
      const uint4 b = *reinterpret_cast<const uint4*>(tile + mma_gemv_swz(g + 8, 4 * u + t));
      const uint32_t lo[4] = {a.x, b.x, a.y, b.y}, hi[4] = {a.z, b.z, a.w, b.w};
      mma::mma16816<V::kBF16>(acc, lo, xv[u].x, xv[u].y);
      mma::mma16816<V::kBF16>(acc, hi, xv[u].z, xv[u].w);
    }
    __syncwarp();  // every lane has read this slot before it is refilled
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the weights are read
  // acc[e]: w row g + 8 (e >= 2), x row 2t + (e & 1). The partial tiles reuse the ring.
  __syncthreads();
  auto part = reinterpret_cast<float(*)[16][9]>(&ring[0][0][0]);
#pragma unroll
  for (int e = 0; e < 4; ++e) part[warp][g + 8 * (e >> 1)][2 * t + (e & 1)] = acc[e];
  __syncthreads();
  if (threadIdx.x < 16 * 8) {
    const int j = threadIdx.x % 16, r = threadIdx.x / 16, col = row0 + j;
    if (r < m && col < n) {
      float v = 0.0f;
#pragma unroll
      for (int wi = 0; wi < NW; ++wi) v += part[wi][j][r];
      store_out<V, 1, kF32Out>(y, n, col, r, v, bias);
    }
  }
}

template <class V, int M, bool kF32Out, bool kGlu>
void launch_m(bool split, const uint16_t* x, const uint16_t* w, const uint16_t* b, void* y, int n, int k, cudaStream_t st) {
  if (split) {
    const dim3 grid(unsigned((n + kSplitRows - 1) / kSplitRows));
    KVLM_CUDA_CHECK(launch_pdl<gemv_split_kernel<V, M, kF32Out, kGlu>>(grid, dim3(kGemvThreads), 0, st, x, w, b, y, n, k));
  } else {
    constexpr int rows_per_cta = kRowsWarp * kGemvThreads / 32;
    const dim3 grid(unsigned((n + rows_per_cta - 1) / rows_per_cta));
    KVLM_CUDA_CHECK(launch_pdl<gemv_rows_kernel<V, M, kF32Out, kGlu>>(grid, dim3(kGemvThreads), 0, st, x, w, b, y, n, k));
  }
}

template <class V, bool kF32Out, bool kGlu>
void launch(int kernel, const void* x, const void* w, const void* bias, void* y, int m, int n, int k, cudaStream_t st) {
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* ws = static_cast<const uint16_t*>(w);
  const auto* bs = static_cast<const uint16_t*>(bias);
  if constexpr (!kGlu) {
    if (kernel == 3) {
      constexpr int smem = kGemvThreads / 32 * kMmaGemvStages * kMmaGemvTile;
      static PerDevice<bool> opted_in;  // once per instantiation and device
      opted_in.get([] {
        KVLM_CUDA_CHECK(cudaFuncSetAttribute(gemv_mma_kernel<V, kF32Out>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        return true;
      });
      const dim3 grid(unsigned((n + 15) / 16));
      KVLM_CUDA_CHECK(launch_pdl<gemv_mma_kernel<V, kF32Out>>(grid, dim3(kGemvThreads), smem, st, xs, ws, bs, y, m, n, k));
      return;
    }
  }
  const bool split = kernel == 2;
  switch (m) {
    case 1: launch_m<V, 1, kF32Out, kGlu>(split, xs, ws, bs, y, n, k, st); break;
    case 2: launch_m<V, 2, kF32Out, kGlu>(split, xs, ws, bs, y, n, k, st); break;
    case 3: launch_m<V, 3, kF32Out, kGlu>(split, xs, ws, bs, y, n, k, st); break;
    default: launch_m<V, 4, kF32Out, kGlu>(split, xs, ws, bs, y, n, k, st); break;
  }
}

template <class V>
void launch_any(int kernel, bool f32, bool glu, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
                cudaStream_t st) {
  if (glu) launch<V, false, true>(kernel, x, w, bias, y, m, n, k, st);  // glu: the down projection, act output
  else if (f32) launch<V, true, false>(kernel, x, w, bias, y, m, n, k, st);
  else launch<V, false, false>(kernel, x, w, bias, y, m, n, k, st);
}

}  // namespace

bool gemv_fits(int m, int k, const void* x, const void* w) {
  return m >= 1 && m <= kGemvMmaMaxM && k % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

void gemv_small_m(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
                  void* stream, int variant, bool glu_input) {
  if (m <= 0 || n <= 0) return;
  if (!gemv_fits(m, k, x, w))
    throw Error("gemv_small_m: needs 1 <= m <= " + std::to_string(kGemvMmaMaxM) +
                ", k % 8 == 0 and 16-byte aligned operands");
  if ((variant == 1 || variant == 2 || glu_input) && m > kGemvMaxM)
    throw Error("gemv_small_m: the rows and split kernels (and a SiLU-and-mul input) take m <= " +
                std::to_string(kGemvMaxM));
  if (glu_input && variant == 3) throw Error("gemv_small_m: the tensor-core kernel takes no SiLU-and-mul input");
  if (variant < 0 || variant > 3) throw Error("gemv_small_m: variant must be 0 (automatic), 1, 2 or 3");
  if (ab != DType::BF16 && ab != DType::F16) throw Error("gemv_small_m: inputs must be bfloat16 or float16");
  if (out != ab && out != DType::F32) throw Error("gemv_small_m: output must be the input type or float32");
  if (glu_input && out != ab) throw Error("gemv_small_m: a SiLU-and-mul input needs a 16-bit output");
  // Automatic: from m = 2 the tensor-core kernel (a SiLU-and-mul input: the split kernel); at
  // m = 1 the rows kernel when there are enough rows to fill the GPU with short chains, else
  // the split kernel.
  int kernel = variant;
  if (kernel == 0) kernel = m >= 2 ? (glu_input ? 2 : 3) : (n >= 16384 && k <= 8192) ? 1 : 2;
  const auto st = static_cast<cudaStream_t>(stream);
  const bool f32 = out == DType::F32;
  if (ab == DType::BF16) launch_any<VecBF16>(kernel, f32, glu_input, x, w, bias, y, m, n, k, st);
  else launch_any<VecF16>(kernel, f32, glu_input, x, w, bias, y, m, n, k, st);
}

}  // namespace kvlm::cuda

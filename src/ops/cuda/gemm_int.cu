// gemm_int: linear layers over grouped integer codes (gemm.h IntWeight) for decode batches of
// 17-64 rows, one pass over the codes.
//
// gemv_int (m <= 16) keeps x in registers, a warp's own k-rounds at a time; from 17 rows the
// runner ran it in passes of 16, reading every code again per pass (4 passes at m = 64: 0.53x
// the bf16 copy at 64 x 4k decode, docs/results/weights-4bit.md). Here the CTA stages x in
// shared memory beside the codes, so each code is read and decoded once for all m rows.
//
// The product is y^T = w . x^T on mma.sync m16n8k16 with fp32 accumulators: 16-row tiles of
// the weight as A, decoded in registers exactly as gemv_int decodes them (int_decode.cuh), and
// 8-row tiles of x as B. A CTA of 8 warps owns 16 RT weight rows per warp (RT 1 or 2) and all
// 8 NT rows of x (NT 4: m <= 32, 8: m <= 64); its k runs in chunks of 128 columns through a
// cp.async ring of stages (codes, x, the chunk's (s, b) words), one __syncthreads a chunk.
// Small n is split over k across the CTAs of a thread-block cluster (up to 8), whose partial
// tiles add through distributed shared memory, as gemv_int does.
//
// A lane owns columns 32 t .. 32 t + 31 of each chunk (t = lane % 4), in four steps of 8: per
// step and row of the weight, one code word (4-bit) or two (8-bit) give two A fragments, and
// one 16-byte load of x per B tile gives their B fragments as loaded (the codes are stored so
// that the decode's pairs are adjacent columns: io/grouped_codes.h grouped_code). Per step and
// B tile that is one shared load for 2 RT MMAs; the decode (15 instructions a word) is shared
// by the NT B tiles. (Until the codes were stored in that order, x was paired by 4 byte
// permutes per load: a third of a chunk's instructions.)
//
// Shared-memory layouts, each read without bank conflicts (8 lanes, rows g and g + 1, per
// 16-byte phase): x's 16 16-byte units of a row sit at 2 t + ((row + step) & 1) + 8 (step >> 1)
// for the unit of (t, step); 4-bit codes are 64-byte rows read 16 bytes a lane; 8-bit codes are
// 128-byte rows whose units are swapped in pairs on odd rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/int_decode.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kGiWarps = kGemvThreads / 32;
constexpr int kGiChunk = 128;              // columns of k a stage holds
constexpr int kGiXRow = kGiChunk * 2;      // bytes of a row of x in a stage
constexpr int kGiMaxSplits = 8;            // the portable cluster size

template <int BITS, int RT, int NT>
struct GiCfg {
  static constexpr int kRows = 16 * RT * kGiWarps;    // weight rows per CTA
  static constexpr int kCodeRow = kGiChunk * BITS / 8;  // bytes of a row's codes per stage
  // (s, b) words of a row per stage: 128 columns span at most 4 groups of 32 or more (4-bit)
  // and 8 of 16 or more (8-bit)
  static constexpr int kPW = BITS == 8 ? 8 : 4;
  static constexpr int kXRows = 8 * NT;
  static constexpr int kCodeBytes = kRows * kCodeRow, kXBytes = kXRows * kGiXRow, kParamBytes = kRows * kPW * 4;
  static constexpr int kStageBytes = kCodeBytes + kXBytes + kParamBytes;
  // RT 1: two CTAs per SM (16 warps); RT 2: one, with the deeper ring
  static constexpr int kBudget = RT == 1 ? 110 * 1024 : 220 * 1024;
  static constexpr int kStages = std::min(4, kBudget / kStageBytes);
  // the fp32 tile [kRows][kXRows + 4] after the loop: rows 16-byte aligned for the reduction's
  // float4 reads, which the 4-float pad keeps free of bank conflicts
  static constexpr int kRedStride = kXRows + 4;
  static constexpr int kSmem = std::max(kStages * kStageBytes, kRows * kRedStride * 4);
  static constexpr int kMinBlocks = RT == 1 ? 2 : 1;
  static_assert(kStages >= 2, "a stage does not fit twice");
};

// floor(x / group) for 0 <= x < group + 128 (a column's group past a chunk's first one, from the
// chunk's remainder): with magic = ceil(2^16 / group) for groups below 128 (exact there: x * the
// rounding of magic stays below 2^16), else a comparison (x < 2 group).
__device__ __forceinline__ int group_of(int x, int group, uint32_t magic) {
  return magic ? int((uint32_t(x) * magic) >> 16) : int(x >= group);
}

template <class V, int BITS, int RT, int NT, bool kF32Out, Int4Kind K4>
__global__ void __launch_bounds__(kGemvThreads, GiCfg<BITS, RT, NT>::kMinBlocks)
    gemm_int_kernel(const uint16_t* x, const uint8_t* codes, const uint32_t* params, int group,
                    const uint16_t* bias, void* y, int ldy, int m, int n, int k, int chunks_per_split) {
  using Cfg = GiCfg<BITS, RT, NT>;
  constexpr int S = Cfg::kStages, kRows = Cfg::kRows, CR = Cfg::kCodeRow, PW = Cfg::kPW, XR = Cfg::kXRows;
  constexpr int kCodeUnits = kRows * (CR / 16), kXUnits = XR * (kGiXRow / 16);
  static_assert(kCodeUnits % kGemvThreads == 0 && (kRows * PW) % kGemvThreads == 0 && kXUnits % kGemvThreads == 0);
  extern __shared__ uint4 gemm_int_smem[];
  char* const smem = reinterpret_cast<char*>(gemm_int_smem);
  const uint32_t smem_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int row0 = int(blockIdx.x) * kRows;
  const int nchunks = (k + kGiChunk - 1) / kGiChunk;
  const int c_begin = int(blockIdx.y) * chunks_per_split;
  const int chunks = max(0, min(nchunks, c_begin + chunks_per_split) - c_begin);
  const size_t row_bytes = size_t(k) * BITS / 8;
  const int ng = k / group;
  const uint32_t magic = group < 128 ? uint32_t((65536 + group - 1) / group) : 0u;
  // The group and remainder of a chunk's first column, advanced a chunk at a time (one integer
  // division per kernel instead of several per chunk): for the copies, which run S - 1 chunks
  // ahead, and for the MMAs.
  const int q128 = kGiChunk / group, r128 = kGiChunk % group;
  int wg = (c_begin * kGiChunk) / group, wr = c_begin * kGiChunk - wg * group;
  int cg = wg, cr = wr;

  // The weight's part of stage i (called for i = 0, 1, 2, ... in order): codes (zero past the
  // row or past n) and the words of the groups the chunk touches (zero past them, so that
  // columns past k decode to finite values that meet zeros of x).
  auto issue_w = [&](int i) {
    const int g0 = wg, r0 = wr;
    wg += q128, wr += r128;
    if (wr >= group) wr -= group, ++wg;
    if (i >= chunks) return;
    const int k0 = (c_begin + i) * kGiChunk;
    const uint32_t base = smem_s + uint32_t((i % S) * Cfg::kStageBytes);
#pragma unroll
    for (int it = 0; it < kCodeUnits / kGemvThreads; ++it) {
      const int u = tid + it * kGemvThreads, r = u / (CR / 16), c = u % (CR / 16), row = row0 + r;
      const size_t off = size_t(k0) * BITS / 8 + size_t(16 * c);
      const bool ok = row < n && off < row_bytes;
      const int pos = BITS == 8 ? (c ^ (r & 1)) : c;
      mma::cp_async16(base + uint32_t(r * CR + pos * 16), ok ? codes + size_t(row) * row_bytes + off : codes,
                      ok ? 16 : 0);
    }
    const int nw = group_of(r0 + min(kGiChunk, k - k0) - 1, group, magic) + 1;
#pragma unroll
    for (int it = 0; it < kRows * PW / kGemvThreads; ++it) {
      const int u = tid + it * kGemvThreads, r = u / PW, wd = u % PW, row = row0 + r;
      const bool ok = row < n && wd < nw;
      mma::cp_async4(base + uint32_t(Cfg::kCodeBytes + Cfg::kXBytes + 4 * u),
                     ok ? params + (size_t(row) * size_t(ng) + size_t(g0 + wd)) : params, ok ? 4 : 0);
    }
  };
  // x's part of stage i (zero past m rows and past k).
  auto issue_x = [&](int i) {
    if (i < chunks) {
      const int k0 = (c_begin + i) * kGiChunk;
      const uint32_t base = smem_s + uint32_t((i % S) * Cfg::kStageBytes + Cfg::kCodeBytes);
#pragma unroll
      for (int it = 0; it < kXUnits / kGemvThreads; ++it) {
        const int u = tid + it * kGemvThreads, r = u / 16, c = u % 16, col = k0 + 8 * c;
        const bool ok = r < m && col < k;
        const int ut = c >> 2, v = c & 3, pos = 2 * ut + ((r + v) & 1) + 8 * (v >> 1);
        mma::cp_async16(base + uint32_t(r * kGiXRow + pos * 16), ok ? x + size_t(r) * size_t(k) + size_t(col) : x,
                        ok ? 16 : 0);
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue_w(i);
  pdl_wait();  // x is the previous kernel's output; the codes and parameters are not
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue_x(i);

  // Every B tile is computed, rows of x past m included (zeros): a guard per tile would be a
  // branch between its shared-memory load and its MMAs, and the tiles would run one after the
  // other (measured: 3-7x slower).
  float acc[RT][NT][4] = {};
  int lr[RT][2];  // the lane's local weight rows: tile j, rows g and g + 8
#pragma unroll
  for (int j = 0; j < RT; ++j) lr[j][0] = (warp * RT + j) * 16 + g, lr[j][1] = lr[j][0] + 8;
  const int gp = g & 1;  // the parity of every row the lane reads (x: 8 q + g; weights: 16 i + g (+ 8))
  for (int i = 0; i < chunks; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncthreads();  // stage i has landed for every thread; stage i - 1's slot is free
    issue_w(i + S - 1);
    issue_x(i + S - 1);
    const int r0 = cr;  // the chunk's first column's remainder in its group (the stage's words start there)
    cg += q128, cr += r128;
    if (cr >= group) cr -= group, ++cg;
    const char* const st = smem + (i % S) * Cfg::kStageBytes;
    const char* const cs = st;
    const char* const xs = st + Cfg::kCodeBytes;
    const uint32_t* const ps = reinterpret_cast<const uint32_t*>(st + Cfg::kCodeBytes + Cfg::kXBytes);
    // the B tiles' 16 bytes of x at step v: row 8 q + g, the lane's unit of the step
    auto load_x = [&](int v, uint4 (&xv)[NT]) {
      const char* const p = xs + g * kGiXRow + (2 * t + ((gp + v) & 1) + 8 * (v >> 1)) * 16;
#pragma unroll
      for (int q = 0; q < NT; ++q) xv[q] = *reinterpret_cast<const uint4*>(p + q * 8 * kGiXRow);
    };
    if constexpr (BITS == 4) {
      uint4 cw[RT][2];
      uint32_t a2[RT][2], s2[RT][2], b2[RT][2];
      const int pi = group_of(r0 + 32 * t, group, magic);  // a lane's 32 columns lie in one group
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          cw[j][h] = *reinterpret_cast<const uint4*>(cs + lr[j][h] * CR + 16 * t);
          int4_params<V::kBF16, K4>(ps[lr[j][h] * PW + pi], a2[j][h], s2[j][h], b2[j][h]);
        }
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint4 xv[NT];
        load_x(v, xv);
        uint32_t a[RT][2][4];
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          const uint32_t lw[4] = {cw[j][0].x, cw[j][0].y, cw[j][0].z, cw[j][0].w};
          const uint32_t hw[4] = {cw[j][1].x, cw[j][1].y, cw[j][1].z, cw[j][1].w};
          uint32_t pl[4], ph[4];
          int4x8_decode<V::kBF16, K4>(lw[v], a2[j][0], s2[j][0], b2[j][0], pl);
          int4x8_decode<V::kBF16, K4>(hw[v], a2[j][1], s2[j][1], b2[j][1], ph);
          a[j][0][0] = pl[0], a[j][0][1] = ph[0], a[j][0][2] = pl[1], a[j][0][3] = ph[1];
          a[j][1][0] = pl[2], a[j][1][1] = ph[2], a[j][1][2] = pl[3], a[j][1][3] = ph[3];
        }
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          const uint32_t xw[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};  // adjacent columns: the decode's pairs
#pragma unroll
          for (int j = 0; j < RT; ++j) {
            mma::mma16816<V::kBF16>(acc[j][q], a[j][0], xw[0], xw[1]);
            mma::mma16816<V::kBF16>(acc[j][q], a[j][1], xw[2], xw[3]);
          }
        }
      }
    } else {
      uint4 cw[RT][2];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint4 xv[NT];
        load_x(v, xv);
        if ((v & 1) == 0) {  // 16 bytes of codes serve two steps
#pragma unroll
          for (int j = 0; j < RT; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
              cw[j][h] = *reinterpret_cast<const uint4*>(cs + lr[j][h] * CR + (((2 * t + (v >> 1)) ^ gp) * 16));
        }
        const int pi = group_of(r0 + 32 * t + 8 * v, group, magic);  // groups of 16 or more: one per step
        uint32_t a[RT][2][4];
#pragma unroll
        for (int j = 0; j < RT; ++j) {
          uint32_t s2[2], b2[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint32_t p = ps[lr[j][h] * PW + pi];
            s2[h] = __byte_perm(p, 0, 0x1010), b2[h] = __byte_perm(p, 0, 0x3232);
          }
          const uint32_t lw[4] = {cw[j][0].x, cw[j][0].y, cw[j][0].z, cw[j][0].w};
          const uint32_t hw[4] = {cw[j][1].x, cw[j][1].y, cw[j][1].z, cw[j][1].w};
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // the step's two words: A rows g (pairs 0, 2), g + 8, ...
            const int wd = 2 * (v & 1) + e;
            int8x4_to_pairs<V::kBF16>(lw[wd], s2[0], b2[0], a[j][e][0], a[j][e][2]);
            int8x4_to_pairs<V::kBF16>(hw[wd], s2[1], b2[1], a[j][e][1], a[j][e][3]);
          }
        }
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          const uint32_t xw[4] = {xv[q].x, xv[q].y, xv[q].z, xv[q].w};  // adjacent columns: the decode's pairs
#pragma unroll
          for (int j = 0; j < RT; ++j) {
            mma::mma16816<V::kBF16>(acc[j][q], a[j][0], xw[0], xw[1]);
            mma::mma16816<V::kBF16>(acc[j][q], a[j][1], xw[2], xw[3]);
          }
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the codes are read
  __syncthreads();     // every warp is done with the ring
  // acc[j][q][e]: weight row lr[j][e >> 1], x row 8 q + 2 t + (e & 1). The CTA's tile goes to
  // shared memory; the cluster's CTAs then each add a slice of rows over every CTA and store it.
  constexpr int RS = Cfg::kRedStride;
  float* const red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(red + lr[j][h] * RS + 8 * q + 2 * t) = make_float2(acc[j][q][2 * h], acc[j][q][2 * h + 1]);
  const int splits = int(gridDim.y);
  cluster_sync(splits);  // every CTA's tile is in its shared memory
  // Each CTA of the cluster adds a slice of rows over all the cluster's tiles, 4 rows of x a
  // thread: every peer's float4 is loaded before any is added (one round trip of distributed
  // shared memory, not one per peer and output), and consecutive threads store consecutive
  // columns of y.
  const int rank = cluster_rank(splits), per = (kRows + splits - 1) / splits, c4s = (m + 3) / 4;
  const float* peer[kGiMaxSplits - 1];
#pragma unroll
  for (int s = 1; s < kGiMaxSplits; ++s) peer[s - 1] = s < splits ? cluster_peer(red, (rank + s) % splits) : red;
  for (int idx = tid; idx < per * c4s; idx += kGemvThreads) {
    const int rr = rank * per + idx % per, c4 = idx / per, row = row0 + rr;
    if (rr >= kRows || row >= n) continue;
    const int at = rr * RS + 4 * c4;
    float4 v = *reinterpret_cast<const float4*>(red + at);
    float4 pv[kGiMaxSplits - 1];
#pragma unroll
    for (int s = 1; s < kGiMaxSplits; ++s)
      if (s < splits) pv[s - 1] = *reinterpret_cast<const float4*>(peer[s - 1] + at);
#pragma unroll
    for (int s = 1; s < kGiMaxSplits; ++s)
      if (s < splits) v.x += pv[s - 1].x, v.y += pv[s - 1].y, v.z += pv[s - 1].z, v.w += pv[s - 1].w;
    const float vs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (4 * c4 + e < m) store_out<V, 1, kF32Out>(y, ldy, row, 4 * c4 + e, vs[e], bias);
  }
  if (splits > 1) cluster_sync(splits);  // no CTA leaves while another reads its tile
}

// The cluster split that finishes soonest if a CTA takes as long as its chunks plus one for
// filling the ring, and one more for adding the cluster's tiles when split (Nsight Compute on
// the first version, which split gate_up at m = 64 four ways and added the tiles one float and
// one peer at a time: half the warps' stall samples were in that addition): waves of the
// resident CTAs times that, the fewest splits among equals.
int gi_splits(int blocks, int nchunks, int slots) {
  if (compute_capability() < 90) return 1;  // no thread-block clusters
  int best = 1;
  long best_cost = -1;
  for (int s = 1; s <= std::min(kGiMaxSplits, nchunks); ++s) {
    const long waves = (long(blocks) * s + slots - 1) / slots, cost = waves * ((nchunks + s - 1) / s + 1 + (s > 1));
    if (best_cost < 0 || cost < best_cost) best = s, best_cost = cost;
  }
  return best;
}

template <class V, int BITS, int RT, int NT, bool kF32Out, Int4Kind K4>
void launch_gi(const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m, int n, int k,
               cudaStream_t st, int splits) {
  using Cfg = GiCfg<BITS, RT, NT>;
  constexpr auto kernel = gemm_int_kernel<V, BITS, RT, NT, kF32Out, K4>;
  const int slots = resident_ctas<kernel, Cfg::kSmem>();  // also opts the kernel in to its shared memory
  const int blocks = (n + Cfg::kRows - 1) / Cfg::kRows, nchunks = (k + kGiChunk - 1) / kGiChunk;
  if (splits <= 0) splits = gi_splits(blocks, nchunks, slots);
  splits = std::min(splits, nchunks);
  const int per = (nchunks + splits - 1) / splits;
  KVLM_CUDA_CHECK(launch_pdl_cluster<kernel>(dim3(unsigned(blocks), unsigned(splits)), dim3(kGemvThreads),
                                             Cfg::kSmem, st, splits, static_cast<const uint16_t*>(x), w.codes,
                                             w.params, w.group, static_cast<const uint16_t*>(bias), y, ldy, m, n, k,
                                             per));
}

template <class V, int BITS>
void launch_gi_any(bool f32, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m, int n,
                   int k, cudaStream_t st, int rt, int splits) {
  auto go = [&](auto rtc, auto ntc, auto kind) {
    constexpr int RT = decltype(rtc)::value, NT = decltype(ntc)::value;
    constexpr Int4Kind K4 = decltype(kind)::value;
    if (f32) launch_gi<V, BITS, RT, NT, true, K4>(x, w, bias, y, ldy, m, n, k, st, splits);
    else launch_gi<V, BITS, RT, NT, false, K4>(x, w, bias, y, ldy, m, n, k, st, splits);
  };
  // 256-row tiles take 64 rows of x only (they pay where x's loads from shared memory, which
  // they halve per MMA, are what limits: full 64-row batches).
  auto by_nt = [&](auto rtc, auto kind) {
    if constexpr (decltype(rtc)::value == 1) {
      if (m <= 32) return go(rtc, std::integral_constant<int, 4>{}, kind);
    }
    go(rtc, std::integral_constant<int, 8>{}, kind);
  };
  auto by_rt = [&](auto kind) {
    if (rt == 2) by_nt(std::integral_constant<int, 2>{}, kind);
    else by_nt(std::integral_constant<int, 1>{}, kind);
  };
  if constexpr (BITS == 4) with_int4_kind(w, by_rt);
  else by_rt(std::integral_constant<Int4Kind, Int4Kind::Affine>{});
}

}  // namespace

int gemm_int_tile_rows(int m, int n) {
  // 128: two CTAs per SM hide more latency than 256-row tiles save in loads of x, at every
  // shape and m measured (docs/results/weights-4bit.md, decode_bench --int-lab)
  (void)m, (void)n;
  return 128;
}

bool gemm_int_available(int tile_rows) {
  static PerDevice<int> optin;
  const int have = optin.get([] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return v;
  });
  // the tile's largest configuration: 8-bit codes, 64 rows of x
  const int need = tile_rows == 256 ? GiCfg<8, 2, 8>::kSmem : GiCfg<8, 1, 8>::kSmem;
  return compute_capability() >= 80 && have >= need;
}

void gemm_int(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
              int n, int k, void* stream, int tile_rows, int splits) {
  if (m <= 0 || n <= 0) return;
  if (m > kGemmIntMaxM)
    throw Error("gemm_int: takes m <= " + std::to_string(kGemmIntMaxM) + " (run larger batches in passes)");
  check_int("gemm_int", ab, w, k);
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("gemm_int: x must be 16-byte aligned");
  if (out != ab && out != DType::F32) throw Error("gemm_int: output must be the input type or float32");
  if (ldy < n) throw Error("gemm_int: the output's row stride is shorter than its rows");
  if (tile_rows == 0) tile_rows = gemm_int_tile_rows(m, n);
  if (tile_rows != 128 && tile_rows != 256) throw Error("gemm_int: tiles are 128 or 256 weight rows");
  if (splits < 0 || splits > kGiMaxSplits) throw Error("gemm_int: a cluster split of 1 to 8, or 0 for the launcher's");
  if (!gemm_int_available(tile_rows))
    throw Error("gemm_int: this GPU lacks the shared memory or tensor cores the kernel needs (gemm_int_available)");
  const auto st = static_cast<cudaStream_t>(stream);
  const bool f32 = out == DType::F32;
  const int rt = tile_rows / 128;
  if (ab == DType::BF16) {
    if (w.bits == 4) launch_gi_any<VecBF16, 4>(f32, x, w, bias, y, ldy, m, n, k, st, rt, splits);
    else launch_gi_any<VecBF16, 8>(f32, x, w, bias, y, ldy, m, n, k, st, rt, splits);
  } else {
    if (w.bits == 4) launch_gi_any<VecF16, 4>(f32, x, w, bias, y, ldy, m, n, k, st, rt, splits);
    else launch_gi_any<VecF16, 8>(f32, x, w, bias, y, ldy, m, n, k, st, rt, splits);
  }
}

}  // namespace kvlm::cuda

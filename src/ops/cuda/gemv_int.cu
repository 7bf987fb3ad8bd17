// Linear layers over grouped integer codes (gemm.h IntWeight; io/grouped_codes.h): 4-bit and
// 8-bit weights, w = s * code + b per group of columns of a row.
//
// At batch 1-16 a decode step is the weight stream, so the kernel that matters is the GEMV
// below: it reads each code once, decodes it to the compute type in registers and feeds the
// tensor cores. A Q4_K matrix streams 5 bits per weight instead of a bf16 copy's 16.
//
// The tensor-core GEMV (m = 1-16 in one pass over the codes) has gemv_fp8.cu's structure, its
// layout of work measured there on an H200: y^T = w . x^T as mma.sync m16n8k16, 16-row tiles of
// the weight as A and the rows of x as B (one 8-column B tile for m <= 8, two for m <= 16),
// fp32 accumulators; a CTA owns RT tiles (x's fragments serve all of them), its 8 warps and the
// CTAs of a thread-block cluster along gridDim.y split k in rounds; each warp streams its rounds
// through a cp.async ring in shared memory, each lane copying (and reading back) 16 bytes of its
// two rows per tile per round. 16 bytes are 32 4-bit codes or 16 8-bit ones, so a round is 128
// or 64 columns, and a lane's 16 bytes lie in one group (groups of 32 or more for 4-bit codes,
// 16 or more for 8-bit ones): one (s, b) per row per round, loaded a round ahead.
//
// Decoding, exact up to the one rounding of s * code + b to the compute type (as a 16-bit copy
// of the dequantized weight would hold it), with the parameters broadcast to both halves of a
// pair:
//  - 4-bit: a 32-bit word holds the codes of 8 consecutive columns; (word >> 4j) & 0x000f000f
//    puts codes j and j + 4 in the low bits of the two halves, OR-ed into the bits of 128.0
//    (bf16) or 1024.0 (f16) that is 128 + code exactly; one fma subtracts 128 (exact), a second
//    forms s * code + b in the compute type: 2 instructions per pair of weights, plus the
//    shift-and-mask. Codes j and j + 4 are columns 2j and 2j + 1 (the order the codes are stored
//    in, io/grouped_codes.h), so a pair is two adjacent columns and x's 32-bit words, as loaded,
//    are the B fragments that meet it.
//  - 8-bit: a byte permute puts bytes (0, 2) or (1, 3) of a word in the low bytes of a pair
//    (columns (0, 1) and (2, 3) in the stored order), bit tricks of the same kind give the code
//    exactly (int8x4_to_pairs says how for bf16, whose 8 significant bits no single magic number
//    covers), and one fma forms s * code + b: 4-5 instructions per pair.
// At 9-16 rows, 4-bit codes and k <= 4096, n >= 6144 (gemv_int_shares_x) a second kernel has
// the CTA's warps own different rows and share each round of x through shared memory (below).
// Larger m: gemm_int.cu up to 64 rows (x staged in shared memory, the same decode), then
// dequantize_int writes the weight in the compute type into a scratch buffer for the 16-bit
// GEMM (as FP8 weights with block scales do). The decode helpers live in int_decode.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "io/grouped_codes.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/gemv_int_dp4a.h"
#include "ops/cuda/int_decode.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kIntWarps = kGemvThreads / 32;
constexpr int kIntMaxSplits = 8;  // the portable cluster size

// RT 16-row tiles per CTA; as gemv_fp8.cu's TcCfg (4 KB of ring per warp and round at RT = 4).
template <int RT>
struct IntCfg {
  static constexpr int kRows = 16 * RT, kStages = RT >= 4 ? 3 : 4, kStageBytes = RT * 2 * 32 * 16;
  static constexpr int kSmem = kIntWarps * kStages * kStageBytes;
};
// CTAs per SM the register budget is cut for: 2 (128 registers). The 4-bit decode and x's 32
// columns per lane and round spill below that; 2 CTAs of 8 warps keep 2-3 rounds of 1-4 KB per
// warp in flight, more than an SM's share of the bandwidth-latency product.
constexpr int int_min_blocks(int, int) { return 2; }

// 8 4-bit codes -> 128 + code as bf16 pairs, codes (0, 4), (1, 5), (2, 6), (3, 7): the scale-
// after-MMA decode (groups of 128 and more), one LOP3 per pair.
__device__ __forceinline__ void int4x8_to_biased_pairs(uint32_t w, uint32_t (&p)[4]) {
  const uint32_t magic = 0x43004300u;  // 128.0 in both halves
#pragma unroll
  for (int j = 0; j < 4; ++j) asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(p[j]) : "r"(w >> (4 * j)), "n"(0x000f000f), "r"(magic));
}

// K4: the kind of 4-bit codes (affine, zero point, E2M1: int_decode.cuh), a template parameter
// because a runtime choice costs the m = 9-16 variants 20 more bytes of spills and 12-25% of
// their time.
// Columns of k one warp covers per round: each of a row's 4 lanes loads 16 bytes of codes.
template <int BITS>
constexpr int kIntRound = 4 * (128 / BITS);

// A lane's weight rows in RT 16-row tiles from `first` (rows g and g + 8 of each; clamped to
// n - 1: rows past n are read, never stored), where its 16 bytes of codes start in each, and its
// rows' (s, b) words round after round. load_p is called for rounds 0, 1, 2, ... in order: the
// group of the lane's first column in the next round it loads advances by a fixed quotient and
// remainder (an integer division by the runtime group every round was a tenth of the
// instructions), and each row's parameters start at a 32-bit offset (n * ng < 2^32: gemv_int
// checks). g_step, r_step: the quotient and remainder of (columns one round of every worker
// covers) / group, from the launch; `col`: the lane's first column in round 0.
template <int RT, int BITS>
struct IntLaneRows {
  const uint8_t* src[RT][2];
  uint32_t poff[RT][2];
  int next_g, next_r;
  __device__ __forceinline__ IntLaneRows(int first, int g, int t, int n, int k, int group, int col,
                                         const uint8_t* codes) {
    const size_t row_bytes = size_t(k) * BITS / 8;
    const int ng = k / group;
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = min(first + 16 * j + 8 * h + g, n - 1);
        src[j][h] = codes + size_t(row) * row_bytes + min(size_t(16 * t), row_bytes - 16);
        poff[j][h] = uint32_t(row) * uint32_t(ng);
      }
    next_g = col / group;
    next_r = col % group;
  }
  // `valid`: the round exists and the lane's columns lie within k (else group 0, read, unused).
  __device__ __forceinline__ void load_p(const uint32_t* params, bool valid, int group, int g_step, int r_step,
                                         uint32_t (&pr)[RT][2]) {
    const uint32_t gi = valid ? uint32_t(next_g) : 0u;
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) pr[j][h] = __ldg(params + (poff[j][h] + gi));
    next_g += g_step, next_r += r_step;
    if (next_r >= group) next_r -= group, ++next_g;
  }
};

// The GEMVs' last step: the CTAs of a cluster (splits along y) add their sums red [kRows][C]
// (rows row0 ..., columns the rows of x) through distributed shared memory, each CTA storing a
// share of the rows into y's rows y_first ... (x's rows m).
template <class V, bool kF32Out, int kRows, int C>
__device__ __forceinline__ void store_cluster_sums(float* red, int splits, int row0, int n, int m, int y_first,
                                                   void* y, int ldy, const uint16_t* bias) {
  cluster_sync(splits);  // every CTA's sums are in its shared memory (a CTA barrier at 1)
  const int rank = cluster_rank(splits), per = (kRows + splits - 1) / splits;
  for (int idx = int(threadIdx.x); idx < per * m; idx += kGemvThreads) {
    const int rr = rank * per + idx / m, r = idx % m, row = row0 + rr;
    if (rr >= kRows || row >= n) continue;
    float v = red[rr * C + r];
    for (int s = 0; s < splits; ++s)
      if (s != rank) v += cluster_peer(red, s)[rr * C + r];
    store_out<V, 1, kF32Out>(y, ldy, row, y_first + r, v, bias);
  }
  if (splits > 1) cluster_sync(splits);  // no CTA leaves while another reads its sums
}

// One round of a warp: its RT 16-row tiles of codes (the lane's 16 bytes of rows g and g + 8 of
// tile j at slot + (2 j) * 512 and slot + (2 j + 1) * 512) times x's B fragments xw (word b of
// the lane's columns of x row 8 q + g: xw[q][b]), the rows' (s, b) words pr, into acc.
template <class V, int BITS, int NT, int RT, bool SAM, Int4Kind K4>
__device__ __forceinline__ void int_round(const char* slot, const uint32_t (&xw)[NT][64 / BITS],
                                          const uint32_t (&pr)[RT][2], float (&acc)[RT][NT][4]) {
  constexpr bool zp = K4 == Int4Kind::ZeroPoint;
  // Scale after the MMA: a round's 128 columns lie in one group of every row, so the MMA takes
  // 128 + q as decoded (exact in bf16) and sum (128 + q) x becomes s (that - 128 sum x) + b sum x
  // in fp32, per row; sum x over the round comes from one MMA of ones per B fragment.
  float sx[NT][4];
  if constexpr (SAM) {
    constexpr uint32_t kOnes = 0x3f803f80u;
    const uint32_t ones[4] = {kOnes, kOnes, kOnes, kOnes};
#pragma unroll
    for (int q = 0; q < NT; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) sx[q][e] = 0.0f;
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        mma::mma16816<true>(sx[q], ones, xw[q][4 * v], xw[q][4 * v + 1]);
        mma::mma16816<true>(sx[q], ones, xw[q][4 * v + 2], xw[q][4 * v + 3]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < RT; ++j) {
    const uint4 lo = *reinterpret_cast<const uint4*>(slot + (2 * j) * 512);
    const uint4 hi = *reinterpret_cast<const uint4*>(slot + (2 * j + 1) * 512);
    const uint32_t lw[4] = {lo.x, lo.y, lo.z, lo.w}, hw[4] = {hi.x, hi.y, hi.z, hi.w};
    if constexpr (SAM) {
      float raw[NT][4] = {};
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint32_t pl[4], ph[4];
        int4x8_to_biased_pairs(lw[v], pl);
        int4x8_to_biased_pairs(hw[v], ph);
        const uint32_t a0[4] = {pl[0], ph[0], pl[1], ph[1]}, a1[4] = {pl[2], ph[2], pl[3], ph[3]};
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          mma::mma16816<true>(raw[q], a0, xw[q][4 * v], xw[q][4 * v + 1]);
          mma::mma16816<true>(raw[q], a1, xw[q][4 * v + 2], xw[q][4 * v + 3]);
        }
      }
      float sc[2], off[2];  // rows g and g + 8: s, and b - 128 s (zero point: -(128 + z) s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[h] = param_lo<V>(pr[j][h]);
        const float hi = param_hi<V>(pr[j][h]);
        off[h] = zp ? hi * sc[h] : fmaf(-128.0f, sc[h], hi);
      }
#pragma unroll
      for (int q = 0; q < NT; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[j][q][e] = fmaf(sc[e >> 1], raw[q][e], fmaf(off[e >> 1], sx[q][e], acc[j][q][e]));
    } else if constexpr (BITS == 4) {
      uint32_t al, sl, bl, ah, sh, bh;
      int4_params<V::kBF16, K4>(pr[j][0], al, sl, bl);
      int4_params<V::kBF16, K4>(pr[j][1], ah, sh, bh);
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint32_t pl[4], ph[4];
        int4x8_decode<V::kBF16, K4>(lw[v], al, sl, bl, pl);
        int4x8_decode<V::kBF16, K4>(hw[v], ah, sh, bh, ph);
        const uint32_t a0[4] = {pl[0], ph[0], pl[1], ph[1]}, a1[4] = {pl[2], ph[2], pl[3], ph[3]};
#pragma unroll
        for (int q = 0; q < NT; ++q) {
          mma::mma16816<V::kBF16>(acc[j][q], a0, xw[q][4 * v], xw[q][4 * v + 1]);
          mma::mma16816<V::kBF16>(acc[j][q], a1, xw[q][4 * v + 2], xw[q][4 * v + 3]);
        }
      }
    } else {
      const uint32_t sl = __byte_perm(pr[j][0], 0, 0x1010), bl = __byte_perm(pr[j][0], 0, 0x3232);
      const uint32_t sh = __byte_perm(pr[j][1], 0, 0x1010), bh = __byte_perm(pr[j][1], 0, 0x3232);
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        uint32_t a[4];  // A fragment: row g (pair 0, 2), row g + 8, row g (pair 1, 3), row g + 8
        int8x4_to_pairs<V::kBF16>(lw[v], sl, bl, a[0], a[2]);
        int8x4_to_pairs<V::kBF16>(hw[v], sh, bh, a[1], a[3]);
#pragma unroll
        for (int q = 0; q < NT; ++q) mma::mma16816<V::kBF16>(acc[j][q], a, xw[q][2 * v], xw[q][2 * v + 1]);
      }
    }
  }
}

template <class V, int BITS, int NT, int RT, bool kF32Out, bool SAM, Int4Kind K4>
__global__ void __launch_bounds__(kGemvThreads, int_min_blocks(RT, NT))
    gemv_int_kernel(const uint16_t* x, const uint8_t* codes, const uint32_t* params, int group,
                    const uint16_t* bias, void* y, int ldy, int m, int n, int k, int g_step, int r_step,
                    IntExpertTiles ex) {
  // Experts (ex.expert set): CTA z takes tile z of the routing's tiles, whose expert's n rows
  // follow the previous experts' in codes, params and bias; its m = count rows of x are
  // x_rows[first ...] (or first ...), its rows of y first .... Everything depends on the
  // routing, so the wait comes first. A cluster shares its tile, so it leaves whole.
  int y_first = 0;
  const int32_t* x_map = nullptr;
  if (ex.expert) {
    pdl_wait();
    const int tile = int(blockIdx.z);
    if (tile >= *ex.tiles) return;
    const int e = ex.expert[tile];
    y_first = ex.first[tile];
    m = ex.count[tile];
    x_map = ex.x_rows ? ex.x_rows + y_first : nullptr;
    codes += size_t(e) * size_t(n) * (size_t(k) * BITS / 8);
    params += size_t(e) * size_t(n) * size_t(k / group);
    if (bias) bias += size_t(e) * size_t(n);
  }
  using Cfg = IntCfg<RT>;
  constexpr int S = Cfg::kStages, NW = kIntWarps, C = NT * 8, kRows = Cfg::kRows, kStageBytes = Cfg::kStageBytes;
  constexpr int C16 = 128 / BITS;   // codes in a lane's 16 bytes
  constexpr int kRound = kIntRound<BITS>;
  constexpr int XW = C16 / 2;       // 32-bit words of x per lane, row of x and round
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = int(blockIdx.x) * kRows;
  const int splits = int(gridDim.y), workers = splits * NW, worker = int(blockIdx.y) * NW + warp;
  const int kr = (k + kRound - 1) / kRound;
  const int rounds = worker < kr ? (kr - worker + workers - 1) / workers : 0;
  extern __shared__ uint4 gemv_int_smem[];
  char* const ring = reinterpret_cast<char*>(gemv_int_smem) + warp * S * kStageBytes;
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring)) + lane * 16;
  IntLaneRows<RT, BITS> lr(row0, g, t, n, k, group, worker * kRound + C16 * t, codes);
  auto issue = [&](int i) {
    if (i < rounds) {
      const int k0 = (worker + i * workers) * kRound;
      const bool ok = k0 + C16 * t < k;  // k % C16 == 0: a lane's codes are all in or all out
      const int off = ok ? k0 * BITS / 8 : 0;
      const uint32_t dst = ring_s + (i % S) * kStageBytes;
#pragma unroll
      for (int j = 0; j < RT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) mma::cp_async16(dst + (2 * j + h) * 512, lr.src[j][h] + off, ok ? 16 : 0);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  if (!ex.expert) pdl_wait();  // x is the previous kernel's output; the codes are not
  const uint16_t* xr[NT];
  bool xon[NT];
#pragma unroll
  for (int q = 0; q < NT; ++q) {
    xon[q] = g + 8 * q < m;
    const int xi = min(g + 8 * q, m - 1);
    xr[q] = x + size_t(x_map ? x_map[xi] : y_first + xi) * size_t(k) + C16 * t;
  }
  // x at the lane's columns of round i as loaded (16-byte words), a round ahead of its use, with
  // the (s, b) of the lane's rows; its 32-bit words are the B fragments as they are (the codes'
  // stored order makes the decode's pairs adjacent columns): B fragment b of word v is
  // xw[q][2 (MMA of the word) + b]. (Until then they were paired by byte permutes when the round
  // ran; permuting at load time had made every round wait for its successor's x.)
  constexpr int XU = XW / 4;
  auto load_x = [&](int i, uint4 (&xa)[NT][XU]) {
    const int k0 = (worker + i * workers) * kRound;
    const bool ok = i < rounds && k0 + C16 * t < k;
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int u = 0; u < XU; ++u) {
        xa[q][u] = make_uint4(0, 0, 0, 0);
        if (xon[q] && ok) xa[q][u] = __ldg(reinterpret_cast<const uint4*>(xr[q] + k0) + u);
      }
  };
  auto pair_x = [&](const uint4 (&xa)[NT][XU], uint32_t (&xw)[NT][XW]) {
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int u = 0; u < XU; ++u)
        xw[q][4 * u] = xa[q][u].x, xw[q][4 * u + 1] = xa[q][u].y, xw[q][4 * u + 2] = xa[q][u].z,
        xw[q][4 * u + 3] = xa[q][u].w;
  };
  auto load_p = [&](int i, uint32_t (&pr)[RT][2]) {
    const int k0 = (worker + i * workers) * kRound;
    lr.load_p(params, i < rounds && k0 + C16 * t < k, group, g_step, r_step, pr);
  };
  float acc[RT][NT][4] = {};
  uint4 xa[NT][XU];
  uint32_t pr[RT][2];
  load_x(0, xa);
  load_p(0, pr);
  for (int i = 0; i < rounds; ++i) {
    uint32_t xw[NT][XW], pn[RT][2];
    pair_x(xa, xw);
    load_x(i + 1, xa);
    load_p(i + 1, pn);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncwarp();
    issue(i + S - 1);  // refills the slot read in round i - 1
    const char* slot = ring + (i % S) * kStageBytes + lane * 16;
    int_round<V, BITS, NT, RT, SAM, K4>(slot, xw, pr, acc);
#pragma unroll
    for (int j = 0; j < RT; ++j) pr[j][0] = pn[j][0], pr[j][1] = pn[j][1];
    __syncwarp();  // every lane has read this slot before it is refilled
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the codes are read
  // acc[j][q][e]: weight row 16 j + g + 8 (e >> 1), x row 8 q + 2 t + (e & 1). The warps'
  // partial tiles reuse the ring, then their sum goes to red [kRows][C].
  __syncthreads();
  float* const part = reinterpret_cast<float*>(gemv_int_smem);
  float* const red = part + NW * kRows * C;
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        part[(warp * kRows + 16 * j + g + 8 * (e >> 1)) * C + 8 * q + 2 * t + (e & 1)] = acc[j][q][e];
  __syncthreads();
  for (int idx = int(threadIdx.x); idx < kRows * C; idx += kGemvThreads) {
    float v = 0.0f;
#pragma unroll
    for (int wi = 0; wi < NW; ++wi) v += part[wi * kRows * C + idx];
    red[idx] = v;
  }
  store_cluster_sums<V, kF32Out, kRows, C>(red, splits, row0, n, m, y_first, y, ldy, bias);
}

// x shared by the CTA (m = 9-16, plain GEMVs; KernelSwitches::int_shared_x_min_m). Above, a
// CTA's warps split k, so each warp loads its own columns of x from L2, and a 32-row CTA reads
// all of x for 32 rows of codes: at m = 16 two bytes of x for every byte of 4-bit codes. Here
// the 8 warps own different rows (RT tiles each: 128 RT rows a CTA) and walk the same rounds of
// k; a round's columns of x's 16 rows (4 KB for 4-bit codes) are copied into the CTA's ring once,
// beside each warp's codes, and read from shared memory when the round runs: a quarter (RT = 2)
// or half (RT = 1) a byte of x per byte of codes, and no x held a round ahead in registers.
// CTAs of a cluster along y split k (their sums added through distributed shared memory), so
// that short weights still fill the GPU.
template <int BITS, int RT>
struct IntXsCfg {
  static constexpr int kStages = 4, kRows = kIntWarps * 16 * RT;
  static constexpr int kXBytes = 16 * kIntRound<BITS> * 2;  // a round of x: 16 rows of 16-bit values
  static constexpr int kWarpBytes = RT * 2 * 32 * 16;       // a warp's codes in a round
  static constexpr int kStageBytes = kXBytes + kIntWarps * kWarpBytes;
  static constexpr int kSmem = kStages * kStageBytes;
};
// Where the 16-byte chunk c of row r of a round's x lies in its row: chunks swizzled so that the
// 8 lanes of a quarter warp (rows g, g + 1; t = 0..3) read 8 different bank groups.
template <int BITS>
__device__ __forceinline__ int xs_chunk(int r, int c) {
  return BITS == 4 ? c ^ ((r & 1) | (((c >> 3) & 1) << 1)) : c ^ (r & 1);
}

template <class V, int BITS, int RT, bool kF32Out, bool SAM, Int4Kind K4>
__global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_int_xs_kernel(const uint16_t* x, const uint8_t* codes, const uint32_t* params, int group,
                       const uint16_t* bias, void* y, int ldy, int m, int n, int k, int g_step, int r_step) {
  using Cfg = IntXsCfg<BITS, RT>;
  constexpr int NT = 2, S = Cfg::kStages, C = NT * 8, kRows = Cfg::kRows, kStageBytes = Cfg::kStageBytes;
  constexpr int C16 = 128 / BITS, kRound = kIntRound<BITS>, XW = C16 / 2, XU = XW / 4;
  constexpr int kXChunks = kRound * 2 / 16;  // 16-byte chunks of a row of x in a round
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = int(blockIdx.x) * kRows, wrow0 = row0 + warp * 16 * RT;
  const int splits = int(gridDim.y), split = int(blockIdx.y);
  const int kr = (k + kRound - 1) / kRound;
  const int rounds = split < kr ? (kr - split + splits - 1) / splits : 0;
  extern __shared__ uint4 gemv_int_smem[];
  char* const ring = reinterpret_cast<char*>(gemv_int_smem);
  const uint32_t ring_s = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  IntLaneRows<RT, BITS> lr(wrow0, g, t, n, k, group, split * kRound + C16 * t, codes);
  const uint32_t code_dst = ring_s + Cfg::kXBytes + warp * Cfg::kWarpBytes + lane * 16;
  auto issue_codes = [&](int i) {
    if (i >= rounds) return;
    const int k0 = (split + i * splits) * kRound;
    const bool ok = k0 + C16 * t < k;  // k % C16 == 0: a lane's codes are all in or all out
    const int off = ok ? k0 * BITS / 8 : 0;
    const uint32_t dst = code_dst + (i % S) * kStageBytes;
#pragma unroll
    for (int j = 0; j < RT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) mma::cp_async16(dst + (2 * j + h) * 512, lr.src[j][h] + off, ok ? 16 : 0);
  };
  // x: thread th copies chunk th % kXChunks (8 columns) of row th / kXChunks; rows past m, and
  // columns past k, are zeros (read from nowhere).
  const int xrow = int(threadIdx.x) / kXChunks, xc = int(threadIdx.x) % kXChunks;
  const uint16_t* const xsrc = x + size_t(min(xrow, m - 1)) * size_t(k) + 8 * xc;
  const uint32_t x_dst = ring_s + xrow * (kRound * 2) + xs_chunk<BITS>(xrow, xc) * 16;
  auto issue_x = [&](int i) {
    if (i >= rounds || xrow >= 16) return;
    const int k0 = (split + i * splits) * kRound;
    const bool ok = xrow < m && k0 + 8 * xc < k;  // k % 16 == 0: a chunk is all in or all out
    mma::cp_async16(x_dst + (i % S) * kStageBytes, ok ? static_cast<const void*>(xsrc + k0) : x, ok ? 16 : 0);
  };
  auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };
  auto load_p = [&](int i, uint32_t (&pr)[RT][2]) {  // (s, b) of the lane's rows, a round ahead
    const int k0 = (split + i * splits) * kRound;
    lr.load_p(params, i < rounds && k0 + C16 * t < k, group, g_step, r_step, pr);
  };
  // The codes do not depend on the previous kernel, x does: the first stages' codes go first,
  // each its own group, then their x as one group; round 0 waits for all of them, round i > 0
  // for the group issued S - 1 rounds before it.
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue_codes(i), commit();
  pdl_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue_x(i);
  commit();
  float acc[RT][NT][4] = {};
  uint32_t pr[RT][2];
  load_p(0, pr);
  for (int i = 0; i < rounds; ++i) {
    uint32_t pn[RT][2];
    load_p(i + 1, pn);
    if (i == 0) asm volatile("cp.async.wait_group 0;\n" ::);
    else asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    __syncthreads();  // round i's copies, every thread's, have landed; round i - 1's slot is read
    issue_codes(i + S - 1);
    issue_x(i + S - 1);
    commit();
    const char* stage = ring + (i % S) * kStageBytes;
    uint32_t xw[NT][XW];
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int u = 0; u < XU; ++u) {
        const int r = 8 * q + g;
        const uint4 v = *reinterpret_cast<const uint4*>(stage + r * (kRound * 2) + xs_chunk<BITS>(r, XU * t + u) * 16);
        xw[q][4 * u] = v.x, xw[q][4 * u + 1] = v.y, xw[q][4 * u + 2] = v.z, xw[q][4 * u + 3] = v.w;
      }
    int_round<V, BITS, NT, RT, SAM, K4>(stage + Cfg::kXBytes + warp * Cfg::kWarpBytes + lane * 16, xw, pr, acc);
#pragma unroll
    for (int j = 0; j < RT; ++j) pr[j][0] = pn[j][0], pr[j][1] = pn[j][1];
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the codes are read
  // acc[j][q][e]: weight row wrow0 + 16 j + g + 8 (e >> 1), x row 8 q + 2 t + (e & 1); the
  // warps' rows differ, so the CTA's sums go straight to red [kRows][C] (over the ring).
  __syncthreads();
  float* const red = reinterpret_cast<float*>(gemv_int_smem);
#pragma unroll
  for (int j = 0; j < RT; ++j)
#pragma unroll
    for (int q = 0; q < NT; ++q)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        red[(warp * 16 * RT + 16 * j + g + 8 * (e >> 1)) * C + 8 * q + 2 * t + (e & 1)] = acc[j][q][e];
  store_cluster_sums<V, kF32Out, kRows, C>(red, splits, row0, n, m, 0, y, ldy, bias);
}

// The cluster split (as gemv_fp8.cu's tc_splits, measured there): 2 where the grid has fewer
// row blocks than SMs and each warp keeps at least 2 rounds, else 1.
// copies: how many weights of n rows the launch multiplies (the experts a step routes to).
int int_splits(int rows_per_cta, int n, int k, int round, int copies = 1) {
  if (compute_capability() < 90) return 1;  // no thread-block clusters
  const int blocks = (n + rows_per_cta - 1) / rows_per_cta * copies, kr = (k + round - 1) / round;
  return blocks < sm_count() && kr >= 2 * kIntWarps * 2 ? 2 : 1;
}

// ex: the experts' tiles (gemv_int_experts), grid z over its max_tiles; else a plain GEMV.
// XS: gemv_int_xs_kernel (NT = 2; plain GEMVs only).
template <class V, int BITS, int NT, int RT, bool kF32Out, bool SAM, Int4Kind K4, bool XS>
void launch_int(const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m, int n, int k,
                cudaStream_t st, const IntExpertTiles& ex) {
  if constexpr (XS) {
    using Cfg = IntXsCfg<BITS, RT>;
    constexpr auto kernel = gemv_int_xs_kernel<V, BITS, RT, kF32Out, SAM, K4>;
    const int resident = resident_ctas<kernel, Cfg::kSmem>();
    const int blocks = (n + Cfg::kRows - 1) / Cfg::kRows, kr = (k + kIntRound<BITS> - 1) / kIntRound<BITS>;
    // A cluster's CTAs split k as long as the grid stays within one wave of resident CTAs and
    // each CTA keeps two rounds or more.
    const int splits = compute_capability() < 90
                           ? 1
                           : std::clamp(resident / blocks, 1, std::min(kIntMaxSplits, std::max(1, kr / 2)));
    const int stride = splits * kIntRound<BITS>;  // columns a round of every CTA of a cluster covers
    KVLM_CUDA_CHECK(launch_pdl_cluster<kernel>(dim3(unsigned(blocks), unsigned(splits)), dim3(kGemvThreads),
                                               Cfg::kSmem, st, splits, static_cast<const uint16_t*>(x), w.codes,
                                               w.params, w.group, static_cast<const uint16_t*>(bias), y, ldy, m,
                                               n, k, stride / w.group, stride % w.group));
  } else {
    using Cfg = IntCfg<RT>;
    constexpr auto kernel = gemv_int_kernel<V, BITS, NT, RT, kF32Out, SAM, K4>;
    resident_ctas<kernel, Cfg::kSmem>();  // opts the kernel in to its shared memory
    const int splits =
        std::min(kIntMaxSplits, int_splits(Cfg::kRows, n, k, kIntRound<BITS>, ex.expert ? ex.routed : 1));
    const dim3 grid(unsigned((n + Cfg::kRows - 1) / Cfg::kRows), unsigned(splits),
                    unsigned(ex.expert ? ex.max_tiles : 1));
    const int stride = splits * kIntWarps * kIntRound<BITS>;  // columns a round of every warp covers
    KVLM_CUDA_CHECK(launch_pdl_cluster<kernel>(grid, dim3(kGemvThreads), Cfg::kSmem, st, splits,
                                               static_cast<const uint16_t*>(x), w.codes, w.params, w.group,
                                               static_cast<const uint16_t*>(bias), y, ldy, m, n, k,
                                               stride / w.group, stride % w.group, ex));
  }
}

template <class V, int BITS>
void launch_int_any(bool f32, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m, int n,
                    int k, cudaStream_t st, const IntExpertTiles& ex) {
  const bool sam = !w.e2m1 && gemv_int_scales_after_mma(V::kBF16 ? DType::BF16 : DType::F16, BITS, w.group);
  auto launch = [&](auto nt, auto rt, auto kind, auto xs) {
    constexpr int NT = decltype(nt)::value, RT = decltype(rt)::value;
    constexpr Int4Kind K4 = decltype(kind)::value;
    constexpr bool kSam = BITS == 4 && V::kBF16 && K4 != Int4Kind::E2M1, XS = decltype(xs)::value;
    if (kSam && sam) {
      if (f32) launch_int<V, BITS, NT, RT, true, kSam, K4, XS>(x, w, bias, y, ldy, m, n, k, st, ex);
      else launch_int<V, BITS, NT, RT, false, kSam, K4, XS>(x, w, bias, y, ldy, m, n, k, st, ex);
      return;
    }
    if (f32) launch_int<V, BITS, NT, RT, true, false, K4, XS>(x, w, bias, y, ldy, m, n, k, st, ex);
    else launch_int<V, BITS, NT, RT, false, false, K4, XS>(x, w, bias, y, ldy, m, n, k, st, ex);
  };
  auto go = [&](auto nt, auto rt, auto xs) {
    if constexpr (BITS == 4) with_int4_kind(w, [&](auto kind) { launch(nt, rt, kind, xs); });
    else launch(nt, rt, std::integral_constant<Int4Kind, Int4Kind::Affine>{}, xs);
  };
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using XS = std::true_type;  // gemv_int_xs_kernel
  using NX = std::false_type;
  const KernelSwitches sw = kernel_switches();
  if (!ex.expert && gemv_int_shares_x(w, m, n, k)) {
    // 256-row CTAs up to 4 row blocks per SM (qkv: 13.2 against 18.5 µs at 128 rows), else
    // 128-row ones (the LM head: 180 against 192 µs); weights-4bit.md.
    const int tiles = sw.int_shared_x_tiles > 0 ? sw.int_shared_x_tiles : (n + 255) / 256 > 4 * sm_count() ? 1 : 2;
    if (tiles == 1) go(I2{}, I1{}, XS{});
    else go(I2{}, I2{}, XS{});
    return;
  }
  // As gemv_fp8.cu: 32-row CTAs where they give 1.4 CTAs per SM or more, else 64-row CTAs.
  const bool small = (n + 31) / 32 * (ex.expert ? ex.routed : 1) >= sm_count() * 7 / 5;
  // 4-bit codes at m > 8 (two B tiles of 32 columns of x per lane) spill at 64 rows.
  if (m <= 8) small ? go(I1{}, I2{}, NX{}) : go(I1{}, I4{}, NX{});
  else if constexpr (BITS == 4) go(I2{}, I2{}, NX{});
  else small ? go(I2{}, I2{}, NX{}) : go(I2{}, I4{}, NX{});
}

// One thread per 16 bytes of codes (C16 values of one group): out = s * code + b, rounded to the
// compute type as the GEMV's decode rounds it.
template <class V, int BITS, Int4Kind K4>
__global__ void dequantize_int_kernel(const uint4* codes, const uint32_t* params, int group, int ng, uint4* out,
                                      int total, int vpr) {
  constexpr int C16 = 128 / BITS;
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= total) return;
  const int row = i / vpr, c0 = (i - row * vpr) * C16;
  const uint32_t p = params[size_t(row) * size_t(ng) + size_t(c0 / group)];
  const uint4 c = codes[i];
  const uint32_t cw[4] = {c.x, c.y, c.z, c.w};
  uint32_t o[C16 / 2];
  if constexpr (BITS == 4) {
    uint32_t a2, s2, b2;
    int4_params<V::kBF16, K4>(p, a2, s2, b2);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      uint32_t pr[4];  // columns (0, 1), (2, 3), (4, 5), (6, 7) of the word: column order
      int4x8_decode<V::kBF16, K4>(cw[v], a2, s2, b2, pr);
#pragma unroll
      for (int j = 0; j < 4; ++j) o[4 * v + j] = pr[j];
    }
  } else {
    const uint32_t s2 = __byte_perm(p, 0, 0x1010), b2 = __byte_perm(p, 0, 0x3232);
#pragma unroll
    for (int v = 0; v < 4; ++v) int8x4_to_pairs<V::kBF16>(cw[v], s2, b2, o[2 * v], o[2 * v + 1]);  // columns (0, 1), (2, 3)
  }
#pragma unroll
  for (int u = 0; u < C16 / 8; ++u)
    out[size_t(i) * (C16 / 8) + size_t(u)] = make_uint4(o[4 * u], o[4 * u + 1], o[4 * u + 2], o[4 * u + 3]);
}

template <class V>
__global__ void embed_int_kernel(const uint8_t* codes, const uint32_t* params, int bits, int group, bool zp,
                                 bool e2m1, const TokenId* tokens, int hidden, float* x, float scale) {
  const int r = blockIdx.x;
  const size_t tok = size_t(tokens[r]);
  const uint8_t* c = codes + tok * size_t(hidden) * size_t(bits) / 8;
  const uint32_t* p = params + tok * size_t(hidden / group);
  float* dst = x + size_t(r) * size_t(hidden);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    const int code = grouped_code(bits, c, i);  // io/grouped_codes.h's order
    const uint32_t pg = p[i / group];
    const float magic = V::kBF16 ? 128.0f : 1024.0f;  // zero point: hi = -(magic + z)
    dst[i] = (e2m1 ? V::load(e2m1_bits<V::kBF16>(code)) * param_lo<V>(pg)  // as e2m1x8_to_pairs decodes
              : zp ? param_lo<V>(pg) * (float(code) + magic + param_hi<V>(pg))
                   : param_lo<V>(pg) * float(code) + param_hi<V>(pg)) *
             scale;
  }
}

void launch_any(DType ab, bool f32, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m, int n,
                int k, cudaStream_t st, const IntExpertTiles& ex) {
  if (ab == DType::BF16) {
    if (w.bits == 4) launch_int_any<VecBF16, 4>(f32, x, w, bias, y, ldy, m, n, k, st, ex);
    else launch_int_any<VecBF16, 8>(f32, x, w, bias, y, ldy, m, n, k, st, ex);
  } else {
    if (w.bits == 4) launch_int_any<VecF16, 4>(f32, x, w, bias, y, ldy, m, n, k, st, ex);
    else launch_int_any<VecF16, 8>(f32, x, w, bias, y, ldy, m, n, k, st, ex);
  }
}

}  // namespace

bool gemv_int_scales_after_mma(DType ab, int bits, int group) {
  // f16's magic number is 1024: the cancellation of 1024 sum x would cost more than it saves.
  return ab == DType::BF16 && bits == 4 && group % 128 == 0 && kernel_switches().int_scale_after_mma;
}

bool gemv_int_shares_x(const IntWeight& w, int m, int n, int k) {
  const KernelSwitches sw = kernel_switches();
  if (m < sw.int_shared_x_min_m || m > kGemvIntMaxM) return false;
  // Measured at m = 16 (decode_bench --int-lab): faster on gate/up, qkv and the LM head at k =
  // 4096 with 4-bit codes; slower on o (n = 4096), down (k = 12288) and most 8-bit shapes.
  return !sw.int_shared_x_by_shape || (w.bits == 4 && k <= 4096 && n >= 6144);
}

bool int_layout_fits(int k, int bits, int group) {
  const int c16 = bits == 4 ? 32 : bits == 8 ? 16 : 0;
  return c16 > 0 && k > 0 && group > 0 && k % c16 == 0 && group % c16 == 0 && k % group == 0;
}

void gemv_int(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
              int n, int k, void* stream) {
  if (m <= 0 || n <= 0) return;
  if (m > kGemvIntMaxM)
    throw Error("gemv_int: takes m <= " + std::to_string(kGemvIntMaxM) + " (dequantize_int + the GEMM above)");
  check_int("gemv_int", ab, w, k);
  if (int64_t(n) * (k / w.group) >= (int64_t(1) << 32))
    throw Error("gemv_int: " + std::to_string(n) + " rows of " + std::to_string(k / w.group) +
                " groups exceed the kernel's 32-bit parameter offsets");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("gemv_int: x must be 16-byte aligned");
  if (out != ab && out != DType::F32) throw Error("gemv_int: output must be the input type or float32");
  if (ldy < n) throw Error("gemv_int: the output's row stride is shorter than its rows");
  if (gemv_int_dp4a_takes(ab, w, m, k) && gemv_int_dp4a_pays(m, n, k)) return gemv_int_dp4a(ab, out, x, w, bias, y, ldy, m, n, k, stream);
  launch_any(ab, out == DType::F32, x, w, bias, y, ldy, m, n, k, static_cast<cudaStream_t>(stream), {});
}

void gemv_int_experts(DType ab, const void* x, const IntWeight& w, const void* bias, void* y, int max_m, int n, int k,
                      const IntExpertTiles& tiles, void* stream) {
  if (tiles.max_tiles <= 0 || n <= 0) return;
  if (max_m < 1 || max_m > kGemvIntMaxM)
    throw Error("gemv_int_experts: a tile holds 1 to " + std::to_string(kGemvIntMaxM) + " rows of x");
  if (!tiles.expert || !tiles.first || !tiles.count || !tiles.tiles)
    throw Error("gemv_int_experts: the tiles' arrays are missing");
  if (tiles.max_tiles > 65535) throw Error("gemv_int_experts: more than 65535 tiles exceed the grid's z dimension");
  check_int("gemv_int_experts", ab, w, k);
  if (int64_t(n) * (k / w.group) >= (int64_t(1) << 32))
    throw Error("gemv_int_experts: an expert's " + std::to_string(n) + " rows of " + std::to_string(k / w.group) +
                " groups exceed the kernel's 32-bit parameter offsets");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0) throw Error("gemv_int_experts: x must be 16-byte aligned");
  IntExpertTiles ex = tiles;
  ex.routed = std::clamp(ex.routed, 1, ex.max_tiles);
  if (gemv_int_dp4a_takes(ab, w, max_m, k) && gemv_int_dp4a_pays(max_m, n, k))
    return gemv_int_dp4a(ab, ab, x, w, bias, y, n, max_m, n, k, stream, ex);
  launch_any(ab, false, x, w, bias, y, n, max_m, n, k, static_cast<cudaStream_t>(stream), ex);
}

void dequantize_int(DType to, const IntWeight& w, void* out, int n, int k, void* stream) {
  check_int("dequantize_int", to, w, k);
  const int vpr = k * w.bits / 8 / 16;  // 16-byte vectors of codes per row
  const size_t vectors = size_t(n) * size_t(vpr);
  if (vectors == 0) return;
  if (vectors > size_t(INT32_MAX)) throw Error("dequantize_int: the weight is too large");
  const unsigned blocks = unsigned((vectors + 255) / 256);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* c = reinterpret_cast<const uint4*>(w.codes);
  auto* o = static_cast<uint4*>(out);
  const int ng = k / w.group;
  auto go = [&](auto kernel) {
    kernel<<<blocks, 256, 0, st>>>(c, w.params, w.group, ng, o, int(vectors), vpr);
    KVLM_CUDA_CHECK(cudaGetLastError());
  };
  auto by_kind = [&](auto v) {
    using V = decltype(v);
    if (w.bits == 8) return go(dequantize_int_kernel<V, 8, Int4Kind::Affine>);
    with_int4_kind(w, [&](auto kind) { go(dequantize_int_kernel<V, 4, decltype(kind)::value>); });
  };
  if (to == DType::BF16) by_kind(VecBF16{});
  else by_kind(VecF16{});
}

void embed_rows_int(DType act, const IntWeight& w, const TokenId* tokens, int rows, int hidden, float* x,
                    void* stream, float scale) {
  if (rows <= 0) return;
  check_int("embed_rows_int", act, w, hidden);
  const auto st = static_cast<cudaStream_t>(stream);
  if (act == DType::BF16)
    embed_int_kernel<VecBF16><<<unsigned(rows), 256, 0, st>>>(w.codes, w.params, w.bits, w.group, w.zero_point,
                                                               w.e2m1, tokens, hidden, x, scale);
  else
    embed_int_kernel<VecF16><<<unsigned(rows), 256, 0, st>>>(w.codes, w.params, w.bits, w.group, w.zero_point,
                                                              w.e2m1, tokens, hidden, x, scale);
  KVLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvlm::cuda

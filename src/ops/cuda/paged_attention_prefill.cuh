// Tiled paged attention for multi-token queries (prefill, chunked prefill, any block of
// queries over existing context), FlashAttention-2 style on mma.sync m16n8k16 tensor cores,
// for every KV format, head sizes 64 / 128 / 256, causal / sliding / non-causal masks.
//
// Why a second tensor-core kernel: the decode kernel (paged_attention_mma.cuh) puts 16 /
// group query rows of one sequence in a CTA and streams their keys from global memory per
// warp, so a 4k prompt re-reads its K/V once per 4 query rows: 65 TFLOP/s at 4k
// (docs/results/kernel-lab.md). Here a CTA holds BM = 128 (head 256: 64) M rows in
// shared memory — (query token, head of the GQA group) pairs, m = token * group + head, so
// every head of a KV group shares each K/V tile — and streams BN-key tiles of K and V
// through shared memory once for all of them; the 4 warps each own 16 * MT M rows.
//
// Per tile: S = Q K^T (ldmatrix from swizzled shared memory, fp32 accumulators), mask,
// online softmax in the exp2 domain, P (rounded to the mma type: bf16 for a bf16 cache,
// f16 otherwise, as FlashAttention and cuDNN do; the tests bound the resulting error) times V.
// Loads: cp.async into a 2-stage ring, the next tile streaming while this one is computed.
// 16-bit caches land directly in the swizzled layout the mma operands are read from; 1-byte
// caches (FP8 E4M3/E5M2, INT8) land raw and are expanded exactly to f16 in shared memory
// once per tile (every fp8 and int8 value is an f16), the scales staying out of the codes:
// per-tensor K scale folded into the score scale, V scale applied to the output,
// per-token-head K scales multiplied into S per key, V scales into P per key (as the decode
// kernel does). Keys outside the CTA's range are zero-filled, never read: stale page rows
// may hold NaN, and 0 * NaN in P.V would poison a row.
//
// Split-KV (a short chunk over a long context does not fill the GPU) uses the decode path's
// partials and reduction kernel. CTAs are issued heaviest first (the last query rows of a
// causal prompt see the most keys), so the tail of the grid is short CTAs.
//
// This header holds what the two kernels share — tile shapes, the loaders, the 1-byte
// expansion, the softmax and the output store — and the launch helpers:
// paged_attention_prefill.cu is the mma.sync kernel (every GPU) and the entry points,
// paged_attention_prefill_wgmma.cu the warp-specialised warpgroup-MMA kernel (sm_90a).
#pragma once

#include <string_view>
#include <type_traits>

#include "ops/cuda/paged_attention_rows.cuh"  // first: the formats and types the mma helpers use
#include "ops/cuda/mma_operands.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {
namespace {

constexpr int kPrefillWarps = 4;

template <int HD>
struct PrefillTile {
  static constexpr int MT = HD <= 128 ? 2 : 1;            // m16 tiles per warp
  static constexpr int BM = 16 * MT * kPrefillWarps;      // M rows per CTA: 128 or 64
  static constexpr int BN = HD <= 128 ? 64 : 32;          // keys per tile
};

template <class Fmt, int HD>
struct PrefillSmem {
  static constexpr int BITS = Fmt::kBits;
  static constexpr bool kPTH = Fmt::kScale == Scale::PerTokenHead;
  static constexpr bool kI4 = kIsInt4<Fmt>;
  static constexpr int BM = PrefillTile<HD>::BM, BN = PrefillTile<HD>::BN;
  static constexpr size_t q = size_t(BM) * HD * 2;                 // f16/bf16 Q, swizzled
  static constexpr size_t kv = size_t(BN) * HD * BITS / 8;         // one K (or V) tile as stored
  static constexpr size_t scales = kPTH ? 2 * BN * sizeof(float) : 0;
  static constexpr size_t stage = 2 * kv + scales;                 // K, V, K scales, V scales
  static constexpr size_t conv = BITS < 16 ? 2 * size_t(BN) * HD * 2 : 0;  // expanded K, V (f16)
  static constexpr size_t qsum = kI4 ? size_t(BM) * sizeof(float) : 0;    // int4: sum(q) per M row
  static constexpr size_t total = q + 2 * stage + conv + qsum;
};

using mma::ldsm_x4;
using mma::ldsm_x4_trans;

// 16-bit tiles in shared memory: row r holds HD values as HD / 8 chunks of 16 B, chunk c
// stored at position c ^ (r % 8), so the 8 rows an ldmatrix phase reads at one column hit 8
// different bank groups (an unswizzled 256 B row stride is an 8-way conflict).
template <int HD>
__device__ __forceinline__ int swz(int r, int c) {
  return r * (HD / 8) + (c ^ (r & 7));
}

// The CTA's share of the work, the same for both kernel variants: the sequence, its query
// tokens [r0, r0 + ntok) as M rows m = token * group + head (m < mrows), and the keys
// [t0, t1) of its split. CTAs are issued heaviest first (the last query rows of a causal
// prompt see the most keys), so the tail of the grid is short CTAs.
struct CtaWork {
  int seq, r0, ntok, mrows, q_begin, kv_len, pos0;
  int part;  // RowsArgs::exact_part
  int t0, t1;
  int lo_inner, hi_inner;  // a tile inside [lo_inner, hi_inner) is visible to every row: no mask
  // False when the sequence has fewer rows than this CTA's first (CTA-uniform: return).
  __device__ bool init(const RowsArgs& a) {
    const PagedAttentionParams& p = a.p;
    seq = int(blockIdx.x) / a.row_groups;
    r0 = (a.row_groups - 1 - int(blockIdx.x) % a.row_groups) * a.rows_per_cta;
    q_begin = p.cu_q_lens[seq];
    const int q_len = p.cu_q_lens[seq + 1] - q_begin;
    if (r0 >= q_len) return false;
    ntok = min(a.rows_per_cta, q_len - r0);
    mrows = ntok * a.group;
    kv_len = p.kv_lens[seq];
    pos0 = kv_len - q_len + r0;
    part = a.exact_part;
    // The pass's ranges (pass_range: the visible keys, or with exact sink / recent tokens the
    // quantized ones, the exact sinks or the exact window) grow with the position or are the
    // same for every row (non-causal; kv/attention_mask.h): the union is [lo(first token),
    // hi(last token)), split across blockIdx.z (range_splits of them; the exact passes are one
    // split) in 16-key multiples. A first token with none of the pass's keys may have lo > hi:
    // no tile then for it, and an empty union when the last token has none either.
    int lo_first, hi_first, lo_last, hi_last;
    pass_range(p, part, pos0, kv_len, lo_first, hi_first);
    pass_range(p, part, pos0 + ntok - 1, kv_len, lo_last, hi_last);
    split_range<16>(lo_first, max(lo_first, hi_last), part ? 1 : a.range_splits, part ? 0 : int(blockIdx.z),
                    a.decreasing_splits, t0, t1);
    lo_inner = max(lo_last, t0);
    hi_inner = min(hi_first, t1);
    return true;
  }
  // The pass's keys of M row m within [t0, t1). Rows past the CTA's tokens compute on zero
  // queries and are never stored: they get the whole range.
  __device__ void row_range(const PagedAttentionParams& p, int m, int G, int& lo, int& hi) const {
    lo = t0;
    hi = t1;
    if (m < mrows) {
      pass_range(p, part, pos0 + m / G, kv_len, lo, hi);
      lo = max(lo, t0);
      hi = min(hi, t1);
    }
  }
  // The partial this CTA writes (store_rows): its split of the quantized keys, or the exact
  // pass's slot after them.
  __device__ static int split(const RowsArgs& a) {
    return a.exact_part == 0 ? int(blockIdx.z) : a.range_splits + (a.exact_part == 2 && a.p.keep_sink > 0 ? 1 : 0);
  }
  // Tiles start at the 16-key run holding t0 (a run never straddles a page).
  __device__ int first_key() const { return t0 & ~15; }
  __device__ int num_tiles(int bn) const { return t1 > t0 ? (t1 - first_key() + bn - 1) / bn : 0; }
};

// Loads the BN keys from kb of K and V (as stored) with cp.async: 16-byte piece c of key row r
// goes to byte dst(r, c, i) of k_out / v_out (i = r * RB / 16 + c), keys outside [t0, t1)
// zero-filled — stale page rows may hold NaN, and 0 * NaN in P.V would poison a row. Per-
// token-head modes also load the tile's K scales to scales[0, BN) and V scales to
// scales[BN, 2 BN), 4 per piece (scale_piece); a 16-key run is loaded when it overlaps
// [t0, t1) (its page exists), and stale entries of masked keys never reach the math
// (key_factors zeroes them). tid is the thread's index among the THREADS loading threads.
// Does not commit.
template <int BN>
__device__ __forceinline__ int scale_piece(int tid) {  // float offset of loader tid < BN / 2
  return (tid >= BN / 4 ? BN : 0) + (tid % (BN / 4)) * 4;
}
template <int BN, int RB, int THREADS, bool kPTH, class Dst>
__device__ __forceinline__ void load_kv_tile(const PagedAttentionParams& p, const PageRows& pr, const CtaWork& w, int kb,
                                             char* k_out, char* v_out, float* scales, Dst dst, int tid) {
  constexpr int PIECES = BN * RB / 16;
  static_assert(PIECES % THREADS == 0, "tile pieces must divide among the threads");
  const char* kbase = static_cast<const char*>(p.k_cache);
  const char* vbase = static_cast<const char*>(p.v_cache);
#pragma unroll
  for (int it = 0; it < PIECES / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int r = i / (RB / 16), c = i % (RB / 16);
    const int key = kb + r;
    const bool ok = key >= w.t0 && key < w.t1;
    size_t off = 0;
    if (ok) off = size_t(pr.row(key)) * RB + c * 16;
    const int d = dst(r, c, i);
    mma::cp_async16(k_out + d, kbase + off, ok ? 16 : 0);
    mma::cp_async16(v_out + d, vbase + off, ok ? 16 : 0);
  }
  if constexpr (kPTH) {
    if (tid < BN / 2) {
      const bool is_v = tid >= BN / 4;
      const int r = (tid % (BN / 4)) * 4;
      const int run = (kb + r) & ~15;
      const bool ok = run < w.t1 && run + 16 > w.t0;
      size_t off = 0;
      if (ok) off = size_t(pr.row(kb + r));
      const float* src = (is_v ? p.v_token_scale : p.k_token_scale) + off;
      mma::cp_async16(scales + scale_piece<BN>(tid), src, ok ? 16 : 0);
    }
  }
}

// Q into shared memory: M row m is query token r0 + m / G, head kvh * G + m % G (zero past
// the CTA's rows), converted to f16 when the cache's mma type is f16; 16-byte chunk c of row
// m goes to sQ[dst(m, c)]. THREADS threads (tid = index among them) load rows [m0, m0 + ROWS).
template <int ROWS, int HD, int THREADS, bool kBF, class Dst>
__device__ __forceinline__ void load_q(const PagedAttentionParams& p, const CtaWork& w, int G, int kvh, uint4* sQ, Dst dst,
                                       int tid, int m0) {
  constexpr int CPR = HD / 8;
  static_assert(ROWS * CPR % THREADS == 0, "Q chunks must divide among the threads");
#pragma unroll 4
  for (int it = 0; it < ROWS * CPR / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int m = m0 + i / CPR, c = i % CPR;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < w.mrows) {
      v = __ldg(reinterpret_cast<const uint4*>(p.q + (size_t(w.q_begin + w.r0 + m / G) * p.num_q_heads + kvh * G + m % G) * HD) + c);
      if constexpr (!kBF) {
        v.x = mma::pack2<false>(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u));
        v.y = mma::pack2<false>(__uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
        v.z = mma::pack2<false>(__uint_as_float(v.z << 16), __uint_as_float(v.z & 0xffff0000u));
        v.w = mma::pack2<false>(__uint_as_float(v.w << 16), __uint_as_float(v.w & 0xffff0000u));
      }
    }
    sQ[dst(m, c)] = v;
  }
}

// Expands a tile's 1-byte or 4-bit codes (K and V, as loaded by load_kv_tile) exactly to f16:
// raw chunk c of row r (16 or 32 codes) becomes the f16 chunks X c .. X c + X - 1 (X = 2 or 4),
// stored at chunk index dst(r, .). Thread tid expands the pieces load_kv_tile<.., THREADS> gave it.
template <class Fmt, int BN, int HD, int THREADS, class Dst>
__device__ __forceinline__ void expand_tile(const char* k_raw, const char* v_raw, uint4* k_out, uint4* v_out, Dst dst,
                                            int tid) {
  constexpr int RB = HD * Fmt::kBits / 8;
  constexpr int X = 8 / Fmt::kBits * 2;  // f16 chunks per raw chunk
  constexpr int PIECES = BN * RB / 16;
#pragma unroll
  for (int it = 0; it < PIECES / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int r = i / (RB / 16), c = i % (RB / 16);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const uint4 raw = reinterpret_cast<const uint4*>(kv ? v_raw : k_raw)[i];
      uint32_t w[4 * X];
      mma::to_pairs<Fmt, 16>(&raw, w);
      uint4* out = kv ? v_out : k_out;
#pragma unroll
      for (int x = 0; x < X; ++x) out[dst(r, X * c + x)] = make_uint4(w[4 * x], w[4 * x + 1], w[4 * x + 2], w[4 * x + 3]);
    }
  }
}

// int4: the zero points of a tile's keys (kz: times the score scale, vz: times the P scale;
// 0 outside [t0, t1), like the factors below), and the step in place of the K / V scale.
template <int NT>
struct KeyZeros {
  float kz[NT][2], vz[NT][2];
};

// Per-key factors of a tile, once per tile: kf = the score scale (times the key's K scale),
// vf = the P factor (the key's V scale times kPScale). Keys outside [t0, t1) get 0: their
// scale slots may be stale or NaN, and a 0 never carries a NaN into S or P. A full tile (every
// key visible to every row, softmax_rows) lies inside [t0, t1): no test then.
template <int NT, bool kPTH, bool kI4 = false>
__device__ __forceinline__ void key_factors(float (&kf)[NT][2], float (&vf)[NT][2], float sscale, const float* ksc,
                                            const float* vsc, float p_scale, bool full, int kb, int t, int t0, int t1,
                                            KeyZeros<NT>* zp = nullptr) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      kf[nt][e] = sscale;
      vf[nt][e] = 1.0f;
      if constexpr (kI4) {  // the scale slots hold {f16 step, f16 zero}
        const int kj = nt * 8 + 2 * t + e;
        const bool ok = full || (kb + kj >= t0 && kb + kj < t1);
        float ks, kz, vs, vz;
        FmtI4::unpack(__float_as_uint(ksc[kj]), ks, kz);
        FmtI4::unpack(__float_as_uint(vsc[kj]), vs, vz);
        kf[nt][e] = ok ? sscale * ks : 0.0f;
        vf[nt][e] = ok ? vs * p_scale : 0.0f;
        zp->kz[nt][e] = ok ? sscale * kz : 0.0f;
        zp->vz[nt][e] = ok ? vz * p_scale : 0.0f;
      } else if constexpr (kPTH) {
        const int kj = nt * 8 + 2 * t + e;
        const bool ok = full || (kb + kj >= t0 && kb + kj < t1);
        kf[nt][e] = ok ? sscale * ksc[kj] : 0.0f;
        vf[nt][e] = ok ? vsc[kj] * p_scale : 0.0f;
      }
    }
}

// Mask and online softmax for the two M rows (g, g + 8) a thread holds in one m16 slice of
// S (the m16n8 accumulator layout, the same for mma.sync and wgmma: s[nt][e] is row g + 8
// (e >> 1), key kb + 8 nt + 2t + (e & 1)). Updates the running max / sum and rescales o;
// leaves P (times the V factors) in s. Callers pass `full` as a literal in each branch of an
// if, so that tiles no row masks compile without the mask. Without per-key factors the score
// scale (> 0) is applied after the max and folded into the exponent's FFMA. int4 (kI4): the
// score gains zero * sum(q) of the row (qs), and zacc of the row sums P times V's zero points.
template <int NT, int DT, bool kPTH, bool kI4 = false>
__device__ __forceinline__ void softmax_rows(float (&s)[NT][4], float (&o)[DT][4], float (&m_run)[2], float (&l_run)[2],
                                             const float (&kf)[NT][2], const float (&vf)[NT][2], float sscale,
                                             bool full, int kb, int t, const int (&rlo)[2], const int (&rhi)[2],
                                             const KeyZeros<NT>* zp = nullptr, const float* qs = nullptr,
                                             float* zacc = nullptr) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kj = nt * 8 + 2 * t + e;
        float x = kPTH ? s[nt][2 * i + e] * kf[nt][e] : s[nt][2 * i + e];
        if constexpr (kI4) x = fmaf(zp->kz[nt][e], qs[i], x);
        if (!full && (kb + kj < rlo[i] || kb + kj >= rhi[i])) x = -INFINITY;
        s[nt][2 * i + e] = x;
        mx = fmaxf(mx, x);
      }
    if (!kPTH && mx != -INFINITY) mx *= sscale;
    const float m_use = mma::online_max(mx, m_run[i], l_run[i], o, i, kI4 ? &zacc[i] : nullptr);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = s[nt][2 * i + e];
        const float pe = exp2_approx(kPTH ? x - m_use : fmaf(x, sscale, -m_use));
        l_run[i] += pe;
        s[nt][2 * i + e] = kPTH ? pe * vf[nt][e] : pe;
        if constexpr (kI4) zacc[i] = fmaf(pe, zp->vz[nt][e], zacc[i]);
      }
  }
}

// int4: each row's V zero-point sum (zacc, per thread: its keys) added to every output
// dimension of the row once the 4 threads of the row have summed theirs.
template <int DT>
__device__ __forceinline__ void add_zero_points(float (&o)[DT][4], float (&zacc)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float z = zacc[i];
    z += __shfl_xor_sync(0xffffffffu, z, 1);
    z += __shfl_xor_sync(0xffffffffu, z, 2);
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      o[d][2 * i] += z;
      o[d][2 * i + 1] += z;
    }
  }
}

// The epilogue of one thread's two M rows in one m16 slice: o / l to bf16 output, or the
// unnormalised partial and (max, sum) for the split-KV reduction.
template <int HD>
__device__ __forceinline__ void store_rows(const RowsArgs& a, const float (&o)[HD / 8][4], const float (&m_run)[2],
                                           const float (&l_run)[2], int m0, int mrows, int G, size_t row0, int kvh,
                                           int split, int t, float vscale, float p_scale) {
  const PagedAttentionParams& p = a.p;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float L = l_run[i];
    L += __shfl_xor_sync(0xffffffffu, L, 1);
    L += __shfl_xor_sync(0xffffffffu, L, 2);
    const int m = m0 + 8 * i;
    if (m >= mrows) continue;
    const size_t row = row0 + size_t(m / G);
    const int h = kvh * G + m % G;
    if (a.num_splits == 1) {
      L += sink_term(p, h, m_run[i]);
      const float inv = L > 0.0f ? vscale / (p_scale * L) : 0.0f;
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + (row * p.num_q_heads + h) * HD);
#pragma unroll
      for (int d = 0; d < HD / 8; ++d) dst[4 * d + t] = mma::pack2<true>(o[d][2 * i] * inv, o[d][2 * i + 1] * inv);
    } else {
      const size_t pi = (row * p.num_q_heads + h) * a.num_splits + split;
      const float f = vscale / p_scale;
      float2* dst = reinterpret_cast<float2*>(a.part_o + pi * HD);
#pragma unroll
      for (int d = 0; d < HD / 8; ++d) dst[4 * d + t] = make_float2(o[d][2 * i] * f, o[d][2 * i + 1] * f);
      if (t == 0) {
        a.part_ml[2 * pi] = m_run[i];
        a.part_ml[2 * pi + 1] = L;
      }
    }
  }
}

// Opts a kernel in to its shared memory (> 48 KB) once per instantiation and device; returns
// its resident CTAs per SM from the occupancy API.
template <auto Kernel>
int occupancy(size_t smem, int threads) {
  static PerDevice<int> n;
  return n.get([&] {
    cuda_check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
               "paged_attention prefill shared memory");
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, Kernel, threads, smem) != cudaSuccess || blocks <= 0) {
      cudaGetLastError();
      blocks = 1;
    }
    return blocks;
  });
}

template <class F>
void dispatch_prefill_hd(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
  }
  throw Error("CUDA paged attention: the tiled prefill kernel takes head sizes 64, 128 and 256, not " +
              std::to_string(head_dim));
}

// One CTA per (sequence, row group) x KV head x split of the pass's keys.
inline dim3 prefill_grid(const RowsArgs& a) {
  return dim3(unsigned(a.p.num_seqs * a.row_groups), unsigned(a.p.num_kv_heads),
              unsigned(a.exact_part ? 1 : a.range_splits));
}

}  // namespace
}  // namespace kvlm::cuda

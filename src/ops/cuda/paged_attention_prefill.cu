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
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "ops/cuda/paged_attention_rows.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/per_device.cuh"
#include "ops/cuda/paged_attention_mma.cuh"
#include "ops/cuda/async_pipeline.cuh"
#include "ops/cuda/wgmma.cuh"

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
  static constexpr int ESZ = sizeof(typename Fmt::Code);
  static constexpr bool kPTH = Fmt::kScale == Scale::PerTokenHead;
  static constexpr int BM = PrefillTile<HD>::BM, BN = PrefillTile<HD>::BN;
  static constexpr size_t q = size_t(BM) * HD * 2;                 // f16/bf16 Q, swizzled
  static constexpr size_t kv = size_t(BN) * HD * ESZ;              // one K (or V) tile as stored
  static constexpr size_t scales = kPTH ? 2 * BN * sizeof(float) : 0;
  static constexpr size_t stage = 2 * kv + scales;                 // K, V, K scales, V scales
  static constexpr size_t conv = ESZ == 1 ? 2 * size_t(BN) * HD * 2 : 0;  // expanded K, V (f16)
  static constexpr size_t total = q + 2 * stage + conv;
};

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
    // Visible ranges grow with the position (causal, sliding) or are all [0, kv_len): the
    // union is [lo(first token), hi(last token)), split across blockIdx.z in 16-key multiples.
    int lo_first, hi_first, lo_last, hi_last;
    visible_range(p, pos0, kv_len, lo_first, hi_first);
    visible_range(p, pos0 + ntok - 1, kv_len, lo_last, hi_last);
    split_range<16>(lo_first, hi_last, a.num_splits, int(blockIdx.z), a.decreasing_splits, t0, t1);
    lo_inner = max(lo_last, t0);
    hi_inner = min(hi_first, t1);
    return true;
  }
  // Visible keys of M row m within [t0, t1). Rows past the CTA's tokens compute on zero
  // queries and are never stored: they get the whole range.
  __device__ void row_range(const PagedAttentionParams& p, int m, int G, int& lo, int& hi) const {
    lo = t0;
    hi = t1;
    if (m < mrows) {
      visible_range(p, pos0 + m / G, kv_len, lo, hi);
      lo = max(lo, t0);
      hi = min(hi, t1);
    }
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

// Expands a tile's 1-byte codes (K and V, as loaded by load_kv_tile) exactly to f16: raw chunk
// c of row r (16 codes) becomes the f16 chunks 2c and 2c + 1, stored at chunk index dst(r, .).
// Thread tid expands the pieces load_kv_tile<.., THREADS> gave it.
template <class Fmt, int BN, int HD, int THREADS, class Dst>
__device__ __forceinline__ void expand_tile(const char* k_raw, const char* v_raw, uint4* k_out, uint4* v_out, Dst dst,
                                            int tid) {
  constexpr int RB = HD;  // 1 byte per code
  constexpr int PIECES = BN * RB / 16;
#pragma unroll
  for (int it = 0; it < PIECES / THREADS; ++it) {
    const int i = tid + it * THREADS;
    const int r = i / (RB / 16), c = i % (RB / 16);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const uint4 raw = reinterpret_cast<const uint4*>(kv ? v_raw : k_raw)[i];
      uint32_t w[8];
      mma::to_pairs<Fmt, 16>(&raw, w);
      uint4* out = kv ? v_out : k_out;
      out[dst(r, 2 * c)] = make_uint4(w[0], w[1], w[2], w[3]);
      out[dst(r, 2 * c + 1)] = make_uint4(w[4], w[5], w[6], w[7]);
    }
  }
}

// Per-key factors of a tile, once per tile: kf = the score scale (times the key's K scale),
// vf = the P factor (the key's V scale times kPScale). Keys outside [t0, t1) get 0: their
// scale slots may be stale or NaN, and a 0 never carries a NaN into S or P. A full tile (every
// key visible to every row, softmax_rows) lies inside [t0, t1): no test then.
template <int NT, bool kPTH>
__device__ __forceinline__ void key_factors(float (&kf)[NT][2], float (&vf)[NT][2], float sscale, const float* ksc,
                                            const float* vsc, float p_scale, bool full, int kb, int t, int t0, int t1) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      kf[nt][e] = sscale;
      vf[nt][e] = 1.0f;
      if constexpr (kPTH) {
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
// scale (> 0) is applied after the max and folded into the exponent's FFMA.
template <int NT, int DT, bool kPTH>
__device__ __forceinline__ void softmax_rows(float (&s)[NT][4], float (&o)[DT][4], float (&m_run)[2], float (&l_run)[2],
                                             const float (&kf)[NT][2], const float (&vf)[NT][2], float sscale,
                                             bool full, int kb, int t, const int (&rlo)[2], const int (&rhi)[2]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kj = nt * 8 + 2 * t + e;
        float x = kPTH ? s[nt][2 * i + e] * kf[nt][e] : s[nt][2 * i + e];
        if (!full && (kb + kj < rlo[i] || kb + kj >= rhi[i])) x = -INFINITY;
        s[nt][2 * i + e] = x;
        mx = fmaxf(mx, x);
      }
    if (!kPTH && mx != -INFINITY) mx *= sscale;
    const float m_use = mma::online_max(mx, m_run[i], l_run[i], o, i);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = s[nt][2 * i + e];
        const float pe = exp2_approx(kPTH ? x - m_use : fmaf(x, sscale, -m_use));
        l_run[i] += pe;
        s[nt][2 * i + e] = kPTH ? pe * vf[nt][e] : pe;
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

template <class Fmt, int HD>
__global__ void __launch_bounds__(kPrefillWarps * 32, 2) attn_prefill_kernel(const RowsArgs a) {
  allow_dependents();
  using Tile = PrefillTile<HD>;
  using Sm = PrefillSmem<Fmt, HD>;
  constexpr int MT = Tile::MT, BM = Tile::BM, BN = Tile::BN;
  constexpr bool kBF = mma::MmaCodec<Fmt>::kBF16;
  constexpr int ESZ = Sm::ESZ;
  constexpr bool kPTH = Sm::kPTH;
  constexpr int RB = HD * ESZ;   // bytes of one stored K/V row
  constexpr int CPR = HD / 8;    // 16-byte chunks per 16-bit row
  constexpr int NT = BN / 8;     // n-tiles of S
  constexpr int DT = HD / 8;     // n-tiles of O
  constexpr int THREADS = kPrefillWarps * 32;
  // Per-token-head V scales ride on P times 2^8 (f16 range, as in the decode kernel).
  constexpr float kPScale = kPTH ? 256.0f : 1.0f;

  const PagedAttentionParams& p = a.p;
  const int G = a.group;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  CtaWork w;
  if (!w.init(a)) return;

  const int row_base = warp * 16 * MT;
  const bool warp_active = row_base < w.mrows;  // warp-uniform: no valid M row -> skip the math
  int rlo[MT][2], rhi[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) w.row_range(p, row_base + mt * 16 + g + 8 * i, G, rlo[mt][i], rhi[mt][i]);

  extern __shared__ uint4 smem_u4[];
  char* const smem = reinterpret_cast<char*>(smem_u4);
  uint4* const sQ = smem_u4;
  char* const stages = smem + Sm::q;
  uint4* const sConv = reinterpret_cast<uint4*>(stages + 2 * Sm::stage);  // 1-byte caches only

  const PageRows pr(p, w.seq, kvh);
  const int base0 = w.first_key();
  const int ntiles = w.num_tiles(BN);

  // Tile j: keys [base0 + j * BN, + BN) into stage j % 2; 16-bit codes land swizzled (the
  // ldmatrix layout), 1-byte codes raw (expanded per tile below).
  auto issue = [&](int j) {
    char* st = stages + (j & 1) * Sm::stage;
    load_kv_tile<BN, RB, THREADS, kPTH>(p, pr, w, base0 + j * BN, st, st + Sm::kv, reinterpret_cast<float*>(st + 2 * Sm::kv),
                                        [](int r, int c, int i) { return ESZ == 2 ? swz<HD>(r, c) * 16 : i * 16; }, tid);
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (ntiles > 0) issue(0);
  load_q<BM, HD, THREADS, kBF>(p, w, G, kvh, sQ, [](int m, int c) { return swz<HD>(m, c); }, tid, 0);

  // Score scale: softmax_scale * log2(e) * per-tensor K scale; V's per-tensor scale at the end.
  float sscale, vscale;
  score_scales<Fmt>(p, kvh, sscale, vscale);

  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.0f;

  // Per-thread ldmatrix row offsets (uint4 units) and swizzled low chunk bits. Q and V rows
  // take chunk 2i + lane / 16, K rows chunk 2i + (lane / 8) % 2 (fragment order of m16n8k16).
  const int q_row = (row_base + (lane & 15)) * CPR;
  const int k_row = ((lane & 7) + ((lane >> 4) << 3)) * CPR;
  const int v_row = ((lane & 7) + (((lane >> 3) & 1) << 3)) * CPR;
  int qx[4], kx[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    qx[i] = (2 * i + (lane >> 4)) ^ (lane & 7);
    kx[i] = (2 * i + ((lane >> 3) & 1)) ^ (lane & 7);
  }

  for (int j = 0; j < ntiles; ++j) {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // tile j landed for everyone; everyone is done with tile j - 1
    if (j + 1 < ntiles) issue(j + 1);
    const char* st = stages + (j & 1) * Sm::stage;
    const uint4* sK = reinterpret_cast<const uint4*>(st);
    const uint4* sV = reinterpret_cast<const uint4*>(st + Sm::kv);
    if constexpr (ESZ == 1) {
      uint4* cK = sConv;
      uint4* cV = sConv + BN * CPR;
      expand_tile<Fmt, BN, HD, THREADS>(reinterpret_cast<const char*>(sK), reinterpret_cast<const char*>(sV), cK, cV,
                                        [](int r, int c) { return swz<HD>(r, c); }, tid);
      __syncthreads();
      sK = cK;
      sV = cV;
    }
    if (!warp_active) continue;
    const int kb = base0 + j * BN;
    const float* ksc = reinterpret_cast<const float*>(st + 2 * Sm::kv);
    const float* vsc = ksc + BN;

    // S = Q K^T. Operand addresses: every ldmatrix row index r has r % 8 == lane % 8, so the
    // swizzled chunk of logical chunk c is (c & ~7) | ((c & 7) ^ (lane & 7)): a compile-time
    // part plus one of 4 per-thread values (qx / kx below), keeping address registers few.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < HD / 16; ++kc) {
      uint32_t qa[MT][4];
      const int qc = (2 * kc & ~7) + qx[kc % 4], kc_ = (2 * kc & ~7) + kx[kc % 4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], sQ + q_row + mt * 16 * CPR + qc);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kf[4];
        ldsm_x4(kf, sK + k_row + np * 16 * CPR + kc_);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::mma16816<kBF>(s[mt][2 * np], qa[mt], kf[0], kf[1]);
          mma::mma16816<kBF>(s[mt][2 * np + 1], qa[mt], kf[2], kf[3]);
        }
      }
    }

    // `full` as a literal in each branch: tiles no row masks compile without the mask.
    auto softmax = [&](bool full) {
      float kf[NT][2], vf[NT][2];
      key_factors<NT, kPTH>(kf, vf, sscale, ksc, vsc, kPScale, full, kb, t, w.t0, w.t1);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        softmax_rows<NT, DT, kPTH>(s[mt], o[mt], m_run[mt], l_run[mt], kf, vf, sscale, full, kb, t, rlo[mt], rhi[mt]);
    };
    if (kb >= w.lo_inner && kb + BN <= w.hi_inner)
      softmax(true);
    else
      softmax(false);

    // O += P V: the S accumulators of n-tiles 2kk and 2kk + 1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = mma::pack2<kBF>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = mma::pack2<kBF>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = mma::pack2<kBF>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = mma::pack2<kBF>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t vf[4];
        ldsm_x4_trans(vf, sV + v_row + kk * 16 * CPR + (2 * dp & ~7) + qx[dp % 4]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::mma16816<kBF>(o[mt][2 * dp], pa[mt], vf[0], vf[1]);
          mma::mma16816<kBF>(o[mt][2 * dp + 1], pa[mt], vf[2], vf[3]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  if (!warp_active) return;

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_rows<HD>(a, o[mt], m_run[mt], l_run[mt], row_base + mt * 16 + g, w.mrows, G, size_t(w.q_begin + w.r0), kvh,
                   split, t, vscale, kPScale);
}

// ---------------------------------------------------------------------------------------
// Hopper (sm_90a): the same algorithm with warpgroup MMAs, warp-specialised. Three
// warpgroups: warpgroup 0 produces, 1 and 2 consume, 64 M rows each (BM = 128 as above, so the
// plan's rows per CTA do not change). The producer streams 128-key tiles of K and V (WsSmem)
// into a ring of shared-memory stages — cp.async straight into the 128-byte-swizzled layout
// the descriptors describe (wgmma.cuh) for 16-bit caches; for 1-byte caches raw into a
// private ring, then expanded to f16 into the stage by the thread that loaded the piece — and
// publishes each stage on its "full" mbarrier; every consumer thread releases the stage on its
// "empty" mbarrier once its GEMMs have read it (async_pipeline.cuh). So the consumers never
// meet at a CTA-wide barrier: the two warpgroups drift apart and one's softmax overlaps the
// other's GEMMs, and the loads' address arithmetic is off their issue slots. setmaxnreg moves
// registers from the producer (addresses only) to the consumers (64 O + BN / 2 S accumulators
// and the P fragments at head 128). Per tile, each consumer warpgroup: S = Q K^T (HD / 16 wgmma
// m64n{BN}k16, Q and K read through shared-memory descriptors), mask and online softmax (the
// mma.sync kernel's), O += P V (BN / 16 wgmma m64n{HD}k16, P from registers: the m64
// accumulator layout is the A-fragment layout per warp; V read transposed). Overlapping the
// next tile's S GEMM with this tile's softmax inside a warpgroup (FlashAttention-3) was tried
// twice (docs/results/kernel-lab.md): ptxas serialises every wgmma when an S accumulator array
// lives across loop iterations (C7514 / C7515), and the version it does not serialise (S fresh
// per iteration, P V of tile j - 1 issued after S of tile j) was 4% slower at bf16 than this.
constexpr int kWsThreads = 384;

// Tile shape, shared-memory layout and register split of the warpgroup kernel per format.
// 128-key tiles, as many stages as fit in 227 KB: 16-bit caches 3 (224 KB at head 128);
// 1-byte caches 2 expanded stages and 2 raw tiles (224 KB), per-token-head ones 1 raw tile
// (their scales would not fit beside a second).
// setmaxnreg moves registers within the CTA's pool (384 x the count ptxas gave the kernel,
// 168 under __launch_bounds__(384, 1)): the producer warpgroup's 128 threads give theirs up to
// kProducerRegs, the consumers' 256 take kConsumerRegs. The split must fit the pool, or the
// consumers' setmaxnreg.inc waits forever (a hang, seen with 64 / 224): prefill_occupancy
// checks it on the host before the first launch. Expanding 128-key tiles takes the producer
// 64 registers.
template <class Fmt, int HD>
struct WsSmem {
  static constexpr int ESZ = sizeof(typename Fmt::Code);
  static constexpr bool kPTH = Fmt::kScale == Scale::PerTokenHead;
  static constexpr int BM = 128, BN = 128;
  static_assert(BM == PrefillTile<HD>::BM, "both kernels must take the plan's rows per CTA");
  static constexpr int kStages = ESZ == 2 ? 3 : 2;          // K/V tiles the consumers read
  static constexpr int kRaw = ESZ == 2 ? 0 : kPTH ? 1 : 2;  // 1-byte caches: the producer's raw tiles
  static constexpr int kProducerRegs = ESZ == 1 ? 64 : 56;
  static constexpr int kConsumerRegs = ESZ == 1 ? 216 : 224;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kWsThreads * (65536 / kWsThreads / 8 * 8),
                "the register split exceeds the largest pool __launch_bounds__(384, 1) allows");
  static constexpr size_t tile16 = size_t(BN) * HD * 2;
  static constexpr size_t raw = size_t(BN) * HD * ESZ;
  static constexpr size_t q = size_t(BM) * HD * 2;  // Q at offset 0
  static constexpr size_t stages = q;
  static constexpr size_t raws = stages + kStages * 2 * tile16;
  static constexpr size_t scales = raws + kRaw * 2 * raw;  // per stage: BN K then BN V scales
  static constexpr size_t raw_scales = scales + (kPTH ? kStages * 2 * BN * sizeof(float) : 0);
  static constexpr size_t bars = raw_scales + (kPTH ? kRaw * 2 * BN * sizeof(float) : 0);
  static constexpr size_t total = bars + 2 * kStages * sizeof(uint64_t) + 1024;  // + alignment
  static_assert(total <= 227 * 1024, "the warpgroup kernel's shared memory exceeds 227 KB");
};

// Chunk index (uint4 units) of row r, 8-value chunk c of a 16-bit tile of R rows in the
// 128-byte-swizzled layout: 64-value column blocks of R x 128 B, chunk (c % 8) ^ (r % 8).
template <int R>
__device__ __forceinline__ int sw128(int r, int c) {
  return (c >> 3) * (R * 8) + r * 8 + ((c & 7) ^ (r & 7));
}

template <class Fmt, int HD>
__global__ void __launch_bounds__(kWsThreads, 1) attn_prefill_wgmma_kernel(const RowsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  allow_dependents();
  using Sm = WsSmem<Fmt, HD>;
  constexpr int BM = Sm::BM, BN = Sm::BN, kStages = Sm::kStages;
  constexpr bool kBF = mma::MmaCodec<Fmt>::kBF16;
  constexpr int ESZ = Sm::ESZ;
  constexpr bool kPTH = Sm::kPTH;
  constexpr int RB = HD * ESZ;
  constexpr int CPR = HD / 8;
  constexpr int NT = BN / 8;
  constexpr int DT = HD / 8;
  constexpr int WG = 128;  // threads per warpgroup
  constexpr float kPScale = kPTH ? 256.0f : 1.0f;

  const PagedAttentionParams& p = a.p;
  const int G = a.group;
  const int kvh = blockIdx.y, split = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wtid = tid & (WG - 1);
  CtaWork w;
  if (!w.init(a)) return;
  const int ntiles = w.num_tiles(BN);
  const int consumers = w.mrows > 64 ? 2 : 1;  // consumer warpgroups holding a valid M row

  extern __shared__ uint4 smem_u4[];
  // The swizzle pattern repeats every 1024 B and the descriptors assume aligned tiles.
  const uint32_t sbase = pipe::smem_addr(smem_u4);
  char* const smem = reinterpret_cast<char*>(smem_u4) + ((1024 - (sbase & 1023)) & 1023);
  float* const sScales = reinterpret_cast<float*>(smem + Sm::scales);
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + Sm::bars);
  uint64_t* const empty = full + kStages;
  auto stage_k = [&](int s) { return smem + Sm::stages + s * 2 * Sm::tile16; };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      pipe::mbar_init(full + s, WG);                // every producer thread
      pipe::mbar_init(empty + s, WG * consumers);   // every thread of an active consumer warpgroup
    }
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: tile j into stage j % kStages once the consumers released its previous use.
    pipe::regs_dec<Sm::kProducerRegs>();
    const PageRows pr(p, w.seq, kvh);
    const int base0 = w.first_key();
    if constexpr (ESZ == 2) {
      for (int j = 0; j < ntiles; ++j) {
        const int s = j % kStages;
        if (j >= kStages) pipe::mbar_wait(empty + s, ((j / kStages) - 1) & 1);
        load_kv_tile<BN, RB, WG, false>(p, pr, w, base0 + j * BN, stage_k(s), stage_k(s) + Sm::tile16, nullptr,
                                        [](int r, int c, int) { return sw128<BN>(r, c) * 16; }, wtid);
        pipe::mbar_arrive_cp_async(full + s);
      }
    } else {
      constexpr int kRaw = Sm::kRaw;
      float* const raw_sc = reinterpret_cast<float*>(smem + Sm::raw_scales);
      // Always commits a group (empty past the last tile): "wait_group kRaw - 1" then always
      // means "tile j landed". A raw slot is refilled as soon as this thread has expanded its
      // pieces of it (no other thread reads them), so kRaw tiles are always in flight.
      auto issue_raw = [&](int j) {
        if (j < ntiles) {
          char* rs = smem + Sm::raws + (j % kRaw) * 2 * Sm::raw;
          load_kv_tile<BN, RB, WG, kPTH>(p, pr, w, base0 + j * BN, rs, rs + Sm::raw, raw_sc + (j % kRaw) * 2 * BN,
                                         [](int, int, int i) { return i * 16; }, wtid);
        }
        asm volatile("cp.async.commit_group;\n" ::);
      };
#pragma unroll
      for (int j = 0; j < kRaw; ++j) issue_raw(j);
      for (int j = 0; j < ntiles; ++j) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kRaw - 1));
        const int s = j % kStages;
        if (j >= kStages) pipe::mbar_wait(empty + s, ((j / kStages) - 1) & 1);
        const char* rs = smem + Sm::raws + (j % kRaw) * 2 * Sm::raw;
        uint4* const st = reinterpret_cast<uint4*>(stage_k(s));
        // This thread expands (and copies the scales of) exactly the pieces it loaded.
        expand_tile<Fmt, BN, HD, WG>(rs, rs + Sm::raw, st, st + BN * CPR, [](int r, int c) { return sw128<BN>(r, c); },
                                     wtid);
        if constexpr (kPTH) {
          if (wtid < BN / 2) {
            const int o = scale_piece<BN>(wtid);
            *reinterpret_cast<float4*>(sScales + s * 2 * BN + o) =
                *reinterpret_cast<const float4*>(raw_sc + (j % kRaw) * 2 * BN + o);
          }
        }
        wgmma::fence_proxy_async();  // st.shared -> the consumers' wgmma reads
        pipe::mbar_arrive(full + s);
        issue_raw(j + kRaw);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::);
    return;
  }

  // Consumers: warpgroup cw = wg - 1 owns M rows 64 cw .. 64 cw + 63, this warp 16 of them.
  pipe::regs_inc<Sm::kConsumerRegs>();
  const int cw = wg - 1;
  if (cw >= consumers) return;  // warpgroup-uniform: wgmma needs all 4 warps
  const int g = lane >> 2, t = lane & 3;
  const int row_base = (warp - 4) * 16;
  int rlo[2], rhi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) w.row_range(p, row_base + g + 8 * i, G, rlo[i], rhi[i]);

  load_q<64, HD, WG, kBF>(p, w, G, kvh, reinterpret_cast<uint4*>(smem), [](int m, int c) { return sw128<BM>(m, c); }, wtid,
                          64 * cw);
  wgmma::fence_proxy_async();
  pipe::named_sync(1 + cw, WG);  // this warpgroup's Q rows stored

  float sscale, vscale;
  score_scales<Fmt>(p, kvh, sscale, vscale);
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const uint64_t dq0 = wgmma::desc_sw128(smem + cw * 64 * 128, 16, 1024);

  for (int j = 0; j < ntiles; ++j) {
    const int s = j % kStages;
    pipe::mbar_wait(full + s, (j / kStages) & 1);
    if constexpr (ESZ == 2) wgmma::fence_proxy_async();  // the producer's cp.async -> wgmma
    const char* const tk = stage_k(s);

    // S = Q K_j^T over HD / 16 k-steps: 32 B further into the 128-B rows per step, the next
    // 64-column block every 4 steps. Descriptor start addresses are in 16-byte units in the
    // low field, so a byte offset inside shared memory is added as offset / 16.
    float sc[NT][4];
    {
      const uint64_t dk0 = wgmma::desc_sw128(tk, 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kc = 0; kc < HD / 16; ++kc) {
        const uint64_t dq = dq0 + uint64_t(((kc >> 2) * (BM * 128) + (kc & 3) * 32) >> 4);
        const uint64_t dk = dk0 + uint64_t(((kc >> 2) * (BN * 128) + (kc & 3) * 32) >> 4);
        wgmma::wgmma_ss<BN, kBF>(&sc[0][0], dq, dk, kc > 0);
      }
      wgmma::commit();
      wgmma::wait<0>();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) wgmma::fence_operand(sc[nt][e]);
    }

    const int kb = w.first_key() + j * BN;
    const float* const ksc = sScales + s * 2 * BN;
    auto softmax = [&](bool full) {  // a literal in each branch, as in the mma.sync kernel
      float kf[NT][2], vf[NT][2];
      key_factors<NT, kPTH>(kf, vf, sscale, ksc, ksc + BN, kPScale, full, kb, t, w.t0, w.t1);
      softmax_rows<NT, DT, kPTH>(sc, o, m_run, l_run, kf, vf, sscale, full, kb, t, rlo, rhi);
    };
    if (kb >= w.lo_inner && kb + BN <= w.hi_inner)
      softmax(true);
    else
      softmax(false);

    // O += P V_j: k-step kk covers keys 16 kk .. 16 kk + 15 (two 1024-B row groups); the
    // 64-dim column blocks of V are BN * 128 B apart (LBO).
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = mma::pack2<kBF>(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = mma::pack2<kBF>(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = mma::pack2<kBF>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = mma::pack2<kBF>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    const uint64_t dv0 = wgmma::desc_sw128(tk + Sm::tile16, BN * 128, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma::wgmma_rs<HD, kBF>(&o[0][0], pa[kk], dv0 + uint64_t((kk * 16 * 128) >> 4), 1);
    wgmma::commit();
    wgmma::wait<0>();
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) wgmma::fence_operand(o[d][e]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) wgmma::fence_operand(pa[kk][e]);
    pipe::mbar_arrive(empty + s);  // this thread is done reading stage s (its scales, its wgmma operands)
  }
  store_rows<HD>(a, o, m_run, l_run, row_base + g, w.mrows, G, size_t(w.q_begin + w.r0), kvh, split, t, vscale, kPScale);
#else
  __trap();  // launched only where sm_90a code is loaded (wgmma_available)
#endif
}

// Whether the warpgroup kernel can run: this build compiled sm_90a code (KVLM_CUDA_SM90A,
// set by CMake when CMAKE_CUDA_ARCHITECTURES lists 90a) and the current GPU is compute
// capability 9.0, the only one that loads it. kernel_switches().wgmma = false turns it off
// (the mma.sync kernel runs instead; for comparisons and as an escape hatch).
bool wgmma_available() {
  if (!kernel_switches().wgmma) return false;
  static PerDevice<bool> on;
  return on.get([] {
#if defined(KVLM_CUDA_SM90A)
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return major == 9 && minor == 0;
#else
    return false;
#endif
  });
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


// Resident CTAs per SM of the kernel that runs (Fmt, HD).
template <class Fmt, int HD>
int prefill_occupancy() {
  if constexpr (HD <= 128) {
    if (wgmma_available()) {
      static PerDevice<bool> fits;  // once per instantiation and device: a misfit would hang the GPU
      fits.get([] {
        cudaFuncAttributes fa{};
        cuda_check(cudaFuncGetAttributes(&fa, attn_prefill_wgmma_kernel<Fmt, HD>), "paged_attention prefill attributes");
        using Sm = WsSmem<Fmt, HD>;
        if (fa.numRegs * kWsThreads < 128 * Sm::kProducerRegs + 256 * Sm::kConsumerRegs)
          throw Error("CUDA paged attention: the warp-specialised prefill kernel was compiled with " +
                      std::to_string(fa.numRegs) + " registers per thread, too few for its register split (" +
                      std::to_string(Sm::kProducerRegs) + " / " + std::to_string(Sm::kConsumerRegs) +
                      "); report this build (the lab's --no-wgmma runs the mma.sync kernel)");
        return true;
      });
      return occupancy<attn_prefill_wgmma_kernel<Fmt, HD>>(WsSmem<Fmt, HD>::total, kWsThreads);
    }
  }
  return occupancy<attn_prefill_kernel<Fmt, HD>>(PrefillSmem<Fmt, HD>::total, kPrefillWarps * 32);
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

}  // namespace

int prefill_rows_per_cta(int head_dim) {
  int bm = 0;
  dispatch_prefill_hd(head_dim, [&](auto hd) { bm = PrefillTile<decltype(hd)::value>::BM; });
  return bm;
}

int prefill_ctas_per_sm(const PagedAttentionParams& p) {
  int n = 1;
  dispatch_cuda_kv(p.storage, p.quant, [&](auto fmt) {
    dispatch_prefill_hd(p.head_dim, [&](auto hd) { n = prefill_occupancy<decltype(fmt), decltype(hd)::value>(); });
  });
  return n;
}

void launch_prefill(const RowsArgs& a, cudaStream_t st) {
  dispatch_cuda_kv(a.p.storage, a.p.quant, [&](auto fmt) {
    using Fmt = decltype(fmt);
    dispatch_prefill_hd(a.p.head_dim, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      prefill_occupancy<Fmt, HD>();  // sets the shared-memory attribute (once)
      const dim3 grid(unsigned(a.p.num_seqs * a.row_groups), unsigned(a.p.num_kv_heads), unsigned(a.num_splits));
      bool launched = false;
      if constexpr (HD <= 128) {
        if (wgmma_available()) {
          attn_prefill_wgmma_kernel<Fmt, HD><<<grid, kWsThreads, WsSmem<Fmt, HD>::total, st>>>(a);
          launched = true;
        }
      }
      if (!launched) attn_prefill_kernel<Fmt, HD><<<grid, kPrefillWarps * 32, PrefillSmem<Fmt, HD>::total, st>>>(a);
      cuda_check(cudaGetLastError(), "paged_attention prefill launch");
      if (a.num_splits > 1) launch_reduce(a, st);
    });
  });
}

}  // namespace kvlm::cuda

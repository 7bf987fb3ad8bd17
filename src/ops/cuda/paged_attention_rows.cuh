// The CUDA-core paged attention kernel (attn_rows_kernel) and the split-KV reduction,
// shared by paged_attention.cu (head sizes 64/128/256, next to the tensor-core kernel) and
// paged_attention_small.cu (head sizes 8/16/32: the CUDA-core kernel only). Two translation
// units so the two sets of instantiations compile in parallel. See paged_attention.cu for
// the design; the kernels are internal to each translation unit (anonymous namespace),
// RowsArgs is the one type both share.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>

#include "kv/attention_mask.h"
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/kv_codec.cuh"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

constexpr int kWarps = 4;  // 128 threads: 4 CTAs/SM fit at ~128 registers, enough loads in flight
constexpr int kVec = 8;    // elements per lane per row: 16 B (bf16/fp16) or 8 B (fp8/int8) loads
constexpr float kLog2e = 1.4426950408889634f;

// What a learned sink adds to the softmax denominator of query head h whose scores' running
// max is m (log2 domain, as every kernel's softmax): 2^(sink log2(e) - m); 0 without sinks.
// m = -inf (no visible key) gives +inf, and the output o / inf = 0, as without the sink.
__device__ __forceinline__ float sink_term(const PagedAttentionParams& p, int h, float m) {
  return p.sinks ? exp2f(fmaf(p.sinks[h], kLog2e, -m)) : 0.0f;
}

// 2^x in one MUFU.EX2 (flushing results below 2^-126 to 0, which a softmax weight can lose):
// exp2f without fast math adds a range test and two multiplies around it.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

struct RowsArgs {
  PagedAttentionParams p;
  int group;         // query heads per kv head
  int head_chunks;   // ceil(group / GMAX) (CUDA-core kernel)
  int rows_per_cta;  // query rows of one sequence per CTA (tensor-core kernel)
  int row_groups;    // ceil(max_q_len / rows_per_cta) (tensor-core kernel)
  int num_splits;
  float* part_o;    // [num_tokens][num_q_heads][num_splits][head_dim]
  float* part_ml;   // [num_tokens][num_q_heads][num_splits][2]: running max (log2 domain), sum
  bool decreasing_splits = false;  // tensor-core decode kernel: splits shorten with their index
  // Exact sink / recent tokens on a tensor-core kernel: it splits the quantized keys into
  // range_splits splits (partials 0 .. range_splits - 1) and the exact keys take the partials
  // after them — after the decode kernel one, the CUDA-core kernel in exact_pass mode; after
  // the tiled prefill kernel one per exact pass it runs (exact_part below). The reduction
  // merges all num_splits. Otherwise range_splits = num_splits.
  int range_splits = 1;
  bool exact_pass = false;
  // The tiled prefill kernel's passes: 0 the quantized keys (range_splits splits), 1 the exact
  // sinks and 2 the exact recent window (one split each, the partials after range_splits; a
  // pass whose count is 0 is not run), on a view of the exact pages as a 16-bit cache
  // (paged_attention.cu's exact_view).
  int exact_part = 0;
  // Tensor-core decode kernel: keys in the mma's M dimension and the CTA's (query row, head)
  // pairs in N (rows_per_cta = 8 / group; paged_attention_mma.cuh, kT).
  bool keys_in_m = false;
};

namespace {

// Where a key's row lives: (page of the key, slot in the page) through the block table, as
// a row index into the layer's pages for one kv head: page * (num_kv_heads * bs) + kvh * bs
// + slot. Block sizes are powers of two in practice (16 by default): a shift and a mask then,
// a division otherwise (an integer division is ~20 instructions, and the tensor-core kernels
// look up a page per 16-key tile or per 16-byte piece).
struct PageRows {
  static __device__ int log2_if_pow2(int n) {
    if (n <= 0 || (n & (n - 1)) != 0) return -1;
    int s = 0;
    while ((1 << s) < n) ++s;
    return s;
  }
  const BlockId* table;
  int bs, shift;      // shift = log2(bs), or -1
  int64_t page_rows;  // num_kv_heads * bs
  int head_row;       // kvh * bs
  __device__ PageRows(const PagedAttentionParams& p, int seq, int kvh)
      : table(p.block_tables + size_t(seq) * p.max_blocks_per_seq),
        bs(p.block_size),
        shift(log2_if_pow2(p.block_size)),
        page_rows(int64_t(p.num_kv_heads) * p.block_size),
        head_row(kvh * p.block_size) {}
  __device__ __forceinline__ int64_t row(int key) const {
    int blk, slot;
    if (shift >= 0) {
      blk = key >> shift;
      slot = key & (bs - 1);
    } else {
      blk = key / bs;
      slot = key - blk * bs;
    }
    return int64_t(__ldg(table + blk)) * page_rows + head_row + slot;
  }
};

// The score scale (softmax_scale * log2(e): every kernel's softmax is in exp2) and the
// output's V scale: per-tensor K and V scales fold in here, so dequantizing costs nothing
// (q.(c*s) = (q*s).c; one scale, or one per kv head); other formats leave the V scale at 1.
template <class Fmt>
__device__ __forceinline__ void score_scales(const PagedAttentionParams& p, int kvh, float& sscale, float& vscale) {
  sscale = p.softmax_scale * kLog2e;
  vscale = 1.0f;
  const int si = p.num_tensor_scales == 1 ? 0 : kvh;
  if constexpr (KOf<Fmt>::kScale == Scale::PerTensor) sscale *= p.k_tensor_scale[si];
  if constexpr (VOf<Fmt>::kScale == Scale::PerTensor) vscale = p.v_tensor_scale[si];
}

// Loads that bypass L1 allocation hints are not used: the non-coherent read-only path
// (ld.global.nc) is enough, pages are read exactly once per decode step.
template <class V>
__device__ __forceinline__ V ldg_vec(const void* p) {
  return __ldg(static_cast<const V*>(p));
}

// The keys the query at `pos` sees (kv/attention_mask.h's visible_keys).
__device__ __forceinline__ void visible_range(const PagedAttentionParams& p, int pos, int kv_len, int& lo, int& hi) {
  const KeyRange r = visible_keys(p.mask, p.window, pos, kv_len);
  lo = r.lo;
  hi = r.hi;
}

// The keys the query at `pos` reads from the quantized pages when exact sink / recent tokens
// are kept (kv/attention_mask.h's quantized_keys; empty: lo >= hi).
__device__ __forceinline__ void quantized_range(const PagedAttentionParams& p, int pos, int kv_len, int& lo, int& hi) {
  visible_range(p, pos, kv_len, lo, hi);
  if (!p.exact_k) return;
  const KeyRange r = quantized_keys({lo, hi}, exact_anchor(p.mask, pos, kv_len), p.keep_sink, p.keep_recent);
  lo = r.lo;
  hi = r.hi;
}

// The keys the query at `pos` reads in pass `part` of the tiled prefill kernel (RowsArgs::
// exact_part): 0 its quantized keys, 1 its exact sinks, 2 its exact recent window (empty: lo >= hi).
__device__ __forceinline__ void pass_range(const PagedAttentionParams& p, int part, int pos, int kv_len, int& lo,
                                           int& hi) {
  if (part == 0) return quantized_range(p, pos, kv_len, lo, hi);
  visible_range(p, pos, kv_len, lo, hi);
  const ExactKeys e = exact_keys({lo, hi}, exact_anchor(p.mask, pos, kv_len), p.keep_sink, p.keep_recent);
  const KeyRange r = part == 1 ? e.sinks : e.recent;
  lo = r.lo;
  hi = r.hi;
}

// The keys [t0, t1) of split `split` of S over a CTA's range [lo, hi), cut at multiples of A
// keys from lo (A = 16 for the tensor-core kernels: a 16-key tile then never straddles two
// splits): equal shares (the last shorter or empty), or, with `decreasing`, shares of the
// A-key units proportional to S - split (the decode kernel in multi-wave grids, make_plan:
// the grid is dispatched split-major, so the last, partial wave gets the short CTAs).
template <int A>
__device__ __forceinline__ void split_range(int lo, int hi, int S, int split, bool decreasing, int& t0, int& t1) {
  const int n = max(0, hi - lo);
  if (decreasing) {
    const int64_t units = (n + A - 1) / A, tri = int64_t(S) * (S + 1) / 2;
    const auto cut = [&](int64_t s) { return int(units * (s * (2 * S - s + 1) / 2) / tri) * A; };
    t0 = lo + cut(split);
    t1 = min(hi, lo + cut(split + 1));
  } else {
    const int per_split = ((n + S - 1) / S + A - 1) / A * A;
    t0 = lo + split * per_split;
    t1 = min(hi, t0 + per_split);
  }
}

// TPR lanes hold one row (head_dim = TPR * 8); a warp covers RPW rows per step; each lane
// group keeps U rows in flight (loads issued before any math) so that every SM has
// >= 20 KB of loads outstanding — what HBM3e needs to reach its bandwidth.
// Fmt: one codec (K and V alike) or a KVPair; K is read through KF, V through VF.
template <class Fmt, int HD, int GMAX>
__global__ void __launch_bounds__(kWarps * 32) attn_rows_kernel(const RowsArgs a) {
  allow_dependents();
  pdl_wait();  // launched with PDL (launch_rows): Q and this step's K/V come from the kernel before
  using KF = KOf<Fmt>;
  using VF = VOf<Fmt>;
  using KVec = typename KF::Vec;
  using VVec = typename VF::Vec;
  constexpr int TPR = HD / kVec;
  constexpr int RPW = 32 / TPR;
  // Same bytes in flight for 1- and 2-byte codes.
  constexpr int U = sizeof(KVec) == 16 || sizeof(VVec) == 16 ? 4 : 8;
  constexpr int STEP = kWarps * RPW;            // rows per CTA per unrolled sub-step
  static_assert(TPR >= 1 && TPR <= 32 && 32 % TPR == 0, "head size must be 8..256, power of two");

  const PagedAttentionParams& p = a.p;
  const int row = blockIdx.x;
  const int kvh = int(blockIdx.y) / a.head_chunks;
  const int chunk = int(blockIdx.y) % a.head_chunks;
  const int split = a.exact_pass ? a.range_splits : int(blockIdx.z);
  const int h0 = kvh * a.group + chunk * GMAX;
  const int nheads = min(GMAX, a.group - chunk * GMAX);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int sub = lane % TPR, rg = lane / TPR;

  // The row's sequence: binary search of cu_q_lens (num_seqs is small, cached in L1).
  int s_lo = 0, s_hi = p.num_seqs - 1;
  while (s_lo < s_hi) {
    const int mid = (s_lo + s_hi + 1) / 2;
    if (p.cu_q_lens[mid] <= row) s_lo = mid;
    else s_hi = mid - 1;
  }
  const int seq = s_lo;
  const int q_begin = p.cu_q_lens[seq], q_len = p.cu_q_lens[seq + 1] - q_begin;
  const int kv_len = p.kv_lens[seq];
  const int pos = kv_len - q_len + (row - q_begin);
  int lo, hi;
  visible_range(p, pos, kv_len, lo, hi);
  int t0, t1;
  // exact_pass: the exact keys alone, as two intervals walked as one: [lo, sink_end), then
  // [win_lo, hi) — t in [0, n_sink + n_win) is key t + lo, then t - n_sink + win_lo.
  const ExactKeys ex = exact_keys({lo, hi}, exact_anchor(p.mask, pos, kv_len), p.keep_sink, p.keep_recent);
  const int sink_end = a.exact_pass ? ex.sinks.hi : 0;
  const int win_lo = a.exact_pass ? ex.recent.lo : 0;
  const int n_sink = sink_end - lo;
  if (a.exact_pass) {
    t0 = 0;
    t1 = n_sink + max(0, hi - win_lo);
  } else {
    split_range<1>(lo, hi, a.range_splits, split, false, t0, t1);
  }
  auto key_of = [&](int t) { return !a.exact_pass ? t : t < n_sink ? lo + t : win_lo + (t - n_sink); };

  // Query slice in registers, pre-multiplied by the score scale (one FFMA less per score).
  float qscale, vscale;
  score_scales<Fmt>(p, kvh, qscale, vscale);
  float q[GMAX][kVec];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    if (g < nheads) {
      const uint4 raw = ldg_vec<uint4>(p.q + (size_t(row) * p.num_q_heads + h0 + g) * HD + sub * kVec);
      FmtBF16::decode8(raw, q[g]);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][e] *= qscale;
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][e] = 0.0f;
    }
  }
  // int4 keys are code * step + zero: score = step * (q . codes) + zero * sum(q); int4 values
  // add weight * zero to every output dimension.
  constexpr bool kZero = kIsInt4<KF>, kZeroV = kIsInt4<VF>;
  float qsum[GMAX], zacc[GMAX];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    qsum[g] = zacc[g] = 0.0f;
    if constexpr (kZero) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) qsum[g] += q[g][e];
#pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) qsum[g] += __shfl_xor_sync(0xffffffffu, qsum[g], o);
    }
  }

  float m[GMAX], l[GMAX], acc[GMAX][kVec];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.0f;
  }

  const char* kbase = static_cast<const char*>(p.k_cache);
  const char* vbase = static_cast<const char*>(p.v_cache);
  const BlockId* table = p.block_tables + size_t(seq) * p.max_blocks_per_seq;
  // Exact sink / recent tokens (kv/attention_mask.h's kv_key_exact): such a key's row comes from the
  // exact pages in bf16 / f16, loaded when it is decoded (few rows: latency, not bandwidth).
  // Its scales undo what the quantized rows fold in: 1 / the per-tensor K scale on the score,
  // 1 / the V scale on the weight (vscale multiplies the whole output at the end).
  const bool keeps = p.exact_k != nullptr;
  const int qpos = exact_anchor(p.mask, pos, kv_len);
  const BlockId* etable = keeps ? p.exact_tables + size_t(seq) * p.max_blocks_per_seq : nullptr;
  const float inv_ks = keeps ? p.softmax_scale * kLog2e / qscale : 1.0f, inv_vs = 1.0f / vscale;
  auto exact_row = [&](const uint16_t* pool, int t, float* f) {
    const BlockId page = etable[t / p.block_size];
    if (page < 0) {  // never, when the engine keeps its books (then read as zeros, not out of bounds)
#pragma unroll
      for (int e = 0; e < kVec; ++e) f[e] = 0.0f;
      return;
    }
    const size_t at = ((size_t(page) * p.num_kv_heads + kvh) * p.block_size + t % p.block_size) * HD + sub * kVec;
    const uint4 raw = ldg_vec<uint4>(pool + at);
    if (p.exact_f16) FmtF16::decode8(raw, f);
    else FmtBF16::decode8(raw, f);
  };
  for (int base = t0; base < t1; base += STEP * U) {
    KVec kv[U];
    VVec vv[U];
    float ksc[U], vsc[U], kz[U], vz[U];
    bool valid[U], exact[U];
    // Issue all U row loads before any math: memory-level parallelism is the whole game.
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int t = key_of(base + u * STEP + warp * RPW + rg);
      valid[u] = base + u * STEP + warp * RPW + rg < t1;
      exact[u] = keeps && valid[u] && (a.exact_pass || kv_key_exact(t, qpos, p.keep_sink, p.keep_recent));
      ksc[u] = vsc[u] = 1.0f;
      kz[u] = vz[u] = 0.0f;
      if (exact[u]) {
        ksc[u] = inv_ks;
        vsc[u] = inv_vs;
        kv[u] = KVec{};
        vv[u] = VVec{};
      } else if (valid[u]) {
        const BlockId page = table[t / p.block_size];
        const int off = t % p.block_size;
        const size_t sidx = (size_t(page) * p.num_kv_heads + kvh) * p.block_size + off;
        const size_t at = sidx * HD + sub * kVec;
        kv[u] = ldg_vec<KVec>(kbase + at * KF::kBits / 8);
        vv[u] = ldg_vec<VVec>(vbase + at * VF::kBits / 8);
        if constexpr (kZero) FmtI4::unpack(__ldg(reinterpret_cast<const uint32_t*>(p.k_token_scale) + sidx), ksc[u], kz[u]);
        else if constexpr (KF::kScale == Scale::PerTokenHead) ksc[u] = __ldg(p.k_token_scale + sidx);
        if constexpr (kZeroV) FmtI4::unpack(__ldg(reinterpret_cast<const uint32_t*>(p.v_token_scale) + sidx), vsc[u], vz[u]);
        else if constexpr (VF::kScale == Scale::PerTokenHead) vsc[u] = __ldg(p.v_token_scale + sidx);
      } else {
        kv[u] = KVec{};
        vv[u] = VVec{};
      }
    }
    float s[U][GMAX];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[kVec];
      if (exact[u]) exact_row(p.exact_k, key_of(base + u * STEP + warp * RPW + rg), kf);
      else KF::decode8(kv[u], kf);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) d = fmaf(q[g][e], kf[e], d);
        s[u][g] = d;
      }
    }
    // Dot products: butterfly over the TPR lanes of a row (all of them end with the sum).
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1)
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int g = 0; g < GMAX; ++g) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
    // Online softmax, one rescale per U rows (not per row). Per-token-head K scales scale
    // the score, V scales the weight: dequantization is one multiply per row, not per element.
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s[u][g] = valid[u] ? (kZero ? fmaf(s[u][g], ksc[u], kz[u] * qsum[g]) : s[u][g] * ksc[u]) : -INFINITY;
        mx = fmaxf(mx, s[u][g]);
      }
      const float m_new = fmaxf(m[g], mx);
      if (m_new == -INFINITY) continue;  // no visible row yet for this lane group
      const float corr = exp2f(m[g] - m_new);
      m[g] = m_new;
      l[g] *= corr;
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] *= corr;
      zacc[g] *= corr;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pr = exp2f(s[u][g] - m_new);
        l[g] += pr;
        s[u][g] = pr * vsc[u];
        if constexpr (kZeroV) zacc[g] = fmaf(pr, vz[u], zacc[g]);  // V's zero point, on every dimension
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float vf[kVec];
      if (exact[u]) exact_row(p.exact_v, key_of(base + u * STEP + warp * RPW + rg), vf);
      else VF::decode8(vv[u], vf);
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
        if (m[g] == -INFINITY) continue;
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] = fmaf(s[u][g], vf[e], acc[g][e]);
      }
    }
  }

  if constexpr (kZeroV) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][e] += zacc[g];
  }

  // Merge the RPW lane groups of the warp (butterfly across groups), then the warps.
  auto merge = [](float& m1, float& l1, float* o1, float m2, float l2, const float* o2) {
    const float mm = fmaxf(m1, m2);
    if (mm == -INFINITY) return;
    const float c1 = exp2f(m1 - mm), c2 = exp2f(m2 - mm);
    l1 = l1 * c1 + l2 * c2;
#pragma unroll
    for (int e = 0; e < kVec; ++e) o1[e] = o1[e] * c1 + o2[e] * c2;
    m1 = mm;
  };
#pragma unroll
  for (int o = TPR; o < 32; o <<= 1) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
      float o2[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
      merge(m[g], l[g], acc[g], m2, l2, o2);
    }
  }

  __shared__ float sm_o[kWarps][GMAX][HD];
  __shared__ float sm_ml[kWarps][GMAX][2];
  if (rg == 0) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) sm_o[warp][g][sub * kVec + e] = acc[g][e];
      if (sub == 0) {
        sm_ml[warp][g][0] = m[g];
        sm_ml[warp][g][1] = l[g];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nheads * HD; i += kWarps * 32) {
    const int g = i / HD, d = i % HD;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, sm_ml[w][g][0]);
    float L = 0.0f, O = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float c = exp2f(sm_ml[w][g][0] - mm);
        L += sm_ml[w][g][1] * c;
        O += sm_o[w][g][d] * c;
      }
    }
    const int h = h0 + g;
    if (a.num_splits == 1) {
      L += sink_term(p, h, mm);
      const float r = L > 0.0f ? O * vscale / L : 0.0f;  // no visible key: 0, as the CPU backend
      p.out[(size_t(row) * p.num_q_heads + h) * HD + d] = __bfloat16_as_ushort(__float2bfloat16_rn(r));
    } else {
      const size_t pi = (size_t(row) * p.num_q_heads + h) * a.num_splits + split;
      a.part_o[pi * HD + d] = O * vscale;
      if (d == 0) {
        a.part_ml[2 * pi] = mm;
        a.part_ml[2 * pi + 1] = L;
      }
    }
  }
}

// Merges the splits of one (row, head). Threads are (output dim, split lane): lane r takes
// splits r, r + R, ..., so loads of different splits are in flight together rather than one
// L2 latency after another (a plain loop over 33 splits took ~10 µs at batch 1 x 32k, a
// fifth of the call); the lanes then meet in shared memory.
constexpr int kReduceMaxLanes = 8;
__global__ void attn_reduce_kernel(const RowsArgs a) {
  allow_dependents();
  pdl_wait();  // launched with PDL (launch_reduce): the partials may not be written yet
  __shared__ float s_m[kReduceMaxLanes], s_l[kReduceMaxLanes], s_o[kReduceMaxLanes][256];
  const int row = blockIdx.x, h = blockIdx.y, r = threadIdx.y, R = blockDim.y;
  const int HD = a.p.head_dim, S = a.num_splits;
  const size_t base = (size_t(row) * a.p.num_q_heads + h) * S;
  const float* ml = a.part_ml + 2 * base;
  uint16_t* out = a.p.out + (size_t(row) * a.p.num_q_heads + h) * HD;
  float mm = -INFINITY;
#pragma unroll 4
  for (int s = r; s < S; s += R) mm = fmaxf(mm, ml[2 * s]);
  float L = 0.0f;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float Ld = 0.0f, O = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll 4
      for (int s = r; s < S; s += R) {
        const float c = exp2f(ml[2 * s] - mm);
        Ld += ml[2 * s + 1] * c;
        O += a.part_o[(base + s) * HD + d] * c;
      }
    }
    L = Ld;  // the same for every d
    if (R == 1) {
      const float Ls = L + sink_term(a.p, h, mm);
      out[d] = __bfloat16_as_ushort(__float2bfloat16_rn(Ls > 0.0f ? O / Ls : 0.0f));
    }
    else s_o[r][d] = O;
  }
  if (R == 1) return;
  if (threadIdx.x == 0) {
    s_m[r] = mm;
    s_l[r] = L;
  }
  __syncthreads();
  if (r != 0) return;
  float M = -INFINITY;
  for (int k = 0; k < R; ++k) M = fmaxf(M, s_m[k]);
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    float Lt = 0.0f, O = 0.0f;
    if (M != -INFINITY) {
      for (int k = 0; k < R; ++k) {
        const float c = s_m[k] == -INFINITY ? 0.0f : exp2f(s_m[k] - M);
        Lt += s_l[k] * c;
        O += s_o[k][d] * c;
      }
    }
    Lt += sink_term(a.p, h, M);
    out[d] = __bfloat16_as_ushort(__float2bfloat16_rn(Lt > 0.0f ? O / Lt : 0.0f));
  }
}

// Launches attn_reduce_kernel for a.num_splits > 1: about 4 splits per lane, at most 8 lanes.
inline void launch_reduce(const RowsArgs& a, cudaStream_t st) {
  const int S = a.num_splits;
  const unsigned lanes = S >= 32 ? 8 : S >= 16 ? 4 : S >= 8 ? 2 : 1;
  cuda_check(launch_pdl<attn_reduce_kernel>(dim3(unsigned(a.p.num_tokens), unsigned(a.p.num_q_heads)),
                                            dim3(unsigned(std::min(a.p.head_dim, 128)), lanes), 0, st, a),
             "paged_attention reduce launch");
}

constexpr int kMaxGroupPerCta = 8;

// The CUDA-core kernel for (Fmt, HD), plus the reduction when the key range is split.
template <class Fmt, int HD>
void launch_rows(const RowsArgs& a, cudaStream_t st) {
  const dim3 grid(unsigned(a.p.num_tokens), unsigned(a.p.num_kv_heads * a.head_chunks),
                  unsigned(a.exact_pass ? 1 : a.num_splits));
  const int gmax = std::min(a.group, kMaxGroupPerCta);
  // GQA group sizes are compiled as 1, 4 and 8 (the common ones); 2-3 run in the 4-wide and
  // 5-7 in the 8-wide instance with idle head slots: correct, somewhat wasteful.
  // Launched with PDL (pdl.cuh): the kernel waits before it reads Q or the pages.
  const dim3 block(kWarps * 32);
  cudaError_t e;
  if (gmax == 1) e = launch_pdl<attn_rows_kernel<Fmt, HD, 1>>(grid, block, 0, st, a);
  else if (gmax <= 4) e = launch_pdl<attn_rows_kernel<Fmt, HD, 4>>(grid, block, 0, st, a);
  else e = launch_pdl<attn_rows_kernel<Fmt, HD, 8>>(grid, block, 0, st, a);
  cuda_check(e, "paged_attention launch");
  if (a.num_splits > 1) launch_reduce(a, st);
}

}  // namespace

// Head sizes 8, 16 and 32 (CUDA-core kernel), compiled in paged_attention_small.cu.
void launch_rows_small_heads(const RowsArgs& a, cudaStream_t st);

// The tiled multi-token kernel (paged_attention_prefill.cu), head sizes 64/128/256: M rows
// ((query token, head) pairs) per CTA, resident CTAs per SM, and the launch of its range_splits
// splits (the caller reduces them, after the exact pass if any).
int prefill_rows_per_cta(int head_dim);
int prefill_ctas_per_sm(const PagedAttentionParams& p);
void launch_prefill(const RowsArgs& a, cudaStream_t st);
// The warp-specialised prefill kernel (paged_attention_prefill_wgmma.cu): whether it runs on
// the current GPU (sm_90a code loaded, not switched off), and, for head sizes 64 and 128, its
// resident CTAs per SM and its launch (launch_prefill chooses it).
bool prefill_wgmma_available();
int prefill_wgmma_ctas_per_sm(const PagedAttentionParams& p);
void launch_prefill_wgmma(const RowsArgs& a, cudaStream_t st);

}  // namespace kvlm::cuda

// Tensor-core paged attention (mma.sync m16n8k16, fp32 accumulation), included by
// paged_attention.cu. Why tensor cores for a memory-bound decode: with CUDA cores the
// 2 * group * head_dim FMAs per key, plus the cross-lane dot-product reductions, cost more
// issue slots than an FP8 page takes to stream, so FP8 ran no faster than BF16 (measured:
// docs/results/kernel-lab.md). An mma does the whole group's dot products for 8 keys in one
// instruction and needs no shuffles.
//
// The 16 rows of the mma's M dimension are (query row, head of the GQA group) pairs:
// m = r * group + h, r < rows_per_cta = 16 / group. Decode at GQA <= 8 takes the transposed
// layout instead (kT below: keys in M, the pairs in N = 8), as this one leaves 12 of 16 M rows
// idle at GQA 4 — acceptable for bf16, which streams at copy bandwidth, but twice the mmas and
// accumulators of the 1-byte and 4-bit tiles, which are bound by instructions
// (docs/results/kernel-lab.md); multi-token rows of one sequence share each K/V load between
// 16 / group query rows here.
//
// Operand layouts come from the mma fragment definitions (PTX ISA, m16n8k16): thread
// (g = lane / 4, t = lane % 4) holds B[k = 2t, 2t+1, 2t+8, 2t+9][n = g] and A rows g, g+8.
//  - Q·K^T: B = K^T, n = key. A dot product is invariant under any permutation of head_dim
//    applied to both q and k, so each thread loads a contiguous-in-16-B slice of its key's
//    row (coalesced: 4 threads cover 64 B of a row per instruction) and Q is loaded with the
//    same permutation. No shared memory, no ldmatrix.
//  - P·V: B = V, k = key, n = output dim. The output dims may be permuted freely (undone
//    when storing), so thread (g, t) loads the contiguous dims [g*HD/8, (g+1)*HD/8) of the 4
//    keys its P fragment covers (2t, 2t+1, 2t+8, 2t+9); 8 threads cover a whole row.
//  - P stays in registers: the S accumulator layout is the A layout of the next mma (FA2).
//    For 16-bit caches P is split into hi + lo halves (two mmas) so the weights keep ~16
//    bits: a single bf16 P would add ~2^-9 relative error per weight (see kSplitP).
#pragma once

#include <cfloat>

#include "ops/cuda/mma_operands.cuh"

namespace kvlm::cuda::mma {

constexpr int kMmaWarps = 4;

#ifdef KVLM_ATTN_TRACE
// attention_lab --trace (attention_ops.h: paged_attention_last_trace): per CTA, globaltimer at
// start / first tile in shared memory / end, and the SM.
constexpr int kTraceCtas = 65536;
__device__ unsigned long long g_cta_trace[kTraceCtas][4];
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// Row padding (floats) of the cross-warp merge buffer: see the merge in attn_mma_kernel.
constexpr int kMergePad = 8;

// Shared-memory layout of a ring tile's rows for 16-bit head-128 codes (256-byte rows, 16
// chunks of 16 B): chunk c of row r (K rows 0-15, V rows 0-15) is stored at c ^ tile_swz(r).
// Unswizzled, the 8 lanes of a 16-byte load phase read 2 K rows at the same bank offsets
// (2-way) and 4 V rows (4-way); bit 2 of the XOR (row parity) separates the K pair, bit 0
// (row bit 1) halves the V conflicts. int4 rows (64 B at head 128, 32 B at head 64): the V
// reads of a half-warp hit rows 2t (t < 4), 128 or 64 B apart — the same banks, 4- or 2-way —
// so their chunks are XORed with row bits 1-2 (NC 4) or bit 2 (NC 2). Other widths (and the
// 1-byte formats' 64-byte rows, measured as they are) are stored as they are.
template <int NC, bool kI4 = false>
__device__ __forceinline__ int tile_swz(int r) {
  if constexpr (NC == 16) return ((r & 1) << 2) | ((r >> 1) & 1);
  else if constexpr (kI4 && NC == 4) return (r >> 1) & 3;
  else if constexpr (kI4 && NC == 2) return (r >> 2) & 1;
  else return 0;
}

// Bytes of one ring tile's codes: 16 K rows and 16 V rows (K's and V's formats may differ),
// and of its scales (16 K and 16 V slots where either side has per-token-head scales).
template <class Fmt, int HD>
constexpr int mma_tile_codes() {
  return 16 * HD * (KOf<Fmt>::kBits + VOf<Fmt>::kBits) / 8;
}
template <class Fmt>
constexpr bool kTokenScales = KOf<Fmt>::kScale == Scale::PerTokenHead || VOf<Fmt>::kScale == Scale::PerTokenHead;

// Ring depth per warp.
template <class Fmt, int HD>
constexpr int mma_stages() {
  constexpr int tile = mma_tile_codes<Fmt, HD>();
  // 1-byte codes: 4 stages (64 KB per CTA), so 3 CTAs fit per SM for more warps to overlap
  // the per-tile math; 16-bit head 128: 3 x 8 KB (96 KB per CTA, 2 CTAs per SM); 4-bit codes
  // (2.1 KB tiles at head 128): 4 stages too, 35 KB per CTA, so that registers (< 128) alone
  // bound the CTAs per SM, at 4. The int4 tile is bound by instruction issue: a 4th CTA's warps
  // hide more of it than deeper rings (8 stages, 3 CTAs per SM, was 23% slower at 64 x 4k on
  // the H200; 6 stages, 4 CTAs, 4% slower, its slot modulo costing instructions; kernel-lab.md).
  return tile >= 8192 ? 3 : 4;
}
template <class Fmt, int HD>
constexpr size_t mma_smem_bytes() {
  constexpr size_t tile = mma_tile_codes<Fmt, HD>() + (kTokenScales<Fmt> ? 128 : 0);
  constexpr size_t ring = kMmaWarps * mma_stages<Fmt, HD>() * tile;
  constexpr size_t merge = sizeof(float) * kMmaWarps * 16 * (HD + kMergePad + 2);
  return ring > merge ? ring : merge;
}

// Two 4-bit codes of a word as one f16 pair (exact) in one AND, as subnormals: the codes at
// bits [0, 4) and [16, 20) (lo) are the f16 values code * 2^-24, those at [4, 8) and [20, 24)
// (hi) 16 code * 2^-24. The tensor cores read f16 subnormals as they are (the attention sweep
// of the CUDA tests checks it), and every product with P stays far inside fp32's range, so the
// accumulators only carry the powers of two, taken off at the end (kI4VLo, kI4VHi). Codes
// under exponent 0x64 (1024 + code, one LOP3 and one HSUB2 or HFMA2) cost twice the
// instructions; folding that 1024 into the zero-point sum instead loses ~7 bits to the tensor
// cores' truncating accumulation (docs/results/kernel-lab.md).
__device__ __forceinline__ uint32_t i4_lo_pair(uint32_t x) { return x & 0x000f000fu; }
__device__ __forceinline__ uint32_t i4_hi_pair(uint32_t x) { return x & 0x00f000f0u; }
constexpr float kI4VLo = 16777216.0f;  // 2^24: o of the lo-nibble dims (M rows g)
constexpr float kI4VHi = 1048576.0f;   // 2^20: the hi-nibble dims (M rows g + 8)

// int4 K rows as the A fragments of S^T = K Q^T over 8-bit integers (the keys-in-M layout,
// imma16832_u8s8): word w of a thread's row (byte i: element 8w + i in the low nibble, 8w + i + 4
// in the high) gives elements 8w .. 8w + 3 as 4 unsigned bytes (one LOP3) and 8w + 4 .. 8w + 7
// (a shift and a LOP3); k-chunk c of 32 takes word c of rows g (a0, a2) and g + 8 (a1, a3), and
// Q's bytes follow the same order (3 instructions per 8 codes, against 9 to expand them to f16).
template <int KW>
__device__ __forceinline__ void int4_k_bytes(const uint32_t (&w0)[KW], const uint32_t (&w1)[KW], int c, uint32_t (&a)[4]) {
  a[0] = w0[c] & 0x0f0f0f0fu;
  a[1] = w1[c] & 0x0f0f0f0fu;
  a[2] = (w0[c] >> 4) & 0x0f0f0f0fu;
  a[3] = (w1[c] >> 4) & 0x0f0f0f0fu;
}

// int4 V rows as the A fragments of O^T = V^T P^T (the keys-in-M layout), straight from the
// codes: the 4 keys' words (keys 2t, 2t+1, 2t+8, 2t+9 of the tile, this thread's HD / 8 dims)
// are paired byte by byte (one permute per 4 bytes of two keys), and each register is one
// i4_lo_pair / i4_hi_pair. M-tile mt, half h holds element (mt / 4) * 8 + mt % 4 + 4 h of the
// thread's dims (kT_vdim): the lo nibbles are M rows g (h = 0), the hi nibbles rows g + 8.
// 1.5 instructions per register, against 3.75 for expanding each key to 1024 + code and then
// pairing the keys.
template <int VW>
__device__ __forceinline__ void int4_v_fragments(const uint32_t (*w)[VW], uint32_t (*va)[4]) {
#pragma unroll
  for (int wi = 0; wi < VW; ++wi)
#pragma unroll
    for (int kp = 0; kp < 2; ++kp) {
      const uint32_t x[2] = {__byte_perm(w[2 * kp][wi], w[2 * kp + 1][wi], 0x5410),
                             __byte_perm(w[2 * kp][wi], w[2 * kp + 1][wi], 0x7632)};
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t src = x[q >> 1] >> (8 * (q & 1));
        va[wi * 4 + q][2 * kp] = i4_lo_pair(src);
        va[wi * 4 + q][2 * kp + 1] = i4_hi_pair(src);
      }
    }
}

// Keys in M: the output dim (within the thread's HD / 8) of m-tile mt, half h (rows g / g + 8),
// for V's format VF.
template <class VF>
__device__ __forceinline__ constexpr int kT_vdim(int mt, int h) {
  if constexpr (kIsInt4<VF>) return (mt / 4) * 8 + mt % 4 + 4 * h;
  else return 2 * mt + h;
}

// kT (RowsArgs::keys_in_m): the transposed products for decode at GQA <= 8, where the layout
// above leaves 12 of 16 M rows idle (GQA 4): S^T = K Q^T (M = the tile's 16 keys, N = 8 (query
// row, head) pairs) and O^T = V^T P^T (M = 16 output dims, N = the pairs). The K and V
// fragments a thread needs are the same bytes as above (K rows g, g + 8; V rows 2t, 2t + 1,
// 2t + 8, 2t + 9 over dims [g HD / 8, (g + 1) HD / 8)), so the ring and its swizzle are shared;
// the tile costs half the mmas (8 + 8 at head 128 instead of 16 + 16), half the accumulators,
// and two movmatrix transposes carry P from the S^T accumulators (key g, pairs 2t, 2t + 1) to
// the B fragments of P^T (keys 2t.., pair g). A row's softmax state then lives in the 8
// threads of one t: max and sums reduce over lanes 4 apart.
template <class Fmt, int HD, bool kT = false>
__global__ void __launch_bounds__(kMmaWarps * 32) attn_mma_kernel(const RowsArgs a) {
  allow_dependents();
#ifdef KVLM_ATTN_TRACE
  const unsigned long long trace_start = global_ns();
  unsigned long long trace_first = 0;
  auto trace_end = [&] {  // thread 0, at the CTA's end (also a CTA without rows)
    const unsigned long long b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * (unsigned long long)blockIdx.z);
    if (threadIdx.x == 0 && b < kTraceCtas) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      g_cta_trace[b][0] = trace_start;
      g_cta_trace[b][1] = trace_first;  // warp 0's first tile (0: warp 0 had none)
      g_cta_trace[b][2] = global_ns();
      g_cta_trace[b][3] = sm;
    }
  };
#endif
  // Fmt: one codec (K and V alike) or a KVPair (kv_codec.cuh): K's codes, Q and S = Q K^T
  // follow KF; V's codes, P and O = P V follow VF.
  using KF = KOf<Fmt>;
  using VF = VOf<Fmt>;
  constexpr bool kBF = MmaCodec<KF>::kBF16;   // the mma type of Q K^T
  constexpr bool kBFV = MmaCodec<VF>::kBF16;  // of P V
  constexpr int KBITS = KF::kBits, VBITS = VF::kBits;
  constexpr bool kI4 = kIsInt4<KF>;   // K = codes * step + zero: see the zero-point terms below
  constexpr bool kI4V = kIsInt4<VF>;  // V likewise
  // int4 with keys in M: S^T = K Q^T on the integer tensor cores, the codes as unsigned bytes
  // and Q as two signed-byte parts (int4_k_bytes); the f16 expansion of K was a third of the
  // tile's instructions.
  constexpr bool kQ8 = kT && kI4;
  constexpr int KBYTES = HD * KBITS / 32;  // bytes of one K row held by a thread
  constexpr int KG = KBYTES < 16 ? KBYTES : 16;  // bytes per K load (8 for int4 at head 64)
  constexpr int KLOADS = KBYTES / KG;      // K loads per row per thread
  constexpr int VB = KG * 8 / KBITS;       // elements per K load
  constexpr int VBYTES = HD * VBITS / 64;  // bytes of one V row held by a thread
  constexpr int KPAIRS = HD / 8;           // 16-bit pairs per K row per thread
  constexpr int VPAIRS = HD / 16;          // pairs per V row per thread
  constexpr int KCH = HD / 16;             // k-chunks of Q.K^T
  constexpr int NT = HD / 8;               // n-tiles of P.V
  constexpr int MT = HD / 16;              // kT: m-tiles of V^T P^T
  constexpr int NO = kT ? MT : NT;         // accumulator tiles of the output
  // P precision: 16-bit caches get P as hi + lo halves (~16 bits, two mmas); 1-byte caches
  // get one f16 P (11 bits, relative error 2^-12 per weight): their codes carry 2^-4 (fp8)
  // to 2^-8 (int8) relative error already, and the saved mma is ~1/3 of the tile's tensor
  // work, which is what bounds the FP8 decode (docs/results/kernel-lab.md).
  constexpr bool kSplitP = VBITS == 16;
  static_assert((KBYTES % 16 == 0 || KBYTES == 8) && (VBYTES == 4 || VBYTES == 8 || VBYTES % 16 == 0),
                "unsupported head size for the mma path");

  const PagedAttentionParams& p = a.p;
  const int G = a.group;
  const int qr = a.rows_per_cta;
  const int seq = blockIdx.x / a.row_groups;
  const int r0 = (blockIdx.x % a.row_groups) * qr;  // first query row (within the sequence)
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  // The thread index through an empty asm: otherwise the compiler re-reads it in the tile loop
  // and recomputes every shared-memory address derived from it, each iteration (~20
  // instructions per tile at int4 head 128 once the max reduction became a branch).
  int tid = threadIdx.x;
  asm("" : "+r"(tid));
  const int lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;

  const int q_begin = p.cu_q_lens[seq], q_len = p.cu_q_lens[seq + 1] - q_begin;
  if (r0 >= q_len) {  // CTA-uniform: this sequence has fewer rows
#ifdef KVLM_ATTN_TRACE
    trace_end();
#endif
    return;
  }
  const int nrows = min(qr, q_len - r0);
  const int kv_len = p.kv_lens[seq];

  // Union of the CTA's rows' visible ranges, split across blockIdx.z in 16-key multiples.
  int lo_all = INT_MAX, hi_all = 0;
  for (int r = 0; r < nrows; ++r) {
    int lo, hi;
    quantized_range(p, kv_len - q_len + r0 + r, kv_len, lo, hi);  // exact keys: the CUDA-core exact pass
    if (lo >= hi) continue;
    lo_all = min(lo_all, lo);
    hi_all = max(hi_all, hi);
  }
  if (lo_all > hi_all) lo_all = hi_all;  // no quantized key for any row (all kept exact): an empty range
  int t0, t1;
  split_range<16>(lo_all, hi_all, a.range_splits, split, a.decreasing_splits, t0, t1);

  // This thread's two (query row, head) pairs — M rows g, g + 8, or with kT the N columns 2t,
  // 2t + 1: query row, head, visible range within [t0, t1).
  int mlo[2], mhi[2], mrow[2], mhead[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int m = kT ? 2 * t + i : g + 8 * i;
    mrow[i] = m / G;
    mhead[i] = m % G;
    mlo[i] = 0;
    mhi[i] = 0;
    if (mrow[i] < nrows) {
      quantized_range(p, kv_len - q_len + r0 + mrow[i], kv_len, mlo[i], mhi[i]);
      mlo[i] = max(mlo[i], t0);
      mhi[i] = min(mhi[i], t1);
    }
  }

  const int mrows = nrows * G;  // (query row, head) pairs in use, <= 16

  const char* kbase = static_cast<const char*>(p.k_cache);
  const char* vbase = static_cast<const char*>(p.v_cache);
  PageRows pr(p, seq, kvh);
  if constexpr (kT) {  // the sequence's page table as one pointer (the compiler otherwise re-adds seq's offset per lookup)
    uint64_t tb = reinterpret_cast<uint64_t>(pr.table);
    asm("" : "+l"(tb));
    pr.table = reinterpret_cast<const BlockId*>(tb);
  }

  // 16-key tiles aligned to 16 absolute positions: with block_size % 16 == 0 a tile never
  // straddles pages, so one block-table lookup serves 16 keys, and the tile's K (and V) rows
  // of this kv head are one contiguous 16 * RB-byte run of the page.
  //
  // Each warp streams its own tiles (warp, warp + 4, ...) through a STAGES-deep cp.async ring
  // in shared memory: STAGES - 1 tiles are always in flight per warp, which is what keeps
  // enough bytes outstanding for HBM (one tile in registers per warp reached only ~75% of
  // copy bandwidth at 64 x 4k). Warps never wait for each other (__syncwarp only).
  // Keys outside [t0, t1) are zero-filled (cp.async src-size 0), never read: stale rows of a
  // page may hold NaNs, and 0 * NaN in P.V would poison the output.
  constexpr int RB = HD * KBITS / 8;   // bytes of a K row
  constexpr int RBV = HD * VBITS / 8;  // of a V row (after the tile's 16 K rows)
  constexpr bool kPTH = kTokenScales<Fmt>;
  constexpr bool kPTHK = KF::kScale == Scale::PerTokenHead, kPTHV = VF::kScale == Scale::PerTokenHead;
  constexpr int CODES = 16 * (RB + RBV);  // the scales follow: 16 K slots, then 16 V slots
  constexpr int TILE = CODES + (kPTH ? 128 : 0);
  constexpr int STAGES = mma_stages<Fmt, HD>();
  extern __shared__ uint4 smem_u4[];
  char* const smem = reinterpret_cast<char*>(smem_u4);
  char* const ring = smem + warp * STAGES * TILE;
  const int first = (t0 & ~15) + warp * 16;
  const int my_tiles = first < t1 ? (t1 - first + kMmaWarps * 16 - 1) / (kMmaWarps * 16) : 0;
  // Issuing a tile is most of a tile's instructions for 1-byte codes (docs/results/kernel-lab.md):
  // one page lookup per tile (PageRows: a shift where block_size is a power of two), and a tile
  // wholly inside [t0, t1) — all but a split's first and last — copies at constant offsets from
  // one source and one destination register.
  constexpr int NC = RB / 16;    // 16-byte chunks per K row (tile_swz)
  constexpr int NCV = RBV / 16;  // per V row
  constexpr bool kSameRows = RB == RBV && kI4 == kI4V;  // K's and V's rows alike (one swizzle)
  // A lane's constant-offset copies cover rows lane / NC + (32 / NC) * U; at NC = 16 the XOR
  // then depends on U's parity only: one destination register for even U, one for odd (the
  // other swizzles do not depend on U at all).
  const uint32_t ring_0 = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const auto lane_dst = [&]<int N, bool I4>(int u) {
    const int r = lane / N + (32 / N) * u;
    return uint32_t(((lane / N) * N + ((lane % N) ^ tile_swz<N, I4>(r))) * 16);
  };
  const uint32_t ring_s = ring_0 + lane_dst.template operator()<NC, kI4>(0);
  const uint32_t ring_s1 = ring_0 + lane_dst.template operator()<NC, kI4>(1);
  const uint32_t ring_v = ring_0 + 16 * RB + lane_dst.template operator()<NCV, kI4V>(0);
  const uint32_t ring_v1 = ring_0 + 16 * RB + lane_dst.template operator()<NCV, kI4V>(1);
  // Per-token-head scales: lane l copies the 4-byte scale of row l % 16, K's (l < 16) or V's, so
  // every lane issues one copy and no lane waits out a branch of the others' (a side without
  // token scales, in a K != V pair, copies none).
  const bool copies_scale = lane < 16 ? kPTHK : kPTHV;
  const float* const sbase = kPTH ? (lane < 16 ? p.k_token_scale : p.v_token_scale) + lane % 16 : nullptr;
  const uint32_t ring_sc = ring_0 + CODES + lane * 4;
  auto issue = [&](int i) {
    if (i < my_tiles) {
      const int base = first + i * kMmaWarps * 16;
      const int64_t tile_row = pr.row(base);  // the tile's 16 rows are consecutive in its page
      const int slot = (i % STAGES) * TILE;
      if (base >= t0 && base + 16 <= t1) {  // warp-uniform: every key of the tile is visible
        const char* ks = kbase + size_t(tile_row) * RB + lane * 16;
        const char* vs = vbase + size_t(tile_row) * RBV + lane * 16;
        const uint32_t d = ring_s + slot, d1 = ring_s1 + slot;
        static_assert(RB % 32 == 0 && RBV % 32 == 0, "16 rows * RB bytes: RB / 32 chunks of 16 B per lane");
        if constexpr (kSameRows) {  // V's rows land at K's offsets + 16 RB: the same two registers
          [&]<int... U>(std::integer_sequence<int, U...>) {
            (cp_async16_at<U * 512, U * 512>((U & 1) ? d1 : d, ks), ...);
            (cp_async16_at<16 * RB + U * 512, U * 512>((U & 1) ? d1 : d, vs), ...);
          }(std::make_integer_sequence<int, RB / 32>{});
        } else {
          const uint32_t dv = ring_v + slot, dv1 = ring_v1 + slot;
          [&]<int... U>(std::integer_sequence<int, U...>) {
            (cp_async16_at<U * 512, U * 512>((U & 1) ? d1 : d, ks), ...);
          }(std::make_integer_sequence<int, RB / 32>{});
          [&]<int... U>(std::integer_sequence<int, U...>) {
            (cp_async16_at<U * 512, U * 512>((U & 1) ? dv1 : dv, vs), ...);
          }(std::make_integer_sequence<int, RBV / 32>{});
        }
        if (kPTH && copies_scale) cp_async4(ring_sc + slot, sbase + tile_row);  // (in each branch: one run of copies)
      } else {
        char* dst = ring + slot;
        const char* ksrc = kbase + size_t(tile_row) * RB;
        const char* vsrc = vbase + size_t(tile_row) * RBV;
        if constexpr (kSameRows) {
#pragma unroll
          for (int c = lane; c < RB; c += 32) {  // 16 rows * RB bytes = RB chunks of 16 B
            const int r = c / NC, tok = base + r;
            const int n = tok >= t0 && tok < t1 ? 16 : 0;
            const int dc = r * NC + ((c % NC) ^ tile_swz<NC, kI4>(r));
            cp_async16(dst + dc * 16, ksrc + c * 16, n);
            cp_async16(dst + 16 * RB + dc * 16, vsrc + c * 16, n);
          }
        } else {
#pragma unroll
          for (int c = lane; c < RB; c += 32) {
            const int r = c / NC, tok = base + r;
            cp_async16(dst + (r * NC + ((c % NC) ^ tile_swz<NC, kI4>(r))) * 16, ksrc + c * 16, tok >= t0 && tok < t1 ? 16 : 0);
          }
#pragma unroll
          for (int c = lane; c < RBV; c += 32) {
            const int r = c / NCV, tok = base + r;
            cp_async16(dst + 16 * RB + (r * NCV + ((c % NCV) ^ tile_swz<NCV, kI4V>(r))) * 16, vsrc + c * 16,
                       tok >= t0 && tok < t1 ? 16 : 0);
          }
        }
        if (kPTH && copies_scale) cp_async4(ring_sc + slot, sbase + tile_row);  // 16 K scales then 16 V scales, 4 B a lane
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  // The ring is filled first: its loads are in flight while Q is loaded and converted below
  // (Q first made every CTA wait one global latency before its first tile was requested).
  // The kernel is launched with PDL (paged_attention.cu): the kernel before it writes Q and
  // this step's K/V rows — positions from kv_len - q_len on — and may still be running.
  // Nothing in the step writes the older pages (block copies finish before a step starts), so
  // tiles wholly before the new rows are requested before pdl_wait: their HBM latency
  // overlaps the end of the kernel before instead of following it.
  // The early tiles are a prefix of the first STAGES - 1 (both conditions fail from some i on).
  const int fresh = kv_len - q_len;
  int early = 0;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < my_tiles && first + i * kMmaWarps * 16 + 16 <= fresh) {
      issue(i);
      early = i + 1;
    }
  }
  pdl_wait();
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i)
    if (i >= early) issue(i);

  // Q A-fragments, permuted like the K slices (element x of this thread's list sits at
  // physical dim (x / VB) * 4 * VB + t * VB + x % VB).
  // kT: Q is the B fragment of S^T, the pair g alone (qa[c][0..1]).
  constexpr int NQ = kT ? 1 : 2;
  uint32_t qa[KCH][2 * NQ];
  float qsum[2] = {0.0f, 0.0f};
  // kQ8 (int4, keys in M): Q as signed bytes for the integer mma, hi and lo parts (below), and
  // each of pairs 2t, 2t + 1's score unit.
  uint32_t q8[2][kQ8 ? KPAIRS / 2 : 1];
  float qstep[2] = {1.0f, 1.0f};
  {
    uint32_t qp[NQ][KPAIRS];
    float qf[kQ8 ? 2 * KPAIRS : 1];  // kQ8: pair g's elements, in the thread's list order
#pragma unroll
    for (int i = 0; i < NQ; ++i) {
      const int m = g + 8 * i, qm = m / G;
      const bool ok = qm < nrows;
      const uint16_t* qrow = p.q + (size_t(q_begin + r0 + (ok ? qm : 0)) * p.num_q_heads + kvh * G + m % G) * HD;
#pragma unroll
      for (int c = 0; c < KLOADS; ++c) {
#pragma unroll
        for (int h = 0; h < VB / 8; ++h) {  // VB bf16 query values = VB / 8 16-byte loads
          const uint4 raw = ok ? __ldg(reinterpret_cast<const uint4*>(qrow + c * 4 * VB + t * VB) + h) : make_uint4(0, 0, 0, 0);
          const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int pi = c * (VB / 2) + h * 4 + j;
            if constexpr (kQ8) {  // the integer parts are made below, from fp32
              qf[2 * pi] = __uint_as_float(w[j] << 16);
              qf[2 * pi + 1] = __uint_as_float(w[j] & 0xffff0000u);
            } else if constexpr (kBF) {
              qp[i][pi] = w[j];
            } else {
              qp[i][pi] = pack2<false>(__uint_as_float(w[j] << 16), __uint_as_float(w[j] & 0xffff0000u));
            }
          }
        }
      }
    }
    if constexpr (kQ8) {
      // Pair g's Q as qstep * (hi + lo / 256), hi and lo signed bytes: qstep = max|q| / 127
      // over the head (the 4 threads t of g hold it between them), hi = round(q / qstep), lo
      // the rounded remainder in 256ths. Error <= max|q| / 65024 per element, below the f16
      // Q of the other paths (2^-12 relative), and the products with the codes sum exactly in
      // int32. sum(q) of the zero-point term is the same integers' sum, so the score is exactly
      // that of the stored Q; NaN in Q is not carried (a model with NaN queries has diverged).
      float amax = 0.0f;
#pragma unroll
      for (int x = 0; x < 2 * KPAIRS; ++x) amax = fmaxf(amax, fabsf(qf[x]));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int isum = 0;
#pragma unroll
      for (int r = 0; r < KPAIRS / 2; ++r) {
        uint32_t hw = 0, lw = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const float x = qf[4 * r + b] * inv;
          const float h = rintf(x);
          const int ih = int(h), il = int(fminf(rintf((x - h) * 256.0f), 127.0f));
          isum += ih * 256 + il;
          hw |= uint32_t(ih & 0xff) << (8 * b);
          lw |= uint32_t(il & 0xff) << (8 * b);
        }
        q8[0][r] = hw;
        q8[1][r] = lw;
      }
      isum += __shfl_xor_sync(0xffffffffu, isum, 1);
      isum += __shfl_xor_sync(0xffffffffu, isum, 2);
      const float step = amax / (127.0f * 256.0f);  // score units of the int32 sums
      qsum[0] = float(__shfl_sync(0xffffffffu, isum, 8 * t));  // exact: |isum| < 2^24 at head 256
      qsum[1] = float(__shfl_sync(0xffffffffu, isum, 8 * t + 4));
      qstep[0] = __shfl_sync(0xffffffffu, step, 8 * t);
      qstep[1] = __shfl_sync(0xffffffffu, step, 8 * t + 4);
    }
#pragma unroll
    for (int c = 0; c < (kQ8 ? 0 : KCH); ++c) {  // (kQ8 reads q8 instead)
      if constexpr (kT) {
        qa[c][0] = qp[0][2 * c];
        qa[c][1] = qp[0][2 * c + 1];
      } else {
        qa[c][0] = qp[0][2 * c];
        qa[c][1] = qp[NQ - 1][2 * c];
        qa[c][2] = qp[0][2 * c + 1];
        qa[c][3] = qp[NQ - 1][2 * c + 1];
      }
    }
    // int4: sum(q) of each M row, from the same 16-bit values the mma reads (the row's 4
    // threads hold all of it between them); kT: of pair g, then fetched for pairs 2t, 2t + 1.
    if constexpr (kI4 && !kQ8) {
#pragma unroll
      for (int i = 0; i < NQ; ++i) {
        float sq = 0.0f;
#pragma unroll
        for (int j = 0; j < KPAIRS; ++j) {
          const float2 v = unpack2<kBF>(qp[i][j]);
          sq += v.x + v.y;
        }
        sq += __shfl_xor_sync(0xffffffffu, sq, 1);
        sq += __shfl_xor_sync(0xffffffffu, sq, 2);
        qsum[i] = sq;
      }
      if constexpr (kT) {
        const float sg = qsum[0];
        qsum[0] = __shfl_sync(0xffffffffu, sg, 8 * t);
        qsum[1] = __shfl_sync(0xffffffffu, sg, 8 * t + 4);
      }
    }
  }

  float sscale, vscale;
  score_scales<Fmt>(p, kvh, sscale, vscale);
  const float ssc[2] = {sscale * qstep[0], sscale * qstep[1]};  // kT: pairs 2t, 2t + 1
  // Per-token-head V scales ride on P (p * v_scale), carried in f16 times 2^8 so that rows
  // with V absmax in ~[1e-4, 3e4] stay in f16's range; undone at the end. int4 steps go up to
  // 65504 / 15 (the f16 zero point's own limit): 2^4 there, so P * step * 16 stays finite for
  // steps below 4096; at the smallest step (2^-14) only weights below 2^-10 reach f16's
  // subnormals, an error far below the step itself.
  constexpr float kPScale = kI4V ? 16.0f : VF::kScale == Scale::PerTokenHead ? 256.0f : 1.0f;

  float o[NO][4];
#pragma unroll
  for (int i = 0; i < NO; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  // kT starts the running max at -FLT_MAX, not -inf: every finite score exceeds it, so the
  // weights can be taken against m_run itself (no -inf - -inf to guard), and exp2(-FLT_MAX - m)
  // is 0 as exp2(-inf) was; it is -inf again before the merge.
  constexpr float kNoMax = kT ? -FLT_MAX : -INFINITY;
  float m_run[2] = {kNoMax, kNoMax}, l_run[2] = {0.0f, 0.0f};
  float zacc[2] = {0.0f, 0.0f};  // int4: sum over keys of weight * V's zero point (x kPScale)

  for (int i = 0; i < my_tiles; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
    __syncwarp();
    issue(i + STAGES - 1);  // refills the slot computed in iteration i - 1
#ifdef KVLM_ATTN_TRACE
    if (i == 0) trace_first = global_ns();
#endif
    const int base = first + i * kMmaWarps * 16;
    const char* tile = ring + (i % STAGES) * TILE;
    uint4 kraw[2][KLOADS];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int c = 0; c < KLOADS; ++c) {
        if constexpr (KG == 16) {
          kraw[j][c] = *reinterpret_cast<const uint4*>(tile + (g + 8 * j) * RB + (((c * 4 + t) ^ tile_swz<NC, kI4>(g)) * 16));
        } else {  // 8-byte pieces (int4, head 64): piece c * 4 + t of the row, in its swizzled chunk
          const int b = (c * 4 + t) * KG;
          const uint2 x = *reinterpret_cast<const uint2*>(tile + (g + 8 * j) * RB +
                                                          ((b / 16) ^ tile_swz<NC, kI4>(g)) * 16 + b % 16);
          kraw[j][c] = make_uint4(x.x, x.y, 0u, 0u);
        }
      }
    // (tile_swz reads row bits 0-2: rows g and g + 8 share theirs.)
    constexpr int kVr = VBYTES >= 16 ? VBYTES / 16 : 1;
    uint4 vraw[4][kVr];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int off = 2 * t + (j & 1) + 8 * (j >> 1);  // keys 2t, 2t+1, 2t+8, 2t+9
      const char* vrow = tile + 16 * RB + off * RBV;
      if constexpr (VBYTES >= 16) {
#pragma unroll
        for (int c = 0; c < kVr; ++c)
          vraw[j][c] = *reinterpret_cast<const uint4*>(vrow + ((g * kVr + c) ^ tile_swz<NCV, kI4V>(off)) * 16);
      } else {
        const int b = g * VBYTES;
        const char* at = vrow + ((b / 16) ^ tile_swz<NCV, kI4V>(off)) * 16 + b % 16;
        if constexpr (VBYTES == 8) {
          const uint2 x = *reinterpret_cast<const uint2*>(at);
          vraw[j][0] = make_uint4(x.x, x.y, 0u, 0u);
        } else {
          vraw[j][0] = make_uint4(*reinterpret_cast<const uint32_t*>(at), 0u, 0u, 0u);
        }
      }
    }
    // Scales of the keys whose scores this thread holds: 2t, 2t+1, 2t+8, 2t+9 (S's columns), or
    // with kT g and g + 8 (S^T's rows).
    constexpr int NS = kT ? 2 : 4;
    float ksc[NS], vsc[NS], kz[NS], vz[NS];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      const int off = kT ? g + 8 * j : 2 * t + (j & 1) + 8 * (j >> 1);
      ksc[j] = vsc[j] = 1.0f;
      kz[j] = vz[j] = 0.0f;
      if constexpr (!kPTH) continue;
      const int tok = base + off;
      const bool ok = tok >= t0 && tok < t1;  // stale scales of skipped keys may be NaN
      const char* sc = tile + CODES;  // 16 K slots, then 16 V slots
      if constexpr (kI4) {  // the packed {f16 step, f16 zero} slot, read whether or not ok (no branch)
        FmtI4::unpack(reinterpret_cast<const uint32_t*>(sc)[off], ksc[j], kz[j]);  // masked below if !ok
      } else if constexpr (kPTHK) {
        ksc[j] = ok ? reinterpret_cast<const float*>(sc)[off] : 0.0f;
      }
      if constexpr (kI4V) {
        float vs, vzero;
        FmtI4::unpack(reinterpret_cast<const uint32_t*>(sc + 64)[off], vs, vzero);
        vsc[j] = ok ? vs : 0.0f;
        vz[j] = ok ? vzero : 0.0f;
      } else if constexpr (kPTHV) {
        vsc[j] = ok ? reinterpret_cast<const float*>(sc + 64)[off] : 0.0f;
      }
    }

    if constexpr (kT) {
      // S^T = K Q^T: s[2j + e] is key base + g + 8j, pair 2t + e.
      float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if constexpr (kQ8) {
        constexpr int KW = KBYTES / 4;  // words of codes per row and thread = k-chunks of 32
        uint32_t w[2][KW];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int x = 0; x < KW; ++x) w[j][x] = reinterpret_cast<const uint32_t*>(&kraw[j][x / 4])[x % 4];
        int shi[4] = {0, 0, 0, 0}, slo[4] = {0, 0, 0, 0};
#pragma unroll
        for (int c = 0; c < KW; ++c) {
          uint32_t ka[4];
          int4_k_bytes<KW>(w[0], w[1], c, ka);
          imma16832_u8s8(shi, ka, q8[0][2 * c], q8[0][2 * c + 1]);
          imma16832_u8s8(slo, ka, q8[1][2 * c], q8[1][2 * c + 1]);
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) s[k] = float(shi[k] * 256 + slo[k]);  // < 2^31 at head 256
      } else {
        uint32_t kp[2][KPAIRS];
#pragma unroll
        for (int j = 0; j < 2; ++j) to_pairs<KF, KBYTES>(kraw[j], kp[j]);
#pragma unroll
        for (int c = 0; c < KCH; ++c) {
          const uint32_t ka[4] = {kp[0][2 * c], kp[1][2 * c], kp[0][2 * c + 1], kp[1][2 * c + 1]};
          mma16816<kBF>(s, ka, qa[c][0], qa[c][1]);
        }
      }
      // Online softmax of pairs 2t, 2t + 1: the 16 keys of a pair are in the 8 lanes of one t.
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = base + g + 8 * j;
          float& x = s[2 * j + e];
          const float sc = kI4 ? fmaf(x, ksc[j], kz[j] * qsum[e]) : x * ksc[j];
          x = (tok >= mlo[e] && tok < mhi[e]) ? sc * ssc[e] : -INFINITY;
          mx[e] = fmaxf(mx[e], x);
        }
      // The running max moves only when a tile holds a new maximum of its pair's keys so far,
      // which gets rare a few tiles in; while no lane's score exceeds its pairs' running max, the
      // max over 8 lanes (three dependent shuffles), the correction factors and the rescale are
      // skipped, with the same result (m_run, the sums and o as they were).
      if (__any_sync(0xffffffffu, mx[0] > m_run[0] || mx[1] > m_run[1])) {
        float corr[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float v = mx[e];
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 8));
          v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 16));
          const float m_new = fmaxf(m_run[e], v);
          corr[e] = exp2_approx(m_run[e] - m_new);  // MUFU.EX2 alone: weights below 2^-126 flush to 0
          m_run[e] = m_new;
          l_run[e] *= corr[e];
          zacc[e] *= corr[e];
        }
        if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            o[mt][0] *= corr[0];
            o[mt][1] *= corr[1];
            o[mt][2] *= corr[0];
            o[mt][3] *= corr[1];
          }
        }
      }
      // P^T: the S^T accumulators (key g / g + 8; pairs 2t, 2t + 1) packed, then transposed
      // into the B fragments (keys 2t, 2t + 1 / 2t + 8, 2t + 9; pair g).
      uint32_t pb[2], plb[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float pe[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = exp2_approx(s[2 * j + e] - m_run[e]);
          l_run[e] += x;
          pe[e] = x * (vsc[j] * kPScale);
          if constexpr (kI4V) zacc[e] = fmaf(x, vz[j] * kPScale, zacc[e]);
        }
        const uint32_t hi = pack2<kBFV>(pe[0], pe[1]);
        pb[j] = movmatrix_trans(hi);
        if constexpr (kSplitP) {
          const float2 hf = unpack2<kBFV>(hi);
          plb[j] = movmatrix_trans(pack2<kBFV>(pe[0] - hf.x, pe[1] - hf.y));
        }
      }
      // O^T += V^T P^T: A fragment of m-tile mt = {dim h = 0, keys 2t.. ; h = 1, keys 2t..;
      // h = 0, keys 2t+8..; h = 1, keys 2t+8..}, dims by kT_vdim.
      uint32_t va[MT][4];
      if constexpr (kI4V) {
        constexpr int VW = VBYTES / 4;
        uint32_t vw[4][VW];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int wi = 0; wi < VW; ++wi) vw[j][wi] = reinterpret_cast<const uint32_t*>(&vraw[j][0])[wi];
        int4_v_fragments<VW>(vw, va);
      } else {
        uint32_t vp[4][VPAIRS];
#pragma unroll
        for (int j = 0; j < 4; ++j) to_pairs<VF, VBYTES>(vraw[j], vp[j]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          va[mt][0] = __byte_perm(vp[0][mt], vp[1][mt], 0x5410);
          va[mt][1] = __byte_perm(vp[0][mt], vp[1][mt], 0x7632);
          va[mt][2] = __byte_perm(vp[2][mt], vp[3][mt], 0x5410);
          va[mt][3] = __byte_perm(vp[2][mt], vp[3][mt], 0x7632);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma16816<kBFV>(o[mt], va[mt], pb[0], pb[1]);
        if constexpr (kSplitP) mma16816<kBFV>(o[mt], va[mt], plb[0], plb[1]);
      }
    } else {
      // S = Q K^T for the two 8-key halves of the tile.
      float s[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t kp[KPAIRS];
        to_pairs<KF, KBYTES>(kraw[j], kp);
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
        for (int c = 0; c < KCH; ++c) mma16816<kBF>(s[j], qa[c], kp[2 * c], kp[2 * c + 1]);
      }
      // Online softmax. s[j][e]: row g (e < 2) or g + 8 (e >= 2), key base + 8j + 2t + (e & 1).
      float pr[2][4] = {};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        // M rows g + 8 exist only when the CTA has > 8 (row, head) pairs (not in GQA <= 8
        // decode): a CTA-uniform branch skips their softmax and rescaling.
        if (i == 1 && mrows <= 8) continue;
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int kj = 2 * j + e;  // index into ksc/vsc: key 2t + e + 8j
            const int tok = base + 8 * j + 2 * t + e;
            float& x = s[j][2 * i + e];
            // int4: q . (codes * step + zero) = step * (q . codes) + zero * sum(q)
            const float sc = kI4 ? fmaf(x, ksc[kj], kz[kj] * qsum[i]) : x * ksc[kj];
            x = (tok >= mlo[i] && tok < mhi[i]) ? sc * sscale : -INFINITY;
            mx = fmaxf(mx, x);
          }
        const float m_use = online_max(mx, m_run[i], l_run[i], o, i, kI4V ? &zacc[i] : nullptr);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2f(s[j][2 * i + e] - m_use);
            l_run[i] += pe;
            pr[j][2 * i + e] = pe * (vsc[2 * j + e] * kPScale);
            if constexpr (kI4V) zacc[i] = fmaf(pe, vz[2 * j + e] * kPScale, zacc[i]);
          }
      }
      // P as A fragments (hi and lo parts): reg0 row g keys 2t.., reg1 row g+8, reg2 row g keys
      // 2t+8.., reg3 row g+8 keys 2t+8.. — exactly the S accumulator layout.
      uint32_t ph[4], pl[4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const uint32_t hi = pack2<kBFV>(pr[j][2 * i], pr[j][2 * i + 1]);
          const float2 hf = unpack2<kBFV>(hi);
          ph[2 * j + i] = hi;
          pl[2 * j + i] = kSplitP ? pack2<kBFV>(pr[j][2 * i] - hf.x, pr[j][2 * i + 1] - hf.y) : 0u;
        }
      // O += P V. V rows of keys 2t, 2t+1, 2t+8, 2t+9 as 16-bit pairs over this thread's dims.
      uint32_t vp[4][VPAIRS];
#pragma unroll
      for (int j = 0; j < 4; ++j) to_pairs<VF, VBYTES>(vraw[j], vp[j]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t sel = (nt & 1) ? 0x7632u : 0x5410u;  // high or low halves of two words
        const uint32_t b0 = __byte_perm(vp[0][nt / 2], vp[1][nt / 2], sel);
        const uint32_t b1 = __byte_perm(vp[2][nt / 2], vp[3][nt / 2], sel);
        mma16816<kBFV>(o[nt], ph, b0, b1);
        if constexpr (kSplitP) mma16816<kBFV>(o[nt], pl, b0, b1);
      }
    }
    __syncwarp();  // every lane is done with this slot before it is refilled
  }
  asm volatile("cp.async.wait_all;\n" ::);

  // Row sums: each thread summed its keys; add the 4 threads of the row (kT: the 8 threads of
  // the pair's t). int4: V's zero points reach every output dimension of the row with the same
  // weight.
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int x = kT ? 4 : 1; x <= (kT ? 16 : 2); x *= 2) {
      l_run[i] += __shfl_xor_sync(0xffffffffu, l_run[i], x);
      if constexpr (kI4V) zacc[i] += __shfl_xor_sync(0xffffffffu, zacc[i], x);
    }
    if constexpr (kI4V) {
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        if constexpr (kT) {  // o[mt][h * 2 + e]: pair 2t + e; the V codes' powers of two first (i4_lo_pair)
          o[n][i] *= kI4VLo;
          o[n][2 + i] *= kI4VHi;
          o[n][i] += zacc[i];
          o[n][2 + i] += zacc[i];
        } else {  // o[nt][2i + e]: M row g + 8i
          o[n][2 * i] += zacc[i];
          o[n][2 * i + 1] += zacc[i];
        }
      }
    }
  }
  // Merge the warps through shared memory: o[nt][2i + e] is M row g + 8i, output dim
  // (2t + e) * (HD / 8) + nt (the permutation chosen for V). A row is stored in the threads'
  // order, position nt * 8 + 2t + e, with rows HD + kMergePad floats apart, so the lanes of a
  // store hit distinct banks (g * 8 + 2t + e); stored by output dim, every lane of a store hit
  // one bank (a 32-way conflict on each of 64 stores per thread). Only the rows in use are
  // written (decode at GQA 4: 4 of the 16).
  // The merge buffers reuse the ring: wait until every warp has left its loop.
  __syncthreads();
  constexpr int kRow = HD + kMergePad;
  auto sm_o = reinterpret_cast<float(*)[16][kRow]>(smem);
  auto sm_ml = reinterpret_cast<float(*)[16][2]>(smem + sizeof(float) * kMmaWarps * 16 * kRow);
  if constexpr (kT) {  // stored by output dim: o[mt][2h + e] is pair 2t + e, dim g HD / 8 + kT_vdim(mt, h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (2 * t + e >= mrows) continue;
      if (m_run[e] == kNoMax) m_run[e] = -INFINITY;  // no score: the merge's and the partials' marker
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) sm_o[warp][2 * t + e][g * (HD / 8) + kT_vdim<VF>(mt, h)] = o[mt][2 * h + e];
      if (g == 0) {
        sm_ml[warp][2 * t + e][0] = m_run[e];
        sm_ml[warp][2 * t + e][1] = l_run[e];
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (8 * i >= mrows) continue;  // CTA-uniform
      if (g + 8 * i < mrows) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float2 v = make_float2(o[nt][2 * i], o[nt][2 * i + 1]);  // e = 0, 1: adjacent
          *reinterpret_cast<float2*>(&sm_o[warp][g + 8 * i][nt * 8 + 2 * t]) = v;
        }
        if (t == 0) {
          sm_ml[warp][g + 8 * i][0] = m_run[i];
          sm_ml[warp][g + 8 * i][1] = l_run[i];
        }
      }
    }
  }
  __syncthreads();
  // Threads walk the stored order (conflict-free reads); position s = nt * 8 + (2t + e) is
  // output dim (2t + e) * NT + nt (kT: s is the dim).
  for (int idx = threadIdx.x; idx < mrows * HD; idx += kMmaWarps * 32) {
    const int m = idx / HD, s = idx % HD;
    const int d = kT ? s : (s % 8) * NT + s / 8;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) mm = fmaxf(mm, sm_ml[w][m][0]);
    float L = 0.0f, O = 0.0f;
    if (mm != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kMmaWarps; ++w) {
        const float c = exp2f(sm_ml[w][m][0] - mm);
        L += sm_ml[w][m][1] * c;
        O += sm_o[w][m][s] * c;
      }
    }
    const int row = q_begin + r0 + m / G, h = kvh * G + m % G;
    O *= 1.0f / kPScale;
    if (a.num_splits == 1) {
      L += sink_term(p, h, mm);
      const float r = L > 0.0f ? O * vscale / L : 0.0f;
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
#ifdef KVLM_ATTN_TRACE
  __syncthreads();
  trace_end();
#endif
}

}  // namespace kvlm::cuda::mma

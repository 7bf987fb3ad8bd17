// The delta rule of prompts in the chunked (WY / UT-transform) form, on CUDA. The formulas are
// the CPU reference's (ops/cpu/linear_attention.cpp, delta_rule_chunked). Per chunk of 64 rows
// of a sequence (gc the cumulative log decay within the chunk; q, k normalized; S the state
// before the chunk):
//   B[i][j] = beta_i (k_i . k_j) exp(gc_i - gc_j) for j < i;  T = (I + B)^-1
//   W = T (beta exp(gc) k),  U = T (beta v)              the chunk's rows as if S were zero
//   v_new = U - W S
//   o_i = exp(gc_i) q_i S + sum_{j <= i} (q_i . k_j) exp(gc_i - gc_j) v_new_j
//   S <- exp(gc_last) S + sum_i exp(gc_last - gc_i) k_i v_new_i^T
// Only the state update is sequential over a sequence's chunks; the rest runs for every chunk
// at once. Four kernels, fp32 on the CUDA cores:
//   prep   a warp per (row, key head): q and k normalized in place in qkv (q also scaled by
//          dk^-0.5), g and beta of the key head's value heads -> scratch
//   wy     a CTA per (chunk, value head, sequence): gc (over g in place); B and its inverse by
//          blocks: the 16x16 diagonal blocks by forward substitution (a thread per column), then
//          merged to 32 and to 64 through [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]
//          (two small products each); W and U -> scratch
//   state  a CTA per (32 columns of the state, value head, sequence), the chunks in order: the
//          state's columns in shared memory, read once and written once; per chunk v_new (over
//          U in place), the state's part of o -> core, then the state update
//   out    a CTA per (chunk, value head, sequence): core += the chunk's own part of o
// Rows past a sequence's last chunk row are zeros (k, q, v, beta) with the chunk's last gc, so
// no exponent is ever positive. All of it is what the recurrent kernel computes, reordered: the
// two agree to fp32 rounding (tests/cuda/test_gdn_cuda.cpp runs both against the CPU).
#include <cuda_runtime.h>

#include <type_traits>

#include "core/error.h"
#include "ops/cuda/act_types.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gated_deltanet_common.cuh"
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {

namespace gdn {

namespace {

constexpr int kC = 64;           // rows per chunk
constexpr int kThreads = 256;    // every kernel's block
constexpr int kMaxDv = 128;      // value head sizes the chunk tiles hold
constexpr int kLd = kMaxDv + 4;  // row stride (floats) of the wy and out kernels' [64][<= 128] tiles (16-byte rows)
constexpr int kLdT = kC + 1;     // row stride of a [64][64] matrix
constexpr int kTile = 32;        // state columns per CTA of the state kernel
constexpr int kLdS = kTile + 4;  // row stride there of the state tile and of v_new (16-byte rows)

struct Scratch {
  float* g;     // [T][H]: g, then (from the wy kernel on) the cumulative log decay within the row's chunk
  float* beta;  // [T][H]
  float* w;     // [T][H][dk]
  float* u;     // [T][H][dv]: U, then (from the state kernel on) v_new
};

Scratch scratch_of(const GatedDeltaNetParams& p) {
  const size_t th = size_t(p.num_tokens) * size_t(p.v_heads);
  return {p.scratch, p.scratch + th, p.scratch + 2 * th, p.scratch + 2 * th + th * size_t(p.dk)};
}

// The chunk blockIdx.x of sequence blockIdx.z: its first row in the step and its rows (<= 64).
// False when the sequence has fewer chunks.
struct Chunk {
  int r0, rows;
};
__device__ __forceinline__ bool chunk_of(const GatedDeltaNetParams& p, Chunk& c) {
  const int s = int(blockIdx.z), start = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - start, c0 = int(blockIdx.x) * kC;
  if (c0 >= n) return false;
  c = {start + c0, min(kC, n - c0)};
  return true;
}

// The chunk's gc into gc[64] (rows past it: the last row's), for a kernel after wy.
__device__ __forceinline__ void load_gc(const Scratch& sc, int H, int h, const Chunk& c, float* gc) {
  const int t = int(threadIdx.x);
  if (t < kC) gc[t] = sc.g[size_t(c.r0 + min(t, c.rows - 1)) * size_t(H) + size_t(h)];
}

// A chunk's [64][COLS] block of a row-major array staged through registers: load() issues every
// load before any is used (one memory latency for the tile, not one per loop trip), store()
// writes the tile at stride LD. Rows past `rows` and columns past `cols` are zeros; row i
// starts at src + i ld.
template <int COLS>
struct Rows {
  static constexpr int kN = kC * COLS / kThreads;
  static_assert(kN * kThreads == kC * COLS, "a tile's values split evenly over the threads");
  float v[kN];
  __device__ __forceinline__ void load(const float* src, size_t ld, int rows, int cols) {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const int idx = int(threadIdx.x) + k * kThreads, i = idx / COLS, e = idx % COLS;
      v[k] = i < rows && e < cols ? src[size_t(i) * ld + size_t(e)] : 0.0f;
    }
  }
  template <int LD>
  __device__ __forceinline__ void store(float* tile) const {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const int idx = int(threadIdx.x) + k * kThreads;
      tile[(idx / COLS) * LD + idx % COLS] = v[k];
    }
  }
};

// out[i][j] = rs_i (x_i . y_j) exp(gc_i - gc_j) for j < i (kStrict) or j <= i, else 0: x, y
// [64][DK] at stride kLd, out at kLdT; rs null for 1. A 4 x 4 block per thread (rows 4 ti + a,
// columns tj + 16 b), 4 values of each row a float4: x's are a warp's broadcasts, y's 16 rows
// take the two wavefronts their 256 bytes need.
template <int DK, bool kStrict>
__device__ __forceinline__ void gram(const float* x, const float* y, const float* gc, const float* rs, float* out) {
  const int t = int(threadIdx.x), ti = t / 16, tj = t % 16;
  float acc[4][4] = {};
#pragma unroll 2
  for (int e = 0; e < DK; e += 4) {
    float4 xa[4], yb[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) xa[a] = *reinterpret_cast<const float4*>(x + (4 * ti + a) * kLd + e);
#pragma unroll
    for (int b = 0; b < 4; ++b) yb[b] = *reinterpret_cast<const float4*>(y + (tj + 16 * b) * kLd + e);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        acc[a][b] += xa[a].x * yb[b].x + xa[a].y * yb[b].y + xa[a].z * yb[b].z + xa[a].w * yb[b].w;
  }
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int i = 4 * ti + a, j = tj + 16 * b;
      const bool keep = kStrict ? j < i : j <= i;
      out[i * kLdT + j] = keep ? (rs ? rs[i] : 1.0f) * acc[a][b] * expf(gc[i] - gc[j]) : 0.0f;
    }
}

// out[i][c] = (or +=, kAdd) sum_{j <= i} m[i][j] v[j][c] for i < rows, c < cols <= 32 NQ: m
// [64][64] at kLdT, zero above the diagonal; v [64][32 NQ] at kLd, zero past `rows`; row i of
// out at out + i ld. A warp: rows 8 ti .. 8 ti + 7 (m read as a broadcast; j stops at the last
// of them), columns te + 32 q.
template <int NQ, bool kAdd>
__device__ __forceinline__ void tri_matmul(const float* m, const float* v, int rows, int cols, float* out, size_t ld) {
  const int t = int(threadIdx.x), ti = t / 32, te = t % 32;
  float acc[8][NQ] = {};
  const int jn = min(rows, 8 * ti + 8);
  for (int j = 0; j < jn; ++j) {
    float mv[8], vv[NQ];
#pragma unroll
    for (int a = 0; a < 8; ++a) mv[a] = m[(8 * ti + a) * kLdT + j];
#pragma unroll
    for (int q = 0; q < NQ; ++q) vv[q] = v[j * kLd + te + 32 * q];
#pragma unroll
    for (int a = 0; a < 8; ++a)
#pragma unroll
      for (int q = 0; q < NQ; ++q) acc[a][q] += mv[a] * vv[q];
  }
#pragma unroll
  for (int a = 0; a < 8; ++a) {
    const int i = 8 * ti + a;
    if (i >= rows) continue;
#pragma unroll
    for (int q = 0; q < NQ; ++q) {
      const int c = te + 32 * q;
      if (c >= cols) continue;
      float* o = out + size_t(i) * ld + size_t(c);
      *o = kAdd ? *o + acc[a][q] : acc[a][q];
    }
  }
}

// One merge step of the blocked inverse: T's diagonal blocks of N are inverses already; for each
// pair of them (A^-1 above, D^-1 below, C = B's block beside D), T's block beside D^-1 becomes
// -D^-1 (C A^-1). xm holds C A^-1 (rows R.., columns 0..N).
template <int N>
__device__ __forceinline__ void merge(const float* bm, float* tm, float* xm) {
  constexpr int kOut = (kC / (2 * N)) * N * N;
  for (int o = int(threadIdx.x); o < kOut; o += kThreads) {
    const int R = 2 * N * (o / (N * N)), ii = (o / N) % N, jj = o % N;
    float s = 0.0f;
    for (int m = jj; m < N; ++m) s += bm[(R + N + ii) * kLdT + R + m] * tm[(R + m) * kLdT + R + jj];
    xm[(R + ii) * kLdT + jj] = s;
  }
  __syncthreads();
  for (int o = int(threadIdx.x); o < kOut; o += kThreads) {
    const int R = 2 * N * (o / (N * N)), ii = (o / N) % N, jj = o % N;
    float s = 0.0f;
    for (int m = 0; m <= ii; ++m) s += tm[(R + N + ii) * kLdT + R + N + m] * xm[(R + m) * kLdT + jj];
    tm[(R + N + ii) * kLdT + R + jj] = -s;
  }
  __syncthreads();
}

template <class A, int DK>
__global__ void __launch_bounds__(kThreads) prep_kernel(const GatedDeltaNetParams p, const Dims d, const Scratch sc) {
  const int64_t item = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  if (item >= int64_t(p.num_tokens) * p.k_heads) return;
  const int lane = int(threadIdx.x % 32), kh = int(item % p.k_heads);
  const size_t r = size_t(item / p.k_heads);
  float* q = p.qkv + r * size_t(d.cd) + size_t(kh) * DK;
  float* k = q + d.kd;
  NormedQk<DK>(q, k, lane).store(q, k, lane);
  const int ratio = p.v_heads / p.k_heads;
  const uint16_t* mrow = static_cast<const uint16_t*>(p.mixed) + r * size_t(d.in_dim) + size_t(d.cd + d.vd);
  for (int j = lane; j < ratio; j += 32) {
    const int h = kh * ratio + j;
    const size_t at = r * size_t(p.v_heads) + size_t(h);
    sc.beta[at] = sigmoidf(A::load(mrow[h]));
    sc.g[at] = log_decay(-expf(p.a_log[h]), A::load(mrow[p.v_heads + h]), p.dt_bias[h]);
  }
}

constexpr int kWySmem = (kC * kLd + 3 * kC * kLdT + 2 * kC) * int(sizeof(float));

template <int DK>
__global__ void __launch_bounds__(kThreads, 2) wy_kernel(const GatedDeltaNetParams p, const Dims d, const Scratch sc) {
  constexpr int KW = (DK + 31) / 32 * 32;  // the columns tri_matmul reads
  Chunk c;
  if (!chunk_of(p, c)) return;
  extern __shared__ float4 wy_smem[];
  float* kv = reinterpret_cast<float*>(wy_smem);  // [64][kLd]: k, then beta exp(gc) k, then beta v
  float* bm = kv + kC * kLd;                      // [64][kLdT]: B
  float* tm = bm + kC * kLdT;                     // [64][kLdT]: T = (I + B)^-1
  float* xm = tm + kC * kLdT;                     // [64][kLdT]: the merges' products
  float* gc = xm + kC * kLdT;                     // [64]
  float* bs = gc + kC;                            // [64]: beta
  const int t = int(threadIdx.x), h = int(blockIdx.y), H = p.v_heads, kh = h / (H / p.k_heads);
  if (t < kC) {  // gc: an inclusive scan of g over each warp's 32 rows (rows past the chunk add 0) ...
    const size_t at = size_t(c.r0 + t) * size_t(H) + size_t(h);
    float g = t < c.rows ? sc.g[at] : 0.0f;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_up_sync(0xffffffffu, g, o);
      if ((t & 31) >= o) g += y;
    }
    gc[t] = g;
    bs[t] = t < c.rows ? sc.beta[at] : 0.0f;
  }
  {
    Rows<KW> k;
    k.load(p.qkv + size_t(c.r0) * size_t(d.cd) + size_t(d.kd + kh * DK), size_t(d.cd), c.rows, DK);
    k.store<kLd>(kv);
  }
  for (int idx = t; idx < kC * kLdT; idx += kThreads) tm[idx] = 0.0f;
  __syncthreads();
  if (t >= 32 && t < kC) gc[t] += gc[31];  // ... and the second warp's rows carry the first's sum
  __syncthreads();
  if (t < c.rows) sc.g[size_t(c.r0 + t) * size_t(H) + size_t(h)] = gc[t];
  gram<DK, true>(kv, kv, gc, bs, bm);
  __syncthreads();
  if (t < kC) {  // the diagonal blocks of T, a thread per column of one
    const int b0 = (t / 16) * 16, jj = t % 16;
    float x[16];
#pragma unroll
    for (int ii = 0; ii < 16; ++ii) {
      float v = ii == jj ? 1.0f : 0.0f;
#pragma unroll
      for (int m = 0; m < ii; ++m) v -= bm[(b0 + ii) * kLdT + b0 + m] * x[m];
      x[ii] = v;
    }
#pragma unroll
    for (int ii = 0; ii < 16; ++ii) tm[(b0 + ii) * kLdT + b0 + jj] = x[ii];
  }
  __syncthreads();
  merge<16>(bm, tm, xm);
  merge<32>(bm, tm, xm);
  for (int idx = t; idx < kC * DK; idx += kThreads) {
    const int i = idx / DK;
    kv[i * kLd + idx % DK] *= bs[i] * expf(gc[i]);
  }
  __syncthreads();
  tri_matmul<KW / 32, false>(tm, kv, c.rows, DK, sc.w + (size_t(c.r0) * size_t(H) + size_t(h)) * DK, size_t(H) * DK);
  __syncthreads();
  {
    Rows<kMaxDv> v;
    v.load(p.qkv + size_t(c.r0) * size_t(d.cd) + size_t(2 * d.kd + h * p.dv), size_t(d.cd), c.rows, p.dv);
    v.store<kLd>(kv);
  }
  __syncthreads();
  for (int idx = t; idx < kC * kMaxDv; idx += kThreads) kv[(idx / kMaxDv) * kLd + idx % kMaxDv] *= bs[idx / kMaxDv];
  __syncthreads();
  tri_matmul<kMaxDv / 32, false>(tm, kv, c.rows, p.dv, sc.u + (size_t(c.r0) * size_t(H) + size_t(h)) * size_t(p.dv),
                                 size_t(H) * size_t(p.dv));
}

template <int DK>
constexpr int state_smem() {
  return (2 * kC * (DK + 4) + DK * kLdS + 2 * kC * kLdS + kC) * int(sizeof(float));  // 104 KB at 128: 2 CTAs an SM
}

// The chunks of one sequence in order, for 32 columns of one value head's state. Per chunk:
// gc, W, q and the U tile in (one batch of loads); phase A, a thread per row i = t / 4 and 8
// columns from cj = 8 (t % 4): v_new = U - W S and the state's part of o = exp(gc_i) q_i S, the
// W / q rows at stride DK + 4 (a warp's 8 rows in 8 banks) and the state tile's row e as two
// float4 broadcasts; v_new and o out through tiles (coalesced), k in over W; phase B, state
// rows t / 4 + 64 m and the same columns: exp(gc_last) S + k^T (exp(gc_last - gc) v_new).
template <class S, int DK>
__global__ void __launch_bounds__(kThreads, 1) state_kernel(const GatedDeltaNetParams p, const Dims d, const Scratch sc) {
  constexpr int kLdW = DK + 4;
  extern __shared__ float4 state_smem_raw[];
  float* ws = reinterpret_cast<float*>(state_smem_raw);  // [64][kLdW]: W, then k
  float* qs = ws + kC * kLdW;                            // [64][kLdW]: q
  float* st = qs + kC * kLdW;                            // [DK][kLdS]: the state's columns col0..
  float* vn = st + DK * kLdS;                            // [64][kLdS]: exp(gc_last - gc) v_new
  float* uo = vn + kC * kLdS;                            // [64][kLdS]: U, then v_new, then the state's part of o
  float* gc = uo + kC * kLdS;                            // [64]
  const int t = int(threadIdx.x), s = int(blockIdx.z), h = int(blockIdx.y), H = p.v_heads, kh = h / (H / p.k_heads);
  const int dv = p.dv, col0 = int(blockIdx.x) * kTile;
  const int r0 = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - r0, slot = p.state_slots[s];
  const bool fresh = p.kv_lens[s] == n;
  using T = typename S::T;
  T* state = slot >= 0 ? reinterpret_cast<T*>(p.states + size_t(slot) * p.state_bytes + d.conv_n * sizeof(float)) +
                             size_t(h) * DK * size_t(dv)
                       : nullptr;
  for (int idx = t; idx < DK * kTile; idx += kThreads) {
    const int e = idx / kTile, j = idx % kTile, col = col0 + j;
    st[e * kLdS + j] = state && !fresh && col < dv ? S::load(state[size_t(e) * size_t(dv) + size_t(col)]) : 0.0f;
  }
  const int ai = t / 4, cj = (t % 4) * 8;
  const size_t ld_u = size_t(H) * size_t(dv);
  Rows<DK> w, q;
  Rows<kTile> u;
  for (int c0 = 0; c0 < n; c0 += kC) {
    const Chunk c{r0 + c0, min(kC, n - c0)};
    const float* q0 = p.qkv + size_t(c.r0) * size_t(d.cd) + size_t(kh) * DK;
    float* u0 = sc.u + (size_t(c.r0) * size_t(H) + size_t(h)) * size_t(dv) + size_t(col0);
    w.load(sc.w + (size_t(c.r0) * size_t(H) + size_t(h)) * DK, size_t(H) * DK, c.rows, DK);
    q.load(q0, size_t(d.cd), c.rows, DK);
    u.load(u0, ld_u, c.rows, dv - col0);
    const float g = t < kC ? sc.g[size_t(c.r0 + min(t, c.rows - 1)) * size_t(H) + size_t(h)] : 0.0f;
    __syncthreads();  // the previous chunk is done with the tiles
    w.store<kLdW>(ws);
    q.store<kLdW>(qs);
    u.store<kLdS>(uo);
    if (t < kC) gc[t] = g;
    __syncthreads();
    const float glast = gc[kC - 1];
    {
      float av[8] = {}, ao[8] = {};
#pragma unroll 4
      for (int e = 0; e < DK; ++e) {
        const float wv = ws[ai * kLdW + e], qv = qs[ai * kLdW + e];
        const float4 s0 = *reinterpret_cast<const float4*>(st + e * kLdS + cj);
        const float4 s1 = *reinterpret_cast<const float4*>(st + e * kLdS + cj + 4);
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          av[j] += wv * sv[j];
          ao[j] += qv * sv[j];
        }
      }
      // Rows past the chunk and columns past dv: U and W are 0 there, so v_new is too.
      const float eq = expf(gc[ai]), ek = expf(glast - gc[ai]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float* x = uo + ai * kLdS + cj + j;
        const float v = *x - av[j];
        vn[ai * kLdS + cj + j] = ek * v;
        x[0] = v;  // v_new until it is out, then o
        av[j] = eq * ao[j];
      }
      Rows<DK> k;  // k in flight while v_new goes out
      k.load(q0 + d.kd, size_t(d.cd), c.rows, DK);
      __syncthreads();
      for (int idx = t; idx < kC * kTile; idx += kThreads) {
        const int i = idx / kTile, j = idx % kTile;
        if (i < c.rows && col0 + j < dv) u0[size_t(i) * ld_u + size_t(j)] = uo[i * kLdS + j];
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < 8; ++j) uo[ai * kLdS + cj + j] = av[j];
      k.store<kLdW>(ws);
      __syncthreads();
    }
    float* o0 = p.core + size_t(c.r0) * size_t(d.vd) + size_t(h) * size_t(dv) + size_t(col0);
    for (int idx = t; idx < kC * kTile; idx += kThreads) {
      const int i = idx / kTile, j = idx % kTile;
      if (i < c.rows && col0 + j < dv) o0[size_t(i) * size_t(d.vd) + size_t(j)] = uo[i * kLdS + j];
    }
    const float el = expf(glast);
    for (int e = ai; e < DK; e += kC) {
      float acc[8];
      {
        const float4 s0 = *reinterpret_cast<const float4*>(st + e * kLdS + cj);
        const float4 s1 = *reinterpret_cast<const float4*>(st + e * kLdS + cj + 4);
        const float sv[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] = el * sv[j];
      }
#pragma unroll 4
      for (int i = 0; i < c.rows; ++i) {
        const float kv = ws[i * kLdW + e];
        const float4 v0 = *reinterpret_cast<const float4*>(vn + i * kLdS + cj);
        const float4 v1 = *reinterpret_cast<const float4*>(vn + i * kLdS + cj + 4);
        const float vv[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += kv * vv[j];
      }
      *reinterpret_cast<float4*>(st + e * kLdS + cj) = make_float4(acc[0], acc[1], acc[2], acc[3]);
      *reinterpret_cast<float4*>(st + e * kLdS + cj + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
    }
  }
  __syncthreads();
  if (state)
    for (int idx = t; idx < DK * kTile; idx += kThreads) {
      const int e = idx / kTile, j = idx % kTile, col = col0 + j;
      if (col < dv) state[size_t(e) * size_t(dv) + size_t(col)] = S::store(st[e * kLdS + j]);
    }
}

constexpr int kOutSmem = (2 * kC * kLd + kC * kLdT + kC) * int(sizeof(float));

template <int DK>
__global__ void __launch_bounds__(kThreads, 2) out_kernel(const GatedDeltaNetParams p, const Dims d, const Scratch sc) {
  Chunk c;
  if (!chunk_of(p, c)) return;
  extern __shared__ float4 out_smem[];
  float* qs = reinterpret_cast<float*>(out_smem);  // [64][kLd]: q
  float* kv = qs + kC * kLd;                       // [64][kLd]: k, then v_new
  float* pm = kv + kC * kLd;                       // [64][kLdT]: (q_i . k_j) exp(gc_i - gc_j), j <= i
  float* gc = pm + kC * kLdT;                      // [64]
  const int h = int(blockIdx.y), H = p.v_heads, kh = h / (H / p.k_heads);
  load_gc(sc, H, h, c, gc);
  {
    const float* q0 = p.qkv + size_t(c.r0) * size_t(d.cd) + size_t(kh) * DK;
    Rows<DK> x;  // q, then k (both at once would not leave two CTAs an SM their registers)
    x.load(q0, size_t(d.cd), c.rows, DK);
    x.store<kLd>(qs);
    x.load(q0 + d.kd, size_t(d.cd), c.rows, DK);
    x.store<kLd>(kv);
  }
  __syncthreads();
  gram<DK, false>(qs, kv, gc, nullptr, pm);
  __syncthreads();
  {
    Rows<kMaxDv> v;
    v.load(sc.u + (size_t(c.r0) * size_t(H) + size_t(h)) * size_t(p.dv), size_t(H) * size_t(p.dv), c.rows, p.dv);
    v.store<kLd>(kv);
  }
  __syncthreads();
  tri_matmul<kMaxDv / 32, true>(pm, kv, c.rows, p.dv, p.core + size_t(c.r0) * size_t(d.vd) + size_t(h) * size_t(p.dv),
                                size_t(d.vd));
}

// Opts Kernel in to `bytes` of dynamic shared memory, once per device.
template <auto Kernel>
void opt_in(int bytes) {
  static PerDevice<bool> done;
  done.get([bytes] {
    KVLM_CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  });
}

}  // namespace

void delta_rule_chunked(const GatedDeltaNetParams& p, const Dims& d, int max_q, cudaStream_t st) {
  const Scratch sc = scratch_of(p);
  const unsigned chunks = unsigned((max_q + kC - 1) / kC);
  const dim3 chunk_grid(chunks, unsigned(p.v_heads), unsigned(p.num_seqs));
  const dim3 state_grid(unsigned((p.dv + kTile - 1) / kTile), unsigned(p.v_heads), unsigned(p.num_seqs));
  act::dispatch(p.act, "gated_delta_net", [&](auto a) {
    using A = decltype(a);
    const auto run = [&](auto dk) {
      constexpr int DK = decltype(dk)::value;
      const int64_t items = int64_t(p.num_tokens) * p.k_heads;
      prep_kernel<A, DK><<<unsigned((items + kThreads / 32 - 1) / (kThreads / 32)), kThreads, 0, st>>>(p, d, sc);
      KVLM_CUDA_CHECK_LAUNCH("gated_delta_net prep_kernel");
      opt_in<wy_kernel<DK>>(kWySmem);
      wy_kernel<DK><<<chunk_grid, kThreads, kWySmem, st>>>(p, d, sc);
      KVLM_CUDA_CHECK_LAUNCH("gated_delta_net wy_kernel");
      constexpr int kStateSmem = state_smem<DK>();
      if (p.state_dtype == DType::BF16) {
        opt_in<state_kernel<StateBF16, DK>>(kStateSmem);
        state_kernel<StateBF16, DK><<<state_grid, kThreads, kStateSmem, st>>>(p, d, sc);
      } else {
        opt_in<state_kernel<StateF32, DK>>(kStateSmem);
        state_kernel<StateF32, DK><<<state_grid, kThreads, kStateSmem, st>>>(p, d, sc);
      }
      KVLM_CUDA_CHECK_LAUNCH("gated_delta_net state_kernel");
      opt_in<out_kernel<DK>>(kOutSmem);
      out_kernel<DK><<<chunk_grid, kThreads, kOutSmem, st>>>(p, d, sc);
      KVLM_CUDA_CHECK_LAUNCH("gated_delta_net out_kernel");
    };
    switch (p.dk) {
      case 16: run(std::integral_constant<int, 16>{}); break;
      case 32: run(std::integral_constant<int, 32>{}); break;
      case 64: run(std::integral_constant<int, 64>{}); break;
      default: run(std::integral_constant<int, 128>{}); break;
    }
  });
}

}  // namespace gdn

bool gated_delta_net_chunk_fits(int dk, int dv) {
  return (dk == 16 || dk == 32 || dk == 64 || dk == 128) && dv >= 1 && dv <= gdn::kMaxDv;
}

bool gated_delta_net_takes_chunks(int num_tokens, int max_q_len, int dk, int dv) {
  return gated_delta_net_chunk_fits(dk, dv) && max_q_len >= kGatedDeltaNetChunkedRows &&
         int64_t(num_tokens) < 5 * int64_t(max_q_len);
}

size_t gated_delta_net_scratch_floats(int num_tokens, int max_q_len, int v_heads, int dk, int dv) {
  if (!gated_delta_net_takes_chunks(num_tokens, max_q_len, dk, dv)) return 0;
  return size_t(num_tokens) * size_t(v_heads) * size_t(2 + dk + dv);
}

}  // namespace kvlm::cuda

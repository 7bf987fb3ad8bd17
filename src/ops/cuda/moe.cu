// The mixture-of-experts kernels (moe.h): route, sort, the expert GEMV (decode batches), the
// grouped expert GEMM, glu, combine.
//
// The grouped GEMM, C[pair][n] = A[row(pair)] . B[expert][n]^T (+ bias[expert][n]): a CTA of
// 4 warps takes one 16-row tile of one expert's pairs and 64 output columns (16 per warp, two
// m16n8k16 fragments; batches with fewer than 8 pairs per expert: 32 columns, one fragment,
// more loads in flight). Each lane streams the expert's weight rows with 16-byte loads, 8
// consecutive k of one row n: for the mma, k is permuted inside each 32-wide chunk (logical
// k 2t, 2t+1 of step s are physical 8t + 4s, +1; 2t+8, 2t+9 are 8t + 4s + 2, +3), the same
// permutation on A, so the sum is the same and every weight byte arrives in a full 16-byte
// load. A's 16 rows (gathered token rows, zero past the tile's pairs) sit in shared memory,
// a chunk of K at a time. A small batch's tiles hold a row or a few: the weights stream at
// memory speed and each routed expert's weights are read once. Batches with at least 48 pairs
// per expert (prefill) take the wide grouped GEMM instead: tiles of 128 pairs by 128 columns
// through a cp.async pipeline and ldmatrix, each weight tile read once per 128 pairs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <string>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "ops/cuda/act_types.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/moe.h"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kTileRows = 16;    // pairs per CTA tile (one m16 fragment)
// Prefill-sized batches (at least kWideMinPairs pairs per held expert on average) take tiles of
// kWideRows pairs: the wide grouped GEMM below, whose CTA reads each weight tile once for 128
// pairs instead of 16.
constexpr int kWideRows = 128;
constexpr int kWideMinPairs = 48;
constexpr int kChunkK = 512;     // A's columns staged in shared memory at a time
constexpr int kAStride = kChunkK + 8;  // halves per staged row (+16 bytes against bank conflicts)
constexpr int kMaxExperts = 1024;
// Batches of at most this many rows take the expert GEMV (below); from 8 rows its FMA work per
// weight made it slower than the grouped GEMM (H200, the Qwen3-30B-A3B shape: 8 rows 295 us
// against 182; 4-5 rows about even, 133 and 138 us). Prefetching a warp's next item into L2
// while its current loads are in flight made 1 row slower (40.7 -> 44.5 us): not done.
constexpr int kGemvMaxRows = 4;
constexpr int kGemvWarps = 8;
constexpr int kGemvMaxTiles = kGemvMaxRows * 16;  // top_k <= 16: the pairs of a GEMV batch at most

template <class F>
void dispatch_act(DType act, F&& f) {
  act::dispatch(act, "CUDA MoE kernels", std::forward<F>(f));
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The pairs in expert order, cut into tiles of at most kTileRows pairs of one expert (written
// by the sort; a decode batch's tiles are its routed experts, one each).
struct Tiles {
  int32_t* expert = nullptr;  // the tile's expert
  int32_t* first = nullptr;   // its first position
  int32_t* count = nullptr;   // its pairs, 1..kTileRows (1..kWideRows for the wide GEMM's tiles)
  int32_t* n = nullptr;       // [1] the tiles
  // The experts whose tiles a grouped GEMM launch takes, its weights starting at e_begin's
  // (experts held as codes are dequantized a run of experts at a time).
  int e_begin = 0, e_end = INT_MAX;
};

// Tiles the sort can make: at most one partial tile per expert that has pairs, and no more
// experts with pairs than pairs.
int max_tiles(int rows, int experts, int top_k, int tile_rows = kTileRows) {
  const int P = rows * top_k;
  return (P + tile_rows - 1) / tile_rows + std::min(experts, P);
}

// The workspace, carved in this order.
struct Workspace {
  int32_t* ids;          // [T * K] expert of each pair (row-major: row t's k-th choice)
  float* weights;        // [T * K]
  int32_t* pair_of;      // [T * K] the pair's position in expert order
  int32_t* pair_row;     // [P] the token row of the pair at each position
  Tiles tiles;           // [max_tiles] each, and the count
  uint16_t* gu;          // act [P][2I]
  uint16_t* h;           // act [P][I]
  uint16_t* out;         // act [P][H]
  uint16_t* deq;         // act, experts held as codes on the wide path: a run of them dequantized
};

// Experts held as codes, on the wide path: how many are dequantized at a time (about 256 MiB of
// gate/up in the compute type, at least one), and whether a batch may take that path at all
// (at least kWideMinPairs pairs for one held expert).
int int_chunk_experts(int hidden, int inter, int experts) {
  const size_t per = size_t(2 * inter) * size_t(hidden) * 2;
  return int(std::clamp<size_t>((size_t(256) << 20) / per, 1, size_t(experts)));
}
bool may_take_wide(int rows, int top_k) { return size_t(rows) * size_t(top_k) >= size_t(kWideMinPairs); }

Workspace carve(void* base, DType act, int rows, int hidden, int inter, int experts, int top_k, bool int_experts) {
  (void)act;
  auto* p = static_cast<uint8_t*>(base);
  const size_t P = size_t(rows) * size_t(top_k);
  Workspace w{};
  auto take = [&](size_t bytes) {
    void* r = p;
    p += align256(bytes);
    return r;
  };
  w.ids = static_cast<int32_t*>(take(P * 4));
  w.weights = static_cast<float*>(take(P * 4));
  w.pair_of = static_cast<int32_t*>(take(P * 4));
  w.pair_row = static_cast<int32_t*>(take(P * 4));
  const size_t tiles = max_tiles(rows, experts, top_k);
  w.tiles.expert = static_cast<int32_t*>(take(tiles * 4));
  w.tiles.first = static_cast<int32_t*>(take(tiles * 4));
  w.tiles.count = static_cast<int32_t*>(take(tiles * 4));
  w.tiles.n = static_cast<int32_t*>(take(4));
  w.gu = static_cast<uint16_t*>(take(P * size_t(2 * inter) * 2));
  w.h = static_cast<uint16_t*>(take(P * size_t(inter) * 2));
  w.out = static_cast<uint16_t*>(take(P * size_t(hidden) * 2));
  w.deq = int_experts && may_take_wide(rows, top_k)
              ? static_cast<uint16_t*>(take(size_t(int_chunk_experts(hidden, inter, experts)) * size_t(2 * inter) *
                                            size_t(hidden) * 2))
              : nullptr;
  return w;
}

// One warp per row: the top k experts by logit (+ bias), in descending order, lower index
// first on ties, and their weights. Each lane holds its experts' logits (lane + 32 j) in
// registers and a bitmask of those already taken; a round is a lane's best untaken, then a
// warp argmax. Lane k keeps the k-th choice, so nothing is indexed by a runtime value (no
// local memory).
template <class A>
__device__ void route_row(const float* __restrict__ logits, const uint16_t* __restrict__ bias, int row, int experts,
                          int top_k, bool norm_topk, int32_t* __restrict__ ids, float* __restrict__ weights) {
  constexpr int kPer = kMaxExperts / 32;
  const int lane = int(threadIdx.x) % 32;
  const float* l = logits + size_t(row) * size_t(experts);
  float v[kPer];
  uint32_t taken = 0;  // bit j: expert lane + 32 j is chosen or does not exist
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = lane + 32 * j;
    v[j] = e < experts ? l[e] + (bias ? A::load(bias[e]) : 0.0f) : 0.0f;
    if (e >= experts) taken |= 1u << j;
  }
  int mine = 0;        // lane k < top_k: the k-th choice
  float mine_v = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    float best = -INFINITY;
    int best_j = -1;
#pragma unroll
    for (int j = 0; j < kPer; ++j)  // ascending j: the lower index wins a tie within the lane
      if (!(taken >> j & 1u) && (best_j < 0 || v[j] > best)) {
        best = v[j];
        best_j = j;
      }
    int best_e = best_j < 0 ? INT_MAX : lane + 32 * best_j;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (oe != INT_MAX && (best_e == INT_MAX || ov > best || (ov == best && oe < best_e))) {
        best = ov;
        best_e = oe;
      }
    }
    if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
    if (lane == k) {
      mine = best_e;
      mine_v = best;
    }
  }
  const float mx = __shfl_sync(0xffffffffu, mine_v, 0);
  float sum = 0.0f;
  if (norm_topk) {
    sum = lane < top_k ? expf(mine_v - mx) : 0.0f;
  } else {
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (lane + 32 * j < experts) sum += expf(v[j] - mx);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (lane < top_k) {
    ids[size_t(row) * size_t(top_k) + size_t(lane)] = mine;
    weights[size_t(row) * size_t(top_k) + size_t(lane)] = expf(mine_v - mx) / sum;
  }
}

template <class A>
__global__ void route_kernel(const float* __restrict__ logits, const uint16_t* __restrict__ bias, int rows, int experts,
                             int top_k, bool norm_topk, int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int warp = int(blockIdx.x) * (blockDim.x / 32) + int(threadIdx.x) / 32;
  if (warp < rows) route_row<A>(logits, bias, warp, experts, top_k, norm_topk, ids, weights);
}

// Two inclusive prefix sums over the warp's lanes at once.
__device__ __forceinline__ void warp_inclusive_scan(int& x, int& y, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int a = __shfl_up_sync(0xffffffffu, x, o), b = __shfl_up_sync(0xffffffffu, y, o);
    if (lane >= o) {
      x += a;
      y += b;
    }
  }
}

// One CTA: count the pairs of each held expert (global ids [first, first + experts); a pair of
// another rank's expert gets pair_of -1 and no position), the offsets and tile offsets (a
// block-wide scan: each thread a run of consecutive experts, then warp scans), then place each
// pair (positions within an expert follow atomics: any order gives each pair the same result,
// as the GEMM's rows are independent). Tiles name held experts (0-based).
__device__ void sort_pairs(const int32_t* __restrict__ ids, int pairs, int first, int experts, int top_k,
                           int32_t* __restrict__ pair_of, int32_t* __restrict__ pair_row, Tiles tl, int tile_rows) {
  __shared__ int count[kMaxExperts], cursor[kMaxExperts];
  __shared__ int warp_pairs[32], warp_tiles[32];
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32, warps = int(blockDim.x) / 32;
  for (int e = tid; e < experts; e += int(blockDim.x)) count[e] = 0;
  __syncthreads();
  for (int p = tid; p < pairs; p += int(blockDim.x))
    if (const int e = ids[p] - first; e >= 0 && e < experts) atomicAdd(&count[e], 1);
  __syncthreads();
  const int per = (experts + int(blockDim.x) - 1) / int(blockDim.x), e0 = tid * per;
  int my_pairs = 0, my_tiles = 0;
  for (int e = e0; e < min(e0 + per, experts); ++e) {
    my_pairs += count[e];
    my_tiles += (count[e] + tile_rows - 1) / tile_rows;
  }
  int inc_pairs = my_pairs, inc_tiles = my_tiles;  // inclusive scans within the warp
  warp_inclusive_scan(inc_pairs, inc_tiles, lane);
  if (lane == 31) {
    warp_pairs[warp] = inc_pairs;
    warp_tiles[warp] = inc_tiles;
  }
  __syncthreads();
  if (warp == 0) {
    int wp = lane < warps ? warp_pairs[lane] : 0, wt = lane < warps ? warp_tiles[lane] : 0;
    warp_inclusive_scan(wp, wt, lane);
    if (lane < warps) {
      warp_pairs[lane] = wp;
      warp_tiles[lane] = wt;
    }
  }
  __syncthreads();
  int at = inc_pairs - my_pairs + (warp > 0 ? warp_pairs[warp - 1] : 0);
  int tiles = inc_tiles - my_tiles + (warp > 0 ? warp_tiles[warp - 1] : 0);
  for (int e = e0; e < min(e0 + per, experts); ++e) {
    cursor[e] = at;
    for (int r = 0; r < count[e]; r += tile_rows, ++tiles) {
      tl.expert[tiles] = e;
      tl.first[tiles] = at + r;
      tl.count[tiles] = min(tile_rows, count[e] - r);
    }
    at += count[e];
  }
  if (tid == 0) *tl.n = warp_tiles[warps - 1];
  __syncthreads();
  for (int p = tid; p < pairs; p += int(blockDim.x)) {
    const int e = ids[p] - first;
    if (e < 0 || e >= experts) {
      pair_of[p] = -1;  // another rank's expert (expert parallelism)
      continue;
    }
    const int pos = atomicAdd(&cursor[e], 1);
    pair_of[p] = pos;
    pair_row[pos] = p / top_k;
  }
}

__global__ void sort_kernel(const int32_t* __restrict__ ids, int pairs, int first, int held, int top_k,
                            int32_t* __restrict__ pair_of, int32_t* __restrict__ pair_row, Tiles tiles, int tile_rows) {
  sort_pairs(ids, pairs, first, held, top_k, pair_of, pair_row, tiles, tile_rows);
}

// Both in one CTA, for batches of at most kGemvMaxRows rows (a warp per row): one launch
// where a decode step had two. Launched with PDL: the logits are the router GEMM's output.
template <class A>
__global__ void route_sort_kernel(const float* __restrict__ logits, const uint16_t* __restrict__ bias, int rows, int experts,
                                  int top_k, bool norm_topk, int first, int held, int32_t* __restrict__ ids,
                                  float* __restrict__ weights, int32_t* __restrict__ pair_of,
                                  int32_t* __restrict__ pair_row, Tiles tiles) {
  pdl_wait();
  allow_dependents();  // one CTA: the expert GEMV's CTAs may launch now and wait for this one
  const int warp = int(threadIdx.x) / 32;
  if (warp < rows) route_row<A>(logits, bias, warp, experts, top_k, norm_topk, ids, weights);
  __syncthreads();  // the ids, in global memory, are visible to the whole CTA past the barrier
  sort_pairs(ids, rows * top_k, first, held, top_k, pair_of, pair_row, tiles, kTileRows);
}

// f(gate) * up: SiLU, GPT-OSS's clamped SwiGLU, or GELU (tanh).
__device__ __forceinline__ float glu_value(GluActivation f, float g, float u, float alpha, float limit) {
  if (f == GluActivation::SwigluClamp) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
  }
  if (f == GluActivation::Silu) return g / (1.0f + expf(-g)) * u;
  return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u;
}

// The expert GEMV (batches of at most kGemvMaxRows rows, so at most one 16-row tile per
// expert: a tile is a routed expert): out[pos][n] = a[row(pos)] . W[e][n]^T (+ bias) for the
// pairs at positions [first, first + count) of expert e. An item is R output columns of one
// routed expert; each warp takes items grid-stride (the launch sizes the grid so that every
// warp takes the same number of them: a decode step's experts are few, and a second partial
// wave of CTAs would leave most of the GPU idle), streaming the item's weight rows whole,
// lane by lane 16 bytes at a time, U loads per row in flight (ld.global.nc.L1::no_allocate:
// read once), as gemv.cu's rows kernel streams a dense layer; the activation rows (at most M,
// a few KB) come through L1. With kGlu, W is [2N][K] (gate rows, then up rows): the item
// streams gate row n and up row N + n together and writes f(gate) * up, each rounded to the
// activation dtype first as the grouped path's separate pass rounds them. Everything depends
// on the routing, so the kernel waits for its producer first; it lets the next kernel launch
// once its weights are read.
template <class A, int M, int R, int U, bool kGlu>
__global__ void __launch_bounds__(kGemvWarps * 32) expert_gemv_kernel(
    const uint16_t* __restrict__ a, const int32_t* __restrict__ a_rows, const uint16_t* __restrict__ w,
    const uint16_t* __restrict__ bias, uint16_t* __restrict__ out, int N, int K, int pairs, Tiles tiles,
    GluActivation f, float alpha, float limit) {
  constexpr int S = kGlu ? 2 * R : R;
  using V = std::conditional_t<A::kBF16, VecBF16, VecF16>;
  // The tiles (routed experts) and their rows, staged once per CTA: an item then starts its
  // weight loads with no dependent global load before them.
  __shared__ int s_expert[kGemvMaxTiles], s_first[kGemvMaxTiles], s_count[kGemvMaxTiles];
  __shared__ int s_row[kGemvMaxTiles];  // pairs <= kGemvMaxRows x 16
  pdl_wait();
  const int n_tiles = *tiles.n;
  for (int i = int(threadIdx.x); i < n_tiles; i += int(blockDim.x)) {
    s_expert[i] = tiles.expert[i];
    s_first[i] = tiles.first[i];
    s_count[i] = tiles.count[i];
  }
  if (a_rows)
    for (int i = int(threadIdx.x); i < pairs; i += int(blockDim.x)) s_row[i] = a_rows[i];
  __syncthreads();
  const int lane = int(threadIdx.x) % 32, kv = K / 8;
  const int groups = (N + R - 1) / R, items = n_tiles * groups;
  const size_t rows_e = kGlu ? 2 * size_t(N) : size_t(N);
  const int stride = int(gridDim.x) * kGemvWarps;
  // Weight row s of an item (rows past N: the item's last, loaded and never stored).
  auto row_of = [&](int item, int s) {
    const int n0 = (item % groups) * R, nrows = min(R, N - n0);
    const int row = (s < R ? 0 : N) + n0 + min(s % R, nrows - 1);
    return w + (size_t(s_expert[item / groups]) * rows_e + size_t(row)) * size_t(K);
  };
  const int item0 = int(blockIdx.x) * kGemvWarps + int(threadIdx.x) / 32;
  for (int item = item0; item < items; item += stride) {
    const int tile = item / groups, e = s_expert[tile];
    const int n0 = (item % groups) * R, nrows = min(R, N - n0);
    const int first = s_first[tile], count = min(M, s_count[tile]);
    const uint4* wr[S];
#pragma unroll
    for (int s = 0; s < S; ++s) wr[s] = reinterpret_cast<const uint4*>(row_of(item, s));
    int xrow[M];  // the activation row of each pair
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int pos = first + min(m, count - 1);
      xrow[m] = a_rows ? s_row[pos] : pos;
    }
    float acc[S][M] = {};
    for (int base = lane; base < kv; base += 32 * U) {
      uint4 wv[U][S];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int s = 0; s < S; ++s) wv[u][s] = base + u * 32 < kv ? ld_stream(wr[s] + base + u * 32) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = base + u * 32;
        if (i >= kv) break;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (m >= count) break;
          float xf[8];
          V::decode8(__ldg(reinterpret_cast<const uint4*>(a + size_t(xrow[m]) * size_t(K)) + i), xf);
#pragma unroll
          for (int s = 0; s < S; ++s) {
            float wf[8];
            V::decode8(wv[u][s], wf);
#pragma unroll
            for (int q = 0; q < 8; ++q) acc[s][m] = fmaf(wf[q], xf[q], acc[s][m]);
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= count) break;
#pragma unroll
      for (int s = 0; s < S; ++s)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[s][m] += __shfl_xor_sync(0xffffffffu, acc[s][m], o);
    }
    // Lane j * M + m stores column n0 + j of pair m.
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (lane != (j * M + m) % 32 || j >= nrows || m >= count) continue;
        const int n = n0 + j;
        const uint16_t* be = bias ? bias + size_t(e) * rows_e : nullptr;
        float v = acc[j][m] + (be ? A::load(be[n]) : 0.0f);
        if constexpr (kGlu) {
          const float g = A::load(A::store(v));
          const float u = A::load(A::store(acc[R + j][m] + (be ? A::load(be[N + n]) : 0.0f)));
          v = glu_value(f, g, u, alpha, limit);
        }
        out[size_t(first + m) * size_t(N) + size_t(n)] = A::store(v);
      }
  }
  allow_dependents();  // this CTA's weights are read
}

// The grouped GEMM (top of file). a: act [*][K]; a_rows: the pair's row of a (null: the
// pair's position); b: act [E][N][K]; bias: act [E][N] or null; c: act [P][N]. NF: n8
// fragments per warp (the CTA's columns: 32 NF); KU: 32-wide k steps whose weight loads are
// issued before their mmas (NF x KU 16-byte loads in flight per lane). Decode-sized batches
// take NF 1, KU 8: twice the CTAs and four times the bytes in flight of NF 2, KU 2, which
// prefill tiles (16 real rows) use to share each weight load between two fragments.
template <class A, int NF, int KU>
__global__ void __launch_bounds__(128) grouped_gemm_kernel(const uint16_t* __restrict__ a, const int32_t* __restrict__ a_rows,
                                                           const uint16_t* __restrict__ b, const uint16_t* __restrict__ bias,
                                                           uint16_t* __restrict__ c, int N, int K, Tiles tiles) {
  __shared__ __align__(16) uint16_t sa[kTileRows * kAStride];
  const int tile = int(blockIdx.x);
  if (tile >= *tiles.n) return;
  const int e = tiles.expert[tile], first = tiles.first[tile], count = tiles.count[tile];
  if (e < tiles.e_begin || e >= tiles.e_end) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int n_base = (int(blockIdx.y) * 4 + warp) * 8 * NF;
  const uint16_t* be = b + size_t(e - tiles.e_begin) * size_t(N) * size_t(K);
  // This lane's weight rows (n >= N: row 0, loaded but never stored).
  const uint16_t* brow[NF];
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    const int n = n_base + f * 8 + g;
    brow[f] = be + size_t(n < N ? n : 0) * size_t(K) + size_t(t4 * 8);
  }
  float acc[NF][4] = {};
  for (int k0 = 0; k0 < K; k0 += kChunkK) {
    const int kc = min(kChunkK, K - k0);
    // Stage A's rows [first, first + 16) x [k0, k0 + kc) (zeros past count), 16 bytes a thread.
    __syncthreads();
    for (int i = int(threadIdx.x); i < kTileRows * (kc / 8); i += int(blockDim.x)) {
      const int r = i / (kc / 8), col = (i % (kc / 8)) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < count) {
        const int row = a_rows ? a_rows[first + r] : first + r;
        v = *reinterpret_cast<const uint4*>(a + size_t(row) * size_t(K) + size_t(k0 + col));
      }
      *reinterpret_cast<uint4*>(sa + r * kAStride + col) = v;
    }
    __syncthreads();
    for (int k = 0; k < kc; k += 32 * KU) {
      const int steps = min(KU, (kc - k) / 32);
      uint4 bw[KU][NF];
#pragma unroll
      for (int u = 0; u < KU; ++u)
#pragma unroll
        for (int f = 0; f < NF; ++f)
          bw[u][f] = u < steps ? __ldg(reinterpret_cast<const uint4*>(brow[f] + size_t(k0 + k + 32 * u)))
                               : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        if (u >= steps) break;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int col = k + 32 * u + t4 * 8 + 4 * s;
          const uint2 lo_row = *reinterpret_cast<const uint2*>(sa + g * kAStride + col);
          const uint2 hi_row = *reinterpret_cast<const uint2*>(sa + (g + 8) * kAStride + col);
          const uint32_t af[4] = {lo_row.x, hi_row.x, lo_row.y, hi_row.y};
#pragma unroll
          for (int f = 0; f < NF; ++f)
            mma::mma16816<A::kBF16>(acc[f], af, s == 0 ? bw[u][f].x : bw[u][f].z, s == 0 ? bw[u][f].y : bw[u][f].w);
        }
      }
    }
  }
  // C fragment: c0, c1 at (g, 2 t4 + {0, 1}), c2, c3 at (g + 8, the same columns).
#pragma unroll
  for (int f = 0; f < NF; ++f) {
    const int n = n_base + f * 8 + 2 * t4;
    if (n >= N) continue;
    const float b0 = bias ? A::load(bias[size_t(e) * size_t(N) + size_t(n)]) : 0.0f;
    const float b1 = bias ? A::load(bias[size_t(e) * size_t(N) + size_t(n) + 1]) : 0.0f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = g + 8 * half;
      if (r >= count) continue;
      const uint32_t packed = uint32_t(A::store(acc[f][2 * half] + b0)) | (uint32_t(A::store(acc[f][2 * half + 1] + b1)) << 16);
      *reinterpret_cast<uint32_t*>(c + size_t(first + r) * size_t(N) + size_t(n)) = packed;
    }
  }
}

// The wide grouped GEMM, for prefill-sized batches: C[pair][n] = A[row(pair)] . B[e][n]^T
// (+ bias[e][n]) over tiles of up to 128 pairs of one expert and 128 output columns, k in steps
// of 32 through a kWideStages-deep cp.async pipeline in shared memory (A's rows gathered by
// a_rows, zero past the tile's pairs; B's rows past N zero). 8 warps, 2 x 4, each 64 pairs x
// 32 columns: per 16-wide k step 4 ldmatrix.x4 of A, 2 of B and 16 m16n8k16 mmas. A row of a
// stage is 32 halves padded to 40 (80 bytes), so the 8 rows an ldmatrix phase reads fall on
// 8 distinct 16-byte bank groups. Same contract as grouped_gemm_kernel: K % 32 == 0, N even.
constexpr int kWideCols = 128, kWideK = 32, kWideStride = 40, kWideStages = 4, kWideThreads = 256;
constexpr size_t kWideStageBytes = size_t(kWideRows + kWideCols) * kWideStride * 2;
constexpr size_t kWideSmem = kWideStages * kWideStageBytes;

template <class A>
__global__ void __launch_bounds__(kWideThreads) wide_gemm_kernel(const uint16_t* __restrict__ a,
                                                                 const int32_t* __restrict__ a_rows,
                                                                 const uint16_t* __restrict__ b,
                                                                 const uint16_t* __restrict__ bias,
                                                                 uint16_t* __restrict__ c, int N, int K, Tiles tiles) {
  extern __shared__ __align__(16) uint16_t smem[];
  // Column blocks run fastest: the CTAs of one tile follow one another, so its 128 gathered A
  // rows are read from DRAM once and from L2 for the other column blocks (with tiles fastest,
  // all of A streamed through DRAM once per column block: 12 times for Qwen3-30B-A3B's
  // gate_up, 0.67 of its 1.08 ms at 4096 rows).
  const int tile = int(blockIdx.y);
  if (tile >= *tiles.n) return;
  const int e = tiles.expert[tile], first = tiles.first[tile], count = tiles.count[tile];
  if (e < tiles.e_begin || e >= tiles.e_end) return;
  const int n0 = int(blockIdx.x) * kWideCols;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  // This thread's copies: 16-byte chunk tid % 4 of rows tid / 4 and tid / 4 + 64, of A and of B.
  const int chunk = tid % 4, r0 = tid / 4;
  const uint16_t* asrc[2];
  const uint16_t* bsrc[2];
  int abytes[2], bbytes[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 64 * h;
    const int row = r < count ? (a_rows ? a_rows[first + r] : first + r) : 0;
    asrc[h] = a + size_t(row) * size_t(K) + size_t(chunk * 8);
    abytes[h] = r < count ? 16 : 0;
    const int n = n0 + r;
    bsrc[h] = b + (size_t(e - tiles.e_begin) * size_t(N) + size_t(n < N ? n : 0)) * size_t(K) + size_t(chunk * 8);
    bbytes[h] = n < N ? 16 : 0;
  }
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  auto stage_a = [&](int st) { return sbase + uint32_t(st * kWideStageBytes); };
  auto stage_b = [&](int st) { return stage_a(st) + uint32_t(kWideRows * kWideStride * 2); };
  const int ksteps = K / kWideK;
  auto load = [&](int ks) {
    const int st = ks % kWideStages;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t off = uint32_t(((r0 + 64 * h) * kWideStride + chunk * 8) * 2);
      mma::cp_async16(stage_a(st) + off, asrc[h] + size_t(ks) * kWideK, abytes[h]);
      mma::cp_async16(stage_b(st) + off, bsrc[h] + size_t(ks) * kWideK, bbytes[h]);
    }
  };
#pragma unroll
  for (int s = 0; s < kWideStages - 1; ++s) {
    if (s < ksteps) load(s);
    asm volatile("cp.async.commit_group;\n" ::);
  }
  const int wm = warp / 4, wn = warp % 4;  // this warp's pairs [64 wm, +64), columns [32 wn, +32)
  float acc[4][4][4] = {};
  // ldmatrix lane addresses (in halves within a stage). A, matrix i = lane / 8: rows +8 for
  // odd i, k +8 for i >= 2. B, per pair of n8 fragments: n +8 for i >= 2, k +8 for odd i.
  const int a_off = (wm * 64 + (lane % 16)) * kWideStride + (lane / 16) * 8;
  const int b_off = (wn * 32 + (lane % 8) + (lane / 16) * 8) * kWideStride + ((lane / 8) % 2) * 8;
  for (int ks = 0; ks < ksteps; ++ks) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kWideStages - 2));
    __syncthreads();  // stage ks is in; every warp is done with the stage the next load refills
    if (ks + kWideStages - 1 < ksteps) load(ks + kWideStages - 1);
    asm volatile("cp.async.commit_group;\n" ::);
    const int st = ks % kWideStages;
    const uint16_t* sa = smem + size_t(st) * (kWideStageBytes / 2);
    const uint16_t* sb = sa + kWideRows * kWideStride;
#pragma unroll
    for (int kk = 0; kk < kWideK; kk += 16) {
      uint32_t af[4][4], bf[4][2];
#pragma unroll
      for (int mf = 0; mf < 4; ++mf) mma::ldsm_x4(af[mf], sa + a_off + mf * 16 * kWideStride + kk);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t r[4];
        mma::ldsm_x4(r, sb + b_off + np * 16 * kWideStride + kk);
        bf[2 * np][0] = r[0];
        bf[2 * np][1] = r[1];
        bf[2 * np + 1][0] = r[2];
        bf[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mf = 0; mf < 4; ++mf)
#pragma unroll
        for (int nf = 0; nf < 4; ++nf) mma::mma16816<A::kBF16>(acc[mf][nf], af[mf], bf[nf][0], bf[nf][1]);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  // C fragment: c0, c1 at (g, 2 t4 + {0, 1}), c2, c3 at (g + 8, the same columns).
  const int g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int nf = 0; nf < 4; ++nf) {
    const int n = n0 + wn * 32 + nf * 8 + 2 * t4;
    if (n >= N) continue;
    const float b0 = bias ? A::load(bias[size_t(e) * size_t(N) + size_t(n)]) : 0.0f;
    const float b1 = bias ? A::load(bias[size_t(e) * size_t(N) + size_t(n) + 1]) : 0.0f;
#pragma unroll
    for (int mf = 0; mf < 4; ++mf)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = wm * 64 + mf * 16 + g + 8 * half;
        if (r >= count) continue;
        const uint32_t packed = uint32_t(A::store(acc[mf][nf][2 * half] + b0)) |
                                (uint32_t(A::store(acc[mf][nf][2 * half + 1] + b1)) << 16);
        *reinterpret_cast<uint32_t*>(c + size_t(first + r) * size_t(N) + size_t(n)) = packed;
      }
  }
}

// h[p][i] = f(gate) * up for the pair rows of gu [P][2I].
template <class A>
__global__ void glu_kernel(const uint16_t* __restrict__ gu, uint16_t* __restrict__ h, size_t pairs, int inter,
                           GluActivation f, float alpha, float limit) {
  const size_t n = pairs * size_t(inter);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t p = i / size_t(inter), j = i % size_t(inter);
    const float g = A::load(gu[p * size_t(2 * inter) + j]);
    const float u = A::load(gu[p * size_t(2 * inter) + size_t(inter) + j]);
    h[i] = A::store(glu_value(f, g, u, alpha, limit));
  }
}

// y[t][:] = sum_k weights[t][k] * out[pair_of[t][k]][:], in fp32: a thread per 8 columns of
// a row, its k loads of the pairs' outputs issued before any sum.
template <class A>
__global__ void combine_kernel(const uint16_t* __restrict__ out, const int32_t* __restrict__ pair_of,
                               const float* __restrict__ weights, int top_k, int hidden, uint16_t* __restrict__ y) {
  using V = std::conditional_t<A::kBF16, VecBF16, VecF16>;
  pdl_wait();  // launched with PDL after the expert GEMMs
  const int t = int(blockIdx.y), v8 = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (v8 >= hidden / 8) return;
  constexpr int kMaxK = 16;
  uint4 o[kMaxK];
  float wk[kMaxK];
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    if (k >= top_k) break;
    const size_t pk = size_t(t) * size_t(top_k) + size_t(k);
    const int pos = pair_of[pk];
    wk[k] = pos < 0 ? 0.0f : weights[pk];  // another rank's expert adds nothing here
    o[k] = pos < 0 ? make_uint4(0, 0, 0, 0)
                   : *reinterpret_cast<const uint4*>(out + size_t(pos) * size_t(hidden) + size_t(v8) * 8);
  }
  float s[8] = {};
#pragma unroll
  for (int k = 0; k < kMaxK; ++k) {
    if (k >= top_k) break;
    float f[8];
    V::decode8(o[k], f);
#pragma unroll
    for (int q = 0; q < 8; ++q) s[q] += wk[k] * f[q];
  }
  uint4 r;
  uint32_t* rw = &r.x;
#pragma unroll
  for (int q = 0; q < 4; ++q) rw[q] = uint32_t(A::store(s[2 * q])) | (uint32_t(A::store(s[2 * q + 1])) << 16);
  *reinterpret_cast<uint4*>(y + size_t(t) * size_t(hidden) + size_t(v8) * 8) = r;
}

// CTAs for an expert GEMV of (at most) `items` warp items: as many as fit on the GPU at once
// or fewer, so that every warp takes the same number of items (a partial last round of
// items, not a partial wave of CTAs).
template <auto Kernel>
unsigned gemv_ctas(int items) {
  static PerDevice<int> resident;
  const int warps = resident.get([] {
    int per_sm = 0;
    KVLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kGemvWarps * 32, 0));
    return std::max(1, per_sm) * sm_count() * kGemvWarps;
  });
  const int rounds = (items + warps - 1) / warps;
  const int per_round = (items + rounds - 1) / rounds;
  return unsigned(std::max(1, (per_round + kGemvWarps - 1) / kGemvWarps));
}

// How a grouped batch's tiles are cut and multiplied.
enum class GemmPath { Decode, Prefill16, Wide };

// [e_begin, e_end): the experts whose tiles run, b holding e_begin's weights first.
template <class A>
void launch_gemm(const uint16_t* a, const int32_t* a_rows, const void* b, const void* bias, uint16_t* c, int N, int K,
                 int max_tiles, GemmPath path, const Workspace& w, cudaStream_t st, int e_begin = 0,
                 int e_end = INT_MAX) {
  Tiles tiles = w.tiles;
  tiles.e_begin = e_begin;
  tiles.e_end = e_end;
  const auto* bw = static_cast<const uint16_t*>(b);
  const auto* bb = static_cast<const uint16_t*>(bias);
  if (path == GemmPath::Wide) {
    static PerDevice<bool> attr;
    attr.get([] {
      KVLM_CUDA_CHECK(cudaFuncSetAttribute(wide_gemm_kernel<A>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kWideSmem)));
      return true;
    });
    KVLM_CHECK(max_tiles <= 65535, "moe: " + std::to_string(max_tiles) + " tiles exceed the grid's y dimension");
    const dim3 grid(unsigned((N + kWideCols - 1) / kWideCols), unsigned(max_tiles));
    wide_gemm_kernel<A><<<grid, kWideThreads, kWideSmem, st>>>(a, a_rows, bw, bb, c, N, K, tiles);
    KVLM_CUDA_CHECK_LAUNCH("moe wide_gemm_kernel");
    return;
  }
  if (path == GemmPath::Decode) {
    const dim3 grid(unsigned(max_tiles), unsigned((N + 31) / 32));
    grouped_gemm_kernel<A, 1, 8><<<grid, 128, 0, st>>>(a, a_rows, bw, bb, c, N, K, tiles);
  } else {
    const dim3 grid(unsigned(max_tiles), unsigned((N + 63) / 64));
    grouped_gemm_kernel<A, 2, 2><<<grid, 128, 0, st>>>(a, a_rows, bw, bb, c, N, K, tiles);
  }
  KVLM_CUDA_CHECK_LAUNCH("moe grouped_gemm_kernel");
}

}  // namespace

bool moe_fits(int hidden, int inter, int experts, int top_k) {
  return hidden > 0 && inter > 0 && hidden % 32 == 0 && inter % 32 == 0 && experts >= 1 && experts <= kMaxExperts &&
         top_k >= 1 && top_k <= std::min(experts, 16);
}

bool moe_int_fits(int hidden, int inter, int bits, int group) {
  return int_layout_fits(hidden, bits, group) && int_layout_fits(inter, bits, group);
}

size_t moe_workspace_bytes(DType act, int rows, int hidden, int inter, int experts, int top_k, bool int_experts) {
  (void)act;
  const size_t P = size_t(rows) * size_t(top_k);
  const size_t deq = int_experts && may_take_wide(rows, top_k)
                         ? align256(size_t(int_chunk_experts(hidden, inter, experts)) * size_t(2 * inter) * size_t(hidden) * 2)
                         : 0;
  return 4 * align256(P * 4) + 3 * align256(size_t(max_tiles(rows, experts, top_k)) * 4) + align256(4) +
         align256(P * size_t(2 * inter) * 2) +
         align256(P * size_t(inter) * 2) + align256(P * size_t(hidden) * 2) + deq;
}

void moe(const MoeParams& p, void* stream) {
  const MoeConfig& c = p.config;
  const int T = p.rows, E = c.num_experts, K = c.top_k, H = p.hidden, I = p.inter;
  if (T <= 0) return;
  if (!moe_fits(H, I, E, K))
    throw Error("CUDA MoE kernels: hidden " + std::to_string(H) + " and expert width " + std::to_string(I) +
                " must be multiples of 32, with 1..16 of at most 1024 experts (got top " + std::to_string(K) + " of " +
                std::to_string(E) + ")");
  const bool int_w = p.gate_up_codes.codes != nullptr;
  if (int_w != (p.down_codes.codes != nullptr))
    throw Error("CUDA MoE kernels: gate/up and down must both be grouped codes, or neither");
  if (int_w && !(moe_int_fits(H, I, p.gate_up_codes.bits, p.gate_up_codes.group) &&
                 moe_int_fits(H, I, p.down_codes.bits, p.down_codes.group)))
    throw Error("CUDA MoE kernels: experts of " + std::to_string(p.gate_up_codes.bits) + "-bit codes in groups of " +
                std::to_string(p.gate_up_codes.group) + " do not tile hidden " + std::to_string(H) +
                " and expert width " + std::to_string(I) + " (moe_int_fits); load with --dequantize-weights");
  const auto st = static_cast<cudaStream_t>(stream);
  const Workspace w = carve(p.workspace, p.act, T, H, I, E, K, int_w);
  const int P = T * K;
  // The experts this rank holds: all, or under expert parallelism its run [first, first + held)
  // (routing chooses among all E; the weights hold only these, indexed from 0).
  const int held = c.held_experts(), first = c.expert_begin;
  // Fewer than 8 pairs per expert on average: the weights are the cost (decode batches); from
  // kWideMinPairs, tiles of 128 pairs (prefill).
  const GemmPath path = P < 8 * E ? GemmPath::Decode : P >= kWideMinPairs * held ? GemmPath::Wide : GemmPath::Prefill16;
  const int tile_rows = path == GemmPath::Wide ? kWideRows : kTileRows;
  const int tiles = max_tiles(T, held, K, tile_rows);
  dispatch_act(p.act, [&](auto a) {
    using A = decltype(a);
    const auto* rbias = static_cast<const uint16_t*>(p.router_bias);
    auto* y = static_cast<uint16_t*>(p.y);
    // h = f(gate) * up over the pairs' gate/up rows (the grouped paths' own pass).
    auto glu = [&] {
      const size_t n = size_t(P) * size_t(I);
      glu_kernel<A><<<unsigned(std::min<size_t>((n + 255) / 256, 65535)), 256, 0, st>>>(w.gu, w.h, size_t(P), I, c.act,
                                                                                         c.swiglu_alpha, c.swiglu_limit);
      KVLM_CUDA_CHECK_LAUNCH("moe glu_kernel");
    };
    // Experts held as grouped codes, batches short of the wide path: the integer GEMV over each
    // tile (one pass over a routed expert's codes per 16 of its pairs), the activation, the
    // GEMV over W_down.
    auto int_gemv = [&] {
      IntExpertTiles t{.expert = w.tiles.expert, .first = w.tiles.first, .count = w.tiles.count, .tiles = w.tiles.n,
                       .x_rows = w.pair_row, .max_tiles = tiles, .routed = std::min(held, P)};
      const int max_m = std::min(T, kTileRows);
      gemv_int_experts(p.act, p.x, p.gate_up_codes, p.gate_up_bias, w.gu, max_m, 2 * I, H, t, st);
      glu();
      t.x_rows = nullptr;
      gemv_int_experts(p.act, w.h, p.down_codes, p.down_bias, w.out, max_m, H, I, t, st);
    };
    // The wide path over codes: a run of experts at a time dequantized into w.deq, then the
    // grouped GEMM over that run's tiles.
    auto int_wide = [&](const IntWeight& codes, const uint16_t* a_in, const int32_t* a_rows, const void* bias,
                        uint16_t* out, int N, int Kd) {
      const int auto_run = int_chunk_experts(H, I, E);
      const int chunk = p.int_run_experts > 0 ? std::min(p.int_run_experts, auto_run) : auto_run;
      const size_t per_row_codes = size_t(Kd) * size_t(codes.bits) / 8, per_row_params = size_t(Kd / codes.group);
      for (int e0 = 0; e0 < held; e0 += chunk) {
        const int e1 = std::min(held, e0 + chunk);
        IntWeight run = codes;
        run.codes += size_t(e0) * size_t(N) * per_row_codes;
        run.params += size_t(e0) * size_t(N) * per_row_params;
        dequantize_int(p.act, run, w.deq, (e1 - e0) * N, Kd, st);
        launch_gemm<A>(a_in, a_rows, w.deq, bias, out, N, Kd, tiles, path, w, st, e0, e1);
      }
    };
    if (T <= kGemvMaxRows) {
      // A decode batch: route and sort in one CTA, then the expert GEMV over each routed
      // expert (one tile each), the activation fused into the gate/up pass, then combine;
      // chained with PDL so that each launch overlaps the kernel before it.
      KVLM_CUDA_CHECK(launch_pdl<route_sort_kernel<A>>(dim3(1), dim3(kGemvMaxRows * 32), 0, st, p.logits, rbias, T, E, K,
                                                       c.norm_topk, first, held, w.ids, w.weights, w.pair_of, w.pair_row,
                                                       w.tiles));
      const int slots = std::min(held, P);  // routed experts: one tile each
      auto gemv = [&](auto m_tag) {
        constexpr int M = decltype(m_tag)::value;
        // Gate/up: an item is one column (its gate and up rows), 8 loads per row in flight;
        // down: four columns, 4 loads each (a row of I = 768 is 3 vectors per lane).
        constexpr auto gate_up = expert_gemv_kernel<A, M, 1, 8, true>;
        constexpr auto down = expert_gemv_kernel<A, M, 4, 4, false>;
        KVLM_CUDA_CHECK(launch_pdl<gate_up>(dim3(gemv_ctas<gate_up>(slots * I)), dim3(kGemvWarps * 32), 0, st,
                                            static_cast<const uint16_t*>(p.x), static_cast<const int32_t*>(w.pair_row),
                                            static_cast<const uint16_t*>(p.gate_up),
                                            static_cast<const uint16_t*>(p.gate_up_bias), w.h, I, H, P, w.tiles, c.act, c.swiglu_alpha, c.swiglu_limit));
        KVLM_CUDA_CHECK(launch_pdl<down>(dim3(gemv_ctas<down>(slots * ((H + 3) / 4))), dim3(kGemvWarps * 32), 0, st,
                                         static_cast<const uint16_t*>(w.h), static_cast<const int32_t*>(nullptr),
                                         static_cast<const uint16_t*>(p.down), static_cast<const uint16_t*>(p.down_bias),
                                         w.out, H, I, P, w.tiles, c.act, c.swiglu_alpha, c.swiglu_limit));
      };
      // An expert holds at most T of the batch's pairs (a row chooses it at most once).
      if (int_w) int_gemv();
      else if (T == 1) gemv(std::integral_constant<int, 1>{});
      else gemv(std::integral_constant<int, kGemvMaxRows>{});
    } else {
      route_kernel<A><<<unsigned((T + 3) / 4), 128, 0, st>>>(p.logits, rbias, T, E, K, c.norm_topk, w.ids, w.weights);
      KVLM_CUDA_CHECK_LAUNCH("moe route_kernel");
      sort_kernel<<<1, 1024, 0, st>>>(w.ids, P, first, held, K, w.pair_of, w.pair_row, w.tiles, tile_rows);
      KVLM_CUDA_CHECK_LAUNCH("moe sort_kernel");
      if (int_w && path != GemmPath::Wide) {
        int_gemv();
      } else {
        const auto* x = static_cast<const uint16_t*>(p.x);
        if (int_w) int_wide(p.gate_up_codes, x, w.pair_row, p.gate_up_bias, w.gu, 2 * I, H);
        else launch_gemm<A>(x, w.pair_row, p.gate_up, p.gate_up_bias, w.gu, 2 * I, H, tiles, path, w, st);
        glu();
        if (int_w) int_wide(p.down_codes, w.h, nullptr, p.down_bias, w.out, H, I);
        else launch_gemm<A>(w.h, nullptr, p.down, p.down_bias, w.out, H, I, tiles, path, w, st);
      }
    }
    KVLM_CUDA_CHECK(launch_pdl<combine_kernel<A>>(dim3(unsigned((H / 8 + 127) / 128), unsigned(T)), dim3(128), 0, st,
                                                  static_cast<const uint16_t*>(w.out), static_cast<const int32_t*>(w.pair_of),
                                                  static_cast<const float*>(w.weights), K, H, y));
  });
}

}  // namespace kvlm::cuda

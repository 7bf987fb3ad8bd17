// The mixture-of-experts kernels (moe.h): route, sort, the grouped expert GEMM, glu, combine.
//
// The grouped GEMM, C[pair][n] = A[row(pair)] . B[expert][n]^T (+ bias[expert][n]): a CTA of
// 4 warps takes one 16-row tile of one expert's pairs and 64 output columns (16 per warp, two
// m16n8k16 fragments; decode batches: 32 columns, one fragment, more loads in flight). Each lane streams the expert's weight rows with 16-byte loads, 8
// consecutive k of one row n: for the mma, k is permuted inside each 32-wide chunk (logical
// k 2t, 2t+1 of step s are physical 8t + 4s, +1; 2t+8, 2t+9 are 8t + 4s + 2, +3), the same
// permutation on A, so the sum is the same and every weight byte arrives in a full 16-byte
// load. A's 16 rows (gathered token rows, zero past the tile's pairs) sit in shared memory,
// a chunk of K at a time. A decode step's tiles are one row each: the weights stream at
// memory speed and each routed expert's weights are read once; prefill tiles fill 16
// rows and the CTAs of one expert and column block run side by side, sharing its weights in L2.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/cuda/act_types.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/moe.h"

namespace kvlm::cuda {

namespace {

constexpr int kTileRows = 16;    // pairs per CTA tile (one m16 fragment)
constexpr int kChunkK = 512;     // A's columns staged in shared memory at a time
constexpr int kAStride = kChunkK + 8;  // halves per staged row (+16 bytes against bank conflicts)
constexpr int kMaxExperts = 1024;

template <class F>
void dispatch_act(DType act, F&& f) {
  act::dispatch(act, "CUDA MoE kernels", std::forward<F>(f));
}

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// The workspace, carved in this order.
struct Workspace {
  int32_t* ids;          // [T * K] expert of each pair (row-major: row t's k-th choice)
  float* weights;        // [T * K]
  int32_t* pair_of;      // [T * K] the pair's position in expert order
  int32_t* pair_row;     // [P] the token row of the pair at each position
  int32_t* offsets;      // [E + 1] first position of each expert
  int32_t* tile_offsets; // [E + 1] first 16-row tile of each expert
  uint16_t* gu;          // act [P][2I]
  uint16_t* h;           // act [P][I]
  uint16_t* out;         // act [P][H]
};

Workspace carve(void* base, DType act, int rows, int hidden, int inter, int experts, int top_k) {
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
  w.offsets = static_cast<int32_t*>(take(size_t(experts + 1) * 4));
  w.tile_offsets = static_cast<int32_t*>(take(size_t(experts + 1) * 4));
  w.gu = static_cast<uint16_t*>(take(P * size_t(2 * inter) * 2));
  w.h = static_cast<uint16_t*>(take(P * size_t(inter) * 2));
  w.out = static_cast<uint16_t*>(take(P * size_t(hidden) * 2));
  return w;
}

// One warp per row: the top k experts by logit (+ bias), in descending order, lower index
// first on ties, and their weights.
template <class A>
__global__ void route_kernel(const float* __restrict__ logits, const uint16_t* __restrict__ bias, int rows, int experts,
                             int top_k, bool norm_topk, int32_t* __restrict__ ids, float* __restrict__ weights) {
  const int warp = int(blockIdx.x) * (blockDim.x / 32) + int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  if (warp >= rows) return;
  const float* l = logits + size_t(warp) * size_t(experts);
  auto logit = [&](int e) { return l[e] + (bias ? A::load(bias[e]) : 0.0f); };
  // Chosen experts so far (k <= experts <= 1024: a bitmask of 32 words per lane's strip is
  // too much; k is small, so a linear check of the chosen list).
  int chosen[16];
  float chosen_logit[16];
  for (int k = 0; k < top_k; ++k) {
    float best = -INFINITY;
    int best_e = experts;
    for (int e = lane; e < experts; e += 32) {
      bool taken = false;
      for (int j = 0; j < k; ++j) taken |= chosen[j] == e;
      const float v = logit(e);
      if (!taken && (v > best || (v == best && e < best_e))) {
        best = v;
        best_e = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ov > best || (ov == best && oe < best_e)) {
        best = ov;
        best_e = oe;
      }
    }
    chosen[k] = best_e;
    chosen_logit[k] = best;
  }
  const float mx = chosen_logit[0];
  float sum = 0.0f;
  if (norm_topk) {
    for (int k = 0; k < top_k; ++k) sum += expf(chosen_logit[k] - mx);
  } else {
    for (int e = lane; e < experts; e += 32) sum += expf(logit(e) - mx);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  if (lane < top_k) {
    int e = 0;
    float v = 0.0f;
    for (int k = 0; k < top_k; ++k)  // registers indexed by a lane-dependent k: select
      if (k == lane) {
        e = chosen[k];
        v = chosen_logit[k];
      }
    ids[size_t(warp) * size_t(top_k) + size_t(lane)] = e;
    weights[size_t(warp) * size_t(top_k) + size_t(lane)] = expf(v - mx) / sum;
  }
}

// One CTA: count the pairs of each expert, the offsets and tile offsets (a scan), then place
// each pair (positions within an expert follow atomics: any order gives each pair the same
// result, as the GEMM's rows are independent).
__global__ void sort_kernel(const int32_t* __restrict__ ids, int pairs, int experts, int top_k, int32_t* __restrict__ pair_of,
                            int32_t* __restrict__ pair_row, int32_t* __restrict__ offsets, int32_t* __restrict__ tile_offsets) {
  __shared__ int count[kMaxExperts], cursor[kMaxExperts];
  for (int e = int(threadIdx.x); e < experts; e += int(blockDim.x)) count[e] = 0;
  __syncthreads();
  for (int p = int(threadIdx.x); p < pairs; p += int(blockDim.x)) atomicAdd(&count[ids[p]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int at = 0, tiles = 0;
    for (int e = 0; e < experts; ++e) {
      offsets[e] = at;
      tile_offsets[e] = tiles;
      cursor[e] = at;
      at += count[e];
      tiles += (count[e] + kTileRows - 1) / kTileRows;
    }
    offsets[experts] = at;
    tile_offsets[experts] = tiles;
  }
  __syncthreads();
  for (int p = int(threadIdx.x); p < pairs; p += int(blockDim.x)) {
    const int pos = atomicAdd(&cursor[ids[p]], 1);
    pair_of[p] = pos;
    pair_row[pos] = p / top_k;
  }
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
                                                           uint16_t* __restrict__ c, int N, int K, int experts,
                                                           const int32_t* __restrict__ offsets,
                                                           const int32_t* __restrict__ tile_offsets) {
  __shared__ __align__(16) uint16_t sa[kTileRows * kAStride];
  const int tile = int(blockIdx.x);
  if (tile >= tile_offsets[experts]) return;
  // The expert whose tiles hold this one: the last e with tile_offsets[e] <= tile.
  int lo = 0, hi = experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo;
  const int first = offsets[e] + (tile - tile_offsets[e]) * kTileRows;
  const int count = min(kTileRows, offsets[e + 1] - first);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int n_base = (int(blockIdx.y) * 4 + warp) * 8 * NF;
  const uint16_t* be = b + size_t(e) * size_t(N) * size_t(K);
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

// h[p][i] = f(gate) * up for the pair rows of gu [P][2I].
template <class A>
__global__ void glu_kernel(const uint16_t* __restrict__ gu, uint16_t* __restrict__ h, size_t pairs, int inter,
                           GluActivation f, float alpha, float limit) {
  const size_t n = pairs * size_t(inter);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t p = i / size_t(inter), j = i % size_t(inter);
    float g = A::load(gu[p * size_t(2 * inter) + j]);
    float u = A::load(gu[p * size_t(2 * inter) + size_t(inter) + j]);
    float v;
    if (f == GluActivation::SwigluClamp) {
      g = fminf(g, limit);
      u = fminf(fmaxf(u, -limit), limit);
      v = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    } else if (f == GluActivation::Silu) {
      v = g / (1.0f + expf(-g)) * u;
    } else {
      v = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g))) * u;
    }
    h[i] = A::store(v);
  }
}

// y[t][:] = sum_k weights[t][k] * out[pair_of[t][k]][:], in fp32.
template <class A>
__global__ void combine_kernel(const uint16_t* __restrict__ out, const int32_t* __restrict__ pair_of,
                               const float* __restrict__ weights, int top_k, int hidden, uint16_t* __restrict__ y) {
  const int t = int(blockIdx.x);
  for (int j = int(threadIdx.x); j < hidden; j += int(blockDim.x)) {
    float s = 0.0f;
    for (int k = 0; k < top_k; ++k) {
      const size_t pk = size_t(t) * size_t(top_k) + size_t(k);
      s += weights[pk] * A::load(out[size_t(pair_of[pk]) * size_t(hidden) + size_t(j)]);
    }
    y[size_t(t) * size_t(hidden) + size_t(j)] = A::store(s);
  }
}

template <class A>
void launch_gemm(const uint16_t* a, const int32_t* a_rows, const void* b, const void* bias, uint16_t* c, int N, int K,
                 int experts, int max_tiles, bool decode, const Workspace& w, cudaStream_t st) {
  const auto* bw = static_cast<const uint16_t*>(b);
  const auto* bb = static_cast<const uint16_t*>(bias);
  if (decode) {
    const dim3 grid(unsigned(max_tiles), unsigned((N + 31) / 32));
    grouped_gemm_kernel<A, 1, 8><<<grid, 128, 0, st>>>(a, a_rows, bw, bb, c, N, K, experts, w.offsets, w.tile_offsets);
  } else {
    const dim3 grid(unsigned(max_tiles), unsigned((N + 63) / 64));
    grouped_gemm_kernel<A, 2, 2><<<grid, 128, 0, st>>>(a, a_rows, bw, bb, c, N, K, experts, w.offsets, w.tile_offsets);
  }
  KVLM_CUDA_CHECK_LAUNCH("moe grouped_gemm_kernel");
}

}  // namespace

bool moe_fits(int hidden, int inter, int experts, int top_k) {
  return hidden > 0 && inter > 0 && hidden % 32 == 0 && inter % 32 == 0 && experts >= 1 && experts <= kMaxExperts &&
         top_k >= 1 && top_k <= std::min(experts, 16);
}

size_t moe_workspace_bytes(DType act, int rows, int hidden, int inter, int experts, int top_k) {
  (void)act;
  const size_t P = size_t(rows) * size_t(top_k);
  return 4 * align256(P * 4) + 2 * align256(size_t(experts + 1) * 4) + align256(P * size_t(2 * inter) * 2) +
         align256(P * size_t(inter) * 2) + align256(P * size_t(hidden) * 2);
}

void moe(const MoeParams& p, void* stream) {
  const MoeConfig& c = p.config;
  const int T = p.rows, E = c.num_experts, K = c.top_k, H = p.hidden, I = p.inter;
  if (T <= 0) return;
  if (!moe_fits(H, I, E, K))
    throw Error("CUDA MoE kernels: hidden " + std::to_string(H) + " and expert width " + std::to_string(I) +
                " must be multiples of 32, with 1..16 of at most 1024 experts (got top " + std::to_string(K) + " of " +
                std::to_string(E) + ")");
  const auto st = static_cast<cudaStream_t>(stream);
  const Workspace w = carve(p.workspace, p.act, T, H, I, E, K);
  const int P = T * K;
  // Tiles: at most one partial tile per expert that has pairs, and no more experts with pairs
  // than pairs.
  const int max_tiles = (P + kTileRows - 1) / kTileRows + std::min(E, P);
  // Fewer than 8 pairs per expert on average: the weights are the cost (decode batches).
  const bool decode = P < 8 * E;
  dispatch_act(p.act, [&](auto a) {
    using A = decltype(a);
    route_kernel<A><<<unsigned((T + 3) / 4), 128, 0, st>>>(p.logits, static_cast<const uint16_t*>(p.router_bias), T, E, K,
                                                           c.norm_topk, w.ids, w.weights);
    KVLM_CUDA_CHECK_LAUNCH("moe route_kernel");
    sort_kernel<<<1, 1024, 0, st>>>(w.ids, P, E, K, w.pair_of, w.pair_row, w.offsets, w.tile_offsets);
    KVLM_CUDA_CHECK_LAUNCH("moe sort_kernel");
    launch_gemm<A>(static_cast<const uint16_t*>(p.x), w.pair_row, p.gate_up, p.gate_up_bias, w.gu, 2 * I, H, E, max_tiles,
                   decode, w, st);
    const size_t n = size_t(P) * size_t(I);
    glu_kernel<A><<<unsigned(std::min<size_t>((n + 255) / 256, 65535)), 256, 0, st>>>(w.gu, w.h, size_t(P), I, c.act,
                                                                                       c.swiglu_alpha, c.swiglu_limit);
    KVLM_CUDA_CHECK_LAUNCH("moe glu_kernel");
    launch_gemm<A>(w.h, nullptr, p.down, p.down_bias, w.out, H, I, E, max_tiles, decode, w, st);
    combine_kernel<A><<<unsigned(T), 256, 0, st>>>(w.out, w.pair_of, w.weights, K, H, static_cast<uint16_t*>(p.y));
    KVLM_CUDA_CHECK_LAUNCH("moe combine_kernel");
  });
}

}  // namespace kvlm::cuda

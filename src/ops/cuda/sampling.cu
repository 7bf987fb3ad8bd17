// Sampling kernel (sampling.h). One CTA per row; every pass streams the row from memory
// (a 152k vocabulary is 600 KB: L2 for a few rows at a time, HBM across a large batch):
//   1. the row's maximum (greedy rows: the argmax, done);
//   2. min-p: a threshold max + T*log(min_p), no pass;
//   3. top-k, then top-p: a radix select over the logits' order-preserving 32-bit keys, 8 bits
//      per level (4 passes), histogramming a weight per key — 1 for top-k, the token's
//      fixed-point probability mass for top-p (integer atomics: exact and order-independent,
//      so a seed gives the same token every run) — and keeping the bin where the running
//      weight from the top reaches the target;
//   4. Gumbel-max over the kept tokens: argmax of logit/T + noise(seed, counter, token id).
// A row with neither top-k nor top-p (the default of most clients) costs two passes.
// A masked row (a grammar's allowed tokens) reads its 19 KB of bits beside its logits in every
// pass and sees -inf for the tokens they exclude, exactly as its reference does.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/philox.h"
#include "ops/cuda/block_argmax.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/sampling.h"

namespace kvlm::cuda {

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Larger float -> larger key (NaN handled by the callers: never kept).
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

struct Shared {
  unsigned long long hist[256];
  float red_f[kWarps];
  unsigned long long red_u[kWarps];
  uint32_t prefix;
  unsigned long long above;
};

__device__ float block_max(float v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) sh.red_f[threadIdx.x / 32] = v;
  __syncthreads();
  float r = sh.red_f[0];
  for (int w = 1; w < kWarps; ++w) r = fmaxf(r, sh.red_f[w]);
  __syncthreads();
  return r;
}

__device__ unsigned long long block_sum(unsigned long long v, Shared& sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) sh.red_u[threadIdx.x / 32] = v;
  __syncthreads();
  unsigned long long r = 0;
  for (int w = 0; w < kWarps; ++w) r += sh.red_u[w];
  __syncthreads();
  return r;
}

__device__ __forceinline__ unsigned long long fixed_weight(float x, float m, float inv_t) {
  return (unsigned long long)(expf((x - m) * inv_t) * 4294967296.0f);
}

// The largest key t >= lo such that the weights of the kept tokens with key >= t add up to
// at least `target` (kMass: fixed-point probability mass; else 1 per token). The caller
// guarantees the kept tokens' total reaches the target.
// Row r's logits as the sampler sees them: -inf outside its mask.
struct Row {
  const float* x;
  const uint64_t* mask;  // null: every token
  __device__ __forceinline__ float operator[](int i) const {
    return (!mask || ((mask[i >> 6] >> (i & 63)) & 1ull)) ? x[i] : -INFINITY;
  }
};

template <bool kMass>
__device__ uint32_t select_threshold(const Row row, int vocab, uint32_t lo, double target, float m, float inv_t,
                                     Shared& sh) {
  uint32_t prefix = 0;
  unsigned long long above = 0;
  for (int level = 0; level < 4; ++level) {
    const int shift = 24 - 8 * level;
    for (int b = threadIdx.x; b < 256; b += kThreads) sh.hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = row[i];
      if (!(x == x)) continue;
      const uint32_t k = order_key(x);
      if (k < lo || (level > 0 && (k >> (shift + 8)) != prefix)) continue;
      atomicAdd(&sh.hist[(k >> shift) & 255u], kMass ? fixed_weight(x, m, inv_t) : 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long cum = above;
      int chosen = 0;
      for (int b = 255; b >= 0; --b) {
        if (double(cum + sh.hist[b]) >= target) {
          chosen = b;
          break;
        }
        cum += sh.hist[b];
      }
      sh.prefix = (prefix << 8) | uint32_t(chosen);
      sh.above = cum;
    }
    __syncthreads();
    prefix = sh.prefix;
    above = sh.above;
    __syncthreads();
  }
  return prefix;
}

__global__ void __launch_bounds__(kThreads) sample_kernel(const float* logits, int vocab, const SampleRowParams* params,
                                                           const uint64_t* masks, TokenId* out) {
  __shared__ Shared sh;
  const SampleRowParams p = params[blockIdx.x];
  if (p.skip) return;
  const Row row{logits + size_t(blockIdx.x) * size_t(vocab),
                p.mask_row >= 0 ? masks + size_t(p.mask_row) * size_t((vocab + 63) / 64) : nullptr};  // mask_words

  if (p.inv_temperature == 0.0f) {  // greedy
    float best = -INFINITY;
    int idx = vocab;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = row[i];
      if (argmax_better(x, i, best, idx)) {
        best = x;
        idx = i;
      }
    }
    idx = block_argmax<kThreads>(best, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = TokenId(idx < vocab ? idx : 0);
    return;
  }

  float m = -INFINITY;
  for (int i = threadIdx.x; i < vocab; i += kThreads) m = fmaxf(m, row[i]);  // fmaxf drops NaN
  m = block_max(m, sh);

  // Kept: key >= lo (and not NaN). Key 0 is below every float's key.
  uint32_t lo = 0;
  if (p.min_p_offset > -INFINITY) lo = order_key(m + p.min_p_offset);
  if (p.top_k > 0 && p.top_k < vocab) {
    unsigned long long n = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = row[i];
      n += (x == x && order_key(x) >= lo) ? 1ull : 0ull;
    }
    if (block_sum(n, sh) > (unsigned long long)p.top_k)
      lo = select_threshold<false>(row, vocab, lo, double(p.top_k), m, p.inv_temperature, sh);
  }
  if (p.top_p < 1.0f) {
    unsigned long long z = 0;
    for (int i = threadIdx.x; i < vocab; i += kThreads) {
      const float x = row[i];
      if (x == x && order_key(x) >= lo) z += fixed_weight(x, m, p.inv_temperature);
    }
    z = block_sum(z, sh);
    lo = select_threshold<true>(row, vocab, lo, double(p.top_p) * double(z), m, p.inv_temperature, sh);
  }

  float best = -INFINITY;
  int idx = vocab;
  for (int i = threadIdx.x; i < vocab; i += kThreads) {
    const float x = row[i];
    if (!(x == x) || order_key(x) < lo) continue;
    const float s = x * p.inv_temperature + rng::gumbel_noise(rng::random_u32(p.seed, p.counter, uint32_t(i)));
    if (argmax_better(s, i, best, idx)) {
      best = s;
      idx = i;
    }
  }
  idx = block_argmax<kThreads>(best, idx);
  if (threadIdx.x == 0) out[blockIdx.x] = TokenId(idx < vocab ? idx : 0);
}

}  // namespace

void sample_rows(const float* logits, int rows, int vocab, const SampleRowParams* params, const uint64_t* masks,
                 TokenId* out, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0) throw Error("sample_rows: empty vocabulary");
  sample_kernel<<<unsigned(rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(logits, vocab, params, masks, out);
  KVLM_CUDA_CHECK_LAUNCH("sample_rows");
}

}  // namespace kvlm::cuda

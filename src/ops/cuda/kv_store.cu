// kv_store: quantize new K/V rows (bf16) and scatter them into the paged cache by slot,
// byte-identical to CpuAttentionBackend::store_kv on the same values (the test checks it).
//
// One warp per (token, kv head) row: the row's absmax is a warp reduction, then each lane
// encodes head_dim / 32 elements (int4: the row's min and max, then each lane packs whole
// 32-bit words of 8 codes). Divisions are IEEE round-to-nearest (__fdiv_rn) — exactly
// the CPU's `x / scale` — never the approximate reciprocal, or fp8/int8 codes could differ.
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/kv_codec.cuh"

namespace kvlm::cuda {
namespace {

constexpr int kStoreWarps = 4;

template <class Fmt>
__device__ __forceinline__ void store_row(const uint16_t* src, typename Fmt::Code* dst, float* token_scale, float tensor_scale,
                                          int d, int lane) {
  float scale = 1.0f;
  if constexpr (Fmt::kScale == Scale::PerTokenHead) {
    float amax = 0.0f;
    for (int i = lane; i < d; i += 32) amax = fmaxf(amax, fabsf(__uint_as_float(uint32_t(src[i]) << 16)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    scale = fmaxf(__fdiv_rn(amax, Fmt::kMax), 1e-6f);  // kvfmt: max(absmax / qmax, kMinScale)
    if (lane == 0) *token_scale = scale;
  } else if constexpr (Fmt::kScale == Scale::PerTensor) {
    scale = tensor_scale;
  }
  for (int i = lane; i < d; i += 32) {
    const float x = __uint_as_float(uint32_t(src[i]) << 16);
    dst[i] = Fmt::encode(Fmt::kScale == Scale::None ? x : __fdiv_rn(x, scale));
  }
}

// int4: the row's min and max, then each lane packs whole words of 8 codes.
__device__ __forceinline__ void store_row_i4(const uint16_t* src, uint32_t* dst, uint32_t* slot, int d, int lane) {
  float lo = INFINITY, hi = -INFINITY;
  for (int i = lane; i < d; i += 32) {
    const float x = __uint_as_float(uint32_t(src[i]) << 16);
    lo = fminf(lo, x);
    hi = fmaxf(hi, x);
  }
  const I4Encoder enc = I4Encoder::over_warp(lo, hi);
  if (lane == 0) *slot = enc.slot;
  for (int w = lane; w < d / 8; w += 32) {
    float x[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __uint_as_float(uint32_t(src[8 * w + k]) << 16);
    dst[w] = enc.word(x);
  }
}

// One side's row into its pages, in the side's format F.
template <class F>
__device__ __forceinline__ void store_side(const uint16_t* src, void* cache, float* token_scale, const float* tensor_scale,
                                           const KVStoreParams& p, size_t sidx, int g, int lane) {
  const size_t drow = sidx * size_t(p.head_dim);
  if constexpr (kIsInt4<F>) {
    store_row_i4(src, static_cast<uint32_t*>(cache) + drow / 8, reinterpret_cast<uint32_t*>(token_scale) + sidx,
                 p.head_dim, lane);
  } else {
    float ts = 1.0f;
    if constexpr (F::kScale == Scale::PerTensor) ts = tensor_scale[p.num_tensor_scales == 1 ? 0 : g];
    store_row<F>(src, static_cast<typename F::Code*>(cache) + drow, token_scale + sidx, ts, p.head_dim, lane);
  }
}

// Fmt: one codec (K and V alike) or a KVPair (kv_codec.cuh).
template <class Fmt>
__global__ void __launch_bounds__(kStoreWarps * 32) kv_store_kernel(const KVStoreParams p) {
  const int64_t row = int64_t(blockIdx.x) * kStoreWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= int64_t(p.num_tokens) * p.num_kv_heads) return;
  const int64_t tok = row / p.num_kv_heads;
  const int g = int(row % p.num_kv_heads);
  const SlotId slot = p.slots[tok];
  if (slot < 0) return;  // padding token
  const int64_t block = slot / p.block_size;
  if (block >= p.num_blocks) return;  // a caller bug; never write outside the pool
  const int off = int(slot % p.block_size);
  const size_t srow = size_t(row) * size_t(p.head_dim);
  if (p.exact_slots) {  // exact sink / recent tokens: the row unquantized into its exact page
    const SlotId es = p.exact_slots[tok];
    if (es >= 0 && es / p.block_size < p.num_exact) {
      const size_t erow = ((size_t(es / p.block_size) * size_t(p.num_kv_heads) + size_t(g)) * size_t(p.block_size) +
                           size_t(es % p.block_size)) * size_t(p.head_dim);
      for (int j = lane; j < p.head_dim; j += 32) {
        const uint16_t k = p.k[srow + size_t(j)], v = p.v[srow + size_t(j)];
        p.exact_k[erow + size_t(j)] = p.exact_f16 ? FmtF16::encode(__uint_as_float(uint32_t(k) << 16)) : k;
        p.exact_v[erow + size_t(j)] = p.exact_f16 ? FmtF16::encode(__uint_as_float(uint32_t(v) << 16)) : v;
      }
    }
  }
  const size_t sidx = (size_t(block) * size_t(p.num_kv_heads) + size_t(g)) * size_t(p.block_size) + size_t(off);
  store_side<KOf<Fmt>>(p.k + srow, p.k_cache, p.k_token_scale, p.k_tensor_scale, p, sidx, g, lane);
  store_side<VOf<Fmt>>(p.v + srow, p.v_cache, p.v_token_scale, p.v_tensor_scale, p, sidx, g, lane);
}

}  // namespace

void kv_store(const KVStoreParams& p, void* stream) {
  if (p.num_tokens <= 0) return;
  if (p.head_dim <= 0 || p.num_kv_heads <= 0 || p.block_size <= 0)
    throw Error("kv_store: head_dim, num_kv_heads and block_size must be positive");
  dispatch_cuda_kv_pair(k_format_of(p), v_format_of(p), "kv_store", [&](auto fmt) {
    using Fmt = decltype(fmt);
    check_kv_pages<Fmt>(p, "kv_store");
    const int64_t rows = int64_t(p.num_tokens) * p.num_kv_heads;
    const unsigned grid = unsigned((rows + kStoreWarps - 1) / kStoreWarps);
    kv_store_kernel<Fmt><<<grid, kStoreWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(p);
    cuda_check(cudaGetLastError(), "kv_store launch");
  });
}

}  // namespace kvlm::cuda

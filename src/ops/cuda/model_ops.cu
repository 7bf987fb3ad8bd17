// The decoder's non-GEMM kernels (model_ops.h). All are memory-bound and small next to the
// GEMMs; what matters is one pass over each tensor and no extra launches:
//  - add_rmsnorm: residual add + norm in one CTA per row, the row held in registers (and, for
//    an FP8 GEMM after it, the output's FP8 codes and scales, sparing that GEMM its own
//    quantization pass);
//  - qkv_rope_store: one warp per (token, head) reads its slice of the fused QKV output once
//    and writes bf16 q, or quantized K and V straight into their pages — no separate q/k
//    norm, RoPE or KV-store pass;
//  - glu (SiLU- or GELU-and-mul), embed_rows, bf16_to_act: elementwise, grid-stride.
// Every kernel of a decode step but the first (embed_rows) is launched with programmatic
// dependent launch (pdl.cuh): it starts while its predecessor drains and waits in pdl_wait()
// before reading that predecessor's output; the kernels let their successor start early.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>
#include <utility>

#include "core/hadamard.h"
#include "core/numeric.h"
#include "ops/cuda/act_types.cuh"
#include "ops/cuda/block_argmax.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/glu.cuh"
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/kv_codec.cuh"
#include "ops/cuda/model_ops.h"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

namespace {

template <class F>
void dispatch_act(DType act, F&& f) {
  act::dispatch(act, "CUDA model kernels", std::forward<F>(f));
}


// ---- embedding ------------------------------------------------------------------------

template <class A>
__global__ void embed_kernel(const uint16_t* table, const TokenId* tokens, int hidden, float* x, float scale) {
  const int r = blockIdx.x;
  const uint16_t* src = table + size_t(tokens[r]) * size_t(hidden);
  float* dst = x + size_t(r) * size_t(hidden);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = A::load(src[i]) * scale;
}

// ---- residual add + RMSNorm -----------------------------------------------------------

// One CTA per row, up to 1024 threads, each holding PER (4, 8 or 16) of the row's values and
// norm weights in registers: every load is issued before any arithmetic (one memory round
// trip, not one per loop iteration: a 256-thread loop over a 4096-wide row took ~15 us), and
// PER is the smallest that covers the row, so nothing spills.
constexpr int kNormMaxThreads = 1024;

template <class A, int PER>
__global__ void __launch_bounds__(kNormMaxThreads) add_rmsnorm_kernel(const AddRmsNormParams p) {
  allow_dependents();
  const int r = blockIdx.x;
  const int src = p.row_map ? p.row_map[r] : r;  // step metadata: uploaded before the step's kernels
  const int H = p.hidden, nt = int(blockDim.x), tid = int(threadIdx.x);
  float* x = p.x ? p.x + size_t(src) * size_t(H) : nullptr;
  const uint16_t* d = p.delta ? static_cast<const uint16_t*>(p.delta) + size_t(src) * size_t(H) : nullptr;
  float v[PER], wt[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) wt[c] = tid + c * nt < H ? p.weight[tid + c * nt] : 0.0f;  // weights: not written
  pdl_wait();  // x and delta come from the kernels before
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    const int i = tid + c * nt;
    v[c] = i < H && x ? x[i] : 0.0f;
    if (d && i < H) v[c] += A::load(d[i]);
  }
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    const int i = tid + c * nt;
    if (i < H) {
      if (x && d && !p.row_map) x[i] = v[c];  // the residual stream after the add
      ss = fmaf(v[c], v[c], ss);
    }
  }
  __shared__ float part[kNormMaxThreads / 32];
  ss = warp_sum(ss);
  if (tid % 32 == 0) part[tid / 32] = ss;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < nt / 32; ++w) total += part[w];
  const float inv = 1.0f / sqrtf(total / float(H) + p.eps);
  uint16_t* out = p.out ? static_cast<uint16_t*>(p.out) + size_t(r) * size_t(H) : nullptr;
  float* out_f32 = p.out_f32 ? p.out_f32 + size_t(r) * size_t(H) : nullptr;
  uint16_t o[PER];  // the stored row (the codes below quantize exactly these values)
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    const int i = tid + c * nt;
    const float y = wt[c] * (v[c] * inv);
    o[c] = A::store(y);
    if (i < H && out) out[i] = o[c];
    if (i < H && out_f32) out_f32[i] = y;
  }
  if (!p.codes) return;
  // quantize_rows_fp8 of the stored row: the absolute maximum of the rounded values per row (or
  // per 128-value group: for each c, 128 consecutive threads, i.e. 4 whole warps), scale =
  // amax / 448 (1 when all zero), code = f32_to_e4m3(value / scale).
  float y[PER], wmax[PER];
#pragma unroll
  for (int c = 0; c < PER; ++c) {
    y[c] = tid + c * nt < H ? A::load(o[c]) : 0.0f;
    wmax[c] = warp_max(fabsf(y[c]));
  }
  __shared__ float gmax[16][kNormMaxThreads / 32];  // [c][warp]
  const int warp = tid / 32, warps = nt / 32;
  if (tid % 32 == 0)
#pragma unroll
    for (int c = 0; c < PER; ++c) gmax[c][warp] = wmax[c];
  __syncthreads();
  uint8_t* codes = p.codes + size_t(r) * size_t(H);
  auto scale_of = [](float amax) { return amax > 0.0f ? amax / num::kE4M3Max : 1.0f; };
  if (p.code_group == 0) {
    float amax = 0.0f;
    for (int w = 0; w < warps; ++w)
#pragma unroll
      for (int c = 0; c < PER; ++c) amax = fmaxf(amax, gmax[c][w]);
    const float scale = scale_of(amax);
    if (tid == 0) p.code_scales[r] = scale;
#pragma unroll
    for (int c = 0; c < PER; ++c)
      if (tid + c * nt < H) codes[tid + c * nt] = num::f32_to_e4m3(y[c] / scale);
  } else {
    const int w0 = warp & ~3;  // the group's 4 warps
#pragma unroll
    for (int c = 0; c < PER; ++c) {
      const int i = tid + c * nt;
      if (i >= H) continue;  // (H % 128 == 0 and nt % 128 == 0: a group is all in or all out)
      const float amax = fmaxf(fmaxf(gmax[c][w0], gmax[c][w0 + 1]), fmaxf(gmax[c][w0 + 2], gmax[c][w0 + 3]));
      const float scale = scale_of(amax);
      if (tid % 128 == 0) p.code_scales[size_t(i / 128) * size_t(p.rows) + size_t(r)] = scale;
      codes[i] = num::f32_to_e4m3(y[c] / scale);
    }
  }
}

// ---- q/k norm + RoPE + KV store -------------------------------------------------------

constexpr int kRopeWarps = 4;
constexpr int kPairsPerLane = 4;  // head_dim / 2 <= 128 = 32 lanes x 4

// Quantize one head row (held as rotate-half pairs a[c] = x[j], b[c] = x[j + half],
// j = lane + 32c) into its page row; per-token-head modes also write the row's scale.
template <class Fmt>
__device__ __forceinline__ void store_head(const float (&a)[kPairsPerLane], const float (&b)[kPairsPerLane], int half,
                                           int lane, typename Fmt::Code* dst, float* token_scale, float tensor_scale) {
  float scale = 1.0f;
  if constexpr (Fmt::kScale == Scale::PerTokenHead) {
    float amax = 0.0f;
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c)
      if (lane + 32 * c < half) amax = fmaxf(amax, fmaxf(fabsf(a[c]), fabsf(b[c])));
    amax = warp_max(amax);
    scale = fmaxf(__fdiv_rn(amax, Fmt::kMax), 1e-6f);  // kvfmt: max(absmax / qmax, kMinScale)
    if (lane == 0) *token_scale = scale;
  } else if constexpr (Fmt::kScale == Scale::PerTensor) {
    scale = tensor_scale;
  }
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {
    const int j = lane + 32 * c;
    if (j < half) {
      dst[j] = Fmt::encode(Fmt::kScale == Scale::None ? a[c] : __fdiv_rn(a[c], scale));
      dst[j + half] = Fmt::encode(Fmt::kScale == Scale::None ? b[c] : __fdiv_rn(b[c], scale));
    }
  }
}

// core/hadamard.h's rotation R (or R^T) of one head row held as above (a[c] = x[j],
// b[c] = x[j + half], j = lane + 32c; d = 2 * half a power of two), in the CPU's order: signs,
// butterflies of strides 1, 2, 4, ... (lanes below 32, registers c above, a/b at half), one
// scale multiply — so the floats equal num::hadamard_rotate's. Warp-uniform call.
__device__ __forceinline__ void hadamard_head(float (&a)[kPairsPerLane], float (&b)[kPairsPerLane], int half, int lane,
                                              bool inverse, uint32_t seed) {
  auto sign = [&](float (&x)[kPairsPerLane], int off) {
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c)
      if (num::hadamard_sign_negative(uint32_t(off + lane + 32 * c), seed)) x[c] = -x[c];
  };
  if (!inverse) {
    sign(a, 0);
    sign(b, half);
  }
  for (int s = 1; s < half && s < 32; s *= 2) {  // across lanes
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const float pa = __shfl_xor_sync(0xffffffffu, a[c], s), pb = __shfl_xor_sync(0xffffffffu, b[c], s);
      a[c] = (lane & s) ? pa - a[c] : a[c] + pa;
      b[c] = (lane & s) ? pb - b[c] : b[c] + pb;
    }
  }
#pragma unroll
  for (int s = 32; s < 32 * kPairsPerLane; s *= 2) {  // across registers
    if (s >= half) break;
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c)
      if ((c & (s / 32)) == 0) {
        const int c2 = c + s / 32;
        const float x0 = a[c], x1 = a[c2], y0 = b[c], y1 = b[c2];
        a[c] = x0 + x1;
        a[c2] = x0 - x1;
        b[c] = y0 + y1;
        b[c2] = y0 - y1;
      }
  }
  const float scale = num::hadamard_scale(2 * half);
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {  // stride half: a against b
    const float x = a[c], y = b[c];
    a[c] = (x + y) * scale;
    b[c] = (x - y) * scale;
  }
  if (inverse) {
    sign(a, 0);
    sign(b, half);
  }
}

// int4: the row's min and max over the warp, the values staged in shared memory so that each
// lane packs one word of 8 consecutive codes (d <= 256: 32 words).
__device__ __forceinline__ void store_head_i4(const float (&a)[kPairsPerLane], const float (&b)[kPairsPerLane], int half,
                                              int lane, float* stage, uint32_t* dst, uint32_t* slot) {
  float lo = INFINITY, hi = -INFINITY;
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {
    const int j = lane + 32 * c;
    if (j < half) {
      stage[j] = a[c];
      stage[j + half] = b[c];
      lo = fminf(lo, fminf(a[c], b[c]));
      hi = fmaxf(hi, fmaxf(a[c], b[c]));
    }
  }
  const I4Encoder enc = I4Encoder::over_warp(lo, hi);
  __syncwarp();
  if (lane == 0) *slot = enc.slot;
  if (lane < half / 4) dst[lane] = enc.word(stage + 8 * lane);
  __syncwarp();  // the stage is reused for V
}

template <class A, class Fmt>
__global__ void __launch_bounds__(kRopeWarps * 32) qkv_rope_store_kernel(const QkvRopeStoreParams p) {
  allow_dependents();
  pdl_wait();  // qkv is the previous kernel's output; this kernel also writes the KV pages
  const int heads = p.num_q_heads + p.num_kv_heads;
  const int64_t item = int64_t(blockIdx.x) * kRopeWarps + threadIdx.x / 32;
  if (item >= int64_t(p.num_tokens) * heads) return;  // whole warp: item is warp-uniform
  const int lane = threadIdx.x % 32;
  const int64_t t = item / heads;
  const int h = int(item % heads);  // < nh: q head h; else k head h - nh
  const int d = p.head_dim, half = d / 2;
  const size_t row_elems = p.qkv_stride > 0 ? size_t(p.qkv_stride) : size_t(p.num_q_heads + 2 * p.num_kv_heads) * size_t(d);
  const uint16_t* row = static_cast<const uint16_t*>(p.qkv) + size_t(t) * row_elems;
  const uint16_t* src = row + size_t(h) * size_t(d);
  const bool is_q = h < p.num_q_heads;

  float a[kPairsPerLane], b[kPairsPerLane];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {
    const int j = lane + 32 * c;
    a[c] = b[c] = 0.0f;
    if (j < half) {
      a[c] = A::load(src[j]);
      b[c] = A::load(src[j + half]);
      ss = fmaf(a[c], a[c], fmaf(b[c], b[c], ss));
    }
  }
  const float* nw = is_q ? p.q_norm : p.k_norm;
  if (nw) {  // Qwen3: RMSNorm over head_dim before RoPE
    const float inv = 1.0f / sqrtf(warp_sum(ss) / float(d) + p.eps);
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      if (j < half) {
        a[c] = nw[j] * (a[c] * inv);
        b[c] = nw[j + half] * (b[c] * inv);
      }
    }
  }
  const float pos = float(p.positions[t]);
  if (p.rotary_dim > 0 && p.rotary_dim < d) {
    // Partial rotary: the pairs are (j, j + rotary_dim / 2) for j < rotary_dim / 2, not the
    // registers' (j, j + half); the head goes through this warp's row of shared memory.
    __shared__ float row_buf[kRopeWarps][2 * 32 * kPairsPerLane];
    float* x = row_buf[threadIdx.x / 32];
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      if (j < half) {
        x[j] = a[c];
        x[j + half] = b[c];
      }
    }
    __syncwarp();
    const int rh = p.rotary_dim / 2;
    for (int j = lane; j < rh; j += 32) {
      float s, co;
      sincosf(pos * p.inv_freq[j], &s, &co);
      const float x0 = x[j], x1 = x[j + rh];
      x[j] = x0 * co - x1 * s;
      x[j + rh] = x1 * co + x0 * s;
    }
    __syncwarp();
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      if (j < half) {
        a[c] = x[j];
        b[c] = x[j + half];
      }
    }
  } else {
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      if (j < half) {
        float s, co;
        sincosf(pos * p.inv_freq[j], &s, &co);
        const float x0 = a[c], x1 = b[c];
        a[c] = x0 * co - x1 * s;
        b[c] = x1 * co + x0 * s;
      }
    }
  }
  if (p.rotate_k) hadamard_head(a, b, half, lane, false, p.rotation_seed);  // q and K
  if (is_q) {
    uint16_t* q = p.q_out + (size_t(t) * size_t(p.num_q_heads) + size_t(h)) * size_t(d);
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      if (j < half) {
        q[j] = act::BF16::store(a[c]);
        q[j + half] = act::BF16::store(b[c]);
      }
    }
    return;
  }
  const int g = h - p.num_q_heads;
  const SlotId slot = p.slots[t];
  if (slot < 0) return;  // padding row
  const int64_t block = slot / p.block_size;
  if (block >= p.num_blocks) return;  // a caller bug (the runner checks slots): never write outside the pool
  const int off = int(slot % p.block_size);
  const size_t sidx = (size_t(block) * size_t(p.num_kv_heads) + size_t(g)) * size_t(p.block_size) + size_t(off);
  const uint16_t* vsrc = row + size_t(p.num_q_heads + p.num_kv_heads + g) * size_t(d);
  auto load_v = [&] {
#pragma unroll
    for (int c = 0; c < kPairsPerLane; ++c) {
      const int j = lane + 32 * c;
      a[c] = b[c] = 0.0f;
      if (j < half) {
        a[c] = A::load(vsrc[j]);
        b[c] = A::load(vsrc[j + half]);
      }
    }
    if (p.rotate_v) hadamard_head(a, b, half, lane, false, p.rotation_seed);
  };
  // Exact sink / recent tokens: the row as it is about to be quantized, in the act dtype.
  uint16_t *exact_k_row = nullptr, *exact_v_row = nullptr;
  if (p.exact_slots) {
    const SlotId es = p.exact_slots[t];
    if (es >= 0 && es / p.block_size < p.num_exact) {
      const size_t e = (size_t(es / p.block_size) * size_t(p.num_kv_heads) + size_t(g)) * size_t(p.block_size) +
                       size_t(es % p.block_size);
      exact_k_row = p.exact_k + e * size_t(d);
      exact_v_row = p.exact_v + e * size_t(d);
    }
  }
  using ExactFmt = std::conditional_t<std::is_same_v<A, act::BF16>, FmtBF16, FmtF16>;  // the act dtype, unscaled
  auto store_exact = [&](uint16_t* dst) {
    if (dst) store_head<ExactFmt>(a, b, half, lane, dst, nullptr, 1.0f);
  };
  store_exact(exact_k_row);
  // One side's row (a, b) into its pages, in the side's format (K's and V's may differ).
  using KF = KOf<Fmt>;
  using VF = VOf<Fmt>;
  __shared__ float stage[kRopeWarps][kIsInt4<KF> || kIsInt4<VF> ? 2 * 32 * kPairsPerLane : 1];
  auto store_side = [&](auto fmt, void* cache, float* token_scale, const float* tensor_scale) {
    using F = decltype(fmt);
    if constexpr (kIsInt4<F>) {
      store_head_i4(a, b, half, lane, stage[threadIdx.x / 32], static_cast<uint32_t*>(cache) + sidx * size_t(d) / 8,
                    reinterpret_cast<uint32_t*>(token_scale) + sidx);
    } else {
      float ts = 1.0f;
      if constexpr (F::kScale == Scale::PerTensor) ts = tensor_scale[p.num_tensor_scales == 1 ? 0 : g];
      store_head<F>(a, b, half, lane, static_cast<typename F::Code*>(cache) + sidx * size_t(d), token_scale + sidx, ts);
    }
  };
  store_side(KF{}, p.k_cache, p.k_token_scale, p.k_tensor_scale);
  load_v();
  store_exact(exact_v_row);
  store_side(VF{}, p.v_cache, p.v_token_scale, p.v_tensor_scale);
}

// out = R^T x per head row (the attention output of a rotated layer), bf16 in, act out.
template <class A>
__global__ void __launch_bounds__(kRopeWarps * 32) unrotate_heads_kernel(const uint16_t* in, void* out, int64_t rows,
                                                                         int d, uint32_t seed) {
  allow_dependents();
  pdl_wait();
  const int64_t r = int64_t(blockIdx.x) * kRopeWarps + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32, half = d / 2;
  const uint16_t* src = in + size_t(r) * size_t(d);
  float a[kPairsPerLane], b[kPairsPerLane];
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {
    const int j = lane + 32 * c;
    a[c] = j < half ? act::BF16::load(src[j]) : 0.0f;
    b[c] = j < half ? act::BF16::load(src[j + half]) : 0.0f;
  }
  hadamard_head(a, b, half, lane, true, seed);
  uint16_t* dst = static_cast<uint16_t*>(out) + size_t(r) * size_t(d);
#pragma unroll
  for (int c = 0; c < kPairsPerLane; ++c) {
    const int j = lane + 32 * c;
    if (j < half) {
      dst[j] = A::store(a[c]);
      dst[j + half] = A::store(b[c]);
    }
  }
}

// ---- SiLU-and-mul, conversion -----------------------------------------------------------

template <class A, GluActivation F>
__global__ void glu_kernel(const uint16_t* gu, uint16_t* out, int rows, int inter) {
  allow_dependents();
  pdl_wait();
  const size_t n = size_t(rows) * size_t(inter);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(inter), c = i % size_t(inter);
    const float g = A::load(gu[r * 2 * size_t(inter) + c]);
    const float u = A::load(gu[r * 2 * size_t(inter) + size_t(inter) + c]);
    out[i] = A::store(glu_gate<F>(g) * u);
  }
}

template <class A>
__global__ void bf16_to_act_kernel(const uint16_t* in, uint16_t* out, size_t n) {
  allow_dependents();
  pdl_wait();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = A::store(act::BF16::load(in[i]));
}

template <class A>
__global__ void f32_rows_to_act_kernel(const float* src, int rows, int cols, uint16_t* dst, int ld) {
  allow_dependents();
  pdl_wait();
  const size_t n = size_t(rows) * size_t(cols);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(cols), c = i % size_t(cols);
    dst[r * size_t(ld) + c] = A::store(src[i]);
  }
}

// ---- greedy sampling --------------------------------------------------------------------

constexpr int kArgmaxThreads = 256;

__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const float* logits, int vocab, TokenId* out) {
  allow_dependents();
  pdl_wait();
  const float* row = logits + size_t(blockIdx.x) * size_t(vocab);
  float best = -INFINITY;
  int idx = vocab;  // loses every tie: a row of -inf still yields index 0
  for (int i = threadIdx.x; i < vocab; i += kArgmaxThreads) {
    const float v = row[i];
    if (argmax_better(v, i, best, idx)) {
      best = v;
      idx = i;
    }
  }
  idx = block_argmax<kArgmaxThreads>(best, idx);
  if (threadIdx.x == 0) out[blockIdx.x] = TokenId(idx < vocab ? idx : 0);
}

// ---- KV page copies ---------------------------------------------------------------------

__global__ void copy_pages_kernel(const KVPagePools* layers, const BlockId* pairs) {
  const KVPagePools L = layers[blockIdx.y];
  uint8_t* base = nullptr;
  uint64_t bytes = 0;
  switch (blockIdx.z) {
    case 0: base = L.k, bytes = L.k_page_bytes; break;
    case 1: base = L.v, bytes = L.v_page_bytes; break;
    case 2: base = L.k_scale, bytes = L.k_scale_page_bytes; break;
    default: base = L.v_scale, bytes = L.v_scale_page_bytes; break;
  }
  if (!base || bytes == 0) return;
  const BlockId src = pairs[2 * blockIdx.x], dst = pairs[2 * blockIdx.x + 1];
  if (src == dst) return;
  const uint8_t* s = base + uint64_t(src) * bytes;
  uint8_t* d = base + uint64_t(dst) * bytes;
  if (bytes % 16 == 0) {  // pools are 256-byte aligned, so 16-byte pages are 16-byte aligned
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (uint64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
  }
}

// Pages <-> the packed form the host tier keeps (one page after the other, each layer by layer:
// K codes, V codes, K scales, V scales, the parts it has). blockIdx: (page of the list, layer,
// part).
__device__ __forceinline__ void page_part(const KVPagePools& L, unsigned part, uint8_t*& base, uint64_t& bytes,
                                          uint64_t& offset) {
  offset = L.page_offset;
  switch (part) {
    case 0: base = L.k, bytes = L.k_page_bytes; break;
    case 1: base = L.v, bytes = L.v_page_bytes, offset += L.k_page_bytes; break;
    case 2: base = L.k_scale, bytes = L.k_scale_page_bytes, offset += L.k_page_bytes + L.v_page_bytes; break;
    default:
      base = L.v_scale, bytes = L.v_scale_page_bytes;
      offset += L.k_page_bytes + L.v_page_bytes + L.k_scale_page_bytes;
      break;
  }
}

template <bool kPack>
__global__ void pack_pages_kernel(const KVPagePools* layers, PackedPageList list, uint8_t* packed, uint64_t page_bytes) {
  uint8_t* base = nullptr;
  uint64_t bytes = 0, offset = 0;
  page_part(layers[blockIdx.y], blockIdx.z, base, bytes, offset);
  if (!base || bytes == 0) return;
  uint8_t* pool = base + uint64_t(list.pages[blockIdx.x]) * bytes;
  uint8_t* flat = packed + uint64_t(blockIdx.x) * page_bytes + offset;
  const uint8_t* s = kPack ? pool : flat;
  uint8_t* d = kPack ? flat : pool;
  if (bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) % 16 == 0) {
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (uint64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

void embed_rows(DType act, const void* table, const TokenId* tokens, int rows, int hidden, float* x, void* stream,
                float scale) {
  if (rows <= 0) return;
  dispatch_act(act, [&](auto a) {
    using A = decltype(a);
    embed_kernel<A><<<unsigned(rows), 256, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<const uint16_t*>(table),
                                                                                   tokens, hidden, x, scale);
    KVLM_CUDA_CHECK_LAUNCH("embed_rows");
  });
}

namespace {
// The norm kernel's values per thread and threads for a row of `hidden`.
int norm_per(int hidden) { return hidden <= kNormMaxThreads * 4 ? 4 : hidden <= kNormMaxThreads * 8 ? 8 : 16; }
int norm_threads(int hidden) {
  const int per = norm_per(hidden);
  return std::min(kNormMaxThreads, ((hidden + per - 1) / per + 31) / 32 * 32);
}
}  // namespace

bool rmsnorm_fp8_fits(int hidden, int group) {
  if (hidden <= 0 || hidden > kNormMaxThreads * 16 || hidden % 8 != 0) return false;  // (quantize_rows_fp8's k % 8)
  return group == 0 || (group == 128 && hidden % 128 == 0 && norm_threads(hidden) % 128 == 0);
}

void add_rmsnorm(const AddRmsNormParams& p, void* stream) {
  if (p.rows <= 0) return;
  if (p.hidden <= 0 || (!p.x && !p.delta) || !p.weight || (!p.out && !p.out_f32) || (p.codes && !p.out))
    throw Error("add_rmsnorm: missing buffers or hidden size");
  if (p.hidden > kNormMaxThreads * 16)
    throw Error("the CUDA RMSNorm handles hidden sizes up to " + std::to_string(kNormMaxThreads * 16) + ", got " +
                std::to_string(p.hidden));
  if (p.codes && (!p.code_scales || p.row_map || !rmsnorm_fp8_fits(p.hidden, p.code_group)))
    throw Error("add_rmsnorm: FP8 codes need their scales, no row map, and a row of " + std::to_string(p.hidden) +
                " values that the norm quantizes in groups of " + std::to_string(p.code_group) +
                " (rmsnorm_fp8_fits)");
  const int per = norm_per(p.hidden);
  const int threads = norm_threads(p.hidden);
  dispatch_act(p.act, [&](auto a) {
    using A = decltype(a);
    const auto st = static_cast<cudaStream_t>(stream);
    const dim3 grid{unsigned(p.rows)}, block{unsigned(threads)};
    if (per == 4) KVLM_CUDA_CHECK(launch_pdl<add_rmsnorm_kernel<A, 4>>(grid, block, 0, st, p));
    else if (per == 8) KVLM_CUDA_CHECK(launch_pdl<add_rmsnorm_kernel<A, 8>>(grid, block, 0, st, p));
    else KVLM_CUDA_CHECK(launch_pdl<add_rmsnorm_kernel<A, 16>>(grid, block, 0, st, p));
  });
}

void qkv_rope_store(const QkvRopeStoreParams& p, void* stream) {
  if (p.num_tokens <= 0) return;
  if (p.head_dim <= 0 || p.head_dim % 2 != 0 || p.head_dim > 2 * 32 * kPairsPerLane)
    throw Error("qkv_rope_store: head_dim must be even and at most 256, got " + std::to_string(p.head_dim));
  if (p.num_q_heads <= 0 || p.num_kv_heads <= 0 || p.block_size <= 0)
    throw Error("qkv_rope_store: head counts and block_size must be positive");
  if (p.rotary_dim < 0 || p.rotary_dim > p.head_dim || p.rotary_dim % 2 != 0)
    throw Error("qkv_rope_store: rotary_dim must be even and at most head_dim, got " + std::to_string(p.rotary_dim));
  if (p.qkv_stride != 0 && p.qkv_stride < int64_t(p.num_q_heads + 2 * p.num_kv_heads) * p.head_dim)
    throw Error("qkv_rope_store: a row of qkv_stride " + std::to_string(p.qkv_stride) + " cannot hold q, k and v");
  dispatch_act(p.act, [&](auto a) {
    using A = decltype(a);
    dispatch_cuda_kv_pair(k_format_of(p), v_format_of(p), "qkv_rope_store", [&](auto fmt) {
      using Fmt = decltype(fmt);
      check_kv_pages<Fmt>(p, "qkv_rope_store");
      if ((p.rotate_k || p.rotate_v) && !num::is_pow2(p.head_dim))
        throw Error("qkv_rope_store: the Hadamard rotation needs a power-of-two head_dim, got " + std::to_string(p.head_dim));
      const int64_t items = int64_t(p.num_tokens) * (p.num_q_heads + p.num_kv_heads);
      const unsigned grid = unsigned((items + kRopeWarps - 1) / kRopeWarps);
      KVLM_CUDA_CHECK(launch_pdl<qkv_rope_store_kernel<A, Fmt>>(dim3(grid), dim3(kRopeWarps * 32), 0,
                                                                static_cast<cudaStream_t>(stream), p));
    });
  });
}

void unrotate_heads(DType act, const uint16_t* in, void* out, int64_t rows, int head_dim, uint32_t seed, void* stream) {
  if (rows <= 0) return;
  if (!num::is_pow2(head_dim) || head_dim > 2 * 32 * kPairsPerLane)
    throw Error("unrotate_heads: head_dim must be a power of two up to 256, got " + std::to_string(head_dim));
  dispatch_act(act, [&](auto a) {
    using A = decltype(a);
    const unsigned grid = unsigned((rows + kRopeWarps - 1) / kRopeWarps);
    KVLM_CUDA_CHECK(launch_pdl<unrotate_heads_kernel<A>>(dim3(grid), dim3(kRopeWarps * 32), 0,
                                                         static_cast<cudaStream_t>(stream), in, out, rows, head_dim,
                                                         seed));
  });
}

void glu(DType act, GluActivation f, const void* gu, void* out, int rows, int inter, void* stream) {
  if (rows <= 0) return;
  KVLM_CHECK(f == GluActivation::Silu || f == GluActivation::GeluTanh, "glu: the dense MLP's activation is SiLU or GELU");
  dispatch_act(act, [&](auto a) {
    using A = decltype(a);
    const dim3 grid(grid_for(size_t(rows) * size_t(inter), 256)), block(256);
    const auto st = static_cast<cudaStream_t>(stream);
    const auto* in = static_cast<const uint16_t*>(gu);
    auto* o = static_cast<uint16_t*>(out);
    if (f == GluActivation::Silu)
      KVLM_CUDA_CHECK(launch_pdl<glu_kernel<A, GluActivation::Silu>>(grid, block, 0, st, in, o, rows, inter));
    else
      KVLM_CUDA_CHECK(launch_pdl<glu_kernel<A, GluActivation::GeluTanh>>(grid, block, 0, st, in, o, rows, inter));
  });
}

void bf16_to_act(DType act, const uint16_t* in, void* out, size_t n, void* stream) {
  if (n == 0) return;
  dispatch_act(act, [&](auto a) {
    using A = decltype(a);
    KVLM_CUDA_CHECK(launch_pdl<bf16_to_act_kernel<A>>(dim3(grid_for(n, 256)), dim3(256), 0, static_cast<cudaStream_t>(stream),
                                                      in, static_cast<uint16_t*>(out), n));
  });
}

void f32_rows_to_act(DType act, const float* src, int rows, int cols, void* dst, int ld, void* stream) {
  const size_t n = size_t(rows) * size_t(cols);
  if (n == 0) return;
  dispatch_act(act, [&](auto a) {
    using A = decltype(a);
    KVLM_CUDA_CHECK(launch_pdl<f32_rows_to_act_kernel<A>>(dim3(grid_for(n, 256)), dim3(256), 0,
                                                           static_cast<cudaStream_t>(stream), src, rows, cols,
                                                           static_cast<uint16_t*>(dst), ld));
  });
}

void argmax_rows(const float* logits, int rows, int vocab, TokenId* out, void* stream) {
  if (rows <= 0) return;
  if (vocab <= 0) throw Error("argmax_rows: empty vocabulary");
  KVLM_CUDA_CHECK(launch_pdl<argmax_kernel>(dim3(unsigned(rows)), dim3(kArgmaxThreads), 0, static_cast<cudaStream_t>(stream),
                                             logits, vocab, out));
}

void copy_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pairs, int num_pairs, void* stream) {
  if (num_pairs <= 0 || num_layers <= 0) return;
  if (num_pairs > 65535 || num_layers > 65535) throw Error("copy_kv_pages: at most 65535 pairs and layers per call");
  copy_pages_kernel<<<dim3(unsigned(num_pairs), unsigned(num_layers), 4), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      layers, pairs);
  KVLM_CUDA_CHECK_LAUNCH("copy_kv_pages");
}

namespace {
void launch_pack(bool pack, const KVPagePools* layers, int num_layers, const BlockId* pages, int num_pages, uint8_t* packed,
                 uint64_t page_bytes, void* stream) {
  if (num_pages <= 0 || num_layers <= 0) return;
  if (num_pages > kMaxPackedPages || num_layers > 65535)
    throw Error("pack_kv_pages: at most " + std::to_string(kMaxPackedPages) + " pages and 65535 layers per call");
  PackedPageList list{};
  for (int i = 0; i < num_pages; ++i) list.pages[i] = pages[i];
  const dim3 grid(unsigned(num_pages), unsigned(num_layers), 4);
  const auto st = static_cast<cudaStream_t>(stream);
  if (pack) pack_pages_kernel<true><<<grid, 256, 0, st>>>(layers, list, packed, page_bytes);
  else pack_pages_kernel<false><<<grid, 256, 0, st>>>(layers, list, packed, page_bytes);
  KVLM_CUDA_CHECK_LAUNCH(pack ? "pack_kv_pages" : "unpack_kv_pages");
}
}  // namespace

void pack_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pages, int num_pages, uint8_t* packed,
                   uint64_t page_bytes, void* stream) {
  launch_pack(true, layers, num_layers, pages, num_pages, packed, page_bytes, stream);
}

void unpack_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pages, int num_pages, const uint8_t* packed,
                     uint64_t page_bytes, void* stream) {
  launch_pack(false, layers, num_layers, pages, num_pages, const_cast<uint8_t*>(packed), page_bytes, stream);
}

}  // namespace kvlm::cuda

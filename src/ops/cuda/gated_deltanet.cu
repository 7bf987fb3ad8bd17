// Gated DeltaNet on CUDA (gated_deltanet.h). The formulas and the state layout are
// ops/cpu/linear_attention.h's; the comments here say how the work is cut.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/error.h"
#include "ops/cuda/act_types.cuh"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gated_deltanet.h"
#include "ops/cuda/kernel_util.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kMaxConv = 8;  // conv kernel sizes the window registers hold (Qwen: 4)
constexpr int kConvThreads = 128;
constexpr int kNormWarps = 4;

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

// The sizes every kernel derives from the params.
struct Dims {
  int kd, vd, cd, in_dim;
  size_t conv_n;  // conv window values (fp32) at the start of a slot; the matrices follow
};

// A state matrix element held as fp32 or bf16 (GatedDeltaNetParams::state_dtype).
struct StateF32 {
  using T = float;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};
struct StateBF16 {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
Dims dims_of(const GatedDeltaNetParams& p) {
  Dims d{};
  d.kd = p.k_heads * p.dk;
  d.vd = p.v_heads * p.dv;
  d.cd = 2 * d.kd + d.vd;
  d.in_dim = d.cd + d.vd + 2 * p.v_heads;
  d.conv_n = size_t(p.conv_kernel - 1) * size_t(d.cd);
  return d;
}

// A thread per (channel, sequence). The window holds the last K - 1 inputs right-aligned in
// kMaxConv - 1 registers (the taps right-aligned too, zeros on the left), so every index is a
// compile-time one.
template <class A>
__global__ void __launch_bounds__(kConvThreads) conv_kernel(const GatedDeltaNetParams p, const Dims d) {
  const int s = int(blockIdx.y), c = int(blockIdx.x) * kConvThreads + int(threadIdx.x);
  if (c >= d.cd) return;
  const int r0 = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - r0, slot = p.state_slots[s], K = p.conv_kernel;
  const bool fresh = p.kv_lens[s] == n;
  float* st = slot >= 0 ? reinterpret_cast<float*>(p.states + size_t(slot) * p.state_bytes) : nullptr;
  float win[kMaxConv - 1], w[kMaxConv];
#pragma unroll
  for (int jj = 0; jj < kMaxConv - 1; ++jj) {
    const int j = jj - (kMaxConv - K);  // the state's row for this register, when >= 0
    win[jj] = j >= 0 && st && !fresh ? st[size_t(j) * size_t(d.cd) + size_t(c)] : 0.0f;
  }
#pragma unroll
  for (int jj = 0; jj < kMaxConv; ++jj) {
    const int j = jj - (kMaxConv - K);
    w[jj] = j >= 0 ? p.conv_w[size_t(c) * size_t(K) + size_t(j)] : 0.0f;
  }
  const auto* mixed = static_cast<const uint16_t*>(p.mixed);
  for (int t = 0; t < n; ++t) {
    const size_t r = size_t(r0 + t);
    const float x = A::load(mixed[r * size_t(d.in_dim) + size_t(c)]);
    float acc = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kMaxConv - 1; ++jj) acc += w[jj] * win[jj];
    acc += w[kMaxConv - 1] * x;
    p.qkv[r * size_t(d.cd) + size_t(c)] = acc * sigmoidf(acc);
#pragma unroll
    for (int jj = 0; jj < kMaxConv - 2; ++jj) win[jj] = win[jj + 1];
    win[kMaxConv - 2] = x;
  }
  if (st)
#pragma unroll
    for (int jj = 0; jj < kMaxConv - 1; ++jj) {
      const int j = jj - (kMaxConv - K);
      if (j >= 0) st[size_t(j) * size_t(d.cd) + size_t(c)] = win[jj];
    }
}

// A warp per (sequence, value head, 32 columns of the state): S[:, j] in registers, one lane
// per column j, the rows of the sequence in order. q and k of the row's key head are
// normalized by the warp and shared through shared memory. DK, the key head size, is a
// template argument so that the column stays in registers; S, how the matrix is held (fp32 or
// bf16, computed in fp32 either way).
template <class A, class S, int DK>
__global__ void __launch_bounds__(32) delta_kernel(const GatedDeltaNetParams p, const Dims d) {
  constexpr int kPer = (DK + 31) / 32;  // q / k values per lane
  const int s = int(blockIdx.x), h = int(blockIdx.y), lane = int(threadIdx.x), j = int(blockIdx.z) * 32 + lane;
  const int dv = p.dv, kh = h / (p.v_heads / p.k_heads);
  const int r0 = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - r0, slot = p.state_slots[s];
  const bool fresh = p.kv_lens[s] == n, col = j < dv;
  using T = typename S::T;
  T* st = slot >= 0 ? reinterpret_cast<T*>(p.states + size_t(slot) * p.state_bytes + d.conv_n * sizeof(float)) +
                          size_t(h) * size_t(DK) * size_t(dv)
                    : nullptr;
  float Sc[DK];  // column j of the head's matrix
#pragma unroll
  for (int i = 0; i < DK; ++i) Sc[i] = col && st && !fresh ? S::load(st[size_t(i) * size_t(dv) + size_t(j)]) : 0.0f;
  __shared__ float qs[DK], ks[DK];
  const float neg_a = -expf(p.a_log[h]), dt_bias = p.dt_bias[h], q_scale = 1.0f / sqrtf(float(DK));
  const auto* mixed = static_cast<const uint16_t*>(p.mixed);
  for (int t = 0; t < n; ++t) {
    const size_t r = size_t(r0 + t);
    const float* qrow = p.qkv + r * size_t(d.cd) + size_t(kh) * size_t(DK);
    const float* krow = qrow + d.kd;
    float qv[kPer], kv[kPer], sq = 0.0f, sk = 0.0f;
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      qv[c] = i < DK ? qrow[i] : 0.0f;
      kv[c] = i < DK ? krow[i] : 0.0f;
      sq += qv[c] * qv[c];
      sk += kv[c] * kv[c];
    }
    const float iq = q_scale / sqrtf(warp_sum(sq) + 1e-6f), ik = 1.0f / sqrtf(warp_sum(sk) + 1e-6f);
    __syncwarp();  // the previous row's reads of qs / ks are done
#pragma unroll
    for (int c = 0; c < kPer; ++c) {
      const int i = lane + 32 * c;
      if (i < DK) {
        qs[i] = qv[c] * iq;
        ks[i] = kv[c] * ik;
      }
    }
    __syncwarp();
    // The gates: g = -exp(A_log) softplus(a + dt_bias) (PyTorch's softplus: x past 20 is x),
    // beta = sigmoid(b); b and a are the projection's last 2 v_heads columns.
    const uint16_t* mrow = mixed + r * size_t(d.in_dim) + size_t(d.cd + d.vd);
    const float beta = sigmoidf(A::load(mrow[h]));
    const float xa = A::load(mrow[p.v_heads + h]) + dt_bias;
    const float decay = expf(neg_a * (xa > 20.0f ? xa : log1pf(expf(xa))));
    const float v = col ? p.qkv[r * size_t(d.cd) + size_t(2 * d.kd) + size_t(h) * size_t(dv) + size_t(j)] : 0.0f;
    float sk_dot = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      Sc[i] *= decay;
      sk_dot += Sc[i] * ks[i];
    }
    const float delta = (v - sk_dot) * beta;
    __syncwarp();  // a memory barrier: ks is read again below, not kept in DK more registers
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < DK; ++i) {
      Sc[i] += ks[i] * delta;
      o += Sc[i] * qs[i];
    }
    if (col) p.core[r * size_t(d.vd) + size_t(h) * size_t(dv) + size_t(j)] = o;
  }
  if (st && col)
#pragma unroll
    for (int i = 0; i < DK; ++i) st[size_t(i) * size_t(dv) + size_t(j)] = S::store(Sc[i]);
}

// A warp per (row, value head): out = w * x / sqrt(mean(x^2) + eps) * silu(z).
template <class A>
__global__ void __launch_bounds__(kNormWarps * 32) norm_kernel(const GatedDeltaNetParams p, const Dims d) {
  const int64_t item = int64_t(blockIdx.x) * kNormWarps + threadIdx.x / 32;
  if (item >= int64_t(p.num_tokens) * p.v_heads) return;
  const int lane = int(threadIdx.x % 32);
  const size_t r = size_t(item / p.v_heads), h = size_t(item % p.v_heads), dv = size_t(p.dv);
  const float* x = p.core + r * size_t(d.vd) + h * dv;
  const uint16_t* z = static_cast<const uint16_t*>(p.mixed) + r * size_t(d.in_dim) + size_t(d.cd) + h * dv;
  float ss = 0.0f;
  for (size_t i = size_t(lane); i < dv; i += 32) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(warp_sum(ss) / float(dv) + p.eps);
  uint16_t* out = static_cast<uint16_t*>(p.out) + r * size_t(d.vd) + h * dv;
  for (size_t i = size_t(lane); i < dv; i += 32) {
    const float zi = A::load(z[i]);
    out[i] = A::store(p.norm_w[i] * (x[i] * inv) * (zi * sigmoidf(zi)));
  }
}

template <class A>
__global__ void sigmoid_gate_kernel(uint16_t* x, const uint16_t* src, int rows, int cols, int64_t stride, int64_t col0) {
  const size_t n = size_t(rows) * size_t(cols);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const size_t r = i / size_t(cols), c = i % size_t(cols);
    x[i] = A::store(A::load(x[i]) * sigmoidf(A::load(src[r * size_t(stride) + size_t(col0) + c])));
  }
}

template <class A>
__global__ void add_gated_rows_kernel(uint16_t* y, const uint16_t* s, const float* gate, int rows, int cols) {
  const size_t n = size_t(rows) * size_t(cols);
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = A::store(A::load(y[i]) + sigmoidf(gate[i / size_t(cols)]) * A::load(s[i]));
}

}  // namespace

bool gated_delta_net_fits(int dk, int dv, int conv_kernel) {
  return (dk == 16 || dk == 32 || dk == 64 || dk == 128) && dv >= 1 && conv_kernel >= 1 && conv_kernel <= kMaxConv;
}

void gated_delta_net(const GatedDeltaNetParams& p, void* stream) {
  if (p.num_tokens <= 0 || p.num_seqs <= 0) return;
  KVLM_CHECK(gated_delta_net_fits(p.dk, p.dv, p.conv_kernel) && p.k_heads > 0 && p.v_heads % p.k_heads == 0,
             "gated_delta_net: key heads of 16, 32, 64 or 128 and conv kernels of at most " + std::to_string(kMaxConv) +
                 " taps");
  KVLM_CHECK(p.num_seqs <= 65535 && p.v_heads <= 65535, "gated_delta_net: grid too large");
  KVLM_CHECK(p.state_dtype == DType::F32 || p.state_dtype == DType::BF16, "gated_delta_net: states are fp32 or bf16");
  const Dims d = dims_of(p);
  const auto st = static_cast<cudaStream_t>(stream);
  act::dispatch(p.act, "gated_delta_net", [&](auto a) {
    using A = decltype(a);
    conv_kernel<A><<<dim3(unsigned((d.cd + kConvThreads - 1) / kConvThreads), unsigned(p.num_seqs)), kConvThreads, 0, st>>>(
        p, d);
    KVLM_CUDA_CHECK_LAUNCH("gated_delta_net conv_kernel");
    const dim3 grid(unsigned(p.num_seqs), unsigned(p.v_heads), unsigned((p.dv + 31) / 32));
    const auto launch = [&](auto s) {
      using S = decltype(s);
      switch (p.dk) {
        case 16: delta_kernel<A, S, 16><<<grid, 32, 0, st>>>(p, d); break;
        case 32: delta_kernel<A, S, 32><<<grid, 32, 0, st>>>(p, d); break;
        case 64: delta_kernel<A, S, 64><<<grid, 32, 0, st>>>(p, d); break;
        default: delta_kernel<A, S, 128><<<grid, 32, 0, st>>>(p, d); break;
      }
    };
    if (p.state_dtype == DType::BF16) launch(StateBF16{});
    else launch(StateF32{});
    KVLM_CUDA_CHECK_LAUNCH("gated_delta_net delta_kernel");
    const int64_t items = int64_t(p.num_tokens) * p.v_heads;
    norm_kernel<A><<<unsigned((items + kNormWarps - 1) / kNormWarps), kNormWarps * 32, 0, st>>>(p, d);
    KVLM_CUDA_CHECK_LAUNCH("gated_delta_net norm_kernel");
  });
}

void sigmoid_gate(DType act, void* x, const void* src, int rows, int cols, int64_t src_stride, int64_t col0,
                  void* stream) {
  const size_t n = size_t(rows) * size_t(cols);
  if (n == 0) return;
  act::dispatch(act, "sigmoid_gate", [&](auto a) {
    using A = decltype(a);
    sigmoid_gate_kernel<A><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint16_t*>(x), static_cast<const uint16_t*>(src), rows, cols, src_stride, col0);
    KVLM_CUDA_CHECK_LAUNCH("sigmoid_gate_kernel");
  });
}

void add_gated_rows(DType act, void* y, const void* s, const float* gate, int rows, int cols, void* stream) {
  const size_t n = size_t(rows) * size_t(cols);
  if (n == 0) return;
  act::dispatch(act, "add_gated_rows", [&](auto a) {
    using A = decltype(a);
    add_gated_rows_kernel<A><<<grid_for(n, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint16_t*>(y), static_cast<const uint16_t*>(s), gate, rows, cols);
    KVLM_CUDA_CHECK_LAUNCH("add_gated_rows_kernel");
  });
}

}  // namespace kvlm::cuda

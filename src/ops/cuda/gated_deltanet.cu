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
#include "ops/cuda/gated_deltanet_common.cuh"
#include "ops/cuda/kernel_util.cuh"

namespace kvlm::cuda {

namespace {

using gdn::Dims;
using gdn::NormedQk;
using gdn::sigmoidf;
using gdn::StateBF16;
using gdn::StateF32;

constexpr int kMaxConv = 8;  // conv kernel sizes the window registers hold (Qwen: 4)
constexpr int kConvThreads = 128;
constexpr int kConvRows = 64;  // rows per conv thread (a long prompt's rows run in parallel blocks)
constexpr int kNormWarps = 4;

// A thread per (channel, sequence, block of kConvRows rows). The window holds the last K - 1
// inputs right-aligned in kMaxConv - 1 registers (the taps right-aligned too, zeros on the
// left), so every index is a compile-time one; a block's window starts from the step's rows
// before it, or from the conv state (zeros for a sequence whose step starts at position 0).
// A sequence of one block leaves its window in the state; a longer one's state is written by
// conv_state_kernel afterwards (its first block reads the old state while the last ends).
template <class A>
__global__ void __launch_bounds__(kConvThreads) conv_kernel(const GatedDeltaNetParams p, const Dims d) {
  const int s = int(blockIdx.y), c = int(blockIdx.x) * kConvThreads + int(threadIdx.x), t0 = int(blockIdx.z) * kConvRows;
  if (c >= d.cd) return;
  const int r0 = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - r0, slot = p.state_slots[s], K = p.conv_kernel;
  if (t0 >= n) return;
  const bool fresh = p.kv_lens[s] == n;
  float* st = slot >= 0 ? reinterpret_cast<float*>(p.states + size_t(slot) * p.state_bytes) : nullptr;
  const auto* mixed = static_cast<const uint16_t*>(p.mixed);
  float win[kMaxConv - 1], w[kMaxConv];
#pragma unroll
  for (int jj = 0; jj < kMaxConv - 1; ++jj) {
    const int j = jj - (kMaxConv - K);  // the window's row for this register, when >= 0
    const int tt = t0 - (K - 1) + j;    // its row in the step (< 0: the state's row K - 1 + tt)
    win[jj] = j < 0 ? 0.0f
              : tt >= 0 ? A::load(mixed[size_t(r0 + tt) * size_t(d.in_dim) + size_t(c)])
              : st && !fresh ? st[size_t(K - 1 + tt) * size_t(d.cd) + size_t(c)]
                             : 0.0f;
  }
#pragma unroll
  for (int jj = 0; jj < kMaxConv; ++jj) {
    const int j = jj - (kMaxConv - K);
    w[jj] = j >= 0 ? p.conv_w[size_t(c) * size_t(K) + size_t(j)] : 0.0f;
  }
  const int t1 = min(n, t0 + kConvRows);
  for (int t = t0; t < t1; ++t) {
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
  if (st && n <= kConvRows)
#pragma unroll
    for (int jj = 0; jj < kMaxConv - 1; ++jj) {
      const int j = jj - (kMaxConv - K);
      if (j >= 0) st[size_t(j) * size_t(d.cd) + size_t(c)] = win[jj];
    }
}

// The conv state of sequences longer than one conv block: their last K - 1 inputs.
template <class A>
__global__ void __launch_bounds__(kConvThreads) conv_state_kernel(const GatedDeltaNetParams p, const Dims d) {
  const int s = int(blockIdx.y), c = int(blockIdx.x) * kConvThreads + int(threadIdx.x);
  if (c >= d.cd) return;
  const int r0 = p.cu_q_lens[s], n = p.cu_q_lens[s + 1] - r0, slot = p.state_slots[s], K = p.conv_kernel;
  if (n <= kConvRows || slot < 0) return;
  float* st = reinterpret_cast<float*>(p.states + size_t(slot) * p.state_bytes);
  const auto* mixed = static_cast<const uint16_t*>(p.mixed);
  for (int j = 0; j < K - 1; ++j)
    st[size_t(j) * size_t(d.cd) + size_t(c)] = A::load(mixed[size_t(r0 + n - (K - 1) + j) * size_t(d.in_dim) + size_t(c)]);
}

// A warp per (sequence, value head, 32 columns of the state): S[:, j] in registers, one lane
// per column j, the rows of the sequence in order. q and k of the row's key head are
// normalized by the warp and shared through shared memory. DK, the key head size, is a
// template argument so that the column stays in registers; S, how the matrix is held (fp32 or
// bf16, computed in fp32 either way).
template <class A, class S, int DK>
__global__ void __launch_bounds__(32) delta_kernel(const GatedDeltaNetParams p, const Dims d) {
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
  const float neg_a = -expf(p.a_log[h]), dt_bias = p.dt_bias[h];
  const auto* mixed = static_cast<const uint16_t*>(p.mixed);
  for (int t = 0; t < n; ++t) {
    const size_t r = size_t(r0 + t);
    const float* qrow = p.qkv + r * size_t(d.cd) + size_t(kh) * size_t(DK);
    const NormedQk<DK> qk(qrow, qrow + d.kd, lane);
    __syncwarp();  // the previous row's reads of qs / ks are done
    qk.store(qs, ks, lane);
    __syncwarp();
    // The gates: beta = sigmoid(b), the decay exp(g); b and a are the projection's last 2
    // v_heads columns.
    const uint16_t* mrow = mixed + r * size_t(d.in_dim) + size_t(d.cd + d.vd);
    const float beta = sigmoidf(A::load(mrow[h]));
    const float decay = expf(gdn::log_decay(neg_a, A::load(mrow[p.v_heads + h]), dt_bias));
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
  const Dims d = gdn::dims_of(p);
  const auto st = static_cast<cudaStream_t>(stream);
  const int max_q = p.max_q_len > 0 ? std::min(p.max_q_len, p.num_tokens) : p.num_tokens;
  const int conv_blocks = (max_q + kConvRows - 1) / kConvRows;
  KVLM_CHECK(conv_blocks <= 65535, "gated_delta_net: sequence too long for the conv grid");
  const bool chunked = p.scratch && gated_delta_net_takes_chunks(p.num_tokens, max_q, p.dk, p.dv);
  act::dispatch(p.act, "gated_delta_net", [&](auto a) {
    using A = decltype(a);
    const unsigned channel_blocks = unsigned((d.cd + kConvThreads - 1) / kConvThreads);
    conv_kernel<A><<<dim3(channel_blocks, unsigned(p.num_seqs), unsigned(conv_blocks)), kConvThreads, 0, st>>>(p, d);
    KVLM_CUDA_CHECK_LAUNCH("gated_delta_net conv_kernel");
    if (max_q > kConvRows) {
      conv_state_kernel<A><<<dim3(channel_blocks, unsigned(p.num_seqs)), kConvThreads, 0, st>>>(p, d);
      KVLM_CUDA_CHECK_LAUNCH("gated_delta_net conv_state_kernel");
    }
    if (chunked) {
      gdn::delta_rule_chunked(p, d, max_q, st);
    } else {
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
    }
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

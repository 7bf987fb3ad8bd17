// Linear layers over FP8 E4M3 weights (gemm.h: Fp8Weight).
//
// m <= kGemvMaxM (decode at batch 1-4): a streaming GEMV like gemv.cu's rows kernel — a warp
// owns 2 rows and walks their k range with 16-byte loads that bypass L1, 4 per row per lane
// in flight — reading ONE byte per weight, half of a bf16 weight's: at batch 1 a decode step
// is the weight stream, so this is the whole speed-up FP8 weights promise. Codes expand to
// f16 pairs (cvt.rn.f16x2.e4m3x2 on sm_89+), then fp32; sums are fp32. A row's scale (per
// tensor or per channel: scale_block = k) multiplies its sum once at the end; block scales
// (scale_block = 128 for the block-wise formats) multiply each 16-value partial as it is
// added, so one vector never spans two blocks (scale_block % 16 == 0; the last block of a row
// may be partial). SiLU-and-mul of the
// fused gate/up projection can be the input row (the down projection at batch 1), as in gemv.cu.
// Larger m: dequantize_fp8 writes the weight in the compute type into a scratch buffer and the
// 16-bit GEMM runs on it (the caller's choice: at prefill sizes the GEMM's FLOPs dwarf the
// extra pass over the weight).
#include <cuda_fp8.h>

#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/kv_codec.cuh"
#include "ops/cuda/pdl.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kFp8Rows = 2, kFp8Unroll = 4;  // 4 vectors of 16 codes per row per lane in flight (8: slower, H200)

// 16 e4m3 codes -> 16 floats (exact), by the KV codec's decoder (kv_codec.cuh FmtE4M3).
__device__ __forceinline__ void decode16(const uint4& v, float* f) {
  using E4M3 = FmtE4M3<Scale::None>;
  E4M3::decode8(make_uint2(v.x, v.y), f);
  E4M3::decode8(make_uint2(v.z, v.w), f + 8);
}

template <class V, int M, bool kF32Out, bool kBlock>
__global__ void __launch_bounds__(kGemvThreads) gemv_fp8_kernel(const uint16_t* x, const uint8_t* w, const float* scales,
                                                                int scale_block, const uint16_t* bias, void* y, int n, int k) {
  constexpr int R = kFp8Rows, U = kFp8Unroll;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (int(blockIdx.x) * (kGemvThreads / 32) + warp) * R;
  if (row0 >= n) return;  // warp-uniform
  const int nrows = min(R, n - row0);
  const int kv = k / 16;                 // 16-byte vectors of codes per row
  const int nb = (k + scale_block - 1) / scale_block;  // scales per row (the last block may be partial)
  const int vpb = scale_block / 16;      // vectors per scale block
  const uint4* wr[R];
  const float* sr[R];
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const int row = row0 + min(j, nrows - 1);
    wr[j] = reinterpret_cast<const uint4*>(w + size_t(row) * size_t(k));
    sr[j] = scales + size_t(row) * size_t(nb);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[R][M] = {};
  for (int base = lane; base < kv; base += 32 * U) {
    uint4 wv[U][R];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < R; ++j) wv[u][j] = base + u * 32 < kv ? ld_stream(wr[j] + base + u * 32) : make_uint4(0, 0, 0, 0);
    if (base == lane) pdl_wait();  // x is the previous kernel's output; w is not
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * 32;
      if (i >= kv) break;
      float wf[R][16];
#pragma unroll
      for (int j = 0; j < R; ++j) decode16(wv[u][j], wf[j]);
      float bs[R];
      if constexpr (kBlock)
#pragma unroll
        for (int j = 0; j < R; ++j) bs[j] = __ldg(sr[j] + i / vpb);
#pragma unroll
      for (int r = 0; r < M; ++r) {
        float xf[16];
        load_x<V, false>(xv, k / 8, r, 2 * i, xf);
        load_x<V, false>(xv, k / 8, r, 2 * i + 1, xf + 8);
#pragma unroll
        for (int j = 0; j < R; ++j) {
          float part = 0.0f;
#pragma unroll
          for (int e = 0; e < 16; ++e) part = fmaf(wf[j][e], xf[e], part);
          acc[j][r] = kBlock ? fmaf(part, bs[j], acc[j][r]) : acc[j][r] + part;
        }
      }
    }
  }
  allow_dependents();  // the weights are read: let the next kernel launch
#pragma unroll
  for (int j = 0; j < R; ++j)
#pragma unroll
    for (int r = 0; r < M; ++r)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[j][r] += __shfl_xor_sync(0xffffffffu, acc[j][r], o);
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (j < nrows) {
        const float s = kBlock ? 1.0f : __ldg(sr[j]);
#pragma unroll
        for (int r = 0; r < M; ++r) store_out<V, M, kF32Out>(y, n, row0 + j, r, acc[j][r] * s, bias);
      }
}

template <class V, bool kF32Out, bool kBlock>
void launch_fp8(const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k, cudaStream_t st) {
  const auto* xs = static_cast<const uint16_t*>(x);
  const auto* bs = static_cast<const uint16_t*>(bias);
  const dim3 grid(unsigned((n + kFp8Rows * kGemvThreads / 32 - 1) / (kFp8Rows * kGemvThreads / 32)));
  const dim3 block(kGemvThreads);
  switch (m) {
#define KVLM_FP8_M(M)                                                                                                 \
  case M:                                                                                                            \
    KVLM_CUDA_CHECK(launch_pdl<gemv_fp8_kernel<V, M, kF32Out, kBlock>>(grid, block, 0, st, xs, w.codes, w.scales,   \
                                                                       w.scale_block, bs, y, n, k));                \
    break;
    KVLM_FP8_M(1)
    KVLM_FP8_M(2)
    KVLM_FP8_M(3)
    KVLM_FP8_M(4)
#undef KVLM_FP8_M
  }
}

template <class V>
void launch_fp8_any(bool f32, bool block, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n,
                    int k, cudaStream_t st) {
  if (f32) {
    if (block) launch_fp8<V, true, true>(x, w, bias, y, m, n, k, st);
    else launch_fp8<V, true, false>(x, w, bias, y, m, n, k, st);
  } else {
    if (block) launch_fp8<V, false, true>(x, w, bias, y, m, n, k, st);
    else launch_fp8<V, false, false>(x, w, bias, y, m, n, k, st);
  }
}

// One thread per 16 codes (vector i of the row-major [n][k] codes, 32-bit indices: n * k / 16
// fits): out = code * scale of (row, column block), rounded once to the compute type, stored as
// two 16-byte vectors.
template <bool kBF>
__global__ void dequantize_fp8_kernel(const uint4* codes, const float* scales, int nb, int scale_block, uint4* out,
                                      int total, int kv) {
  const int i = int(blockIdx.x) * int(blockDim.x) + int(threadIdx.x);
  if (i >= total) return;
  const int row = i / kv, c0 = (i - row * kv) * 16;
  const float s = scales[size_t(row) * size_t(nb) + size_t(c0 / scale_block)];
  float f[16];
  decode16(codes[i], f);
  uint32_t p[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float a = f[2 * e] * s, b = f[2 * e + 1] * s;
    const uint32_t lo = kBF ? __bfloat16_as_ushort(__float2bfloat16_rn(a)) : __half_as_ushort(__float2half_rn(a));
    const uint32_t hi = kBF ? __bfloat16_as_ushort(__float2bfloat16_rn(b)) : __half_as_ushort(__float2half_rn(b));
    p[e] = lo | hi << 16;
  }
  out[2 * size_t(i)] = make_uint4(p[0], p[1], p[2], p[3]);
  out[2 * size_t(i) + 1] = make_uint4(p[4], p[5], p[6], p[7]);
}

}  // namespace

bool fp8_weights_supported(int compute_capability) { return compute_capability >= 89; }

bool fp8_layout_fits(int k, int scale_block) { return k > 0 && k % 16 == 0 && scale_block > 0 && scale_block % 16 == 0; }

void gemv_fp8(DType ab, DType out, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k,
              void* stream) {
  if (m <= 0 || n <= 0) return;
  if (m > kGemvMaxM) throw Error("gemv_fp8: takes m <= " + std::to_string(kGemvMaxM) + " (dequantize_fp8 + the GEMM above)");
  if (!fp8_layout_fits(k, w.scale_block))
    throw Error("gemv_fp8: needs k % 16 == 0 and a scale block that is a multiple of 16 (k " + std::to_string(k) +
                ", scale block " + std::to_string(w.scale_block) + ")");
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(w.codes) % 16 != 0)
    throw Error("gemv_fp8: x and the codes must be 16-byte aligned");
  if (ab != DType::BF16 && ab != DType::F16) throw Error("gemv_fp8: inputs must be bfloat16 or float16");
  if (out != ab && out != DType::F32) throw Error("gemv_fp8: output must be the input type or float32");
  const auto st = static_cast<cudaStream_t>(stream);
  const bool f32 = out == DType::F32, block = w.scale_block < k;
  if (ab == DType::BF16) launch_fp8_any<VecBF16>(f32, block, x, w, bias, y, m, n, k, st);
  else launch_fp8_any<VecF16>(f32, block, x, w, bias, y, m, n, k, st);
}

void dequantize_fp8(DType to, const Fp8Weight& w, void* out, int n, int k, void* stream) {
  if (!fp8_layout_fits(k, w.scale_block)) throw Error("dequantize_fp8: unsupported layout");
  if (to != DType::BF16 && to != DType::F16) throw Error("dequantize_fp8: the output must be bfloat16 or float16");
  const size_t vectors = size_t(n) * size_t(k / 16);
  if (vectors == 0) return;
  if (vectors > size_t(INT32_MAX)) throw Error("dequantize_fp8: the weight is too large (over 2^35 values)");
  const int nb = (k + w.scale_block - 1) / w.scale_block;
  const unsigned blocks = unsigned((vectors + 255) / 256);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* c = reinterpret_cast<const uint4*>(w.codes);
  auto* o = static_cast<uint4*>(out);
  if (to == DType::BF16)
    dequantize_fp8_kernel<true><<<blocks, 256, 0, st>>>(c, w.scales, nb, w.scale_block, o, int(vectors), k / 16);
  else
    dequantize_fp8_kernel<false><<<blocks, 256, 0, st>>>(c, w.scales, nb, w.scale_block, o, int(vectors), k / 16);
  KVLM_CUDA_CHECK(cudaGetLastError());
}

}  // namespace kvlm::cuda

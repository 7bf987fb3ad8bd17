// gemv_int at 1-4 rows of x on the integer pipes: x quantized to int8 per block of columns,
// the codes multiplied as they are stored with DP4A (gemv_int_dp4a.h).
//
// Why: at m = 1 the tensor-core GEMV (gemv_int.cu) decodes every code to a 16-bit value for an
// MMA whose other 7 columns are idle, and Nsight Compute puts it at 1.3-3.1 TB/s, bound by
// instructions and their latency (docs/results/weights-4bit.md): a weight costs about 4.6
// thread instructions, against the ~3.9 an H200 can issue per weight at full bandwidth (132 SMs
// x 4 schedulers x 1.98 GHz x 32 lanes / 8.5e12 4.5-bit weights a second). Here a 32-bit word
// of 4-bit codes is two masks and two DP4A for 8 weights, and a word of 8-bit codes one DP4A
// for 4: with the loads and the per-block fp32 sums about 0.9 instructions a weight.
//
// The arithmetic. Each CTA quantizes x (the previous kernel's output) into shared memory first:
// per block of C columns (C = 32 for 4-bit codes, 16 for 8-bit: the 16 bytes of codes a lane
// loads, which lie in one group of the weight), dx = max |x| / 127 and xq = rint(x / dx), and
// the sum of the block's codes. A weight row's dot with x is then, block by block,
//     sum_c (s q_c + b) x_c  ~  s dx sum_c q_c xq_c  +  b dx sum_c xq_c  =  sum_c (s q_c + b) dx xq_c
// with the integer sums exact (DP4A), so the only error is x's quantization weighted by the
// weights themselves: at most |s q_c + b| dx / 2 per column (the weights' values s q + b are
// used unrounded, as the scale-after-MMA path uses them). A zero-point layout's b is -s z.
// The offset meets the quantized x, not x itself, on purpose: the 4-bit layouts' codes are
// unsigned (0..15) and b recentres them, so sum (s q + b)(x - dx xq) errs about half as much as
// sum s q (x - dx xq) would. Measured on the CPU's int8 path (the same quantization of x, the
// offset through the codes' sum as here) against the exact product, on the accuracy text:
// SmolLM2 Q4_1 mean KLD 1.6e-3 against 7.6e-3 with b times the exact sum of x, Gemma 3 Q4_K_M
// 2.0e-3 against 4.4e-3 (docs/results/weights-4bit.md).
//
// The codes are multiplied in their stored order (io/grouped_codes.h): a 4-bit word's low
// nibbles (word & 0x0f0f0f0f) are columns 0, 4, 1, 5 of its 8 and the high ones 2, 6, 3, 7; an
// 8-bit word's bytes columns 0, 2, 1, 3. x's int8 codes are written in the same order, so
// neither side is permuted in the loop.
//
// Work: each warp takes R consecutive rows at a time (a task), its lanes striding along k one
// 16-byte vector of each row per lane and step, U steps' loads issued before any is used
// (R * U * 16 bytes in flight per lane); CTAs loop over tasks (as many CTAs as fit on the GPU,
// so that x is quantized once per CTA, not once per row). A task's sums meet by warp shuffles.
// The first task's first steps load before the wait for x (the weights are no kernel's output),
// so that x's quantization overlaps them: 4-5% of a batch-1 step (docs/results/weights-4bit.md).
#include "ops/cuda/gemv_int_dp4a.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/int_decode.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/per_device.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kDp4aWarps = kGemvThreads / 32;
constexpr int kDp4aRows = 2;   // R: weight rows per warp and task
constexpr int kDp4aSteps = 4;  // U: 16-byte vectors per row a lane loads before using them
constexpr int kPrefetchSteps = 2;  // further steps of U the first task prefetches to L2 before x is ready

__device__ __forceinline__ uint32_t pack_i8(int a, int b, int c, int d) {
  return uint32_t(a & 0xff) | uint32_t(b & 0xff) << 8 | uint32_t(c & 0xff) << 16 | uint32_t(d & 0xff) << 24;
}

// A group's 32-bit word (grouped_param, grouped_param_zero_point, grouped_param_e2m1) as fp32
// scale and offset, for codes as the loop multiplies them (E2M1: twice their value).
template <class V, Int4Kind K>
__device__ __forceinline__ void group_scale_offset(uint32_t p, float& s, float& b) {
  s = V::load(uint16_t(p & 0xffffu));
  if constexpr (K == Int4Kind::E2M1) {
    // the word is 2^(e - 127) times 2^126 (bf16) or 2^14 (f16); the codes are 2 E2M1(code)
    s *= V::kBF16 ? 0x1p-127f : 0x1p-15f;
    b = 0.0f;
    return;
  }
  const float hi = V::load(uint16_t(p >> 16));
  // zero point: hi = -(magic + z), so b = -s z = s (hi + magic), exact in fp32 up to one rounding
  b = K == Int4Kind::ZeroPoint ? s * (hi + (V::kBF16 ? 128.0f : 1024.0f)) : hi;
}

// Twice the E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as the bytes of two words: a byte permute
// with a code as its selector looks the magnitude up (selector bits 0-2), and gives 0 where the
// code's sign bit (selector bit 3: replicate the selected byte's sign, which is 0) is set.
constexpr uint32_t kE2m1Lo = 0x03020100u, kE2m1Hi = 0x0c080604u;
// PTX's prmt in its generic form, with the selector's bit 3 (sign replication) as the hardware
// reads it; __byte_perm is documented to use bits 0-2 only. The low 16 bits of sel select.
__device__ __forceinline__ uint32_t e2m1_magnitudes(uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(kE2m1Lo), "r"(kE2m1Hi), "r"(sel));
  return r;
}

// BITS: 4 or 8; M: rows of x the variant holds (m <= M; rows past m are zeros, never stored);
// K: the kind of 4-bit codes (affine, zero point, E2M1; int_decode.cuh); bshift: log2(group / C).
template <class V, int BITS, int M, Int4Kind K, bool kF32Out>
__global__ void __launch_bounds__(kGemvThreads, 2)
    gemv_int_dp4a_kernel(const uint16_t* x, const uint8_t* codes, const uint32_t* params, int bshift,
                         const uint16_t* bias, void* y, int ldy, int m, int n, int k, IntExpertTiles ex) {
  // Experts (ex.expert set), as gemv_int.cu's kernel takes them: CTA column z takes tile z, whose
  // expert's n rows follow the previous experts' in codes, params and bias; its m = count rows
  // of x are x_rows[first ...] (or first ...), its rows of y first .... All of it is the
  // routing's output, so the wait comes first.
  int y_first = 0;
  const int32_t* x_map = nullptr;
  if (ex.expert) {
    pdl_wait();
    const int tile = int(blockIdx.z);
    if (tile >= *ex.tiles) return;
    const int e = ex.expert[tile];
    y_first = ex.first[tile];
    m = ex.count[tile];
    x_map = ex.x_rows ? ex.x_rows + y_first : nullptr;
    codes += size_t(e) * size_t(n) * (size_t(k) * BITS / 8);
    params += size_t(e) * size_t(n) * size_t((k / (128 / BITS)) >> bshift);
    if (bias) bias += size_t(e) * size_t(n);
  }
  constexpr int C = 128 / BITS, R = kDp4aRows, U = M >= 4 ? kDp4aSteps / 2 : kDp4aSteps;  // M = 4 spilled at 4 steps
  const int nb = k / C, ng = nb >> bshift;  // x blocks (16-byte vectors of codes) and groups per row
  extern __shared__ uint4 dp4a_shared[];
  // xq [M][k] int8 in the codes' order; 4-bit: the two 16-byte halves of block v at 16 v and
  // k / 2 + 16 v, so that a warp's lanes read consecutive 16-byte words (no bank conflicts).
  int8_t* const xq = reinterpret_cast<int8_t*>(dp4a_shared);
  float2* const xs = reinterpret_cast<float2*>(xq + size_t(M) * size_t(k));  // [M][nb]: (dx, dx times the sum of the codes)
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int tasks = (n + R - 1) / R, first = int(blockIdx.x) * kDp4aWarps + warp, stride = int(gridDim.x) * kDp4aWarps;
  const size_t row_bytes = size_t(k) * BITS / 8;

  // A task's rows and the loads of its codes and parameters: the next U steps' load while this
  // step's are multiplied.
  const uint4* crow[R];
  const uint32_t* prow[R];
  uint4 cn[R][U];
  uint32_t pn[R][U];
  auto rows_of = [&](int task) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int row = min(task * R + j, n - 1);  // rows past n are read, never stored
      crow[j] = reinterpret_cast<const uint4*>(codes + size_t(row) * row_bytes);
      prow[j] = params + size_t(row) * size_t(ng);
    }
  };
  auto load = [&](int v0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int v = v0 + 32 * u;
      const bool ok = v < nb;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        cn[j][u] = ok ? ld_stream(crow[j] + v) : make_uint4(0, 0, 0, 0);
        pn[j][u] = ok ? __ldg(prow[j] + (v >> bshift)) : 0u;  // a missing vector: s = b = 0
      }
    }
  };
  // The weights are no kernel's output: the first task's first U steps load into registers
  // before the wait for x and before x's quantization (which held every warp for an L2 round
  // trip and its arithmetic with no code in flight), and its next kPrefetchSteps steps start
  // towards L2 (a 12288-long row of 4-bit codes is 3 steps of U). E2M1 at 2-4 rows has no
  // registers to spare for them during the quantization (128 bytes spilled): its first steps go
  // to L2 too, and load after it.
  constexpr bool kEarly = M == 1 || K != Int4Kind::E2M1;
  if (first < tasks) {
    if constexpr (kEarly) {
      rows_of(first);
      load(lane);
    }
    for (int j = 0; j < R; ++j) {  // (its own pointers: crow kept live here spilled E2M1 at 2 rows)
      const uint4* row = reinterpret_cast<const uint4*>(codes + size_t(min(first * R + j, n - 1)) * row_bytes);
      for (int v = lane + (kEarly ? 32 * U : 0); v < min(nb, 32 * U * (1 + kPrefetchSteps)); v += 32)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(row + v));
    }
  }
  if (!ex.expert) pdl_wait();

  // x -> int8 codes per block of C columns, 8 columns per thread (C / 8 consecutive lanes a
  // block), kBatch vectors of x loaded before any is used: one L2 round trip per batch, not one
  // per vector (k = 12288 took six in a row).
  {
    constexpr int UB = C / 8, kBatch = 8;
    const int per_row = k / 8, units = M * per_row;
    for (int base = 0; base < units; base += kBatch * kGemvThreads) {
      uint4 raw[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int u = base + i * kGemvThreads + int(threadIdx.x), r = u / per_row;
        const size_t xrow = r < m ? size_t(x_map ? x_map[r] : y_first + r) : 0;
        raw[i] = u < units && r < m ? __ldg(reinterpret_cast<const uint4*>(x + xrow * size_t(k)) + (u - r * per_row))
                                    : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        if (base + i * kGemvThreads >= units) break;  // uniform across the CTA
        const int u = base + i * kGemvThreads + int(threadIdx.x);
        const bool on = u < units;
        const int r = on ? u / per_row : 0, c0 = on ? (u - r * per_row) * 8 : 0;
        float f[8];
        V::decode8(raw[i], f);
        float amax = 0.0f, sum = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e])), sum += f[e];
#pragma unroll
        for (int o = 1; o < UB; o <<= 1) {
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          sum += __shfl_xor_sync(0xffffffffu, sum, o);
        }
        // A block whose largest |x| is below 2^-100 counts as zeros (127 / amax would overflow
        // in the subnormals); NaN in x (which fmaxf skips: the fp32 sum is what sees it) and
        // infinities (which leave no scale) reach the output as NaN through dx.
        const float inv = amax > 0x1p-100f ? 127.0f / amax : 0.0f;
        const float dx = sum != sum || isinf(amax) ? __int_as_float(0x7fc00000) : inv > 0.0f ? amax / 127.0f : 0.0f;
        int q[8], qsum = 0;
#pragma unroll
        for (int e = 0; e < 8; ++e) q[e] = __float2int_rn(f[e] * inv), qsum += q[e];
#pragma unroll
        for (int o = 1; o < UB; o <<= 1) qsum += __shfl_xor_sync(0xffffffffu, qsum, o);
        if (!on) continue;
        int8_t* const row = xq + size_t(r) * size_t(k);
        const int v = c0 / C;
        if constexpr (BITS == 4) {
          const int w = (c0 % C) / 8;  // the word of the block: half w / 2, 8 bytes at 8 (w % 2)
          // affine codes: low nibbles columns 0, 4, 1, 5, high ones 2, 6, 3, 7; E2M1's byte
          // permutes: nibbles 0-3 (columns 0, 2, 4, 6), then 4-7 (1, 3, 5, 7)
          *reinterpret_cast<uint2*>(row + (w / 2) * (k / 2) + 16 * v + 8 * (w % 2)) =
              K == Int4Kind::E2M1 ? make_uint2(pack_i8(q[0], q[2], q[4], q[6]), pack_i8(q[1], q[3], q[5], q[7]))
                                  : make_uint2(pack_i8(q[0], q[4], q[1], q[5]), pack_i8(q[2], q[6], q[3], q[7]));
        } else {
          *reinterpret_cast<uint2*>(row + c0) =
              make_uint2(pack_i8(q[0], q[2], q[1], q[3]), pack_i8(q[4], q[6], q[5], q[7]));
        }
        // the offsets meet x as quantized, dx times the sum of its codes (see the header comment)
        if (u % UB == 0) xs[r * nb + v] = make_float2(dx, dx * float(qsum));
      }
    }
  }
  __syncthreads();

  for (int task = first; task < tasks; task += stride) {
    float acc[R][M] = {};
    if (task != first || !kEarly) {
      rows_of(task);
      load(lane);
    }
    for (int v0 = lane; v0 < nb; v0 += 32 * U) {
      uint4 c[R][U];
      uint32_t p[R][U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < R; ++j) c[j][u] = cn[j][u], p[j][u] = pn[j][u];
      if (v0 + 32 * U < nb) load(v0 + 32 * U);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = min(v0 + 32 * u, nb - 1);
        uint4 xa[M], xb[M];
        float2 ds[M];
#pragma unroll
        for (int mm = 0; mm < M; ++mm) {
          const int8_t* row = xq + size_t(mm) * size_t(k);
          xa[mm] = *reinterpret_cast<const uint4*>(row + 16 * v);
          if constexpr (BITS == 4) xb[mm] = *reinterpret_cast<const uint4*>(row + k / 2 + 16 * v);
          ds[mm] = xs[mm * nb + v];
        }
#pragma unroll
        for (int j = 0; j < R; ++j) {
          float s, b;
          group_scale_offset<V, K>(p[j][u], s, b);
          const uint32_t cw[4] = {c[j][u].x, c[j][u].y, c[j][u].z, c[j][u].w};
#pragma unroll
          for (int mm = 0; mm < M; ++mm) {
            int dot = 0;
            if constexpr (K == Int4Kind::E2M1) {
              // sum 2 E2M1(code) xq = (positive codes' magnitudes) . xq - (negative codes') . xq:
              // a byte permute by the codes gives the first, by the codes with their sign bits
              // flipped the second, zeros elsewhere in each
              const uint32_t xw[8] = {xa[mm].x, xa[mm].y, xa[mm].z, xa[mm].w, xb[mm].x, xb[mm].y, xb[mm].z, xb[mm].w};
              int neg = 0;
#pragma unroll
              for (int w = 0; w < 4; ++w) {
                const uint32_t f = cw[w] ^ 0x88888888u;
                dot = __dp4a(int(e2m1_magnitudes(cw[w])), int(xw[2 * w]), dot);
                dot = __dp4a(int(e2m1_magnitudes(cw[w] >> 16)), int(xw[2 * w + 1]), dot);
                neg = __dp4a(int(e2m1_magnitudes(f)), int(xw[2 * w]), neg);
                neg = __dp4a(int(e2m1_magnitudes(f >> 16)), int(xw[2 * w + 1]), neg);
              }
              dot -= neg;
            } else if constexpr (BITS == 4) {
              const uint32_t xw[8] = {xa[mm].x, xa[mm].y, xa[mm].z, xa[mm].w, xb[mm].x, xb[mm].y, xb[mm].z, xb[mm].w};
#pragma unroll
              for (int w = 0; w < 4; ++w) {
                dot = __dp4a(int(cw[w] & 0x0f0f0f0fu), int(xw[2 * w]), dot);
                dot = __dp4a(int((cw[w] >> 4) & 0x0f0f0f0fu), int(xw[2 * w + 1]), dot);
              }
            } else {
              dot = __dp4a(int(cw[0]), int(xa[mm].x), dot);
              dot = __dp4a(int(cw[1]), int(xa[mm].y), dot);
              dot = __dp4a(int(cw[2]), int(xa[mm].z), dot);
              dot = __dp4a(int(cw[3]), int(xa[mm].w), dot);
            }
            acc[j][mm] = fmaf(s * ds[mm].x, float(dot), fmaf(b, ds[mm].y, acc[j][mm]));
          }
        }
      }
    }
    // Every lane ends with the task's sums; lane j M + mm stores row j, x row mm.
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
      for (int mm = 0; mm < M; ++mm) {
        float v = acc[j][mm];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        const int row = task * R + j;
        if (lane == j * M + mm && row < n && mm < m) store_out<V, 1, kF32Out>(y, ldy, row, y_first + mm, v, bias);
      }
  }
  allow_dependents();
}

// Shared memory a CTA needs: x's int8 codes and its two floats per block, for M rows.
size_t dp4a_smem(int bits, int rows, int k) {
  const int c = 128 / bits;
  return size_t(rows) * (size_t(k) + size_t(k / c) * sizeof(float2));
}

int variant_rows(int m) { return m <= 1 ? 1 : m <= 2 ? 2 : 4; }

template <class V, int BITS, int M, Int4Kind K, bool kF32Out>
void launch(const void* x, const IntWeight& w, int bshift, const void* bias, void* y, int ldy, int m, int n, int k,
            cudaStream_t st, const IntExpertTiles& ex) {
  constexpr auto kernel = gemv_int_dp4a_kernel<V, BITS, M, K, kF32Out>;
  const size_t smem = dp4a_smem(BITS, M, k);
  // Opt in to the most dynamic shared memory once; CTAs per SM from the registers (the
  // occupancy of a CTA with no shared memory) and from this launch's shared memory.
  struct Fit {
    int regs_ctas = 1, smem_per_sm = 0;
  };
  static PerDevice<Fit> fit;
  const Fit& f = fit.get([] {
    Fit r;
    int optin = 0;
    KVLM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device()));
    KVLM_CUDA_CHECK(cudaDeviceGetAttribute(&r.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, current_device()));
    KVLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
    KVLM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    KVLM_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&r.regs_ctas, kernel, kGemvThreads, 0));
    r.regs_ctas = std::max(1, r.regs_ctas);
    return r;
  });
  const int per_sm = std::clamp(f.smem_per_sm / int(smem + 1024), 1, f.regs_ctas);
  const int tasks = (n + kDp4aRows - 1) / kDp4aRows;
  // Experts: the resident CTAs shared among about ex.routed tiles.
  const int copies = ex.expert ? ex.routed : 1;
  const int ctas = std::min((tasks + kDp4aWarps - 1) / kDp4aWarps, std::max(1, per_sm * sm_count() / copies));
  KVLM_CUDA_CHECK(launch_pdl<kernel>(dim3(unsigned(ctas), 1, unsigned(ex.expert ? ex.max_tiles : 1)), dim3(kGemvThreads),
                                     smem, st, static_cast<const uint16_t*>(x), w.codes, w.params, bshift,
                                     static_cast<const uint16_t*>(bias), y, ldy, m, n, k, ex));
}

template <class V, int BITS>
void launch_bits(bool f32, const void* x, const IntWeight& w, int bshift, const void* bias, void* y, int ldy, int m,
                 int n, int k, cudaStream_t st, const IntExpertTiles& ex) {
  auto go = [&](auto rows, auto kind) {
    constexpr int M = decltype(rows)::value;
    constexpr Int4Kind K = decltype(kind)::value;
    if (f32) launch<V, BITS, M, K, true>(x, w, bshift, bias, y, ldy, m, n, k, st, ex);
    else launch<V, BITS, M, K, false>(x, w, bshift, bias, y, ldy, m, n, k, st, ex);
  };
  auto by_zp = [&](auto rows) {
    if constexpr (BITS == 4) with_int4_kind(w, [&](auto kind) { go(rows, kind); });
    else go(rows, std::integral_constant<Int4Kind, Int4Kind::Affine>{});
  };
  switch (variant_rows(m)) {
    case 1: by_zp(std::integral_constant<int, 1>{}); break;
    case 2: by_zp(std::integral_constant<int, 2>{}); break;
    default: by_zp(std::integral_constant<int, 4>{}); break;
  }
}

}  // namespace

bool gemv_int_dp4a_takes(DType ab, const IntWeight& w, int m, int k) {
  if (m < 1 || m > std::min(kGemvIntDp4aMaxM, kernel_switches().int_dp4a_max_m)) return false;
  if (ab != DType::BF16 && ab != DType::F16) return false;
  if ((w.bits != 4 && w.bits != 8) || ((w.zero_point || w.e2m1) && w.bits != 4) || (w.zero_point && w.e2m1)) return false;
  const int c = 128 / w.bits;
  if (k <= 0 || k % c != 0 || w.group <= 0 || w.group % c != 0 || k % w.group != 0) return false;
  const int blocks = w.group / c;
  if ((blocks & (blocks - 1)) != 0) return false;  // the group index is a shift
  if (compute_capability() < 61) return false;     // DP4A
  return dp4a_smem(w.bits, variant_rows(m), k) <= kGemvIntDp4aMaxSmem;
}

bool gemv_int_dp4a_pays(int m, int n, int k) {
  if (!kernel_switches().int_dp4a_by_shape) return true;
  if (m <= 2) return k <= 12288;
  return int64_t(n) >= 4 * int64_t(k);
}

void gemv_int_dp4a(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
                   int n, int k, void* stream, const IntExpertTiles& ex) {
  check_int("gemv_int_dp4a", ab, w, k);
  if (!gemv_int_dp4a_takes(ab, w, m, k)) throw Error("gemv_int_dp4a: called for a layout or m it does not take");
  int bshift = 0;
  while ((w.group / (128 / w.bits)) >> bshift > 1) ++bshift;
  const auto st = static_cast<cudaStream_t>(stream);
  const bool f32 = out == DType::F32;
  if (ab == DType::BF16) {
    if (w.bits == 4) launch_bits<VecBF16, 4>(f32, x, w, bshift, bias, y, ldy, m, n, k, st, ex);
    else launch_bits<VecBF16, 8>(f32, x, w, bshift, bias, y, ldy, m, n, k, st, ex);
  } else {
    if (w.bits == 4) launch_bits<VecF16, 4>(f32, x, w, bshift, bias, y, ldy, m, n, k, st, ex);
    else launch_bits<VecF16, 8>(f32, x, w, bshift, bias, y, ldy, m, n, k, st, ex);
  }
}

}  // namespace kvlm::cuda

// The FP8 GEMM for decode batches of up to 64 rows (gemm.h: gemm_fp8_small): FP8 weights with
// one scale per row (per-tensor and per-channel checkpoints, --quantization fp8) times
// activations quantized per token, on Hopper's FP8 warpgroup MMAs (wgmma, sm_90a).
//
// Why a kernel of our own: at m = 64 a Qwen3-8B layer's weights are 193 MB, 46 µs of copy on
// an H200, but cuBLASLt's FP8 GEMMs took 122 µs there (108 with 128 x 128 blocks), no faster
// than the bf16 GEMMs on twice the bytes: every one of them costs at least ~14 µs however small
// the matrix (docs/results/cuda-runner.md). At this m a GEMM is still a weight stream (64 MACs
// per weight byte, far below the tensor cores' rate), so this kernel is built like gemv_fp8.cu's
// tensor-core GEMV: stream the codes once, keep the GPU full, and let the MMAs ride along.
// (mma.sync over e4m3 was tried first: ptxas expands it on sm_90 into f16 conversions and two
// 16-bit MMAs, and the kernel ran at a quarter of copy; kernel-lab.md.)
//
// Layout of the work:
//  - A CTA owns 128 weight rows, 64 per warpgroup (wgmma's M), and all m <= N rows of x (N =
//    32 or 64: wgmma's N, one B tile both warpgroups read). k goes in rounds of 128 through a
//    kSgStages-deep cp.async ring of [weights 16 KB | x N rows x 128 bytes], 3 rounds in
//    flight; x is copied once per CTA, so its traffic from L2 is m / 128 of the weights'. One
//    CTA barrier per round (a round is 16 KB of weights, ~1,000 clocks of the CTA's share of
//    the stream), then 4 wgmma m64nNk32 per warpgroup.
//  - The sums leave through shared memory so that consecutive threads store consecutive
//    columns of y (stored straight from the accumulators, 2-byte stores m apart, gate_up at
//    m = 64 took 67 µs instead of 39 on an H200).
//  - Both operands are K-major tiles of 128-byte rows in the 128-byte swizzle (16-byte chunk c
//    of row r at c ^ (r % 8), 8-row groups of 1024 B): what the wgmma descriptors read, and
//    what the 16-byte cp.async copies write directly.
//  - The CTAs of a thread-block cluster along y (1, 2, 4 or 8) split the rounds into
//    contiguous ranges, and add their sums through distributed shared memory (as the GEMV's).
//  - Scales: one per weight row and one per token multiply the finished sum. With 128 x 128
//    block scales (Qwen3-FP8, DeepSeek) a round is exactly one block column and a CTA exactly
//    one block row, so a round's sums take one weight scale and one per-(token, 128-group) x
//    scale per column: the round's wgmmas write a second set of accumulators, added into the
//    first times those scales once they land. The scales ride in the ring with their round
//    (a small ring beside it), so reading them costs no latency after the wgmma wait.
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/gemv_common.cuh"
#include "ops/cuda/mma_sync.cuh"
#include "ops/cuda/pdl.cuh"
#include "ops/cuda/wgmma.cuh"

namespace kvlm::cuda {

namespace {

constexpr int kSgRound = 128;                // k per round: one 128-byte row of codes per weight row
constexpr int kSgRows = 128;                 // weight rows per CTA: 64 per warpgroup
constexpr int kSgStages = 4;                 // ring depth: 3 rounds in flight
constexpr int kSgMaxSplits = 8;              // the portable cluster size

template <int N, bool kBlock>
struct SgCfg {
  static constexpr int kWBytes = kSgRows * kSgRound;  // a round's weights
  static constexpr int kXBytes = N * kSgRound;        // a round's x
  static constexpr int kStageBytes = kWBytes + kXBytes;
  // Block scales: per stage N x scales (one per x row) then the weight block's scale.
  static constexpr int kScaleSlot = N + 4;  // floats (16-byte aligned slots)
  static constexpr int kScaleBytes = kBlock ? kSgStages * kScaleSlot * int(sizeof(float)) : 0;
  static constexpr int kSmem = kSgStages * kStageBytes + kScaleBytes + 1024;  // + the slack to align to 1024 B
  static_assert(kStageBytes % 1024 == 0, "stages keep the swizzle's 1024-B alignment");
  static_assert(kSgRows * N * int(sizeof(float)) <= kSgStages * kStageBytes, "the CTA's sums fit in the ring");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // the one kernel that uses it (nvcc #177 elsewhere)
// Row r's 16-byte chunk c (0..7) of a round's tile in shared memory (128-byte rows, swizzled).
__device__ __forceinline__ uint32_t sg_offset(int r, int c) { return uint32_t(r * kSgRound + ((c ^ (r & 7)) << 4)); }
#endif

// ws: kBlock ? the block scales [ceil(n / 128)][ws_ld] : one per row [n]; xs: kBlock ? per
// (128-group, token) [k / 128][m] : per token [m].
template <class V, int N, bool kF32Out, bool kBlock>
__global__ void __launch_bounds__(kGemvThreads, 2)
    gemm_fp8_small_kernel(const uint8_t* x, const float* xs, const uint8_t* w, const float* ws, int ws_ld,
                          const uint16_t* bias, void* y, int m, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Cfg = SgCfg<N, kBlock>;
  constexpr int S = kSgStages, XJ = N / 32;
  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int wg = warp / 4, wl = warp % 4;
  const int row0 = int(blockIdx.x) * kSgRows;
  const int splits = int(gridDim.y), rank = cluster_rank(splits);
  const int kr = (k + kSgRound - 1) / kSgRound;
  const int first = kr * rank / splits, rounds = kr * (rank + 1) / splits - first;
  extern __shared__ uint4 sg_smem[];
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(sg_smem));
  char* const smem = reinterpret_cast<char*>(sg_smem) + ((1024 - (raw_s & 1023)) & 1023);  // the swizzle's alignment
  const uint32_t smem_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  float* const scale_ring = reinterpret_cast<float*>(smem + kSgStages * Cfg::kStageBytes);  // kBlock only
  const uint32_t scale_s = smem_s + uint32_t(kSgStages * Cfg::kStageBytes);

  // Copies: thread copies chunk tid % 8 of rows tid / 8 + 32 j, so a warp instruction reads 4
  // whole 128-byte lines (4 L2 requests; 32-byte pieces of 16 rows took 16 and left L2's
  // request rate, not DRAM, the limit). Rows past n or m, and k past the end (k % 16 == 0: a
  // chunk is all in or all out), are zero-filled.
  const int cr = tid / 8, cc = tid % 8;
  const uint32_t dst0 = smem_s + sg_offset(cr, cc);  // row cr + 32 j: 32 j rows on (the swizzle repeats every 8)
  const uint8_t* wsrc[4];
  bool won[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    won[j] = row0 + cr + 32 * j < n;
    wsrc[j] = w + size_t(min(row0 + cr + 32 * j, n - 1)) * size_t(k) + 16 * cc;
  }
  const uint8_t* xsrc[XJ];
  bool xon[XJ];
#pragma unroll
  for (int j = 0; j < XJ; ++j) {
    xon[j] = cr + 32 * j < m;
    xsrc[j] = x + size_t(min(cr + 32 * j, m - 1)) * size_t(k) + 16 * cc;
  }
  auto issue_w = [&](int i) {
    if (i >= rounds) return;
    const int k0 = (first + i) * kSgRound;
    const uint32_t st = dst0 + (i % S) * Cfg::kStageBytes;
    const bool in = k0 + 16 * cc < k;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool ok = won[j] && in;
      mma::cp_async16(st + j * 32 * kSgRound, wsrc[j] + (ok ? k0 : 0), ok ? 16 : 0);
    }
    if (kBlock && tid == 0)  // the block's scale
      mma::cp_async4(scale_s + uint32_t(((i % S) * Cfg::kScaleSlot + N) * 4),
                     ws + size_t(blockIdx.x) * size_t(ws_ld) + first + i);
  };
  auto issue_x = [&](int i) {
    if (i >= rounds) return;
    const int k0 = (first + i) * kSgRound;
    const uint32_t st = dst0 + (i % S) * Cfg::kStageBytes + Cfg::kWBytes;
    const bool in = k0 + 16 * cc < k;
#pragma unroll
    for (int j = 0; j < XJ; ++j) {
      const bool ok = xon[j] && in;
      mma::cp_async16(st + j * 32 * kSgRound, xsrc[j] + (ok ? k0 : 0), ok ? 16 : 0);
    }
    if (kBlock && tid < N)  // x's scales of this group (rows past m: row m - 1's, times zero codes)
      mma::cp_async4(scale_s + uint32_t(((i % S) * Cfg::kScaleSlot + tid) * 4),
                     xs + size_t(first + i) * size_t(m) + min(tid, m - 1));
  };
  auto commit = [] { asm volatile("cp.async.commit_group;\n" ::); };
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    issue_w(i);  // the weights are not the previous kernel's output: ask for them before the wait
    commit();
  }
  pdl_wait();
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    issue_x(i);
    commit();
  }
  // Group accounting: W0..W(S-2), X0..X(S-2), then one group per round; waiting until S - 2
  // groups are pending leaves round i's weights and x landed at every round.

  // d[4 j + e]: weight row 64 wg + 16 wl + g + 8 (e >> 1), x row 8 j + 2 t + (e & 1).
  float acc[N / 2] = {};
  [[maybe_unused]] float part[kBlock ? N / 2 : 1];  // kBlock: the round's sums before its scales
  const int wrow = 64 * wg + 16 * wl + g;
  for (int i = 0; i < rounds; ++i) {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2));
    wgmma::fence_proxy_async();  // this thread's cp.async writes -> the wgmma reads
    __syncthreads();             // round i is in every thread's view; round i - 1's slot is free
    issue_w(i + S - 1);
    issue_x(i + S - 1);
    commit();
    char* const stage = smem + (i % S) * Cfg::kStageBytes;
    const uint64_t da = wgmma::desc_sw128(stage + wg * 64 * kSgRound, 16, 1024);
    const uint64_t db = wgmma::desc_sw128(stage + Cfg::kWBytes, 16, 1024);
    wgmma::fence();
    if constexpr (kBlock) {
#pragma unroll
      for (int kk = 0; kk < kSgRound / 32; ++kk)  // the first step overwrites the round's sums
        wgmma::wgmma_ss_e4m3<N>(part, da + uint64_t(2 * kk), db + uint64_t(2 * kk), kk > 0);
      wgmma::commit();
      wgmma::wait<0>();
#pragma unroll
      for (int e = 0; e < N / 2; ++e) wgmma::fence_operand(part[e]);
      const float* const sc = scale_ring + (i % S) * Cfg::kScaleSlot;
      const float wsc = sc[N];
#pragma unroll
      for (int j = 0; j < N / 8; ++j) {
        const float2 xsc = *reinterpret_cast<const float2*>(sc + 8 * j + 2 * t);
        const float s0 = wsc * xsc.x, s1 = wsc * xsc.y;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * j + e] = fmaf(part[4 * j + e], (e & 1) ? s1 : s0, acc[4 * j + e]);
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < kSgRound / 32; ++kk)  // 32 codes further into the 128-byte rows per step
        wgmma::wgmma_ss_e4m3<N>(acc, da + uint64_t(2 * kk), db + uint64_t(2 * kk), 1);
      wgmma::commit();
      wgmma::wait<0>();
#pragma unroll
      for (int e = 0; e < N / 2; ++e) wgmma::fence_operand(acc[e]);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  allow_dependents();  // the weights are read
  __syncthreads();     // nobody reads the ring any more: it becomes the sums red [N][kSgRows]
  float* const red = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      red[(8 * j + 2 * t + (e & 1)) * kSgRows + wrow + 8 * (e >> 1)] = acc[4 * j + e];
  cluster_sync(splits);  // every CTA's sums are in its shared memory
  // This CTA's share of the rows, consecutive threads on consecutive rows of a row of y (its
  // stores coalesce; one x row after another).
  const int per = kSgRows / splits;
  for (int idx = tid; idx < per * m; idx += kGemvThreads) {
    const int rr = rank * per + idx % per, r = idx / per, row = row0 + rr;
    if (row >= n) continue;
    float v = red[r * kSgRows + rr];
    for (int s = 0; s < splits; ++s)
      if (s != rank) v += cluster_peer(red, s)[r * kSgRows + rr];
    if constexpr (!kBlock) v *= __ldg(xs + r) * __ldg(ws + row);  // (block scales: applied per round)
    store_out<V, 1, kF32Out>(y, n, row, r, v, bias);
  }
  if (splits > 1) cluster_sync(splits);  // no CTA leaves while another reads its sums
#else
  __trap();  // launched only where sm_90a code runs (gemm_fp8_small_available)
#endif
}

struct SgLaunch {
  int n_tile = 0, splits = 0, grid = 0, resident = 0;
  bool block = false;
};
thread_local SgLaunch g_last;  // this thread's last launch (gemm_fp8_small_last_launch, for tests and the lab)

// The cluster split: the largest of 1, 2, 4, 8 whose CTAs fit on the GPU at once with at least
// 2 rounds each (Qwen3-8B at 2 CTAs per SM of an H200: o and down 8, qkv 4, gate_up 1).
int sg_splits(int slots, int n, int k, int forced) {
  if (compute_capability() < 90) return 1;  // no thread-block clusters
  if (forced > 0) return forced;  // 1, 2, 4 or 8 (gemm_fp8_small checks)
  const int blocks = (n + kSgRows - 1) / kSgRows, kr = (k + kSgRound - 1) / kSgRound;
  int s = 1;
  while (s < kSgMaxSplits && blocks * s * 2 <= slots && kr >= 2 * s * 2) s *= 2;
  return s;
}

template <class V, int N, bool kF32Out, bool kBlock>
void launch_sg(const uint8_t* x, const float* xs, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k,
               int forced_splits, cudaStream_t st) {
  using Cfg = SgCfg<N, kBlock>;
  constexpr auto kernel = gemm_fp8_small_kernel<V, N, kF32Out, kBlock>;
  const int slots = resident_ctas<kernel, Cfg::kSmem>();  // also opts the kernel in to its shared memory
  const int splits = sg_splits(slots, n, k, forced_splits);
  const dim3 grid(unsigned((n + kSgRows - 1) / kSgRows), unsigned(splits));
  KVLM_CUDA_CHECK(launch_pdl_cluster<kernel>(grid, dim3(kGemvThreads), Cfg::kSmem, st, splits, x, xs, w.codes,
                                             kBlock ? w.block_scales : w.scales, fp8_block_scale_ld(k),
                                             static_cast<const uint16_t*>(bias), y, m, n, k));
  g_last = {N, splits, int(grid.x * grid.y), slots, kBlock};
}

template <class V>
void launch_sg_any(bool f32, const uint8_t* x, const float* xs, const Fp8Weight& w, const void* bias, void* y, int m,
                   int n, int k, int splits, cudaStream_t st) {
  const bool block = w.scale_block < k;
  auto go = [&](auto nt) {
    constexpr int N = decltype(nt)::value;
    if (block) {
      if (f32) launch_sg<V, N, true, true>(x, xs, w, bias, y, m, n, k, splits, st);
      else launch_sg<V, N, false, true>(x, xs, w, bias, y, m, n, k, splits, st);
    } else {
      if (f32) launch_sg<V, N, true, false>(x, xs, w, bias, y, m, n, k, splits, st);
      else launch_sg<V, N, false, false>(x, xs, w, bias, y, m, n, k, splits, st);
    }
  };
  if (m <= 32) go(std::integral_constant<int, 32>{});
  else go(std::integral_constant<int, 64>{});
}

}  // namespace

bool gemm_fp8_small_available() {
#if defined(KVLM_CUDA_SM90A)
  return compute_capability() == 90;  // the only GPUs that load sm_90a code
#else
  return false;  // built without sm_90a code
#endif
}

bool gemm_fp8_small_fits(int m, int k, int scale_block) {
  return m >= 1 && m <= kGemmFp8SmallMaxM && k > 0 && k % 16 == 0 &&
         (scale_block >= k || (scale_block == kSgRound && k % kSgRound == 0));
}

void gemm_fp8_small(DType out, const uint8_t* x, const float* x_scales, const Fp8Weight& w, const void* bias, void* y,
                    int m, int n, int k, void* stream, int splits) {
  if (m <= 0 || n <= 0) return;
  if (!gemm_fp8_small_available())
    throw Error("CUDA FP8 small-batch GEMM: needs a Hopper GPU (compute capability 9.0) and kvlm built for sm_90a");
  if (!gemm_fp8_small_fits(m, k, w.scale_block))
    throw Error("CUDA FP8 small-batch GEMM: needs 1 <= m <= " + std::to_string(kGemmFp8SmallMaxM) +
                ", k a multiple of 16, and one scale per weight row or 128 x 128 blocks with k a multiple of 128 (m=" +
                std::to_string(m) + ", k=" + std::to_string(k) + ", scale block " + std::to_string(w.scale_block) + ")");
  if (w.scale_block < k && !w.block_scales)
    throw Error("CUDA FP8 small-batch GEMM: 128-column scale blocks need the scales once per 128 x 128 block "
                "(Fp8Weight::block_scales: every block's rows share their scales)");
  if (out != DType::BF16 && out != DType::F16 && out != DType::F32)
    throw Error("CUDA FP8 small-batch GEMM: output must be bfloat16, float16 or float32");
  if (out == DType::F32 && bias) throw Error("CUDA FP8 small-batch GEMM: a bias needs a 16-bit output (its type)");
  if (splits != 0 && splits != 1 && splits != 2 && splits != 4 && splits != 8)
    throw Error("CUDA FP8 small-batch GEMM: a forced split of k is 1, 2, 4 or 8 CTAs (a divisor of the CTA's " +
                std::to_string(kSgRows) + " rows), not " + std::to_string(splits));
  const auto st = static_cast<cudaStream_t>(stream);
  if (out == DType::F16) launch_sg_any<VecF16>(false, x, x_scales, w, bias, y, m, n, k, splits, st);
  else launch_sg_any<VecBF16>(out == DType::F32, x, x_scales, w, bias, y, m, n, k, splits, st);
}

std::string gemm_fp8_small_last_launch() {
  return "N " + std::to_string(g_last.n_tile) + (g_last.block ? ", 128 x 128 blocks" : ", row scales") + ", split " +
         std::to_string(g_last.splits) + ", grid " + std::to_string(g_last.grid) + ", resident " +
         std::to_string(g_last.resident);
}

}  // namespace kvlm::cuda

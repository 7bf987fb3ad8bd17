// cuBLASLt linear layers. Column-major view of the row-major operands:
//   x [m][k] row-major = X^T, a k x m column-major matrix (ld k)
//   w [n][k] row-major = W^T, a k x n column-major matrix (ld k)
//   y [m][n] row-major = Y^T, an n x m column-major matrix (ld n)
// so Y^T = op(W^T) . X^T with op = transpose: A = w (TRANSA = T), B = x (TRANSB = N), and
// the epilogue's bias (one value per row of the column-major D) is one value per out feature.
#include "ops/cuda/gemm.h"

#include <algorithm>
#include <map>
#include <set>
#include <string_view>
#include <tuple>
#include <vector>

#include "ops/cuda/cuda_check.cuh"

namespace kvlm::cuda {

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    case DType::F32: return CUDA_R_32F;
    default: break;
  }
  throw Error("CUDA GEMM: unsupported element type " + std::string(dtype_name(t)) + " (bfloat16, float16; float32 output)");
}

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

}  // namespace

constexpr int kMaxAlgos = 16;
constexpr int kTuneMaxM = 512;

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool gemv = true;
  // A problem: (kind, out, bias, m, n, k), kind telling the inputs and, for FP8 (linear_fp8),
  // the scaling (row / token, or 128 x 128 blocks / 128-value groups).
  using Key = std::tuple<int, int, bool, int, int, int>;
  static Key key(DType ab, DType out, const void* bias, int m, int n, int k, bool block) {
    return {int(ab) * 2 + (block ? 1 : 0), int(out), bias != nullptr, m, n, k};
  }
  std::map<Key, std::unique_ptr<Plan>> plans;
  std::set<Key> no_fp8_algo;  // FP8 problems cuBLASLt has no algorithm for (linear_fp8: false at once)
  std::map<Key, cublasLtMatmulAlgo_t> tuned;  // m replaced by its power-of-two bucket -> the fastest

  static void set_scales(Plan& p, const float* w_scales, const float* x_scales) {
    KVLM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales, sizeof(w_scales)));
    KVLM_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales, sizeof(x_scales)));
  }

  cublasStatus_t run(Plan& p, const cublasLtMatmulAlgo_t& algo, const void* x, const void* w, void* y, cudaStream_t st) {
    const float alpha = 1.0f, beta = 0.0f;
    return cublasLtMatmul(handle, p.desc, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c, &algo, workspace, workspace_bytes, st);
  }

  // Median time of `f` over 5 calls after 2 warm-ups, in ms.
  template <class F>
  float time_ms(F&& f, cudaStream_t st) {
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    KVLM_CUDA_CHECK(cudaEventCreate(&e0));
    KVLM_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
      KVLM_CUDA_CHECK(cudaEventRecord(e0, st));
      f();
      KVLM_CUDA_CHECK(cudaEventRecord(e1, st));
      KVLM_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      KVLM_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) t.push_back(ms);
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::nth_element(t.begin(), t.begin() + ptrdiff_t(t.size() / 2), t.end());
    return t[t.size() / 2];
  }

  // Times each candidate on the real operands (time_ms); the fastest.
  int fastest(Plan& p, const cublasLtMatmulHeuristicResult_t* res, int found, const void* x, const void* w, void* y,
              cudaStream_t st) {
    int best = 0;
    float best_ms = 1e30f;
    for (int i = 0; i < found; ++i) {
      bool ok = true;
      const float ms = time_ms([&] { ok = ok && run(p, res[i].algo, x, w, y, st) == CUBLAS_STATUS_SUCCESS; }, st);
      if (ok && ms < best_ms) {  // an algorithm that cannot run this problem is skipped
        best_ms = ms;
        best = i;
      }
    }
    return best;
  }

  // The plan of a shape, created (and for m <= kTuneMaxM timed) on its first use. An FP8 plan
  // (ab = F8E4M3) scales A (the weight) per row and B (x) per token: the scale pointers are
  // set on the descriptor before each run, and here before the timing.
  Plan& plan(DType ab, DType out, const void* bias, int m, int n, int k, const void* x, const void* w, void* y,
             cudaStream_t st, const float* w_scales = nullptr, const float* x_scales = nullptr, bool block = false) {
    const Key pkey = key(ab, out, bias, m, n, k, block);
    if (auto it = plans.find(pkey); it != plans.end()) return *it->second;
    auto p = std::make_unique<Plan>();
    const bool fp8 = ab == DType::F8E4M3;
    const cudaDataType_t tab = fp8 ? CUDA_R_8F_E4M3 : cuda_type(ab), tout = cuda_type(out);
    KVLM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
    KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
    if (fp8) {
      // (FAST_ACCUM stays 0, its default: the MMA's narrower accumulator is promoted to fp32
      // periodically.)
      const int8_t fast = 0;
      KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
      const int32_t a_mode = block ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      const int32_t b_mode = block ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F : CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
      KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)));
      KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)));
      set_scales(*p, w_scales, x_scales);
    }
    if (bias) {
      const cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
      KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)));
      KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &tout, sizeof(tout)));
    }
    KVLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, tab, uint64_t(k), uint64_t(n), int64_t(k)));
    KVLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, tab, uint64_t(k), uint64_t(m), int64_t(k)));
    KVLM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->c, tout, uint64_t(n), uint64_t(m), int64_t(n)));
    cublasLtMatmulPreference_t pref = nullptr;
    KVLM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws = workspace_bytes;
    cublasStatus_t status =
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    // Split-K (k slices added afterwards) only with fp32 partial sums, and none with a bias.
    // The in-place and output-type reductions add the slices in the 16-bit output type (the
    // counterpart of PyTorch's allow_bf16_reduced_precision_reduction); with a bias epilogue
    // even fp32 partials gave outputs 0.061 off where one rounding of the exact result is
    // allowed (tests/cuda/test_model_ops_cuda.cpp GemmMatchesCpuLinear, m = 16, n = 383,
    // k = 1320). Without split-K a batch-16-64 decode step took 7-17% longer
    // (docs/results/cuda-runner.md, "cuBLASLt split-K").
    const uint32_t reductions =
        bias ? uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE)
             : uint32_t(CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE);
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                                    sizeof(reductions));
    cublasLtMatmulHeuristicResult_t res[kMaxAlgos]{};
    int found = 0;
    if (status == CUBLAS_STATUS_SUCCESS)
      status = cublasLtMatmulAlgoGetHeuristic(handle, p->desc, p->a, p->b, p->c, p->c, pref, kMaxAlgos, res, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (fp8 && (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)) found = 0;
    else KVLM_CUBLAS_CHECK(status);
    if (found == 0)
      throw Error("cuBLASLt has no algorithm for a " + std::string(dtype_name(ab)) + " GEMM m=" + std::to_string(m) +
                  " n=" + std::to_string(n) + " k=" + std::to_string(k) + " with " + std::string(dtype_name(out)) +
                  " output");
    // Timing the candidates costs ~100 launches, so it is done once per power-of-two bucket
    // of m (a serving engine sees every m from 1 to max-num-seqs): the other m of a bucket
    // reuse its winner when cuBLASLt confirms it runs their problem.
    p->algo = res[0].algo;
    if (found > 1 && m <= kTuneMaxM) {
      int bucket = 1;
      while (bucket < m) bucket *= 2;
      const Key tkey = key(ab, out, bias, bucket, n, k, block);
      cublasLtMatmulHeuristicResult_t check{};
      if (auto t = tuned.find(tkey); t != tuned.end() &&
                                     cublasLtMatmulAlgoCheck(handle, p->desc, p->a, p->b, p->c, p->c, &t->second, &check) ==
                                         CUBLAS_STATUS_SUCCESS &&
                                     check.workspaceSize <= workspace_bytes) {
        p->algo = t->second;
      } else {
        cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
        KVLM_CUDA_CHECK(cudaStreamIsCapturing(st, &cap));
        if (cap == cudaStreamCaptureStatusNone) {
          if (bias)
            KVLM_CUBLAS_CHECK(
                cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
          p->algo = res[fastest(*p, res, found, x, w, y, st)].algo;
          tuned.insert_or_assign(tkey, p->algo);
        }
      }
    }
    return *plans.emplace(pkey, std::move(p)).first->second;
  }
};

Gemm::Gemm() : impl_(std::make_unique<Impl>()) {
  KVLM_CUBLAS_CHECK(cublasLtCreate(&impl_->handle));
}

Gemm::~Gemm() {
  impl_->plans.clear();
  if (impl_->handle) cublasLtDestroy(impl_->handle);
}

void Gemm::set_small_m_kernel(bool on) { impl_->gemv = on; }
bool Gemm::small_m_kernel(int m) const { return impl_->gemv && m >= 1 && m <= kGemvMmaMaxM; }

void Gemm::set_workspace(void* workspace, size_t bytes) {
  if (bytes != impl_->workspace_bytes) {  // algorithms were chosen for the old size
    impl_->plans.clear();
    impl_->tuned.clear();
  }
  impl_->workspace = workspace;
  impl_->workspace_bytes = bytes;
}

void Gemm::linear(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
                  void* stream) {
  if (m <= 0) return;
  if (n <= 0 || k <= 0) throw Error("CUDA GEMM: empty weight (n=" + std::to_string(n) + ", k=" + std::to_string(k) + ")");
  if (ab != DType::BF16 && ab != DType::F16)
    throw Error("CUDA GEMM: inputs must be bfloat16 or float16, not " + std::string(dtype_name(ab)));
  if (out != ab && out != DType::F32)
    throw Error("CUDA GEMM: output must be " + std::string(dtype_name(ab)) + " or float32");
  if (small_m_kernel(m) && gemv_fits(m, k, x, w))
    return gemv_small_m(ab, out, x, w, bias, y, m, n, k, stream);
  const auto st = static_cast<cudaStream_t>(stream);
  Plan& p = impl_->plan(ab, out, bias, m, n, k, x, w, y, st);
  if (bias)
    KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  KVLM_CUBLAS_CHECK(impl_->run(p, p.algo, x, w, y, st));
}

bool fp8_gemm_fits(int n, int k, int scale_block) {
  if (n <= 0 || k <= 0) return false;
  if (scale_block >= k) return n % 16 == 0 && k % 16 == 0;
  return scale_block == 128 && n % 128 == 0 && k % 128 == 0;
}

bool Gemm::linear_fp8(DType out, const uint8_t* x, const float* x_scales, const Fp8Weight& w, const void* bias, void* y,
                      int m, int n, int k, void* stream) {
  if (m <= 0) return true;
  const bool block = w.scale_block < k;
  if (!fp8_gemm_fits(n, k, w.scale_block) || (block && !w.block_scales))
    throw Error("CUDA FP8 GEMM: needs one scale per weight row and n, k multiples of 16, or 128 x 128 block scales "
                "and n, k multiples of 128 (n=" + std::to_string(n) + ", k=" + std::to_string(k) + ", scale block " +
                std::to_string(w.scale_block) + ")");
  if (out != DType::BF16 && out != DType::F16 && out != DType::F32)
    throw Error("CUDA FP8 GEMM: output must be bfloat16, float16 or float32");
  const auto st = static_cast<cudaStream_t>(stream);
  const float* w_scales = block ? w.block_scales : w.scales;
  const Impl::Key pkey = Impl::key(DType::F8E4M3, out, bias, m, n, k, block);
  if (impl_->no_fp8_algo.contains(pkey)) return false;
  Plan* p = nullptr;
  try {
    p = &impl_->plan(DType::F8E4M3, out, bias, m, n, k, x, w.codes, y, st, w_scales, x_scales, block);
  } catch (const Error&) {  // no algorithm, or scales this cuBLASLt does not take
    impl_->no_fp8_algo.insert(pkey);
    return false;
  }
  Impl::set_scales(*p, w_scales, x_scales);
  if (bias)
    KVLM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  KVLM_CUBLAS_CHECK(impl_->run(*p, p->algo, x, w.codes, y, st));
  return true;
}

int fp8_gemm_rows(int m, int k, int scale_block) {
  // cuBLASLt's 128-value-group scaling of B takes no odd row counts (m = 33 found no
  // algorithm on an H100 where m = 64 and 4096 ran): the block-scaled GEMM takes the rows down
  // to a multiple of 4 and the caller the rest.
  return scale_block < k ? m & ~3 : m;
}

}  // namespace kvlm::cuda

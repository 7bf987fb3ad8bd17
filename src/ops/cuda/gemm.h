// Linear layers on the GPU through cuBLASLt, with no CUDA header: a stream is a `void*`.
//
//   y[m][n] = x[m][k] . w[n][k]^T (+ bias[n])
// x and w (PyTorch Linear layout, row-major [out][in]) are bfloat16 or float16, both the
// same type; accumulation is fp32; y is the same 16-bit type or float32 (logits). The bias
// (same type as y) is added in the GEMM's epilogue. Pointers must be 256-byte aligned
// (cuBLASLt's default alignment assumption; every kvlm device allocation is).
//
// m <= 8 (decode at batch 1-8, short prefill chunks) runs gemv_small_m: kernels that stream
// w once at memory speed, where cuBLASLt's tiles leave bandwidth unused (gemv.cu; figures in
// docs/results/cuda-runner.md). Larger m goes to cuBLASLt: on the first use of a shape its
// heuristic proposes up to 16 algorithms; for m <= 512 (decode batches, short prefill chunks,
// where the choice matters most and timing is cheap) each is timed on the real operands and
// the fastest kept, else the top one. Plans are cached, so a steady state issues no query and
// no timing; the workspace is the caller's (fixed, so calls can be captured in a CUDA graph —
// first uses must not be). set_small_m_kernel(false) sends every m to cuBLASLt (for
// measurements: decode_bench --no-gemv).
#pragma once

#include <cstddef>
#include <memory>

#include "core/dtype.h"

namespace kvlm::cuda {

inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;
inline constexpr int kGemvMaxM = 4;      // the FMA kernels (variants 1, 2)
inline constexpr int kGemvMmaMaxM = 8;   // the tensor-core kernel (variant 3)

// The small-m kernels on their own (tests, the lab). Need 1 <= m <= kGemvMmaMaxM, k % 8 == 0
// and 16-byte aligned x and w; gemv_fits says whether they apply. variant: 0 = automatic (m = 1:
// the rows or the split kernel by shape; m >= 2: the tensor-core kernel), 1 = the rows kernel,
// 2 = the split-k kernel (both m <= kGemvMaxM), 3 = the tensor-core kernel (gemv.cu). glu_input: x is a fused
// gate/up projection [m][2k] and the kernel's input row is silu(gate) * up, computed on the
// fly in fp32 (SiLU-and-mul fused into the down projection; needs out == ab and m <= kGemvMaxM;
// the tensor-core kernel takes none).
bool gemv_fits(int m, int k, const void* x, const void* w);
void gemv_small_m(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
                  void* stream, int variant = 0, bool glu_input = false);

class Gemm {
 public:
  Gemm();  // creates the cuBLASLt handle; throws kvlm::Error on failure
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void set_workspace(void* workspace, size_t bytes);
  // Whether the small-m kernels are used (default on), and whether
  // they run the GEMMs of m rows (1 <= m <= kGemvMmaMaxM).
  void set_small_m_kernel(bool on);
  bool small_m_kernel(int m) const;
  // ab: DType::BF16 or DType::F16; out: the same or DType::F32. bias may be null.
  void linear(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
              void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm::cuda

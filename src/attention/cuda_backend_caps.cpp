#include "attention/cuda_caps.h"

namespace kvlm {

// Exactly what src/ops/cuda implements and tests/cuda/test_attention_cuda.cu checks against
// the CPU backend: six formats (no float32 pages), head sizes 64/128/256, all three masks.
const BackendCapabilities& cuda_attention_capabilities() {
  static const BackendCapabilities caps{
      .name = "cuda",
      .device = Device::Cuda,
      .kv_formats = {{DType::F16, KVQuantMode::None},
                     {DType::BF16, KVQuantMode::None},
                     {DType::F8E4M3, KVQuantMode::Fp8PerTensor},
                     {DType::F8E5M2, KVQuantMode::Fp8PerTensor},
                     {DType::F8E4M3, KVQuantMode::Fp8PerTokenHead},
                     {DType::I8, KVQuantMode::Int8PerTokenHead}},
      .head_sizes = {64, 128, 256},
      .max_head_size = 256,
      .causal = true,
      .sliding_window = true,
      .non_causal = true,
      .min_compute_capability = 90,  // built for sm_90a (FP8 cvt needs sm_89+)
      .priority = 100,               // above cpu (10)
      .description = "paged CUDA kernels: split-KV decode, per-row multi-token path; bf16 queries, fp32 accumulation",
  };
  return caps;
}

}  // namespace kvlm

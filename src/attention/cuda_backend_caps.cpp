#include "attention/cuda_caps.h"

namespace kvlm {

// Exactly what src/ops/cuda implements and tests/cuda/test_attention_cuda.cu checks against
// the CPU backend: six formats (no float32 pages), head sizes 8/16/32/64/128/256, all three
// masks. Registered in CUDA builds (attention/registry.cpp); the CUDA model runner
// (model/cuda) runs every layer the selector gives it.
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
      .head_sizes = {8, 16, 32, 64, 128, 256},
      .max_head_size = 256,
      .causal = true,
      .sliding_window = true,
      .non_causal = true,
      // Built for sm_90a only. The sources also compile for sm_80 and sm_89 (cuda_fp8.hpp
      // converts FP8 in software below sm_89; programmatic dependent launch is compiled out
      // below sm_90), but no such GPU has run the tests: lowering this needs
      // CMAKE_CUDA_ARCHITECTURES "80;89;90a" and a test run there.
      .min_compute_capability = 90,
      .priority = 100,               // above cpu (10)
      .description = "paged CUDA kernels: split-KV decode, per-row multi-token path; bf16 queries, fp32 accumulation",
  };
  return caps;
}

}  // namespace kvlm

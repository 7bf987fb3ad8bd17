// The gated MLP's activation of the gate, f(gate) (its product with up follows), shared by
// every kernel that computes f(gate) * up — model_ops.cu's glu and gemv_fp8.cu's fused
// quantizer — so that they agree bit for bit.
#pragma once

#include <cuda_runtime.h>

#include "config/model_config.h"  // GluActivation

namespace kvlm::cuda {

// SiLU or GELU(tanh); GPT-OSS's clamped SwiGLU needs its alpha and limit and the up value
// (ops/cuda/moe.cu computes it).
template <GluActivation F>
__device__ __forceinline__ float glu_gate(float g) {
  static_assert(F == GluActivation::Silu || F == GluActivation::GeluTanh, "glu_gate: SiLU or GELU(tanh) only");
  if constexpr (F == GluActivation::Silu) return g / (1.0f + expf(-g));
  else return 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));  // gelu_pytorch_tanh
}

}  // namespace kvlm::cuda

#include "attention/cuda_caps.h"

// CMake defines the architectures the device code was compiled for (CMAKE_CUDA_ARCHITECTURES,
// ',' separated) and KVLM_FORCE_SOFTWARE_FP8 when that option is on.
#ifndef KVLM_CUDA_ARCHS
#error "KVLM_CUDA_ARCHS must name the CUDA architectures compiled (CMakeLists.txt defines it)"
#endif
#ifdef KVLM_FORCE_SOFTWARE_FP8
#define KVLM_CAPS_SOFTWARE_FP8 true
#else
#define KVLM_CAPS_SOFTWARE_FP8 false
#endif

namespace kvlm {

// Exactly what src/ops/cuda implements and tests/cuda/test_attention_cuda.cu checks against
// the CPU backend: seven formats (no float32 pages), head sizes 8/16/32/64/128/256, all three
// masks, on the compute capabilities this build has code for (see
// make_cuda_attention_capabilities). Registered in CUDA builds (attention/registry.cpp); the
// CUDA model runner (model/cuda) runs every layer the selector gives it.
const BackendCapabilities& cuda_attention_capabilities() {
  static const BackendCapabilities caps = make_cuda_attention_capabilities(KVLM_CUDA_ARCHS, KVLM_CAPS_SOFTWARE_FP8);
  return caps;
}

}  // namespace kvlm

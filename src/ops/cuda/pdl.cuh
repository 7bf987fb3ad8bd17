// Programmatic dependent launch (PDL, sm_90), shared by every kernel that takes part in it.
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while
// its predecessor in the stream still runs; it must call pdl_wait() before reading what the
// predecessor writes. A predecessor calls allow_dependents() to let that launch begin early.
// Both are no-ops in code compiled below sm_90 and when the grid was launched normally.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <string_view>

namespace kvlm::cuda {

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether `kernel` may be launched with the PDL attribute on the current device: compute
// capability 9.0+, and the code loaded for the kernel compiled for sm_90+ — sm_80 / sm_89
// code (or its PTX JIT-compiled on a newer GPU) has no griddepcontrol.wait and would read its
// inputs before the producer wrote them. KVLM_CUDA_PDL=0 turns PDL off everywhere. `ptx` (if
// given) receives the PTX version of the loaded code, for the caller's message.
inline bool pdl_supported(const void* kernel, int* ptx = nullptr) {
  const char* e = std::getenv("KVLM_CUDA_PDL");
  if (e && std::string_view(e) == "0") return false;
  int dev = 0, major = 0;
  cudaFuncAttributes fa{};
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (ptx) *ptx = fa.ptxVersion;
  return major >= 9 && fa.ptxVersion >= 90;
}

}  // namespace kvlm::cuda

// Programmatic dependent launch (PDL, sm_90), shared by every kernel that takes part in it.
// A kernel launched with cudaLaunchAttributeProgrammaticStreamSerialization may start while
// its predecessor in the stream still runs; it must call pdl_wait() before reading what the
// predecessor writes. A predecessor calls allow_dependents() to let that launch begin early.
// Both are no-ops in code compiled below sm_90 and when the grid was launched normally.
//
// The rule every PDL-launched kernel follows: before pdl_wait() it may read only what no
// kernel of the step writes (weights, the step's metadata uploaded before its first kernel,
// the KV pages of positions cached before the step: a step stores only its new tokens, and
// block copies complete before a step starts) and may write nothing. Its predecessor may
// itself still be waiting on the kernel before it, so "two kernels back" is no safer than
// "the previous one".
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <string_view>
#include <utility>

#include "core/log.h"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/per_device.cuh"

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
// inputs before the producer wrote them. `ptx` (if given) receives the PTX version of the
// loaded code, for the caller's message. (kernel_switches().pdl turns PDL off everywhere.)
inline bool pdl_supported(const void* kernel, int* ptx = nullptr) {
  cudaFuncAttributes fa{};
  if (cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if (ptx) *ptx = fa.ptxVersion;
  return compute_capability() >= 90 && fa.ptxVersion >= 90;
}

// Says once per process that kernels run without PDL, and why that may be.
inline void note_pdl_off(int ptx) {
  static std::atomic<bool> told{false};
  if (!told.exchange(true))
    log::info("CUDA kernels launched without programmatic dependent launch (compute capability below 9.0, code "
              "compiled for compute_" + std::to_string(ptx) + ")");
}

// launch_pdl<kernel>(grid, block, smem, stream, args...): kernel<<<grid, block, smem,
// stream>>>(args...), with programmatic stream serialization where pdl_supported(kernel)
// (decided once per kernel and device). The kernel must call pdl_wait() as the rule above says.
// Returns the launch's error, for the caller's check. launch_pdl_cluster also groups the CTAs
// along y into thread-block clusters of cluster_y (sm_90+; 1: no cluster attribute).
template <auto Kernel, class... Args>
cudaError_t launch_pdl_cluster(dim3 grid, dim3 block, size_t smem, cudaStream_t st, int cluster_y, Args&&... args) {
  static PerDevice<bool> decided;  // once per kernel and device
  const bool on = decided.get([] {
    int ptx = 0;
    const bool ok = pdl_supported(reinterpret_cast<const void*>(Kernel), &ptx);
    if (!ok) note_pdl_off(ptx);
    return ok;
  });
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[2]{};
  unsigned na = 0;
  if (cluster_y > 1) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = 1;
    attr[na].val.clusterDim.y = unsigned(cluster_y);
    attr[na].val.clusterDim.z = 1;
    ++na;
  }
  if (on && kernel_switches().pdl) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    ++na;
  }
  cfg.attrs = attr;
  cfg.numAttrs = na;
  return cudaLaunchKernelEx(&cfg, Kernel, std::forward<Args>(args)...);
}
template <auto Kernel, class... Args>
cudaError_t launch_pdl(dim3 grid, dim3 block, size_t smem, cudaStream_t st, Args&&... args) {
  return launch_pdl_cluster<Kernel>(grid, block, smem, st, 1, std::forward<Args>(args)...);
}

}  // namespace kvlm::cuda

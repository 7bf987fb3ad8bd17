// CUDA build: query the runtime. Any error (no driver, no device) means "no devices".
#include <cuda_runtime.h>

#include "core/device.h"

namespace kvlm {

bool built_with_cuda() { return true; }

std::vector<GpuInfo> cuda_devices() {
  std::vector<GpuInfo> out;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error state of a failed query
    return out;
  }
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    out.push_back({.index = i, .name = p.name, .compute_capability = p.major * 10 + p.minor, .total_memory = p.totalGlobalMem});
  }
  return out;
}

std::optional<GpuMemory> cuda_memory_info(int index) {
  int prev = 0;
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(index) != cudaSuccess) {
    cudaGetLastError();
    return std::nullopt;
  }
  GpuMemory m;
  const bool ok = cudaMemGetInfo(&m.free, &m.total) == cudaSuccess;
  cudaSetDevice(prev);
  if (!ok) {
    cudaGetLastError();
    return std::nullopt;
  }
  return m;
}

}  // namespace kvlm

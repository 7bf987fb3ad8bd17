// What accelerators this process can see. Implemented with the CUDA runtime when built
// with KVLM_CUDA, and as "no devices" otherwise; this header includes no CUDA header.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kvlm {

struct GpuInfo {
  int index = 0;
  std::string name;
  int compute_capability = 0;  // major * 10 + minor, e.g. 90
  size_t total_memory = 0;
};

bool built_with_cuda();
// Visible CUDA devices; empty without a driver, without devices, or in a CPU-only build.
std::vector<GpuInfo> cuda_devices();

struct GpuMemory {
  size_t free = 0, total = 0;
};
// Free and total memory of CUDA device `index`; nullopt without one.
std::optional<GpuMemory> cuda_memory_info(int index);

}  // namespace kvlm

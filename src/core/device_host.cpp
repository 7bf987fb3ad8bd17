// CPU-only build: no CUDA runtime linked, so no devices.
#include "core/device.h"

namespace kvlm {
bool built_with_cuda() { return false; }
std::vector<GpuInfo> cuda_devices() { return {}; }
std::optional<GpuMemory> cuda_memory_info(int) { return std::nullopt; }
}  // namespace kvlm

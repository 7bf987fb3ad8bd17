// CPU-only build: no CUDA runtime linked, so no devices.
#include "core/device.h"

namespace kvlm {
bool built_with_cuda() { return false; }
std::vector<GpuInfo> cuda_devices() { return {}; }
}  // namespace kvlm

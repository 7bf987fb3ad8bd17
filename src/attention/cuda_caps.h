// What the CUDA attention kernels (src/ops/cuda) handle, as a BackendCapabilities
// declaration. No CUDA header: the selector and `kvlm inspect` can read it anywhere.
// Compiled and registered (attention/registry.cpp) in CUDA builds only.
#pragma once

#include "attention/backend.h"

namespace kvlm {

const BackendCapabilities& cuda_attention_capabilities();

}  // namespace kvlm

#include "attention/registry.h"

#include <vector>

#include "attention/cpu_backend.h"
#ifdef KVLM_WITH_CUDA
#include "attention/cuda_caps.h"
#endif
#include "core/error.h"

namespace kvlm {

namespace {
const CpuAttentionBackend& cpu_backend() {
  static const CpuAttentionBackend b;
  return b;
}
}  // namespace

std::span<const BackendCapabilities> builtin_backend_caps() {
  static const std::vector<BackendCapabilities> caps{
      CpuAttentionBackend::capabilities(),
#ifdef KVLM_WITH_CUDA
      cuda_attention_capabilities(),  // run by the CUDA model runner (model/cuda), not through AttentionBackend
#endif
  };
  return caps;
}

const AttentionBackend& backend_by_name(std::string_view name) {
  if (name == cpu_backend().caps().name) return cpu_backend();
  if (name == "cuda")
    throw Error("the 'cuda' attention backend runs inside the CUDA model runner (--device cuda); it has no host-side "
                "AttentionBackend");
  throw Error("no attention backend named '" + std::string(name) + "' in this build");
}

}  // namespace kvlm

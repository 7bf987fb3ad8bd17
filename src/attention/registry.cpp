#include "attention/registry.h"

#include <vector>

#include "attention/cpu_backend.h"
#include "core/error.h"

namespace kvlm {

namespace {
const CpuAttentionBackend& cpu_backend() {
  static const CpuAttentionBackend b;
  return b;
}
}  // namespace

std::span<const BackendCapabilities> builtin_backend_caps() {
  static const std::vector<BackendCapabilities> caps{CpuAttentionBackend::capabilities()};
  return caps;
}

const AttentionBackend& backend_by_name(std::string_view name) {
  if (name == cpu_backend().caps().name) return cpu_backend();
  throw Error("no attention backend named '" + std::string(name) + "' in this build");
}

}  // namespace kvlm

// The attention backends compiled into this binary.
#pragma once

#include <span>
#include <string_view>

#include "attention/backend.h"

namespace kvlm {

// Capability declarations of every compiled backend, for the selector and `kvlm inspect`.
std::span<const BackendCapabilities> builtin_backend_caps();
// The backend object for a name returned by the selector. Throws for unknown names.
const AttentionBackend& backend_by_name(std::string_view name);

}  // namespace kvlm

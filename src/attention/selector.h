// Attention backend selection: a pure function of a layer's spec, the backends'
// capability declarations and the runtime context (device, compute capability, a forced
// backend name). Every rejection carries its reason, and a failed selection lists them all.
#pragma once

#include <optional>
#include <span>
#include <string>

#include "attention/backend.h"

namespace kvlm {

struct SelectionContext {
  Device device = Device::Cpu;
  int compute_capability = 0;             // of the GPU in use; 0 on the CPU
  std::optional<std::string> forced;      // --attention-backend NAME
};

// nullopt when `caps` covers the layer in this context, else the reason it does not.
std::optional<std::string> rejection_reason(const BackendCapabilities& caps, const KVLayerSpec& layer,
                                            const SelectionContext& ctx);

// What the user should know about a layer the backend runs (nullopt: nothing): today, that
// its FP8 conversions run in software on this GPU (see ComputeTier).
std::optional<std::string> selection_note(const BackendCapabilities& caps, const KVLayerSpec& layer,
                                          const SelectionContext& ctx);

// The tier of `caps` that covers `compute_capability`; nullptr when none does (or it has none).
const ComputeTier* find_compute_tier(const BackendCapabilities& caps, int compute_capability);

std::string compute_capability_name(int cc);  // 86 -> "8.6"
// "8.0-8.8: sm_80 (FP8 converted in software); 9.0: sm_90a; ..." — the tiers in one line.
std::string describe_compute_tiers(const BackendCapabilities& caps);

// The highest-priority backend that fits (or the forced one, if it fits). Throws
// kvlm::Error listing every backend with its reason when none does.
const BackendCapabilities& select_backend(const KVLayerSpec& layer, std::span<const BackendCapabilities> backends,
                                          const SelectionContext& ctx);

// Runs select_backend on every layer of the plan and records the choice in the spec; each
// distinct selection_note is appended once to plan.warnings.
void assign_backends(KVPlan& plan, std::span<const BackendCapabilities> backends, const SelectionContext& ctx);

// A layer's KV format: "fp8_e4m3/fp8_per_tensor", or "K int8/int8_per_token_head, V int4/..." when apart.
std::string describe_kv_format(const KVLayerSpec& layer);
std::string describe_layer(const KVLayerSpec& layer);  // "layer 3 (sliding(8), fp8_e4m3/fp8_per_tensor, 4x128)"

}  // namespace kvlm

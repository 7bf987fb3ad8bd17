// An architecture kvlm runs, described once, in its own file under model/arch/: the names
// config.json gives it, what it reads from config.json beyond the fields every decoder shares,
// and how its model definition is built. Adding an architecture is that file plus its line in
// config/architectures.cpp (and in CMakeLists.txt).
//
// The list lives here, at the bottom of the layers, because config.json parsing needs it; the
// entries it names are defined in model/arch/, which include this header. The helpers below
// are the config.json rules more than one architecture shares.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace kvlm {

class ModelDefinition;  // model/architecture.h
struct ModelConfig;
struct RopeConfig;
struct MoeConfig;

struct ArchSpec {
  std::string_view name;                          // config.json architectures[0], e.g. "Qwen3MoeForCausalLM"
  std::span<const std::string_view> model_types;  // config.json model_type values naming it without 'architectures'
  // Reads what is particular to the architecture into `m` (activation, RoPE, biases, q/k norms,
  // per-layer attention, experts, ...), after parse_model_config has read the shared fields.
  // Throws kvlm::Error naming the field for anything it cannot run.
  void (*parse)(const nlohmann::json& cfg, ModelConfig& m) = nullptr;
  // Its model definition; null for an architecture that does not generate on its own, whose
  // `not_a_model` says how to use it instead.
  std::unique_ptr<ModelDefinition> (*make)(const ModelConfig& m) = nullptr;
  std::string_view not_a_model;
  bool dflash_target = false;  // a DFlash drafter can read its layers' outputs
  // Multimodal wrappers (e.g. "Qwen3_5ForConditionalGeneration") whose language model this is:
  // config.json's text_config holds its config, and the checkpoint its tensors under
  // model.language_model. (or language_model.model.); the vision tower is skipped.
  std::span<const std::string_view> wrappers;
  // Fills in what a wrapper's text_config may leave to the text config class's defaults (the
  // released Gemma 3 4B-27B configs give only the sizes that differ from Gemma3TextConfig's):
  // sets the keys `text` lacks, after the wrapper's top-level values. Null: none needed.
  void (*text_defaults)(nlohmann::json& text) = nullptr;
};

// Every architecture, in the order messages list them.
std::span<const ArchSpec* const> architectures();
// The HF class name ("?" for none).
std::string_view arch_name(const ArchSpec* a);

namespace arch_config {

// config.json's RoPE: `params` is transformers-5 rope_parameters (or one layer type's entry
// of it); otherwise the Hub's rope_theta (default `theta`) and an optional rope_scaling.
RopeConfig parse_rope(const nlohmann::json& cfg, const nlohmann::json* params, double theta,
                      const std::string& params_where);
// The usual case: rope_parameters or rope_theta + rope_scaling, default theta 1e4, and
// GGUF-written per-frequency factors (rope_freq_factors) -> m.rope.
void parse_standard_rope(const nlohmann::json& cfg, ModelConfig& m);
// hidden_act must be silu (the gated MLP's SiLU).
void require_silu(const nlohmann::json& cfg, std::string_view family);
// config.json's sliding_window (0 when absent or null).
int sliding_window(const nlohmann::json& cfg);
// Per-layer attention: layer_types when config.json has it (a sliding_attention layer gets
// `window`, or stays full when window is 0), else sliding where `sliding_by_default(layer)`
// (when window > 0).
void set_layer_windows(const nlohmann::json& cfg, ModelConfig& m, int window,
                       const std::function<bool(int)>& sliding_by_default);
// The Qwen rule (transformers' Qwen2/Qwen3 configs): sliding_window counts only with
// use_sliding_window, and without layer_types the layers from max_window_layers on slide.
void set_qwen_layer_windows(const nlohmann::json& cfg, ModelConfig& m);
// A mixture of experts' counts: num_experts or num_local_experts (the Hub and transformers 5
// write either; `preferred` first), num_experts_per_tok no larger than the experts. The other
// MoeConfig fields are the architecture's.
void parse_expert_counts(const nlohmann::json& cfg, std::string_view preferred, MoeConfig& e);
// Which layers hold the experts (m.moe_layers), as Qwen's MoE configs say: every
// decoder_sparse_step-th layer (default 1: all) except those of mlp_only_layers.
void set_sparse_layers(const nlohmann::json& cfg, ModelConfig& m);
// A positive integer field no larger than `max` (a corrupt config cannot make kvlm allocate
// absurd amounts); `fallback` when absent (nullopt: the field is required).
int positive_int(const nlohmann::json& cfg, std::string_view key, long long max, std::optional<int> fallback = {});

}  // namespace arch_config

}  // namespace kvlm

// The Llama family: Llama, Qwen2, Qwen3 and Mistral, one definition. What differs between
// them is data of ModelConfig: q/k/v, o and MLP biases, Qwen3's per-head q/k RMSNorm, tied
// embeddings, per-layer sliding windows (the KV plan carries the mask) and rope scaling.
//
//   x = embed(tokens)
//   per layer:  h = RMSNorm(x) ; qkv = h Wqkv^T (+b) ; prologue (q/k norm, RoPE, K/V -> pages)
//               x += attention(q) Wo^T (+b)
//               h = RMSNorm(x) ; x += (silu(h Wg^T) * (h Wu^T)) Wd^T   (gate/up fused)
//   logits = RMSNorm(x[logit rows]) Wlm^T
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "model/arch/blocks.h"
#include "model/architecture.h"

namespace kvlm {

namespace {

using namespace arch;

std::unique_ptr<ModelDefinition> make(const ModelConfig& c) {
  return std::make_unique<PreNormDecoder>(
      c, [&c](WeightList& list, const std::string& p, int, PreNormLayerWeights& L) { L.mlp = add_gated_mlp(list, c, p); });
}

bool attention_bias(const nlohmann::json& cfg) {
  return json_get::opt_bool(cfg, "attention_bias", "config.json").value_or(false);
}

void parse_llama(const nlohmann::json& cfg, ModelConfig& m) {
  arch_config::require_silu(cfg, "Llama");
  arch_config::parse_standard_rope(cfg, m);
  m.qkv_bias = m.o_bias = attention_bias(cfg);
  m.mlp_bias = json_get::opt_bool(cfg, "mlp_bias", "config.json").value_or(false);
  arch_config::set_layer_windows(cfg, m, 0, [](int) { return false; });  // Llama has no sliding window
}

void parse_mistral(const nlohmann::json& cfg, ModelConfig& m) {
  parse_llama(cfg, m);
  // Without layer_types Mistral's window applies to every layer.
  arch_config::set_layer_windows(cfg, m, arch_config::sliding_window(cfg), [](int) { return true; });
}

void parse_qwen2(const nlohmann::json& cfg, ModelConfig& m) {
  arch_config::require_silu(cfg, "Qwen2");
  arch_config::parse_standard_rope(cfg, m);
  m.qkv_bias = true;  // Qwen2 always has q/k/v biases and no o_proj bias
  arch_config::set_qwen_layer_windows(cfg, m);
}

void parse_qwen3(const nlohmann::json& cfg, ModelConfig& m) {
  arch_config::require_silu(cfg, "Qwen3");
  arch_config::parse_standard_rope(cfg, m);
  m.qk_norm = true;
  m.qkv_bias = m.o_bias = attention_bias(cfg);
  arch_config::set_qwen_layer_windows(cfg, m);
}

constexpr std::string_view kLlamaTypes[] = {"llama"}, kMistralTypes[] = {"mistral"}, kQwen2Types[] = {"qwen2"},
                           kQwen3Types[] = {"qwen3"};

}  // namespace

namespace arch_specs {
extern const ArchSpec llama{.name = "LlamaForCausalLM", .model_types = kLlamaTypes, .parse = parse_llama, .make = make,
                            .dflash_target = true};
extern const ArchSpec qwen2{.name = "Qwen2ForCausalLM", .model_types = kQwen2Types, .parse = parse_qwen2, .make = make,
                            .dflash_target = true};
extern const ArchSpec qwen3{.name = "Qwen3ForCausalLM", .model_types = kQwen3Types, .parse = parse_qwen3, .make = make,
                            .dflash_target = true};
extern const ArchSpec mistral{.name = "MistralForCausalLM", .model_types = kMistralTypes, .parse = parse_mistral,
                              .make = make, .dflash_target = true};
}  // namespace arch_specs

}  // namespace kvlm

// Qwen3.5 (Qwen3_5ForCausalLM, the text model of Qwen3.5's dense checkpoints) and Qwen3.5-MoE
// (Qwen3_5MoeForCausalLM): the hybrid decoder of model/arch/hybrid.h — Gated DeltaNet layers
// beside gated full-attention layers, three of the first to one of the second by default —
// with the DeltaNet's input projection stored as separate in_proj_qkv / z / b / a tensors.
// Qwen3.5's MLPs are dense; Qwen3.5-MoE's are, in every layer, experts stored fused as
// transformers 5 holds them (mlp.experts.gate_up_proj [E][2I][H], gate rows then up rows;
// down_proj [E][H][I]; router mlp.gate, always renormalized over the top k) plus a shared
// expert scaled by sigmoid(mlp.shared_expert_gate).
//
// The released checkpoints are the multimodal wrappers (Qwen3_5ForConditionalGeneration and
// its MoE twin): config.json's text_config and model.language_model.* tensors, read as the
// language model alone (ArchSpec::wrappers).
#include <nlohmann/json.hpp>

#include "model/arch/hybrid.h"

namespace kvlm {

namespace {

using namespace arch;

std::unique_ptr<ModelDefinition> make(const ModelConfig& c) {
  return std::make_unique<HybridDecoder>(
      c, DeltaNetProjections::Separate,
      [&c](WeightList& list, const std::string& p, int, HybridLayerWeights& L) { L.mlp = add_gated_mlp(list, c, p); });
}

void parse(const nlohmann::json& cfg, ModelConfig& m) { parse_hybrid(cfg, m, "Qwen3.5"); }

std::unique_ptr<ModelDefinition> make_moe(const ModelConfig& c) {
  return std::make_unique<HybridDecoder>(c, DeltaNetProjections::Separate,
                                         [&c](WeightList& list, const std::string& p, int, HybridLayerWeights& L) {
                                           L.moe = add_moe_stacked(list, c, p);
                                           add_shared_expert(list, c, p, *L.moe);
                                         });
}

void parse_moe(const nlohmann::json& cfg, ModelConfig& m) {
  parse_hybrid(cfg, m, "Qwen3.5-MoE");
  m.moe = parse_hybrid_experts(cfg, /*norm_topk=*/true);  // its router always renormalizes (no norm_topk_prob)
  m.moe_layers.assign(size_t(m.num_layers), true);
}

constexpr std::string_view kModelTypes[] = {"qwen3_5_text"};
constexpr std::string_view kWrappers[] = {"Qwen3_5ForConditionalGeneration"};
constexpr std::string_view kMoeModelTypes[] = {"qwen3_5_moe_text"};
constexpr std::string_view kMoeWrappers[] = {"Qwen3_5MoeForConditionalGeneration"};

}  // namespace

namespace arch_specs {
extern const ArchSpec qwen3_5{
    .name = "Qwen3_5ForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make, .wrappers = kWrappers};
extern const ArchSpec qwen3_5_moe{.name = "Qwen3_5MoeForCausalLM", .model_types = kMoeModelTypes, .parse = parse_moe,
                                  .make = make_moe, .wrappers = kMoeWrappers};
}  // namespace arch_specs

}  // namespace kvlm

// Qwen3-Next (Qwen3NextForCausalLM: Qwen3-Next-80B-A3B): the hybrid decoder of
// model/arch/hybrid.h with the DeltaNet's input projection stored interleaved per key head
// (in_proj_qkvz: q, k, then its value heads' v and z; in_proj_ba: b, then a), and mixtures of
// experts (one tensor per expert and projection as the Hub stores them, router mlp.gate with
// norm_topk_prob) plus a shared expert scaled by sigmoid(mlp.shared_expert_gate) — except the
// layers of mlp_only_layers and those decoder_sparse_step skips, which keep a dense MLP of
// intermediate_size.
#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "model/arch/hybrid.h"

namespace kvlm {

namespace {

using namespace arch;

std::unique_ptr<ModelDefinition> make(const ModelConfig& c) {
  return std::make_unique<HybridDecoder>(c, DeltaNetProjections::Interleaved,
                                         [&c](WeightList& list, const std::string& p, int layer, HybridLayerWeights& L) {
                                           if (c.moe_layers[size_t(layer)]) {
                                             L.moe = add_moe_per_expert(list, c, p);
                                             add_shared_expert(list, c, p, *L.moe);
                                           } else {
                                             L.mlp = add_gated_mlp(list, c, p);
                                           }
                                         });
}

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  parse_hybrid(cfg, m, "Qwen3-Next");
  m.moe = parse_hybrid_experts(cfg, json_get::opt_bool(cfg, "norm_topk_prob", "config.json").value_or(true));
  arch_config::set_sparse_layers(cfg, m);
}

constexpr std::string_view kModelTypes[] = {"qwen3_next"};

}  // namespace

namespace arch_specs {
extern const ArchSpec qwen3_next{.name = "Qwen3NextForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make};
}  // namespace arch_specs

}  // namespace kvlm

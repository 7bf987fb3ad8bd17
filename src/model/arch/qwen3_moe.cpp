// Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder's MoE models): the
// Qwen3 decoder (per-head q/k RMSNorm, GQA) whose MLPs are mixtures of experts, except the
// layers of mlp_only_layers and those decoder_sparse_step skips, which keep a dense MLP of
// intermediate_size.
//
//   per layer:  h = RMSNorm(x) ; attention as Qwen3 ; x += o-projection
//               h = RMSNorm(x) ; p = softmax(h Wr^T) ; the top k experts by p (renormalized
//               over them with norm_topk_prob) ; x += sum_k p_k down_k(silu(gate_k h) * up_k h)
//
// The checkpoint keeps each expert's projections as its own tensors
// (mlp.experts.E.{gate,up,down}_proj.weight) and the router as mlp.gate.weight.
#include <string>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"
#include "model/arch/blocks.h"
#include "model/architecture.h"

namespace kvlm {

namespace {

using namespace arch;
namespace jg = json_get;
constexpr std::string_view kWhere = "config.json";

std::unique_ptr<ModelDefinition> make(const ModelConfig& c) {
  return std::make_unique<PreNormDecoder>(c, [&c](WeightList& list, const std::string& p, int layer, PreNormLayerWeights& L) {
    if (c.moe_layers[size_t(layer)])
      L.moe = add_moe_per_expert(list, c, p);
    else
      L.mlp = add_gated_mlp(list, c, p);
  });
}

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  using arch_config::positive_int;
  arch_config::require_silu(cfg, "Qwen3-MoE");
  arch_config::parse_standard_rope(cfg, m);
  m.qk_norm = true;
  m.qkv_bias = m.o_bias = jg::opt_bool(cfg, "attention_bias", kWhere).value_or(false);
  arch_config::set_qwen_layer_windows(cfg, m);
  if (jg::opt_int(cfg, "shared_expert_intermediate_size", kWhere).value_or(0) > 0)
    throw Error("config.json: shared_expert_intermediate_size is set, but Qwen3-MoE has no shared expert (is this a "
                "Qwen2-MoE or Qwen3-Next checkpoint with the wrong architectures entry?)");
  MoeConfig e;
  arch_config::parse_expert_counts(cfg, "num_experts", e);  // transformers 5 saves num_local_experts
  e.expert_size = positive_int(cfg, "moe_intermediate_size", 1 << 20);
  e.norm_topk = jg::opt_bool(cfg, "norm_topk_prob", kWhere).value_or(false);
  e.act = GluActivation::Silu;
  m.moe = e;
  arch_config::set_sparse_layers(cfg, m);
}

constexpr std::string_view kModelTypes[] = {"qwen3_moe"};

}  // namespace

namespace arch_specs {
extern const ArchSpec qwen3_moe{.name = "Qwen3MoeForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make,
                                .dflash_target = true};
}  // namespace arch_specs

}  // namespace kvlm

// GPT-OSS (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): a pre-norm decoder whose attention
// has q/k/v/o biases, a learned sink logit per query head in every softmax, sliding windows
// (128) on alternate layers and YaRN RoPE, and whose every MLP is a mixture of experts with a
// biased router (top k by logit, softmax over those k) and biased experts with a clamped
// SwiGLU.
//
//   per layer:  h = RMSNorm(x) ; qkv = h Wqkv^T + b ; RoPE (yarn) ; K/V -> pages
//               x += attention_with_sinks(q) Wo^T + b
//               h = RMSNorm(x) ; l = h Wr^T + br ; the top k experts by l, p = softmax(l_topk)
//               x += sum_k p_k (Wd_k swiglu_clamp(Wgu_k h + bgu_k) + bd_k)
//   swiglu_clamp(g, u) = min(g, L) sigmoid(alpha min(g, L)) (clamp(u, -L, L) + 1)
//
// The checkpoint fuses the experts: mlp.experts.gate_up_proj [E][hidden][2I] (gate and up
// alternating column by column) and down_proj [E][I][hidden], with biases; the loader lays
// them out as MoeWeights (PieceLayout). The released checkpoints hold these in MXFP4
// (quantization_config quant_method mxfp4): the checkpoint shows them as these tensors
// (io/int4_checkpoint.h). A GGUF file (llama.cpp's gpt-oss) holds them per expert instead
// (MoeConfig::per_expert_tensors; io/gguf_model.h), as Qwen3-MoE's are, with their biases.
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
  return std::make_unique<PreNormDecoder>(c, [&c](WeightList& list, const std::string& p, int, PreNormLayerWeights& L) {
    L.moe = c.moe->per_expert_tensors ? add_moe_per_expert(list, c, p, "mlp.router") : add_moe_fused(list, c, p);
  });
}

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  // hidden_act says silu, but the experts' activation is the clamped SwiGLU below.
  if (jg::find(cfg, "rope_parameters") || jg::find(cfg, "rope_scaling")) {
    m.rope = arch_config::parse_rope(cfg, jg::find(cfg, "rope_parameters"), 150000.0, "config.json rope_parameters");
  } else {  // transformers' GptOssConfig default
    const nlohmann::json yarn = {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                                 {"truncate", false}, {"original_max_position_embeddings", 4096}};
    m.rope = arch_config::parse_rope(cfg, &yarn, 150000.0, "GPT-OSS's default rope_parameters");
  }
  m.rms_norm_eps = jg::opt_number(cfg, "rms_norm_eps", kWhere).value_or(1e-5);
  m.qkv_bias = m.o_bias = jg::opt_bool(cfg, "attention_bias", kWhere).value_or(true);
  m.attention_sinks = true;
  // Without layer_types: even layers slide, odd ones attend fully (GptOssConfig's default).
  const int window = jg::find(cfg, "sliding_window") ? arch_config::sliding_window(cfg) : 128;
  arch_config::set_layer_windows(cfg, m, window, [](int i) { return (i + 1) % 2 != 0; });
  MoeConfig e;
  arch_config::parse_expert_counts(cfg, "num_local_experts", e);
  e.expert_size = m.intermediate_size;  // GPT-OSS's intermediate_size is each expert's width
  e.norm_topk = true;                    // softmax over the top k logits
  e.router_bias = e.expert_bias = true;
  e.act = GluActivation::SwigluClamp;
  e.swiglu_alpha = float(jg::opt_number(cfg, "swiglu_alpha", kWhere).value_or(1.702));
  e.swiglu_limit = float(jg::opt_number(cfg, "swiglu_limit", kWhere).value_or(7.0));
  if (!(e.swiglu_limit > 0)) throw Error("config.json: swiglu_limit must be positive");
  e.per_expert_tensors = jg::opt_bool(cfg, "per_expert_tensors", kWhere).value_or(false);
  m.moe = e;
  m.moe_layers.assign(size_t(m.num_layers), true);
}

constexpr std::string_view kModelTypes[] = {"gpt_oss"};

}  // namespace

namespace arch_specs {
extern const ArchSpec gpt_oss{.name = "GptOssForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make,
                              .dflash_target = true};
}  // namespace arch_specs

}  // namespace kvlm

// Gemma 3 (Gemma3ForCausalLM, the text model): sliding-window and global layers (5:1 by
// default), each kind with its own RoPE (rope_local_base_freq on sliding layers, rope_theta
// with rope_scaling on global ones), per-head q/k RMSNorm, Gemma's RMSNorm that scales by
// (1 + w), norms before and after both attention and MLP, a GELU(tanh)-gated MLP,
// embeddings scaled by sqrt(hidden) and attention scores by query_pre_attn_scalar^-0.5.
//
//   x = embed(tokens) * sqrt(hidden)
//   per layer:  h = RMSNorm(x) ; qkv = h Wqkv^T ; prologue (q/k norm, the layer kind's RoPE, K/V -> pages)
//               x += RMSNorm(attention(q) Wo^T)
//               h = RMSNorm(x) ; x += RMSNorm((gelu_tanh(h Wg^T) * (h Wu^T)) Wd^T)
//   logits = RMSNorm(x[logit rows]) Wlm^T        (Wlm = the embedding table unless untied)
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"
#include "core/numeric.h"
#include "model/arch/blocks.h"
#include "model/architecture.h"

namespace kvlm {

namespace {

using namespace arch;

class Gemma3 final : public ModelDefinition {
 public:
  explicit Gemma3(const ModelConfig& c) : cfg_(c) {
    const int64_t hd = c.hidden_size;
    auto norm = [&](const std::string& name) { return add_norm(weights_, name, hd, /*add_one=*/true); };
    emb_ = add_embedding(weights_, c);
    embedding_ = emb_.embed;
    lm_head_ = emb_.lm_head;
    final_norm_ = norm("model.norm.weight");
    rope_global_ = add_rope(weights_, c.rope, c.head_dim);
    rope_local_ = add_rope(weights_, c.rope_local.value_or(c.rope), c.head_dim);
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer L;
      L.sliding = c.layers[size_t(i)].kind == AttentionKind::Sliding;
      L.in_norm = norm(p + "input_layernorm.weight");
      L.post_attn_norm = norm(p + "post_attention_layernorm.weight");
      L.pre_ff_norm = norm(p + "pre_feedforward_layernorm.weight");
      L.post_ff_norm = norm(p + "post_feedforward_layernorm.weight");
      L.attn = add_attention(weights_, c, p, /*norm_add_one=*/true);
      L.mlp = add_gated_mlp(weights_, c, p);
      layers_.push_back(L);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    auto W = [&](size_t i) { return weight_or_empty(w, i); };
    const float eps = float(cfg_.rms_norm_eps);
    const float scale_global = softmax_scale(cfg_, cfg_.rope), scale_local = softmax_scale(cfg_, *cfg_.rope_local);
    const DecoderActivations a = alloc_decoder_activations(ops, cfg_);
    ops.embed(w[emb_.embed], embed_scale(w[emb_.embed].dtype), a.x);
    Tensor pending;  // the last layer's normed MLP output, added by the next norm
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      ops.add_rmsnorm(a.x, pending, w[L.in_norm], eps, a.h);
      if (li > 0) ops.capture(int(li) - 1, a.x);
      ops.linear(a.h, w[L.attn.qkv], W(L.attn.bqkv), a.qkv);
      ops.attention_prologue(int(li), a.qkv,
                             {.q_norm = w[L.attn.q_norm],
                              .k_norm = w[L.attn.k_norm],
                              .inv_freq = w[L.sliding ? rope_local_ : rope_global_],
                              .eps = eps},
                             a.q);
      ops.attention(int(li), a.q, a.attn, L.sliding ? scale_local : scale_global, Weight{});
      ops.linear(a.attn, w[L.attn.o], W(L.attn.bo), a.delta);
      ops.all_reduce_sum(a.delta);
      ops.rmsnorm(a.delta, w[L.post_attn_norm], eps, a.delta);
      ops.add_rmsnorm(a.x, a.delta, w[L.pre_ff_norm], eps, a.h);
      ops.linear(a.h, w[L.mlp.gate_up], W(L.mlp.b_gate_up), a.gu);
      ops.mlp_down(cfg_.hidden_act, a.gu, w[L.mlp.down], W(L.mlp.b_down), a.delta);
      ops.all_reduce_sum(a.delta);
      ops.rmsnorm(a.delta, w[L.post_ff_norm], eps, a.delta);
      pending = a.delta;
    }
    return final_logits(ops, cfg_, a.x, pending, w[final_norm_], w[emb_.lm_head]);
  }

 private:
  // sqrt(hidden) in the embedding table's type, as transformers multiplies (the CPU's fp32
  // table: exact; a bf16 table: sqrt(hidden) rounded to bf16).
  float embed_scale(DType table) const {
    const float s = std::sqrt(float(cfg_.hidden_size));
    if (table == DType::BF16) return num::bf16_to_f32(num::f32_to_bf16(s));
    if (table == DType::F16) return num::f16_to_f32(num::f32_to_f16(s));
    return s;
  }

  struct Layer {
    bool sliding = false;
    size_t in_norm = kNoWeight, post_attn_norm = kNoWeight, pre_ff_norm = kNoWeight, post_ff_norm = kNoWeight;
    AttentionWeights attn;
    MlpWeights mlp;
  };
  ModelConfig cfg_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, rope_global_ = kNoWeight, rope_local_ = kNoWeight;
  std::vector<Layer> layers_;
};

std::unique_ptr<ModelDefinition> make(const ModelConfig& cfg) { return std::make_unique<Gemma3>(cfg); }

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  namespace jg = json_get;
  constexpr std::string_view kWhere = "config.json";
  // Gemma configs name the activation hidden_activation (older ones hidden_act).
  std::optional<std::string> act = jg::opt_string(cfg, "hidden_activation", kWhere);
  if (!act) act = jg::opt_string(cfg, "hidden_act", kWhere);
  if (act && *act != "gelu_pytorch_tanh")
    throw Error("config.json: hidden_activation '" + *act + "' is not supported for Gemma 3; kvlm supports gelu_pytorch_tanh");
  m.hidden_act = GluActivation::GeluTanh;
  // Global layers: rope_theta (default 1e6) with rope_scaling; sliding layers: plain RoPE with
  // rope_local_base_freq (default 1e4). transformers 5 writes both as rope_parameters keyed by
  // layer type.
  const nlohmann::json* rope_params = jg::find(cfg, "rope_parameters");
  const nlohmann::json* full = rope_params && rope_params->is_object() ? jg::find(*rope_params, "full_attention") : nullptr;
  const nlohmann::json* local = rope_params && rope_params->is_object() ? jg::find(*rope_params, "sliding_attention") : nullptr;
  m.rope = arch_config::parse_rope(cfg, full ? full : (local ? nullptr : rope_params), 1e6,
                                   "config.json rope_parameters.full_attention");
  RopeConfig l;
  l.theta = jg::opt_number(cfg, "rope_local_base_freq", kWhere).value_or(1e4);
  if (local) {
    const nlohmann::json none = nlohmann::json::object();
    l = arch_config::parse_rope(none, local, l.theta, "config.json rope_parameters.sliding_attention");
  }
  if (!(l.theta > 0)) throw Error("config.json: rope_local_base_freq must be positive");
  m.rope_local = l;
  m.query_pre_attn_scalar = jg::opt_number(cfg, "query_pre_attn_scalar", kWhere).value_or(256.0);
  if (!(*m.query_pre_attn_scalar > 0)) throw Error("config.json: query_pre_attn_scalar must be positive");
  for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"})
    if (jg::opt_number(cfg, cap, kWhere))
      throw Error(std::string("config.json: ") + cap + " is set; kvlm does not implement logit soft-capping (Gemma 2)");
  m.tie_word_embeddings = jg::opt_bool(cfg, "tie_word_embeddings", kWhere).value_or(true);
  m.qk_norm = true;
  m.qkv_bias = m.o_bias = jg::opt_bool(cfg, "attention_bias", kWhere).value_or(false);
  // Without layer_types, every sliding_window_pattern-th layer is global and the others slide
  // (window default 4096, transformers' Gemma3TextConfig default).
  const int window = jg::find(cfg, "sliding_window") ? arch_config::sliding_window(cfg) : 4096;
  std::optional<long long> pattern = jg::opt_int(cfg, "sliding_window_pattern", kWhere);
  if (!pattern) pattern = jg::opt_int(cfg, "_sliding_window_pattern", kWhere);
  const long long every = pattern.value_or(6);
  if (every <= 0) throw Error("config.json: sliding_window_pattern must be positive");
  arch_config::set_layer_windows(cfg, m, window, [&](int i) { return (i + 1) % every != 0; });
}

constexpr std::string_view kModelTypes[] = {"gemma3_text"};
// Gemma 3 4B, 12B and 27B ship as the multimodal Gemma3ForConditionalGeneration, whose
// text_config names only what differs from Gemma3TextConfig (4B: hidden and MLP sizes, layers,
// the global layers' linear RoPE scaling, the window): the class's defaults (transformers 5.24)
// fill the rest.
constexpr std::string_view kWrappers[] = {"Gemma3ForConditionalGeneration"};
void text_defaults(nlohmann::json& t) {
  const nlohmann::json defaults = {
      {"vocab_size", 262208},         {"hidden_size", 2304},        {"intermediate_size", 9216},
      {"num_hidden_layers", 26},      {"num_attention_heads", 8},   {"num_key_value_heads", 4},
      {"head_dim", 256},              {"hidden_activation", "gelu_pytorch_tanh"},
      {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-6}, {"attention_bias", false},
      {"query_pre_attn_scalar", 256}, {"sliding_window", 4096},     {"tie_word_embeddings", true},
      {"bos_token_id", 2},            {"eos_token_id", 1}};
  for (const auto& [k, v] : defaults.items())  // (parse() defaults the RoPE thetas itself)
    if (!t.contains(k)) t[k] = v;
}

}  // namespace

namespace arch_specs {
extern const ArchSpec gemma3{.name = "Gemma3ForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make,
                             .wrappers = kWrappers, .text_defaults = text_defaults};
}  // namespace arch_specs

}  // namespace kvlm

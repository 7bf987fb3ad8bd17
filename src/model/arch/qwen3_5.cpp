// Qwen3.5 (Qwen3_5ForCausalLM, the text model of Qwen3.5's dense checkpoints): a hybrid of Gated
// DeltaNet layers (linear attention with a recurrent state per sequence) and gated full-
// attention layers, three of the first to one of the second by default.
//
//   per layer:  h = RMSNorm(x)                                       ((1 + w) norms throughout)
//     linear:   m = h [Wqkv | Wz | Wb | Wa]^T ; o = GatedDeltaNet(m) (conv, delta rule, gated
//               norm; Ops::gated_delta_net) ; x += o Wout^T
//     full:     qkvg = h [Wq | Wk | Wv | Wgate]^T (q_proj's rows hold each head's query, then its
//               gate) ; prologue (q/k (1 + w) norms, partial RoPE, K/V -> pages) ;
//               x += (attention(q) * sigmoid(gate)) Wo^T
//     then:     h = RMSNorm(x) ; x += (silu(h Wg^T) * (h Wu^T)) Wd^T
//   logits = RMSNorm(x[logit rows]) Wlm^T
//
// The KV plan holds the full-attention layers only (attention_layers): KV layer i is the i-th
// of them, and linear layer j the j-th Gated DeltaNet layer, whose states the runner keeps.
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

struct LinearLayerWeights {
  size_t in_proj = kNoWeight, out_proj = kNoWeight, conv = kNoWeight, a_log = kNoWeight, dt_bias = kNoWeight,
         norm = kNoWeight;
};

struct HybridLayer {
  bool linear = false;
  int index = 0;  // among the linear layers, or among the attention layers (its KV layer)
  size_t in_norm = kNoWeight, post_norm = kNoWeight;
  LinearLayerWeights lin;
  AttentionWeights attn;  // qkv: q | k | v | gate
  MlpWeights mlp;
};

size_t add(WeightList& list, std::vector<WeightPiece> pieces, WeightRole role) {
  return list.add(WeightSpec{.pieces = std::move(pieces), .role = role});
}

class Qwen35 : public ModelDefinition {
 public:
  explicit Qwen35(const ModelConfig& c) : cfg_(c), lin_(*c.linear_attention) {
    emb_ = add_embedding(weights_, c);
    embedding_ = emb_.embed;
    lm_head_ = emb_.lm_head;
    final_norm_ = add_norm(weights_, "model.norm.weight", c.hidden_size, /*add_one=*/true);
    inv_freq_ = add_rope(weights_, c.rope, c.head_dim);
    const int64_t H = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
    int n_linear = 0, n_attn = 0;
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      HybridLayer L;
      L.linear = c.is_linear_layer(i);
      L.index = L.linear ? n_linear++ : n_attn++;
      L.in_norm = add_norm(weights_, p + "input_layernorm.weight", H, true);
      L.post_norm = add_norm(weights_, p + "post_attention_layernorm.weight", H, true);
      if (L.linear) {
        const std::string a = p + "linear_attn.";
        const int64_t cd = lin_.conv_dim(), vd = lin_.value_dim(), hv = lin_.v_heads;
        L.lin.in_proj = weights_.add(WeightSpec{.pieces = {{a + "in_proj_qkv.weight", {cd, H}},
                                                           {a + "in_proj_z.weight", {vd, H}},
                                                           {a + "in_proj_b.weight", {hv, H}},
                                                           {a + "in_proj_a.weight", {hv, H}}},
                                                .role = WeightRole::Matrix,
                                                .linear = true});
        L.lin.out_proj = weights_.add(
            WeightSpec{.pieces = {{a + "out_proj.weight", {H, vd}}}, .role = WeightRole::Matrix, .linear = true});
        L.lin.conv = add(weights_, {{a + "conv1d.weight", {cd, 1, lin_.conv_kernel}}}, WeightRole::Norm);
        L.lin.a_log = add(weights_, {{a + "A_log", {hv}}}, WeightRole::Norm);
        L.lin.dt_bias = add(weights_, {{a + "dt_bias", {hv}}}, WeightRole::Norm);
        L.lin.norm = add_norm(weights_, a + "norm.weight", lin_.v_dim);  // the gated norm: w, not 1 + w
      } else {
        const std::string a = p + "self_attn.";
        L.attn.qkv = weights_.add(WeightSpec{
            .pieces = {{.name = a + "q_proj.weight", .shape = {2 * nh * d, H}, .shard_units = nh,
                        .layout = PieceLayout::HeadsFirstHalf},
                       {a + "k_proj.weight", {kvh * d, H}, kvh},
                       {a + "v_proj.weight", {kvh * d, H}, kvh},
                       {.name = a + "q_proj.weight", .shape = {2 * nh * d, H}, .shard_units = nh,
                        .layout = PieceLayout::HeadsSecondHalf}},
            .role = WeightRole::Matrix,
            .linear = true});
        L.attn.o = weights_.add(
            WeightSpec{.pieces = {{a + "o_proj.weight", {H, nh * d}, nh}}, .role = WeightRole::Matrix, .linear = true});
        L.attn.q_norm = add_norm(weights_, a + "q_norm.weight", d, true);
        L.attn.k_norm = add_norm(weights_, a + "k_norm.weight", d, true);
      }
      L.mlp = add_gated_mlp(weights_, c, p);
      layers_.push_back(L);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    const ModelConfig& c = cfg_;
    const int64_t T = ops.num_tokens(), H = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
    const float eps = float(c.rms_norm_eps), scale = softmax_scale(c, c.rope);
    const Tensor x = ops.alloc(ActRole::Residual, T, H), h = ops.alloc(ActRole::Hidden, T, H);
    const Tensor qkvg = ops.alloc(ActRole::Hidden, T, (2 * nh + 2 * kvh) * d), q = ops.alloc(ActRole::Query, T, nh * d);
    const Tensor attn = ops.alloc(ActRole::Hidden, T, nh * d), delta = ops.alloc(ActRole::Hidden, T, H);
    const Tensor mixed = ops.alloc(ActRole::Hidden, T, lin_.in_proj_dim());
    const Tensor core = ops.alloc(ActRole::Hidden, T, lin_.value_dim());
    const Tensor gu = ops.alloc(ActRole::Hidden, T, 2 * int64_t(c.intermediate_size));
    ops.embed(w[emb_.embed], 1.0f, x);
    Tensor pending;
    for (const HybridLayer& L : layers_) {
      ops.add_rmsnorm(x, pending, w[L.in_norm], eps, h);
      if (L.linear) {
        ops.linear(h, w[L.lin.in_proj], Weight{}, mixed);
        ops.gated_delta_net(L.index, lin_, mixed,
                            {.conv = w[L.lin.conv], .a_log = w[L.lin.a_log], .dt_bias = w[L.lin.dt_bias],
                             .norm = w[L.lin.norm], .eps = eps},
                            core);
        ops.linear(core, w[L.lin.out_proj], Weight{}, delta);
      } else {
        ops.linear(h, w[L.attn.qkv], Weight{}, qkvg);
        ops.attention_prologue(
            L.index, qkvg, {.q_norm = w[L.attn.q_norm], .k_norm = w[L.attn.k_norm], .inv_freq = w[inv_freq_], .eps = eps}, q);
        ops.attention(L.index, q, attn, scale, Weight{});
        ops.sigmoid_gate(attn, qkvg, (nh + 2 * kvh) * d);
        ops.linear(attn, w[L.attn.o], Weight{}, delta);
      }
      ops.add_rmsnorm(x, delta, w[L.post_norm], eps, h);
      ops.linear(h, w[L.mlp.gate_up], Weight{}, gu);
      ops.mlp_down(c.hidden_act, gu, w[L.mlp.down], Weight{}, delta);
      pending = delta;
    }
    return final_logits(ops, c, x, pending, w[final_norm_], w[emb_.lm_head]);
  }

 private:
  ModelConfig cfg_;
  LinearAttentionConfig lin_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<HybridLayer> layers_;
};

std::unique_ptr<ModelDefinition> make(const ModelConfig& c) { return std::make_unique<Qwen35>(c); }

// Which layers are Gated DeltaNet layers: layer_types ("linear_attention" / "full_attention"),
// else every full_attention_interval-th layer (default 4) is full attention.
void parse_layer_kinds(const nlohmann::json& cfg, ModelConfig& m) {
  using arch_config::positive_int;
  m.layers.assign(size_t(m.num_layers), LayerAttention{});
  m.linear_layers.assign(size_t(m.num_layers), false);
  if (const nlohmann::json* lt = jg::find(cfg, "layer_types")) {
    if (!lt->is_array() || lt->size() != size_t(m.num_layers))
      throw Error("config.json: 'layer_types' must be a list with one entry per layer (" + std::to_string(m.num_layers) +
                  ")");
    for (size_t i = 0; i < lt->size(); ++i) {
      const nlohmann::json& t = (*lt)[i];
      const std::string s = t.is_string() ? t.get<std::string>() : t.dump();
      if (s == "linear_attention") m.linear_layers[i] = true;
      else if (s != "full_attention")
        throw Error("config.json: layer_types[" + std::to_string(i) + "] is '" + s +
                    "'; Qwen3.5 layers are linear_attention or full_attention");
    }
  } else {
    const int every = positive_int(cfg, "full_attention_interval", 1 << 20, 4);
    for (int i = 0; i < m.num_layers; ++i) m.linear_layers[size_t(i)] = (i + 1) % every != 0;
  }
  if (m.num_linear_layers() == m.num_layers)
    throw Error("config.json: every layer is linear_attention; kvlm needs at least one full_attention layer");
}

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  using arch_config::positive_int;
  arch_config::require_silu(cfg, "Qwen3.5");
  arch_config::parse_standard_rope(cfg, m);
  if (jg::opt_bool(cfg, "attention_bias", kWhere).value_or(false))
    throw Error("config.json: attention_bias is true; Qwen3.5 checkpoints have none and kvlm does not read them");
  // Partial rotary: rope_parameters' partial_rotary_factor (transformers 5), or the top-level one.
  double partial = 1.0;
  if (const nlohmann::json* rp = jg::find(cfg, "rope_parameters"); rp && rp->is_object())
    if (auto f = jg::opt_number(*rp, "partial_rotary_factor", "config.json rope_parameters")) partial = *f;
  if (auto f = jg::opt_number(cfg, "partial_rotary_factor", kWhere)) partial = *f;
  const double rot = partial * m.head_dim;
  if (!(partial > 0 && partial <= 1) || rot != double(int(rot)) || int(rot) % 2 != 0)
    throw Error("config.json: partial_rotary_factor " + std::to_string(partial) + " times head_dim " +
                std::to_string(m.head_dim) + " must be an even number of dimensions in (0, head_dim]");
  if (int(rot) < m.head_dim) m.rope.rotary_dim = int(rot);
  m.qk_norm = true;
  m.attn_output_gate = true;
  LinearAttentionConfig l;
  l.k_heads = positive_int(cfg, "linear_num_key_heads", 4096);
  l.v_heads = positive_int(cfg, "linear_num_value_heads", 4096);
  l.k_dim = positive_int(cfg, "linear_key_head_dim", 4096);
  l.v_dim = positive_int(cfg, "linear_value_head_dim", 4096);
  l.conv_kernel = positive_int(cfg, "linear_conv_kernel_dim", 64);
  if (l.v_heads % l.k_heads != 0)
    throw Error("config.json: linear_num_value_heads (" + std::to_string(l.v_heads) +
                ") must be a multiple of linear_num_key_heads (" + std::to_string(l.k_heads) + ")");
  m.linear_attention = l;
  parse_layer_kinds(cfg, m);
}

constexpr std::string_view kModelTypes[] = {"qwen3_5_text"};
constexpr std::string_view kWrappers[] = {"Qwen3_5ForConditionalGeneration"};

}  // namespace

namespace arch_specs {
extern const ArchSpec qwen3_5{
    .name = "Qwen3_5ForCausalLM", .model_types = kModelTypes, .parse = parse, .make = make, .wrappers = kWrappers};
}  // namespace arch_specs

}  // namespace kvlm

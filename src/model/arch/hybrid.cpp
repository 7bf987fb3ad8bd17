#include "model/arch/hybrid.h"

#include <string>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"

namespace kvlm::arch {

namespace {

namespace jg = json_get;
constexpr std::string_view kWhere = "config.json";

// Tensor `name` (shape `shape`) whose rows are q | k | v of the Gated DeltaNet (in_proj_qkv,
// conv1d): for tensor-parallel loading its three sections, each split by key heads; one rank
// takes it whole (a 4-bit checkpoint's blocks stay kept).
std::vector<WeightPiece> qkv_pieces(const ModelConfig& c, const LinearAttentionConfig& l, const std::string& name,
                                    const std::vector<int64_t>& shape) {
  if (c.weight_split <= 1) return {{name, shape}};
  const int64_t kd = l.key_dim(), kh = l.k_heads;
  auto section = [&](int64_t begin, int64_t count) {
    return WeightPiece{.name = name, .shape = shape, .shard_units = kh, .row_begin = begin, .row_count = count};
  };
  return {section(0, kd), section(kd, kd), section(2 * kd, l.value_dim())};
}

// The fused input projection [q | k | v | z | b | a] of Gated DeltaNet layer `a` (its prefix),
// split by key heads under tensor parallelism: a rank holds its key heads' q and k rows and
// their value heads' v, z, b and a rows.
size_t add_in_proj(WeightList& list, const ModelConfig& c, const LinearAttentionConfig& l, DeltaNetProjections proj,
                   const std::string& a) {
  const int64_t H = c.hidden_size, vd = l.value_dim(), hv = l.v_heads, kh = l.k_heads;
  if (proj == DeltaNetProjections::Separate) {
    std::vector<WeightPiece> pieces = qkv_pieces(c, l, a + "in_proj_qkv.weight", {l.conv_dim(), H});
    pieces.push_back({a + "in_proj_z.weight", {vd, H}, kh});
    pieces.push_back({a + "in_proj_b.weight", {hv, H}, kh});
    pieces.push_back({a + "in_proj_a.weight", {hv, H}, kh});
    return add_linear(list, std::move(pieces), Shard::Rows);
  }
  // Per key head g: q, k (k_dim rows each), then v and z of its r = v_heads / k_heads value
  // heads (r v_dim rows each); in_proj_ba per key head: b, then a (r rows each).
  const int64_t dk = l.k_dim, r = l.v_heads / l.k_heads, rv = r * l.v_dim;
  const std::string qkvz = a + "in_proj_qkvz.weight", ba = a + "in_proj_ba.weight";
  const std::vector<int64_t> qkvz_shape{kh * (2 * dk + 2 * rv), H}, ba_shape{kh * 2 * r, H};
  auto slice = [&](const std::string& name, const std::vector<int64_t>& shape, int64_t begin, int64_t rows) {
    return WeightPiece{.name = name, .shape = shape, .shard_units = kh, .layout = PieceLayout::GroupRows,
                       .group_begin = begin, .group_rows = rows};
  };
  return add_linear(list,
                    {slice(qkvz, qkvz_shape, 0, dk), slice(qkvz, qkvz_shape, dk, dk),
                     slice(qkvz, qkvz_shape, 2 * dk, rv), slice(qkvz, qkvz_shape, 2 * dk + rv, rv),
                     slice(ba, ba_shape, 0, r), slice(ba, ba_shape, r, r)},
                    Shard::Rows);
}

}  // namespace

HybridDecoder::HybridDecoder(const ModelConfig& c, DeltaNetProjections projections, const HybridMlpAdder& mlp)
    : cfg_(c), lin_(*c.linear_attention) {
  emb_ = add_embedding(weights_, c);
  embedding_ = emb_.embed;
  lm_head_ = emb_.lm_head;
  final_norm_ = add_norm(weights_, "model.norm.weight", c.hidden_size, /*add_one=*/true);
  inv_freq_ = add_rope(weights_, c.rope, c.head_dim);
  const int64_t H = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
  int n_linear = 0, n_attn = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    HybridLayerWeights L;
    L.linear = c.is_linear_layer(i);
    L.index = L.linear ? n_linear++ : n_attn++;
    L.in_norm = add_norm(weights_, p + "input_layernorm.weight", H, true);
    L.post_norm = add_norm(weights_, p + "post_attention_layernorm.weight", H, true);
    if (L.linear) {
      const std::string a = p + "linear_attn.";
      const int64_t cd = lin_.conv_dim(), vd = lin_.value_dim(), hv = lin_.v_heads, kh = lin_.k_heads;
      L.in_proj = add_in_proj(weights_, c, lin_, projections, a);
      L.out_proj = add_linear(weights_, {{a + "out_proj.weight", {H, vd}, kh}}, Shard::Cols);
      L.conv = add_weight(weights_, qkv_pieces(c, lin_, a + "conv1d.weight", {cd, 1, lin_.conv_kernel}),
                          WeightRole::Norm, Shard::Rows);
      L.a_log = add_weight(weights_, {{a + "A_log", {hv}, kh}}, WeightRole::Norm, Shard::Rows);
      L.dt_bias = add_weight(weights_, {{a + "dt_bias", {hv}, kh}}, WeightRole::Norm, Shard::Rows);
      L.gated_norm = add_norm(weights_, a + "norm.weight", lin_.v_dim);  // the gated norm: w, not 1 + w
    } else {
      const std::string a = p + "self_attn.";
      // q_proj: per head its query (d rows), then its gate (d rows).
      const WeightPiece q{.name = a + "q_proj.weight", .shape = {2 * nh * d, H}, .shard_units = nh,
                          .layout = PieceLayout::GroupRows, .group_rows = d};
      WeightPiece gate = q;
      gate.group_begin = d;
      L.attn.qkv = add_linear(
          weights_, {q, {a + "k_proj.weight", {kvh * d, H}, kvh}, {a + "v_proj.weight", {kvh * d, H}, kvh}, gate},
          Shard::Rows);
      L.attn.o = add_linear(weights_, {{a + "o_proj.weight", {H, nh * d}, nh}}, Shard::Cols);
      L.attn.q_norm = add_norm(weights_, a + "q_norm.weight", d, true);
      L.attn.k_norm = add_norm(weights_, a + "k_norm.weight", d, true);
    }
    mlp(weights_, p, i, L);
    layers_.push_back(L);
  }
}

Tensor HybridDecoder::forward(Ops& ops, std::span<const Weight> w) const {
  const ModelConfig& c = cfg_;
  auto W = [&](size_t i) { return weight_or_empty(w, i); };
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
  for (const HybridLayerWeights& L : layers_) {
    ops.add_rmsnorm(x, pending, w[L.in_norm], eps, h);
    if (L.linear) {
      ops.linear(h, w[L.in_proj], Weight{}, mixed);
      ops.gated_delta_net(L.index, lin_, mixed,
                          {.conv = w[L.conv], .a_log = w[L.a_log], .dt_bias = w[L.dt_bias], .norm = w[L.gated_norm],
                           .eps = eps},
                          core);
      ops.linear(core, w[L.out_proj], Weight{}, delta);
      ops.all_reduce_sum(delta);
    } else {
      ops.linear(h, w[L.attn.qkv], Weight{}, qkvg);
      ops.attention_prologue(
          L.index, qkvg, {.q_norm = w[L.attn.q_norm], .k_norm = w[L.attn.k_norm], .inv_freq = w[inv_freq_], .eps = eps}, q);
      ops.attention(L.index, q, attn, scale, Weight{});
      ops.sigmoid_gate(attn, qkvg, (nh + 2 * kvh) * d);
      ops.linear(attn, w[L.attn.o], Weight{}, delta);
      ops.all_reduce_sum(delta);
    }
    ops.add_rmsnorm(x, delta, w[L.post_norm], eps, h);
    if (L.moe) {
      ops.moe(h, *c.moe, moe_weights(w, *L.moe), delta);
    } else {
      ops.linear(h, w[L.mlp.gate_up], W(L.mlp.b_gate_up), gu);
      ops.mlp_down(c.hidden_act, gu, w[L.mlp.down], W(L.mlp.b_down), delta);
    }
    ops.all_reduce_sum(delta);
    pending = delta;
  }
  return final_logits(ops, c, x, pending, w[final_norm_], w[emb_.lm_head]);
}

namespace {

// Which layers are Gated DeltaNet layers: layer_types ("linear_attention" / "full_attention"),
// else every full_attention_interval-th layer (default 4) is full attention.
void parse_layer_kinds(const nlohmann::json& cfg, ModelConfig& m, std::string_view family) {
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
        throw Error("config.json: layer_types[" + std::to_string(i) + "] is '" + s + "'; " + std::string(family) +
                    " layers are linear_attention or full_attention");
    }
  } else {
    const int every = positive_int(cfg, "full_attention_interval", 1 << 20, 4);
    for (int i = 0; i < m.num_layers; ++i) m.linear_layers[size_t(i)] = (i + 1) % every != 0;
  }
  if (m.num_linear_layers() == m.num_layers)
    throw Error("config.json: every layer is linear_attention; kvlm needs at least one full_attention layer");
}

}  // namespace

void parse_hybrid(const nlohmann::json& cfg, ModelConfig& m, std::string_view family) {
  using arch_config::positive_int;
  arch_config::require_silu(cfg, family);
  arch_config::parse_standard_rope(cfg, m);
  if (jg::opt_bool(cfg, "attention_bias", kWhere).value_or(false))
    throw Error("config.json: attention_bias is true; " + std::string(family) +
                " checkpoints have none and kvlm does not read them");
  // Partial rotary: rope_parameters' partial_rotary_factor (transformers 5), else the top-level
  // one, else 0.25 (what transformers' configs of this family default to).
  std::optional<double> partial;
  if (const nlohmann::json* rp = jg::find(cfg, "rope_parameters"); rp && rp->is_object())
    partial = jg::opt_number(*rp, "partial_rotary_factor", "config.json rope_parameters");
  if (!partial) partial = jg::opt_number(cfg, "partial_rotary_factor", kWhere);
  const double f = partial.value_or(0.25), rot = f * m.head_dim;
  if (!(f > 0 && f <= 1) || rot != double(int(rot)) || int(rot) % 2 != 0)
    throw Error("config.json: partial_rotary_factor " + std::to_string(f) + " times head_dim " +
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
  parse_layer_kinds(cfg, m, family);
}

MoeConfig parse_hybrid_experts(const nlohmann::json& cfg, bool norm_topk) {
  using arch_config::positive_int;
  MoeConfig e;
  arch_config::parse_expert_counts(cfg, "num_experts", e);
  e.expert_size = positive_int(cfg, "moe_intermediate_size", 1 << 20);
  e.shared_expert_size = positive_int(cfg, "shared_expert_intermediate_size", 1 << 20);
  e.norm_topk = norm_topk;
  e.act = GluActivation::Silu;
  return e;
}

}  // namespace kvlm::arch

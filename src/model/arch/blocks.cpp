#include "model/arch/blocks.h"

#include <cmath>

#include "model/rope.h"

namespace kvlm::arch {

size_t add_weight(WeightList& list, std::vector<WeightPiece> pieces, WeightRole role, Shard shard) {
  return list.add(WeightSpec{.pieces = std::move(pieces), .role = role, .shard = shard});
}
size_t add_linear(WeightList& list, std::vector<WeightPiece> pieces, Shard shard) {
  return list.add(WeightSpec{.pieces = std::move(pieces), .role = WeightRole::Matrix, .shard = shard, .linear = true});
}
namespace {
// A mixture's stacked expert matrices (gate/up or down of every held expert).
size_t add_experts(WeightList& list, std::vector<WeightPiece> pieces, Shard shard) {
  return list.add(WeightSpec{.pieces = std::move(pieces), .role = WeightRole::Matrix, .shard = shard, .experts = true});
}
}  // namespace

EmbeddingWeights add_embedding(WeightList& list, const ModelConfig& c) {
  EmbeddingWeights e;
  const int64_t vocab = c.vocab_size, hd = c.hidden_size;
  e.embed = add_weight(list, {{"model.embed_tokens.weight", {vocab, hd}}}, WeightRole::Matrix, Shard::Vocab);
  if (c.tie_word_embeddings) {
    e.lm_head = e.embed;
    list.known_unused.push_back("lm_head.weight");  // some tied checkpoints still carry a copy
  } else {
    e.lm_head = list.add(WeightSpec{.pieces = {{"lm_head.weight", {vocab, hd}}},
                                    .role = WeightRole::Matrix,
                                    .shard = Shard::RankZero,
                                    .missing_hint = ", and tie_word_embeddings is false in config.json"});
  }
  return e;
}

size_t add_norm(WeightList& list, const std::string& name, int64_t dim, bool add_one) {
  return list.add(WeightSpec{.pieces = {{name, {dim}}}, .role = WeightRole::Norm, .add_one = add_one});
}

size_t add_rope(WeightList& list, const RopeConfig& rope, int head_dim) {
  return list.add(WeightSpec{.role = WeightRole::Constant, .constant = rope_inv_freq(rope, head_dim)});
}

AttentionWeights add_attention(WeightList& list, const ModelConfig& c, const std::string& p, bool norm_add_one) {
  const int64_t hd = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
  AttentionWeights a;
  // Sharded by heads: a rank holds whole query heads and the KV heads they read.
  a.qkv = add_linear(list,
                     {{p + "self_attn.q_proj.weight", {nh * d, hd}, nh},
                      {p + "self_attn.k_proj.weight", {kvh * d, hd}, kvh},
                      {p + "self_attn.v_proj.weight", {kvh * d, hd}, kvh}},
                     Shard::Rows);
  if (c.qkv_bias)
    a.bqkv = add_weight(list,
                 {{p + "self_attn.q_proj.bias", {nh * d}, nh},
                  {p + "self_attn.k_proj.bias", {kvh * d}, kvh},
                  {p + "self_attn.v_proj.bias", {kvh * d}, kvh}},
                 WeightRole::Bias, Shard::Rows);
  a.o = add_linear(list, {{p + "self_attn.o_proj.weight", {hd, nh * d}, nh}}, Shard::Cols);
  if (c.o_bias) a.bo = add_weight(list, {{p + "self_attn.o_proj.bias", {hd}}}, WeightRole::Bias, Shard::RankZero);
  if (c.qk_norm) {
    a.q_norm = add_norm(list, p + "self_attn.q_norm.weight", d, norm_add_one);
    a.k_norm = add_norm(list, p + "self_attn.k_norm.weight", d, norm_add_one);
  }
  if (c.attention_sinks)  // fp32 (a norm's role), split by query heads
    a.sinks = add_weight(list, {{p + "self_attn.sinks", {nh}, nh}}, WeightRole::Norm, Shard::Rows);
  return a;
}

MlpWeights add_gated_mlp(WeightList& list, const ModelConfig& c, const std::string& p) {
  const int64_t hd = c.hidden_size, inter = c.intermediate_size;
  MlpWeights m;
  m.gate_up = add_linear(list, {{p + "mlp.gate_proj.weight", {inter, hd}}, {p + "mlp.up_proj.weight", {inter, hd}}},
                         Shard::Rows);
  if (c.mlp_bias)
    m.b_gate_up = add_weight(list, {{p + "mlp.gate_proj.bias", {inter}}, {p + "mlp.up_proj.bias", {inter}}}, WeightRole::Bias,
                      Shard::Rows);
  m.down = add_linear(list, {{p + "mlp.down_proj.weight", {hd, inter}}}, Shard::Cols);
  if (c.mlp_bias) m.b_down = add_weight(list, {{p + "mlp.down_proj.bias", {hd}}}, WeightRole::Bias, Shard::RankZero);
  return m;
}

MoeLayerWeights add_moe_per_expert(WeightList& list, const ModelConfig& c, const std::string& p,
                                   const std::string& router) {
  const MoeConfig& m = *c.moe;
  const int64_t hd = c.hidden_size, inter = m.expert_size, E = m.num_experts;
  MoeLayerWeights w;
  w.router = add_weight(list, {{p + router + ".weight", {E, hd}}}, WeightRole::Matrix, Shard::Replicated);
  if (m.router_bias) w.router_bias = add_weight(list, {{p + router + ".bias", {E}}}, WeightRole::Bias, Shard::Replicated);
  std::vector<WeightPiece> gate_up, down, gate_up_bias, down_bias;
  const int ep = m.expert_parallel ? int(E) : 0;  // Experts: the pieces' expert count and expert
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
    const int id = m.expert_parallel ? int(e) : -1;
    gate_up.push_back({.name = x + "gate_proj.weight", .shape = {inter, hd}, .shard_units = ep, .expert = id});
    gate_up.push_back({.name = x + "up_proj.weight", .shape = {inter, hd}, .shard_units = ep, .expert = id});
    down.push_back({.name = x + "down_proj.weight", .shape = {hd, inter}, .shard_units = ep, .expert = id});
    // The biases as the fused layout holds them: [E][2I] (each expert's gate, then up) and [E][H].
    gate_up_bias.push_back({.name = x + "gate_proj.bias", .shape = {inter}, .shard_units = ep, .expert = id});
    gate_up_bias.push_back({.name = x + "up_proj.bias", .shape = {inter}, .shard_units = ep, .expert = id});
    down_bias.push_back({.name = x + "down_proj.bias", .shape = {hd}, .shard_units = ep, .expert = id});
  }
  // Tensor parallel inside each expert: a rank holds its share of every expert's rows (gate,
  // up) and columns (down); or with expert parallelism its experts whole. The down bias is
  // added once, by rank 0, as a row-parallel layer's.
  w.gate_up = add_experts(list, std::move(gate_up), m.expert_parallel ? Shard::Experts : Shard::Rows);
  w.down = add_experts(list, std::move(down), m.expert_parallel ? Shard::Experts : Shard::Cols);
  if (m.expert_bias) {
    w.gate_up_bias =
        add_weight(list, std::move(gate_up_bias), WeightRole::Bias, m.expert_parallel ? Shard::Experts : Shard::Rows);
    w.down_bias =
        add_weight(list, std::move(down_bias), WeightRole::Bias, m.expert_parallel ? Shard::Experts : Shard::RankZero);
  }
  return w;
}

MoeLayerWeights add_moe_fused(WeightList& list, const ModelConfig& c, const std::string& p) {
  const MoeConfig& m = *c.moe;
  const int64_t hd = c.hidden_size, inter = m.expert_size, E = m.num_experts;
  MoeLayerWeights w;
  w.router = add_weight(list, {{p + "mlp.router.weight", {E, hd}}}, WeightRole::Matrix, Shard::Replicated);
  if (m.router_bias) w.router_bias = add_weight(list, {{p + "mlp.router.bias", {E}}}, WeightRole::Bias, Shard::Replicated);
  const std::string x = p + "mlp.experts.";
  if (m.expert_parallel) {  // whole experts per rank: each fused tensor split into E runs of rows
    w.gate_up = add_experts(list, {{x + "gate_up_proj", {E, hd, 2 * inter}, E, PieceLayout::ExpertsTransposedInterleaved}},
                            Shard::Experts);
    w.down = add_experts(list, {{x + "down_proj", {E, inter, hd}, E, PieceLayout::ExpertsTransposed}}, Shard::Experts);
    if (m.expert_bias) {
      w.gate_up_bias = add_weight(list, {{x + "gate_up_proj_bias", {E, 2 * inter}, E, PieceLayout::ExpertsInterleaved}},
                           WeightRole::Bias, Shard::Experts);
      w.down_bias = add_weight(list, {{x + "down_proj_bias", {E, hd}, E}}, WeightRole::Bias, Shard::Experts);
    }
    return w;
  }
  // Held as [E * 2I][hidden] (PieceLayout), each expert's gate and up rows a group of which
  // every tensor-parallel rank takes its share.
  w.gate_up = add_experts(
      list, {{x + "gate_up_proj", {E, hd, 2 * inter}, 0, PieceLayout::ExpertsTransposedInterleaved, 2 * E}}, Shard::Rows);
  w.down = add_experts(list, {{x + "down_proj", {E, inter, hd}, 0, PieceLayout::ExpertsTransposed}}, Shard::Cols);
  if (m.expert_bias) {
    w.gate_up_bias = add_weight(list, {{x + "gate_up_proj_bias", {E, 2 * inter}, 0, PieceLayout::ExpertsInterleaved, 2 * E}},
                         WeightRole::Bias, Shard::Rows);
    w.down_bias = add_weight(list, {{x + "down_proj_bias", {E, hd}}}, WeightRole::Bias, Shard::RankZero);
  }
  return w;
}

MoeLayerWeights add_moe_stacked(WeightList& list, const ModelConfig& c, const std::string& p) {
  const MoeConfig& m = *c.moe;
  const int64_t hd = c.hidden_size, inter = m.expert_size, E = m.num_experts;
  MoeLayerWeights w;
  w.router = add_weight(list, {{p + "mlp.gate.weight", {E, hd}}}, WeightRole::Matrix, Shard::Replicated);
  const std::string x = p + "mlp.experts.";
  // Held as [E * 2I][H] and [E * H][I]: the same bytes. Expert parallelism: each tensor split
  // into E runs of rows; tensor parallelism inside experts: every expert's gate and up rows a
  // group of which each rank takes its share, down's columns split.
  if (m.expert_parallel) {
    w.gate_up =
        add_experts(list, {{x + "gate_up_proj", {E, 2 * inter, hd}, E, PieceLayout::ExpertsStacked}}, Shard::Experts);
    w.down = add_experts(list, {{x + "down_proj", {E, hd, inter}, E, PieceLayout::ExpertsStacked}}, Shard::Experts);
    return w;
  }
  w.gate_up =
      add_experts(list, {{x + "gate_up_proj", {E, 2 * inter, hd}, 0, PieceLayout::ExpertsStacked, 2 * E}}, Shard::Rows);
  w.down = add_experts(list, {{x + "down_proj", {E, hd, inter}, 0, PieceLayout::ExpertsStacked}}, Shard::Cols);
  return w;
}

void add_shared_expert(WeightList& list, const ModelConfig& c, const std::string& p, MoeLayerWeights& m) {
  const int64_t hd = c.hidden_size, s = c.moe->shared_expert_size;
  const std::string x = p + "mlp.shared_expert.";
  m.shared_gate_up =
      add_linear(list, {{x + "gate_proj.weight", {s, hd}}, {x + "up_proj.weight", {s, hd}}}, Shard::Rows);
  m.shared_down = add_linear(list, {{x + "down_proj.weight", {hd, s}}}, Shard::Cols);
  m.shared_gate = add_weight(list, {{p + "mlp.shared_expert_gate.weight", {1, hd}}}, WeightRole::Matrix, Shard::Replicated);
}

MoeWeights moe_weights(std::span<const Weight> w, const MoeLayerWeights& m) {
  auto W = [&](size_t i) { return weight_or_empty(w, i); };
  return MoeWeights{.router = W(m.router), .router_bias = W(m.router_bias), .gate_up = W(m.gate_up),
                    .gate_up_bias = W(m.gate_up_bias), .down = W(m.down), .down_bias = W(m.down_bias),
                    .shared_gate_up = W(m.shared_gate_up), .shared_down = W(m.shared_down),
                    .shared_gate = W(m.shared_gate)};
}

PreNormLayerWeights add_pre_norm_attention(WeightList& list, const ModelConfig& c, const std::string& p) {
  PreNormLayerWeights L;
  L.in_norm = add_norm(list, p + "input_layernorm.weight", c.hidden_size);
  L.post_norm = add_norm(list, p + "post_attention_layernorm.weight", c.hidden_size);
  L.attn = add_attention(list, c, p);
  return L;
}

PreNormLayerWeights add_pre_norm_layer(WeightList& list, const ModelConfig& c, const std::string& p) {
  PreNormLayerWeights L = add_pre_norm_attention(list, c, p);
  L.mlp = add_gated_mlp(list, c, p);
  return L;
}

float softmax_scale(const ModelConfig& c, const RopeConfig& rope) {
  return float(1.0 / std::sqrt(c.query_pre_attn_scalar.value_or(double(c.head_dim)))) * rope_score_scale(rope);
}

PreNormDecoder::PreNormDecoder(const ModelConfig& c, const LayerMlpAdder& mlp) : cfg_(c) {
  emb_ = add_embedding(weights_, c);
  embedding_ = emb_.embed;
  lm_head_ = emb_.lm_head;
  final_norm_ = add_norm(weights_, "model.norm.weight", c.hidden_size);
  inv_freq_ = add_rope(weights_, c.rope, c.head_dim);
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    PreNormLayerWeights L = add_pre_norm_attention(weights_, c, p);
    mlp(weights_, p, i, L);
    layers_.push_back(L);
  }
}

Tensor PreNormDecoder::forward(Ops& ops, std::span<const Weight> w) const {
  const float scale = softmax_scale(cfg_, cfg_.rope);
  const DecoderActivations a = alloc_decoder_activations(ops, cfg_);
  ops.embed(w[emb_.embed], 1.0f, a.x);
  Tensor pending;  // the last layer's MLP output, added by the next norm
  for (size_t li = 0; li < layers_.size(); ++li)
    pending = pre_norm_layer(ops, cfg_, a, w, layers_[li], int(li), pending, w[inv_freq_], scale, int(li) - 1);
  return final_logits(ops, cfg_, a.x, pending, w[final_norm_], w[emb_.lm_head]);
}

Tensor pre_norm_layer(Ops& ops, const ModelConfig& c, const DecoderActivations& a, std::span<const Weight> w,
                      const PreNormLayerWeights& L, int kv_layer, Tensor pending, const Weight& inv_freq,
                      float softmax_scale, int capture_layer) {
  auto W = [&](size_t i) { return weight_or_empty(w, i); };
  const float eps = float(c.rms_norm_eps);
  ops.add_rmsnorm(a.x, pending, w[L.in_norm], eps, a.h);
  if (capture_layer >= 0) ops.capture(capture_layer, a.x);
  ops.linear(a.h, w[L.attn.qkv], W(L.attn.bqkv), a.qkv);
  ops.attention_prologue(kv_layer, a.qkv,
                         {.q_norm = W(L.attn.q_norm), .k_norm = W(L.attn.k_norm), .inv_freq = inv_freq, .eps = eps}, a.q);
  ops.attention(kv_layer, a.q, a.attn, softmax_scale, W(L.attn.sinks));
  ops.linear(a.attn, w[L.attn.o], W(L.attn.bo), a.delta);
  ops.all_reduce_sum(a.delta);
  ops.add_rmsnorm(a.x, a.delta, w[L.post_norm], eps, a.h);
  if (L.moe) {
    ops.moe(a.h, *c.moe, moe_weights(w, *L.moe), a.delta);
  } else {
    ops.linear(a.h, w[L.mlp.gate_up], W(L.mlp.b_gate_up), a.gu);
    ops.mlp_down(c.hidden_act, a.gu, w[L.mlp.down], W(L.mlp.b_down), a.delta);
  }
  ops.all_reduce_sum(a.delta);
  return a.delta;
}

DecoderActivations alloc_decoder_activations(Ops& ops, const ModelConfig& c) {
  const int64_t T = ops.num_tokens(), H = c.hidden_size, QD = int64_t(c.num_heads) * c.head_dim;
  const int64_t QKV = int64_t(c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
  return DecoderActivations{.x = ops.alloc(ActRole::Residual, T, H),
                            .h = ops.alloc(ActRole::Hidden, T, H),
                            .qkv = ops.alloc(ActRole::Hidden, T, QKV),
                            .q = ops.alloc(ActRole::Query, T, QD),
                            .attn = ops.alloc(ActRole::Hidden, T, QD),
                            .delta = ops.alloc(ActRole::Hidden, T, H),
                            .gu = ops.alloc(ActRole::Hidden, T, 2 * int64_t(c.intermediate_size))};
}

Tensor final_logits(Ops& ops, const ModelConfig& c, Tensor x, Tensor pending, const Weight& norm, const Weight& head) {
  const int64_t R = ops.num_logit_rows();
  if (R == 0) return {};
  if (ops.pooling()) {  // an embedding model's output: the normed hidden states themselves
    const Tensor pooled = ops.alloc(ActRole::Logits, R, c.hidden_size);
    ops.final_norm(x, pending, norm, float(c.rms_norm_eps), pooled);
    return pooled;
  }
  const Tensor hl = ops.alloc(ActRole::Hidden, R, c.hidden_size);
  const Tensor logits = ops.alloc(ActRole::Logits, R, c.vocab_size);
  ops.final_norm(x, pending, norm, float(c.rms_norm_eps), hl);
  ops.linear(hl, head, Weight{}, logits);
  return logits;
}

}  // namespace kvlm::arch

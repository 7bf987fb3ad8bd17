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
#include <limits>
#include <string>

#include "core/numeric.h"
#include "model/architecture.h"
#include "model/rope.h"

namespace kvlm {

namespace {

constexpr size_t kNone = std::numeric_limits<size_t>::max();

class Gemma3 final : public ModelDefinition {
 public:
  explicit Gemma3(const ModelConfig& c) : cfg_(c) {
    const int64_t hd = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
    const int64_t inter = c.intermediate_size, vocab = c.vocab_size;
    using R = WeightRole;
    auto add = [&](std::vector<WeightPiece> pieces, WeightRole role, Shard shard) {
      return weights_.add(WeightSpec{.pieces = std::move(pieces), .role = role, .shard = shard});
    };
    auto norm = [&](const std::string& name, int64_t dim) {  // Gemma's RMSNorm: x * (1 + w)
      return weights_.add(WeightSpec{.pieces = {{name, {dim}}}, .role = R::Norm, .add_one = true});
    };
    embed_ = add({{"model.embed_tokens.weight", {vocab, hd}}}, R::Matrix, Shard::Vocab);
    if (c.tie_word_embeddings) {
      lm_head_ = embed_;
      weights_.known_unused.push_back("lm_head.weight");
    } else {
      lm_head_ = weights_.add(WeightSpec{.pieces = {{"lm_head.weight", {vocab, hd}}},
                                         .role = R::Matrix,
                                         .shard = Shard::Vocab,
                                         .missing_hint = ", and config.json sets tie_word_embeddings false"});
    }
    final_norm_ = norm("model.norm.weight", hd);
    rope_global_ = weights_.add(WeightSpec{.role = R::Constant, .constant = rope_inv_freq(c.rope, c.head_dim)});
    rope_local_ = weights_.add(
        WeightSpec{.role = R::Constant, .constant = rope_inv_freq(c.rope_local.value_or(c.rope), c.head_dim)});
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer L;
      L.sliding = c.layers[size_t(i)].kind == AttentionKind::Sliding;
      L.in_norm = norm(p + "input_layernorm.weight", hd);
      L.post_attn_norm = norm(p + "post_attention_layernorm.weight", hd);
      L.pre_ff_norm = norm(p + "pre_feedforward_layernorm.weight", hd);
      L.post_ff_norm = norm(p + "post_feedforward_layernorm.weight", hd);
      L.qkv = add({{p + "self_attn.q_proj.weight", {nh * d, hd}},
                   {p + "self_attn.k_proj.weight", {kvh * d, hd}},
                   {p + "self_attn.v_proj.weight", {kvh * d, hd}}},
                  R::Matrix, Shard::Rows);
      if (c.qkv_bias)
        L.bqkv = add({{p + "self_attn.q_proj.bias", {nh * d}},
                      {p + "self_attn.k_proj.bias", {kvh * d}},
                      {p + "self_attn.v_proj.bias", {kvh * d}}},
                     R::Bias, Shard::Rows);
      L.o = add({{p + "self_attn.o_proj.weight", {hd, nh * d}}}, R::Matrix, Shard::Cols);
      if (c.o_bias) L.bo = add({{p + "self_attn.o_proj.bias", {hd}}}, R::Bias, Shard::Replicated);
      L.q_norm = norm(p + "self_attn.q_norm.weight", d);
      L.k_norm = norm(p + "self_attn.k_norm.weight", d);
      L.gu = add({{p + "mlp.gate_proj.weight", {inter, hd}}, {p + "mlp.up_proj.weight", {inter, hd}}}, R::Matrix,
                 Shard::Rows);
      L.down = add({{p + "mlp.down_proj.weight", {hd, inter}}}, R::Matrix, Shard::Cols);
      layers_.push_back(L);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    auto W = [&](size_t i) { return i == kNone ? Weight{} : w[i]; };
    const int64_t T = ops.num_tokens(), R = ops.num_logit_rows();
    const int64_t H = cfg_.hidden_size, QD = int64_t(cfg_.num_heads) * cfg_.head_dim;
    const int64_t QKV = int64_t(cfg_.num_heads + 2 * cfg_.num_kv_heads) * cfg_.head_dim;
    const float eps = float(cfg_.rms_norm_eps);
    const float scale = float(1.0 / std::sqrt(cfg_.query_pre_attn_scalar.value_or(double(cfg_.head_dim))));
    const Tensor x = ops.alloc(ActRole::Residual, T, H);
    const Tensor h = ops.alloc(ActRole::Hidden, T, H);
    const Tensor qkv = ops.alloc(ActRole::Hidden, T, QKV);
    const Tensor q = ops.alloc(ActRole::Query, T, QD);
    const Tensor attn = ops.alloc(ActRole::Hidden, T, QD);
    const Tensor delta = ops.alloc(ActRole::Hidden, T, H);
    const Tensor gu = ops.alloc(ActRole::Hidden, T, 2 * int64_t(cfg_.intermediate_size));
    ops.embed(w[embed_], embed_scale(w[embed_].dtype), x);
    Tensor pending;  // the last layer's normed MLP output, added by the next norm
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      ops.add_rmsnorm(x, pending, w[L.in_norm], eps, h);
      ops.linear(h, w[L.qkv], W(L.bqkv), qkv);
      ops.attention_prologue(
          int(li), qkv,
          {.q_norm = w[L.q_norm], .k_norm = w[L.k_norm], .inv_freq = w[L.sliding ? rope_local_ : rope_global_]}, q);
      ops.attention(int(li), q, attn, scale);
      ops.linear(attn, w[L.o], W(L.bo), delta);
      ops.all_reduce_sum(delta);
      ops.rmsnorm(delta, w[L.post_attn_norm], eps, delta);
      ops.add_rmsnorm(x, delta, w[L.pre_ff_norm], eps, h);
      ops.linear(h, w[L.gu], Weight{}, gu);
      ops.mlp_down(cfg_.hidden_act, gu, w[L.down], Weight{}, delta);
      ops.all_reduce_sum(delta);
      ops.rmsnorm(delta, w[L.post_ff_norm], eps, delta);
      pending = delta;
    }
    if (R == 0) return {};
    const Tensor hl = ops.alloc(ActRole::Hidden, R, H);
    const Tensor logits = ops.alloc(ActRole::Logits, R, cfg_.vocab_size);
    ops.final_norm(x, pending, w[final_norm_], eps, hl);
    ops.linear(hl, w[lm_head_], Weight{}, logits);
    return logits;
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
    size_t in_norm = kNone, post_attn_norm = kNone, pre_ff_norm = kNone, post_ff_norm = kNone, qkv = kNone,
           bqkv = kNone, o = kNone, bo = kNone, q_norm = kNone, k_norm = kNone, gu = kNone, down = kNone;
  };
  ModelConfig cfg_;
  size_t embed_ = kNone, lm_head_ = kNone, final_norm_ = kNone, rope_global_ = kNone, rope_local_ = kNone;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<ModelDefinition> make_gemma3(const ModelConfig& cfg) { return std::make_unique<Gemma3>(cfg); }

}  // namespace kvlm

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
#include <limits>
#include <string>

#include "model/architecture.h"
#include "model/rope.h"

namespace kvlm {

namespace {

constexpr size_t kNone = std::numeric_limits<size_t>::max();

class LlamaFamily final : public ModelDefinition {
 public:
  explicit LlamaFamily(const ModelConfig& c) : cfg_(c) {
    const int64_t hd = c.hidden_size, d = c.head_dim, nh = c.num_heads, kvh = c.num_kv_heads;
    const int64_t inter = c.intermediate_size, vocab = c.vocab_size;
    auto add = [&](std::vector<WeightPiece> pieces, WeightRole role, Shard shard) {
      return weights_.add(WeightSpec{.pieces = std::move(pieces), .role = role, .shard = shard});
    };
    using R = WeightRole;
    embed_ = add({{"model.embed_tokens.weight", {vocab, hd}}}, R::Matrix, Shard::Vocab);
    if (c.tie_word_embeddings) {
      lm_head_ = embed_;
      weights_.known_unused.push_back("lm_head.weight");  // some tied checkpoints still carry a copy
    } else {
      lm_head_ = weights_.add(WeightSpec{.pieces = {{"lm_head.weight", {vocab, hd}}},
                                         .role = R::Matrix,
                                         .shard = Shard::Vocab,
                                         .missing_hint = ", and config.json does not set tie_word_embeddings"});
    }
    final_norm_ = add({{"model.norm.weight", {hd}}}, R::Norm, Shard::Replicated);
    inv_freq_ = weights_.add(WeightSpec{.role = R::Constant, .constant = rope_inv_freq(c.rope, c.head_dim)});
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer L;
      L.in_norm = add({{p + "input_layernorm.weight", {hd}}}, R::Norm, Shard::Replicated);
      L.post_norm = add({{p + "post_attention_layernorm.weight", {hd}}}, R::Norm, Shard::Replicated);
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
      if (c.qk_norm) {
        L.q_norm = add({{p + "self_attn.q_norm.weight", {d}}}, R::Norm, Shard::Replicated);
        L.k_norm = add({{p + "self_attn.k_norm.weight", {d}}}, R::Norm, Shard::Replicated);
      }
      L.gu = add({{p + "mlp.gate_proj.weight", {inter, hd}}, {p + "mlp.up_proj.weight", {inter, hd}}}, R::Matrix,
                 Shard::Rows);
      if (c.mlp_bias)
        L.bgu = add({{p + "mlp.gate_proj.bias", {inter}}, {p + "mlp.up_proj.bias", {inter}}}, R::Bias, Shard::Rows);
      L.down = add({{p + "mlp.down_proj.weight", {hd, inter}}}, R::Matrix, Shard::Cols);
      if (c.mlp_bias) L.bdown = add({{p + "mlp.down_proj.bias", {hd}}}, R::Bias, Shard::Replicated);
      layers_.push_back(L);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    auto W = [&](size_t i) { return i == kNone ? Weight{} : w[i]; };
    const int64_t T = ops.num_tokens(), R = ops.num_logit_rows();
    const int64_t H = cfg_.hidden_size, QD = int64_t(cfg_.num_heads) * cfg_.head_dim;
    const int64_t QKV = int64_t(cfg_.num_heads + 2 * cfg_.num_kv_heads) * cfg_.head_dim;
    const float eps = float(cfg_.rms_norm_eps);
    const float scale = 1.0f / std::sqrt(float(cfg_.head_dim));
    const Tensor x = ops.alloc(ActRole::Residual, T, H);
    const Tensor h = ops.alloc(ActRole::Hidden, T, H);
    const Tensor qkv = ops.alloc(ActRole::Hidden, T, QKV);
    const Tensor q = ops.alloc(ActRole::Query, T, QD);
    const Tensor attn = ops.alloc(ActRole::Hidden, T, QD);
    const Tensor delta = ops.alloc(ActRole::Hidden, T, H);
    const Tensor gu = ops.alloc(ActRole::Hidden, T, 2 * int64_t(cfg_.intermediate_size));
    ops.embed(w[embed_], 1.0f, x);
    Tensor pending;  // the last layer's MLP output, added by the next norm
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      ops.add_rmsnorm(x, pending, w[L.in_norm], eps, h);
      ops.linear(h, w[L.qkv], W(L.bqkv), qkv);
      ops.attention_prologue(int(li), qkv, {.q_norm = W(L.q_norm), .k_norm = W(L.k_norm), .inv_freq = w[inv_freq_]}, q);
      ops.attention(int(li), q, attn, scale);
      ops.linear(attn, w[L.o], W(L.bo), delta);
      ops.all_reduce_sum(delta);
      ops.add_rmsnorm(x, delta, w[L.post_norm], eps, h);
      ops.linear(h, w[L.gu], W(L.bgu), gu);
      ops.mlp_down(cfg_.hidden_act, gu, w[L.down], W(L.bdown), delta);
      ops.all_reduce_sum(delta);
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
  struct Layer {
    size_t in_norm = kNone, post_norm = kNone, qkv = kNone, bqkv = kNone, o = kNone, bo = kNone, q_norm = kNone,
           k_norm = kNone, gu = kNone, bgu = kNone, down = kNone, bdown = kNone;
  };
  ModelConfig cfg_;
  size_t embed_ = kNone, lm_head_ = kNone, final_norm_ = kNone, inv_freq_ = kNone;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<ModelDefinition> make_llama_family(const ModelConfig& cfg) { return std::make_unique<LlamaFamily>(cfg); }

}  // namespace kvlm

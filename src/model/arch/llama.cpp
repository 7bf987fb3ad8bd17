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
#include <string>

#include "model/arch/blocks.h"
#include "model/architecture.h"

namespace kvlm {

namespace {

using namespace arch;

class LlamaFamily final : public ModelDefinition {
 public:
  explicit LlamaFamily(const ModelConfig& c) : cfg_(c) {
    emb_ = add_embedding(weights_, c);
    embedding_ = emb_.embed;
    lm_head_ = emb_.lm_head;
    final_norm_ = add_norm(weights_, "model.norm.weight", c.hidden_size);
    inv_freq_ = add_rope(weights_, c.rope, c.head_dim);
    for (int i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      Layer L;
      L.in_norm = add_norm(weights_, p + "input_layernorm.weight", c.hidden_size);
      L.post_norm = add_norm(weights_, p + "post_attention_layernorm.weight", c.hidden_size);
      L.attn = add_attention(weights_, c, p);
      L.mlp = add_gated_mlp(weights_, c, p);
      layers_.push_back(L);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    auto W = [&](size_t i) { return weight_or_empty(w, i); };
    const float eps = float(cfg_.rms_norm_eps);
    const float scale = 1.0f / std::sqrt(float(cfg_.head_dim));
    const DecoderActivations a = alloc_decoder_activations(ops, cfg_);
    ops.embed(w[emb_.embed], 1.0f, a.x);
    Tensor pending;  // the last layer's MLP output, added by the next norm
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& L = layers_[li];
      ops.add_rmsnorm(a.x, pending, w[L.in_norm], eps, a.h);
      if (li > 0) ops.capture(int(li) - 1, a.x);
      ops.linear(a.h, w[L.attn.qkv], W(L.attn.bqkv), a.qkv);
      ops.attention_prologue(
          int(li), a.qkv,
          {.q_norm = W(L.attn.q_norm), .k_norm = W(L.attn.k_norm), .inv_freq = w[inv_freq_], .eps = eps}, a.q);
      ops.attention(int(li), a.q, a.attn, scale);
      ops.linear(a.attn, w[L.attn.o], W(L.attn.bo), a.delta);
      ops.all_reduce_sum(a.delta);
      ops.add_rmsnorm(a.x, a.delta, w[L.post_norm], eps, a.h);
      ops.linear(a.h, w[L.mlp.gate_up], W(L.mlp.b_gate_up), a.gu);
      ops.mlp_down(cfg_.hidden_act, a.gu, w[L.mlp.down], W(L.mlp.b_down), a.delta);
      ops.all_reduce_sum(a.delta);
      pending = a.delta;
    }
    return final_logits(ops, cfg_, a.x, pending, w[final_norm_], w[emb_.lm_head]);
  }

 private:
  struct Layer {
    size_t in_norm = kNoWeight, post_norm = kNoWeight;
    AttentionWeights attn;
    MlpWeights mlp;
  };
  ModelConfig cfg_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<ModelDefinition> make_llama_family(const ModelConfig& cfg) { return std::make_unique<LlamaFamily>(cfg); }

}  // namespace kvlm

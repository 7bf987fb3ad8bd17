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
    for (int i = 0; i < c.num_layers; ++i)
      layers_.push_back(add_pre_norm_layer(weights_, c, "model.layers." + std::to_string(i) + "."));
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    const float scale = 1.0f / std::sqrt(float(cfg_.head_dim));
    const DecoderActivations a = alloc_decoder_activations(ops, cfg_);
    ops.embed(w[emb_.embed], 1.0f, a.x);
    Tensor pending;  // the last layer's MLP output, added by the next norm
    for (size_t li = 0; li < layers_.size(); ++li)
      pending = pre_norm_layer(ops, cfg_, a, w, layers_[li], int(li), pending, w[inv_freq_], scale, int(li) - 1);
    return final_logits(ops, cfg_, a.x, pending, w[final_norm_], w[emb_.lm_head]);
  }

 private:
  ModelConfig cfg_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<PreNormLayerWeights> layers_;
};

}  // namespace

std::unique_ptr<ModelDefinition> make_llama_family(const ModelConfig& cfg) { return std::make_unique<LlamaFamily>(cfg); }

}  // namespace kvlm

// The hybrid decoder of the Qwen3.5 / Qwen3-Next family: Gated DeltaNet layers (linear
// attention with a recurrent state per sequence) beside gated full-attention layers, (1 + w)
// RMSNorms, and per layer a dense MLP or a mixture of experts with a shared expert. The
// architectures differ in how the checkpoint lays out the DeltaNet's input projection and the
// experts; each file (qwen3_5.cpp, qwen3_next.cpp) says which, and this builds the rest.
//
//   per layer:  h = RMSNorm(x)
//     linear:   m = h [Wq | Wk | Wv | Wz | Wb | Wa]^T ; o = GatedDeltaNet(m) (conv, delta rule,
//               gated norm; Ops::gated_delta_net) ; x += o Wout^T
//     full:     qkvg = h [Wq | Wk | Wv | Wgate]^T (q_proj's rows hold each head's query, then its
//               gate) ; prologue (q/k (1 + w) norms, partial RoPE, K/V -> pages) ;
//               x += (attention(q) * sigmoid(gate)) Wo^T
//     then:     h = RMSNorm(x) ; x += MLP(h) (dense, or experts + sigmoid(h Wsg^T) * shared(h))
//   logits = RMSNorm(x[logit rows]) Wlm^T
//
// The KV plan holds the full-attention layers only (ModelConfig::attention_layers): KV layer i
// is the i-th of them, and linear layer j the j-th Gated DeltaNet layer, whose states the
// runner keeps.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/arch/blocks.h"

namespace kvlm::arch {

// How a checkpoint stores a Gated DeltaNet layer's input projection.
enum class DeltaNetProjections {
  Separate,     // Qwen3.5: in_proj_qkv [q | k | v], in_proj_z, in_proj_b, in_proj_a
  Interleaved,  // Qwen3-Next: in_proj_qkvz, per key head [q k v z] (its value heads' v and z);
                // in_proj_ba, per key head [b a]
};

struct HybridLayerWeights {
  bool linear = false;
  int index = 0;  // among the linear layers, or among the attention layers (its KV layer)
  size_t in_norm = kNoWeight, post_norm = kNoWeight;
  // Gated DeltaNet: the fused input projection [q | k | v | z | b | a], out_proj and the rest.
  size_t in_proj = kNoWeight, out_proj = kNoWeight, conv = kNoWeight, a_log = kNoWeight, dt_bias = kNoWeight,
         gated_norm = kNoWeight;
  AttentionWeights attn;  // qkv: q | k | v | gate
  MlpWeights mlp;
  std::optional<MoeLayerWeights> moe;
};

// Adds a layer's MLP (dense or experts) to its weights, as PreNormDecoder's LayerMlpAdder.
using HybridMlpAdder = std::function<void(WeightList& list, const std::string& prefix, int layer, HybridLayerWeights& L)>;

class HybridDecoder : public ModelDefinition {
 public:
  HybridDecoder(const ModelConfig& c, DeltaNetProjections projections, const HybridMlpAdder& mlp);
  Tensor forward(Ops& ops, std::span<const Weight> w) const override;

 private:
  ModelConfig cfg_;
  LinearAttentionConfig lin_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<HybridLayerWeights> layers_;
};

// The config.json rules the family shares: partial rotary (rope_parameters' or the top-level
// partial_rotary_factor, 0.25 when neither says), q/k norms and the gated attention output, the
// linear_* sizes, and which layers are Gated DeltaNet layers (layer_types, else every
// full_attention_interval-th layer, default 4, is full attention). `family` names the model in
// errors.
void parse_hybrid(const nlohmann::json& cfg, ModelConfig& m, std::string_view family);
// The family's experts (Qwen3-Next, Qwen3.5-MoE): num_experts, num_experts_per_tok,
// moe_intermediate_size and the shared expert's shared_expert_intermediate_size, SiLU;
// `norm_topk` is the architecture's (a config field, or always on).
MoeConfig parse_hybrid_experts(const nlohmann::json& cfg, bool norm_topk);

}  // namespace kvlm::arch

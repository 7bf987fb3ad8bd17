// Building blocks the architectures share: the Hugging Face decoder's tensor names, how they
// fuse (q/k/v and gate/up along dim 0) and shard, the activations of one step, and the final
// norm + LM head. A definition (llama.cpp, gemma3.cpp) composes them; what is particular to
// it (norm placement, its RoPE tables, scales) stays in its own file.
#pragma once

#include <cstddef>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "model/architecture.h"
#include "model/ops.h"
#include "model/weights.h"

namespace kvlm::arch {

// The index of an absent optional weight.
inline constexpr size_t kNoWeight = std::numeric_limits<size_t>::max();
inline Weight weight_or_empty(std::span<const Weight> w, size_t i) { return i == kNoWeight ? Weight{} : w[i]; }

// model.embed_tokens and lm_head (vocab-sharded), or the embedding again when tied (a tied
// checkpoint's stray lm_head copy is not reported as unused).
struct EmbeddingWeights {
  size_t embed = kNoWeight, lm_head = kNoWeight;
};
// A weight of the given role and tensor-parallel split.
size_t add_weight(WeightList& list, std::vector<WeightPiece> pieces, WeightRole role, Shard shard = Shard::Replicated);
// A projection (q/k/v, o, gate/up, down, a linear-attention layer's in/out): what
// --quantization fp8 quantizes.
size_t add_linear(WeightList& list, std::vector<WeightPiece> pieces, Shard shard = Shard::Replicated);

EmbeddingWeights add_embedding(WeightList& list, const ModelConfig& c);

// An RMSNorm weight [dim] (add_one: stored as 1 + w, Gemma's convention).
size_t add_norm(WeightList& list, const std::string& name, int64_t dim, bool add_one = false);

// RoPE inverse frequencies for `rope` (a host-computed constant).
size_t add_rope(WeightList& list, const RopeConfig& rope, int head_dim);

// `prefix`self_attn.{q,k,v}_proj fused along dim 0 (column-parallel) with their biases when
// cfg.qkv_bias; o_proj (row-parallel) with its bias when cfg.o_bias; q_norm / k_norm when
// cfg.qk_norm (norm_add_one: Gemma's); the learned sinks (self_attn.sinks, one per query
// head) when cfg.attention_sinks.
struct AttentionWeights {
  size_t qkv = kNoWeight, bqkv = kNoWeight, o = kNoWeight, bo = kNoWeight, q_norm = kNoWeight, k_norm = kNoWeight,
         sinks = kNoWeight;
};
AttentionWeights add_attention(WeightList& list, const ModelConfig& c, const std::string& prefix, bool norm_add_one = false);

// `prefix`mlp.{gate,up}_proj fused along dim 0 (column-parallel) and down_proj (row-parallel),
// with biases when cfg.mlp_bias.
struct MlpWeights {
  size_t gate_up = kNoWeight, b_gate_up = kNoWeight, down = kNoWeight, b_down = kNoWeight;
};
MlpWeights add_gated_mlp(WeightList& list, const ModelConfig& c, const std::string& prefix);

// A mixture-of-experts MLP's weights (MoeWeights, ops.h), in either checkpoint layout:
// per expert (Qwen3-MoE: `prefix`mlp.experts.E.{gate,up,down}_proj.weight, the router
// `prefix`mlp.gate.weight) or fused (GPT-OSS: `prefix`mlp.experts.{gate_up_proj,down_proj}
// [E][in][out] with their biases, the router `prefix`mlp.router.{weight,bias}).
struct MoeLayerWeights {
  size_t router = kNoWeight, router_bias = kNoWeight, gate_up = kNoWeight, gate_up_bias = kNoWeight,
         down = kNoWeight, down_bias = kNoWeight;
  size_t shared_gate_up = kNoWeight, shared_down = kNoWeight, shared_gate = kNoWeight;
};
// Per expert: the router `prefix``router`.weight (and .bias with c.moe->router_bias), each
// expert's projections' .bias beside their weights with c.moe->expert_bias (GPT-OSS from GGUF).
MoeLayerWeights add_moe_per_expert(WeightList& list, const ModelConfig& c, const std::string& prefix,
                                   const std::string& router = "mlp.gate");
MoeLayerWeights add_moe_fused(WeightList& list, const ModelConfig& c, const std::string& prefix);
// Fused as transformers 5 holds Qwen-style experts (Qwen3.5-MoE's checkpoints):
// `prefix`mlp.experts.gate_up_proj [E][2I][H] (each expert's gate rows, then its up rows) and
// down_proj [E][H][I], the router `prefix`mlp.gate.weight.
MoeLayerWeights add_moe_stacked(WeightList& list, const ModelConfig& c, const std::string& prefix);
// The shared expert of c.moe->shared_expert_size: `prefix`mlp.shared_expert.{gate,up,down}_proj
// (sharded as a dense MLP) and `prefix`mlp.shared_expert_gate.weight [1][H] (replicated).
void add_shared_expert(WeightList& list, const ModelConfig& c, const std::string& prefix, MoeLayerWeights& m);
MoeWeights moe_weights(std::span<const Weight> w, const MoeLayerWeights& m);

// A pre-norm decoder layer's weights (Llama, Qwen, Mistral, Qwen3-MoE, GPT-OSS; a DFlash
// drafter's layers): `prefix`input_layernorm, self_attn.*, post_attention_layernorm, and the
// dense MLP or (moe) the mixture of experts.
struct PreNormLayerWeights {
  size_t in_norm = kNoWeight, post_norm = kNoWeight;
  AttentionWeights attn;
  MlpWeights mlp;
  std::optional<MoeLayerWeights> moe;
};
PreNormLayerWeights add_pre_norm_layer(WeightList& list, const ModelConfig& c, const std::string& prefix);
// The same without the MLP (the caller adds the dense one or the experts).
PreNormLayerWeights add_pre_norm_attention(WeightList& list, const ModelConfig& c, const std::string& prefix);

struct DecoderActivations;
// One pre-norm decoder layer on KV layer `kv_layer`: h = RMSNorm(x += pending) (then, when
// capture_layer >= 0, x — that layer's output — is offered to Ops::capture), attention with
// q/k norm and RoPE (inv_freq), x += o-projection, h = RMSNorm(x); returns the MLP's output,
// which the next norm adds to x.
Tensor pre_norm_layer(Ops& ops, const ModelConfig& c, const DecoderActivations& a, std::span<const Weight> w,
                      const PreNormLayerWeights& L, int kv_layer, Tensor pending, const Weight& inv_freq,
                      float softmax_scale, int capture_layer);

// The activations of one step of a decoder: the residual stream x, the normed input h, the
// fused projection qkv, the queries q, the attention output, a layer's output delta and the
// fused gate/up projection gu (num_tokens rows each).
struct DecoderActivations {
  Tensor x, h, qkv, q, attn, delta, gu;
};
DecoderActivations alloc_decoder_activations(Ops& ops, const ModelConfig& c);

// The softmax scale of a layer with `rope`: head_dim^-0.5 (or query_pre_attn_scalar^-0.5)
// times what the rope type multiplies scores by (YaRN's attention factor, squared).
float softmax_scale(const ModelConfig& c, const RopeConfig& rope);

// A pre-norm decoder: embedding, one pre_norm_layer per layer, final norm and LM head. The
// Llama family, Qwen3-MoE and GPT-OSS are this with their own layers: `mlp(list, prefix,
// layer)` adds a layer's MLP (dense or mixture) to the layer's weights.
using LayerMlpAdder = std::function<void(WeightList& list, const std::string& prefix, int layer, PreNormLayerWeights& L)>;
class PreNormDecoder : public ModelDefinition {
 public:
  PreNormDecoder(const ModelConfig& c, const LayerMlpAdder& mlp);
  Tensor forward(Ops& ops, std::span<const Weight> w) const override;

 private:
  ModelConfig cfg_;
  EmbeddingWeights emb_;
  size_t final_norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<PreNormLayerWeights> layers_;
};

// The final norm of the logit rows (x + pending, the last layer's output not yet added) and
// the LM head: [num_logit_rows][vocab] logits, or an empty tensor when no row wants them. A
// pooling step (Ops::pooling) returns the normed rows instead ([num_logit_rows][hidden], fp32).
Tensor final_logits(Ops& ops, const ModelConfig& c, Tensor x, Tensor pending, const Weight& norm, const Weight& head);

}  // namespace kvlm::arch

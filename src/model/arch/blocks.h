// Building blocks the architectures share: the Hugging Face decoder's tensor names, how they
// fuse (q/k/v and gate/up along dim 0) and shard, the activations of one step, and the final
// norm + LM head. A definition (llama.cpp, gemma3.cpp) composes them; what is particular to
// it (norm placement, its RoPE tables, scales) stays in its own file.
#pragma once

#include <cstddef>
#include <limits>
#include <span>
#include <string>

#include "config/model_config.h"
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
EmbeddingWeights add_embedding(WeightList& list, const ModelConfig& c);

// An RMSNorm weight [dim] (add_one: stored as 1 + w, Gemma's convention).
size_t add_norm(WeightList& list, const std::string& name, int64_t dim, bool add_one = false);

// RoPE inverse frequencies for `rope` (a host-computed constant).
size_t add_rope(WeightList& list, const RopeConfig& rope, int head_dim);

// `prefix`self_attn.{q,k,v}_proj fused along dim 0 (column-parallel) with their biases when
// cfg.qkv_bias; o_proj (row-parallel) with its bias when cfg.o_bias; q_norm / k_norm when
// cfg.qk_norm (norm_add_one: Gemma's).
struct AttentionWeights {
  size_t qkv = kNoWeight, bqkv = kNoWeight, o = kNoWeight, bo = kNoWeight, q_norm = kNoWeight, k_norm = kNoWeight;
};
AttentionWeights add_attention(WeightList& list, const ModelConfig& c, const std::string& prefix, bool norm_add_one = false);

// `prefix`mlp.{gate,up}_proj fused along dim 0 (column-parallel) and down_proj (row-parallel),
// with biases when cfg.mlp_bias.
struct MlpWeights {
  size_t gate_up = kNoWeight, b_gate_up = kNoWeight, down = kNoWeight, b_down = kNoWeight;
};
MlpWeights add_gated_mlp(WeightList& list, const ModelConfig& c, const std::string& prefix);

// A pre-norm decoder layer's weights (Llama, Qwen, Mistral; a DFlash drafter's layers):
// `prefix`input_layernorm, self_attn.*, post_attention_layernorm, mlp.*.
struct PreNormLayerWeights {
  size_t in_norm = kNoWeight, post_norm = kNoWeight;
  AttentionWeights attn;
  MlpWeights mlp;
};
PreNormLayerWeights add_pre_norm_layer(WeightList& list, const ModelConfig& c, const std::string& prefix);

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

// The final norm of the logit rows (x + pending, the last layer's output not yet added) and
// the LM head: [num_logit_rows][vocab] logits, or an empty tensor when no row wants them.
Tensor final_logits(Ops& ops, const ModelConfig& c, Tensor x, Tensor pending, const Weight& norm, const Weight& head);

}  // namespace kvlm::arch

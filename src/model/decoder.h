// The decoder-only transformer shared by Llama, Qwen2, Qwen3 and Mistral. Architecture
// differences are flags of ModelConfig (q/k/v/o and MLP biases, Qwen3 q/k RMSNorm, tied
// embeddings, per-layer sliding windows, rope scaling), so one forward serves all four.
//
// Weights are held in fp32 on the host (converted once at load from bf16/fp16/fp32); the
// KV cache is held in whatever each layer's KVLayerSpec says, through the layer's backend.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "attention/backend.h"
#include "config/kv_plan.h"
#include "config/model_config.h"
#include "io/checkpoint.h"
#include "kv/kv_cache.h"

namespace kvlm {

// A flattened batch of tokens from one or more sequences.
struct ForwardBatch {
  std::span<const TokenId> tokens;     // [num_tokens]
  std::span<const Position> positions; // [num_tokens]
  std::span<const SlotId> slots;       // [num_tokens]: where each token's K/V goes
  std::span<const AttnSeq> seqs;       // per sequence: rows, context length, block table
  std::span<const int32_t> logit_rows; // rows of `tokens` whose next-token logits are wanted
};

class DecoderModel {
 public:
  // Loads and checks every weight against `config`. The plan says, per layer, how its
  // KV is stored; `backends[i]` runs layer i's attention.
  DecoderModel(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan,
               std::vector<const AttentionBackend*> backends);

  const ModelConfig& config() const { return cfg_; }
  size_t num_parameters() const { return num_params_; }

  // Runs the batch, storing its K/V in `cache`; writes logits [logit_rows.size()][vocab].
  void forward(const ForwardBatch& batch, KVCache& cache, std::span<float> logits);

 private:
  struct Layer {
    std::vector<float> in_norm, post_norm;  // [hidden]
    std::vector<float> wq, wk, wv, wo;      // [nh*d][hidden], [kvh*d][hidden] x2, [hidden][nh*d]
    std::vector<float> bq, bk, bv, bo;      // optional biases
    std::vector<float> q_norm, k_norm;      // [head_dim], Qwen3
    std::vector<float> w_gate, w_up, w_down;  // [inter][hidden] x2, [hidden][inter]
    std::vector<float> b_gate, b_up, b_down;
  };
  ModelConfig cfg_;
  const KVPlan* plan_;
  std::vector<const AttentionBackend*> backends_;
  std::vector<float> embed_;    // [vocab][hidden]
  std::vector<float> lm_head_;  // [vocab][hidden]; empty when tied to embed_
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  std::vector<float> inv_freq_;
  size_t num_params_ = 0;
};

// The model's compute dtype: config.json's torch_dtype/dtype, else the embedding's dtype.
DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt);

}  // namespace kvlm

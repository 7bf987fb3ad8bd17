// The decoder-only transformer shared by Llama, Qwen2, Qwen3 and Mistral. Architecture
// differences are flags of ModelConfig (q/k/v/o and MLP biases, Qwen3 q/k RMSNorm, tied
// embeddings, per-layer sliding windows, rope scaling), so one forward serves all four.
//
// Weights are held in fp32 on the host (converted once at load from bf16/fp16/fp32); the
// KV cache is held in whatever each layer's KVLayerSpec says, through the layer's backend.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/backend.h"
#include "config/kv_plan.h"
#include "config/model_config.h"
#include "io/checkpoint.h"
#include "kv/kv_cache.h"
#include "model/model_runner.h"

namespace kvlm {

// The CPU model runner.
class DecoderModel final : public ModelRunner {
 public:
  // Loads and checks every weight against `config`. The plan says, per layer, how its
  // KV is stored; `backends[i]` runs layer i's attention.
  DecoderModel(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan,
               std::vector<const AttentionBackend*> backends);

  const ModelConfig& config() const override { return cfg_; }
  Device device() const override { return Device::Cpu; }
  size_t num_parameters() const override { return num_params_; }
  size_t weight_bytes() const override { return num_params_ * sizeof(float); }

  void allocate_kv(int num_blocks, int block_size) override;
  int kv_num_blocks() const override { return cache_ ? cache_->num_blocks() : 0; }
  size_t kv_bytes() const override { return cache_ ? cache_->bytes() : 0; }
  void forward(const ForwardBatch& batch, std::span<float> logits) override;
  void copy_blocks(std::span<const std::pair<BlockId, BlockId>> pairs) override;

  // Sees every layer's K (after the q/k norm and RoPE, as it is stored) and V just before
  // they are stored, fp32 [num_tokens][num_kv_heads][head_dim]: for `kvlm calibrate`.
  using KVObserver = std::function<void(size_t layer, std::span<const float> k, std::span<const float> v)>;
  void set_kv_observer(KVObserver f) { observer_ = std::move(f); }

  // The host KV pool (tests read pages through it); null before allocate_kv.
  KVCache* kv_cache() { return cache_.get(); }

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
  std::unique_ptr<KVCache> cache_;
  KVObserver observer_;
};

// The model's compute dtype: config.json's torch_dtype/dtype, else the embedding's dtype.
DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt);

}  // namespace kvlm

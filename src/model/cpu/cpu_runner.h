// The CPU model runner: a model definition (model/architecture.h) executed by the reference
// ops in fp32 (model/cpu/cpu_runner.cpp), with the KV cache on the host in whatever each
// layer's KVLayerSpec says, stored and read through the layer's attention backend.
//
// Weights are held in fp32 (converted once at load from bf16/fp16/fp32/FP8), except a GGUF
// file's quantized matrices, which stay in their ggml blocks (ops/cpu/quant_matmul.h) unless
// CpuRunnerOptions says otherwise.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "attention/backend.h"
#include "kv/kv_plan.h"
#include "config/model_config.h"
#include "io/checkpoint.h"
#include "kv/kv_cache.h"
#include "model/architecture.h"
#include "model/communicator.h"
#include "model/model_runner.h"
#include "ops/cpu/quant_matmul.h"

namespace kvlm {

struct CpuRunnerOptions {
  // GGUF matrices stay in their quantization blocks; false (--dequantize-weights): fp32 at load.
  bool keep_blocks = true;
  // Blocks meet the activations in fp32, dequantized as they are read (the reference,
  // --dtype float32); otherwise small batches quantize the activations to int8 per 32 values
  // and use integer dot products, as llama.cpp does.
  bool exact_blocks = false;
};

class CpuModelRunner final : public ModelRunner {
 public:
  // Loads and checks every weight the architecture's definition names. The plan says, per
  // layer, how its KV is stored; `backends[i]` runs layer i's attention.
  // `drafter` (optional): a drafter whose layers are the plan's layers after the target's.
  // `comm` (optional): the runner is rank comm->rank() of a tensor-parallel group of
  // comm->world_size() (model/tensor_parallel.h): it loads that rank's slice of the weights
  // (`config` is the whole model's; `plan` the rank's, shard_kv_plan) and all-reduces
  // through `comm`, which must outlive it.
  CpuModelRunner(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan,
                 std::vector<const AttentionBackend*> backends, const DrafterSource* drafter = nullptr,
                 Communicator* comm = nullptr, CpuRunnerOptions options = {});
  ~CpuModelRunner() override;

  const ModelConfig& config() const override { return cfg_; }
  Device device() const override { return Device::Cpu; }
  size_t num_parameters() const override { return num_params_; }
  size_t weight_bytes() const override { return weight_bytes_; }
  // GGUF tensors kept in their blocks (0 for safetensors, or with keep_blocks off).
  size_t block_tensors() const { return block_tensors_; }

  void allocate_kv(int num_blocks, int block_size, int num_exact_pages = 0) override;
  void kv_plan_changed() override { cache_.reset(); }
  void allocate_states(int slots) override;
  void copy_states(std::span<const StateCopy> copies) override;
  int kv_num_blocks() const override { return cache_ ? cache_->num_blocks() : 0; }
  size_t kv_bytes() const override { return cache_ ? cache_->bytes() : 0; }
  void forward(const ForwardBatch& batch, std::span<float> logits) override;
  void forward_follower(const ForwardBatch& batch) override;
  void copy_blocks(std::span<const PageCopy> copies) override;
  size_t kv_page_bytes(int block_size, PageKind kind = PageKind::Pages) const override;
  void save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out,
                  PageKind kind = PageKind::Pages) override;
  void load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in,
                  PageKind kind = PageKind::Pages) override;
  bool has_drafter() const override { return draft_def_ != nullptr; }
  void draft(const ForwardBatch& blocks, std::span<float> logits) override;

  // The target features the last forward() captured for the drafter, fp32
  // [num_tokens][feature layers * hidden] (tests).
  std::span<const float> last_features() const { return features_; }
  std::span<const Weight> drafter_weights() const { return draft_weights_; }

  // Sees every layer's K (after the q/k norm and RoPE, as it is stored) and V just before
  // they are stored, fp32 [num_tokens][num_kv_heads][head_dim]: for `kvlm calibrate`.
  using KVObserver = std::function<void(size_t layer, std::span<const float> k, std::span<const float> v)>;
  void set_kv_observer(KVObserver f) { observer_ = std::move(f); }

  // The host KV pool (tests read pages through it); null before allocate_kv.
  KVCache* kv_cache() { return cache_.get(); }

 private:
  ops::cpu::BlockMath block_math() const;

  ModelConfig cfg_;  // the whole model's (a tensor-parallel rank computes with shard_config's)
  const KVPlan* plan_;
  std::vector<const AttentionBackend*> backends_;
  std::unique_ptr<ModelDefinition> def_;
  size_t state_bytes_ = 0;  // a Gated DeltaNet layer's state slot on this rank (its key heads)
  CpuRunnerOptions options_;
  std::vector<std::vector<float>> storage_;  // the weights' fp32 data
  std::deque<std::vector<uint8_t>> block_storage_;       // GGUF matrices' blocks
  std::deque<std::vector<WeightBlocks>> block_parts_;    // and their parts (Weight::blocks)
  std::vector<Weight> weights_;
  size_t num_params_ = 0, weight_bytes_ = 0, block_tensors_ = 0;
  std::unique_ptr<KVCache> cache_;
  // Gated DeltaNet layers' states: per linear layer, slots x LinearAttentionConfig::state_values.
  std::vector<std::vector<uint8_t>> states_;  // per Gated DeltaNet layer: [slots][state_bytes]
  int state_slots_ = 0;
  SingleProcessCommunicator single_;
  Communicator* comm_ = &single_;
  KVObserver observer_;
  // The drafter, when loaded: its definition, its weights followed by the target's
  // embedding and LM head, and which target layer fills which feature slot.
  std::unique_ptr<DraftDefinition> draft_def_;
  std::vector<Weight> draft_weights_;
  std::vector<int> feature_slot_;  // per target layer: its slot among the features, or -1
  std::vector<float> features_;
};

}  // namespace kvlm

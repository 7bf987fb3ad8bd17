// A model architecture, defined once for every device: its weights (model/weights.h) and
// its forward, written against the device-neutral ops (model/ops.h). The CPU and CUDA
// runners (model/cpu, model/cuda) execute the same definition; what differs between them is
// memory, the ops' kernels and how a step is launched, never the layer order, the weight
// names or the fusions.
//
// Each architecture lives in one file under model/arch/, which defines its ArchSpec
// (config/arch_spec.h): its config.json fields and how to make its definition.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "config/model_config.h"
#include "model/ops.h"
#include "model/weights.h"

namespace kvlm {

class ModelDefinition {
 public:
  virtual ~ModelDefinition() = default;
  // Every weight the forward uses, in the order the runner loads them.
  const WeightList& weights() const { return weights_; }
  // One step: reads the step through `ops`, stores the step's K/V in the pages, and returns
  // the logits of the step's logit rows ([num_logit_rows][vocab], ActRole::Logits), or an
  // empty tensor when no row wants logits. `w` holds the loaded weights, one per spec.
  virtual Tensor forward(Ops& ops, std::span<const Weight> w) const = 0;
  // The embedding table and the LM head among weights() (a drafter borrows them).
  size_t embedding_index() const { return embedding_; }
  size_t lm_head_index() const { return lm_head_; }

 protected:
  WeightList weights_;
  size_t embedding_ = SIZE_MAX, lm_head_ = SIZE_MAX;
};

// A drafter to load next to a target (--speculative-config): its config, checkpoint and
// tensor-name prefix.
struct DrafterSource {
  ModelConfig config;
  const Checkpoint* checkpoint = nullptr;
  std::string prefix;
};

// A drafter (DFlash): forward() runs the drafted blocks — the step's rows are blocks of
// [last token, mask x (block_size - 1)] whose queries attend non-causally to the context's
// K/V and the block's own — and returns the logits of the logit rows; context() writes the
// K/V of every row of a target step into the drafter's layers, from the target features the
// step captured. Its `w` holds its own weights, then the target's embedding table and LM
// head (a drafter has neither of its own).
class DraftDefinition : public ModelDefinition {
 public:
  // The target layers whose outputs condition the drafter, in feature order.
  virtual std::span<const int> feature_layers() const = 0;
  // `features`: [num_tokens][feature_layers().size() * hidden] (ActRole::Hidden).
  virtual void context(Ops& ops, std::span<const Weight> w, Tensor features) const = 0;
};

// The definition of `cfg`'s architecture. Throws kvlm::Error for an architecture kvlm does
// not define.
std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg);

// A DFlash drafter (DFlashDraftModel) whose tensors are named `prefix` + "layers.0...."
// ("" in the published checkpoints, "model." in some conversions) and whose layers are the
// KV plan's layers first_layer, first_layer + 1, ...
std::unique_ptr<DraftDefinition> make_dflash_draft(const ModelConfig& cfg, const std::string& prefix, int first_layer);

}  // namespace kvlm

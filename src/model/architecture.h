// A model architecture, defined once for every device: its weights (model/weights.h) and
// its forward, written against the device-neutral ops (model/ops.h). The CPU and CUDA
// runners (model/cpu, model/cuda) execute the same definition; what differs between them is
// memory, the ops' kernels and how a step is launched, never the layer order, the weight
// names or the fusions.
//
// Each architecture lives in one file under model/arch/ and is registered in
// architecture.cpp.
#pragma once

#include <memory>
#include <span>

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

 protected:
  WeightList weights_;
};

// The definition of `cfg`'s architecture. Throws kvlm::Error for an architecture kvlm does
// not define.
std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg);

// Architectures (model/arch/*.cpp).
std::unique_ptr<ModelDefinition> make_llama_family(const ModelConfig& cfg);  // Llama, Qwen2, Qwen3, Mistral
std::unique_ptr<ModelDefinition> make_gemma3(const ModelConfig& cfg);        // Gemma3ForCausalLM

}  // namespace kvlm

#include "model/architecture.h"

#include "core/error.h"

namespace kvlm {

std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg) {
  KVLM_CHECK(cfg.arch != nullptr, "a model config without an architecture");
  if (!cfg.arch->make) throw Error(std::string(cfg.arch->not_a_model));
  return cfg.arch->make(cfg);
}

}  // namespace kvlm

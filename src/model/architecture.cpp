#include "model/architecture.h"

#include "core/error.h"

namespace kvlm {

std::unique_ptr<ModelDefinition> make_model_definition(const ModelConfig& cfg) {
  switch (cfg.arch) {
    case Arch::Llama:
    case Arch::Qwen2:
    case Arch::Qwen3:
    case Arch::Mistral:
      return make_llama_family(cfg);
    case Arch::Gemma3:
      return make_gemma3(cfg);
    case Arch::DFlashDraft:
      throw Error("this is a DFlash drafter (DFlashDraftModel), not a model that generates on its own; use it as "
                  "--speculative-config '{\"method\":\"dflash\",\"model\":DIR,...}' next to its target model");
  }
  throw Error("kvlm has no model definition for " + std::string(arch_name(cfg.arch)));
}

}  // namespace kvlm

// The list of architectures (config/arch_spec.h); each entry is defined in its file under
// model/arch/.
#include "config/arch_spec.h"

namespace kvlm {

namespace arch_specs {
extern const ArchSpec llama, qwen2, qwen3, mistral, gemma3, qwen3_moe, gpt_oss, qwen3_5, qwen3_5_moe, qwen3_next, dflash;
}  // namespace arch_specs

std::span<const ArchSpec* const> architectures() {
  using namespace arch_specs;
  static const ArchSpec* const all[] = {&llama, &qwen2, &qwen3, &mistral, &gemma3, &qwen3_moe, &gpt_oss, &qwen3_5,
                                        &qwen3_5_moe, &qwen3_next, &dflash};
  return all;
}

}  // namespace kvlm

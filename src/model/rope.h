// Rotary-embedding frequencies for every supported rope type, computed as Hugging Face
// transformers computes them (default, linear, llama3), then divided by a GGUF file's
// per-frequency factors where it has them (as llama.cpp does).
#pragma once

#include <vector>

#include "config/model_config.h"

namespace kvlm {

// inv_freq[i] for i < head_dim / 2.
std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim);

}  // namespace kvlm

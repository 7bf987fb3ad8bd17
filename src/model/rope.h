// Rotary-embedding frequencies for every supported rope type, computed as Hugging Face
// transformers computes them (default, linear, llama3, yarn), then divided by a GGUF file's
// per-frequency factors where it has them (as llama.cpp does).
#pragma once

#include <vector>

#include "config/model_config.h"

namespace kvlm {

// inv_freq[i] for i < head_dim / 2 (rope.rotary_dim / 2 under partial rotary).
std::vector<float> rope_inv_freq(const RopeConfig& rope, int head_dim);

// What the rope type multiplies attention scores by: YaRN's attention_factor scales cos and
// sin, so q and k each, and scores by its square; kvlm stores K unscaled and multiplies the
// softmax scale by this instead (the same scores; a per-token-head format quantizes K alike
// either way). 1 for the other types.
float rope_score_scale(const RopeConfig& rope);

}  // namespace kvlm

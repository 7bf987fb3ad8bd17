// Token sampling: penalties (repetition, presence, frequency), then greedy or temperature
// with top-k, top-p and min-p, from a seeded generator so the same seed gives the same
// tokens; and log-probabilities of the raw model distribution.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/index_types.h"

namespace kvlm {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy
  int top_k = 0;                    // 0 or -1 = disabled
  float top_p = 1.0f;               // 1 = disabled
  float min_p = 0.0f;               // keep tokens with p >= min_p * p_max; 0 = disabled
  float repetition_penalty = 1.0f;  // HF/vLLM: prompt and output tokens; > 1 discourages
  float presence_penalty = 0.0f;    // OpenAI: output tokens, once per distinct token
  float frequency_penalty = 0.0f;   // OpenAI: output tokens, per occurrence
  bool has_penalties() const {
    return repetition_penalty != 1.0f || presence_penalty != 0.0f || frequency_penalty != 0.0f;
  }
};

// Throws kvlm::Error with the flag name for out-of-range values.
void validate_sampling(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}
  // `prompt` and `output` are the sequence's tokens so far (for the penalties).
  TokenId sample(std::span<const float> logits, const SamplingParams& p, std::span<const TokenId> prompt = {},
                 std::span<const TokenId> output = {});

 private:
  std::mt19937_64 rng_;
  std::vector<std::pair<float, TokenId>> scratch_;
  std::vector<float> penalized_;
};

TokenId argmax(std::span<const float> logits);  // lowest id among ties

// Applies the penalties of `p` to a copy of `logits` (vLLM's order and formulas).
void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const TokenId> prompt,
                     std::span<const TokenId> output);

// log(sum(exp(logits))), accumulated in double.
float log_sum_exp(std::span<const float> logits);
// log_softmax(logits)[token]
float logprob_of(std::span<const float> logits, TokenId token);
// The k most likely tokens of log_softmax(logits), most likely first.
std::vector<std::pair<TokenId, float>> top_logprobs(std::span<const float> logits, int k);

}  // namespace kvlm

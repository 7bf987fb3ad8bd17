// Token sampling: greedy, temperature, top-k, top-p, with a seeded generator so the same
// seed gives the same tokens; and log-probabilities of the raw model distribution.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "core/index_types.h"

namespace kvlm {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy
  int top_k = 0;             // 0 or -1 = disabled
  float top_p = 1.0f;        // 1 = disabled
};

// Throws kvlm::Error with the flag name for out-of-range values.
void validate_sampling(const SamplingParams& p);

class Sampler {
 public:
  explicit Sampler(uint64_t seed) : rng_(seed) {}
  TokenId sample(std::span<const float> logits, const SamplingParams& p);

 private:
  std::mt19937_64 rng_;
  std::vector<std::pair<float, TokenId>> scratch_;
};

TokenId argmax(std::span<const float> logits);  // lowest id among ties

// log_softmax(logits)[token]
float logprob_of(std::span<const float> logits, TokenId token);
// The k most likely tokens of log_softmax(logits), most likely first.
std::vector<std::pair<TokenId, float>> top_logprobs(std::span<const float> logits, int k);

}  // namespace kvlm

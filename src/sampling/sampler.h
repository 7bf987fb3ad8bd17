// Token sampling: penalties (repetition, presence, frequency), then greedy or temperature
// with top-k, top-p and min-p, from a seeded generator so the same seed gives the same
// tokens; and log-probabilities of the raw model distribution.
#pragma once

#include <cmath>
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
  std::vector<double> prob_;
  std::vector<float> penalized_;
};

TokenId argmax(std::span<const float> logits);  // lowest id among ties

// Applies the penalties of `p` to a copy of `logits` (vLLM's order and formulas).
void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const TokenId> prompt,
                     std::span<const TokenId> output);

// Sampling as the GPU runs it (ops/cuda/sampling.cu), on the CPU: the definition of that
// kernel's result and its reference in tests. No penalties (a row with penalties is sampled
// on the host by Sampler). The kept set is found by value thresholds, in this order: min-p
// (logit >= max + T*log(min_p)), top-k (logit >= the k-th largest kept logit: tokens tied
// with the k-th are all kept, where Sampler keeps exactly k), top-p (logit >= the largest
// value whose kept tokens of at least that logit hold top_p of the kept mass, the mass of
// each token counted in fixed point so that the sum is exact and order-independent). The
// token is then drawn by Gumbel-max, argmax over the kept tokens of logit/T + Gumbel noise
// with noise from Philox(seed; counter, token id) (core/philox.h) — an exact draw from the
// kept tokens' softmax at temperature T, with no generator state. Temperature 0: argmax.
struct GumbelParams {
  float inv_temperature = 1.0f;  // 0 = greedy
  int top_k = 0;                 // 0 = off
  float top_p = 1.0f;            // 1 = off
  float min_p_offset = 0.0f;     // T * log(min_p), computed in double; -inf = off
};
GumbelParams gumbel_params(const SamplingParams& p);
// A token's weight in the top-p mass: exp((logit - max) / T) in [0, 1], scaled by 2^32.
inline uint64_t gumbel_fixed_weight(float logit, float max_logit, float inv_temperature) {
  return uint64_t(std::exp((logit - max_logit) * inv_temperature) * 4294967296.0f);
}
TokenId sample_gumbel(std::span<const float> logits, const SamplingParams& p, uint64_t seed, uint64_t counter);
// A token mask (a grammar's allowed tokens): bit t of words[t / 64] set = token t may be drawn
// (grammar::TokenMask's layout, and the GPU sampler's). Sets every other logit of the row to
// -inf, as the GPU sampler reads a masked row.
void apply_token_mask(std::span<float> logits, std::span<const uint64_t> words);

// A sampled token's log-probability and the top-K alternatives, most likely first.
struct TokenLogprobs {
  TokenId token = 0;
  float logprob = 0;
  std::vector<std::pair<TokenId, float>> top;
  int rank = 0;  // prompt log-probabilities: 1 + the tokens more likely than `token` (vLLM's rank); 0 = not computed
};

// log(sum(exp(logits))), accumulated in double.
float log_sum_exp(std::span<const float> logits);
// log_softmax(logits)[token]
float logprob_of(std::span<const float> logits, TokenId token);
// 1 + the number of tokens whose logit is higher than `token`'s.
int rank_of(std::span<const float> logits, TokenId token);
// The k most likely tokens of log_softmax(logits), most likely first.
std::vector<std::pair<TokenId, float>> top_logprobs(std::span<const float> logits, int k);

}  // namespace kvlm

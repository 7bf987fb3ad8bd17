// Token sampling on the GPU: temperature, top-k, top-p and min-p over fp32 logits, one CTA
// per row, so that only token ids cross to the host. The result is defined by its CPU
// reference, sampling/sampler.h's sample_gumbel (same thresholds, same Philox noise); see
// there for how it differs from the host Sampler (ties at the k-th logit are kept). No CUDA
// header here: a stream is a void*.
#pragma once

#include <cstdint>

#include "core/index_types.h"

namespace kvlm::cuda {

struct SampleRowParams {
  float inv_temperature = 0.0f;  // 0 = greedy (argmax, ties to the lowest id)
  int32_t top_k = 0;             // 0 = off
  float top_p = 1.0f;            // 1 = off
  float min_p_offset = 0.0f;     // T * log(min_p); -inf = off (sampling/sampler.h gumbel_params)
  uint64_t seed = 0;
  uint64_t counter = 0;          // the output position of the token being drawn
  int32_t skip = 0;              // 1: not sampled here (out[r] is left unwritten)
  int32_t mask_row = -1;         // >= 0: only the tokens of that row of `masks` may be drawn
};

// Words of one token mask: bit t of word t / 64 set = token t allowed (grammar::TokenMask's
// layout).
inline int mask_words(int vocab) { return (vocab + 63) / 64; }

// out[r] = the token of row r of logits [rows][vocab] (device), for every row whose params
// (device, [rows]) have skip == 0. A row with mask_row >= 0 is sampled as if every token
// outside masks[mask_row] ([*][mask_words(vocab)], device) had logit -inf — its mask must
// allow at least one token. masks may be null when no row has one.
void sample_rows(const float* logits, int rows, int vocab, const SampleRowParams* params, const uint64_t* masks,
                 TokenId* out, void* stream);

}  // namespace kvlm::cuda

// Greedy outputs that must be the same computation batched differently (drafted vs plain
// decoding): token for token equal, except that after a near tie of the reference's logits
// the two may part. On the CPU a 1-row product goes through OpenBLAS's GEMV kernel and a
// multi-row one through its GEMM kernel, which sum in another order on some CPUs (seen on
// AVX-512 machines), so the last bits of a logit depend on how many rows were computed
// together; a near tie (a top-2 log-probability gap below kNearTie) can then flip. A real
// bug shows as a divergence at a wide margin, which fails.
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "offline/generate.h"

namespace kvlm::test {

inline constexpr double kNearTie = 2e-3;

// `ref` must have been generated with logprobs >= 2. Returns whether the outputs part (at a
// near tie; a wide-margin divergence is a test failure). `near_tie`: kNearTie for fp32 on the
// CPU; a 16-bit GPU computation rounds each product ~100x coarser, so its ties are wider.
inline bool expect_same_greedy(const GenerateResult& ref, const GenerateResult& got, const std::string& what,
                               double near_tie = kNearTie) {
  size_t same = 0;
  while (same < ref.tokens.size() && same < got.tokens.size() && ref.tokens[same] == got.tokens[same]) ++same;
  if (same == ref.tokens.size() && same == got.tokens.size()) return false;
  if (same >= ref.tokens.size() || same >= got.tokens.size()) {
    ADD_FAILURE() << what << ": " << ref.tokens.size() << " vs " << got.tokens.size() << " tokens";
    return true;
  }
  EXPECT_GE(ref.logprobs.size(), ref.tokens.size()) << what << ": generate the reference with logprobs >= 2";
  if (same >= ref.logprobs.size() || ref.logprobs[same].top.size() < 2) return true;
  const double gap = double(ref.logprobs[same].top[0].second) - double(ref.logprobs[same].top[1].second);
  EXPECT_LT(gap, near_tie) << what << ": diverges at token " << same << " (" << ref.tokens[same] << " vs "
                           << got.tokens[same] << ") where the reference's top-2 log-probability gap is " << gap;
  std::printf("[greedy] %s: same for %zu tokens, then parts at a near tie (gap %.2e)\n", what.c_str(), same, gap);
  return true;
}

}  // namespace kvlm::test

// N-gram drafting (prompt lookup, vLLM's "ngram" method): the sequence's last n tokens, for
// the largest n in [min_n, max_n] that occurred earlier in the sequence (prompt and output),
// propose the tokens that followed that earlier occurrence — the earliest one among the
// longest matches, as vLLM does. No model, no KV: it pays off where the output repeats its
// input (editing, extraction, code, summaries that quote) and costs one scan per step.
#pragma once

#include <span>
#include <vector>

#include "engine/proposer.h"

namespace kvlm {

// Up to k tokens following the earliest longest earlier occurrence of the suffix of
// `tokens` with length in [min_n, max_n]; empty when there is none. One pass over tokens.
std::vector<TokenId> ngram_lookup(std::span<const TokenId> tokens, int min_n, int max_n, int k);

class NgramProposer final : public DraftProposer {
 public:
  NgramProposer(int k, int min_n, int max_n) : k_(k), min_n_(min_n), max_n_(max_n) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override;

 private:
  int k_, min_n_, max_n_;
};

}  // namespace kvlm

// Speculative decoding's proposing side: something that guesses the next tokens of the
// sequences being decoded, cheaply, so that one target step can verify several of them
// (the OutputProcessor keeps the agreeing prefix; output_processor.h says why the result is
// exactly plain decoding's). Proposers are called once per step, for the running sequences
// that decode, before the scheduler shares the step's budget out.
#pragma once

#include <span>

#include "engine/sequence.h"

namespace kvlm {

class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // Sets each sequence's `draft` to at most max_draft[i] tokens that follow its tokens (an
  // empty draft is always right). Called on the engine thread.
  virtual void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) = 0;
  // Positions past a sequence's last token whose pages the proposer writes (a drafter
  // model's block); the engine reserves them first and skips sequences it cannot.
  virtual int lookahead() const { return 0; }
};

}  // namespace kvlm

// DFlash drafting (arXiv 2602.06036): the drafter model loaded into the runner next to the
// target (ModelRunner::has_drafter) proposes a whole block in one forward. The target's
// steps keep the drafter's context K/V current for every position they compute (the
// runner's context pass); a proposal is one drafter forward over the block [last token,
// mask x (B - 1)] at the positions after the sequence's computed ones, non-causal over the
// context and the block, whose rows 1..K propose the next K tokens greedily.
#pragma once

#include <vector>

#include "engine/block_manager.h"
#include "engine/proposer.h"
#include "engine/step_batch.h"  // ExactLayout
#include "model/model_runner.h"

namespace kvlm {

class DFlashProposer final : public DraftProposer {
 public:
  // block: the drafter's block size; k: tokens proposed per block (<= block - 1).
  // `pages`: the scheduler's pages (their size, and their exact pages for exact tokens).
  DFlashProposer(ModelRunner& runner, const BlockManager& pages, int block, TokenId mask_token, int k)
      : runner_(runner), pages_(pages), page_size_(pages.block_size()), block_(block), mask_(mask_token), k_(k) {}
  int lookahead() const override { return block_ - 1; }
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override;

 private:
  ModelRunner& runner_;
  const BlockManager& pages_;
  int page_size_, block_;
  TokenId mask_;
  int k_;
  // Scratch, kept across steps.
  std::vector<TokenId> tokens_, drafted_;
  std::vector<Position> positions_;
  std::vector<SlotId> slots_;
  ExactLayout exact_;
  std::vector<AttnSeq> seqs_;
  std::vector<int32_t> logit_rows_;
};

}  // namespace kvlm

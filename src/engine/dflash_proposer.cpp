#include "engine/dflash_proposer.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

void DFlashProposer::propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) {
  tokens_.clear();
  positions_.clear();
  slots_.clear();
  exact_.begin(pages_.exact_map(), page_size_);
  seqs_.clear();
  logit_rows_.clear();
  std::vector<int> wanted;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const Sequence& s = *seqs[i];
    const int start = s.num_computed;  // the last token's position: every token before it is computed
    KVLM_CHECK(start == int(s.tokens.size()) - 1, "DFlash proposes only for decoding sequences");
    KVLM_CHECK(int(s.pages.size()) * page_size_ >= start + block_, "DFlash block without pages");
    const int q0 = int(tokens_.size());
    for (int j = 0; j < block_; ++j) {
      const int p = start + j;
      tokens_.push_back(j == 0 ? s.tokens.back() : mask_);
      positions_.push_back(Position(p));
      slots_.push_back(SlotId(s.pages[size_t(p / page_size_)]) * page_size_ + p % page_size_);
      exact_.add_token(s.pages[size_t(p / page_size_)], p % page_size_);
    }
    seqs_.push_back(AttnSeq{.q_begin = q0, .q_len = block_, .kv_len = start + block_, .block_table = s.pages});
    exact_.add_sequence(s.pages);
    const int k = std::min(k_, max_draft[i]);
    for (int j = 1; j <= k; ++j) logit_rows_.push_back(q0 + j);
    wanted.push_back(k);
  }
  exact_.bind(seqs_);
  drafted_.assign(logit_rows_.size(), -1);
  runner_.draft_greedy(ForwardBatch{.tokens = tokens_, .positions = positions_, .slots = slots_,
                                    .exact_slots = exact_.slots(), .seqs = seqs_, .logit_rows = logit_rows_},
                       drafted_);
  size_t at = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i]->draft.assign(drafted_.begin() + std::ptrdiff_t(at), drafted_.begin() + std::ptrdiff_t(at + size_t(wanted[i])));
    at += size_t(wanted[i]);
  }
}

}  // namespace kvlm

// One engine step's rows laid out for the model runner: the scheduled sequences' tokens
// flattened into a ForwardBatch (positions, KV slots, per-sequence block tables), the rows
// whose logits are wanted — prompt rows for prompt_logits / prompt log-probabilities, then
// the rows that draw tokens (one, or 1 + the draft when speculating: a multi-token query
// per sequence, verified by the OutputProcessor) — and which of those the runner samples
// on its device. Kept across steps so its buffers are reused.
#pragma once

#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "engine/sequence.h"
#include "model/model_runner.h"

namespace kvlm {

// A batch's exact pages (exact sink / recent tokens): each token's exact slot and each
// sequence's exact table, from the BlockManager's exact_map — nothing when the map is empty.
// Laid out by StepBatch and DFlashProposer alike; kept across steps so its buffers are reused.
class ExactLayout {
 public:
  void begin(std::span<const int32_t> exact_map, int block_size);
  void add_token(BlockId page, int offset);
  void add_sequence(std::span<const BlockId> pages);
  // Points seqs[i].exact_table at the i-th sequence's table (once every one is added).
  void bind(std::span<AttnSeq> seqs) const;
  std::span<const SlotId> slots() const { return slots_; }

 private:
  std::span<const int32_t> map_;
  int block_size_ = 1;
  std::vector<SlotId> slots_;
  std::vector<BlockId> tables_;  // the sequences' tables, one after the other
};

class StepBatch {
 public:
  // Lays out `seqs` (each with `scheduled` set) and records each one's logit rows in it.
  // device_sampling: the runner samples on its device (forward_sampled); has_eos: the model
  // has EOS ids (min_tokens masks them).
  // exact_map: the BlockManager's exact page of every page (empty: no exact tokens).
  void build(std::span<Sequence* const> seqs, int block_size, bool device_sampling, bool has_eos, size_t vocab,
             std::span<const int32_t> exact_map = {});
  // The mask of the token `s` draws at output index i (OutputProcessor::fill_mask): writes
  // its allowed tokens as bits and returns true, or returns false when it is not ready.
  using MaskFn = std::function<bool(Sequence& s, int i, std::span<uint64_t> words)>;
  // Runs the step: the pages receive the rows' K/V, the logits (or the runner's tokens) come
  // back. `mask` gives the runner the masks of masked rows while the forward pass runs.
  void run(ModelRunner& runner, const MaskFn& mask = {});

  int num_rows() const { return int(tokens_.size()); }
  // Host logits of `n` consecutive logit rows of `s` from its r-th ([n][vocab]).
  std::span<const float> logits(const Sequence& s, int r, int n = 1) const;
  // The token the runner drew for the r-th logit row of `s` (device_sampled sequences); -1
  // for a masked row whose mask was late (its logits are here instead).
  TokenId device_token(const Sequence& s, int r) const;
  // Masked rows the runner did not sample (their mask was late), after run().
  int late_masks() const;

 private:
  bool device_sampling_ = false;
  size_t vocab_ = 0;
  std::vector<TokenId> tokens_;
  std::vector<Position> positions_;
  std::vector<SlotId> slots_;
  ExactLayout exact_;
  std::vector<AttnSeq> attn_;
  std::vector<int32_t> logit_rows_;
  std::vector<RowSampling> row_sampling_;  // per logit row (runners that sample on their device)
  std::vector<std::pair<Sequence*, int>> row_owner_;  // per logit row: its sequence and output index
  std::vector<int> host_row_;  // per logit row: its slot in logits_, -1 = sampled by the runner
  std::vector<TokenId> device_tokens_;     // per logit row: the runner's token
  std::vector<float> logits_;              // the host rows' logits
};

}  // namespace kvlm

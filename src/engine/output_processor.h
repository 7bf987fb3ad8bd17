// Turns a step's logits into what each request hears: prompt log-probabilities and prompt
// logits, the tokens drawn (on the host with the request's Sampler, or by the runner), the
// verification of a speculative draft, stop conditions and the counters.
//
// Verification keeps the draft's longest prefix that the target model's own draws agree
// with, then the target's token after it: row i draws t_i from the target's distribution
// given everything before it; while t_i equals draft[i] the draft token is accepted and the
// next row is drawn. Every emitted token is thus a draw from the target model given the
// tokens before it — the output distribution is exactly that of plain decoding (for a
// deterministic drafter, this is rejection sampling with a one-point proposal). The K/V the
// rejected draft rows wrote stays in slots past the sequence's length, unread, and is
// overwritten by the tokens that come later.
#pragma once

#include <span>
#include <utility>
#include <vector>

#include "engine/metrics.h"
#include "engine/scheduler.h"
#include "engine/sequence.h"
#include "engine/step_batch.h"

namespace kvlm {

class OutputProcessor {
 public:
  OutputProcessor(std::vector<TokenId> eos, int max_model_len, Scheduler& scheduler, EngineStats& stats)
      : eos_(std::move(eos)), max_model_len_(max_model_len), scheduler_(scheduler), stats_(stats) {}

  bool has_eos() const { return !eos_.empty(); }
  // Ends `s` for `why`: marks it finished, releases its pages, counts it.
  void close(Sequence& s, FinishReason why, Sequence::Clock::time_point now);

  // Draws every sequence's tokens from the step's logits, in parallel over the sequences
  // (each has its own generator, so the result does not depend on the thread count).
  // Throws when an invariant breaks.
  void draw(std::span<Sequence* const> seqs, const StepBatch& batch);
  // Applies the draws in order: the sequences' K/V length, tokens, prefix-cache pages and
  // stop conditions. Returns the outputs to deliver; a finished sequence has released its
  // pages and is marked finished.
  std::vector<std::pair<Sequence*, RequestOutput>> apply(std::span<Sequence* const> seqs, const StepBatch& batch);
  // The token of a deferred sequence (Sequence::deferred), drawn from its saved row now that
  // its grammar mask is ready, with its stop conditions; the output to deliver.
  RequestOutput draw_deferred(Sequence& s);
  // For a runner that samples masked rows (StepBatch::MaskFn): the tokens of a `vocab`-token
  // vocabulary that `s` may draw at output index i, as bits (bit t of words[t / 64]) — the
  // grammar's, with EOS and the stop tokens where the text may end and min_tokens is reached;
  // without a grammar every token but, before min_tokens, EOS and the stop tokens. False
  // without waiting when the grammar's mask is still being computed, and when it fails or
  // allows nothing: the row's logits then come back, and draw() defers it or says why.
  bool fill_mask(Sequence& s, int i, size_t vocab, std::span<uint64_t> words) const;

 private:
  struct Drawn {
    std::vector<TokenId> tokens;           // accepted draft tokens, then the target's own
    std::vector<TokenLogprobs> logprobs;   // one per token when logprobs > 0
    std::string error;                     // the request fails (its grammar admits no token)
    bool deferred = false;                 // its grammar mask was not ready: drawn later
  };
  // The tokens `s` may draw at output index i (fill_mask's bits; waits for the grammar's
  // mask). Returns an error message when the grammar fails or nothing is left to draw.
  std::string allowed_tokens(const Sequence& s, int i, size_t vocab, std::span<uint64_t> words) const;
  // The logits a host-sampled row draws from: the raw row, or a copy with the logit bias
  // added and the tokens min_tokens or the request's grammar forbid at -inf. Returns an
  // error message when nothing is left to draw.
  std::string masked_row(const Sequence& s, int output_index, std::span<const float> raw, std::vector<float>& out) const;
  void draw_one(Sequence& s, const StepBatch& batch, Drawn& d) const;
  // Row i's token drawn on the host from `raw` (bias, min_tokens and grammar masking,
  // penalties, log-probabilities; the grammar advances) — by the request's Sampler, or for a
  // device_sampled sequence (a late mask) by sample_gumbel, as the runner would have. -1 with
  // d.error set when the request must fail. `history`: scratch for the output so far.
  TokenId draw_host(Sequence& s, std::span<const float> raw, int i, Drawn& d, std::vector<TokenId>& history) const;
  // Advances the request's grammar by its token t (drawn here or by the runner) and starts
  // the next mask; false with d.error set when the grammar rejects it.
  bool advance(Sequence& s, TokenId t, Drawn& d) const;
  // Appends d's tokens to s and says why s ends (None: it goes on); counts them.
  FinishReason emit(Sequence& s, Drawn& d, RequestOutput& out, Sequence::Clock::time_point now);
  // The end of an output: the prompt's log-probabilities once they are due, and the finish
  // (`why` not None: s closes and releases its pages).
  void settle(Sequence& s, FinishReason why, bool prompt_logprobs_due, RequestOutput& out, Sequence::Clock::time_point now);
  FinishReason stop_reason(const Sequence& s, TokenId t) const;

  std::vector<TokenId> eos_;
  int max_model_len_;
  Scheduler& scheduler_;
  EngineStats& stats_;
  std::vector<Drawn> drawn_;  // per sequence of the step
  bool may_defer_ = false;    // this step has other sequences that need not wait for a mask
};

}  // namespace kvlm

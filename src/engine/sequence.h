// One request's state inside the serving engine, shared by its three parts: the Scheduler
// (which sequences run this step and with how many rows), the StepBatch (the step's rows
// laid out for the model runner) and the OutputProcessor (tokens, log-probabilities,
// stops). LLMEngine owns the sequences; nothing outside engine/ sees them.
#pragma once

#include <chrono>
#include <span>
#include <vector>

#include "core/index_types.h"
#include "engine/page_hash.h"
#include "engine/request.h"
#include "sampling/sampler.h"

namespace kvlm {

struct Sequence {
  using Clock = std::chrono::steady_clock;

  EngineRequest req;
  std::vector<TokenId> tokens;  // prompt, then generated tokens
  int num_prompt = 0;
  int num_computed = 0;         // leading tokens whose K/V is in the pages
  std::vector<BlockId> pages;
  int state_slot = -1;            // hybrid models: its recurrent-state slot while it runs (Scheduler)
  int snapshot_at = -1;           // hybrid models: the position whose state the prefix cache keeps (Scheduler)
  std::vector<uint64_t> serials;  // prefix-cache serials of the leading registered pages
  // With a lower tier: the chain hashes (engine/page_hash.h) of its leading full pages. They
  // depend on the tokens alone, so unlike serials they survive preemption.
  std::vector<PageHash> chains;
  // Waiting while its prefix is read from the disk tier (Scheduler): others are scheduled
  // meanwhile. restore_rounds: reads started for it (pages read for it that were replaced before
  // it was admitted are read again, a bounded number of times).
  bool restoring = false;
  int restore_rounds = 0;
  int exact_from = 0;             // exact tokens: first non-sink page it holds exact (Scheduler)
  int exact_stale_from = 0;       // and the first whose idle exact copy it has not marked stale
  int cached_prompt_tokens = 0;
  bool started = false;           // scheduled at least once (prompt tokens counted)
  bool first_token_sent = false;
  bool finished = false;
  std::vector<TokenLogprobs> prompt_lp;  // collected while prefilling, sent once
  bool prompt_lp_sent = false;
  Sampler sampler;
  Clock::time_point arrival, last_token;
  // Structured outputs: the step ended before this sequence's grammar mask was computed (on
  // another thread), so its token was not drawn; it sits out the steps until the mask is
  // there (LLMEngine draws it from this row then), and the others do not wait for it.
  bool deferred = false;
  std::vector<float> deferred_row;

  // --- this step ------------------------------------------------------------------------
  // Speculative tokens proposed after the last token (only while decoding: every token but
  // the last is computed). They run as extra query rows of the step, each with its logits,
  // and the OutputProcessor keeps the prefix the target model agrees with.
  std::vector<TokenId> draft;
  int scheduled = 0;    // query rows this step: uncomputed tokens, then the draft
  int logit_row = -1;    // first logits row of this step, -1 = none
  int logit_count = 0;
  int prompt_row0 = 0;   // position of the first prompt row among them
  int prompt_rows = 0;   // leading logit rows that are prompt rows (prompt_logits / _logprobs)
  int sample_row0 = 0;   // index of the first row that draws a token
  int sample_rows = 0;   // rows that draw tokens: 1 + draft, or 0 (prefill chunk, scoring)
  // Those rows are drawn by the Gumbel sampler (sample_gumbel: a token fixed by the seed and
  // its position) — by the runner (forward_sampled), or on the host for a masked row whose
  // mask was late.
  bool device_sampled = false;
  int prompt_logits_sent = 0;   // prompt rows already delivered (never twice after preemption)

  explicit Sequence(EngineRequest r) : req(std::move(r)), sampler(req.seed) {}

  int num_output() const { return int(tokens.size()) - num_prompt; }
  // Tokens the step may run: the uncomputed ones and the draft after them.
  int num_pending() const { return int(tokens.size() + draft.size()) - num_computed; }
  std::span<const TokenId> prompt() const { return std::span(tokens).first(size_t(num_prompt)); }
  std::span<const TokenId> output() const { return std::span(tokens).subspan(size_t(num_prompt)); }
  TokenId token_at(int p) const {
    return p < int(tokens.size()) ? tokens[size_t(p)] : draft[size_t(p - int(tokens.size()))];
  }
  bool wants_prompt_logprobs() const { return req.prompt_logprobs >= 0 && !prompt_lp_sent; }
  // Prompt rows whose logits this request still wants, [prompt_rows_begin, prompt_rows_end):
  // for prompt_logits every row from req.prompt_logits_from on; all but the last for prompt
  // log-probabilities (row p scores token p + 1).
  int prompt_rows_begin() const {
    if (!req.prompt_logits) return 0;
    return std::max(prompt_logits_sent, std::min(req.prompt_logits_from, num_prompt - 1));
  }
  int prompt_rows_end() const {
    if (req.prompt_logits) return num_prompt;
    return wants_prompt_logprobs() ? num_prompt - 1 : 0;
  }
  // Whether the next tokens can be drawn where the logits are: no penalties, no
  // log-probabilities, no logit bias (a grammar, and min_tokens holding back EOS, travel to the
  // runner as token masks).
  bool device_samplable() const {
    return !req.sampling.has_penalties() && req.logprobs == 0 && req.logit_bias.empty();
  }
  // Whether the token at output index `i` is drawn from a subset of the vocabulary: a
  // grammar's tokens, or all but EOS and the stop tokens before min_tokens.
  bool needs_mask(int i, bool has_eos) const {
    return req.constraint || (i < req.min_tokens && ((!req.ignore_eos && has_eos) || !req.stop_token_ids.empty()));
  }
};

}  // namespace kvlm

#include "engine/output_processor.h"

#include <algorithm>
#include <chrono>
#include <exception>

#include "core/error.h"
#include "core/host_threads.h"
#include "core/units.h"

namespace kvlm {

void OutputProcessor::draw_one(Sequence& s, const StepBatch& batch, Drawn& d) const {
  d.tokens.clear();
  d.logprobs.clear();
  d.error.clear();
  d.deferred = false;
  if (s.logit_row < 0) return;
  if (s.wants_prompt_logprobs()) {
    const int k = s.req.prompt_logprobs;
    for (int r = 0; r < s.prompt_rows; ++r) {
      const int p = s.prompt_row0 + r;
      if (p + 1 >= s.num_prompt) break;
      const TokenId next = s.tokens[size_t(p + 1)];
      const auto row = batch.logits(s, r);
      s.prompt_lp.push_back({next, logprob_of(row, next), top_logprobs(row, k), rank_of(row, next)});
    }
  }
  std::vector<TokenId> history;  // output tokens so far, accepted draft tokens included
  for (int i = 0; i < s.sample_rows; ++i) {
    const int r = s.sample_row0 + i;
    TokenId t = s.device_sampled ? batch.device_token(s, r) : -1;
    if (t >= 0) {
      if (!advance(s, t, d)) break;
    } else {  // a host row, or a masked row whose mask was late
      const auto raw = batch.logits(s, r);
      if (i == 0 && s.req.constraint && may_defer_ && !s.req.constraint->ready()) {
        // The others in the step need not wait for this mask (constrained rows have no draft).
        d.deferred = true;
        s.deferred_row.assign(raw.begin(), raw.end());
        return;
      }
      t = draw_host(s, raw, i, d, history);
      if (t < 0) break;
    }
    KVLM_CHECK(t >= 0, "a row that draws a token was not sampled");
    d.tokens.push_back(t);
    // The draft token is accepted when the target drew the same token; otherwise the
    // target's token replaces it and the rest of the draft is void.
    if (i >= int(s.draft.size()) || t != s.draft[size_t(i)] || stop_reason(s, t) != FinishReason::None) break;
  }
}

TokenId OutputProcessor::draw_host(Sequence& s, std::span<const float> raw, int i, Drawn& d,
                                   std::vector<TokenId>& history) const {
  std::span<const float> row = raw;
  std::vector<float> masked;
  if (s.num_output() + i < s.req.min_tokens || !s.req.logit_bias.empty() || s.req.constraint) {
    d.error = masked_row(s, s.num_output() + i, raw, masked);
    if (!d.error.empty()) return -1;
    row = masked;
  }
  std::span<const TokenId> output = s.output();
  if (i > 0) {
    history.assign(output.begin(), output.end());
    history.insert(history.end(), d.tokens.begin(), d.tokens.end());
    output = history;
  }
  const TokenId t = s.device_sampled
                        ? sample_gumbel(row, s.req.sampling, s.req.seed, uint64_t(s.num_output() + i))
                        : s.sampler.sample(row, s.req.sampling, s.prompt(), output);
  if (s.req.logprobs > 0) d.logprobs.push_back({t, logprob_of(raw, t), top_logprobs(raw, s.req.logprobs)});
  return advance(s, t, d) ? t : -1;
}

bool OutputProcessor::advance(Sequence& s, TokenId t, Drawn& d) const {
  if (!s.req.constraint || stop_reason(s, t) != FinishReason::None) return true;
  try {
    if (!s.req.constraint->accept(t)) {
      d.error = "the sampled token " + std::to_string(t) + " does not continue the request's grammar";  // a masking bug
      return false;
    }
    s.req.constraint->prefetch();  // the next mask, while the next forward pass runs
  } catch (const Error& e) {
    d.error = e.what();
    return false;
  }
  return true;
}

std::string OutputProcessor::allowed_tokens(const Sequence& s, int i, size_t vocab, std::span<uint64_t> words) const {
  KVLM_CHECK(words.size() * 64 >= vocab, "a token mask shorter than the vocabulary");
  const bool early = i < s.req.min_tokens;
  auto set = [&](TokenId t, bool on) {
    if (t < 0 || size_t(t) >= vocab) return;
    const uint64_t bit = uint64_t(1) << (t % 64);
    words[size_t(t) / 64] = on ? words[size_t(t) / 64] | bit : words[size_t(t) / 64] & ~bit;
  };
  const auto& c = s.req.constraint;
  // EOS and the stop tokens: allowed where the text may end, and never before min_tokens.
  const bool may_end = !early && (!c || c->can_end());
  if (c) {
    std::shared_ptr<const grammar::TokenMask> allowed;
    try {
      allowed = c->allowed();
    } catch (const Error& e) {
      return e.what();  // the grammar proved too ambiguous: this request fails, not the engine
    }
    const size_t n = std::min(words.size(), allowed->words.size());
    std::copy_n(allowed->words.begin(), n, words.begin());
    std::fill(words.begin() + ptrdiff_t(n), words.end(), uint64_t(0));
  } else {
    std::ranges::fill(words, ~uint64_t(0));
  }
  if (vocab % 64) words[vocab / 64] &= (uint64_t(1) << (vocab % 64)) - 1;  // nothing past the vocabulary
  std::fill(words.begin() + ptrdiff_t((vocab + 63) / 64), words.end(), uint64_t(0));
  if (!c || may_end) {  // (where a grammar cannot end, its bits stand: EOS has no text it could allow)
    if (!s.req.ignore_eos)
      for (TokenId e : eos_) set(e, may_end);
    for (TokenId e : s.req.stop_token_ids) set(e, may_end);
  }
  if (std::ranges::none_of(words, [](uint64_t w) { return w != 0; })) {
    if (!c) return "min_tokens leaves no token of the vocabulary to draw";
    return c->can_end() ? "min_tokens asks for more tokens than the request's grammar allows"
                        : "no token of the vocabulary continues the request's grammar (the model's tokens cannot spell "
                          "what it requires next)";
  }
  return {};
}

bool OutputProcessor::fill_mask(Sequence& s, int i, size_t vocab, std::span<uint64_t> words) const {
  if (s.req.constraint && !s.req.constraint->ready()) return false;
  return allowed_tokens(s, i, vocab, words).empty();
}

std::string OutputProcessor::masked_row(const Sequence& s, int output_index, std::span<const float> raw,
                                        std::vector<float>& out) const {
  out.assign(raw.begin(), raw.end());
  for (const auto& [t, bias] : s.req.logit_bias) out[size_t(t)] += bias;
  if (!s.req.constraint && output_index >= s.req.min_tokens) return {};  // nothing to mask
  std::vector<uint64_t> words((raw.size() + 63) / 64);
  if (std::string error = allowed_tokens(s, output_index, raw.size(), words); !error.empty()) return error;
  apply_token_mask(out, words);
  return {};
}

void OutputProcessor::draw(std::span<Sequence* const> seqs, const StepBatch& batch) {
  const int nb = int(seqs.size());
  drawn_.resize(seqs.size());
  may_defer_ = nb > 1;  // alone in its step, a late mask holds nobody else up
  std::vector<std::exception_ptr> failed(seqs.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(host_threads::team()) if (nb > 1)
  for (int i = 0; i < nb; ++i) {
    try {
      draw_one(*seqs[size_t(i)], batch, drawn_[size_t(i)]);
    } catch (...) {
      failed[size_t(i)] = std::current_exception();
    }
  }
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);  // a broken invariant: the engine stops (AsyncEngine reports it)
}

void OutputProcessor::close(Sequence& s, FinishReason why, Sequence::Clock::time_point now) {
  s.finished = true;
  scheduler_.release_pages(s);
  ++stats_.requests_finished_total[std::string(finish_reason_name(why))];
  stats_.e2e_request_latency.observe(seconds(now - s.arrival));
}

FinishReason OutputProcessor::stop_reason(const Sequence& s, TokenId t) const {
  const bool is_eos = std::ranges::find(eos_, t) != eos_.end();
  if ((!s.req.ignore_eos && is_eos) || std::ranges::find(s.req.stop_token_ids, t) != s.req.stop_token_ids.end())
    return FinishReason::Stop;
  return FinishReason::None;
}

std::vector<std::pair<Sequence*, RequestOutput>> OutputProcessor::apply(std::span<Sequence* const> seqs,
                                                                        const StepBatch& batch) {
  const auto now = Sequence::Clock::now();
  std::vector<std::pair<Sequence*, RequestOutput>> outputs;
  for (size_t i = 0; i < seqs.size(); ++i) {
    Sequence& s = *seqs[i];
    Drawn& d = drawn_[i];
    const int draft = int(s.draft.size());
    // The step computed its uncomputed tokens; of the draft rows, those accepted.
    const int accepted = std::max(0, int(d.tokens.size()) - 1);
    const int before = s.num_computed;
    s.num_computed += s.scheduled - draft + std::min(accepted, draft);
    // A hybrid model's recurrent state went through the rejected draft tokens too: it goes back
    // to the step's start, and the accepted tokens are computed again next step.
    if (draft > 0 && accepted < draft && scheduler_.rewinds_drafts()) scheduler_.rewind_draft(s, before);
    if (draft > 0) {
      ++stats_.spec_drafts_total;
      stats_.spec_draft_tokens_total += uint64_t(draft);
      stats_.spec_accepted_tokens_total += uint64_t(std::min(accepted, draft));
    }
    s.draft.clear();
    RequestOutput out;
    bool report = false;
    if (s.req.prompt_logits && s.prompt_rows > 0) {
      out.prompt_logits = batch.logits(s, 0, s.prompt_rows);
      out.prompt_logits_begin = s.prompt_row0;
      s.prompt_logits_sent = s.prompt_row0 + s.prompt_rows;
      report = true;
    }
    FinishReason why = FinishReason::None;
    const bool prompt_done = s.num_computed >= s.num_prompt;
    if (!d.error.empty()) {
      why = FinishReason::Error;
      out.error = std::move(d.error);
      report = true;
    } else if (d.deferred) {
      s.deferred = true;  // LLMEngine draws its token once the mask is ready
      ++stats_.grammar_deferred_tokens_total;
    } else if (s.sample_rows > 0) {
      why = emit(s, d, out, now);
      report = true;
    } else if (prompt_done && s.req.max_tokens == 0) {
      why = FinishReason::Length;  // scored the prompt; nothing to generate
      report = true;
    }
    if (draft > 0) scheduler_.trim_pages(s);
    scheduler_.advance_exact(s);
    scheduler_.register_full_pages(s);
    settle(s, why, report && (prompt_done || why != FinishReason::None), out, now);
    if (report) outputs.emplace_back(&s, std::move(out));
  }
  return outputs;
}

FinishReason OutputProcessor::emit(Sequence& s, Drawn& d, RequestOutput& out, Sequence::Clock::time_point now) {
  FinishReason why = FinishReason::None;
  for (size_t k = 0; k < d.tokens.size() && why == FinishReason::None; ++k) {
    const TokenId t = d.tokens[k];
    s.tokens.push_back(t);
    out.new_tokens.push_back(t);
    if (k < d.logprobs.size()) out.new_logprobs.push_back(std::move(d.logprobs[k]));
    why = stop_reason(s, t);
    if (why == FinishReason::None && s.req.constraint && s.req.constraint->terminated()) why = FinishReason::Stop;
    if (why == FinishReason::None && (s.num_output() >= s.req.max_tokens || int(s.tokens.size()) >= max_model_len_))
      why = FinishReason::Length;
  }
  stats_.generation_tokens_total += out.new_tokens.size();
  if (!s.first_token_sent) {
    s.first_token_sent = true;
    stats_.time_to_first_token.observe(seconds(now - s.arrival));
  } else {
    stats_.inter_token_latency.observe(seconds(now - s.last_token));
  }
  s.last_token = now;
  return why;
}

RequestOutput OutputProcessor::draw_deferred(Sequence& s) {
  KVLM_CHECK(s.deferred && !s.finished, "draw_deferred: the sequence has no token waiting");
  const std::vector<float> row = std::move(s.deferred_row);
  s.deferred_row = {};
  s.deferred = false;
  Drawn d;
  std::vector<TokenId> history;
  if (const TokenId t = draw_host(s, row, 0, d, history); t >= 0) d.tokens.push_back(t);
  const auto now = Sequence::Clock::now();
  RequestOutput out;
  FinishReason why;
  if (!d.error.empty()) {
    why = FinishReason::Error;
    out.error = std::move(d.error);
  } else {
    why = emit(s, d, out, now);
  }
  settle(s, why, true, out, now);  // the prompt is done: it was sampling
  return out;
}

void OutputProcessor::settle(Sequence& s, FinishReason why, bool prompt_logprobs_due, RequestOutput& out,
                             Sequence::Clock::time_point now) {
  if (prompt_logprobs_due && s.wants_prompt_logprobs()) {
    out.prompt_logprobs = std::move(s.prompt_lp);
    s.prompt_lp_sent = true;
  }
  if (why != FinishReason::None) {
    // The last token and the finish travel together.
    close(s, why, now);
    out.finished = true;
    out.finish_reason = why;
  }
}

}  // namespace kvlm

#include "serve/llm_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <exception>

#include "core/error.h"
#include "sampling/sampler.h"

namespace kvlm {

struct LLMEngine::Sequence {
  EngineRequest req;
  std::vector<TokenId> tokens;  // prompt, then generated tokens
  int num_prompt = 0;
  int num_computed = 0;         // leading tokens whose K/V is in the pages
  std::vector<BlockId> pages;
  std::vector<uint64_t> serials;  // prefix-cache serials of the leading registered pages
  int cached_prompt_tokens = 0;
  bool started = false;           // scheduled at least once (prompt tokens counted)
  bool first_token_sent = false;
  bool finished = false;
  std::vector<TokenLogprobs> prompt_lp;  // collected while prefilling, sent once
  bool prompt_lp_sent = false;
  Sampler sampler;
  Clock::time_point arrival, last_token;
  int scheduled = 0;   // tokens in this step
  int logit_row = -1;  // first logits row of this step, -1 = none
  int logit_count = 0;
  bool device_sampled = false;  // this step's token is drawn by the runner (forward_sampled)

  Sequence(EngineRequest r) : req(std::move(r)), sampler(req.seed) {}
  int num_output() const { return int(tokens.size()) - num_prompt; }
  std::span<const TokenId> prompt() const { return std::span(tokens).first(size_t(num_prompt)); }
  std::span<const TokenId> output() const { return std::span(tokens).subspan(size_t(num_prompt)); }
  bool wants_prompt_logprobs() const { return req.prompt_logprobs >= 0 && !prompt_lp_sent; }
  // Whether the next token can be drawn where the logits are: no penalties, no
  // log-probabilities, and no tokens to mask for min_tokens.
  bool device_samplable(bool has_eos) const {
    const bool masking = num_output() < req.min_tokens && ((!req.ignore_eos && has_eos) || !req.stop_token_ids.empty());
    return !req.sampling.has_penalties() && req.logprobs == 0 && !masking;
  }
};

namespace {

int pages_for(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }

double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

LLMEngine::LLMEngine(Engine& engine, SchedulerConfig cfg) : engine_(engine), cfg_(cfg) {
  const ModelConfig& mc = engine.config();
  if (cfg_.max_model_len <= 0) cfg_.max_model_len = mc.max_position_embeddings;
  if (cfg_.max_model_len > mc.max_position_embeddings)
    throw Error("--max-model-len " + std::to_string(cfg_.max_model_len) + " exceeds the model's context length of " +
                std::to_string(mc.max_position_embeddings) + " tokens (max_position_embeddings)");
  if (cfg_.max_num_seqs < 1) throw Error("--max-num-seqs must be at least 1");
  if (cfg_.max_num_batched_tokens < 1) throw Error("--max-num-batched-tokens must be at least 1");
  const int bs = engine.block_size();
  if (int64_t(cfg_.num_blocks) * bs < cfg_.max_model_len)
    throw Error("the KV pool holds " + std::to_string(int64_t(cfg_.num_blocks) * bs) +
                " tokens, fewer than one request of --max-model-len " + std::to_string(cfg_.max_model_len) +
                " tokens; give the cache more memory or lower --max-model-len");
  engine.model().allocate_kv(cfg_.num_blocks, bs);
  blocks_ = std::make_unique<BlockManager>(cfg_.num_blocks, bs, cfg_.enable_prefix_caching);
  eos_ = mc.eos_token_ids;
}

LLMEngine::~LLMEngine() = default;

void LLMEngine::check_request(const EngineRequest& req) const {
  const ModelConfig& mc = engine_.config();
  if (req.id.empty()) throw Error("a request needs an id");
  if (req.prompt.empty()) throw Error("the prompt is empty; give at least one token");
  for (TokenId t : req.prompt)
    if (t < 0 || t >= mc.vocab_size)
      throw Error("prompt token id " + std::to_string(t) + " is outside the model's vocabulary (0.." +
                  std::to_string(mc.vocab_size - 1) + ")");
  for (TokenId t : req.stop_token_ids)
    if (t < 0 || t >= mc.vocab_size)
      throw Error("stop token id " + std::to_string(t) + " is outside the model's vocabulary");
  if (req.max_tokens < 1) throw Error("max_tokens must be at least 1, got " + std::to_string(req.max_tokens));
  if (req.min_tokens < 0 || req.min_tokens > req.max_tokens)
    throw Error("min_tokens must be between 0 and max_tokens, got " + std::to_string(req.min_tokens));
  if (req.logprobs < 0 || req.logprobs > mc.vocab_size)
    throw Error("logprobs must be between 0 and the vocabulary size " + std::to_string(mc.vocab_size));
  if (req.prompt_logprobs < -1 || req.prompt_logprobs > mc.vocab_size)
    throw Error("prompt_logprobs must be between 0 and the vocabulary size " + std::to_string(mc.vocab_size));
  const int64_t prompt = int64_t(req.prompt.size());
  if (prompt >= cfg_.max_model_len)
    throw Error("the prompt has " + std::to_string(prompt) + " tokens; this server's maximum context length is " +
                std::to_string(cfg_.max_model_len) + " tokens (--max-model-len), prompt and output together");
  if (prompt + req.max_tokens > cfg_.max_model_len)
    throw Error("the prompt (" + std::to_string(prompt) + " tokens) plus max_tokens " + std::to_string(req.max_tokens) +
                " exceeds the maximum context length of " + std::to_string(cfg_.max_model_len) +
                " tokens; lower max_tokens to at most " + std::to_string(cfg_.max_model_len - prompt));
  validate_sampling(req.sampling);
}

void LLMEngine::add_request(EngineRequest req) {
  check_request(req);
  if (live_.count(req.id)) throw Error("request id '" + req.id + "' is already in use");
  auto s = std::make_unique<Sequence>(std::move(req));
  s->tokens = s->req.prompt;
  s->num_prompt = int(s->tokens.size());
  s->arrival = Clock::now();
  live_[s->req.id] = s.get();
  ++stats_.requests_total;
  waiting_.push_back(std::move(s));
}

void LLMEngine::abort(const std::string& id) {
  if (live_.count(id)) aborts_.push_back(id);
}

bool LLMEngine::ensure_pages(Sequence& s, int tokens) {
  const int need = pages_for(tokens, blocks_->block_size()) - int(s.pages.size());
  if (need <= 0) return true;
  if (need > blocks_->num_free()) return false;
  for (int i = 0; i < need; ++i) {
    auto b = blocks_->allocate();
    KVLM_CHECK(b.has_value(), "free page count and allocation disagree");
    s.pages.push_back(*b);
  }
  return true;
}

void LLMEngine::release_pages(Sequence& s) {
  // Last pages first, so a sequence's tail is evicted before its (more shareable) head.
  for (auto it = s.pages.rbegin(); it != s.pages.rend(); ++it) blocks_->release(*it);
  s.pages.clear();
  s.serials.clear();
  s.num_computed = 0;
}

// A sequence about to be scheduled for the first time (or again after preemption) takes
// the pages the prefix cache holds for its leading tokens.
void LLMEngine::admit_prefix(Sequence& s) {
  if (!blocks_->prefix_caching() || s.wants_prompt_logprobs() || !s.pages.empty()) return;
  const int bs = blocks_->block_size();
  const int found = blocks_->match_prefix(s.tokens, s.pages, s.serials);
  if (found == 0) return;
  int computed = found * bs;
  const int total = int(s.tokens.size());
  if (computed >= total) {
    // Every token is cached, but the last one must run to give the next token's logits and
    // will write its K/V into the last page, which other sequences share: copy that page
    // first (copy-on-write) and recompute only the last token into the copy.
    if (auto fresh = blocks_->allocate()) {
      const std::pair<BlockId, BlockId> cow{s.pages.back(), *fresh};
      engine_.model().copy_blocks({&cow, 1});
      blocks_->release(s.pages.back());
      s.pages.back() = *fresh;
    } else {  // no page to copy into: recompute the whole last page instead
      blocks_->release(s.pages.back());
      s.pages.pop_back();
    }
    s.serials.pop_back();
    computed = std::min(total - 1, int(s.pages.size()) * bs);
  }
  s.num_computed = computed;
  if (!s.started) s.cached_prompt_tokens = std::min(computed, s.num_prompt);
}

void LLMEngine::preempt(Sequence& s) {
  release_pages(s);
  if (!s.prompt_lp_sent) s.prompt_lp.clear();
  ++stats_.preemptions_total;
}

void LLMEngine::register_full_pages(Sequence& s) {
  if (!blocks_->prefix_caching()) return;
  const int bs = blocks_->block_size();
  const int full = s.num_computed / bs;
  for (int i = int(s.serials.size()); i < full; ++i) {
    const uint64_t parent = i == 0 ? 0 : s.serials[size_t(i - 1)];
    s.serials.push_back(
        blocks_->register_full(s.pages[size_t(i)], parent, std::span(s.tokens).subspan(size_t(i) * size_t(bs), size_t(bs))));
  }
}

bool LLMEngine::deliver(Sequence& s, RequestOutput& out) {
  out.id = s.req.id;
  out.prompt_tokens = s.num_prompt;
  out.completion_tokens = s.num_output();
  out.cached_prompt_tokens = s.cached_prompt_tokens;
  if (!s.req.on_output) return true;
  try {
    return s.req.on_output(out);
  } catch (...) {
    return false;  // a failing consumer stops its own request, never the engine
  }
}

void LLMEngine::publish() {
  if (listener_) listener_(stats());
}

void LLMEngine::finish(Sequence& s, FinishReason why, const std::string& error) {
  if (s.finished) return;
  s.finished = true;
  release_pages(s);
  ++stats_.requests_finished_total[std::string(finish_reason_name(why))];
  stats_.e2e_request_latency.observe(seconds(Clock::now() - s.arrival));
  live_.erase(s.req.id);
  publish();
  RequestOutput out;
  out.finished = true;
  out.finish_reason = why;
  out.error = error;
  deliver(s, out);
}

bool LLMEngine::step() {
  const auto t_step = Clock::now();
  // Aborts first: their pages are free for this step.
  for (const auto& id : aborts_) {
    auto it = live_.find(id);
    if (it != live_.end()) finish(*it->second, FinishReason::Abort);
  }
  aborts_.clear();
  auto gone = [](const std::unique_ptr<Sequence>& s) { return s->finished; };
  std::erase_if(running_, gone);
  std::erase_if(waiting_, gone);
  if (running_.empty() && waiting_.empty()) return false;

  // --- schedule ----------------------------------------------------------------------
  int budget = cfg_.max_num_batched_tokens;
  std::vector<Sequence*> batch;
  bool preempted = false;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Sequence& s = *running_[i];
    const int n = std::min(int(s.tokens.size()) - s.num_computed, budget);
    bool dropped = false;
    while (!ensure_pages(s, s.num_computed + n)) {
      // Preempt the newest running sequence (possibly this one) and retry.
      std::unique_ptr<Sequence> victim = std::move(running_.back());
      running_.pop_back();
      preempt(*victim);
      preempted = true;
      const bool self = victim.get() == &s;
      waiting_.push_front(std::move(victim));
      if (self) {
        dropped = true;
        break;
      }
    }
    if (dropped) break;  // it was the newest: nothing after it to schedule
    s.scheduled = n;
    budget -= n;
    batch.push_back(&s);
    ++i;
  }
  while (!preempted && budget > 0 && !waiting_.empty() && int(running_.size()) < cfg_.max_num_seqs) {
    Sequence& s = *waiting_.front();
    admit_prefix(s);
    const int n = std::min(int(s.tokens.size()) - s.num_computed, budget);
    if (!ensure_pages(s, s.num_computed + n)) {
      release_pages(s);  // do not sit on cached pages while waiting (they stay cached)
      break;             // first come, first served: nobody overtakes the head
    }
    if (!s.started) {
      s.started = true;
      stats_.prompt_tokens_total += uint64_t(s.num_prompt - s.cached_prompt_tokens);
      stats_.prefix_cache_queries_total += uint64_t(s.num_prompt);
      stats_.prefix_cache_hits_total += uint64_t(s.cached_prompt_tokens);
    }
    s.scheduled = n;
    budget -= n;
    batch.push_back(&s);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  if (batch.empty()) return !waiting_.empty() || !running_.empty();

  // --- lay out the batch -------------------------------------------------------------
  const int bs = blocks_->block_size();
  const bool device_sampling = engine_.model().samples_on_device();
  int num_host_rows = 0;
  tokens_.clear();
  positions_.clear();
  slots_.clear();
  attn_.clear();
  logit_rows_.clear();
  row_sampling_.clear();
  host_row_.clear();
  for (Sequence* s : batch) {
    const int q0 = int(tokens_.size());
    const int end = s->num_computed + s->scheduled;
    for (int p = s->num_computed; p < end; ++p) {
      tokens_.push_back(s->tokens[size_t(p)]);
      positions_.push_back(Position(p));
      slots_.push_back(SlotId(s->pages[size_t(p / bs)]) * bs + p % bs);
    }
    attn_.push_back(AttnSeq{.q_begin = q0, .q_len = s->scheduled, .kv_len = end, .block_table = s->pages});
    s->logit_row = int(logit_rows_.size());
    s->logit_count = 0;
    if (s->wants_prompt_logprobs()) {
      // Row p predicts token p + 1: every prompt row that has a next prompt token.
      for (int p = s->num_computed; p < std::min(end, s->num_prompt - 1); ++p, ++s->logit_count)
        logit_rows_.push_back(q0 + p - s->num_computed);
    }
    if (end == int(s->tokens.size()) && (s->logit_count == 0 || logit_rows_.back() != q0 + s->scheduled - 1)) {
      logit_rows_.push_back(q0 + s->scheduled - 1);
      ++s->logit_count;
    }
    if (s->logit_count == 0) s->logit_row = -1;
    // The row that draws the next token may be sampled by the runner, unless its logits are
    // needed here (prompt log-probabilities share the row, penalties, logprobs, min_tokens).
    s->device_sampled = device_sampling && end == int(s->tokens.size()) && !s->wants_prompt_logprobs() &&
                        s->device_samplable(!eos_.empty());
    for (int r = 0; r < s->logit_count; ++r) {
      RowSampling rs;
      if (s->device_sampled) {
        rs = RowSampling{.on_device = true, .params = s->req.sampling, .seed = s->req.seed,
                         .counter = uint64_t(s->num_output())};
      }
      host_row_.push_back(rs.on_device ? -1 : num_host_rows++);
      row_sampling_.push_back(rs);
    }
  }
  const size_t vocab = size_t(engine_.config().vocab_size);
  logits_.resize(size_t(num_host_rows) * vocab);
  device_tokens_.assign(logit_rows_.size(), -1);
  const auto t_forward = Clock::now();
  stats_.schedule_seconds_total += seconds(t_forward - t_step);
  try {
    const ForwardBatch fb{.tokens = tokens_, .positions = positions_, .slots = slots_, .seqs = attn_,
                          .logit_rows = logit_rows_};
    if (device_sampling) engine_.model().forward_sampled(fb, row_sampling_, device_tokens_, logits_);
    else engine_.model().forward(fb, logits_);
  } catch (const std::exception& e) {
    // The step failed as a whole: its sequences fail with the reason, the rest go on.
    for (Sequence* s : batch) finish(*s, FinishReason::Error, e.what());
    std::erase_if(running_, gone);
    ++stats_.steps_total;
    return true;
  }
  ++stats_.steps_total;
  const auto t_sample = Clock::now();
  stats_.forward_seconds_total += seconds(t_sample - t_forward);

  // --- sample and report -------------------------------------------------------------
  // Sampling and log-probabilities (a pass over the vocabulary per row) run in parallel
  // over the sequences: each has its own generator, so the result does not depend on the
  // thread count. Bookkeeping, the block manager and the callbacks stay on this thread.
  const auto now = Clock::now();
  const int nb = int(batch.size());
  std::vector<TokenId> sampled(batch.size(), -1);
  std::vector<std::optional<TokenLogprobs>> sampled_lp(batch.size());
  std::vector<std::exception_ptr> failed(batch.size());
#pragma omp parallel for schedule(dynamic, 1) if (nb > 1)
  for (int i = 0; i < nb; ++i) {
    Sequence* s = batch[size_t(i)];
    if (s->logit_row < 0) continue;
    try {
      const int start = s->num_computed, end = start + s->scheduled;
      auto row = [&](int r) {
        const int h = host_row_[size_t(s->logit_row + r)];
        KVLM_CHECK(h >= 0, "the logits of a row sampled by the runner were used");
        return std::span<const float>(logits_).subspan(size_t(h) * vocab, vocab);
      };
      if (s->wants_prompt_logprobs()) {
        const int k = s->req.prompt_logprobs;
        int used = 0;
        for (int p = start; p < std::min(end, s->num_prompt - 1); ++p, ++used) {
          const TokenId next = s->tokens[size_t(p + 1)];
          s->prompt_lp.push_back({next, logprob_of(row(used), next), top_logprobs(row(used), k)});
        }
      }
      if (end < int(s->tokens.size())) continue;  // prefill chunk, not yet done
      if (s->device_sampled) {
        sampled[size_t(i)] = device_tokens_[size_t(s->logit_row + s->logit_count - 1)];
        continue;
      }
      std::span<const float> last = row(s->logit_count - 1);
      std::vector<float> masked;
      if (s->num_output() < s->req.min_tokens) {
        // Too early to stop: EOS and stop tokens cannot be sampled.
        masked.assign(last.begin(), last.end());
        if (!s->req.ignore_eos)
          for (TokenId t : eos_) masked[size_t(t)] = -std::numeric_limits<float>::infinity();
        for (TokenId t : s->req.stop_token_ids) masked[size_t(t)] = -std::numeric_limits<float>::infinity();
        last = masked;
      }
      const TokenId t = s->sampler.sample(last, s->req.sampling, s->prompt(), s->output());
      sampled[size_t(i)] = t;
      if (s->req.logprobs > 0) {
        const auto raw = row(s->logit_count - 1);
        sampled_lp[size_t(i)] = TokenLogprobs{t, logprob_of(raw, t), top_logprobs(raw, s->req.logprobs)};
      }
    } catch (...) {
      failed[size_t(i)] = std::current_exception();
    }
  }
  for (const auto& e : failed)
    if (e) std::rethrow_exception(e);  // a broken invariant: the engine stops (AsyncEngine reports it)
  stats_.sample_seconds_total += seconds(Clock::now() - t_sample);

  std::vector<std::pair<Sequence*, RequestOutput>> outputs;
  for (int i = 0; i < nb; ++i) {
    Sequence* s = batch[size_t(i)];
    s->num_computed += s->scheduled;
    register_full_pages(*s);
    if (s->logit_row < 0 || s->num_computed < int(s->tokens.size())) continue;
    RequestOutput out;
    if (s->wants_prompt_logprobs()) {
      out.prompt_logprobs = std::move(s->prompt_lp);
      s->prompt_lp_sent = true;
    }
    const TokenId t = sampled[size_t(i)];
    KVLM_CHECK(t >= 0, "a finished row was not sampled");
    s->tokens.push_back(t);
    out.new_tokens.push_back(t);
    if (sampled_lp[size_t(i)]) out.new_logprobs.push_back(std::move(*sampled_lp[size_t(i)]));
    ++stats_.generation_tokens_total;
    if (!s->first_token_sent) {
      s->first_token_sent = true;
      stats_.time_to_first_token.observe(seconds(now - s->arrival));
    } else {
      stats_.inter_token_latency.observe(seconds(now - s->last_token));
    }
    s->last_token = now;
    FinishReason why = FinishReason::None;
    const bool is_eos = std::ranges::find(eos_, t) != eos_.end();
    if ((!s->req.ignore_eos && is_eos) || std::ranges::find(s->req.stop_token_ids, t) != s->req.stop_token_ids.end())
      why = FinishReason::Stop;
    else if (s->num_output() >= s->req.max_tokens || int(s->tokens.size()) >= cfg_.max_model_len)
      why = FinishReason::Length;
    if (why != FinishReason::None) {
      // The last token and the finish travel together.
      s->finished = true;
      out.finished = true;
      out.finish_reason = why;
      release_pages(*s);
      ++stats_.requests_finished_total[std::string(finish_reason_name(why))];
      stats_.e2e_request_latency.observe(seconds(now - s->arrival));
      live_.erase(s->req.id);
    }
    outputs.emplace_back(s, std::move(out));
  }
  publish();
  bool recount = false;
  for (auto& [s, out] : outputs) {
    if (deliver(*s, out)) continue;
    // The consumer matched a stop string in this token's text.
    if (!out.finished) {
      finish(*s, FinishReason::Stop);
    } else if (out.finish_reason == FinishReason::Length) {
      // The request ended here anyway, but the client is told "stop": count it as that.
      --stats_.requests_finished_total["length"];
      ++stats_.requests_finished_total["stop"];
      recount = true;
    }
  }
  if (recount) publish();
  std::erase_if(running_, gone);
  return true;
}

EngineStats LLMEngine::stats() const {
  EngineStats st = stats_;
  auto live = [](const auto& q) { return int(std::ranges::count_if(q, [](const auto& s) { return !s->finished; })); };
  st.num_running = live(running_);
  st.num_waiting = live(waiting_);
  st.num_blocks = blocks_->num_blocks();
  st.num_free_blocks = blocks_->num_free();
  st.kv_usage = double(blocks_->num_used()) / double(blocks_->num_blocks());
  return st;
}

}  // namespace kvlm

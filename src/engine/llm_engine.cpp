#include "engine/llm_engine.h"

#include <algorithm>
#include <cmath>
#include <chrono>
#include <exception>

#include "core/error.h"
#include "core/log.h"
#include "core/units.h"
#include "engine/dflash_proposer.h"
#include "engine/memory_plan.h"
#include "engine/ngram_proposer.h"
#include "sampling/sampler.h"

namespace kvlm {

namespace {

SchedulerConfig checked(SchedulerConfig cfg, const LoadedModel& model) {
  const ModelConfig& mc = model.config();
  if (cfg.max_model_len <= 0) cfg.max_model_len = mc.max_position_embeddings;
  if (cfg.max_model_len > mc.max_position_embeddings)
    throw Error("--max-model-len " + std::to_string(cfg.max_model_len) + " exceeds the model's context length of " +
                std::to_string(mc.max_position_embeddings) + " tokens (max_position_embeddings)");
  if (cfg.max_num_seqs < 1) throw Error("--max-num-seqs must be at least 1");
  if (cfg.max_num_batched_tokens < 1) throw Error("--max-num-batched-tokens must be at least 1");
  // A prefix-cache hit skips the rows that build a Gated DeltaNet layer's state: a hybrid model
  // resumes from the state snapshots the scheduler keeps, and without any, computes everything.
  cfg.draft_states = mc.linear_attention && model.speculative() ? cfg.max_num_seqs : 0;
  if (!mc.linear_attention || !cfg.enable_prefix_caching) cfg.state_snapshots = 0;
  else if (cfg.state_snapshots < 0) cfg.state_snapshots = cfg.max_num_seqs;
  if (mc.linear_attention && cfg.enable_prefix_caching && cfg.state_snapshots == 0) {
    cfg.enable_prefix_caching = false;
    log::warn("prefix caching is off: no state snapshots were given for " + std::string(arch_name(mc.arch)) +
              "'s Gated DeltaNet layers, which a cache hit must resume from");
  }
  if (cfg.kv_offload_pages > 0) cfg.kv_identity = model.kv_identity();
  const KVPlan& plan = model.plan();
  cfg.keep_sink = plan.keep_sink();
  cfg.keep_recent = plan.keep_recent();
  cfg.num_exact_pages = exact_pages_needed(plan, model.block_size(), cfg.max_num_seqs, cfg.max_num_batched_tokens);
  if (int64_t(cfg.num_blocks) * model.block_size() < cfg.max_model_len)
    throw Error("the KV pool holds " + std::to_string(int64_t(cfg.num_blocks) * model.block_size()) +
                " tokens, fewer than one request of --max-model-len " + std::to_string(cfg.max_model_len) +
                " tokens; give the cache more memory or lower --max-model-len");
  return cfg;
}

}  // namespace

LLMEngine::LLMEngine(LoadedModel& model, SchedulerConfig cfg)
    : model_(model),
      cfg_(checked(cfg, model)),
      scheduler_(cfg_, model.block_size(), model.model(), stats_),
      outputs_(model.config().eos_token_ids, cfg_.max_model_len, scheduler_, stats_) {
  model.model().allocate_kv(cfg_.num_blocks, model.block_size(), cfg_.num_exact_pages);
  model.model().allocate_states(cfg_.max_num_seqs + cfg_.state_snapshots + cfg_.draft_states);
  if (const auto& spec = model.speculative(); spec && spec->method == SpecMethod::Ngram) {
    proposer_ = std::make_unique<NgramProposer>(spec->num_speculative_tokens, spec->prompt_lookup_min,
                                                spec->prompt_lookup_max);
  } else if (spec && spec->method == SpecMethod::DFlash) {
    const auto& d = model.drafter_config();
    KVLM_CHECK(d && d->dflash && model.model().has_drafter(), "a dflash speculative config without a loaded drafter");
    proposer_ = std::make_unique<DFlashProposer>(model.model(), scheduler_.blocks(), d->dflash->block_size,
                                                 d->dflash->mask_token_id, spec->num_speculative_tokens);
  }
  if (const auto& spec = model.speculative()) draft_max_running_ = spec->disable_by_batch_size;
}

LLMEngine::~LLMEngine() = default;

void LLMEngine::check_request(const EngineRequest& req) const {
  const ModelConfig& mc = model_.config();
  if (req.id.empty()) throw Error("a request needs an id");
  if (req.prompt.empty()) throw Error("the prompt is empty; give at least one token");
  for (TokenId t : req.prompt)
    if (t < 0 || t >= mc.vocab_size)
      throw Error("prompt token id " + std::to_string(t) + " is outside the model's vocabulary (0.." +
                  std::to_string(mc.vocab_size - 1) + ")");
  for (TokenId t : req.stop_token_ids)
    if (t < 0 || t >= mc.vocab_size)
      throw Error("stop token id " + std::to_string(t) + " is outside the model's vocabulary");
  if (req.max_tokens < 0) throw Error("max_tokens must not be negative, got " + std::to_string(req.max_tokens));
  if (model_.model().pooling() && (req.max_tokens > 0 || !req.prompt_logits || req.prompt_logprobs >= 0))
    throw Error("this model runs as an embedding model (--runner pooling): it pools prompts into vectors "
                "(/v1/embeddings) and does not generate; pass --runner generate to generate text with it");
  if (req.min_tokens < 0 || req.min_tokens > req.max_tokens)
    throw Error("min_tokens must be between 0 and max_tokens, got " + std::to_string(req.min_tokens));
  if (req.logprobs < 0 || req.logprobs > mc.vocab_size)
    throw Error("logprobs must be between 0 and the vocabulary size " + std::to_string(mc.vocab_size));
  if (req.prompt_logprobs < -1 || req.prompt_logprobs > mc.vocab_size)
    throw Error("prompt_logprobs must be between 0 and the vocabulary size " + std::to_string(mc.vocab_size));
  const int64_t prompt = int64_t(req.prompt.size());
  if (req.max_tokens == 0 && prompt > cfg_.max_model_len)
    throw Error("the prompt has " + std::to_string(prompt) + " tokens; the maximum context length is " +
                std::to_string(cfg_.max_model_len) + " tokens (--max-model-len)");
  if (req.max_tokens > 0 && prompt >= cfg_.max_model_len)
    throw Error("the prompt has " + std::to_string(prompt) + " tokens; this server's maximum context length is " +
                std::to_string(cfg_.max_model_len) + " tokens (--max-model-len), prompt and output together");
  if (prompt + req.max_tokens > cfg_.max_model_len)
    throw Error("the prompt (" + std::to_string(prompt) + " tokens) plus max_tokens " + std::to_string(req.max_tokens) +
                " exceeds the maximum context length of " + std::to_string(cfg_.max_model_len) +
                " tokens; lower max_tokens to at most " + std::to_string(cfg_.max_model_len - prompt));
  validate_sampling(req.sampling);
  for (const auto& [t, bias] : req.logit_bias)
    if (t < 0 || t >= model_.config().vocab_size || !std::isfinite(bias))
      throw Error("logit_bias names token " + std::to_string(t) + ", outside the vocabulary, or a bias that is not finite");
  if (req.constraint && req.constraint->vocab_size() > model_.config().vocab_size)
    throw Error("the grammar's vocabulary is larger than the model's");
}

void LLMEngine::add_request(EngineRequest req) {
  check_request(req);
  if (live_.count(req.id)) throw Error("request id '" + req.id + "' is already in use");
  if (req.constraint) req.constraint->prefetch();  // the first mask, while the prompt is prefilled
  auto s = std::make_unique<Sequence>(std::move(req));
  s->tokens = s->req.prompt;
  s->num_prompt = int(s->tokens.size());
  s->arrival = Sequence::Clock::now();
  if (live_.empty()) stats_.peak_running = 0;  // a new busy period
  live_[s->req.id] = s.get();
  ++stats_.requests_total;
  scheduler_.add(std::move(s));
}

void LLMEngine::abort(const std::string& id) {
  if (live_.count(id)) aborts_.push_back(id);
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
  outputs_.close(s, why, Sequence::Clock::now());
  live_.erase(s.req.id);
  publish();
  RequestOutput out;
  out.finished = true;
  out.finish_reason = why;
  out.error = error;
  deliver(s, out);
}

bool LLMEngine::step() {
  using Clock = Sequence::Clock;
  const auto t_step = Clock::now();
  // Aborts first: their pages are free for this step.
  for (const auto& id : aborts_) {
    auto it = live_.find(id);
    if (it != live_.end()) finish(*it->second, FinishReason::Abort);
  }
  aborts_.clear();
  scheduler_.drop_finished();
  if (scheduler_.empty()) return false;
  draw_deferred(false);
  if (scheduler_.empty()) return true;

  if (proposer_) {
    const auto t_draft = Clock::now();
    propose();
    const double d = seconds(Clock::now() - t_draft);
    stats_.draft_seconds_total += d;
    stats_.schedule_seconds_total -= d;  // counted once, as drafting
  }
  const std::vector<Sequence*> seqs = scheduler_.schedule();
  if (seqs.empty()) return draw_deferred(true) || !scheduler_.empty();
  stats_.peak_running = std::max(stats_.peak_running, scheduler_.num_running());
  const ModelRunner& runner = model_.model();
  batch_.build(seqs, model_.block_size(), runner.samples_on_device() && !runner.pooling(), outputs_.has_eos(),
               size_t(runner.output_width()), scheduler_.blocks().exact_map());
  const auto t_forward = Clock::now();
  stats_.schedule_seconds_total += seconds(t_forward - t_step);
  try {
    scheduler_.save_draft_states(seqs);  // hybrid models: what a rejected draft rolls back to
    const size_t vocab = size_t(model_.config().vocab_size);
    batch_.run(model_.model(),
               [&](Sequence& s, int i, std::span<uint64_t> words) { return outputs_.fill_mask(s, i, vocab, words); });
  } catch (const std::exception& e) {
    // The step failed as a whole: its sequences fail with the reason, the rest go on.
    for (Sequence* s : seqs) {
      s->draft.clear();
      finish(*s, FinishReason::Error, e.what());
    }
    scheduler_.drop_finished();
    ++stats_.steps_total;
    // A runner that cannot run any more (a tensor-parallel node died) stops the engine.
    if (const std::string b = model_.model().broken(); !b.empty()) throw Error("the model cannot run any more: " + b);
    return true;
  }
  ++stats_.steps_total;
  stats_.grammar_late_masks_total += uint64_t(batch_.late_masks());
  const auto t_sample = Clock::now();
  stats_.forward_seconds_total += seconds(t_sample - t_forward);
  // What recomputing costs: a step mostly of prompt rows, less the page copies it waited for
  // (issued by schedule(), which read the copy times as it began; completed inside the forward).
  if (scheduler_.host_tier()) {
    int prompt_rows = 0;
    for (const Sequence* s : seqs)
      if (s->scheduled > 1 + int(s->draft.size())) prompt_rows += s->scheduled;
    if (2 * prompt_rows >= batch_.num_rows()) {
      const ModelRunner::PageCopyTimes& copies0 = scheduler_.copy_times();
      const ModelRunner::PageCopyTimes copies1 = model_.model().page_copy_times();
      const double copies = copies1.load_seconds + copies1.save_seconds - copies0.load_seconds - copies0.save_seconds;
      scheduler_.note_step(seconds(t_sample - t_forward) - copies, batch_.num_rows());
    }
  }

  outputs_.draw(seqs, batch_);
  stats_.sample_seconds_total += seconds(Clock::now() - t_sample);
  deliver_all(outputs_.apply(seqs, batch_));
  return true;
}

void LLMEngine::deliver_all(std::vector<std::pair<Sequence*, RequestOutput>> outputs) {
  for (auto& [s, out] : outputs)
    if (out.finished) live_.erase(s->req.id);
  publish();
  bool recount = false;
  for (auto& [s, out] : outputs) {
    if (deliver(*s, out)) continue;
    // The consumer matched a stop string in this step's text.
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
  scheduler_.drop_finished();
}

// Constrained sequences whose grammar mask was not ready when their step ended sat it out;
// their tokens are drawn once the mask is there. `wait`: nothing else can run, so wait for
// the first of them. Returns whether a token was drawn.
bool LLMEngine::draw_deferred(bool wait) {
  using Clock = Sequence::Clock;
  std::vector<Sequence*> deferred, ready;
  for (const auto& s : scheduler_.running())
    if (s->deferred && !s->finished) {
      deferred.push_back(s.get());
      if (s->req.constraint->ready()) ready.push_back(s.get());
    }
  const auto t0 = Clock::now();
  if (ready.empty() && wait && !deferred.empty()) {
    deferred.front()->req.constraint->wait();
    ready.push_back(deferred.front());
  }
  if (ready.empty()) return false;
  std::vector<std::pair<Sequence*, RequestOutput>> outputs;
  for (Sequence* s : ready) outputs.emplace_back(s, outputs_.draw_deferred(*s));
  const double t = seconds(Clock::now() - t0);
  stats_.sample_seconds_total += t;
  stats_.schedule_seconds_total -= t;  // inside the step's scheduling time: counted once
  deliver_all(std::move(outputs));
  return true;
}

// Drafts for the running sequences that decode (every token but the last computed), no
// longer than what the request may still generate and the context may still hold.
void LLMEngine::propose() {
  decoding_.clear();
  max_draft_.clear();
  const bool paused = draft_max_running_ > 0 && scheduler_.num_running() > draft_max_running_;
  for (const auto& sp : scheduler_.running()) {
    Sequence& s = *sp;
    s.draft.clear();
    if (paused) continue;
    if (s.finished || s.num_computed != int(s.tokens.size()) - 1) continue;
    if (s.req.constraint) continue;  // a grammar decides token by token: no drafts to verify
    const int room = std::min(s.req.max_tokens - s.num_output(), cfg_.max_model_len - int(s.tokens.size())) - 1;
    if (room <= 0) continue;
    if (const int ahead = proposer_->lookahead(); ahead > 0) {
      const int end = int(s.tokens.size()) + ahead;  // the last token's position + ahead, exclusive
      if (end > cfg_.max_model_len || !scheduler_.reserve(s, end)) continue;
    }
    decoding_.push_back(&s);
    max_draft_.push_back(room);
  }
  if (decoding_.empty()) return;
  proposer_->propose(decoding_, max_draft_);
  for (size_t i = 0; i < decoding_.size(); ++i) {
    Sequence& s = *decoding_[i];
    KVLM_CHECK(int(s.draft.size()) <= max_draft_[i], "the proposer drafted more tokens than allowed");
    for (TokenId t : s.draft)
      KVLM_CHECK(t >= 0 && t < model_.config().vocab_size, "the proposer drafted a token outside the vocabulary");
  }
}

EngineStats LLMEngine::stats() const {
  EngineStats st = stats_;
  st.num_running = scheduler_.num_running();
  st.num_waiting = scheduler_.num_waiting();
  st.num_restoring = scheduler_.num_restoring();
  const BlockManager& b = scheduler_.blocks();
  st.num_blocks = b.num_blocks();
  st.num_free_blocks = b.num_free();
  st.kv_usage = double(b.num_used()) / double(b.num_blocks());
  if (const HostKVTier* t = scheduler_.host_tier()) {
    st.kv_offload_pages = int(t->size());
    st.kv_offload_capacity = int(t->capacity());
    st.kv_offload_stored_bytes_total = t->pages_kept() * t->page_bytes();
    st.kv_offload_restored_bytes_total = t->pages_restored() * t->page_bytes();
    const ModelRunner::PageCopyTimes times = model_.model().page_copy_times();
    st.kv_offload_store_seconds_total = times.save_seconds;
    st.kv_offload_restore_seconds_total = times.load_seconds;
    st.kv_offload_stored_total = t->pages_kept();
    st.kv_offload_restored_total = t->pages_restored();
    st.kv_offload_evictions_total = t->evictions();
    st.kv_offload_hit_tokens_total = b.lower_tier_hits();
    const TierCosts& costs = scheduler_.tier_costs();
    st.kv_offload_recompute_page_seconds = costs.recompute_per_page().value_or(0);
    st.kv_offload_restore_page_seconds = costs.restore_per_page(TierCosts::Tier::Host).value_or(0);
    st.kv_offload_disk_page_seconds = costs.restore_per_page(TierCosts::Tier::Disk).value_or(0);
    st.kv_offload_host_in_use = scheduler_.tiers_in_use().host;
    st.kv_offload_disk_in_use = scheduler_.tiers_in_use().disk;
    if (const HostKVTier* x = scheduler_.exact_tier()) {
      st.kv_offload_exact_pages = int(x->size());
      st.kv_offload_exact_capacity = int(x->capacity());
      st.kv_offload_exact_stored_total = x->pages_kept();
      st.kv_offload_exact_restored_total = x->pages_restored();
      st.kv_offload_stored_bytes_total += x->pages_kept() * x->page_bytes();
      st.kv_offload_restored_bytes_total += x->pages_restored() * x->page_bytes();
      if (const DiskKVTier* d = x->disk()) {
        st.kv_offload_exact_disk_pages = int(d->size());
        st.kv_offload_exact_disk_written_total = d->pages_written();
        st.kv_offload_exact_disk_read_total = d->pages_read();
        st.kv_offload_exact_disk_damaged_total = d->damaged();
      }
    }
    if (const DiskKVTier* d = t->disk()) {
      st.kv_offload_disk_pages = int(d->size());
      st.kv_offload_disk_capacity = int(d->capacity());
      st.kv_offload_disk_written_total = d->pages_written();
      st.kv_offload_disk_read_total = d->pages_read();
      st.kv_offload_disk_evictions_total = d->evictions();
      st.kv_offload_disk_damaged_total = d->damaged();
      st.kv_offload_disk_bytes_per_page = d->file_bytes();
      st.kv_offload_disk_write_seconds_total = d->write_seconds();
      st.kv_offload_disk_read_seconds_total = d->read_seconds();
    }
  }
  return st;
}

}  // namespace kvlm

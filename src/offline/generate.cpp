#include "offline/generate.h"

#include <chrono>

#include "core/error.h"
#include "engine/llm_engine.h"

namespace kvlm {

void validate_request(const LoadedModel& engine, const GenerateRequest& req) {
  const ModelConfig& cfg = engine.config();
  if (req.prompt.empty()) throw Error("the prompt is empty; give at least one token id");
  for (TokenId t : req.prompt)
    if (t < 0 || t >= cfg.vocab_size)
      throw Error("prompt token id " + std::to_string(t) + " is outside the model's vocabulary (0.." +
                  std::to_string(cfg.vocab_size - 1) + ")");
  if (req.max_tokens < 1) throw Error("--max-tokens must be at least 1, got " + std::to_string(req.max_tokens));
  if (req.logprobs < 0 || req.logprobs > cfg.vocab_size)
    throw Error("--logprobs must be between 0 and the vocabulary size " + std::to_string(cfg.vocab_size));
  if (req.prefill_chunk < 1) throw Error("the prefill chunk must be at least 1 token");
  const long long need = (long long)req.prompt.size() + req.max_tokens;
  if (need > cfg.max_position_embeddings)
    throw Error("prompt (" + std::to_string(req.prompt.size()) + " tokens) + --max-tokens " + std::to_string(req.max_tokens) +
                " = " + std::to_string(need) + " exceeds the model's context length of " +
                std::to_string(cfg.max_position_embeddings) + " tokens");
  validate_sampling(req.sampling);
}

GenerateResult generate(LoadedModel& engine, const GenerateRequest& req, const TokenCallback& on_token) {
  validate_request(engine, req);
  using clock = std::chrono::steady_clock;
  GenerateResult res;
  res.prompt = req.prompt;
  // A pool of exactly this request's pages, one sequence, steps of prefill_chunk tokens.
  const int capacity = int(req.prompt.size()) + req.max_tokens, bs = engine.block_size();
  LLMEngine llm(engine, SchedulerConfig{.max_num_seqs = 1,
                                        .max_num_batched_tokens = req.prefill_chunk,
                                        .max_model_len = capacity,
                                        .enable_prefix_caching = false,
                                        .num_blocks = (capacity + bs - 1) / bs});
  res.kv_bytes = engine.model().kv_bytes();
  res.finish_reason = "length";
  const auto t0 = clock::now();
  std::optional<clock::time_point> t1;  // the first token
  std::string error;
  EngineRequest er{.id = "generate",
                   .prompt = req.prompt,
                   .sampling = req.sampling,
                   .seed = req.seed,
                   .max_tokens = req.max_tokens,
                   .ignore_eos = req.ignore_eos,
                   .logprobs = req.logprobs,
                   .stop_token_ids = req.extra_eos};
  er.on_output = [&](const RequestOutput& out) {
    if (!t1 && !out.new_tokens.empty()) t1 = clock::now();
    bool go_on = true;
    for (size_t i = 0; i < out.new_tokens.size(); ++i) {
      res.tokens.push_back(out.new_tokens[i]);
      if (i < out.new_logprobs.size()) res.logprobs.push_back(out.new_logprobs[i]);
      if (go_on && on_token && !on_token(out.new_tokens[i])) go_on = false;
    }
    if (out.finished) {
      res.finish_reason = std::string(finish_reason_name(out.finish_reason));
      error = out.error;
    }
    if (!go_on) res.finish_reason = "stop";  // the caller stopped it (a stop string, say)
    return go_on;
  };
  llm.add_request(std::move(er));
  bool aborted = false;
  while (llm.has_work()) {
    if (req.cancel && req.cancel->load() && !aborted) {
      llm.abort("generate");
      aborted = true;
    }
    const bool decoding = t1.has_value();
    llm.step();
    if (decoding) ++res.decode_steps;
  }
  if (res.finish_reason == "error") throw Error(error);
  const EngineStats st = llm.stats();
  res.drafts = st.spec_drafts_total;
  res.draft_tokens = st.spec_draft_tokens_total;
  res.accepted_tokens = st.spec_accepted_tokens_total;
  const auto t2 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1.value_or(t2) - t0).count();
  res.decode_seconds = std::chrono::duration<double>(t2 - t1.value_or(t2)).count();
  return res;
}

}  // namespace kvlm

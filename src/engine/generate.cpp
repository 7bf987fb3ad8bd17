#include "engine/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/sequence.h"

namespace kvlm {

void validate_request(const Engine& engine, const GenerateRequest& req) {
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

GenerateResult generate(Engine& engine, const GenerateRequest& req, const TokenCallback& on_token) {
  validate_request(engine, req);
  using clock = std::chrono::steady_clock;
  GenerateResult res;
  res.prompt = req.prompt;
  const int capacity = int(req.prompt.size()) + req.max_tokens;
  SequenceRunner seq(engine, capacity);
  res.kv_bytes = seq.kv_bytes();
  Sampler sampler(req.seed);
  std::vector<TokenId> eos = engine.config().eos_token_ids;
  eos.insert(eos.end(), req.extra_eos.begin(), req.extra_eos.end());

  auto t0 = clock::now();
  std::vector<float> logits;
  for (size_t i = 0; i < req.prompt.size(); i += size_t(req.prefill_chunk)) {
    const size_t n = std::min(req.prompt.size() - i, size_t(req.prefill_chunk));
    logits = seq.append(std::span(req.prompt).subspan(i, n), false);
  }
  auto t1 = clock::now();
  res.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  res.finish_reason = "length";
  for (int step = 0; step < req.max_tokens; ++step) {
    if (req.cancel && req.cancel->load()) {
      res.finish_reason = "abort";
      break;
    }
    const TokenId next = sampler.sample(logits, req.sampling, req.prompt, res.tokens);
    res.tokens.push_back(next);
    if (req.logprobs > 0) res.logprobs.push_back({next, logprob_of(logits, next), top_logprobs(logits, req.logprobs)});
    if (on_token && !on_token(next)) {
      res.finish_reason = "stop";
      break;
    }
    if (!req.ignore_eos && std::ranges::find(eos, next) != eos.end()) {
      res.finish_reason = "stop";
      break;
    }
    if (step + 1 < req.max_tokens) logits = seq.append({&next, 1}, false);
  }
  res.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  return res;
}

}  // namespace kvlm

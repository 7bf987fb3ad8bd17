// Single-request generation (`kvlm generate`, `kvlm chat`, tests): one request through the
// serving engine (LLMEngine) with a pool sized for it — the same scheduling, batch
// building, forward and sampling as `kvlm serve`: prefill in chunks of prefill_chunk tokens,
// then decode, stopping at EOS (unless ignored), an extra stop token or max_tokens.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/loaded_model.h"
#include "sampling/sampler.h"  // SamplingParams, TokenLogprobs

namespace kvlm {

struct GenerateRequest {
  std::vector<TokenId> prompt;
  SamplingParams sampling;
  uint64_t seed = 0;
  int max_tokens = 16;
  bool ignore_eos = false;
  int logprobs = 0;          // top-K log-probabilities per generated token (0 = none)
  int prefill_chunk = 512;   // tokens per prefill step
  std::vector<TokenId> extra_eos;         // stop tokens beyond the model's EOS ids
  const std::atomic<bool>* cancel = nullptr;  // set from another thread (Ctrl-C) to stop
};

struct GenerateResult {
  std::vector<TokenId> prompt;
  std::vector<TokenId> tokens;
  std::vector<TokenLogprobs> logprobs;  // one per generated token when requested
  std::string finish_reason;            // "length", "stop" (EOS or the callback) or "abort"
  double prefill_seconds = 0, decode_seconds = 0;
  size_t kv_bytes = 0;                  // bytes of the KV pool this request used
  // Speculative decoding (--speculative-config): drafts verified, their tokens, accepted ones.
  uint64_t drafts = 0, draft_tokens = 0, accepted_tokens = 0;
  // Forward passes of the model after the first token: tokens - 1 without drafting, fewer
  // with it (each verifies a draft and yields one or more tokens).
  uint64_t decode_steps = 0;
};

// Validates the request (token ids, lengths, sampling values) with clear errors.
void validate_request(const LoadedModel& engine, const GenerateRequest& req);

// Called after each generated token (EOS tokens included); returning false stops the
// generation with finish_reason "stop" (a stop string was reached, say).
using TokenCallback = std::function<bool(TokenId)>;

GenerateResult generate(LoadedModel& engine, const GenerateRequest& req, const TokenCallback& on_token = {});

}  // namespace kvlm

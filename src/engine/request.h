// A request as the serving engine sees it (token ids in, token ids out) and the output it
// streams back. Text, stop strings and the OpenAI protocol live in the server above.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/index_types.h"
#include "sampling/sampler.h"  // SamplingParams, TokenLogprobs
#include "text/grammar/matcher.h"

namespace kvlm {

enum class FinishReason : uint8_t { None, Stop, Length, Abort, Error };
std::string_view finish_reason_name(FinishReason r);  // "", "stop", "length", "abort", "error"

// What one step produced for one request. Delivered on the engine thread; a callback
// copies what it keeps and returns quickly (it must not block on a client socket).
struct RequestOutput {
  std::string id;
  std::vector<TokenId> new_tokens;           // tokens generated this step (usually one)
  std::vector<TokenLogprobs> new_logprobs;   // one per new token when logprobs > 0
  std::vector<TokenLogprobs> prompt_logprobs;  // once, before the first token, when asked
  // prompt_logits requests: fp32 next-token logits [rows][vocab] of prompt rows
  // [prompt_logits_begin, prompt_logits_begin + rows) computed this step (row p follows
  // token p) — a pooling runner's hidden states [rows][hidden] instead. Valid only during the
  // callback.
  std::span<const float> prompt_logits;
  int prompt_logits_begin = 0;
  bool finished = false;
  FinishReason finish_reason = FinishReason::None;
  std::string error;                         // FinishReason::Error: what went wrong
  // Running totals.
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_prompt_tokens = 0;  // prompt tokens served from the prefix cache
};

// Returning false finishes the request with FinishReason::Stop at once (a stop string
// matched in the text); its pages are freed before the next step.
using OutputCallback = std::function<bool(const RequestOutput&)>;

struct EngineRequest {
  std::string id;                 // unique among live requests
  // Requests of one group (an API request's choices) share the running set fairly with other
  // groups: a waiting sequence of the group with the fewest running goes first. Empty: a
  // group of its own.
  std::string group;
  std::vector<TokenId> prompt;
  // --scheduling-policy priority: lower values are admitted first and preempted last (vLLM's
  // convention); equal priorities go first come, first served.
  int priority = 0;
  SamplingParams sampling;
  uint64_t seed = 0;
  int max_tokens = 16;            // 0 = run the prompt only (scoring, calibration)
  int min_tokens = 0;             // EOS and stop tokens are ignored before this many tokens
  bool ignore_eos = false;
  int logprobs = 0;               // top-K log-probabilities per generated token (0 = none)
  int prompt_logprobs = -1;       // -1 = none; K >= 0: the chosen token's plus top-K per prompt token
  std::vector<TokenId> stop_token_ids;  // stop tokens beyond the model's EOS ids
  // Deliver every prompt row's logits (teacher forcing: eval, goldens) — or, from a pooling
  // runner (ModelRunner::set_pooling), its final-normed hidden states (embeddings).
  bool prompt_logits = false;
  // (prompt_logits) the first prompt row wanted; rows before it get no logits (no LM head):
  // num_prompt - 1 for last-token pooling, the first scored row for perplexity windows.
  int prompt_logits_from = 0;
  // (prompt_logits) rows from prompt_logits_from on run at most this many a step (0: as the
  // step's token budget allows). 1 runs every scored row as a step of one row, which is how
  // decode runs a token: the kernels a batch-1 step uses (on CUDA the int8-activation GEMV)
  // instead of the prefill ones, for `kvlm eval perplexity --decode-steps`.
  int prompt_logits_step = 0;
  std::vector<std::pair<TokenId, float>> logit_bias;  // added to the logits before sampling
  // Structured outputs: the tokens drawn keep the output inside this grammar (masked before
  // sampling; EOS only where the text is complete), and the request stops with "stop" once
  // the grammar admits nothing more. The engine owns its state from add_request on.
  std::shared_ptr<grammar::Constraint> constraint;
  OutputCallback on_output;
};

}  // namespace kvlm

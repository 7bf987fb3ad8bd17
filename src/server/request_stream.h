// One HTTP request's generations in flight: its choices (one engine request each: prompts x
// n) report on the engine thread, which only detokenizes, matches stop strings and queues
// small events; the HTTP thread that owns the request takes them off the queue. The engine
// thread never waits on a client.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "config/pooling_config.h"
#include "text/text_output.h"
#include "engine/request.h"

namespace kvlm::server {

struct TextOptions {
  std::vector<std::string> stop;         // stop strings (need a tokenizer)
  std::vector<TokenId> stop_token_ids;   // the request's stop tokens (reported in stop_reason)
  std::vector<TokenId> eos_token_ids;    // the model's EOS tokens (empty with ignore_eos)
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  // Embeddings: each choice's prompt rows (a pooling runner's hidden states, RequestOutput::
  // prompt_logits) are pooled into ChoiceEvent::embedding when it finishes.
  struct Pooling {
    PoolingType type = PoolingType::Last;
    int width = 0;  // the hidden size
    bool normalize = true;
    int dimensions = 0;  // 0: all; else a Matryoshka cut
  };
  std::optional<Pooling> pooling;
};

// What one engine output meant for one choice.
struct ChoiceEvent {
  int choice = 0;
  std::string text;                          // new text, safe to show (never part of a stop string)
  std::vector<TokenId> tokens;               // new tokens
  std::vector<TokenLogprobs> logprobs;       // one per new token when asked
  std::vector<TokenLogprobs> prompt_logprobs;  // once, when asked
  bool finished = false;
  FinishReason reason = FinishReason::None;
  std::optional<std::string> stop_string;    // the stop string that ended it
  std::optional<TokenId> stop_token;         // or the stop token (not EOS) that ended it
  std::string error;
  int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;  // running totals
  std::vector<float> embedding;              // TextOptions::pooling: the pooled vector, when finished
};

class RequestStream {
 public:
  // `tok` may be null (a model without tokenizer.json): no text, no stop strings.
  RequestStream(const Tokenizer* tok, TextOptions opts, int num_choices);

  // Engine thread: the engine's output for `choice`. Returns false once a stop string has
  // matched (the engine then finishes the request and frees its pages). Never throws.
  bool on_output(int choice, const RequestOutput& out) noexcept;
  // Finishes a choice the engine will not report on (refused, or the engine is gone).
  void fail(int choice, FinishReason reason, const std::string& error);

  // HTTP thread: appends the pending events to `out`, waiting up to `timeout` for one.
  void wait(std::vector<ChoiceEvent>& out, std::chrono::milliseconds timeout);
  // Every choice has finished and every event has been taken.
  bool done() const;
  // Every choice has finished (events may still be queued).
  bool all_finished() const;
  int num_choices() const { return int(choices_.size()); }

 private:
  struct Choice {
    std::optional<TextOutput> text;  // none without a tokenizer (token ids only) or when pooling
    bool finished = false;
    int completion_tokens = 0;
    std::optional<Pooler> pooler;
  };
  void finish_text(Choice& c, ChoiceEvent& ev);
  bool is_stop_token(TokenId t) const;

  const Tokenizer* tok_;
  TextOptions opts_;
  std::vector<Choice> choices_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ChoiceEvent> events_;
  int finished_ = 0;
};

}  // namespace kvlm::server

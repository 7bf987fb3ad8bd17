// Folds a request's ChoiceEvents into OpenAI responses: SSE chunks while streaming, or one
// JSON body at the end. Both paths keep the same per-choice record, so the streamed text
// concatenates to exactly the non-streamed text and usage is counted once, the same way.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "server/protocol.h"
#include "server/request_stream.h"

namespace kvlm::server {

enum class Endpoint { Completions, Chat };

struct ChoiceMeta {
  int prompt_index = 0;
  std::vector<TokenId> prompt_ids;
  std::string echo_text;  // completions with echo: the prompt's text
};

class ResponseAssembler {
 public:
  ResponseAssembler(Endpoint ep, std::string id, int64_t created, std::string model, const GenParams& gen,
                    std::vector<ChoiceMeta> choices, TokenText token_text);

  // Streaming. begin(): the chat role chunks (one per choice); chunks(): one chunk per
  // choice that has news in `events`; end(): the usage chunk when asked, then [DONE].
  std::string begin();
  std::string chunks(const std::vector<ChoiceEvent>& events);
  // The same chunks as JSON objects, before SSE framing (the Responses API's events are made
  // from them: server/responses.h).
  std::vector<Json> chunk_objects(const std::vector<ChoiceEvent>& events);
  std::string end();

  // Non-streaming: fold events, then the response body.
  void add(const std::vector<ChoiceEvent>& events);
  Json response() const;

  // A choice that ended in an engine error or was cancelled by the server (shutdown):
  // the error to answer with (500 / 503) instead of a response.
  const std::optional<ApiError>& failure() const { return failure_; }
  Json usage() const;
  const std::string& id() const { return id_; }

 private:
  struct Record {
    std::string text;
    std::vector<TokenId> tokens;
    CompletionLogprobs lp;       // completions
    std::vector<TokenLogprobs> prompt_lp;  // prompt_logprobs
    Json chat_lp = Json::array();  // chat
    bool echoed = false;
    bool finished = false;
    FinishReason reason = FinishReason::None;
    Json stop_reason = nullptr;
    int prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
    std::optional<ReasoningStream> reasoning;  // streaming chat with --reasoning-parser
    std::optional<ToolCallStream> tools;  // streaming chat with tools
    int tool_calls_sent = 0;
  };
  // A finish reason as the client sees it: "tool_calls" for a reply that made calls.
  std::string finish_str(const Record& r, bool made_calls) const;
  void fold(const ChoiceEvent& ev);  // one event into its choice's record
  Json chunk_base() const;
  Json finish_json(const Record& r) const;

  Endpoint ep_;
  std::string id_;
  int64_t created_;
  std::string model_;
  GenParams gen_;
  std::vector<ChoiceMeta> meta_;
  TokenText token_text_;
  std::vector<Record> recs_;
  std::optional<ApiError> failure_;
};

}  // namespace kvlm::server

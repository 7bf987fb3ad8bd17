// The Responses API (/v1/responses) over the chat completions path. A request becomes the chat
// request it amounts to — `instructions` as the system message, the conversation stored under
// `previous_response_id`, the input items as messages (function calls as the assistant's
// tool_calls, their outputs as tool messages), flat function tools as chat tools, `text.format`
// as response_format, `max_output_tokens` as max_completion_tokens — so templates, tool-call and
// reasoning parsers, structured outputs and sampling are the chat endpoint's, written once. The
// chat assembler's message (or its streamed chunks) then becomes the Response object: reasoning,
// message and function_call items (or the stream of response.* events the openai client reads).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "server/protocol.h"

namespace kvlm::server {

// Responses kept for previous_response_id and GET /v1/responses/{id}: the newest `max_responses`
// within `max_bytes` (their JSON), older ones dropped first. Each keeps its own input and output
// items and its predecessor's id, so a conversation is replayed by walking back the chain.
class ResponseStore {
 public:
  ResponseStore(size_t max_responses, size_t max_bytes);
  bool enabled() const { return max_responses_ > 0; }
  void put(const std::string& id, Json response, Json input_items, std::optional<std::string> previous);
  std::optional<Json> response(const std::string& id) const;
  bool erase(const std::string& id);
  // Every item of the conversation that `id` ends, oldest first (inputs and outputs of each
  // response of the chain). Throws ApiError 404 when `id`, or a response before it, is not here.
  Json conversation(const std::string& id) const;
  size_t size() const;

 private:
  struct Entry {
    Json response, input;
    std::optional<std::string> previous;
    size_t bytes = 0;
    std::list<std::string>::iterator age;
  };
  void evict();  // with mu_ held
  size_t max_responses_, max_bytes_;
  mutable std::mutex mu_;
  std::map<std::string, Entry> entries_;
  std::list<std::string> order_;  // oldest first
  size_t bytes_ = 0;
};

// A parsed /v1/responses request.
struct ResponsesRequest {
  Json chat;         // the /v1/chat/completions body it amounts to (for parse_chat_request)
  Json input_items;  // this request's input as items (stored with the response)
  std::optional<std::string> previous_response_id;
  bool store = true;
  bool stream = false;
  Json echo;         // the request fields the Response object repeats
  std::vector<std::string> ignored_fields;
};

// Throws ApiError: 400 for what kvlm does not implement (built-in tools, background mode,
// prompt templates, conversations, image or file inputs, truncation "auto"), naming the field;
// 404 for a previous_response_id the store does not hold.
ResponsesRequest parse_responses_request(const Json& body, const ResponseStore& store);

// What a Response object says besides its output.
struct ResponseMeta {
  std::string id;
  int64_t created = 0;
  std::string model;
  Json echo = Json::object();
};

// The Response object of a finished chat completion (ResponseAssembler::response()).
Json response_from_chat(const ResponseMeta& meta, const Json& chat_completion);

// Streaming: the chat chunks of one choice turned into the Responses API's events, with the
// `event:` line and a sequence_number.
class ResponsesStream {
 public:
  explicit ResponsesStream(ResponseMeta meta) : meta_(std::move(meta)) {}
  std::string begin();  // response.created, response.in_progress
  std::string events(const std::vector<Json>& chat_chunks);
  // Closes the open item; response.completed (or .incomplete at max_output_tokens).
  std::string end(const Json& chat_usage);
  std::string failed(const ApiError& e);  // response.failed
  const Json& final_response() const { return final_; }

 private:
  enum class Open { None, Reasoning, Message };
  std::string event(const char* type, Json body);
  std::string open(Open kind);
  std::string close();
  ResponseMeta meta_;
  int seq_ = 0;
  Json output_ = Json::array();
  Open open_ = Open::None;
  Json item_;             // the open item
  std::string text_;      // its text so far
  Json logprobs_ = Json::array();
  std::string finish_;
  Json final_;
};

}  // namespace kvlm::server

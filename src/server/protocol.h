// The OpenAI protocol, without sockets or threads: request bodies of /v1/completions and
// /v1/chat/completions parsed and validated into plain structs (every mistake an ApiError
// with the HTTP status, an OpenAI-shaped body and the parameter's name), and the JSON of
// responses, streamed chunks, log-probabilities, usage and errors. Pure functions, unit
// tested in tests/server.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/index_types.h"
#include "sampling/sampler.h"  // TokenLogprobs
#include "text/grammar/grammar.h"
#include "engine/request.h"    // FinishReason
#include "server/reasoning.h"
#include "server/tool_calls.h"

namespace kvlm::server {

using Json = nlohmann::ordered_json;

// An error for the client: HTTP status, OpenAI's error `type`, the offending parameter
// (empty = null) and a machine-readable `code` (empty = null).
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = {}, std::string code = {})
      : std::runtime_error(message), status_(status), param_(std::move(param)), code_(std::move(code)) {}
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& code() const { return code_; }

 private:
  int status_;
  std::string param_, code_;
};

// {"error": {"message", "type", "param", "code"}}; `type` follows the status as OpenAI's
// does (invalid_request_error, authentication_error, not_found_error, ...).
Json error_json(int status, std::string_view message, std::string_view param = {}, std::string_view code = {});
Json error_json(const ApiError& e);
std::string_view error_type_for_status(int status);

// Limits a request must stay within; the defaults are the server's (see README "Serving").
struct ApiLimits {
  int max_n = 128;                 // OpenAI's documented maximum for `n`
  int max_choices = 256;           // prompts x n in one request (--max-seqs-per-request)
  int max_stop = 16;               // stop strings
  size_t max_stop_bytes = 1024;    // bytes of one stop string
  int max_stop_token_ids = 256;
  int max_logprobs = 20;           // vLLM's default --max-logprobs; OpenAI's top_logprobs maximum
  int max_json_depth = 64;         // nesting of the request body
  bool priority_scheduling = false;  // --scheduling-policy priority: `priority` may be set
};

// What the model brings to validation and defaults.
struct ModelInfo {
  std::string name;            // --served-model-name
  int max_model_len = 0;       // prompt + output
  int vocab_size = 0;
  bool has_tokenizer = false;
  bool has_chat_template = false;
  std::optional<float> default_temperature, default_top_p, default_min_p;  // generation_config.json
  std::optional<int> default_top_k;
  // The format the model writes tool calls in (--tool-call-parser, or found in its chat
  // template); None: requests with tools are refused unless tool_choice is "none".
  ToolParser tool_parser = ToolParser::None;
  // --reasoning-parser: ThinkTags splits chat replies at <think> ... </think> (reasoning.h).
  ReasoningParser reasoning_parser = ReasoningParser::None;
};

// The generation parameters shared by both endpoints, validated.
struct GenParams {
  SamplingParams sampling;
  std::optional<uint64_t> seed;       // nullopt: random per choice
  std::optional<int> max_tokens;      // nullopt: the endpoint's default
  int min_tokens = 0;
  bool ignore_eos = false;
  int n = 1;
  std::vector<std::string> stop;
  std::vector<TokenId> stop_token_ids;
  bool include_stop_str_in_output = false;
  bool skip_special_tokens = true;
  // Top-level fields kvlm neither reads nor refuses (not OpenAI's or vLLM's): the request
  // goes on and the server logs them, as vLLM does.
  std::vector<std::string> ignored_fields;
  // Completions: `logprobs` K; chat: `top_logprobs` K when `logprobs` is true. nullopt = none.
  std::optional<int> logprobs;
  bool echo = false;                  // completions only
  int priority = 0;                   // vLLM's `priority` (--scheduling-policy priority; lower first)
  // vLLM's prompt_logprobs K: each prompt token's log-probability with its rank, and the top K
  // (the first token has none). Not streamed.
  std::optional<int> prompt_logprobs;
  bool stream = false;
  bool include_usage = false;         // stream_options.include_usage
  bool return_token_ids = false;      // vLLM's extension: token ids in each choice
  // logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling.
  std::vector<std::pair<TokenId, float>> logit_bias;
  // Structured outputs (response_format json_object / json_schema, structured_outputs,
  // guided_json / guided_regex / guided_choice / guided_grammar): the grammar every choice's
  // text must match, and a key that names it (equal keys = equal grammars) for the server's
  // cache of compiled grammars. Null: unconstrained.
  std::shared_ptr<const grammar::Grammar> grammar;
  std::string grammar_key;
  // The request field the grammar comes from, for the error should it not compile.
  std::string grammar_field = "response_format";
  // Chat with tools: the replies' tool calls are pulled out of the text in this format, with
  // the request's tools (qwen3_coder types argument values by their schemas).
  ToolParser tool_parser = ToolParser::None;
  std::shared_ptr<const Json> tools;
  // Text the reply continues (harmony's forced call header): appended to the prompt's tokens,
  // read by the tool-call parser before the model's text, never returned itself.
  std::string reply_prefix;
  // Chat with --reasoning-parser qwen3 / deepseek_r1: the reply is split at <think> tags, and
  // whether it starts inside the reasoning (read from the rendered prompt by the server).
  bool reasoning = false;
  bool reply_in_reasoning = false;
};

struct Prompt {
  std::optional<std::string> text;    // a text prompt (tokenized by the server)
  std::vector<TokenId> ids;           // or token ids
};

struct CompletionRequest {
  GenParams gen;
  std::vector<Prompt> prompts;        // one or more (a batch)
};

struct ChatRequest {
  GenParams gen;
  Json messages;                      // content normalized to strings
  bool add_generation_prompt = true;
  Json template_kwargs = Json::object();  // chat_template_kwargs (enable_thinking, ...); `tools` too
  // tool_choice "auto" with tools: the model must see them in its prompt to call one (the
  // server checks that the chat template renders them).
  bool tools_must_reach_prompt = false;
};

// /v1/embeddings (OpenAI's fields, and vLLM's truncate_prompt_tokens, add_special_tokens,
// normalize): validated; whether the model pools, and `dimensions` against the model, are the
// server's to check.
struct EmbeddingRequest {
  std::vector<Prompt> inputs;
  bool base64 = false;                       // encoding_format "base64": little-endian float32 bytes
  int dimensions = 0;                        // 0: the model's
  std::optional<int> truncate_prompt_tokens; // keep each input's last N tokens
  bool add_special_tokens = true;            // text inputs: the tokenizer's BOS/EOS
  std::optional<bool> normalize;             // nullopt: the model's pooling config
  int priority = 0;
  std::vector<std::string> ignored_fields;
};
EmbeddingRequest parse_embedding_request(const Json& body, const ModelInfo& info, const ApiLimits& limits);
// {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage"}.
Json embedding_response(const std::string& model, const std::vector<std::vector<float>>& vectors, bool base64,
                        int64_t prompt_tokens);

// Parses a request body. Throws ApiError 400 for malformed JSON, a non-object body, or
// JSON nested deeper than limits.max_json_depth.
Json parse_body(std::string_view body, const ApiLimits& limits);

// Throws ApiError: 400 for wrong types and values out of range, 404 for a model name
// other than info.name. OpenAI and vLLM fields kvlm does not implement (suffix, best_of > 1,
// structural tags, audio, predicted outputs, beam search, ...) are refused rather than
// silently dropped; fields that only label a request (user, metadata, service_tier) are
// accepted; any other field is listed in gen.ignored_fields.
CompletionRequest parse_completion_request(const Json& body, const ModelInfo& info, const ApiLimits& limits);
ChatRequest parse_chat_request(const Json& body, const ModelInfo& info, const ApiLimits& limits);

// The max_tokens a request gets, after its prompt is known: the request's value (checked
// against the context: 400 with code context_length_exceeded) or the endpoint's default
// (completions: 16, chat: the rest of the context), never past max_model_len.
int resolve_max_tokens(const GenParams& gen, int prompt_len, int max_model_len, bool chat);

// Log-probabilities in the two OpenAI shapes. `token_text` renders one token id.
using TokenText = std::function<std::string(TokenId)>;
struct CompletionLogprobs {
  // Accumulates the legacy completions shape: tokens, token_logprobs, top_logprobs,
  // text_offset. Prompt entries (echo) come first; the first prompt token has nulls.
  Json tokens = Json::array(), token_logprobs = Json::array(), top_logprobs = Json::array(),
       text_offset = Json::array();
  size_t offset = 0;  // characters so far (code points, as Python counts)
  void add_prompt(std::span<const TokenId> prompt, std::span<const TokenLogprobs> lps, int k, const TokenText& text);
  void add(const TokenLogprobs& lp, int k, const TokenText& text);
  Json to_json() const;
  bool empty() const { return tokens.empty(); }
};
// Chat: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}.
Json chat_logprob_entry(const TokenLogprobs& lp, int k, const TokenText& text);
// vLLM's prompt_logprobs: [null, then per prompt token {"<id>": {"logprob", "rank",
// "decoded_token"}} for the token itself and the top k].
Json prompt_logprobs_json(std::span<const TokenLogprobs> lps, int k, const TokenText& text);

// A logprob as JSON: finite values as they are, -inf / NaN as -9999.0 (vLLM's choice;
// JSON has no infinity).
double json_logprob(float v);
// Code points in a UTF-8 string (invalid bytes count one each).
size_t utf8_length(std::string_view s);

// "stop", "length", "abort" (vLLM's name for cancelled requests), "error".
std::string finish_reason_str(FinishReason r);

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);

// Server-sent events: one `data:` event, and the stream's end.
std::string sse_event(const Json& j);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";
// JSON text of a response: UTF-8 kept as is, invalid bytes replaced by U+FFFD.
std::string dump(const Json& j);

// A message from an exception, fit for a client: filesystem paths (a token that starts with
// '/' and has another '/' in it) are cut to their last component, so "/srv/models/qwen/chat
// template:3:5: ..." reads "chat template:3:5: ...".
std::string without_paths(std::string_view message);

// Random request ids: "cmpl-" / "chatcmpl-" + 32 hex digits.
std::string make_request_id(std::string_view prefix);

}  // namespace kvlm::server

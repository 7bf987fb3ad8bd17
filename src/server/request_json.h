// Reading request bodies field by field, for every endpoint's parser (protocol.cpp: completions
// and chat; embeddings.cpp; responses.cpp): each mistake an ApiError 400 naming the field, null
// treated as unset as OpenAI does.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "server/protocol.h"

namespace kvlm::server {

[[noreturn]] void bad(const std::string& message, const std::string& param, const std::string& code = {});
// "a string", "an integer", "an array", ... (for messages).
std::string kind(const Json& v);
// The value of `key`, or nullptr when it is absent or null.
const Json* field(const Json& body, const char* key);
std::optional<bool> opt_bool(const Json& body, const char* key);
std::optional<double> opt_number(const Json& body, const char* key);  // finite
// An integer (an integral float such as 2.0 is accepted, as pydantic accepts it).
std::optional<int64_t> opt_int(const Json& body, const char* key);
std::string num(double v);  // a number as messages print it
// `key` in [lo, hi] (or (lo, hi] when lo_open), else `dflt` when absent.
float number_in(const Json& body, const char* key, double lo, double hi, bool lo_open, float dflt);
// `model`, when given, names the served model (404 otherwise).
void check_model(const Json& body, const ModelInfo& info);
TokenId token_id(const Json& v, const ModelInfo& info, const char* param, const char* what);
// vLLM's `priority`: an integer, lower first; anything but 0 needs --scheduling-policy priority.
int parse_priority(const Json& b, const ApiLimits& lim);
std::vector<TokenId> token_list(const Json& arr, const ModelInfo& info, const char* key);
// `key` ("prompt", or "input" for embeddings): a string, a list of strings, a list of token
// ids, or a list of token-id lists.
std::vector<Prompt> parse_prompts(const Json& b, const ModelInfo& info, const char* key = "prompt");

}  // namespace kvlm::server

#include "server/request_fields.h"

#include <set>

namespace kvlm::server {

namespace {

struct Refusal {
  const char* field;
  const char* why;
};
constexpr Refusal kRefused[] = {
    {"audio", "audio output is not supported by kvlm (text only)"},
    {"prediction", "predicted outputs are not supported by kvlm"},
    {"web_search_options", "web search is not supported by kvlm"},
    {"store", "kvlm does not store completions (store must be false or absent)"},
    {"use_beam_search", "beam search is not supported by kvlm"},
    {"allowed_token_ids", "allowed_token_ids is not supported by kvlm; use logit_bias or structured_outputs.choice"},
    {"bad_words", "bad_words is not supported by kvlm; use logit_bias to ban tokens"},
    {"truncate_prompt_tokens", "truncate_prompt_tokens is not supported by kvlm; shorten the prompt"},
    {"mm_processor_kwargs", "kvlm serves text models only"},
    {"documents", "documents are not supported by kvlm"},
};

// Fields with a neutral value of their own, checked apart from the table.
constexpr const char* kRefusedOtherwise[] = {"modalities", "length_penalty", "reasoning_effort"};

// What the parsers read (protocol.cpp) and the labels that change no output.
const std::set<std::string> kCommon = {
    "model", "n", "max_tokens", "min_tokens", "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "return_token_ids", "stream", "stream_options", "logit_bias", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_whitespace_pattern",
    "structural_tag", "logprobs", "echo", "user", "metadata", "service_tier", "prompt_logprobs", "priority"};
const std::set<std::string> kCompletions = {"prompt", "suffix", "best_of"};
const std::set<std::string> kChat = {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                     "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
                                     "tool_choice", "parallel_tool_calls", "functions", "function_call"};

[[noreturn]] void refuse(const std::string& why, const char* field) { throw ApiError(400, why, field); }

}  // namespace

void refuse_unimplemented_fields(const Json& b, bool chat) {
  const auto value = [&](const char* k) -> const Json* {
    auto it = b.find(k);
    return it == b.end() || it->is_null() ? nullptr : &*it;
  };
  const auto set = [&](const char* k) {
    const Json* v = value(k);
    return v && *v != false && !(v->is_array() && v->empty()) && !(v->is_object() && v->empty());
  };
  for (const Refusal& r : kRefused)
    if (set(r.field)) refuse(r.why, r.field);
  if (const Json* m = value("modalities"); m && *m != Json::array({"text"}))
    refuse("modalities other than [\"text\"] are not supported by kvlm", "modalities");
  if (const Json* lp = value("length_penalty"); lp && *lp != 1 && *lp != 1.0)
    refuse("length_penalty applies to beam search, which kvlm does not implement", "length_penalty");
  if (!chat && set("reasoning_effort")) refuse("reasoning_effort applies to chat completions", "reasoning_effort");
}

std::vector<std::string> unrecognized_fields(const Json& b, bool chat) {
  static const std::set<std::string> known = [] {
    std::set<std::string> k = kCommon;
    for (const Refusal& r : kRefused) k.insert(r.field);
    k.insert(std::begin(kRefusedOtherwise), std::end(kRefusedOtherwise));
    return k;
  }();
  std::vector<std::string> out;
  for (auto it = b.begin(); it != b.end(); ++it)
    if (!known.count(it.key()) && !(chat ? kChat : kCompletions).count(it.key())) out.push_back(it.key().substr(0, 64));
  return out;
}

}  // namespace kvlm::server

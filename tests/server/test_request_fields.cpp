// Request fields kvlm does not implement: OpenAI's and vLLM's are refused with a 400 naming
// them (unless set to their neutral value), labels are accepted, anything else is listed for
// the server's log; reasoning_effort reaches the chat template.
#include <gtest/gtest.h>

#include <algorithm>

#include "server/protocol.h"
#include "protocol_test_util.h"

using namespace kvlm;
using namespace kvlm::server;
using namespace kvlm::server::testing;

namespace {

const std::string kChat = R"("messages": [{"role": "user", "content": "hi"}])";

// The param of the 400 a body raises, or "" when it parses.
std::string refused(const std::string& fields, bool chat) {
  const Json b = Json::parse("{" + (chat ? kChat : std::string(R"("prompt": "hi")")) + ", " + fields + "}");
  try {
    if (chat) parse_chat_request(b, info(), {});
    else parse_completion_request(b, info(), {});
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400) << fields;
    return e.param();
  }
  return "";
}

}  // namespace

TEST(RequestFields, UnimplementedFieldsAreRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("audio": {"voice": "alloy", "format": "wav"})", "audio"},
      {R"("modalities": ["text", "audio"])", "modalities"},
      {R"("prediction": {"type": "content", "content": "x"})", "prediction"},
      {R"("web_search_options": {"search_context_size": "low"})", "web_search_options"},
      {R"("store": true)", "store"},
      {R"("use_beam_search": true)", "use_beam_search"},
      {R"("length_penalty": 0.5)", "length_penalty"},
      {R"("allowed_token_ids": [1, 2])", "allowed_token_ids"},
      {R"("bad_words": ["x"])", "bad_words"},
      {R"("truncate_prompt_tokens": 10)", "truncate_prompt_tokens"},
      {R"("documents": [{"text": "x"}])", "documents"},
  };
  for (const bool chat : {false, true})
    for (const auto& [f, param] : cases) EXPECT_EQ(refused(f, chat), param) << f << (chat ? " (chat)" : "");
  EXPECT_EQ(refused(R"("reasoning_effort": "low")", false), "reasoning_effort") << "completions have no template";
  EXPECT_EQ(refused(R"("reasoning_effort": "extreme")", true), "reasoning_effort");
}

TEST(RequestFields, NeutralValuesAndLabelsAreAccepted) {
  const std::string neutral =
      R"("audio": null, "modalities": ["text"], "store": false, "use_beam_search": false, "length_penalty": 1,)"
      R"( "bad_words": [], "prediction": null, "user": "u-17", "metadata": {"k": "v"}, "service_tier": "auto")";
  for (const bool chat : {false, true}) {
    EXPECT_EQ(refused(neutral, chat), "") << (chat ? "chat" : "completions");
    const Json b = Json::parse("{" + (chat ? kChat : std::string(R"("prompt": "hi")")) + ", " + neutral + "}");
    const GenParams g = chat ? parse_chat_request(b, info(), {}).gen : parse_completion_request(b, info(), {}).gen;
    EXPECT_TRUE(g.ignored_fields.empty()) << g.ignored_fields.front();
  }
}

TEST(RequestFields, OtherFieldsAreListedForTheLog) {
  const Json c = Json::parse(R"({"prompt": "hi", "frobnicate": 1, "priority": 2, "max_tokens": 3, "zap": null})");
  const auto got = parse_completion_request(c, info(), ApiLimits{.priority_scheduling = true}).gen.ignored_fields;
  EXPECT_EQ(got, (std::vector<std::string>{"frobnicate", "zap"}));  // priority is read now
  // A chat-only field sent to completions is listed there, and the other way round.
  EXPECT_EQ(parse_completion_request(Json::parse(R"({"prompt": "hi", "tools": []})"), info(), {}).gen.ignored_fields,
            std::vector<std::string>{"tools"});
  const Json ch = Json::parse("{" + kChat + R"(, "suffix": "x", "max_completion_tokens": 4})");
  EXPECT_EQ(parse_chat_request(ch, info(), {}).gen.ignored_fields, std::vector<std::string>{"suffix"});
}

TEST(RequestFields, ReasoningEffortReachesTheChatTemplate) {
  const Json b = Json::parse("{" + kChat + R"(, "reasoning_effort": "high"})");
  EXPECT_EQ(parse_chat_request(b, info(), {}).template_kwargs.at("reasoning_effort"), "high");
  const Json kw = Json::parse("{" + kChat + R"(, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}})");
  EXPECT_EQ(parse_chat_request(kw, info(), {}).template_kwargs.at("reasoning_effort"), "low") << "the kwargs win";
}

// GPT-OSS's template reads an assistant turn's reasoning from `thinking`: the reasoning_content
// kvlm returned comes back to it there, except beside content in a turn with calls (the
// template raises on both).
TEST(RequestFields, HarmonyReasoningReturnsAsThinking) {
  ModelInfo m = info();
  m.tool_parser = ToolParser::Harmony;
  const Json b = Json::parse(R"({"model": "tiny", "messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "reasoning_content": "Call the tool.",
       "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
      {"role": "assistant", "content": "Sunny.", "reasoning_content": "Say it.",
       "tool_calls": [{"id": "call_2", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
      {"role": "assistant", "content": "Done.", "reasoning_content": "Finish.", "thinking": "mine"}]})");
  const ChatRequest r = parse_chat_request(b, m, {});
  EXPECT_EQ(r.messages[1].value("thinking", ""), "Call the tool.");
  EXPECT_FALSE(r.messages[3].contains("thinking")) << "content beside calls: the template takes one";
  EXPECT_EQ(r.messages[4].value("thinking", ""), "mine") << "a client's own thinking stays";
  EXPECT_FALSE(parse_chat_request(b, info(), {}).messages[1].contains("thinking")) << "only for harmony";
}

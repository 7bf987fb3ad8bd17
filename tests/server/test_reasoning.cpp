// --reasoning-parser qwen3 / deepseek_r1 (server/reasoning.h): <think> ... </think> apart from
// the answer, whole and streamed in pieces split anywhere (a tag across pieces included), and
// where a reply starts, read from the prompt.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "server/reasoning.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"

using namespace kvlm;
using namespace kvlm::server;

namespace {

// The split of `text` streamed one piece of `step` bytes at a time.
ReasoningSplit streamed(const std::string& text, bool in_reasoning, size_t step) {
  ReasoningStream s(in_reasoning);
  ReasoningSplit out;
  for (size_t i = 0; i < text.size(); i += step) {
    const ReasoningSplit p = s.push(std::string_view(text).substr(i, step));
    out.reasoning += p.reasoning;
    out.content += p.content;
  }
  const ReasoningSplit f = s.finish();
  out.reasoning += f.reasoning;
  out.content += f.content;
  return out;
}

void expect_split(const std::string& text, bool in_reasoning, const std::string& reasoning, const std::string& content) {
  const ReasoningSplit whole = split_reasoning(text, in_reasoning);
  EXPECT_EQ(whole.reasoning, reasoning) << text;
  EXPECT_EQ(whole.content, content) << text;
  for (size_t step : {1, 2, 3, 5, 7}) {
    const ReasoningSplit s = streamed(text, in_reasoning, step);
    EXPECT_EQ(s.reasoning, reasoning) << text << " in pieces of " << step;
    EXPECT_EQ(s.content, content) << text << " in pieces of " << step;
  }
}

}  // namespace

TEST(ReasoningSplit, ReplyOpensTheBlock) {
  expect_split("<think>\nThe user greets me.\n</think>\n\nHello there.", false, "\nThe user greets me.\n", "Hello there.");
  expect_split("  \n<think>a < b and </thin are not the tag</think>ok", false, "a < b and </thin are not the tag", "ok");
  expect_split("<think></think>Answer only.", false, "", "Answer only.");
}

TEST(ReasoningSplit, PromptOpensTheBlock) {
  // DeepSeek-R1's template (and Qwen3's thinking-only models) end the prompt with <think>.
  expect_split("Let me think.\n</think>\n\nThe answer is 4.", true, "Let me think.\n", "The answer is 4.");
  // A second <think> inside the reasoning is text.
  expect_split("plan <think> more</think>done", true, "plan <think> more", "done");
}

TEST(ReasoningSplit, NoBlockIsAllAnswer) {
  expect_split("Hello there.", false, "", "Hello there.");
  expect_split("  leading spaces stay", false, "", "  leading spaces stay");
  expect_split("<thinking> is not the tag", false, "", "<thinking> is not the tag");
  expect_split("<thi", false, "", "<thi");  // ended while it might have been the tag
  expect_split("", false, "", "");
  expect_split("Answer, then </think> later", false, "", "Answer, then </think> later");
}

TEST(ReasoningSplit, UnclosedBlockIsAllReasoning) {
  // A reply cut by max_tokens inside its reasoning: nothing of it is the answer.
  expect_split("<think>still thinking", false, "still thinking", "");
  expect_split("still thinking </thi", true, "still thinking </thi", "");
  expect_split("<think>reasoning</think>\n\n", false, "reasoning", "");
}

TEST(ReasoningSplit, WhereTheReplyStartsComesFromThePrompt) {
  EXPECT_TRUE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));  // enable_thinking false
  EXPECT_FALSE(prompt_opens_reasoning("<|im_start|>assistant\n"));
  EXPECT_FALSE(prompt_opens_reasoning(""));
  // An earlier turn's closed block does not count; the last one decides.
  EXPECT_TRUE(prompt_opens_reasoning("<think>a</think>b<|im_start|>assistant\n<think>"));
}

TEST(ReasoningSplit, ConstraintsBindTheAnswerOnly) {
  const grammar::Grammar answer = grammar::json_schema_grammar(
      nlohmann::ordered_json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})"));
  auto vocab = std::make_shared<const grammar::TokenVocab>(std::vector<std::string>{"x"});
  const auto accepts = [&](bool in_reasoning, const std::string& text) {
    grammar::Constraint c(std::make_shared<const grammar::CompiledGrammar>(reasoning_then(answer, in_reasoning), vocab));
    return c.accept_text(text) && c.can_end();
  };
  // The prompt opened the block: any text without the tag, then the answer.
  EXPECT_TRUE(accepts(true, "Let me see: < and </ and </thin> are text.</think>\n\n{\"a\": 1}"));
  EXPECT_TRUE(accepts(true, "<</think>{\"a\": 2}"));  // a '<' right before the tag
  EXPECT_FALSE(accepts(true, "thinking</think>{\"b\": 1}"));  // the answer must follow the schema
  EXPECT_FALSE(accepts(true, "{\"a\": 1}"));                    // the reasoning must close first
  EXPECT_FALSE(accepts(true, "done</think>{\"a\": 1}</think>"));
  // Otherwise the reply may open a block, or be the answer at once.
  EXPECT_TRUE(accepts(false, "{\"a\": 3}"));
  EXPECT_TRUE(accepts(false, "\n<think>plan</think>{\"a\": 3}"));
  EXPECT_FALSE(accepts(false, "plan</think>{\"a\": 3}"));
  EXPECT_FALSE(accepts(false, "<think>never closed {\"a\": 3}"));
}

TEST(ReasoningSplit, ParserNames) {
  EXPECT_EQ(parse_reasoning_parser("qwen3"), ReasoningParser::ThinkTags);
  EXPECT_EQ(parse_reasoning_parser("deepseek_r1"), ReasoningParser::ThinkTags);
  EXPECT_EQ(parse_reasoning_parser("gpt_oss"), ReasoningParser::Harmony);
  try {
    parse_reasoning_parser("qwen");
    FAIL() << "accepted an unknown name";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qwen3 or deepseek_r1"), std::string::npos) << e.what();
  }
}

// Reasoning apart from the answer (--reasoning-parser, as in vLLM): a thinking model's reply
// split into OpenAI's `reasoning_content` and `content`, whole or streamed.
//
//   qwen3, deepseek_r1  <think>REASONING</think>ANSWER. Where the reply starts is read from the
//                       rendered prompt, not guessed per family: a prompt whose last <think> is
//                       still open (DeepSeek-R1's template, Qwen3 thinking-only models, a
//                       template that opens the block itself) starts the reply inside the
//                       reasoning, so text up to </think> is reasoning; otherwise a reply that
//                       begins with <think> (after whitespace) opens it, and any other reply is
//                       all answer (Qwen3 with enable_thinking false: its template closes an
//                       empty block in the prompt). A reasoning block never closed (the reply
//                       hit max_tokens) is all reasoning. Whitespace between </think> and the
//                       answer is dropped.
//   gpt_oss             harmony (GPT-OSS): its tool-call format splits every reply already
//                       (tool_calls.h); the name is accepted for such a model.
//
// The split is applied before the tool-call parser, which sees the answer only.
#pragma once

#include <string>
#include <string_view>

#include "text/grammar/grammar.h"

namespace kvlm::server {

enum class ReasoningParser { None, ThinkTags, Harmony };

// "qwen3", "deepseek_r1" (the same split), "gpt_oss" / "openai_gptoss" / "harmony"; throws
// kvlm::Error naming the valid values.
ReasoningParser parse_reasoning_parser(std::string_view name);

// Whether a reply after this prompt text (its tail is enough) starts inside a <think> block:
// the last <think> in it is not followed by </think>.
bool prompt_opens_reasoning(std::string_view prompt);

struct ReasoningSplit {
  std::string reasoning;
  std::string content;
};

// The <think> split while streaming: text in, reasoning and answer out. Text that may be part
// of a tag is held back until it is known.
class ReasoningStream {
 public:
  explicit ReasoningStream(bool in_reasoning) : state_(in_reasoning ? State::Reasoning : State::Start) {}
  ReasoningSplit push(std::string_view text);
  ReasoningSplit finish();  // the reply ended: what was held back

 private:
  enum class State { Start, Reasoning, AfterReasoning, Answer };
  State state_;
  std::string held_;
};

// The whole reply at once (the same as one push and finish).
ReasoningSplit split_reasoning(std::string_view text, bool in_reasoning);

// A constraint on the answer of a reply that may reason first (structured outputs, a forced
// tool call), as vLLM applies it: free text up to </think>, whitespace, then `answer`. A
// reply that starts inside the block (in_reasoning) begins in the free text; otherwise it
// either opens a block with <think> (after whitespace) or is the answer from its first token.
// The free text is a rule per character of </think> matched so far (the tag's automaton), so
// the reasoning is any text that does not contain the tag.
grammar::Grammar reasoning_then(const grammar::Grammar& answer, bool in_reasoning);

}  // namespace kvlm::server

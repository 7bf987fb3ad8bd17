// The parser seam of chat replies: the model's text split into OpenAI's `content`,
// `reasoning_content` and `tool_calls`, whole or streamed, and the grammar that forces a call
// when the request's tool_choice is "required" or names a function. The formats, chosen by
// --tool-call-parser as in vLLM or found in the chat template:
//   hermes       Hermes / Qwen 2.5 / Qwen 3: <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>,
//                one block per call, text around them is content;
//   qwen3_coder  Qwen3-Coder / Qwen3.5: the same blocks around XML, <function=NAME> then
//                <parameter=KEY>\nVALUE\n</parameter> per argument and </function>; a value is
//                typed by the tool's parameters schema (a string as written, other types read
//                as JSON; without a schema, JSON where it parses);
//   llama3_json  Llama 3.1 / 3.2: the whole reply is {"name": ..., "parameters": {...}}
//                (optionally after <|python_tag|>), calls separated by ";";
//   pythonic     Llama 3.2 / 4 and others: the whole reply is a Python list of calls with
//                keyword arguments, [f(a=1, b="x"), g()] (optionally between <|python_start|>
//                and <|python_end|>), values Python literals (JSON's true / false / null too);
//   harmony      GPT-OSS: messages <|channel|>CHANNEL[ to=functions.NAME][ <|constrain|>json]
//                <|message|>BODY<|end|> (<|call|> after a call; <|start|>assistant between
//                messages): the analysis channel is reasoning, final is content, a
//                commentary message to functions.NAME is a call (BODY its arguments), and one
//                without a recipient (a preamble) is content. Harmony parses every chat reply
//                of the model, with tools or without (the markers are special tokens, kept in
//                the text the parser reads).
// A reply that does not hold a well-formed call is content, unchanged.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/grammar/grammar.h"

namespace kvlm::server {

enum class ToolParser { None, Hermes, Llama3Json, Harmony, Qwen3Coder, Pythonic };

// The length of the longest suffix of `s` that is a proper prefix of `tag`: text a streaming
// parser holds back because it may yet become the tag.
size_t partial_tag(std::string_view s, std::string_view tag);

// Whether the format carries reasoning apart from the answer (every reply is parsed).
inline bool parses_every_reply(ToolParser p) { return p == ToolParser::Harmony; }

// "hermes", "llama3_json", "qwen3_coder", "pythonic", "harmony" (vLLM's names; "qwen" and "llama3" are accepted too); throws
// kvlm::Error naming the valid values.
ToolParser parse_tool_parser(std::string_view name);
std::string_view tool_parser_name(ToolParser p);
// The format a chat template writes tool calls in, from its text: Hermes' <tool_call> tags,
// Llama's "parameters" JSON with ipython; None when it writes neither.
ToolParser detect_tool_parser(std::string_view chat_template);

struct ToolCall {
  std::string id;         // "call_" + 24 hex digits
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ExtractedCalls {
  std::string content;         // the text that is not a call (trimmed when there are calls)
  std::vector<ToolCall> calls;
  std::string reasoning;       // harmony's analysis channel
};
// `tools`: the request's tools (qwen3_coder types its values by their schemas), or null.
ExtractedCalls extract_tool_calls(ToolParser p, std::string_view text, const nlohmann::ordered_json* tools = nullptr);

// The same while streaming: text in, content and completed calls out. Text that may begin a
// call is held back until it is known (a call is sent whole, in one delta, once parsed).
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolParser p, const nlohmann::ordered_json* tools = nullptr)
      : p_(p), tools_(tools ? *tools : nlohmann::ordered_json()) {}
  struct Out {
    std::string content;
    std::vector<ToolCall> calls;
    std::string reasoning;
  };
  Out push(std::string_view text);  // new text of the reply
  Out finish();                     // the reply ended: what was held back
  bool any_calls() const { return calls_ > 0; }

 private:
  Out push_harmony(bool end);
  // The call a <tool_call> block's body holds (hermes: JSON, qwen3_coder: XML), if any.
  std::optional<ToolCall> block_call(std::string_view body) const;

  ToolParser p_;
  nlohmann::ordered_json tools_;  // qwen3_coder: the request's tools, for their schemas
  std::string pending_;
  bool in_call_ = false;
  bool decided_ = false;  // llama3_json: whether the reply is a call (starts with '{')
  int calls_ = 0;
  // harmony: in a message's header (up to <|message|>) or its body; the header read so far,
  // what it made the body (its channel and recipient), and a call's body so far.
  bool in_body_ = false;
  std::string header_, channel_, recipient_, call_body_;
};

// The format a forced call (tool_choice "required" or named) is written in for a model whose
// own format is `p`: its own where kvlm has a grammar for it (hermes, qwen3_coder,
// llama3_json); otherwise — no known format, or pythonic — llama3_json's plain JSON calls,
// forced through structured outputs alone as vLLM does, which that parser reads back.
// (Harmony's forced call is harmony_forced_call.)
ToolParser forced_call_format(ToolParser p);

// The grammar of a reply that is one or more calls (parallel: more than one allowed) of the
// given tools (hermes, qwen3_coder, llama3_json; pythonic calls are forced as llama3_json's) ({"type": "function", "function": {name, parameters}}), in the parser's format;
// each call's arguments follow its function's parameters schema. Throws kvlm::Error naming
// the tool whose schema cannot be enforced.
grammar::Grammar tool_call_grammar(ToolParser p, const nlohmann::ordered_json& tools, bool parallel);

// Harmony's forced call (tool_choice naming a function, or "required" with one tool): the
// header the reply starts with — <|channel|>commentary to=functions.NAME <|constrain|>json
// <|message|>, whose markers are special tokens a grammar cannot write, so the server appends
// it to the prompt and the parser reads it before the model's text — and the grammar of the
// arguments the model then writes (the function's parameters schema). The model's analysis
// channel is skipped: the reply is the call. Throws kvlm::Error naming the tool whose schema
// cannot be enforced.
struct ForcedCall {
  std::string prefix;
  grammar::Grammar args;
};
ForcedCall harmony_forced_call(const nlohmann::ordered_json& tool);
// Harmony's forced call among several tools (tool_choice "required"): the header up to the
// function's name after the prompt (<|channel|>commentary to=functions.), and a grammar over
// the rest of the call — a listed function's name, " <|constrain|>json<|message|>" (special
// tokens the grammar names: grammar::Grammar::special_token) and that function's arguments.
// Throws kvlm::Error naming a tool whose schema cannot be enforced.
ForcedCall harmony_required_call(const nlohmann::ordered_json& tools);

}  // namespace kvlm::server

// Tool calling: the Hermes and Llama-3 JSON parsers (whole replies and streamed pieces split
// anywhere), parser detection from chat templates, and chat requests with tools and
// tool_choice (what reaches the template, and the grammar that forces calls).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "text/grammar/matcher.h"
#include "server/protocol.h"
#include "server/tool_calls.h"
#include "protocol_test_util.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::server;
using namespace kvlm::server::testing;

namespace tools_test {

using kvlm::server::ExtractedCalls;
using kvlm::server::ToolCallStream;
using kvlm::server::ToolParser;

// Whether `text` is a whole sentence of `g`.
bool accepts(const kvlm::grammar::Grammar& g, const std::string& text) {
  static const auto vocab = std::make_shared<const kvlm::grammar::TokenVocab>(std::vector<std::string>{"x"});
  kvlm::grammar::Constraint c(std::make_shared<const kvlm::grammar::CompiledGrammar>(g, vocab));
  return c.accept_text(text) && c.can_end();
}

// Streaming the text in two pieces split at every byte, and one byte at a time, gives the calls
// and content of the whole.
void expect_stream_equals_whole(ToolParser p, const std::string& text) {
  const ExtractedCalls whole = kvlm::server::extract_tool_calls(p, text);
  for (size_t cut = 0; cut <= text.size() + 1; ++cut) {
    ToolCallStream s(p);
    std::vector<ToolCallStream::Out> outs;
    if (cut <= text.size()) {
      outs.push_back(s.push(text.substr(0, cut)));
      outs.push_back(s.push(text.substr(cut)));
    } else {  // byte by byte
      for (const char ch : text) outs.push_back(s.push(std::string(1, ch)));
    }
    outs.push_back(s.finish());
    std::string content;
    std::vector<std::string> names;
    for (const auto& o : outs) {
      content += o.content;
      for (const auto& call : o.calls) names.push_back(call.name + call.arguments);
    }
    std::vector<std::string> want;
    for (const auto& call : whole.calls) want.push_back(call.name + call.arguments);
    EXPECT_EQ(names, want) << text << " cut " << cut;
    if (whole.calls.empty()) EXPECT_EQ(content, whole.content) << text << " cut " << cut;
    else EXPECT_EQ(std::string(content.find_first_not_of(" \n") == std::string::npos ? "" : "x"),
                   std::string(whole.content.empty() ? "" : "x"))
        << text << " cut " << cut;
  }
}

TEST(ToolCalls, HermesCallsAreParsedOutOfTheText) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
  const ExtractedCalls x = kvlm::server::extract_tool_calls(ToolParser::Hermes, text);
  ASSERT_EQ(x.calls.size(), 2u);
  EXPECT_EQ(x.calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(x.calls[0].arguments), Json::parse(R"({"city": "Paris", "days": 2})"));
  EXPECT_EQ(x.calls[1].name, "get_time");
  EXPECT_EQ(Json::parse(x.calls[1].arguments), Json::parse(R"({"tz": "CET"})"));  // arguments sent as a string
  EXPECT_EQ(x.content, "Let me check.");
  EXPECT_TRUE(x.calls[0].id.starts_with("call_"));
  EXPECT_NE(x.calls[0].id, x.calls[1].id);
  expect_stream_equals_whole(ToolParser::Hermes, text);
  // Not calls: plain text, a broken call, a tag mentioned in prose.
  for (const std::string t : {"no calls here", "<tool_call>\n{\"name\": }\n</tool_call>", "use <tool_call to call", "a < b"}) {
    const ExtractedCalls y = kvlm::server::extract_tool_calls(ToolParser::Hermes, t);
    EXPECT_TRUE(y.calls.empty()) << t;
    EXPECT_EQ(y.content, t);
    expect_stream_equals_whole(ToolParser::Hermes, t);
  }
  // A reply that ends (EOS) before its closing tag still holds a whole call.
  EXPECT_EQ(kvlm::server::extract_tool_calls(ToolParser::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}").calls.size(), 1u);
}

// A model may write anything: a number past a double's range in a call is not a call (the
// text stays content), in every parser, whole and streamed, and never an exception.
TEST(ToolCalls, NumbersOutOfRangeAreNotCalls) {
  const std::vector<std::pair<ToolParser, std::string>> cases = {
      {ToolParser::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1e400}}\n</tool_call>"},
      {ToolParser::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": \"1e400\"}\n</tool_call>"},
      {ToolParser::Llama3Json, "{\"name\": \"f\", \"parameters\": {\"x\": -1e999}}"},
      {ToolParser::Pythonic, "[f(x=1e400)]"},
  };
  for (const auto& [p, text] : cases) {
    ExtractedCalls x;
    EXPECT_NO_THROW(x = kvlm::server::extract_tool_calls(p, text)) << text;
    EXPECT_TRUE(x.calls.empty()) << text;
    expect_stream_equals_whole(p, text);
  }
  // Harmony and qwen3_coder keep such arguments as the model wrote them.
  ExtractedCalls h;
  EXPECT_NO_THROW(h = kvlm::server::extract_tool_calls(ToolParser::Harmony,
                                                       "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": 1e400}"));
  ASSERT_EQ(h.calls.size(), 1u);
  EXPECT_EQ(h.calls[0].arguments, "{\"x\": 1e400}");
  ExtractedCalls c;
  EXPECT_NO_THROW(c = kvlm::server::extract_tool_calls(
                      ToolParser::Qwen3Coder, "<tool_call>\n<function=f>\n<parameter=x>\n1e400\n</parameter>\n</function>\n</tool_call>"));
  ASSERT_EQ(c.calls.size(), 1u);
  EXPECT_EQ(Json::parse(c.calls[0].arguments), Json::parse(R"({"x": "1e400"})"));
}

TEST(ToolCalls, Llama3JsonCallsAreTheWholeReply) {
  const std::string one = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}";
  const ExtractedCalls x = kvlm::server::extract_tool_calls(ToolParser::Llama3Json, one);
  ASSERT_EQ(x.calls.size(), 1u);
  EXPECT_EQ(x.calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(x.calls[0].arguments), Json::parse(R"({"city": "Oslo"})"));
  EXPECT_TRUE(x.content.empty());
  EXPECT_EQ(kvlm::server::extract_tool_calls(ToolParser::Llama3Json, "<|python_tag|>" + one + "; {\"name\": \"g\", \"parameters\": {}}").calls.size(), 2u);
  for (const std::string t : {"The weather is fine.", "{\"city\": \"no name\"}", "{\"name\": \"f\", \"parameters\": {} trailing"})
    EXPECT_TRUE(kvlm::server::extract_tool_calls(ToolParser::Llama3Json, t).calls.empty()) << t;
  expect_stream_equals_whole(ToolParser::Llama3Json, one);
  expect_stream_equals_whole(ToolParser::Llama3Json, "Plain words {\"name\": \"f\"}");
}

// Harmony (GPT-OSS): the analysis channel is reasoning, final is content, a commentary
// message to functions.NAME is a call; the text as the model writes it after the template's
// "<|start|>assistant", with the stop tokens (<|return|>, <|call|>) already cut off.
TEST(ToolCalls, HarmonySplitsReasoningAnswerAndCalls) {
  using kvlm::server::extract_tool_calls;
  const std::string answer =
      "<|channel|>analysis<|message|>The user greets; reply briefly.<|end|><|start|>assistant<|channel|>final"
      "<|message|>Hello! How can I help?";
  ExtractedCalls x = extract_tool_calls(ToolParser::Harmony, answer);
  EXPECT_EQ(x.reasoning, "The user greets; reply briefly.");
  EXPECT_EQ(x.content, "Hello! How can I help?");
  EXPECT_TRUE(x.calls.empty());
  // A call: the recipient in the header after the channel, or before it; <|constrain|>json.
  for (const std::string call : {std::string("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"),
                                 std::string(" to=functions.get_weather<|channel|>commentary json<|message|>")}) {
    const std::string text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + call +
                             "{\"city\": \"Paris\"}";
    x = extract_tool_calls(ToolParser::Harmony, text);
    EXPECT_EQ(x.reasoning, "Need the weather.") << text;
    ASSERT_EQ(x.calls.size(), 1u) << text;
    EXPECT_EQ(x.calls[0].name, "get_weather");
    EXPECT_EQ(Json::parse(x.calls[0].arguments), Json::parse(R"({"city": "Paris"})"));
    EXPECT_TRUE(x.content.empty());
    expect_stream_equals_whole(ToolParser::Harmony, text);
  }
  // A preamble on commentary is content; a call's body that is not JSON is passed on as written.
  x = extract_tool_calls(ToolParser::Harmony,
                         "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
                         "to=functions.lookup<|message|>not json");
  EXPECT_EQ(x.content, "Checking.");
  ASSERT_EQ(x.calls.size(), 1u);
  EXPECT_EQ(x.calls[0].arguments, "not json");
  // Text outside the format is content; a reply cut inside a header loses only the header.
  EXPECT_EQ(extract_tool_calls(ToolParser::Harmony, "plain words").content, "plain words");
  x = extract_tool_calls(ToolParser::Harmony, "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|chan");
  EXPECT_EQ(x.reasoning, "thinking");
  EXPECT_TRUE(x.content.empty());
  // Streamed in pieces split anywhere (inside markers too), reasoning and content arrive as
  // they are written: no piece of a marker leaks into either.
  for (size_t cut = 0; cut <= answer.size(); ++cut) {
    ToolCallStream s(ToolParser::Harmony);
    auto a = s.push(answer.substr(0, cut));
    auto b = s.push(answer.substr(cut));
    auto c = s.finish();
    EXPECT_EQ(a.reasoning + b.reasoning + c.reasoning, "The user greets; reply briefly.") << cut;
    EXPECT_EQ(a.content + b.content + c.content, "Hello! How can I help?") << cut;
  }
  expect_stream_equals_whole(ToolParser::Harmony, answer);
}

TEST(ToolCalls, ParsersAreNamedAndDetected) {
  EXPECT_EQ(kvlm::server::parse_tool_parser("hermes"), ToolParser::Hermes);
  EXPECT_EQ(kvlm::server::parse_tool_parser("llama3_json"), ToolParser::Llama3Json);
  EXPECT_EQ(kvlm::server::parse_tool_parser("openai"), ToolParser::Harmony);  // vLLM's name for GPT-OSS's
  EXPECT_THROW(kvlm::server::parse_tool_parser("mistral"), kvlm::Error);
  EXPECT_EQ(kvlm::server::detect_tool_parser("{{- '<|start|>assistant<|channel|>final<|message|>' + m.content }}"),
            ToolParser::Harmony);
  const fs::path tpl = fs::path(KVLM_TEST_DATA) / ".." / ".." / "shared" / "data" / "chat-templates";
  if (!fs::exists(tpl)) GTEST_SKIP() << "../shared/data is not beside the repository";
  const auto read = [&](const char* f) {
    std::ifstream in(tpl / f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(kvlm::server::detect_tool_parser(read("Qwen-Qwen3-0.6B.jinja")), ToolParser::Hermes);
  EXPECT_EQ(kvlm::server::detect_tool_parser(read("Qwen-Qwen2.5-7B-Instruct.jinja")), ToolParser::Hermes);
  EXPECT_EQ(kvlm::server::detect_tool_parser(read("meta-llama-Llama-3.1-8B-Instruct.jinja")), ToolParser::Llama3Json);
  EXPECT_EQ(kvlm::server::detect_tool_parser("{{ messages }}"), ToolParser::None);
}

const char* kTools = R"([
  {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
   "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                  "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
   "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}])";

// Qwen3-Coder / Qwen3.5's XML calls: values typed by the tools' schemas, streamed the same.
TEST(ToolCalls, Qwen3CoderCallsAreTypedByTheSchemas) {
  const Json tools = Json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
      "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"},
      "opts": {"type": "object"}, "tags": {"type": ["array", "null"]}}}}}])");
  const std::string text =
      "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\nCity\n</parameter>\n"
      "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n"
      "<parameter=opts>\n{\"metric\": true}\n</parameter>\n<parameter=tags>\nnull\n</parameter>\n"
      "</function>\n</tool_call>";
  const ExtractedCalls x = kvlm::server::extract_tool_calls(ToolParser::Qwen3Coder, text, &tools);
  ASSERT_EQ(x.calls.size(), 1u);
  EXPECT_EQ(x.calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(x.calls[0].arguments),
            Json::parse(R"({"city": "New York\nCity", "days": 3, "zip": "01234", "opts": {"metric": true}, "tags": null})"));
  EXPECT_EQ(x.content, "Let me check.");
  // Without the schemas a value is JSON where it parses.
  const ExtractedCalls u = kvlm::server::extract_tool_calls(ToolParser::Qwen3Coder, text);
  ASSERT_EQ(u.calls.size(), 1u);
  EXPECT_EQ(Json::parse(u.calls[0].arguments)["days"], 3);
  EXPECT_EQ(Json::parse(u.calls[0].arguments)["city"], "New York\nCity");
  expect_stream_equals_whole(ToolParser::Qwen3Coder, text);
  expect_stream_equals_whole(ToolParser::Qwen3Coder, text + "\n" + text);
  // Not a call: text, unchanged.
  for (const std::string bad : {"<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
                                "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<tool_call><function=>\n</function></tool_call>"}) {
    const ExtractedCalls b = kvlm::server::extract_tool_calls(ToolParser::Qwen3Coder, bad, &tools);
    EXPECT_TRUE(b.calls.empty()) << bad;
    EXPECT_EQ(b.content, bad);
  }
  EXPECT_EQ(kvlm::server::parse_tool_parser("qwen3_coder"), ToolParser::Qwen3Coder);
  EXPECT_EQ(kvlm::server::detect_tool_parser(
                "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}{{- '<parameter=' + k + '>\\n' }}"),
            ToolParser::Qwen3Coder);

  // Forced calls: the grammar writes the format, values as their schemas say.
  ModelInfo m = info();
  m.tool_parser = ToolParser::Qwen3Coder;
  const auto r = parse_chat_request(J(std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": )") +
                                      kTools + R"(, "tool_choice": "required"})"),
                                    m, {});
  ASSERT_TRUE(r.gen.grammar);
  const auto accepts = [&](const std::string& t) { return tools_test::accepts(*r.gen.grammar, t); };
  const std::string w = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <3\n</parameter>\n"
                        "</function>\n</tool_call>";
  const std::string add = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n-2\n</parameter>\n"
                          "</function>\n</tool_call>";
  EXPECT_TRUE(accepts(w));
  EXPECT_TRUE(accepts(add));
  EXPECT_TRUE(accepts(w + "\n" + add));  // parallel calls
  EXPECT_TRUE(accepts("<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n<parameter=unit>\n\"C\"\n"
                      "</parameter>\n</function>\n</tool_call>"));
  EXPECT_FALSE(accepts("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"));  // b
  EXPECT_FALSE(accepts("<tool_call>\n<function=add>\n<parameter=a>\none\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                       "</function>\n</tool_call>"));
  EXPECT_FALSE(accepts("Sure."));
  const ExtractedCalls fx = kvlm::server::extract_tool_calls(ToolParser::Qwen3Coder, w + "\n" + add, r.gen.tools.get());
  ASSERT_EQ(fx.calls.size(), 2u);
  EXPECT_EQ(fx.calls[0].arguments, R"({"city":"Paris <3"})");
  EXPECT_EQ(fx.calls[1].arguments, R"({"a":1,"b":-2})");
}

// Pythonic calls (Llama 3.2 / 4): the whole reply is a list of calls with Python literals.
TEST(ToolCalls, PythonicCallsAreTheWholeReply) {
  const std::string text =
      "[get_weather(city='San Francisco', days=3, metric=True, note=\"it's \\\"fine\\\"\\n\", extra=None),"
      " add(a=-1.5e2, b=[1, (2, 3), {'k': false}],), noop()]";
  const ExtractedCalls x = kvlm::server::extract_tool_calls(ToolParser::Pythonic, text);
  ASSERT_EQ(x.calls.size(), 3u) << x.content;
  EXPECT_EQ(x.calls[0].name, "get_weather");
  EXPECT_EQ(Json::parse(x.calls[0].arguments),
            Json::parse(R"({"city": "San Francisco", "days": 3, "metric": true, "note": "it's \"fine\"\n", "extra": null})"));
  EXPECT_EQ(Json::parse(x.calls[1].arguments), Json::parse(R"({"a": -150.0, "b": [1, [2, 3], {"k": false}]})"));
  EXPECT_EQ(x.calls[2].name, "noop");
  EXPECT_EQ(x.calls[2].arguments, "{}");
  EXPECT_TRUE(x.content.empty());
  // Llama 4 wraps them in <|python_start|> ... <|python_end|>.
  const ExtractedCalls w = kvlm::server::extract_tool_calls(ToolParser::Pythonic, "<|python_start|>[f(x='\\u00e9')]<|python_end|>");
  ASSERT_EQ(w.calls.size(), 1u);
  EXPECT_EQ(Json::parse(w.calls[0].arguments)["x"], "\u00e9");
  const ExtractedCalls e = kvlm::server::extract_tool_calls(ToolParser::Pythonic, "[f(x='\\U0001F600')]");
  ASSERT_EQ(e.calls.size(), 1u);
  EXPECT_EQ(Json::parse(e.calls[0].arguments)["x"], "\xF0\x9F\x98\x80");
  EXPECT_TRUE(kvlm::server::extract_tool_calls(ToolParser::Pythonic, "[f(x='\\ud800')]").calls.empty());  // a surrogate
  expect_stream_equals_whole(ToolParser::Pythonic, text);
  expect_stream_equals_whole(ToolParser::Pythonic, "  [f(a=1)]");
  // Anything else is the answer, unchanged (streamed as it comes when it cannot be a call).
  for (const std::string answer : {"The weather is fine.", "[1, 2, 3]", "[f(1)]", "[f(a=)]", "[f(a='x)]", "[]",
                                   "[f(a=1)] and more", "[link](http://x)"}) {
    const ExtractedCalls a = kvlm::server::extract_tool_calls(ToolParser::Pythonic, answer);
    EXPECT_TRUE(a.calls.empty()) << answer;
    EXPECT_EQ(a.content, answer);
    expect_stream_equals_whole(ToolParser::Pythonic, answer);
  }
  EXPECT_EQ(kvlm::server::parse_tool_parser("pythonic"), ToolParser::Pythonic);
  // A forced call is written as a plain JSON call.
  ModelInfo m = info();
  m.tool_parser = ToolParser::Pythonic;
  const auto r = parse_chat_request(J(std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": )") +
                                      kTools + R"(, "tool_choice": "required"})"),
                                    m, {});
  ASSERT_TRUE(r.gen.grammar);
  EXPECT_EQ(r.gen.tool_parser, ToolParser::Llama3Json);
  const auto a = parse_chat_request(J(std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": )") + kTools + "}"),
                                    m, {});
  EXPECT_EQ(a.gen.tool_parser, ToolParser::Pythonic);
  EXPECT_FALSE(a.gen.grammar);
}

TEST(ToolCalls, ChatRequestsWithTools) {
  ModelInfo m = info();
  m.tool_parser = ToolParser::Hermes;
  const auto body = [](const std::string& extra) {
    return J(std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": )") + kTools + extra + "}");
  };
  // auto: tools to the template, calls parsed, nothing forced.
  const auto a = parse_chat_request(body(""), m, {});
  EXPECT_EQ(a.template_kwargs["tools"].size(), 2u);
  EXPECT_EQ(a.gen.tool_parser, ToolParser::Hermes);
  EXPECT_FALSE(a.gen.grammar);
  // none: tools rendered, not parsed.
  const auto n = parse_chat_request(body(R"(, "tool_choice": "none")"), m, {});
  EXPECT_EQ(n.gen.tool_parser, ToolParser::None);
  // required / named: a grammar that admits exactly calls of the chosen tools.
  const auto r = parse_chat_request(body(R"(, "tool_choice": "required")"), m, {});
  ASSERT_TRUE(r.gen.grammar);
  const auto named = parse_chat_request(body(R"(, "tool_choice": {"type": "function", "function": {"name": "add"}})"), m, {});
  ASSERT_TRUE(named.gen.grammar);
  const std::string w = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  const std::string add = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": -2}}\n</tool_call>";
  EXPECT_TRUE(accepts(*r.gen.grammar, w));
  EXPECT_TRUE(accepts(*r.gen.grammar, w + "\n" + add));  // parallel calls
  EXPECT_FALSE(accepts(*r.gen.grammar, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(accepts(*r.gen.grammar, "Sure."));
  EXPECT_TRUE(accepts(*named.gen.grammar, add));
  EXPECT_FALSE(accepts(*named.gen.grammar, w));
  EXPECT_FALSE(accepts(*named.gen.grammar, add + "\n" + add));  // a named function: one call
  const auto single = parse_chat_request(body(R"(, "tool_choice": "required", "parallel_tool_calls": false)"), m, {});
  EXPECT_FALSE(accepts(*single.gen.grammar, w + "\n" + add));
  // What the client gets back from such a reply.
  const ExtractedCalls x = kvlm::server::extract_tool_calls(ToolParser::Hermes, w + "\n" + add);
  ASSERT_EQ(x.calls.size(), 2u);
  EXPECT_EQ(x.calls[1].name, "add");

  // History: an assistant turn with tool_calls (arguments as OpenAI sends them, a string)
  // and the tool's answer.
  const auto h = parse_chat_request(J(std::string(R"({"messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": )") + kTools + "}"),
                                    m, {});
  EXPECT_EQ(h.messages[1]["tool_calls"][0]["function"]["arguments"]["city"], "Paris");
  EXPECT_EQ(h.messages[1]["content"], "");

  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"(, "tool_choice": "sometimes")", "tool_choice"},
      {R"(, "tool_choice": {"type": "function", "function": {"name": "nope"}})", "tool_choice"},
      {R"(, "tool_choice": 3)", "tool_choice"},
      {R"(, "tool_choice": "required", "response_format": {"type": "json_object"})", "tool_choice"},
  };
  for (const auto& [extra, param] : cases) {
    const Outcome o = outcome([&] { parse_chat_request(body(extra), m, {}); });
    EXPECT_EQ(o.status, 400) << extra;
    EXPECT_EQ(o.param, param) << extra << " -> " << o.message;
  }
  for (const auto& [b, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools"},
           {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]})", "tools"},
           {R"({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}})", "tools"},
           {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})", "tool_choice"},
           {R"({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]})", "functions"},
           {R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}]})", "messages"},
           // A number past a double's range parses to an out_of_range error, not a parse error
           // (the fuzzer's find: it escaped as an uncaught exception).
           {R"({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", "arguments": "1e400"}}]}]})", "messages"},
           {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": "{\"maximum\": 1e400}"}}})", "response_format"},
       }) {
    const Outcome o = outcome([&] { parse_chat_request(J(b), m, {}); });
    EXPECT_EQ(o.status, 400) << b;
    EXPECT_EQ(o.param, param) << b << " -> " << o.message;
  }
  // A model without a tool-call format: tools with "auto" are refused (with what to do) ...
  const Outcome none = outcome([&] { parse_chat_request(body(""), info(), {}); });
  EXPECT_EQ(none.param, "tools");
  EXPECT_NE(none.message.find("--tool-call-parser"), std::string::npos);
  EXPECT_NE(none.message.find("required"), std::string::npos);
  EXPECT_EQ(parse_chat_request(body(R"(, "tool_choice": "none")"), info(), {}).gen.tool_parser, ToolParser::None);
  // ... while "required" and a named function are forced through structured outputs, as plain
  // JSON calls that the llama3_json parser reads back.
  const auto fr = parse_chat_request(body(R"(, "tool_choice": "required")"), info(), {});
  ASSERT_TRUE(fr.gen.grammar);
  EXPECT_EQ(fr.gen.tool_parser, ToolParser::Llama3Json);
  const std::string jw = R"({"name": "get_weather", "parameters": {"city": "Paris"}})";
  const std::string ja = R"({"name": "add", "parameters": {"a": 1, "b": 2}})";
  EXPECT_TRUE(accepts(*fr.gen.grammar, jw));
  EXPECT_TRUE(accepts(*fr.gen.grammar, jw + "; " + ja));
  EXPECT_FALSE(accepts(*fr.gen.grammar, "Sure."));
  EXPECT_FALSE(accepts(*fr.gen.grammar, R"({"name": "add", "parameters": {"a": 1}})"));  // b is required
  const auto fn = parse_chat_request(body(R"(, "tool_choice": {"type": "function", "function": {"name": "add"}})"), info(), {});
  EXPECT_TRUE(accepts(*fn.gen.grammar, ja));
  EXPECT_FALSE(accepts(*fn.gen.grammar, jw));
  const ExtractedCalls fx = kvlm::server::extract_tool_calls(fr.gen.tool_parser, jw + "; " + ja);
  ASSERT_EQ(fx.calls.size(), 2u);
  EXPECT_EQ(fx.calls[0].name, "get_weather");
  EXPECT_EQ(fx.calls[1].arguments, R"({"a":1,"b":2})");
}

}  // namespace tools_test

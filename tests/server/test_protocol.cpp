// The server's pure parts: request parsing and validation (every error an OpenAI-shaped
// 400/404 naming the parameter), SSE framing, Prometheus text, the per-request stream
// (detokenization and stop strings on the engine thread) and the response assembler
// (streamed chunks add up to the non-streamed response). Tool calls: test_tool_calls.cpp.
#include <set>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>

#include "core/error.h"
#include "text/grammar/matcher.h"
#include "text/text_processor.h"
#include "server/prometheus.h"
#include "server/protocol.h"
#include "server/request_stream.h"
#include "server/response.h"
#include "protocol_test_util.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::server;
using namespace kvlm::server::testing;

namespace {

const std::filesystem::path kTinyChat = std::filesystem::path(KVLM_TEST_DATA) / "models" / "tiny-chat";

Outcome completion(const std::string& body, const ApiLimits& lim = {}) {
  return outcome([&] { parse_completion_request(J(body), info(), lim); });
}
Outcome chat(const std::string& body, const ApiLimits& lim = {}) {
  return outcome([&] { parse_chat_request(J(body), info(), lim); });
}

}  // namespace

TEST(Protocol, ParseBody) {
  const ApiLimits lim;
  EXPECT_EQ(parse_body(R"({"a": 1})", lim)["a"], 1);
  for (const char* bad : {"", "   ", "{", "[1, 2]", "\"x\"", "{\"a\": }", "{} x", "nul"}) {
    const Outcome o = outcome([&] { parse_body(bad, lim); });
    EXPECT_EQ(o.status, 400) << bad;
    EXPECT_FALSE(o.message.empty());
  }
  // Invalid UTF-8 inside a string is malformed JSON.
  EXPECT_EQ(outcome([&] { parse_body("{\"a\": \"\xff\"}", lim); }).status, 400);
  // Deep nesting is refused before anything recurses over it.
  std::string deep = "{\"a\": " + std::string(100, '[') + std::string(100, ']') + "}";
  const Outcome o = outcome([&] { parse_body(deep, lim); });
  EXPECT_EQ(o.status, 400);
  EXPECT_NE(o.message.find("nested deeper than 64"), std::string::npos) << o.message;
  std::string ok = "{\"a\": " + std::string(60, '[') + std::string(60, ']') + "}";
  EXPECT_NO_THROW(parse_body(ok, lim));
  // A number beyond a double is a 400 naming where it is.
  const Outcome big = outcome([&] { parse_body(R"({"prompt": [1, 1e400], "n": 1})", lim); });
  EXPECT_EQ(big.status, 400);
  EXPECT_EQ(big.param, "prompt[1]") << big.message;
  EXPECT_EQ(outcome([&] { parse_body(R"({"max_tokens": -1e400})", lim); }).param, "max_tokens");
}

TEST(Protocol, ErrorMessagesCarryNoPaths) {
  EXPECT_EQ(without_paths("/srv/models/qwen/chat template:3:5: unknown filter 'x'"), "chat template:3:5: unknown filter 'x'");
  EXPECT_EQ(without_paths("check `slot >= 0` failed at /work/main/src/attention/cpu_backend.cpp:47: slot out of range"),
            "check `slot >= 0` failed at cpu_backend.cpp:47: slot out of range");
  EXPECT_EQ(without_paths("cannot open '/home/u/m/config.json' (No such file)"), "cannot open 'config.json' (No such file)");
  EXPECT_EQ(without_paths("a/b and 1/2 and / alone and /one"), "a/b and 1/2 and / alone and /one");  // not paths
}

TEST(Protocol, ErrorJsonShape) {
  const Json e = error_json(ApiError(400, "max_tokens must be at least 1", "max_tokens"));
  EXPECT_EQ(e["error"]["message"], "max_tokens must be at least 1");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["param"], "max_tokens");
  EXPECT_TRUE(e["error"]["code"].is_null());
  EXPECT_EQ(error_json(401, "no key")["error"]["type"], "authentication_error");
  EXPECT_EQ(error_json(404, "x", "model", "model_not_found")["error"]["code"], "model_not_found");
  EXPECT_EQ(error_json(503, "x")["error"]["type"], "service_unavailable_error");
  EXPECT_TRUE(error_json(500, "x")["error"]["param"].is_null());
}

TEST(Protocol, PromptShapes) {
  auto r = parse_completion_request(J(R"({"prompt": "hello"})"), info(), {});
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(*r.prompts[0].text, "hello");
  r = parse_completion_request(J(R"({"prompt": ["a", "b", "c"]})"), info(), {});
  ASSERT_EQ(r.prompts.size(), 3u);
  EXPECT_EQ(*r.prompts[2].text, "c");
  r = parse_completion_request(J(R"({"prompt": [1, 2, 3]})"), info(), {});
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_FALSE(r.prompts[0].text);
  EXPECT_EQ(r.prompts[0].ids, (std::vector<TokenId>{1, 2, 3}));
  r = parse_completion_request(J(R"({"prompt": [[1, 2], [3]]})"), info(), {});
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].ids, (std::vector<TokenId>{3}));

  for (const char* bad : {R"({})", R"({"prompt": null})", R"({"prompt": 5})", R"({"prompt": []})", R"({"prompt": [[]]})",
                          R"({"prompt": ["a", 1]})", R"({"prompt": [1, "a"]})", R"({"prompt": [[1], 2]})",
                          R"({"prompt": [true]})", R"({"prompt": [1.5]})", R"({"prompt": [-1]})", R"({"prompt": [1024]})",
                          R"({"prompt": [[1, 99999999999]]})", R"({"prompt": {"a": 1}})"}) {
    const Outcome o = completion(bad);
    EXPECT_EQ(o.status, 400) << bad;
    EXPECT_EQ(o.param, "prompt") << bad;
  }
  ModelInfo no_tok = info();
  no_tok.has_tokenizer = false;
  EXPECT_EQ(outcome([&] { parse_completion_request(J(R"({"prompt": "hi"})"), no_tok, {}); }).param, "prompt");
  EXPECT_NO_THROW(parse_completion_request(J(R"({"prompt": [5]})"), no_tok, {}));
}

TEST(Protocol, Defaults) {
  ModelInfo m = info();
  m.default_temperature = 0.6f;
  m.default_top_p = 0.9f;
  m.default_top_k = 20;
  const auto r = parse_completion_request(J(R"({"prompt": "x", "unknown_field": {"nested": [1]}, "user": "u"})"), m, {});
  EXPECT_FLOAT_EQ(r.gen.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(r.gen.sampling.top_p, 0.9f);
  EXPECT_EQ(r.gen.sampling.top_k, 20);
  EXPECT_EQ(r.gen.n, 1);
  EXPECT_FALSE(r.gen.max_tokens);
  EXPECT_FALSE(r.gen.seed);
  EXPECT_FALSE(r.gen.stream);
  EXPECT_FALSE(r.gen.logprobs);
  EXPECT_TRUE(r.gen.skip_special_tokens);
  const auto r2 = parse_completion_request(J(R"({"prompt": "x", "temperature": 0, "top_p": 1, "top_k": -1, "seed": -1})"), m, {});
  EXPECT_FLOAT_EQ(r2.gen.sampling.temperature, 0.0f);
  EXPECT_EQ(r2.gen.sampling.top_k, -1);
  EXPECT_FALSE(r2.gen.seed);  // -1 = random
  // Nulls mean "unset", as OpenAI reads them.
  const auto r3 = parse_completion_request(J(R"({"prompt": "x", "temperature": null, "max_tokens": null, "stop": null})"), m, {});
  EXPECT_FLOAT_EQ(r3.gen.sampling.temperature, 0.6f);
  EXPECT_FALSE(r3.gen.max_tokens);
}

TEST(Protocol, EveryParameterParses) {
  const auto r = parse_completion_request(
      J(R"({"model": "tiny", "prompt": "x", "n": 3, "max_tokens": 7, "min_tokens": 2, "temperature": 0.5, "top_p": 0.8,
            "top_k": 5, "min_p": 0.1, "seed": 42, "stop": ["a", "bc"], "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "repetition_penalty": 1.2, "logprobs": 3, "echo": true, "ignore_eos": true, "stream": true,
            "stream_options": {"include_usage": true}, "stop_token_ids": [7, 8], "skip_special_tokens": false,
            "include_stop_str_in_output": true, "return_token_ids": true, "best_of": 3, "logit_bias": {}, "suffix": ""})"),
      info(), {});
  const GenParams& g = r.gen;
  EXPECT_EQ(g.n, 3);
  EXPECT_EQ(*g.max_tokens, 7);
  EXPECT_EQ(g.min_tokens, 2);
  EXPECT_FLOAT_EQ(g.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(g.sampling.top_p, 0.8f);
  EXPECT_EQ(g.sampling.top_k, 5);
  EXPECT_FLOAT_EQ(g.sampling.min_p, 0.1f);
  EXPECT_EQ(*g.seed, 42u);
  EXPECT_EQ(g.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_FLOAT_EQ(g.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(g.sampling.frequency_penalty, -0.5f);
  EXPECT_FLOAT_EQ(g.sampling.repetition_penalty, 1.2f);
  EXPECT_EQ(*g.logprobs, 3);
  EXPECT_TRUE(g.echo);
  EXPECT_TRUE(g.ignore_eos);
  EXPECT_TRUE(g.stream);
  EXPECT_TRUE(g.include_usage);
  EXPECT_EQ(g.stop_token_ids, (std::vector<TokenId>{7, 8}));
  EXPECT_FALSE(g.skip_special_tokens);
  EXPECT_TRUE(g.include_stop_str_in_output);
  EXPECT_TRUE(g.return_token_ids);
  // A single stop string, and integral floats for integers (pydantic accepts 2.0).
  const auto r2 = parse_completion_request(J(R"({"prompt": "x", "stop": "\n", "max_tokens": 2.0, "n": 1.0})"), info(), {});
  EXPECT_EQ(r2.gen.stop, (std::vector<std::string>{"\n"}));
  EXPECT_EQ(*r2.gen.max_tokens, 2);
}

TEST(Protocol, InvalidParametersAre400WithTheirName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("max_tokens": 0)", "max_tokens"},
      {R"("max_tokens": -5)", "max_tokens"},
      {R"("max_tokens": "10")", "max_tokens"},
      {R"("max_tokens": 1.5)", "max_tokens"},
      {R"("max_tokens": true)", "max_tokens"},
      {R"("min_tokens": -1)", "min_tokens"},
      {R"("max_tokens": 3, "min_tokens": 4)", "min_tokens"},
      {R"("n": 0)", "n"},
      {R"("n": 129)", "n"},
      {R"("n": 1000000)", "n"},
      {R"("n": "2")", "n"},
      {R"("temperature": -0.1)", "temperature"},
      {R"("temperature": 2.5)", "temperature"},
      {R"("temperature": "hot")", "temperature"},
      {R"("top_p": 0)", "top_p"},
      {R"("top_p": 1.1)", "top_p"},
      {R"("top_k": -2)", "top_k"},
      {R"("top_k": 2.5)", "top_k"},
      {R"("min_p": 1.5)", "min_p"},
      {R"("presence_penalty": 3)", "presence_penalty"},
      {R"("frequency_penalty": -2.5)", "frequency_penalty"},
      {R"("repetition_penalty": 0)", "repetition_penalty"},
      {R"("repetition_penalty": -1)", "repetition_penalty"},
      {R"("seed": "x")", "seed"},
      {R"("seed": 1e30)", "seed"},
      {R"("stop": 5)", "stop"},
      {R"("stop": [5])", "stop"},
      {R"("stop": [""])", "stop"},
      {R"("stop": "")", "stop"},
      {R"("stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"])", "stop"},
      {R"("stop_token_ids": [99999])", "stop_token_ids"},
      {R"("stop_token_ids": 5)", "stop_token_ids"},
      {R"("logprobs": 21)", "logprobs"},
      {R"("logprobs": -1)", "logprobs"},
      {R"("logprobs": true)", "logprobs"},
      {R"("echo": "yes")", "echo"},
      {R"("stream": 1)", "stream"},
      {R"("stream_options": {"include_usage": true})", "stream_options"},
      {R"("stream": true, "stream_options": 3)", "stream_options"},
      {R"("stream": true, "stream_options": {"include_usage": "yes"})", "stream_options.include_usage"},
      {R"("max_tokens": 18446744073709551616)", "max_tokens"},
      {R"("max_tokens": 4294967297)", "max_tokens"},
      {R"("n": 1e20)", "n"},
      {R"("seed": 36893488147419103232)", "seed"},
      {R"("repetition_penalty": 1e308)", "repetition_penalty"},
      {R"("top_k": 18446744073709551616)", "top_k"},
      {R"("echo": true, "logprobs": 99999999999999999999)", "logprobs"},
      {R"("ignore_eos": "no")", "ignore_eos"},
      {R"("logit_bias": {"1024": 10})", "logit_bias"},
      {R"("logit_bias": {"5": 100.5})", "logit_bias"},
      {R"("logit_bias": {"-1": 1})", "logit_bias"},
      {R"("logit_bias": {"five": 1})", "logit_bias"},
      {R"("logit_bias": {"5": "1"})", "logit_bias"},
      {R"("logit_bias": [1])", "logit_bias"},
      {R"("response_format": {"type": "json_schema"})", "response_format"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "x"}})", "response_format"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}})", "response_format"},
      {R"("response_format": {"type": "yaml"})", "response_format"},
      {R"("guided_regex": "(a")", "guided_regex"},
      {R"("guided_regex": "(a)\\1")", "guided_regex"},
      {R"("guided_choice": [])", "guided_choice"},
      {R"("guided_choice": ["a", 1])", "guided_choice"},
      {R"("guided_json": "{not json")", "guided_json"},
      {R"("guided_grammar": "root ::= missing")", "guided_grammar"},
      {R"("structured_outputs": {"regex": "a", "choice": ["b"]})", "structured_outputs.choice"},
      {R"("structured_outputs": {"structural_tag": "x"})", "structured_outputs.structural_tag"},
      {R"("structured_outputs": [1])", "structured_outputs"},
      {R"("guided_regex": "a", "response_format": {"type": "json_object"})", "guided_regex"},
      {R"("guided_whitespace_pattern": " ")", "guided_whitespace_pattern"},
      {R"("suffix": "tail")", "suffix"},
      {R"("best_of": 4)", "best_of"},
      {R"("model": 5)", "model"},
  };
  for (const auto& [fields, param] : cases) {
    const Outcome o = completion(R"({"prompt": "x", )" + fields + "}");
    EXPECT_EQ(o.status, 400) << fields;
    EXPECT_EQ(o.param, param) << fields << " -> " << o.message;
    EXPECT_FALSE(o.message.empty());
  }
  // A stop string longer than the limit.
  EXPECT_EQ(completion(R"({"prompt": "x", "stop": ")" + std::string(1025, 'a') + "\"}").param, "stop");
  // Too many choices in one request.
  ApiLimits lim;
  lim.max_choices = 10;
  EXPECT_EQ(completion(R"({"prompt": ["a", "b", "c"], "n": 4})", lim).param, "n");
  EXPECT_EQ(completion(R"({"prompt": ["a", "b"], "n": 5})", lim).status, 0);
  // An unknown model is 404 model_not_found, as OpenAI and vLLM answer.
  const Outcome m = completion(R"({"prompt": "x", "model": "gpt-4"})");
  EXPECT_EQ(m.status, 404);
  EXPECT_EQ(m.code, "model_not_found");
  EXPECT_EQ(completion(R"({"prompt": "x", "model": "tiny"})").status, 0);
}

TEST(Protocol, StructuredOutputsAndLogitBias) {
  // Every field that carries a constraint gives a grammar; equal constraints, equal keys.
  const std::vector<std::string> bodies = {
      R"({"prompt": "x", "response_format": {"type": "json_object"}})",
      R"({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}})",
      R"({"prompt": "x", "guided_json": "{\"type\": \"array\"}"})",
      R"({"prompt": "x", "guided_regex": "[0-9]+"})",
      R"({"prompt": "x", "guided_choice": ["yes", "no"]})",
      R"({"prompt": "x", "guided_grammar": "root ::= \"a\"+"})",
      R"({"prompt": "x", "structured_outputs": {"json": {"type": "boolean"}, "disable_any_whitespace": true}})",
      R"({"prompt": "x", "structured_outputs": {"regex": "b+"}})",
      R"({"prompt": "x", "structured_outputs": {"choice": ["c"]}})",
      R"({"prompt": "x", "structured_outputs": {"grammar": "root ::= [a-z]"}})",
      R"({"prompt": "x", "structured_outputs": {"json_object": true}})",
  };
  std::set<std::string> keys;
  for (const auto& b : bodies) {
    const auto r = parse_completion_request(J(b), info(), {});
    ASSERT_TRUE(r.gen.grammar) << b;
    EXPECT_FALSE(r.gen.grammar_key.empty());
    keys.insert(r.gen.grammar_key);
  }
  EXPECT_EQ(keys.size(), bodies.size() - 1);  // json_object twice (response_format and structured_outputs)
  EXPECT_FALSE(parse_completion_request(J(R"({"prompt": "x", "response_format": {"type": "text"}})"), info(), {}).gen.grammar);
  const auto chat = parse_chat_request(
      J(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})"), info(), {});
  EXPECT_TRUE(chat.gen.grammar);
  ModelInfo no_tok = info();
  no_tok.has_tokenizer = false;
  EXPECT_EQ(outcome([&] { parse_completion_request(J(R"({"prompt": [1], "guided_regex": "a"})"), no_tok, {}); }).param,
            "guided_regex");

  const auto lb = parse_completion_request(J(R"({"prompt": "x", "logit_bias": {"5": 10, "1023": -100}})"), info(), {});
  ASSERT_EQ(lb.gen.logit_bias.size(), 2u);
  EXPECT_EQ(lb.gen.logit_bias[0], (std::pair<TokenId, float>{5, 10.0f}));
  EXPECT_EQ(lb.gen.logit_bias[1], (std::pair<TokenId, float>{1023, -100.0f}));
}

TEST(Protocol, Chat) {
  const auto r = parse_chat_request(
      J(R"({"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                         {"role": "assistant", "content": null}],
            "max_tokens": 9, "max_completion_tokens": 5, "logprobs": true, "top_logprobs": 4,
            "chat_template_kwargs": {"enable_thinking": false}, "add_generation_prompt": false})"),
      info(), {});
  EXPECT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[1]["content"], "a\nb");
  EXPECT_EQ(*r.gen.max_tokens, 5);  // max_completion_tokens wins
  EXPECT_EQ(*r.gen.logprobs, 4);
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_EQ(r.template_kwargs["enable_thinking"], false);
  EXPECT_EQ(*parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})"), info(), {})
                 .gen.logprobs,
            0);
  EXPECT_FALSE(parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": false})"), info(), {})
                   .gen.logprobs);

  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({})", "messages"},
      {R"({"messages": []})", "messages"},
      {R"({"messages": "hi"})", "messages"},
      {R"({"messages": [1]})", "messages"},
      {R"({"messages": [{"content": "x"}]})", "messages"},
      {R"({"messages": [{"role": 3, "content": "x"}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": 3}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})", "messages"},
      {R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21})", "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "logprobs": 1})", "logprobs"},
      {R"({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0})", "max_completion_tokens"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})", "tools"},
      {R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"})", "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "x"}], "echo": true})", "echo"},
      {R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1})", "chat_template_kwargs"},
  };
  for (const auto& [body, param] : cases) {
    const Outcome o = chat(body);
    EXPECT_EQ(o.status, 400) << body;
    EXPECT_EQ(o.param, param) << body << " -> " << o.message;
  }
  ModelInfo no_tpl = info();
  no_tpl.has_chat_template = false;
  EXPECT_EQ(outcome([&] { parse_chat_request(J(R"({"messages": [{"role": "user", "content": "x"}]})"), no_tpl, {}); }).status,
            400);
}

TEST(Protocol, MaxTokensAgainstTheContext) {
  GenParams g;
  EXPECT_EQ(resolve_max_tokens(g, 10, 100, false), 16);  // completions default
  EXPECT_EQ(resolve_max_tokens(g, 90, 100, false), 10);  // ... within the context
  EXPECT_EQ(resolve_max_tokens(g, 10, 100, true), 90);   // chat: the rest of the context
  g.max_tokens = 90;
  EXPECT_EQ(resolve_max_tokens(g, 10, 100, false), 90);
  g.max_tokens = 91;
  Outcome o = outcome([&] { resolve_max_tokens(g, 10, 100, false); });
  EXPECT_EQ(o.status, 400);
  EXPECT_EQ(o.code, "context_length_exceeded");
  EXPECT_EQ(o.param, "max_tokens");
  EXPECT_NE(o.message.find("at most 90"), std::string::npos) << o.message;
  g.max_tokens.reset();
  o = outcome([&] { resolve_max_tokens(g, 100, 100, false); });
  EXPECT_EQ(o.code, "context_length_exceeded");
  EXPECT_EQ(o.param, "prompt");
  o = outcome([&] { resolve_max_tokens(g, 250, 100, true); });
  EXPECT_EQ(o.param, "messages");
  g.min_tokens = 20;
  EXPECT_EQ(outcome([&] { resolve_max_tokens(g, 90, 100, false); }).param, "min_tokens");
}

TEST(Protocol, SseFraming) {
  EXPECT_EQ(sse_event(Json{{"a", 1}}), "data: {\"a\":1}\n\n");
  EXPECT_EQ(std::string(kSseDone), "data: [DONE]\n\n");
  // Newlines inside strings are escaped, so an event is always one line.
  const std::string ev = sse_event(Json{{"text", "a\nb\n\nc"}});
  EXPECT_EQ(ev.find('\n'), ev.size() - 2);
  // Invalid UTF-8 (a token that is half a character) becomes U+FFFD, never a broken event.
  EXPECT_EQ(dump(Json{{"t", std::string("a\xe4\xbd")}}), "{\"t\":\"a\xef\xbf\xbd\"}");
  EXPECT_EQ(make_request_id("cmpl-").size(), 5u + 32u);
  EXPECT_NE(make_request_id("cmpl-"), make_request_id("cmpl-"));
}

TEST(Prometheus, Format) {
  EngineStats s;
  s.num_running = 3;
  s.num_waiting = 2;
  s.kv_usage = 0.25;
  s.prompt_tokens_total = 100;
  s.generation_tokens_total = 50;
  s.preemptions_total = 4;
  s.recomputed_tokens_total = 9;
  s.kv_offload_capacity = 10;
  s.kv_offload_pages = 3;
  s.kv_offload_restored_bytes_total = 4096;
  s.kv_offload_restore_seconds_total = 0.5;
  s.kv_offload_disk_capacity = 40;
  s.kv_offload_disk_pages = 12;
  s.kv_offload_disk_read_total = 3;
  s.kv_offload_disk_bytes_per_page = 1000;
  s.kv_offload_disk_damaged_total = 1;
  s.requests_finished_total["stop"] = 5;
  s.requests_finished_total["length"] = 2;
  s.time_to_first_token = Histogram({0.1, 1.0});
  s.time_to_first_token.counts = {1, 2, 3};  // <=0.1, <=1, +Inf
  s.time_to_first_token.count = 6;
  s.time_to_first_token.sum = 12.5;
  HttpStats h;
  h.responses_by_status[200] = 7;
  h.responses_by_status[400] = 1;
  const std::string t = format_prometheus(s, h, "my \"model\"");
  auto has = [&](const std::string& line) { return t.find(line + "\n") != std::string::npos; };
  const std::string L = "model_name=\"my \\\"model\\\"\"";
  EXPECT_TRUE(has("kvlm:num_requests_running{" + L + "} 3")) << t;
  EXPECT_TRUE(has("kvlm:num_requests_waiting{" + L + "} 2"));
  EXPECT_TRUE(has("kvlm:kv_cache_usage_perc{" + L + "} 0.25"));
  EXPECT_TRUE(has("# TYPE kvlm:prompt_tokens_total counter"));
  EXPECT_TRUE(has("kvlm:prompt_tokens_total{" + L + "} 100"));
  EXPECT_TRUE(has("kvlm:generation_tokens_total{" + L + "} 50"));
  EXPECT_TRUE(has("kvlm:num_preemptions_total{" + L + "} 4"));
  EXPECT_TRUE(has("kvlm:recomputed_tokens_total{" + L + "} 9"));
  EXPECT_TRUE(has("kvlm:kv_offload_pages{" + L + "} 3"));
  EXPECT_TRUE(has("kvlm:kv_offload_capacity_pages{" + L + "} 10"));
  EXPECT_TRUE(has("kvlm:kv_offload_restored_bytes_total{" + L + "} 4096"));
  EXPECT_TRUE(has("kvlm:kv_offload_restore_seconds_total{" + L + "} 0.5"));
  EXPECT_TRUE(has("kvlm:kv_offload_disk_pages{" + L + "} 12"));
  EXPECT_TRUE(has("kvlm:kv_offload_disk_capacity_pages{" + L + "} 40"));
  EXPECT_TRUE(has("kvlm:kv_offload_disk_read_pages_total{" + L + "} 3"));
  EXPECT_TRUE(has("kvlm:kv_offload_disk_read_bytes_total{" + L + "} 3000"));
  EXPECT_TRUE(has("kvlm:kv_offload_disk_damaged_total{" + L + "} 1"));
  EXPECT_TRUE(has("kvlm:request_success_total{" + L + ",finished_reason=\"stop\"} 5"));
  EXPECT_TRUE(has("kvlm:request_success_total{" + L + ",finished_reason=\"abort\"} 0"));  // always present
  EXPECT_TRUE(has("# TYPE kvlm:time_to_first_token_seconds histogram"));
  EXPECT_TRUE(has("kvlm:time_to_first_token_seconds_bucket{" + L + ",le=\"0.1\"} 1"));  // cumulative
  EXPECT_TRUE(has("kvlm:time_to_first_token_seconds_bucket{" + L + ",le=\"1\"} 3"));
  EXPECT_TRUE(has("kvlm:time_to_first_token_seconds_bucket{" + L + ",le=\"+Inf\"} 6"));
  EXPECT_TRUE(has("kvlm:time_to_first_token_seconds_sum{" + L + "} 12.5"));
  EXPECT_TRUE(has("kvlm:time_to_first_token_seconds_count{" + L + "} 6"));
  EXPECT_TRUE(has("kvlm:http_responses_total{" + L + ",status=\"400\"} 1"));
  // vLLM's names for the same figures, so that dashboards built for vLLM show them.
  EXPECT_TRUE(has("vllm:num_requests_running{" + L + "} 3"));
  EXPECT_TRUE(has("vllm:kv_cache_usage_perc{" + L + "} 0.25"));
  EXPECT_TRUE(has("vllm:gpu_cache_usage_perc{" + L + "} 0.25"));
  EXPECT_TRUE(has("# TYPE vllm:prompt_tokens_total counter"));
  EXPECT_TRUE(has("vllm:generation_tokens_total{" + L + "} 50"));
  EXPECT_TRUE(has("vllm:request_success_total{" + L + ",finished_reason=\"stop\"} 5"));
  EXPECT_TRUE(has("vllm:time_to_first_token_seconds_bucket{" + L + ",le=\"1\"} 3"));
  EXPECT_TRUE(has("vllm:time_per_output_token_seconds_count{" + L + "} 0"));
  EXPECT_EQ(t.find("vllm:http_responses_total"), std::string::npos);  // kvlm's own: no alias
  // Every sample line: name{labels} value, and every name has HELP and TYPE.
  std::istringstream in(t);
  std::string line;
  std::map<std::string, int> typed;
  while (std::getline(in, line)) {
    ASSERT_FALSE(line.empty());
    if (line.rfind("# TYPE ", 0) == 0) typed[line.substr(7, line.find(' ', 7) - 7)] = 1;
    if (line[0] == '#') continue;
    const std::string name = line.substr(0, line.find('{'));
    std::string base = name;
    for (const char* suf : {"_bucket", "_sum", "_count"})
      if (!typed.count(base) && base.size() > strlen(suf) && base.compare(base.size() - strlen(suf), strlen(suf), suf) == 0)
        base = base.substr(0, base.size() - strlen(suf));
    EXPECT_TRUE(typed.count(base)) << line;
    EXPECT_NE(line.find("} "), std::string::npos) << line;
  }
}

// --- the engine-thread side: detokenize, hold back stop strings -----------------------------

class StreamTest : public ::testing::Test {
 protected:
  void SetUp() override { text_.emplace(TextProcessor::load(kTinyChat)); }
  const Tokenizer& tok() const { return text_->tokenizer(); }
  std::vector<TokenId> ids(const std::string& s) const { return tok().encode(s, {.add_special_tokens = false}); }
  static RequestOutput out(std::vector<TokenId> toks, bool finished = false, FinishReason r = FinishReason::None) {
    RequestOutput o;
    o.new_tokens = std::move(toks);
    o.finished = finished;
    o.finish_reason = r;
    o.prompt_tokens = 3;
    return o;
  }
  static std::string all_text(RequestStream& s, std::vector<ChoiceEvent>* keep = nullptr) {
    std::vector<ChoiceEvent> evs;
    s.wait(evs, std::chrono::milliseconds(0));
    std::string t;
    for (auto& e : evs) t += e.text;
    if (keep) *keep = std::move(evs);
    return t;
  }
  std::optional<TextProcessor> text_;
};

TEST_F(StreamTest, TextAddsUpToTheDecode) {
  const std::string s = "Hello world, this is a test of streaming text: 12345 ñ 漢字!";
  const auto toks = ids(s);
  RequestStream st(&tok(), {}, 1);
  for (size_t i = 0; i < toks.size(); ++i) EXPECT_TRUE(st.on_output(0, out({toks[i]}, i + 1 == toks.size(), FinishReason::Length)));
  std::vector<ChoiceEvent> evs;
  EXPECT_EQ(all_text(st, &evs), s);
  EXPECT_TRUE(st.done());
  EXPECT_EQ(evs.back().reason, FinishReason::Length);
  EXPECT_EQ(evs.back().completion_tokens, int(toks.size()));
  EXPECT_EQ(evs.back().prompt_tokens, 3);
}

// max_tokens can cut a reply inside a character (a byte-level vocabulary spells 漢 in several
// tokens): the text ends before it, as vLLM's does, never in U+FFFD; the ids keep every token.
TEST_F(StreamTest, AReplyCutInsideACharacterEndsBeforeIt) {
  const auto head = ids("Hello ");
  const auto han = ids("漢");
  ASSERT_GE(han.size(), 1u);
  // The character's first byte alone: its byte-level token (GPT-2's alphabet maps 0xE6 to 'æ').
  const auto first_byte = tok().token_to_id("\u00e6");
  ASSERT_TRUE(first_byte.has_value());
  std::vector<TokenId> toks = head;
  toks.push_back(*first_byte);
  RequestStream st(&tok(), {}, 1);
  for (size_t i = 0; i < toks.size(); ++i) st.on_output(0, out({toks[i]}, i + 1 == toks.size(), FinishReason::Length));
  std::vector<ChoiceEvent> evs;
  EXPECT_EQ(all_text(st, &evs), "Hello ");
  size_t n = 0;
  for (const auto& e : evs) n += e.tokens.size();
  EXPECT_EQ(n, toks.size());
}

TEST_F(StreamTest, StopStringIsNeverEmittedAndStopsTheEngine) {
  const auto toks = ids("The cat sat on the mat. END of story, more text after");
  TextOptions o;
  o.stop = {"END"};
  RequestStream st(&tok(), o, 1);
  std::string seen;
  bool stopped_at = false;
  size_t fed = 0;
  for (; fed < toks.size(); ++fed) {
    const bool more = st.on_output(0, out({toks[fed]}));
    seen += all_text(st);
    EXPECT_EQ(seen.find('E'), std::string::npos) << "part of the stop string leaked: " << seen;
    if (!more) {
      stopped_at = true;
      break;
    }
  }
  ASSERT_TRUE(stopped_at);
  EXPECT_EQ(seen, "The cat sat on the mat. ");
  EXPECT_TRUE(st.all_finished());
  // The engine's own finish after the callback said stop is ignored.
  EXPECT_FALSE(st.on_output(0, out({}, true, FinishReason::Stop)));
  std::vector<ChoiceEvent> evs;
  st.wait(evs, std::chrono::milliseconds(0));
  EXPECT_TRUE(evs.empty());

  // include_stop_str_in_output keeps it.
  o.include_stop_str_in_output = true;
  RequestStream st2(&tok(), o, 1);
  std::string seen2;
  for (TokenId t : toks)
    if (!st2.on_output(0, out({t}))) break;
  std::vector<ChoiceEvent> evs2;
  seen2 = all_text(st2, &evs2);
  EXPECT_EQ(seen2, "The cat sat on the mat. END");
  EXPECT_EQ(*evs2.back().stop_string, "END");
}

TEST_F(StreamTest, HeldBackTextIsReleasedAtTheEnd) {
  const auto toks = ids("abc EN");
  TextOptions o;
  o.stop = {"END"};
  RequestStream st(&tok(), o, 1);
  for (size_t i = 0; i < toks.size(); ++i) st.on_output(0, out({toks[i]}, i + 1 == toks.size(), FinishReason::Length));
  EXPECT_EQ(all_text(st), "abc EN");
}

TEST_F(StreamTest, StopTokensAndEosAreNotShown) {
  const auto toks = ids("hello there");
  const TokenId eos = *text_->eos_id();
  TextOptions o;
  o.eos_token_ids = {eos};
  o.skip_special_tokens = false;  // even shown special tokens: the EOS that ended it is not text
  RequestStream st(&tok(), o, 2);
  for (TokenId t : toks) st.on_output(0, out({t}));
  st.on_output(0, out({eos}, true, FinishReason::Stop));
  std::vector<ChoiceEvent> evs;
  EXPECT_EQ(all_text(st, &evs), "hello there");
  EXPECT_FALSE(evs.back().stop_token);  // EOS is not reported as a stop token
  // A user stop token: hidden too, and reported.
  TextOptions o2;
  o2.stop_token_ids = {toks.back()};
  RequestStream st2(&tok(), o2, 1);
  for (size_t i = 0; i < toks.size(); ++i)
    st2.on_output(0, out({toks[i]}, i + 1 == toks.size(), i + 1 == toks.size() ? FinishReason::Stop : FinishReason::None));
  std::vector<ChoiceEvent> evs2;
  const std::string t2 = all_text(st2, &evs2);
  EXPECT_EQ(t2, tok().decode(std::vector<TokenId>(toks.begin(), toks.end() - 1)));
  EXPECT_EQ(*evs2.back().stop_token, toks.back());
}

TEST_F(StreamTest, ChoicesAreIndependentAndFailFinishes) {
  RequestStream st(&tok(), {}, 3);
  st.on_output(1, out(ids("b")));
  st.on_output(0, out(ids("a"), true, FinishReason::Length));
  st.fail(2, FinishReason::Abort, "gone");
  st.fail(2, FinishReason::Abort, "twice is ignored");
  EXPECT_FALSE(st.all_finished());
  st.on_output(1, out({}, true, FinishReason::Abort));
  EXPECT_TRUE(st.all_finished());
  std::vector<ChoiceEvent> evs;
  st.wait(evs, std::chrono::milliseconds(0));
  ASSERT_EQ(evs.size(), 4u);
  EXPECT_EQ(evs[0].choice, 1);
  EXPECT_EQ(evs[0].text, "b");
  EXPECT_EQ(evs[1].text, "a");
  EXPECT_EQ(evs[2].reason, FinishReason::Abort);
  EXPECT_EQ(evs[2].error, "gone");
  EXPECT_FALSE(st.on_output(7, out({1})));  // an unknown choice
  EXPECT_TRUE(st.done());
}

TEST(StreamNoTokenizer, TokensOnly) {
  RequestStream st(nullptr, {}, 1);
  RequestOutput o;
  o.new_tokens = {4, 5};
  EXPECT_TRUE(st.on_output(0, o));
  std::vector<ChoiceEvent> evs;
  st.wait(evs, std::chrono::milliseconds(0));
  ASSERT_EQ(evs.size(), 1u);
  EXPECT_EQ(evs[0].tokens, (std::vector<TokenId>{4, 5}));
  EXPECT_TRUE(evs[0].text.empty());
}

// --- the HTTP-thread side: chunks add up to the response -----------------------------------

namespace {

std::vector<ChoiceEvent> script() {
  // Two choices interleaved, with logprobs.
  auto ev = [](int c, std::string text, TokenId t, bool fin = false, FinishReason r = FinishReason::None) {
    ChoiceEvent e;
    e.choice = c;
    e.text = std::move(text);
    e.tokens = {t};
    e.logprobs = {TokenLogprobs{t, -0.5f, {{t, -0.5f}, {t + 1, -1.5f}, {t + 2, -std::numeric_limits<float>::infinity()}}}};
    e.finished = fin;
    e.reason = r;
    e.prompt_tokens = 4;
    e.completion_tokens = 1;
    return e;
  };
  std::vector<ChoiceEvent> v{ev(0, "Hel", 10), ev(1, "Wor", 20), ev(0, "lo", 11), ev(1, "ld", 21, true, FinishReason::Length),
                             ev(0, "", 12, true, FinishReason::Stop)};
  v[2].completion_tokens = 2;
  v[3].completion_tokens = 2;
  v[4].completion_tokens = 3;
  v[4].stop_string = "!";
  return v;
}

std::string tok_text(TokenId t) { return "<" + std::to_string(t) + ">"; }

std::vector<Json> parse_sse(const std::string& s, bool* done) {
  std::vector<Json> out;
  *done = false;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = s.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "an event without its blank line";
    if (end == std::string::npos) break;
    const std::string ev = s.substr(pos, end - pos);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    const std::string payload = ev.substr(6);
    if (payload == "[DONE]") *done = true;
    else out.push_back(Json::parse(payload));
    pos = end + 2;
  }
  return out;
}

}  // namespace

TEST(Assembler, StreamedChunksEqualTheResponse) {
  for (Endpoint ep : {Endpoint::Completions, Endpoint::Chat}) {
    GenParams g;
    g.n = 2;
    g.logprobs = 1;
    g.include_usage = true;
    std::vector<ChoiceMeta> meta(2, ChoiceMeta{0, {1, 2, 3, 4}, ""});
    ResponseAssembler whole(ep, "id-1", 100, "m", g, meta, tok_text);
    ResponseAssembler streamed(ep, "id-1", 100, "m", g, meta, tok_text);
    const auto evs = script();
    whole.add(evs);
    const Json resp = whole.response();
    std::string sse = streamed.begin();
    // Deliver in two batches, as the HTTP thread would.
    sse += streamed.chunks({evs.begin(), evs.begin() + 2});
    sse += streamed.chunks({evs.begin() + 2, evs.end()});
    sse += streamed.end();
    bool done = false;
    const auto chunks = parse_sse(sse, &done);
    EXPECT_TRUE(done);
    std::map<int, std::string> text;
    std::map<int, std::string> finish;
    std::map<int, int> lp_count;
    Json usage;
    for (const auto& c : chunks) {
      EXPECT_EQ(c["id"], "id-1");
      EXPECT_EQ(c["object"], ep == Endpoint::Chat ? "chat.completion.chunk" : "text_completion");
      if (c.contains("usage")) {
        usage = c["usage"];
        EXPECT_TRUE(c["choices"].empty());
        continue;
      }
      ASSERT_EQ(c["choices"].size(), 1u);
      const Json& ch = c["choices"][0];
      const int i = ch["index"];
      if (ep == Endpoint::Chat) {
        if (ch["delta"].contains("content")) text[i] += ch["delta"]["content"].get<std::string>();
        if (!ch["logprobs"].is_null()) lp_count[i] += int(ch["logprobs"]["content"].size());
      } else {
        text[i] += ch["text"].get<std::string>();
        if (!ch["logprobs"].is_null()) lp_count[i] += int(ch["logprobs"]["tokens"].size());
      }
      if (!ch["finish_reason"].is_null()) {
        EXPECT_FALSE(finish.count(i)) << "finished twice";
        finish[i] = ch["finish_reason"];
      }
    }
    for (int i = 0; i < 2; ++i) {
      const Json& rc = resp["choices"][size_t(i)];
      const std::string want = ep == Endpoint::Chat ? rc["message"]["content"].get<std::string>() : rc["text"].get<std::string>();
      EXPECT_EQ(text[i], want);
      EXPECT_EQ(finish[i], rc["finish_reason"].get<std::string>());
      const Json& lp = rc["logprobs"];
      EXPECT_EQ(lp_count[i], int(ep == Endpoint::Chat ? lp["content"].size() : lp["tokens"].size()));
    }
    const Json want0 = ep == Endpoint::Chat ? Json{{"role", "assistant"}, {"content", "Hello"}} : Json("Hello");
    EXPECT_EQ(resp["choices"][0][ep == Endpoint::Chat ? "message" : "text"], want0);
    EXPECT_EQ(resp["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(resp["choices"][0]["stop_reason"], "!");
    EXPECT_EQ(resp["choices"][1]["finish_reason"], "length");
    EXPECT_EQ(usage, resp["usage"]);
    EXPECT_EQ(resp["usage"]["prompt_tokens"], 4);  // one prompt, counted once for n = 2
    EXPECT_EQ(resp["usage"]["completion_tokens"], 5);
    EXPECT_EQ(resp["usage"]["total_tokens"], 9);
  }
}

TEST(Assembler, LogprobShapes) {
  GenParams g;
  g.logprobs = 2;
  std::vector<ChoiceMeta> meta{ChoiceMeta{0, {1, 2, 3, 4}, ""}};
  ResponseAssembler c(Endpoint::Completions, "x", 1, "m", g, meta, tok_text);
  c.add(script());
  const Json lp = c.response()["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 3u);
  EXPECT_EQ(lp["tokens"][0], "<10>");
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][0].get<double>(), -0.5);
  EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);  // top-2, the chosen among them
  EXPECT_DOUBLE_EQ(lp["top_logprobs"][0]["<11>"].get<double>(), -1.5);
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][1], 4);  // "<10>" is 4 characters
  ChoiceMeta m2{0, {1, 2, 3, 4}, ""};
  GenParams g0;
  g0.logprobs = 0;
  ResponseAssembler c0(Endpoint::Completions, "x", 1, "m", g0, {m2}, tok_text);
  c0.add(script());
  EXPECT_EQ(c0.response()["choices"][0]["logprobs"]["top_logprobs"][0].size(), 1u);  // logprobs=0: the chosen token only

  GenParams gc;
  gc.logprobs = 3;
  ResponseAssembler ch(Endpoint::Chat, "x", 1, "m", gc, meta, tok_text);
  ch.add(script());
  const Json e = ch.response()["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(e["token"], "<10>");
  EXPECT_EQ(e["bytes"], (Json{'<', '1', '0', '>'}));
  ASSERT_EQ(e["top_logprobs"].size(), 3u);
  EXPECT_DOUBLE_EQ(e["top_logprobs"][2]["logprob"].get<double>(), -9999.0);  // -inf has no JSON form
}

TEST(Assembler, EchoWithPromptLogprobs) {
  GenParams g;
  g.echo = true;
  g.logprobs = 1;
  std::vector<ChoiceMeta> meta{ChoiceMeta{0, {1, 2, 3}, "PROMPT"}};
  ResponseAssembler a(Endpoint::Completions, "x", 1, "m", g, meta, tok_text);
  ChoiceEvent first;
  first.choice = 0;
  first.text = "X";
  first.tokens = {9};
  first.logprobs = {TokenLogprobs{9, -0.1f, {{9, -0.1f}}}};
  first.prompt_logprobs = {TokenLogprobs{2, -1.f, {{2, -1.f}}}, TokenLogprobs{3, -2.f, {{3, -2.f}}}};  // tokens 1..2
  first.finished = true;
  first.reason = FinishReason::Length;
  std::string sse = a.chunks({first});
  bool done = false;
  const auto chunks = parse_sse(sse + std::string(kSseDone), &done);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(chunks[0]["choices"][0]["text"], "PROMPTX");
  const Json lp = chunks[0]["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 4u);  // 3 prompt tokens + 1
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][2].get<double>(), -2.0);
}

TEST(Assembler, FailuresBecomeErrors) {
  GenParams g;
  std::vector<ChoiceMeta> meta(2, ChoiceMeta{0, {1}, ""});
  ResponseAssembler a(Endpoint::Completions, "x", 1, "m", g, meta, tok_text);
  ChoiceEvent e;
  e.choice = 1;
  e.finished = true;
  e.reason = FinishReason::Error;
  e.error = "device lost";
  const std::string sse = a.chunks({e});
  EXPECT_TRUE(sse.empty());  // no finish chunk for a failed choice: the caller sends the error event
  ASSERT_TRUE(a.failure());
  EXPECT_EQ(a.failure()->status(), 500);
  EXPECT_NE(std::string(a.failure()->what()).find("device lost"), std::string::npos);
  ResponseAssembler b(Endpoint::Chat, "x", 1, "m", g, meta, tok_text);
  e.reason = FinishReason::Abort;
  b.add({e});
  EXPECT_EQ(b.failure()->status(), 503);
}

TEST(Logprobs, PromptLogprobsAreVllmsShape) {
  const TokenText text = [](TokenId t) { return "t" + std::to_string(t); };
  // Token 5 ranked 3rd (its own entry and the top 2); token 7 is the top token (one entry).
  const std::vector<TokenLogprobs> lps = {TokenLogprobs{5, -2.5f, {{9, -0.5f}, {8, -1.0f}, {5, -2.5f}}, 3},
                                          TokenLogprobs{7, -0.1f, {{7, -0.1f}, {4, -3.0f}}, 1}};
  const Json j = prompt_logprobs_json(lps, 2, text);
  ASSERT_EQ(j.size(), 3u);
  EXPECT_TRUE(j[0].is_null());
  EXPECT_EQ(j[1].size(), 3u);
  EXPECT_EQ(j[1]["5"], (Json{{"logprob", -2.5}, {"rank", 3}, {"decoded_token", "t5"}}));
  EXPECT_EQ(j[1]["9"]["rank"], 1);
  EXPECT_EQ(j[1]["8"]["rank"], 2);
  EXPECT_EQ(j[2].size(), 2u);
  EXPECT_EQ(j[2]["7"]["rank"], 1);
  EXPECT_EQ(prompt_logprobs_json({}, 2, text), Json::array({nullptr}));  // a one-token prompt
}

// The Responses API's translation (server/responses.h): requests into chat requests, the
// store's chain and limits, the Response object and the streamed events of a reply with
// reasoning, text and a tool call.
#include <gtest/gtest.h>

#include "server/responses.h"

using namespace kvlm::server;

namespace {

ApiError error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return e;
  }
  return ApiError(0, "no error");
}

Json chunk(Json delta, Json finish = nullptr) {
  return Json{{"choices", Json::array({Json{{"index", 0}, {"delta", std::move(delta)}, {"finish_reason", std::move(finish)}}})}};
}

}  // namespace

TEST(Responses, RequestsBecomeChatRequests) {
  const ResponseStore store(10, 1 << 20);
  const Json body = Json::parse(R"({
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0.5,
    "input": [
      {"role": "developer", "content": "Use tools."},
      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add "}, {"type": "input_text", "text": "2 and 3"}]},
      {"type": "reasoning", "summary": []},
      {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\":2,\"b\":3}"},
      {"type": "function_call_output", "call_id": "c1", "output": "5"}],
    "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
    "tool_choice": {"type": "function", "name": "add"},
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "reasoning": {"effort": "low"}, "frobnicate": 1})");
  const ResponsesRequest r = parse_responses_request(body, store);
  const Json& m = r.chat["messages"];
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0], (Json{{"role", "system"}, {"content", "Be brief."}}));
  EXPECT_EQ(m[1], (Json{{"role", "system"}, {"content", "Use tools."}}));  // developer -> system
  EXPECT_EQ(m[2]["content"], "Add 2 and 3");
  EXPECT_EQ(m[3]["role"], "assistant");  // the call as the assistant's tool_calls
  EXPECT_EQ(m[3]["tool_calls"][0]["function"]["name"], "add");
  EXPECT_EQ(m[3]["tool_calls"][0]["id"], "c1");
  EXPECT_EQ(m[4], (Json{{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "5"}}));
  EXPECT_EQ(r.chat["tools"][0]["function"]["name"], "add");
  EXPECT_EQ(r.chat["tool_choice"], (Json{{"type", "function"}, {"function", {{"name", "add"}}}}));
  EXPECT_EQ(r.chat["response_format"]["json_schema"]["name"], "x");
  EXPECT_EQ(r.chat["max_completion_tokens"], 50);
  EXPECT_EQ(r.chat["reasoning_effort"], "low");
  EXPECT_EQ(r.ignored_fields, std::vector<std::string>{"frobnicate"});
  EXPECT_EQ(r.echo["instructions"], "Be brief.");
  EXPECT_EQ(r.input_items.size(), 5u);

  EXPECT_EQ(error_of([&] { parse_responses_request(Json{{"input", "x"}, {"tools", Json::parse(R"([{"type": "file_search"}])")}}, store); }).param(),
            "tools");
  EXPECT_EQ(error_of([&] { parse_responses_request(Json{{"input", "x"}, {"truncation", "auto"}}, store); }).param(), "truncation");
  EXPECT_EQ(error_of([&] { parse_responses_request(Json{{"input", 3}}, store); }).param(), "input");
  EXPECT_EQ(error_of([&] { parse_responses_request(Json{{"input", "x"}, {"previous_response_id", "resp_x"}}, store); }).status(), 404);
  const ResponseStore none(0, 0);
  EXPECT_EQ(error_of([&] { parse_responses_request(Json{{"input", "x"}, {"previous_response_id", "resp_x"}}, none); }).status(), 400);
}

TEST(Responses, TheStoreReplaysChainsAndForgetsTheOldest) {
  ResponseStore store(2, 1 << 20);
  const auto out = [](const char* text) {
    return Json{{"output", Json::array({Json{{"type", "message"}, {"role", "assistant"},
                                            {"content", Json::array({Json{{"type", "output_text"}, {"text", text}}})}}})}};
  };
  const auto in = [](const char* text) { return Json::array({Json{{"type", "message"}, {"role", "user"}, {"content", text}}}); };
  store.put("r1", out("a1"), in("q1"), std::nullopt);
  store.put("r2", out("a2"), in("q2"), "r1");
  const Json conv = store.conversation("r2");
  ASSERT_EQ(conv.size(), 4u);
  EXPECT_EQ(conv[0]["content"], "q1");
  EXPECT_EQ(conv[3]["content"][0]["text"], "a2");
  // The chain continues from a stored response: its messages come first.
  const ResponsesRequest r = parse_responses_request(Json{{"input", "q3"}, {"previous_response_id", "r2"}}, store);
  ASSERT_EQ(r.chat["messages"].size(), 5u);
  EXPECT_EQ(r.chat["messages"][1], (Json{{"role", "assistant"}, {"content", "a1"}}));
  store.put("r3", out("a3"), in("q3"), "r2");  // a third: r1 goes
  EXPECT_EQ(store.size(), 2u);
  EXPECT_FALSE(store.response("r1"));
  const ApiError e = error_of([&] { store.conversation("r3"); });
  EXPECT_EQ(e.status(), 404);
  EXPECT_NE(std::string(e.what()).find("'r1', which this server no longer keeps"), std::string::npos) << e.what();
  EXPECT_TRUE(store.erase("r3"));
  EXPECT_FALSE(store.erase("r3"));
  ResponseStore tiny(10, 300);  // bytes: the newest that fit
  tiny.put("a", out("xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"), in("q"), std::nullopt);
  tiny.put("b", out("yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"), in("q"), std::nullopt);
  EXPECT_FALSE(tiny.response("a"));
  EXPECT_TRUE(tiny.response("b"));
}

TEST(Responses, ChatCompletionsBecomeResponseObjectsAndEvents) {
  const ResponseMeta meta{.id = "resp_1", .created = 7, .model = "m", .echo = Json{{"store", true}}};
  const Json usage = {{"prompt_tokens", 10}, {"completion_tokens", 5}, {"total_tokens", 15},
                      {"prompt_tokens_details", {{"cached_tokens", 4}}}};
  const Json cc = {{"choices", Json::array({Json{{"message", {{"role", "assistant"}, {"reasoning_content", "hmm"}, {"content", nullptr},
                                                             {"tool_calls", Json::array({Json{{"id", "call_1"}, {"type", "function"},
                                                                                              {"function", {{"name", "f"}, {"arguments", "{}"}}}}})}}},
                                                {"finish_reason", "tool_calls"}}})},
                   {"usage", usage}};
  const Json r = response_from_chat(meta, cc);
  EXPECT_EQ(r["status"], "completed");
  ASSERT_EQ(r["output"].size(), 2u);  // reasoning, the call (no empty message beside a call)
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "hmm");
  EXPECT_EQ(r["output"][1]["type"], "function_call");
  EXPECT_EQ(r["output"][1]["call_id"], "call_1");
  EXPECT_EQ(r["usage"]["input_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(r["store"], true);

  ResponsesStream s(meta);
  std::string out = s.begin();
  out += s.events({chunk({{"reasoning_content", "th"}}), chunk({{"reasoning_content", "ink"}}), chunk({{"content", "An"}}),
                   chunk({{"content", "swer"}})});
  out += s.events({chunk({{"tool_calls", Json::array({Json{{"index", 0}, {"id", "call_2"}, {"type", "function"},
                                                           {"function", {{"name", "g"}, {"arguments", "{\"x\":1}"}}}}})}},
                         "length")});
  out += s.end(usage);
  std::vector<std::string> types;
  int last_seq = -1;
  bool ordered = true;
  for (size_t at = out.find("event: "); at != std::string::npos; at = out.find("event: ", at + 1)) {
    const size_t nl = out.find('\n', at);
    types.push_back(out.substr(at + 7, nl - at - 7));
    const size_t data = out.find("data: ", nl);
    const Json j = Json::parse(out.substr(data + 6, out.find('\n', data) - data - 6));
    ordered &= j["type"] == types.back() && j["sequence_number"] == last_seq + 1;
    last_seq = j["sequence_number"];
  }
  EXPECT_TRUE(ordered) << "each event's type matches its event line; sequence numbers count up";
  const std::vector<std::string> want = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
      "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
      "response.output_item.done", "response.incomplete"};
  EXPECT_EQ(types, want);
  const Json& f = s.final_response();
  EXPECT_EQ(f["status"], "incomplete");
  EXPECT_EQ(f["incomplete_details"]["reason"], "max_output_tokens");
  ASSERT_EQ(f["output"].size(), 3u);
  EXPECT_EQ(f["output"][0]["content"][0]["text"], "think");
  EXPECT_EQ(f["output"][1]["content"][0]["text"], "Answer");
  EXPECT_EQ(f["output"][2]["arguments"], "{\"x\":1}");
  const std::string failed = ResponsesStream(meta).failed(ApiError(500, "boom", "", "engine_error"));
  EXPECT_NE(failed.find("\"status\":\"failed\""), std::string::npos);
  EXPECT_NE(failed.find("\"code\":\"engine_error\""), std::string::npos);
}

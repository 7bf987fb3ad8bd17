// The HTTP server over loopback with a scripted engine (no model, fast, deterministic):
// status codes and OpenAI-shaped error bodies, auth, body limits, streaming framing,
// client disconnects aborting engine requests, draining and cancelling at shutdown.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <thread>

#include "core/error.h"
#include "text/tokenizer/tokenizer.h"
#include "server/connections.h"
#include "server/grammar_cache.h"
#include "server/http_server.h"
#include "server/tool_calls.h"
#include "text/grammar/grammar.h"
#include "text/grammar/matcher.h"

using namespace kvlm;
using namespace kvlm::server;
using namespace std::chrono_literals;

namespace {

const std::filesystem::path kTinyChat = std::filesystem::path(KVLM_TEST_DATA) / "models" / "tiny-chat";

// Emits one token per request every step, cycling through `script` (stop_at_end: the reply
// is the script once, ending as a stop token would end it); a prompt starting with 999 is
// refused, one starting with 998 fails with an engine error.
class FakeEngine : public EngineClient {
 public:
  FakeEngine(std::vector<TokenId> script, std::chrono::milliseconds step, bool stop_at_end = false)
      : script_(std::move(script)), step_(step), stop_at_end_(stop_at_end) {
    thread_ = std::thread([this] { run(); });
  }
  ~FakeEngine() override {
    {
      std::lock_guard lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void add_request(EngineRequest r) override {
    if (!r.prompt.empty() && r.prompt[0] == 999) throw Error("the fake engine refuses this prompt");
    std::lock_guard lock(mu_);
    ++accepted_;
    last_prompt_ = r.prompt;
    last_constrained_ = r.constraint != nullptr;
    if (r.constraint) {  // whether the grammar takes the scripted reply, token by token, to an end
      grammar::Constraint probe = *r.constraint;
      last_script_fits_ = std::all_of(script_.begin(), script_.end(), [&](TokenId t) { return probe.accept(t); }) &&
                          probe.can_end();
    }
    live_.push_back({std::move(r), 0});
    cv_.notify_all();
  }
  void abort(const std::string& id) override {
    std::lock_guard lock(mu_);
    aborted_.insert(id);
  }
  EngineStats stats() const override {
    std::lock_guard lock(mu_);
    EngineStats s;
    s.num_running = int(live_.size());
    s.requests_total = accepted_;
    s.generation_tokens_total = generated_;
    return s;
  }
  bool was_aborted(const std::string& prefix) const {
    std::lock_guard lock(mu_);
    for (const auto& id : aborted_)
      if (id.rfind(prefix, 0) == 0) return true;
    return false;
  }
  size_t num_aborted() const {
    std::lock_guard lock(mu_);
    return aborted_.size();
  }
  int live() const {
    std::lock_guard lock(mu_);
    return int(live_.size());
  }
  // The prompt of the last request added, and whether a grammar constrained it.
  std::vector<TokenId> last_prompt() const {
    std::lock_guard lock(mu_);
    return last_prompt_;
  }
  bool last_constrained() const {
    std::lock_guard lock(mu_);
    return last_constrained_;
  }
  bool last_script_fits() const {
    std::lock_guard lock(mu_);
    return last_script_fits_;
  }

 private:
  struct Live {
    EngineRequest req;
    int produced;
  };
  void run() {
    std::unique_lock lock(mu_);
    while (!quit_) {
      cv_.wait_for(lock, step_, [&] { return quit_; });
      std::vector<std::pair<OutputCallback, RequestOutput>> outs;
      for (auto it = live_.begin(); it != live_.end();) {
        RequestOutput o;
        o.id = it->req.id;
        o.prompt_tokens = int(it->req.prompt.size());
        bool done = false;
        if (aborted_.count(it->req.id)) {
          o.finished = true;
          o.finish_reason = FinishReason::Abort;
          done = true;
        } else if (it->req.prompt[0] == 998) {
          o.finished = true;
          o.finish_reason = FinishReason::Error;
          o.error = "simulated device failure";
          done = true;
        } else {
          const TokenId t = script_[size_t(it->produced) % script_.size()];
          ++it->produced;
          ++generated_;
          o.new_tokens = {t};
          if (it->req.logprobs > 0) o.new_logprobs = {TokenLogprobs{t, -0.25f, {{t, -0.25f}}}};
          o.completion_tokens = it->produced;
          if (stop_at_end_ && size_t(it->produced) == script_.size()) {
            o.finished = true;
            o.finish_reason = FinishReason::Stop;
            done = true;
          } else if (it->produced >= it->req.max_tokens) {
            o.finished = true;
            o.finish_reason = FinishReason::Length;
            done = true;
          }
        }
        outs.emplace_back(it->req.on_output, o);
        if (done) it = live_.erase(it);
        else ++it;
      }
      lock.unlock();
      std::vector<std::string> stopped;
      for (auto& [cb, o] : outs)
        if (!cb(o) && !o.finished) stopped.push_back(o.id);
      lock.lock();
      for (const auto& id : stopped)
        for (auto it = live_.begin(); it != live_.end(); ++it)
          if (it->req.id == id) {
            RequestOutput o;
            o.id = id;
            o.finished = true;
            o.finish_reason = FinishReason::Stop;
            auto cb = it->req.on_output;
            live_.erase(it);
            lock.unlock();
            cb(o);
            lock.lock();
            break;
          }
    }
  }

  std::vector<TokenId> script_;
  std::chrono::milliseconds step_;
  bool stop_at_end_ = false;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Live> live_;
  std::set<std::string> aborted_;
  uint64_t accepted_ = 0, generated_ = 0;
  std::vector<TokenId> last_prompt_;
  bool last_constrained_ = false, last_script_fits_ = false;
  bool quit_ = false;
  std::thread thread_;
};

class HttpTest : public ::testing::Test {
 protected:
  void start(std::chrono::milliseconds step = 2ms, const std::string& key = {}, size_t max_body = 16u << 20) {
    text_.emplace(TextProcessor::load(kTinyChat));
    engine_ = std::make_unique<FakeEngine>(
        text_->tokenizer().encode("the quick brown fox jumps over the lazy dog. ", {.add_special_tokens = false}), step);
    ServerOptions o;
    o.port = 0;
    o.api_key = key;
    o.max_body_bytes = max_body;
    server_ = std::make_unique<HttpServer>(o);
    port_ = server_->bind();
    server_->start();
  }
  void ready(ToolParser tools = ToolParser::None, ReasoningParser reasoning = ReasoningParser::None) {
    ServedModel m;
    m.engine = engine_.get();
    m.text = &*text_;
    m.info.name = "tiny";
    m.info.max_model_len = 256;
    m.info.vocab_size = text_->tokenizer().vocab_size();
    m.info.has_tokenizer = true;
    m.info.has_chat_template = text_->has_chat_template();
    m.info.tool_parser = tools;
    m.info.reasoning_parser = reasoning;
    m.eos_token_ids = {*text_->eos_id()};
    server_->set_ready(m);
  }
  void TearDown() override {
    if (server_) server_->stop();
    server_.reset();
    engine_.reset();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(10s);
    return c;
  }
  static Json body_of(const httplib::Result& r) { return Json::parse(r->body); }
  static void expect_error_shape(const httplib::Result& r, int status) {
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, status) << r->body;
    const Json j = Json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    ASSERT_TRUE(j.contains("error")) << r->body;
    for (const char* k : {"message", "type", "param", "code"}) EXPECT_TRUE(j["error"].contains(k)) << k << ": " << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
  }
  // A raw connection: send a request, read `want` bytes of the response, then close.
  std::string send_and_hang_up(const std::string& body, size_t want) const {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(uint16_t(port_));
    ::inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    const std::string req = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
                            std::to_string(body.size()) + "\r\n\r\n" + body;
    EXPECT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), ssize_t(req.size()));
    std::string got;
    char buf[4096];
    while (got.size() < want) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      got.append(buf, size_t(n));
    }
    ::close(fd);
    return got;
  }
  template <class F>
  static bool eventually(F&& f, std::chrono::milliseconds limit = 5000ms) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      if (f()) return true;
      std::this_thread::sleep_for(10ms);
    }
    return f();
  }

  std::optional<TextProcessor> text_;
  std::unique_ptr<FakeEngine> engine_;
  std::unique_ptr<HttpServer> server_;
  int port_ = 0;
};

}  // namespace

// A second server on a port in use fails to bind (no SO_REUSEPORT sharing: two servers with
// different models would otherwise answer on one port, the kernel splitting the connections).
TEST(HttpBind, SecondServerOnABusyPortFails) {
  HttpServer first(ServerOptions{.host = "127.0.0.1", .port = 0});
  const int port = first.bind();
  ASSERT_GT(port, 0);
  HttpServer second(ServerOptions{.host = "127.0.0.1", .port = port});
  try {
    second.bind();
    FAIL() << "a second server bound port " << port;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on 127.0.0.1:" + std::to_string(port)), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
  }
}

TEST_F(HttpTest, LoadingThenReady) {
  start();
  auto c = client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  expect_error_shape(c.Get("/v1/models"), 503);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x"})", "application/json"), 503);
  ready();
  r = c.Get("/health");
  EXPECT_EQ(r->status, 200);
  r = c.Get("/v1/models");
  ASSERT_EQ(r->status, 200);
  const Json m = body_of(r);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_model_len"], 256);
}

TEST_F(HttpTest, ErrorsAreOpenAIShaped) {
  start(2ms, {}, 4096);
  ready();
  auto c = client();
  expect_error_shape(c.Post("/v1/completions", "{not json", "application/json"), 400);
  expect_error_shape(c.Post("/v1/completions", "[]", "application/json"), 400);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 0})", "application/json"), 400);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 1000})", "application/json"), 400);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x", "model": "nope"})", "application/json"), 404);
  expect_error_shape(c.Post("/v1/chat/completions", R"({"messages": []})", "application/json"), 400);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": [999, 1]})", "application/json"), 400);  // engine refusal
  expect_error_shape(c.Get("/v1/nothing"), 404);
  expect_error_shape(c.Post("/v1/completions", std::string(5000, ' '), "application/json"), 413);
  expect_error_shape(c.Post("/tokenize", R"({"prompt": 5})", "application/json"), 400);
  expect_error_shape(c.Post("/detokenize", R"({"tokens": [99999]})", "application/json"), 400);
  // The server still serves after all that.
  auto r = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  // The engine failing mid-request is a 500 with an error body.
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": [998, 1], "max_tokens": 3})", "application/json"), 500);
}

TEST_F(HttpTest, ApiKey) {
  start(2ms, "sekrit");
  ready();
  auto c = client();
  expect_error_shape(c.Get("/v1/models"), 401);
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x"})", "application/json"), 401);
  httplib::Headers wrong{{"Authorization", "Bearer nope"}}, right{{"Authorization", "Bearer sekrit"}},
      basic{{"Authorization", "Basic sekrit"}};
  expect_error_shape(c.Get("/v1/models", wrong), 401);
  expect_error_shape(c.Get("/v1/models", basic), 401);
  auto r = c.Get("/v1/models", right);
  EXPECT_EQ(r->status, 200);
  r = c.Post("/v1/completions", right, R"({"prompt": "x", "max_tokens": 2})", "application/json");
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(c.Get("/health")->status, 200);  // outside /v1: no key needed
  EXPECT_EQ(c.Get("/metrics")->status, 200);
}

TEST_F(HttpTest, StreamingMatchesNonStreaming) {
  start();
  ready();
  auto c = client();
  auto r = c.Post("/v1/completions", R"({"prompt": "hello", "max_tokens": 12, "n": 2, "logprobs": 1})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json whole = body_of(r);
  ASSERT_EQ(whole["choices"].size(), 2u);
  EXPECT_EQ(whole["usage"]["completion_tokens"], 24);
  r = c.Post("/v1/completions",
             R"({"prompt": "hello", "max_tokens": 12, "n": 2, "logprobs": 1, "stream": true, "stream_options": {"include_usage": true}})",
             "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
  std::map<int, std::string> text;
  Json usage;
  bool done = false;
  size_t pos = 0;
  const std::string& s = r->body;
  while (pos < s.size()) {
    const size_t end = s.find("\n\n", pos);
    ASSERT_NE(end, std::string::npos);
    const std::string ev = s.substr(pos, end - pos);
    pos = end + 2;
    ASSERT_EQ(ev.rfind("data: ", 0), 0u);
    if (ev == "data: [DONE]") {
      done = true;
      EXPECT_EQ(pos, s.size()) << "nothing after [DONE]";
      continue;
    }
    const Json j = Json::parse(ev.substr(6));
    if (j.contains("usage")) usage = j["usage"];
    for (const auto& ch : j["choices"]) text[ch["index"].get<int>()] += ch["text"].get<std::string>();
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(text[0], whole["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(text[1], whole["choices"][1]["text"].get<std::string>());
  EXPECT_EQ(usage, whole["usage"]);
}

TEST_F(HttpTest, StopStringsEndTheEngineRequest) {
  start();
  ready();
  auto c = client();
  auto r = c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 40, "stop": ["fox"]})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json j = body_of(r);
  EXPECT_EQ(j["choices"][0]["text"], "the quick brown ");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["stop_reason"], "fox");
  EXPECT_LT(j["usage"]["completion_tokens"].get<int>(), 40);
  EXPECT_TRUE(eventually([&] { return engine_->live() == 0; }));
}

TEST_F(HttpTest, ClientDisconnectAbortsTheRequest) {
  start(20ms);  // slow enough to still be generating when the client leaves
  ready();
  const std::string got = send_and_hang_up(R"({"prompt": "x", "max_tokens": 250, "stream": true})", 300);
  EXPECT_NE(got.find("200 OK"), std::string::npos) << got;
  EXPECT_TRUE(eventually([&] { return engine_->was_aborted("cmpl-"); })) << "the stream's engine request was not aborted";
  EXPECT_TRUE(eventually([&] { return server_->in_flight() == 0; }));
}

TEST_F(HttpTest, NonStreamingClientDisconnectAbortsTheRequest) {
  start(20ms);
  ready();
  // Send, read nothing, hang up: the server notices while it waits for the result.
  send_and_hang_up(R"({"prompt": "x", "max_tokens": 200, "n": 2})", 0);
  EXPECT_TRUE(eventually([&] { return engine_->num_aborted() == 2; }, 8000ms));
  EXPECT_TRUE(eventually([&] { return server_->in_flight() == 0; }));
}

TEST_F(HttpTest, DrainThenCancel) {
  start(20ms);
  ready();
  std::string streamed;
  std::jthread t([&] {
    auto c = client();
    auto r = c.Post("/v1/chat/completions",
                    R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 150, "stream": true})",
                    "application/json");
    if (r) streamed = r->body;
  });
  ASSERT_TRUE(eventually([&] { return server_->in_flight() == 1; }));
  server_->begin_drain();
  auto c = client();
  expect_error_shape(c.Post("/v1/completions", R"({"prompt": "x"})", "application/json"), 503);
  EXPECT_EQ(c.Get("/health")->status, 503);
  EXPECT_FALSE(server_->wait_idle(std::chrono::steady_clock::now() + 100ms));  // still streaming
  server_->cancel_all("the server is shutting down");
  EXPECT_TRUE(server_->wait_idle(std::chrono::steady_clock::now() + 5s));
  t.join();
  // The stream ends with an error event and [DONE], never silently.
  EXPECT_NE(streamed.find("\"error\""), std::string::npos) << streamed;
  EXPECT_NE(streamed.find("shutting down"), std::string::npos) << streamed;
  EXPECT_EQ(streamed.substr(streamed.size() - 14), "data: [DONE]\n\n");
  EXPECT_TRUE(engine_->was_aborted("chatcmpl-"));
}

TEST_F(HttpTest, TokenizeDetokenize) {
  start();
  ready();
  auto c = client();
  auto r = c.Post("/tokenize", R"({"prompt": "Hello world", "return_token_strs": true})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json t = body_of(r);
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_EQ(t["max_model_len"], 256);
  EXPECT_EQ(t["token_strs"].size(), t["tokens"].size());
  r = c.Post("/detokenize", Json{{"tokens", t["tokens"]}}.dump(), "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(body_of(r)["prompt"], "Hello world");
  r = c.Post("/tokenize", R"({"messages": [{"role": "user", "content": "hi"}]})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_GT(body_of(r)["count"].get<int>(), 3);
}

TEST_F(HttpTest, Metrics) {
  start();
  ready();
  auto c = client();
  c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 3})", "application/json");
  c.Post("/v1/completions", R"({"prompt": "x", "max_tokens": 0})", "application/json");
  auto r = c.Get("/metrics");
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->get_header_value("Content-Type").find("text/plain"), std::string::npos);
  EXPECT_NE(r->body.find("kvlm:generation_tokens_total{model_name=\"tiny\"} 3\n"), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("kvlm:http_responses_total{model_name=\"tiny\",status=\"400\"} 1\n"), std::string::npos) << r->body;
}

// The poller's strict reading of a header block (connections.h: parse_framing).
TEST(Framing, StrictContentLengthAndTransferEncoding) {
  const auto f = [](const std::string& headers) { return parse_framing("POST /x HTTP/1.1\r\nHost: h\r\n" + headers + "\r\n"); };
  EXPECT_EQ(f("Content-Length: 15\r\n").error, "");
  EXPECT_EQ(f("Content-Length: 15\r\n").content_length, 15u);
  EXPECT_EQ(f("content-length:\t7 \r\nContent-Length: 7\r\n").content_length, 7u);  // OWS, an equal repeat
  EXPECT_TRUE(f("Transfer-Encoding: Chunked\r\n").chunked);
  EXPECT_EQ(f("").content_length, 0u);
  for (const char* bad : {"Content-Length: abc\r\n", "Content-Length: 15abc\r\n", "Content-Length: +15\r\n",
                          "Content-Length: -1\r\n", "Content-Length:\r\n", "Content-Length: 1 5\r\n",
                          "Content-Length: 99999999999999999999\r\n", "Content-Length: 15\r\nContent-Length: 16\r\n",
                          "Content-Length: 15\r\nTransfer-Encoding: chunked\r\n", "Transfer-Encoding: xchunked\r\n",
                          "Transfer-Encoding: gzip, chunked\r\n", "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
                          "X-No-Colon\r\n", "Range: bytes=0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-,0-\r\n", "X-A: 1\r\n folded\r\n", "Content-Length : 5\r\n", "X-A: a\nb\r\n"})
    EXPECT_NE(f(bad).error, "") << bad;
  const char nul[] = "GET / HTTP/1.1\r\nX-A: a\0b\r\n\r\n";  // a NUL inside a header value
  EXPECT_NE(parse_framing(std::string_view(nul, sizeof nul - 1)).error, "");
  EXPECT_NE(parse_framing("GET / HTTP/1.1\r\nHost: h\r\n").error, "");  // no blank line
}

// The grammar cache: a failed compile is not kept; the budget is counted from the ask.
TEST(GrammarCacheTest, FailedCompilesAreNotKeptAndTheBudgetHolds) {
  const Tokenizer tok = Tokenizer::load(std::filesystem::path(KVLM_TEST_DATA) / "models/tiny-chat/tokenizer.json");
  GrammarCache cache(GrammarCacheLimits{.compile_seconds = 5});
  auto ok = std::make_shared<const grammar::Grammar>(grammar::parse_gbnf("root ::= [a-z]+\n"));
  EXPECT_NE(cache.get(tok, tok.vocab_size(), ok, "a"), nullptr);
  EXPECT_EQ(cache.get(tok, tok.vocab_size(), ok, "a"), cache.get(tok, tok.vocab_size(), ok, "a"));
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_GT(cache.bytes(), 0u);
  // Too ambiguous to start: 5,000 alternatives that all begin alike, each a rule of its own.
  std::string amb = "root ::= a0";
  for (int i = 1; i < 5000; ++i) amb += " | a" + std::to_string(i);
  amb += "\n";
  for (int i = 0; i < 5000; ++i) amb += "a" + std::to_string(i) + " ::= \"x\" [0-9]\n";
  auto bad = std::make_shared<const grammar::Grammar>(grammar::parse_gbnf(amb));
  EXPECT_THROW(cache.get(tok, tok.vocab_size(), bad, "b"), Error);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.size(), 1u);
}

// GPT-OSS's harmony format through the server: a tokenizer with harmony's markers as special
// tokens and a harmony chat template (the bundled tiny tokenizer, extended), an engine that
// replies with a scripted harmony message sequence, and chat requests through real HTTP: the
// analysis channel comes back as reasoning_content, the final channel as content, a
// commentary message to functions.NAME as a tool call (finish_reason tool_calls), streamed
// and not, the markers never in the text.
class HarmonyTest : public HttpTest {
 protected:
  // The tiny model with `tokens` added to its tokenizer (special or not), `chat_template`, and
  // a scripted engine that replies `reply`; the server ready with these parsers.
  void start_tiny(const std::string& reply, std::initializer_list<const char*> tokens, bool special,
                  const std::string& chat_template, ToolParser tools, ReasoningParser reasoning) {
    dir_ = std::filesystem::temp_directory_path() / ("kvlm-parsers-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
      std::filesystem::copy_file(kTinyChat / f, dir_ / f);
    Json tok = Json::parse(std::ifstream(kTinyChat / "tokenizer.json"));
    int id = int(tok["model"]["vocab"].size()) + int(tok["added_tokens"].size());
    for (const char* m : tokens)
      tok["added_tokens"].push_back(Json{{"id", id++}, {"content", m}, {"single_word", false}, {"lstrip", false},
                                         {"rstrip", false}, {"normalized", false}, {"special", special}});
    std::ofstream(dir_ / "tokenizer.json") << tok.dump();
    Json cfg = Json::parse(std::ifstream(kTinyChat / "tokenizer_config.json"));
    cfg.erase("added_tokens_decoder");
    cfg["chat_template"] = chat_template;
    std::ofstream(dir_ / "tokenizer_config.json") << cfg.dump();
    text_.emplace(TextProcessor::load(dir_));
    const auto script = text_->tokenizer().encode(reply, {.add_special_tokens = false});
    engine_ = std::make_unique<FakeEngine>(script, 1ms, /*stop_at_end=*/true);
    server_ = std::make_unique<HttpServer>(ServerOptions{.port = 0});
    port_ = server_->bind();
    server_->start();
    ready(tools, reasoning);
  }
  void start_with(const std::string& reply) {
    const std::string tpl =
        "{%- if tools %}<|start|>developer<|message|># Tools{% for t in tools %} {{ t.function.name }}{% endfor %}"
        "<|end|>{%- endif %}{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
        "<|message|>{{ m.content }}<|end|>{%- endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}";
    start_tiny(reply, {"<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"},
               /*special=*/true, tpl, detect_tool_parser(tpl), ReasoningParser::None);
  }
  void TearDown() override {
    HttpTest::TearDown();
    std::filesystem::remove_all(dir_);
  }
  // A streamed reply's deltas joined: reasoning, content, and the tool calls' name + arguments.
  struct Streamed {
    std::string reasoning, content, calls, finish;
  };
  static Streamed join(const std::string& body) {
    Streamed out;
    for (size_t pos = 0; pos < body.size();) {
      const size_t end = body.find("\n\n", pos);
      const std::string ev = body.substr(pos, end - pos);
      pos = end + 2;
      if (ev == "data: [DONE]") continue;
      const Json j = Json::parse(ev.substr(6));
      for (const auto& ch : j["choices"]) {
        const Json& d = ch["delta"];
        if (d.contains("reasoning_content")) out.reasoning += d["reasoning_content"].get<std::string>();
        if (d.contains("content")) out.content += d["content"].get<std::string>();
        if (d.contains("tool_calls"))
          for (const auto& c : d["tool_calls"])
            out.calls += c["function"]["name"].get<std::string>() + c["function"]["arguments"].get<std::string>();
        if (!ch["finish_reason"].is_null()) out.finish = ch["finish_reason"].get<std::string>();
      }
    }
    return out;
  }
  std::filesystem::path dir_;
};

TEST_F(HarmonyTest, ReasoningAndAnswerApart) {
  start_with("<|channel|>analysis<|message|>The user says hello.<|end|><|start|>assistant<|channel|>final<|message|>"
             "Hello there.");
  EXPECT_EQ(text_->tokenizer().decode(text_->tokenizer().encode("<|channel|>", {.add_special_tokens = false})), "<|channel|>");
  auto c = client();
  const std::string req = R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100)";
  auto r = c.Post("/v1/chat/completions", req + "}", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json msg = body_of(r)["choices"][0]["message"];
  ASSERT_TRUE(msg.contains("reasoning_content")) << r->body;
  EXPECT_EQ(msg["reasoning_content"], "The user says hello.") << r->body;
  EXPECT_EQ(msg["content"], "Hello there.") << r->body;
  EXPECT_FALSE(msg.contains("tool_calls"));
  EXPECT_EQ(body_of(r)["choices"][0]["finish_reason"], "stop");
  r = c.Post("/v1/chat/completions", req + R"(, "stream": true})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Streamed s = join(r->body);
  EXPECT_EQ(s.reasoning, "The user says hello.");
  EXPECT_EQ(s.content, "Hello there.");
  EXPECT_EQ(s.finish, "stop");
}

TEST_F(HarmonyTest, ToolCallsFromTheCommentaryChannel) {
  start_with("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
             "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}");
  auto c = client();
  const std::string req =
      R"({"messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 100, "tools": [{"type": "function",
          "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
  auto r = c.Post("/v1/chat/completions", req + "}", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json ch = body_of(r)["choices"][0];
  EXPECT_EQ(ch["finish_reason"], "tool_calls") << r->body;
  ASSERT_TRUE(ch["message"].contains("reasoning_content") && ch["message"].contains("tool_calls")) << r->body;
  EXPECT_EQ(ch["message"]["reasoning_content"], "Need the weather.");
  EXPECT_TRUE(ch["message"]["content"].is_null()) << r->body;
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r->body;
  EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(ch["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()), Json({{"city", "Paris"}}));
  r = c.Post("/v1/chat/completions", req + R"(, "stream": true})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Streamed s = join(r->body);
  EXPECT_EQ(s.reasoning, "Need the weather.");
  EXPECT_EQ(s.content, "");
  EXPECT_EQ(s.calls, "get_weather{\"city\":\"Paris\"}");
  EXPECT_EQ(s.finish, "tool_calls");
}

// tool_choice naming a function (or "required" with one tool): kvlm writes the call's header
// after the prompt and a grammar holds the model to the function's parameters; the reply is
// the call. "required" among several tools: the header up to the function's name goes after
// the prompt, and the grammar covers a listed name, the header's special tokens and that
// function's arguments (HarmonyRequiredAmongSeveralTools).
TEST_F(HarmonyTest, ForcedCallsWriteTheHeaderForTheModel) {
  start_with("{\"city\": \"Oslo\"}");  // the model writes only the arguments
  auto c = client();
  const std::string tool =
      R"({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})";
  const std::string other = R"({"type": "function", "function": {"name": "get_time"}})";
  const std::string msgs = R"({"messages": [{"role": "user", "content": "weather in Oslo?"}], "max_tokens": 100, )";
  const std::vector<TokenId> header = text_->tokenizer().encode(
      "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>", {.add_special_tokens = false});
  for (const std::string& choice : {std::string(R"("tool_choice": {"type": "function", "function": {"name": "get_weather"}})"),
                                    std::string(R"("tool_choice": "required")")}) {
    const std::string tools = choice.find("required") != std::string::npos ? "[" + tool + "]" : "[" + other + ", " + tool + "]";
    const std::string req = msgs + R"("tools": )" + tools + ", " + choice;
    for (bool stream : {false, true}) {
      auto r = c.Post("/v1/chat/completions", req + (stream ? R"(, "stream": true})" : "}"), "application/json");
      ASSERT_EQ(r->status, 200) << choice << ": " << r->body;
      const std::vector<TokenId> prompt = engine_->last_prompt();
      ASSERT_GE(prompt.size(), header.size());
      EXPECT_TRUE(std::equal(header.begin(), header.end(), prompt.end() - std::ptrdiff_t(header.size())))
          << "the prompt must end with the call's header";
      EXPECT_TRUE(engine_->last_constrained());
      if (stream) {
        const Streamed s = join(r->body);
        EXPECT_EQ(s.calls, "get_weather{\"city\":\"Oslo\"}") << r->body;
        EXPECT_EQ(s.content, "");
        EXPECT_EQ(s.reasoning, "");
        EXPECT_EQ(s.finish, "tool_calls");
        continue;
      }
      const Json ch = body_of(r)["choices"][0];
      EXPECT_EQ(ch["finish_reason"], "tool_calls") << r->body;
      EXPECT_TRUE(ch["message"]["content"].is_null()) << r->body;
      EXPECT_FALSE(ch["message"].contains("reasoning_content"));
      ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r->body;
      EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["name"], "get_weather");
      EXPECT_EQ(Json::parse(ch["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
                Json({{"city", "Oslo"}}));
    }
  }
}

// "required" among several tools: the model writes the function's name and the header's
// special tokens (<|constrain|>, <|message|>) itself, under a grammar that allows exactly those
// tokens there; the scripted reply below passes the grammar token by token, and comes back as
// the call.
TEST_F(HarmonyTest, HarmonyRequiredAmongSeveralTools) {
  start_with("get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}");
  auto c = client();
  const std::string tools =
      R"([{"type": "function", "function": {"name": "get_time"}}, {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])";
  const std::string req =
      R"({"messages": [{"role": "user", "content": "weather in Oslo?"}], "max_tokens": 100, "tool_choice": "required", "tools": )" +
      tools;
  const std::vector<TokenId> header =
      text_->tokenizer().encode("<|channel|>commentary to=functions.", {.add_special_tokens = false});
  for (bool stream : {false, true}) {
    auto r = c.Post("/v1/chat/completions", req + (stream ? R"(, "stream": true})" : "}"), "application/json");
    ASSERT_EQ(r->status, 200) << r->body;
    const std::vector<TokenId> prompt = engine_->last_prompt();
    ASSERT_GE(prompt.size(), header.size());
    EXPECT_TRUE(std::equal(header.begin(), header.end(), prompt.end() - std::ptrdiff_t(header.size())))
        << "the prompt must end with the header up to the function's name";
    EXPECT_TRUE(engine_->last_constrained());
    EXPECT_TRUE(engine_->last_script_fits()) << "the grammar must take the name, <|constrain|>json<|message|> and the arguments";
    if (stream) {
      const Streamed s = join(r->body);
      EXPECT_EQ(s.calls, "get_weather{\"city\":\"Oslo\"}") << r->body;
      EXPECT_EQ(s.content, "");
      EXPECT_EQ(s.finish, "tool_calls");
      continue;
    }
    const Json ch = body_of(r)["choices"][0];
    EXPECT_EQ(ch["finish_reason"], "tool_calls") << r->body;
    ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r->body;
    EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["name"], "get_weather");
    EXPECT_EQ(Json::parse(ch["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
              Json({{"city", "Oslo"}}));
  }
}

// The grammar takes only listed names and the arguments their schemas allow: a reply naming
// another function, or missing a required argument, does not pass it.
TEST_F(HarmonyTest, HarmonyRequiredRefusesOtherNamesAndArguments) {
  for (const char* reply : {"get_date <|constrain|>json<|message|>{}",
                            "get_weather <|constrain|>json<|message|>{}",
                            "get_weather json<|message|>{\"city\":\"Oslo\"}"}) {
    if (engine_) TearDown();  // the previous reply's server
    start_with(reply);
    auto c = client();
    auto r = c.Post("/v1/chat/completions",
                    R"({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}, {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]})",
                    "application/json");
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_TRUE(engine_->last_constrained());
    EXPECT_FALSE(engine_->last_script_fits()) << reply;
  }
}

// --reasoning-parser qwen3 over a chat template in Qwen3's manner: <think> and </think> are
// added (non-special) tokens; enable_thinking false closes an empty block in the prompt, and
// `open_think` (standing in for DeepSeek-R1's template) leaves one open.
class ThinkTest : public HarmonyTest {
 protected:
  void start_with(const std::string& reply, ToolParser tools = ToolParser::None) {
    start_tiny(reply, {"<think>", "</think>"}, /*special=*/false,
               "{%- if tools %}[tools]{% for t in tools %} {{ t.function.name }}{% endfor %}\n{%- endif %}"
               "{%- for m in messages %}[{{ m.role }}] {{ m.content }}\n{%- endfor %}"
               "{%- if add_generation_prompt %}[assistant] {%- if enable_thinking is defined and enable_thinking is false %}"
               "<think>\n\n</think>\n\n{%- elif open_think is defined and open_think %}<think>\n{%- endif %}{%- endif %}",
               tools, ReasoningParser::ThinkTags);
  }
  // The reply to `req` whole and streamed: reasoning_content (absent: "-") and content.
  void expect_reply(const std::string& req, const std::string& reasoning, const std::string& content) {
    auto c = client();
    auto r = c.Post("/v1/chat/completions", req + "}", "application/json");
    ASSERT_EQ(r->status, 200) << r->body;
    const Json msg = body_of(r)["choices"][0]["message"];
    EXPECT_EQ(msg.contains("reasoning_content") ? msg["reasoning_content"].get<std::string>() : "-", reasoning) << r->body;
    EXPECT_EQ(msg["content"], content) << r->body;
    r = c.Post("/v1/chat/completions", req + R"(, "stream": true})", "application/json");
    ASSERT_EQ(r->status, 200) << r->body;
    const Streamed s = join(r->body);
    EXPECT_EQ(s.reasoning.empty() ? "-" : s.reasoning, reasoning.empty() ? "-" : reasoning) << r->body;
    EXPECT_EQ(s.content, content) << r->body;
    EXPECT_EQ(s.finish, "stop");
  }
};

TEST_F(ThinkTest, ReasoningAndAnswerApart) {
  start_with("<think>\nThe user says hello.\n</think>\n\nHello there.");
  EXPECT_EQ(text_->tokenizer().decode(text_->tokenizer().encode("<think>", {.add_special_tokens = false}), true), "<think>");
  expect_reply(R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100)", "\nThe user says hello.\n",
               "Hello there.");
}

TEST_F(ThinkTest, APromptThatOpensTheBlockStartsTheReplyInIt) {
  start_with("The user says hello.</think>Hello there.");
  expect_reply(R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100,)"
               R"( "chat_template_kwargs": {"open_think": true})",
               "The user says hello.", "Hello there.");
  // Without the open block the same text has no reasoning: the stray </think> is answer text.
  expect_reply(R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100)", "-",
               "The user says hello.</think>Hello there.");
}

TEST_F(ThinkTest, ThinkingOffIsAllAnswer) {
  start_with("Hello there.");
  expect_reply(R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100,)"
               R"( "chat_template_kwargs": {"enable_thinking": false})",
               "-", "Hello there.");
}

TEST_F(ThinkTest, ToolCallsAfterTheReasoning) {
  start_with("<think>I should call f.</think>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call>",
             ToolParser::Hermes);
  auto c = client();
  const std::string req = R"({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 100,)"
                          R"( "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])";
  auto r = c.Post("/v1/chat/completions", req + "}", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Json ch = body_of(r)["choices"][0];
  EXPECT_EQ(ch["message"]["reasoning_content"], "I should call f.") << r->body;
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << r->body;
  EXPECT_EQ(ch["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(ch["finish_reason"], "tool_calls");
  r = c.Post("/v1/chat/completions", req + R"(, "stream": true})", "application/json");
  ASSERT_EQ(r->status, 200) << r->body;
  const Streamed s = join(r->body);
  EXPECT_EQ(s.reasoning, "I should call f.");
  EXPECT_EQ(s.calls, R"(f{"x":1})");
  EXPECT_EQ(s.finish, "tool_calls");
}

TEST_F(ThinkTest, AConstraintBindsTheAnswerAfterTheReasoning) {
  start_with("The user wants JSON.</think>\n{}");
  expect_reply(R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},)"
               R"( "chat_template_kwargs": {"open_think": true})",
               "The user wants JSON.", "{}");
  EXPECT_TRUE(engine_->last_constrained());
}

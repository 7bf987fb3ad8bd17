// The OpenAI-compatible HTTP server (cpp-httplib): /v1/completions, /v1/chat/completions,
// /v1/responses, /v1/embeddings (an embedding model), /v1/models, /health, /metrics, /tokenize, /detokenize.
//
// Lifecycle: bind() and start() first, so /health answers 503 while the model loads; then
// set_ready() with the engine; at shutdown begin_drain() (new generation requests get 503),
// wait_idle() for in-flight requests, cancel_all() for the rest, stop().
//
// Connections (server/connections.h): a connection holds a thread only while a request of it
// is read, computed and answered; idle keep-alive connections and connections still sending
// their headers wait in one poller thread, with deadlines.
//
// Threads: each request is served by a pool thread. A generation request becomes one
// engine request per choice; their outputs arrive on the engine thread, which only queues
// them on the request's RequestStream; the connection's thread writes to the socket. A
// client that goes away (a failed write, or a closed socket seen while waiting) has its
// engine requests aborted at once.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/pooling_config.h"
#include "text/text_processor.h"
#include "engine/metrics.h"
#include "engine/request.h"
#include "server/protocol.h"

namespace kvlm {
class AsyncEngine;
}

namespace kvlm::server {

// What the server needs of the engine (AsyncEngine in production, a fake in tests).
class EngineClient {
 public:
  virtual ~EngineClient() = default;
  // Throws kvlm::Error with a message for the client when the request is invalid.
  virtual void add_request(EngineRequest req) = 0;
  virtual void abort(const std::string& id) = 0;
  virtual EngineStats stats() const = 0;
};

class AsyncEngineClient : public EngineClient {
 public:
  explicit AsyncEngineClient(AsyncEngine& e) : e_(e) {}
  void add_request(EngineRequest req) override;
  void abort(const std::string& id) override;
  EngineStats stats() const override;

 private:
  AsyncEngine& e_;
};

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                     // 0 = any free port (see bound_port())
  std::string api_key;                 // non-empty: /v1/* needs "Authorization: Bearer <key>"
  size_t max_body_bytes = 16u << 20;   // larger bodies get 413
  int header_timeout_s = 10;           // a request's headers must arrive within this of its first byte (408)
  int read_timeout_s = 30;             // its body, within this of the headers (408); and any one read
  int write_timeout_s = 30;            // a client that stops reading its response
  // Longer than the idle expiry of common client pools (httpx, used by the OpenAI SDK: 5 s;
  // aiohttp: 15 s): when the server closes an idle connection at the moment the client
  // reuses it, the client sees a connection error. At 5 s that race failed 1 of 800 requests
  // of the load test (tests/server/load_test.py) on a busy 2-core machine.
  int keep_alive_timeout_s = 30;
  // Requests in progress at once (one thread each); more get 503 with Retry-After. Idle
  // keep-alive connections and connections still sending their headers hold no thread.
  int max_connections = 1024;
  int max_open_connections = 0;        // open connections at most (503 beyond); 0: from the descriptor limit
  bool log_requests = true;            // an access-log line per request on stderr
  // Origins allowed to call the API from a browser (CORS); "*" any; empty: no CORS headers.
  std::vector<std::string> allowed_origins;
  // Seeds the generator that seeds requests without a seed (--seed): the same requests in
  // the same order sample the same. Unset: from the system's entropy.
  std::optional<uint64_t> seed;
  ApiLimits limits;
  double grammar_compile_s = 10;       // a structured output's compile budget (400 past it)
  // /v1/responses with store: the newest responses kept for previous_response_id (0: none).
  size_t responses_store_size = 1000;
  size_t responses_store_bytes = size_t(256) << 20;
};

struct ServedModel {
  EngineClient* engine = nullptr;
  const TextProcessor* text = nullptr;  // null: the model has no tokenizer (token ids only)
  ModelInfo info;
  std::vector<TokenId> eos_token_ids;   // the model's and the tokenizer's EOS ids
  Json kv_plan = Json::object();        // {"summary", "layers": [...]}: GET /v1/kvlm/plan, the chat page
  // An embedding model (--runner pooling): /v1/embeddings pools with this, and the generation
  // endpoints refuse; nullopt: the reverse.
  std::optional<PoolingConfig> pooling;
  int hidden_size = 0;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions opts);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket; throws kvlm::Error saying what to change when it cannot.
  // Returns the port (useful with port 0).
  int bind();
  // Serves on a background thread: /health says 503 (loading) until set_ready().
  void start();
  void set_ready(ServedModel model);
  // New generation requests get 503 and /health 503; requests in flight continue.
  void begin_drain();
  int in_flight() const;
  // Waits until no generation request is in flight; false at the deadline.
  bool wait_idle(std::chrono::steady_clock::time_point deadline) const;
  // Ends every request in flight with `why` (their clients get a 503 or an error event).
  void cancel_all(const std::string& why);
  // Closes the listening socket and waits for the connection threads to end.
  void stop();
  int bound_port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm::server

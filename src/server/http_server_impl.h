// The HTTP server's insides, shared by its two source files: http_server.cpp (lifecycle, routes,
// the access log) and http_handlers.cpp (the endpoints' handlers: generation, embeddings,
// tokenize). Not part of the server's interface (http_server.h).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "server/connections.h"
#include "server/grammar_cache.h"
#include "server/http_server.h"
#include "server/request_stream.h"
#include "server/response.h"
#include "server/responses.h"

namespace kvlm::server {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

void reply(httplib::Response& res, int status, const Json& body);
// An unexpected failure: the detail goes to the server's log under an id, the client gets the
// id (no internal exception text, no paths).
void reply_internal(httplib::Response& res, const std::string& what);
void reply_error(httplib::Response& res, const ApiError& e);
// An endpoint of the other runner (--runner): a 400 that says which one the server runs.
void require_runner(const ServedModel& m, bool pooling);
// The token counts the access-log line of the request this thread serves reports.
void record_usage(const Json& usage);

// A generation request in flight: its stream and engine ids. The last owner (the handler,
// or the streaming response) unregisters it.
struct Flight {
  std::function<void(const std::string&)> unregister;
  std::string id;
  std::shared_ptr<RequestStream> stream;
  std::vector<std::string> engine_ids;
  EngineClient* engine = nullptr;
  void abort_unfinished() const {
    if (stream->all_finished()) return;
    for (const auto& e : engine_ids) engine->abort(e);
  }
  ~Flight();
};

struct HttpServer::Impl {
  ServerOptions opts;
  Listener svr;
  std::unique_ptr<ConnectionManager> conns;
  std::thread thread;
  int port = -1;
  bool started = false;
  std::atomic<bool> listener_done{false};

  void wait_listening() const {
    for (int i = 0; i < 10000 && !svr.is_running() && !listener_done; ++i) std::this_thread::sleep_for(1ms);
  }
  std::atomic<bool> ready{false}, draining{false};
  ServedModel model;  // written once, before `ready` becomes true
  int64_t created = std::time(nullptr);

  mutable std::mutex live_mu;
  mutable std::condition_variable live_cv;
  struct Live {
    std::shared_ptr<RequestStream> stream;
    std::vector<std::string> engine_ids;
    EngineClient* engine = nullptr;
  };
  std::map<std::string, Live> live;

  mutable std::mutex stats_mu;
  std::map<int, uint64_t> by_status;
  GrammarCache grammars;  // structured outputs
  ResponseStore response_store;  // /v1/responses with store: previous_response_id, GET /v1/responses/{id}

  std::mutex seed_mu;
  std::mt19937_64 seed_rng;
  uint64_t random_seed() {
    std::lock_guard lock(seed_mu);
    return seed_rng();
  }

  explicit Impl(ServerOptions o)
      : opts(std::move(o)),
        grammars(GrammarCacheLimits{.compile_seconds = opts.grammar_compile_s}),
        response_store(opts.responses_store_size, opts.responses_store_bytes),
        seed_rng(opts.seed ? *opts.seed : std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32)) {}

  const ServedModel* served(httplib::Response& res) const {
    if (ready.load(std::memory_order_acquire)) return &model;
    reply(res, 503, error_json(503, "the model is still loading; retry when /health answers 200", "", "model_loading"));
    return nullptr;
  }

  // served(), and not draining: a request that starts work (503 once the server drains).
  const ServedModel* accepting(httplib::Response& res) const {
    const ServedModel* m = served(res);
    if (m && draining.load()) {
      reply(res, 503, error_json(503, "the server is shutting down and takes no new requests", "", "server_shutting_down"));
      return nullptr;
    }
    return m;
  }

  void unregister(const std::string& id) {
    {
      std::lock_guard lock(live_mu);
      live.erase(id);
    }
    live_cv.notify_all();
  }

  // Runs a handler body, answering every failure with an OpenAI-shaped error.
  template <class F>
  void guarded(httplib::Response& res, F&& f) {
    try {
      f();
    } catch (const ApiError& e) {
      reply_error(res, e);
    } catch (const Error& e) {
      reply(res, 400, error_json(400, without_paths(e.what())));
    } catch (const std::bad_alloc&) {
      reply(res, 503, error_json(503, "the server is out of memory; retry later", "", "out_of_memory"));
    } catch (const std::exception& e) {
      reply_internal(res, e.what());
    }
  }

  std::string token_text(TokenId t) const {
    if (!model.text) return "token_id:" + std::to_string(t);
    return model.text->tokenizer().decode(std::span<const TokenId>(&t, 1), false, true);
  }

  struct StreamState {
    std::shared_ptr<Flight> flight;
    ResponseAssembler asmb;
    std::vector<ChoiceEvent> evs;
    bool begun = false;
    std::shared_ptr<ResponsesStream> responses;  // /v1/responses: its events instead of chat chunks
    std::function<void(const Json&)> store_with;  // and where the finished response is kept
  };
  static bool write_stream(StreamState& st, httplib::DataSink& sink);

  // POST handlers: `body` is the request body as post() read it (see there).
  // `responses`: /v1/responses, a chat request underneath (server/responses.h).
  void generate(const httplib::Request& req, const std::string& body, httplib::Response& res, Endpoint ep,
                bool responses = false);
  void embed(const httplib::Request& req, const std::string& body, httplib::Response& res);
  // Registers a request's engine requests as live (cancel_all reaches them); throws 503 once
  // the server drains.
  // A non-streamed request: hands each batch of events to `take` (false: stop waiting) until
  // every choice has finished. False when the client went away (its requests aborted, 499).
  bool await_all(const httplib::Request& req, httplib::Response& res, Flight& flight,
                 const std::function<bool(std::vector<ChoiceEvent>&)>& take);
  std::shared_ptr<Flight> begin_flight(const std::string& id, const std::shared_ptr<RequestStream>& stream,
                                       std::vector<EngineRequest>& reqs, EngineClient* engine);
  // /tokenize and /detokenize: the served model (null: answered already), its checked body, and
  // a 400 when the model has no tokenizer.
  const ServedModel* text_request(const std::string& raw, httplib::Response& res, Json& body);
  void tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void detokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  template <class F>
  void post(const char* path, F handler);
  void install_routes();
  // CORS: the Access-Control-Allow-Origin a request's Origin gets ("" when none).
  std::string allowed_origin(const httplib::Request& req) const;
  void access_log(const httplib::Request& req, const httplib::Response& res) const;
};

}  // namespace kvlm::server

#include "server/http_server.h"

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "engine/async_engine.h"
#include "server/chat_page.h"
#include "server/connections.h"
#include "server/grammar_cache.h"
#include "server/http_server_impl.h"
#include "server/prometheus.h"

namespace kvlm::server {

void AsyncEngineClient::add_request(EngineRequest req) { e_.add_request(std::move(req)); }
void AsyncEngineClient::abort(const std::string& id) { e_.abort(id); }
EngineStats AsyncEngineClient::stats() const { return e_.stats(); }

namespace {

constexpr const char* kJson = "application/json";

// What the access-log line of the request the calling thread serves says besides the HTTP
// facts: the handler and the log run on the same worker thread (the streamed body too).
struct AccessRecord {
  int64_t prompt_tokens = -1, completion_tokens = -1;
};
thread_local AccessRecord t_access;

// "2026-11-26T03:45:12.345Z"
std::string utc_timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = int(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[96];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

}  // namespace

void reply(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(dump(body), kJson);
}

// An unexpected failure: the detail goes to the server's log under an id, the client gets the
// id (no internal exception text, no paths).
void reply_internal(httplib::Response& res, const std::string& what) {
  const std::string id = make_request_id("err-");
  log::error("internal error " + id + ": " + what);
  reply(res, 500, error_json(500, "internal error (logged by the server as " + id + ")", "", "internal_error"));
}

void reply_error(httplib::Response& res, const ApiError& e) { reply(res, e.status(), error_json(e)); }

// An endpoint of the other runner (--runner): a 400 that says which one the server runs.
void require_runner(const ServedModel& m, bool pooling) {
  if (bool(m.pooling) == pooling) return;
  throw ApiError(400,
                 pooling ? "this server runs '" + m.info.name +
                               "' as a generative model; embeddings need an embedding model served with --runner "
                               "pooling (the default for a directory with sentence-transformers' modules.json)"
                         : "this server runs '" + m.info.name +
                               "' as an embedding model (--runner pooling): it answers /v1/embeddings and does not "
                               "generate; serve it with --runner generate to generate text",
                 "", "model_not_supported");
}

void record_usage(const Json& usage) {
  if (!usage.is_object()) return;
  if (auto it = usage.find("prompt_tokens"); it != usage.end() && it->is_number_integer()) t_access.prompt_tokens = it->get<int64_t>();
  if (auto it = usage.find("completion_tokens"); it != usage.end() && it->is_number_integer())
    t_access.completion_tokens = it->get<int64_t>();
}

void HttpServer::Impl::install_routes() {
  // The accept loop only hands each socket to the connection manager (see connections.h).
  svr.new_task_queue = [] { return new InlineQueue; };
  svr.set_tcp_nodelay(true);  // SSE chunks are small: send them now
  // One byte over our own limit, which post() enforces on the (inflated) body as it arrives:
  // so a chunked body over the limit reaches post()'s check, not httplib's.
  svr.set_payload_max_length(opts.max_body_bytes + 1);
  svr.set_read_timeout(opts.read_timeout_s, 0);
  svr.set_write_timeout(opts.write_timeout_s, 0);
  svr.set_keep_alive_timeout(opts.keep_alive_timeout_s);
  svr.set_keep_alive_max_count(1000);

  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    ConnectionManager::headers_done();  // the body's deadline starts now
    t_access = {};
    if (!opts.allowed_origins.empty()) {
      if (const std::string origin = allowed_origin(req); !origin.empty()) {
        res.set_header("Access-Control-Allow-Origin", origin);
        if (origin != "*") res.set_header("Vary", "Origin");
      }
      // A CORS preflight: answered here, before the API key (browsers send none with it).
      if (req.method == "OPTIONS" && req.has_header("Origin") && req.has_header("Access-Control-Request-Method")) {
        if (!res.has_header("Access-Control-Allow-Origin")) {
          res.set_header("Connection", "close");
          ConnectionManager::close_after_response();
          reply(res, 403, error_json(403, "cross-origin requests from '" + req.get_header_value("Origin") +
                                              "' are not allowed (see --allowed-origins)"));
          return httplib::Server::HandlerResponse::Handled;
        }
        res.status = 204;
        res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        const std::string asked = req.get_header_value("Access-Control-Request-Headers");
        res.set_header("Access-Control-Allow-Headers", asked.empty() ? "Authorization, Content-Type" : asked);
        res.set_header("Access-Control-Max-Age", "600");
        return httplib::Server::HandlerResponse::Handled;
      }
    }
    // An API server serves no byte ranges: httplib would build every range a Range header
    // lists (overlapping ones too) into one response in memory, ~4,000x an 8 KB header on a
    // page anyone may load. The request is httplib's own (non-const) object; it parsed the
    // ranges before routing and applies them after the handler. This is the second of two
    // guards: parse_framing (connections.cpp) already refused a Range header long enough to
    // make that parse itself costly, so what reaches here is short and merely ignored.
    const_cast<httplib::Request&>(req).ranges.clear();
    if (opts.api_key.empty()) return httplib::Server::HandlerResponse::Unhandled;
    // The key guards the API and every route that reads a body (/tokenize compiles
    // structured outputs and renders chat templates): only GET /, /health and /metrics
    // answer without it.
    const bool needs_key = req.method == "POST" || req.path == "/v1" || req.path.rfind("/v1/", 0) == 0;
    if (!needs_key) return httplib::Server::HandlerResponse::Unhandled;
    const std::string auth = req.get_header_value("Authorization");
    constexpr std::string_view kBearer = "Bearer ";
    const bool ok = auth.size() > kBearer.size() && auth.compare(0, kBearer.size(), kBearer) == 0 &&
                    constant_time_equal(auth.substr(kBearer.size()), opts.api_key);
    if (ok) return httplib::Server::HandlerResponse::Unhandled;
    // Refused before its body was read: what follows on the connection cannot be trusted to
    // start the next request (a body shaped like one would be answered as one).
    res.set_header("Connection", "close");
    ConnectionManager::close_after_response();
    res.set_header("WWW-Authenticate", "Bearer");
    reply(res, 401,
          error_json(401,
                     auth.empty() ? "this server needs an API key: send the header 'Authorization: Bearer <key>'"
                                  : "incorrect API key in the Authorization header",
                     "", "invalid_api_key"));
    return httplib::Server::HandlerResponse::Handled;
  });

  svr.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;  // a handler's own error body
    if (res.status == 400 && ConnectionManager::current_timed_out()) {  // the headers stopped coming
      res.status = 408;
      res.set_header("Connection", "close");
      ConnectionManager::close_after_response();
      res.set_content(dump(error_json(408, "the request's headers did not arrive within " +
                                               std::to_string(opts.header_timeout_s) + " s", "", "request_timeout")),
                      kJson);
      return;
    }
    // httplib's own refusals of a request it could not parse or read: the bytes after it
    // cannot be trusted to start the next request.
    if (res.status == 400 || res.status == 413 || res.status == 414) ConnectionManager::close_after_response();
    std::string msg;
    switch (res.status) {
      case 404: msg = "no route for " + req.method + " " + req.path; break;
      case 413: msg = "the request body is too large"; break;
      case 414: msg = "the request URI is too long"; break;
      case 400: msg = "malformed HTTP request"; break;
      default: msg = "HTTP error " + std::to_string(res.status); break;
    }
    res.set_content(dump(error_json(res.status, msg)), kJson);
  });

  svr.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    reply_internal(res, what);
  });

  // Responses are counted before they are written (httplib calls this just before the status
  // line goes out; its logger runs after the client has the answer, so a client's next
  // request, on another connection, could read /metrics before the count).
  svr.set_post_routing_handler([this](const httplib::Request&, httplib::Response& res) {
    std::lock_guard lock(stats_mu);
    ++by_status[res.status];
  });
  svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    // Health checks and scrapes come every few seconds from probes: logged with -v only.
    const bool probe = req.path == "/health" || req.path == "/metrics";
    if (opts.log_requests && log::level() >= (probe ? log::Level::Info : log::Level::Warn)) access_log(req, res);
  });

  // The chat page (no key needed to load it; it asks for one when /v1/* answers 401).
  svr.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("Content-Security-Policy", "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'");
    res.set_content(std::string(chat_page()), "text/html; charset=utf-8");
  });
  svr.Get("/v1/kvlm/plan", [this](const httplib::Request&, httplib::Response& res) {
    const ServedModel* m = served(res);
    if (!m) return;
    reply(res, 200, m->kv_plan);
  });
  svr.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!served(res)) return;
    if (draining.load()) {
      reply(res, 503, error_json(503, "the server is shutting down", "", "server_shutting_down"));
      return;
    }
    res.status = 200;
  });
  const auto model_json = [this](const ServedModel& m) {
    Json model = Json::object();
    model["id"] = m.info.name;
    model["object"] = "model";
    model["created"] = created;
    model["owned_by"] = "kvlm";
    model["root"] = m.info.name;  // the served name: a path would tell clients about the server's disk
    model["parent"] = nullptr;
    model["max_model_len"] = m.info.max_model_len;
    model["vocab_size"] = m.info.vocab_size;  // kvlm's addition (kvlm bench serve's synthetic prompts)
    return model;
  };
  svr.Get("/v1/models", [this, model_json](const httplib::Request&, httplib::Response& res) {
    const ServedModel* m = served(res);
    if (!m) return;
    reply(res, 200, Json{{"object", "list"}, {"data", Json::array({model_json(*m)})}});
  });
  // GET /v1/models/{id}: the model, or 404 as OpenAI answers for another id.
  svr.Get(R"(/v1/models/(.+))", [this, model_json](const httplib::Request& req, httplib::Response& res) {
    const ServedModel* m = served(res);
    if (!m) return;
    const std::string id = req.matches[1];
    if (id != m->info.name) {
      reply(res, 404, error_json(404, "The model '" + id.substr(0, 200) + "' does not exist; this server serves '" + m->info.name + "'",
                                 "model", "model_not_found"));
      return;
    }
    reply(res, 200, model_json(*m));
  });
  svr.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    const ServedModel* m = served(res);
    if (!m) return;
    HttpStats hs;
    {
      std::lock_guard lock(stats_mu);
      hs.responses_by_status = by_status;
    }
    {
      std::lock_guard lock(live_mu);
      hs.requests_in_flight = int(live.size());
    }
    read_process_memory(hs);
    res.set_content(format_prometheus(m->engine->stats(), hs, m->info.name), "text/plain; version=0.0.4; charset=utf-8");
  });
  post("/v1/completions", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    generate(req, body, res, Endpoint::Completions);
  });
  post("/v1/embeddings", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    embed(req, body, res);
  });
  post("/v1/chat/completions", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    generate(req, body, res, Endpoint::Chat);
  });
  post("/v1/responses", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    generate(req, body, res, Endpoint::Chat, /*responses=*/true);
  });
  // A stored response (store: true), and its deletion.
  svr.Get(R"(/v1/responses/([A-Za-z0-9_\-]+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (!served(res)) return;
    if (const auto r = response_store.response(req.matches[1])) reply(res, 200, *r);
    else reply(res, 404, error_json(404, "Response with id '" + std::string(req.matches[1]) + "' not found", "response_id", "response_not_found"));
  });
  svr.Delete(R"(/v1/responses/([A-Za-z0-9_\-]+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (!served(res)) return;
    const std::string id = req.matches[1];
    if (response_store.erase(id)) reply(res, 200, Json{{"id", id}, {"object", "response"}, {"deleted", true}});
    else reply(res, 404, error_json(404, "Response with id '" + id + "' not found", "response_id", "response_not_found"));
  });
  post("/tokenize", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    tokenize(req, body, res);
  });
  post("/detokenize", [this](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    detokenize(req, body, res);
  });
}

// A POST route whose body this server reads itself, as it arrives (decompressed when the client
// sent Content-Encoding gzip / deflate), up to max_body_bytes of it, and always as JSON: with a
// plain handler httplib parses an application/x-www-form-urlencoded body (what `curl -d` sends)
// as a form and refuses one over 8 KiB with a 413 that our JSON limit never meant; and the limit
// here holds for the inflated size, so a small gzip of zeros cannot grow into gigabytes.
template <class F>
void HttpServer::Impl::post(const char* path, F handler) {
  svr.Post(path, [this, handler](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
    if (req.is_multipart_form_data()) {  // (httplib's plain reader cannot read one: it needs part callbacks)
      reply(res, 400, error_json(400, "multipart bodies are not supported: send the request as JSON "
                                      "(Content-Type: application/json)"));
      return;
    }
    std::string body;
    // A declared length over the limit: httplib reads and drops the body (so the client can
    // read the answer) and the read fails; nothing is kept.
    bool too_big = false;
    if (req.has_header("Content-Length")) {
      const std::string cl = req.get_header_value("Content-Length");
      too_big = cl.size() > 19 || std::strtoull(cl.c_str(), nullptr, 10) > uint64_t(opts.max_body_bytes);
    }
    const bool ok = read([&](const char* data, size_t n) {
      if (too_big) return true;  // (not reached: httplib skips such a body)
      if (body.size() + n > opts.max_body_bytes) {
        too_big = true;
        return false;
      }
      body.append(data, n);
      return true;
    });
    // Unless the body was read whole, what is left of it must not be taken for a next request.
    if (too_big || !ok) {
      res.set_header("Connection", "close");
      ConnectionManager::close_after_response();
    }
    if (too_big) {
      reply(res, 413, error_json(413, "the request body is larger than this server's limit of " +
                                          std::to_string(opts.max_body_bytes) + " bytes"));
      return;
    }
    if (!ok && ConnectionManager::current_timed_out()) {
      reply(res, 408, error_json(408, "the request body did not arrive within " + std::to_string(opts.read_timeout_s) + " s",
                                 "", "request_timeout"));
      return;
    }
    if (!ok) {
      reply(res, 400, error_json(400, "the request body could not be read (a malformed or unsupported encoding?)"));
      return;
    }
    guarded(res, [&] {
      handler(req, body, res);
    });
  });
}

std::string HttpServer::Impl::allowed_origin(const httplib::Request& req) const {
  if (!req.has_header("Origin")) return "";
  const std::string origin = req.get_header_value("Origin");
  for (const auto& o : opts.allowed_origins) {
    if (o == "*") return "*";
    if (o == origin) return origin;
  }
  return "";
}

// One line per request on stderr: when, who, what, the answer, tokens where the request
// generated, and the time from its headers to the end of its response (a stream's too).
void HttpServer::Impl::access_log(const httplib::Request& req, const httplib::Response& res) const {
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - ConnectionManager::current_started()).count();
  auto tokens = [](int64_t n) { return n < 0 ? std::string("-") : std::to_string(n); };
  const std::string peer = req.remote_addr.find(':') != std::string::npos ? "[" + req.remote_addr + "]" : req.remote_addr;
  std::fprintf(stderr, "%s %s:%d \"%s %s\" %d prompt_tokens=%s completion_tokens=%s latency_ms=%.1f\n",
               utc_timestamp().c_str(), peer.c_str(), req.remote_port, req.method.c_str(), req.path.c_str(), res.status,
               tokens(t_access.prompt_tokens).c_str(), tokens(t_access.completion_tokens).c_str(), ms);
}

HttpServer::HttpServer(ServerOptions opts) : impl_(std::make_unique<Impl>(std::move(opts))) {
  impl_->install_routes();
  ConnectionLimits lim;
  lim.max_busy = std::max(impl_->opts.max_connections, 1);
  lim.max_open = impl_->opts.max_open_connections;
  lim.header_timeout_s = impl_->opts.header_timeout_s;
  lim.read_timeout_s = impl_->opts.read_timeout_s;
  lim.write_timeout_s = impl_->opts.write_timeout_s;
  lim.keep_alive_timeout_s = impl_->opts.keep_alive_timeout_s;
  lim.keep_alive_max_count = 1000;
  impl_->conns = std::make_unique<ConnectionManager>(
      impl_->svr, lim, [I = impl_.get()](int status, const std::string& message, const std::string& code) {
        {
          std::lock_guard lock(I->stats_mu);  // refusals count in /metrics as answers do
          ++I->by_status[status];
        }
        return dump(error_json(status, message, "", code));
      });
  // httplib's default sets SO_REUSEPORT, with which a second server (another model) binds the
  // same port and the kernel splits the connections between the two. SO_REUSEADDR alone lets
  // a restarted server bind while old connections linger in TIME_WAIT, and nothing more.
  impl_->svr.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::bind() {
  Impl& I = *impl_;
  if (I.opts.port < 0 || I.opts.port > 65535) throw Error("--port must be between 0 and 65535, got " + std::to_string(I.opts.port));
  errno = 0;
  if (I.opts.port == 0) {
    I.port = I.svr.bind_to_any_port(I.opts.host);
    if (I.port < 0) I.port = -1;
  } else {
    I.port = I.svr.bind_to_port(I.opts.host, I.opts.port) ? I.opts.port : -1;
  }
  if (I.port < 0) {
    const int err = errno;
    throw Error("cannot listen on " + I.opts.host + ":" + std::to_string(I.opts.port) +
                (err ? std::string(": ") + std::strerror(err) : std::string()) +
                "; is another server using the port? Choose another with --port, or check --host");
  }
  ::listen(I.svr.listen_fd(), 4096);  // a longer backlog than httplib's 5
  return I.port;
}

void HttpServer::start() {
  Impl& I = *impl_;
  if (I.started) return;
  if (I.port < 0) bind();
  I.started = true;
  I.listener_done = false;
  I.conns->start();
  I.thread = std::thread([&I] {
    I.svr.listen_after_bind();
    I.listener_done = true;
  });
  I.wait_listening();
}

void HttpServer::set_ready(ServedModel model) {
  impl_->model = std::move(model);
  impl_->ready.store(true, std::memory_order_release);
}

void HttpServer::begin_drain() {
  std::lock_guard lock(impl_->live_mu);
  impl_->draining.store(true);
}

int HttpServer::in_flight() const {
  std::lock_guard lock(impl_->live_mu);
  return int(impl_->live.size());
}

bool HttpServer::wait_idle(std::chrono::steady_clock::time_point deadline) const {
  std::unique_lock lock(impl_->live_mu);
  return impl_->live_cv.wait_until(lock, deadline, [&] { return impl_->live.empty(); });
}

void HttpServer::cancel_all(const std::string& why) {
  std::vector<Impl::Live> all;
  {
    std::lock_guard lock(impl_->live_mu);
    for (const auto& [_, l] : impl_->live) all.push_back(l);
  }
  // The stream first, so its choices end with `why`: a choice's first finish wins, and the
  // engine's own abort event (aborted before, it raced this and sometimes won, losing the
  // reason) is then ignored as an echo.
  for (const auto& l : all) {
    for (int c = 0; c < l.stream->num_choices(); ++c) l.stream->fail(c, FinishReason::Abort, why);
    for (const auto& e : l.engine_ids) l.engine->abort(e);
  }
}

void HttpServer::stop() {
  Impl& I = *impl_;
  if (I.started) {
    // httplib's stop() does nothing until its accept loop has started.
    I.wait_listening();
    if (I.svr.is_running()) I.svr.stop();  // closes the listener: nothing new is accepted
    if (I.thread.joinable()) I.thread.join();
    I.conns->stop();  // closes idle connections now instead of after their keep-alive timeout
    I.started = false;
  }
}

int HttpServer::bound_port() const { return impl_->port; }

}  // namespace kvlm::server

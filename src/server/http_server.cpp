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
#include "server/prometheus.h"
#include "server/request_stream.h"
#include "server/response.h"
#include "server/responses.h"
#include "offline/embed.h"

namespace kvlm::server {

void AsyncEngineClient::add_request(EngineRequest req) { e_.add_request(std::move(req)); }
void AsyncEngineClient::abort(const std::string& id) { e_.abort(id); }
EngineStats AsyncEngineClient::stats() const { return e_.stats(); }

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr const char* kJson = "application/json";

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

// What the access-log line of the request the calling thread serves says besides the HTTP
// facts: the handler and the log run on the same worker thread (the streamed body too).
struct AccessRecord {
  int64_t prompt_tokens = -1, completion_tokens = -1;
};
thread_local AccessRecord t_access;

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
  void tokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void detokenize(const httplib::Request& req, const std::string& body, httplib::Response& res);
  template <class F>
  void post(const char* path, F handler);
  void install_routes();
  // CORS: the Access-Control-Allow-Origin a request's Origin gets ("" when none).
  std::string allowed_origin(const httplib::Request& req) const;
  void access_log(const httplib::Request& req, const httplib::Response& res) const;
};

Flight::~Flight() {
  try {
    abort_unfinished();  // nobody will read what they produce
  } catch (...) {
  }
  if (unregister) unregister(id);
}

void HttpServer::Impl::generate(const httplib::Request& req, const std::string& raw, httplib::Response& res, Endpoint ep,
                                bool responses) {
  const ServedModel* m = served(res);
  if (!m) return;
  if (draining.load()) {
    reply(res, 503, error_json(503, "the server is shutting down and takes no new requests", "", "server_shutting_down"));
    return;
  }
  const bool chat = ep == Endpoint::Chat;
  require_runner(*m, /*pooling=*/false);
  const Json body = parse_body(raw, opts.limits);
  std::optional<ResponsesRequest> rr;
  GenParams gen;
  std::vector<std::vector<TokenId>> prompts;
  std::vector<std::string> echo_texts;
  if (!chat) {
    CompletionRequest cr = parse_completion_request(body, m->info, opts.limits);
    gen = cr.gen;
    for (auto& p : cr.prompts) {
      std::vector<TokenId> ids = p.text ? m->text->encode_prompt(*p.text) : std::move(p.ids);
      std::string echo;
      if (gen.echo) echo = p.text ? *p.text : (m->text ? m->text->tokenizer().decode(ids, gen.skip_special_tokens, true) : "");
      echo_texts.push_back(std::move(echo));
      prompts.push_back(std::move(ids));
    }
  } else {
    if (responses) rr = parse_responses_request(body, response_store);
    ChatRequest cr = parse_chat_request(rr ? rr->chat : body, m->info, opts.limits);
    gen = cr.gen;
    try {
      prompts.push_back(m->text->encode_chat(cr.messages, cr.add_generation_prompt, cr.template_kwargs));
      if (cr.tools_must_reach_prompt) {
        // A template that ignores `tools` renders the same prompt without them: the model
        // would never learn of the tools, and tool_choice auto would quietly never call one.
        Json without = cr.template_kwargs;
        without.erase("tools");
        if (m->text->encode_chat(cr.messages, cr.add_generation_prompt, without) == prompts.back())
          throw ApiError(400,
                         "this model's chat template does not render `tools`, so the model cannot see them and "
                         "would never call one: send tool_choice \"required\" or a named function (the call is "
                         "then forced), or serve with a --chat-template that renders tools",
                         "tools");
      }
      if (gen.reasoning) {  // does the prompt leave a <think> block open for the reply?
        const std::vector<TokenId>& ids = prompts.back();
        const size_t tail = std::min<size_t>(ids.size(), 64);
        gen.reply_in_reasoning = prompt_opens_reasoning(m->text->tokenizer().decode(
            std::span<const TokenId>(ids).last(tail), /*skip_special_tokens=*/false, true));
        if (gen.grammar) {  // the constraint binds the answer, after the reasoning
          gen.grammar = std::make_shared<const grammar::Grammar>(reasoning_then(*gen.grammar, gen.reply_in_reasoning));
          gen.grammar_key = std::string(gen.reply_in_reasoning ? "after reasoning\n" : "after optional reasoning\n") +
                            gen.grammar_key;
        }
      }
      if (!gen.reply_prefix.empty()) {  // the reply's first tokens, written for the model
        const std::vector<TokenId> more = m->text->tokenizer().encode(gen.reply_prefix, {.add_special_tokens = false});
        prompts.back().insert(prompts.back().end(), more.begin(), more.end());
      }
    } catch (const Error& e) {
      throw ApiError(400, "the model's chat template cannot render these messages: " + without_paths(e.what()), "messages");
    }
    echo_texts.emplace_back();
  }
  if (!m->text) gen.return_token_ids = true;  // no text to show: show the ids
  std::vector<int> max_tokens;
  for (const auto& p : prompts) {
    if (p.empty())
      throw ApiError(400, "the prompt is empty (it has no tokens after tokenization)", chat ? "messages" : "prompt");
    max_tokens.push_back(resolve_max_tokens(gen, int(p.size()), m->info.max_model_len, chat));
  }

  // One engine request per choice: prompt p, sample i -> choice p * n + i.
  const std::string id = make_request_id(rr ? "resp_" : chat ? "chatcmpl-" : "cmpl-");
  if (rr) gen.ignored_fields.insert(gen.ignored_fields.end(), rr->ignored_fields.begin(), rr->ignored_fields.end());
  if (!gen.ignored_fields.empty()) {
    std::string list;
    for (const auto& f : gen.ignored_fields) list += (list.empty() ? "" : ", ") + f;
    log::warn("request " + id + ": fields ignored (not OpenAI's or vLLM's): " + list);
  }
  const int total = int(prompts.size()) * gen.n;
  TextOptions to;
  to.stop = gen.stop;
  to.stop_token_ids = gen.stop_token_ids;
  if (!gen.ignore_eos) to.eos_token_ids = m->eos_token_ids;
  to.include_stop_str_in_output = gen.include_stop_str_in_output;
  to.skip_special_tokens = gen.skip_special_tokens;
  auto stream = std::make_shared<RequestStream>(m->text ? &m->text->tokenizer() : nullptr, to, total);
  // The engine stops at the model's EOS ids by itself; the tokenizer's EOS (which chat
  // templates end turns with) may not be among them.
  std::vector<TokenId> engine_stops = gen.stop_token_ids;
  if (!gen.ignore_eos)
    for (TokenId t : m->eos_token_ids)
      if (std::find(engine_stops.begin(), engine_stops.end(), t) == engine_stops.end()) engine_stops.push_back(t);
  std::shared_ptr<const grammar::CompiledGrammar> compiled;
  if (gen.grammar) {
    try {
      compiled = grammars.get(m->text->tokenizer(), m->info.vocab_size, gen.grammar, gen.grammar_key);
    } catch (const GrammarCacheBusy& e) {
      throw ApiError(503, e.what(), "", "server_busy");
    } catch (const Error& e) {
      throw ApiError(400, std::string("the request's output constraint cannot be compiled: ") + e.what(), "response_format");
    }
  }
  std::vector<ChoiceMeta> meta;
  std::vector<EngineRequest> reqs;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int i = 0; i < gen.n; ++i) {
      const int c = int(p) * gen.n + i;
      meta.push_back({.prompt_index = int(p), .prompt_ids = prompts[p], .echo_text = echo_texts[p]});
      EngineRequest er;
      er.id = id + "-" + std::to_string(c);
      er.group = id;
      er.prompt = prompts[p];
      er.priority = gen.priority;
      er.sampling = gen.sampling;
      er.seed = gen.seed ? *gen.seed + uint64_t(i) : random_seed();
      er.max_tokens = max_tokens[p];
      er.min_tokens = gen.min_tokens;
      er.ignore_eos = gen.ignore_eos;
      er.logprobs = gen.logprobs ? std::max(*gen.logprobs, 1) : 0;
      er.prompt_logprobs = std::max(gen.echo && gen.logprobs ? *gen.logprobs : -1, gen.prompt_logprobs.value_or(-1));
      er.stop_token_ids = engine_stops;
      er.logit_bias = gen.logit_bias;
      if (compiled) er.constraint = std::make_shared<grammar::Constraint>(compiled);
      er.on_output = [stream, c](const RequestOutput& out) { return stream->on_output(c, out); };
      reqs.push_back(std::move(er));
    }
  const std::shared_ptr<Flight> flight = begin_flight(id, stream, reqs, m->engine);

  ResponseAssembler asmb(ep, id, std::time(nullptr), m->info.name, gen, std::move(meta),
                         [this](TokenId t) { return token_text(t); });
  if (!gen.stream) {
    const bool present = await_all(req, res, *flight, [&](std::vector<ChoiceEvent>& evs) {
      asmb.add(evs);
      return !asmb.failure();
    });
    if (!present) return;
    if (asmb.failure()) {
      flight->abort_unfinished();
      reply_error(res, *asmb.failure());
      return;
    }
    if (rr) {
      const Json resp = response_from_chat(ResponseMeta{id, std::time(nullptr), m->info.name, rr->echo}, asmb.response());
      if (rr->store) response_store.put(id, resp, rr->input_items, rr->previous_response_id);
      reply(res, 200, resp);
    } else {
      reply(res, 200, asmb.response());
    }
    record_usage(asmb.usage());
    return;
  }

  auto st = std::make_shared<StreamState>(StreamState{flight, std::move(asmb), {}, false});
  if (rr) {
    st->responses = std::make_shared<ResponsesStream>(ResponseMeta{id, std::time(nullptr), m->info.name, rr->echo});
    if (rr->store)
      st->store_with = [this, id, input = rr->input_items, prev = rr->previous_response_id](const Json& resp) {
        response_store.put(id, resp, input, prev);
      };
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [st](size_t, httplib::DataSink& sink) {
        try {
          return write_stream(*st, sink);
        } catch (...) {
          return false;  // ends the response; the releaser aborts what is left
        }
      },
      [st](bool) {
        try {
          st->flight->abort_unfinished();
        } catch (...) {
        }
      });
}

bool HttpServer::Impl::await_all(const httplib::Request& req, httplib::Response& res, Flight& flight,
                                 const std::function<bool(std::vector<ChoiceEvent>&)>& take) {
  ConnectionProbe probe(req);
  auto next_probe = Clock::now() + 1s;
  std::vector<ChoiceEvent> evs;
  while (!flight.stream->done()) {
    evs.clear();
    flight.stream->wait(evs, 100ms);
    if (!take(evs)) break;
    const auto now = Clock::now();
    if (now >= next_probe) {
      next_probe = now + 250ms;
      if (probe.client_gone()) {
        flight.abort_unfinished();
        log::info("request " + flight.id + ": the client disconnected; aborted");
        res.status = 499;  // nginx's "client closed request", for the logs and /metrics
        return false;
      }
    }
  }
  return true;
}

std::shared_ptr<Flight> HttpServer::Impl::begin_flight(const std::string& id, const std::shared_ptr<RequestStream>& stream,
                                                       std::vector<EngineRequest>& reqs, EngineClient* engine) {
  auto flight = std::make_shared<Flight>();
  flight->id = id;
  flight->stream = stream;
  flight->engine = engine;
  for (const auto& r : reqs) flight->engine_ids.push_back(r.id);
  {
    std::lock_guard lock(live_mu);
    // Checked under the lock begin_drain() takes, so once draining starts the set of
    // requests in flight can only shrink.
    if (draining.load())
      throw ApiError(503, "the server is shutting down and takes no new requests", "", "server_shutting_down");
    live[id] = Live{stream, flight->engine_ids, engine};
  }
  flight->unregister = [this](const std::string& fid) { unregister(fid); };  // from here on
  for (size_t c = 0; c < reqs.size(); ++c) {
    try {
      engine->add_request(std::move(reqs[c]));
    } catch (const std::exception& e) {
      for (size_t j = 0; j < c; ++j) engine->abort(flight->engine_ids[j]);
      for (size_t j = c; j < reqs.size(); ++j) stream->fail(int(j), FinishReason::Abort, e.what());
      if (dynamic_cast<const EngineShutDown*>(&e) || draining.load())
        throw ApiError(503, "the server is shutting down and takes no new requests", "", "server_shutting_down");
      throw ApiError(400, without_paths(e.what()));
    }
  }
  return flight;
}

void HttpServer::Impl::embed(const httplib::Request& req, const std::string& raw, httplib::Response& res) {
  const ServedModel* m = served(res);
  if (!m) return;
  if (draining.load()) {
    reply(res, 503, error_json(503, "the server is shutting down and takes no new requests", "", "server_shutting_down"));
    return;
  }
  require_runner(*m, /*pooling=*/true);
  const Json body = parse_body(raw, opts.limits);
  EmbeddingRequest er = parse_embedding_request(body, m->info, opts.limits);
  try {
    check_dimensions(*m->pooling, m->hidden_size, er.dimensions);
  } catch (const Error& e) {
    throw ApiError(400, e.what(), "dimensions");
  }
  std::vector<std::vector<TokenId>> prompts;
  int64_t prompt_tokens = 0;
  for (size_t i = 0; i < er.inputs.size(); ++i) {
    Prompt& p = er.inputs[i];
    std::vector<TokenId> ids = !p.text ? std::move(p.ids)
                               : er.add_special_tokens ? m->text->encode_prompt(*p.text)
                                                       : m->text->tokenizer().encode(*p.text, {.add_special_tokens = false});
    if (er.truncate_prompt_tokens && int(ids.size()) > *er.truncate_prompt_tokens)
      ids.erase(ids.begin(), ids.end() - *er.truncate_prompt_tokens);  // vLLM keeps the last tokens
    if (ids.empty()) throw ApiError(400, "input " + std::to_string(i) + " is empty (it has no tokens after tokenization)", "input");
    if (int(ids.size()) > m->info.max_model_len)
      throw ApiError(400,
                     "input " + std::to_string(i) + " has " + std::to_string(ids.size()) +
                         " tokens; this model's maximum context length is " + std::to_string(m->info.max_model_len) +
                         " (send truncate_prompt_tokens to keep the last tokens)",
                     "input", "context_length_exceeded");
    prompt_tokens += int64_t(ids.size());
    prompts.push_back(std::move(ids));
  }
  const std::string id = make_request_id("embd-");
  if (!er.ignored_fields.empty()) {
    std::string list;
    for (const auto& f : er.ignored_fields) list += (list.empty() ? "" : ", ") + f;
    log::warn("request " + id + ": fields ignored (not OpenAI's or vLLM's): " + list);
  }
  TextOptions to;
  to.pooling = TextOptions::Pooling{.type = m->pooling->type, .width = m->hidden_size,
                                    .normalize = er.normalize.value_or(m->pooling->normalize), .dimensions = er.dimensions};
  auto stream = std::make_shared<RequestStream>(nullptr, to, int(prompts.size()));
  std::vector<EngineRequest> reqs;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r = embedding_request(id + "-" + std::to_string(i), std::move(prompts[i]), m->pooling->type);
    r.group = id;
    r.priority = er.priority;
    const int c = int(i);
    r.on_output = [stream, c](const RequestOutput& out) { return stream->on_output(c, out); };
    reqs.push_back(std::move(r));
  }
  const std::shared_ptr<Flight> flight = begin_flight(id, stream, reqs, m->engine);
  std::vector<std::vector<float>> vectors(reqs.size());
  const bool present = await_all(req, res, *flight, [&](std::vector<ChoiceEvent>& evs) {
    for (ChoiceEvent& ev : evs) {
      if (!ev.finished) continue;
      if (ev.reason == FinishReason::Error || ev.reason == FinishReason::Abort || ev.embedding.empty()) {
        flight->abort_unfinished();
        const std::string why = ev.error.empty() ? "the request was aborted" : ev.error;
        if (ev.reason == FinishReason::Abort)
          throw ApiError(503, "input " + std::to_string(ev.choice) + ": " + why, "", "server_busy");
        throw ApiError(500, "input " + std::to_string(ev.choice) + ": " + why, "", "internal_error");
      }
      vectors[size_t(ev.choice)] = std::move(ev.embedding);
    }
    return true;
  });
  if (!present) return;
  reply(res, 200, embedding_response(m->info.name, vectors, er.base64, prompt_tokens));
  record_usage(Json{{"prompt_tokens", prompt_tokens}});
}

// One turn of a streaming response: wait (briefly) for events, write their chunks, end the
// stream when every choice has finished. False when the client is gone.
bool HttpServer::Impl::write_stream(StreamState& st, httplib::DataSink& sink) {
  RequestStream& s = *st.flight->stream;
  std::string out;
  ResponsesStream* rs = st.responses.get();
  if (!st.begun) {
    st.begun = true;
    out = rs ? rs->begin() : st.asmb.begin();
  }
  st.evs.clear();
  s.wait(st.evs, out.empty() ? 100ms : 0ms);
  out += rs ? rs->events(st.asmb.chunk_objects(st.evs)) : st.asmb.chunks(st.evs);
  const bool failed = st.asmb.failure().has_value();
  const bool finished = failed || s.done();
  if (failed) {
    st.flight->abort_unfinished();
    if (rs) {
      out += rs->failed(*st.asmb.failure());
    } else {
      out += sse_event(error_json(*st.asmb.failure()));
      out += kSseDone;
    }
  } else if (finished) {
    if (rs) {
      out += rs->end(st.asmb.usage());
      if (st.store_with) st.store_with(rs->final_response());
    } else {
      out += st.asmb.end();
    }
    record_usage(st.asmb.usage());
  }
  if (!out.empty()) {
    if (!sink.write(out.data(), out.size())) return false;  // the client is gone
  } else if (!sink.is_writable()) {
    return false;  // the client closed the connection while we waited
  }
  if (finished) sink.done();
  return true;
}

void HttpServer::Impl::tokenize(const httplib::Request&, const std::string& raw, httplib::Response& res) {
  const ServedModel* m = served(res);
  if (!m) return;
  const Json body = parse_body(raw, opts.limits);
  if (const auto it = body.find("model"); it != body.end() && !it->is_null() && *it != m->info.name)
    throw ApiError(404, "The model '" + (it->is_string() ? it->get<std::string>() : it->dump()) + "' does not exist",
                   "model", "model_not_found");
  if (!m->text) throw ApiError(400, "this model has no tokenizer (tokenizer.json)");
  auto flag = [&](const char* key, bool dflt) {
    const auto it = body.find(key);
    if (it == body.end() || it->is_null()) return dflt;
    if (!it->is_boolean()) throw ApiError(400, std::string(key) + " must be a boolean", key);
    return it->get<bool>();
  };
  std::vector<TokenId> ids;
  if (body.contains("messages")) {
    if (!m->text->has_chat_template()) throw ApiError(400, "this model has no chat template", "messages");
    ModelInfo info = m->info;
    Json chat_body = body;
    chat_body.erase("model");
    const ChatRequest cr = parse_chat_request(chat_body, info, opts.limits);
    try {
      const std::string rendered = m->text->render_chat(cr.messages, cr.add_generation_prompt, cr.template_kwargs);
      ids = m->text->tokenizer().encode(rendered, {.add_special_tokens = flag("add_special_tokens", false)});
    } catch (const ApiError&) {
      throw;
    } catch (const Error& e) {
      throw ApiError(400, "the model's chat template cannot render these messages: " + without_paths(e.what()), "messages");
    }
  } else {
    const auto it = body.find("prompt");
    if (it == body.end() || !it->is_string()) throw ApiError(400, "prompt (a string) or messages is required", "prompt");
    const std::string& text = it->get_ref<const std::string&>();
    ids = flag("add_special_tokens", true) ? m->text->encode_prompt(text)
                                            : m->text->tokenizer().encode(text, {.add_special_tokens = false});
  }
  Json out = Json::object();
  out["count"] = ids.size();
  out["max_model_len"] = m->info.max_model_len;
  out["tokens"] = ids;
  if (flag("return_token_strs", false)) {
    Json strs = Json::array();
    for (TokenId t : ids) strs.push_back(m->text->tokenizer().id_to_token(t).value_or(""));
    out["token_strs"] = std::move(strs);
  } else {
    out["token_strs"] = nullptr;
  }
  reply(res, 200, out);
}

void HttpServer::Impl::detokenize(const httplib::Request&, const std::string& raw, httplib::Response& res) {
  const ServedModel* m = served(res);
  if (!m) return;
  const Json body = parse_body(raw, opts.limits);
  if (const auto it = body.find("model"); it != body.end() && !it->is_null() && *it != m->info.name)
    throw ApiError(404, "The model '" + (it->is_string() ? it->get<std::string>() : it->dump()) + "' does not exist",
                   "model", "model_not_found");
  if (!m->text) throw ApiError(400, "this model has no tokenizer (tokenizer.json)");
  const auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) throw ApiError(400, "tokens (a list of token ids) is required", "tokens");
  std::vector<TokenId> ids;
  for (const auto& v : *it) {
    if (!v.is_number_integer() && !v.is_number_unsigned()) throw ApiError(400, "tokens must hold integer token ids", "tokens");
    const int64_t t = v.is_number_unsigned() ? int64_t(std::min<uint64_t>(v.get<uint64_t>(), uint64_t(INT64_MAX))) : v.get<int64_t>();
    if (t < 0 || t >= m->info.vocab_size)
      throw ApiError(400, "token id " + std::to_string(t) + " is outside the model's vocabulary (0.." +
                              std::to_string(m->info.vocab_size - 1) + ")",
                     "tokens");
    ids.push_back(TokenId(t));
  }
  Json out = Json::object();
  out["prompt"] = m->text->tokenizer().decode(ids, false);
  reply(res, 200, out);
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

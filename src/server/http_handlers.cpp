// The HTTP server's endpoint handlers (HttpServer::Impl, http_server_impl.h): generation
// (completions, chat, responses) and its streaming, embeddings, tokenize and detokenize.
#include <ctime>

#include "core/log.h"
#include "engine/async_engine.h"
#include "offline/embed.h"
#include "server/http_server_impl.h"
#include "server/request_json.h"

namespace kvlm::server {

Flight::~Flight() {
  try {
    abort_unfinished();  // nobody will read what they produce
  } catch (...) {
  }
  if (unregister) unregister(id);
}

void HttpServer::Impl::generate(const httplib::Request& req, const std::string& raw, httplib::Response& res, Endpoint ep,
                                bool responses) {
  const ServedModel* m = accepting(res);
  if (!m) return;
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
      throw ApiError(400, std::string("the request's output constraint cannot be compiled: ") + e.what(), gen.grammar_field);
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
  const ServedModel* m = accepting(res);
  if (!m) return;
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

const ServedModel* HttpServer::Impl::text_request(const std::string& raw, httplib::Response& res, Json& body) {
  const ServedModel* m = served(res);
  if (!m) return nullptr;
  body = parse_body(raw, opts.limits);
  check_model(body, m->info);
  if (!m->text) throw ApiError(400, "this model has no tokenizer (tokenizer.json)");
  return m;
}

void HttpServer::Impl::tokenize(const httplib::Request&, const std::string& raw, httplib::Response& res) {
  Json body;
  const ServedModel* m = text_request(raw, res, body);
  if (!m) return;
  auto flag = [&](const char* key, bool dflt) { return opt_bool(body, key).value_or(dflt); };
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
  Json body;
  const ServedModel* m = text_request(raw, res, body);
  if (!m) return;
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

}  // namespace kvlm::server

#include "server/response.h"

#include <algorithm>
#include <map>

namespace kvlm::server {

namespace {

Json slice(const Json& arr, size_t from) {
  Json out = Json::array();
  for (size_t i = from; i < arr.size(); ++i) out.push_back(arr[i]);
  return out;
}

}  // namespace

ResponseAssembler::ResponseAssembler(Endpoint ep, std::string id, int64_t created, std::string model, const GenParams& gen,
                                     std::vector<ChoiceMeta> choices, TokenText token_text)
    : ep_(ep), id_(std::move(id)), created_(created), model_(std::move(model)), gen_(gen), meta_(std::move(choices)),
      token_text_(std::move(token_text)), recs_(meta_.size()) {}

void ResponseAssembler::add(const std::vector<ChoiceEvent>& events) {
  for (const auto& ev : events) fold(ev);
}

void ResponseAssembler::fold(const ChoiceEvent& ev) {
  if (ev.choice < 0 || size_t(ev.choice) >= recs_.size()) return;
  Record& r = recs_[size_t(ev.choice)];
  const ChoiceMeta& m = meta_[size_t(ev.choice)];
  const bool want_lp = gen_.logprobs.has_value();
  const int k = gen_.logprobs.value_or(0);
  if (ep_ == Endpoint::Completions && gen_.echo && !r.echoed) {
    r.echoed = true;
    r.text += m.echo_text;
    if (want_lp) r.lp.add_prompt(m.prompt_ids, ev.prompt_logprobs, k, token_text_);
  }
  if (gen_.prompt_logprobs && !ev.prompt_logprobs.empty()) r.prompt_lp = ev.prompt_logprobs;
  r.text += ev.text;
  r.tokens.insert(r.tokens.end(), ev.tokens.begin(), ev.tokens.end());
  if (want_lp)
    for (const auto& lp : ev.logprobs) {
      if (ep_ == Endpoint::Completions) r.lp.add(lp, k, token_text_);
      else r.chat_lp.push_back(chat_logprob_entry(lp, k, token_text_));
    }
  if (ev.prompt_tokens > 0) r.prompt_tokens = ev.prompt_tokens;
  r.completion_tokens = std::max(r.completion_tokens, ev.completion_tokens);
  r.cached_tokens = std::max(r.cached_tokens, ev.cached_tokens);
  if (ev.finished && !r.finished) {
    r.finished = true;
    r.reason = ev.reason;
    if (ev.stop_string) r.stop_reason = *ev.stop_string;
    else if (ev.stop_token) r.stop_reason = *ev.stop_token;
    if (ev.reason == FinishReason::Error && !failure_)
      failure_.emplace(500, "the engine failed while generating this request: " + (ev.error.empty() ? "unknown error" : without_paths(ev.error)),
                       "", "engine_error");
    if (ev.reason == FinishReason::Abort && !failure_)
      failure_.emplace(503, "the request was cancelled before it finished" + (ev.error.empty() ? std::string() : ": " + without_paths(ev.error)),
                       "", "request_cancelled");
  }
}

Json ResponseAssembler::chunk_base() const {
  Json j = Json::object();
  j["id"] = id_;
  j["object"] = ep_ == Endpoint::Completions ? "text_completion" : "chat.completion.chunk";
  j["created"] = created_;
  j["model"] = model_;
  return j;
}

std::string ResponseAssembler::begin() {
  if (ep_ != Endpoint::Chat) return {};
  std::string out;
  for (size_t i = 0; i < recs_.size(); ++i) {
    Json c = Json::object();
    c["index"] = i;
    c["delta"] = Json{{"role", "assistant"}, {"content", ""}};
    c["logprobs"] = nullptr;
    c["finish_reason"] = nullptr;
    Json j = chunk_base();
    j["choices"] = Json::array({std::move(c)});
    out += sse_event(j);
  }
  return out;
}

std::string ResponseAssembler::chunks(const std::vector<ChoiceEvent>& events) {
  std::string out;
  for (const Json& j : chunk_objects(events)) out += sse_event(j);
  return out;
}

std::vector<Json> ResponseAssembler::chunk_objects(const std::vector<ChoiceEvent>& events) {
  struct Mark {
    size_t text = 0, tokens = 0, lp = 0;
    bool was_finished = false;
  };
  std::vector<int> order;
  std::map<int, Mark> marks;
  for (const auto& ev : events) {
    if (ev.choice < 0 || size_t(ev.choice) >= recs_.size()) continue;
    if (!marks.count(ev.choice)) {
      const Record& r = recs_[size_t(ev.choice)];
      marks[ev.choice] = Mark{r.text.size(), r.tokens.size(), ep_ == Endpoint::Completions ? r.lp.tokens.size() : r.chat_lp.size(),
                              r.finished};
      order.push_back(ev.choice);
    }
    fold(ev);
  }
  std::vector<Json> out;
  for (int ci : order) {
    const Record& r = recs_[size_t(ci)];
    const Mark& mk = marks[ci];
    const std::string text = r.text.substr(mk.text);
    const bool finished_now = r.finished && !mk.was_finished;
    // An engine error or a cancellation is answered with an error event by the caller.
    const bool ok_finish = finished_now && r.reason != FinishReason::Error && r.reason != FinishReason::Abort;
    Json lp = nullptr;
    if (gen_.logprobs) {
      if (ep_ == Endpoint::Completions && r.lp.tokens.size() > mk.lp) {
        lp = Json::object();
        lp["tokens"] = slice(r.lp.tokens, mk.lp);
        lp["token_logprobs"] = slice(r.lp.token_logprobs, mk.lp);
        lp["top_logprobs"] = slice(r.lp.top_logprobs, mk.lp);
        lp["text_offset"] = slice(r.lp.text_offset, mk.lp);
      } else if (ep_ == Endpoint::Chat && r.chat_lp.size() > mk.lp) {
        lp = Json{{"content", slice(r.chat_lp, mk.lp)}};
      }
    }
    const bool new_tokens = gen_.return_token_ids && r.tokens.size() > mk.tokens;
    // Chat with --reasoning-parser: the text is split at <think> tags first; then, with tools,
    // the answer goes through the tool-call parser (calls whole, in one delta).
    std::string content = text, reasoning;
    Json calls = Json::array();
    Record& rw = recs_[size_t(ci)];
    if (ep_ == Endpoint::Chat && gen_.reasoning) {
      if (!rw.reasoning) rw.reasoning.emplace(gen_.reply_in_reasoning);
      ReasoningSplit s = rw.reasoning->push(text);
      if (finished_now) {
        ReasoningSplit f = rw.reasoning->finish();
        s.reasoning += f.reasoning;
        s.content += f.content;
      }
      content = std::move(s.content);
      reasoning = std::move(s.reasoning);
    }
    if (ep_ == Endpoint::Chat && gen_.tool_parser != ToolParser::None) {
      if (!rw.tools) {
        rw.tools.emplace(gen_.tool_parser, gen_.tools.get());
        rw.tools->push(gen_.reply_prefix);  // a forced call's header: nothing to send yet
      }
      ToolCallStream::Out o = rw.tools->push(content);
      if (finished_now) {
        ToolCallStream::Out f = rw.tools->finish();
        o.content += f.content;
        for (auto& c : f.calls) o.calls.push_back(std::move(c));
      }
      content = std::move(o.content);
      reasoning += o.reasoning;
      for (const ToolCall& call : o.calls)
        calls.push_back(Json{{"index", rw.tool_calls_sent++},
                             {"id", call.id},
                             {"type", "function"},
                             {"function", Json{{"name", call.name}, {"arguments", call.arguments}}}});
    }
    if (content.empty() && reasoning.empty() && calls.empty() && lp.is_null() && !ok_finish && !new_tokens) continue;
    Json c = Json::object();
    c["index"] = ci;
    if (ep_ == Endpoint::Completions) {
      c["text"] = content;
    } else {
      Json delta = Json::object();
      if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
      if (!content.empty()) delta["content"] = content;
      if (!calls.empty()) delta["tool_calls"] = std::move(calls);
      c["delta"] = std::move(delta);
    }
    c["logprobs"] = lp;
    c["finish_reason"] = ok_finish ? Json(finish_str(r, rw.tool_calls_sent > 0)) : Json(nullptr);
    if (ok_finish) c["stop_reason"] = r.stop_reason;
    if (gen_.return_token_ids) {
      std::vector<TokenId> toks(r.tokens.begin() + std::ptrdiff_t(mk.tokens), r.tokens.end());
      c["token_ids"] = toks;
    }
    Json j = chunk_base();
    j["choices"] = Json::array({std::move(c)});
    out.push_back(std::move(j));
  }
  return out;
}

std::string ResponseAssembler::finish_str(const Record& r, bool made_calls) const {
  return made_calls && r.reason == FinishReason::Stop ? "tool_calls" : finish_reason_str(r.reason);
}

Json ResponseAssembler::usage() const {
  int64_t prompt = 0, completion = 0, cached = 0;
  std::map<int, std::pair<int64_t, int64_t>> per_prompt;  // prompt index -> (tokens, cached)
  for (size_t i = 0; i < recs_.size(); ++i) {
    completion += recs_[i].completion_tokens;
    auto& pp = per_prompt[meta_[i].prompt_index];
    pp.first = int64_t(meta_[i].prompt_ids.size());
    pp.second = std::max<int64_t>(pp.second, recs_[i].cached_tokens);
  }
  for (const auto& [_, pp] : per_prompt) {
    prompt += pp.first;
    cached += pp.second;
  }
  return usage_json(prompt, completion, cached);
}

std::string ResponseAssembler::end() {
  std::string out;
  if (gen_.include_usage) {
    Json j = chunk_base();
    j["choices"] = Json::array();
    j["usage"] = usage();
    out += sse_event(j);
  }
  out += kSseDone;
  return out;
}

Json ResponseAssembler::response() const {
  Json j = Json::object();
  j["id"] = id_;
  j["object"] = ep_ == Endpoint::Completions ? "text_completion" : "chat.completion";
  j["created"] = created_;
  j["model"] = model_;
  Json choices = Json::array();
  for (size_t i = 0; i < recs_.size(); ++i) {
    const Record& r = recs_[i];
    Json c = Json::object();
    c["index"] = i;
    if (ep_ == Endpoint::Completions) {
      c["text"] = r.text;
      c["logprobs"] = gen_.logprobs ? r.lp.to_json() : Json(nullptr);
      c["finish_reason"] = finish_reason_str(r.reason);
      if (gen_.prompt_logprobs) c["prompt_logprobs"] = prompt_logprobs_json(r.prompt_lp, *gen_.prompt_logprobs, token_text_);
    } else {
      Json msg = Json{{"role", "assistant"}, {"content", r.text}};
      std::string answer = r.text;
      if (gen_.reasoning) {  // --reasoning-parser: <think> ... </think> apart from the answer
        ReasoningSplit s = split_reasoning(r.text, gen_.reply_in_reasoning);
        if (!s.reasoning.empty()) msg["reasoning_content"] = s.reasoning;
        msg["content"] = s.content;
        answer = std::move(s.content);
      }
      bool made_calls = false;
      if (gen_.tool_parser != ToolParser::None) {
        ExtractedCalls x = extract_tool_calls(gen_.tool_parser, gen_.reply_prefix + answer, gen_.tools.get());
        if (!x.reasoning.empty()) msg["reasoning_content"] = x.reasoning;
        if (parses_every_reply(gen_.tool_parser) && x.calls.empty()) msg["content"] = x.content;
        if (!x.calls.empty()) {
          made_calls = true;
          msg["content"] = x.content.empty() ? Json(nullptr) : Json(x.content);
          Json calls = Json::array();
          for (const ToolCall& call : x.calls)
            calls.push_back(Json{{"id", call.id},
                                 {"type", "function"},
                                 {"function", Json{{"name", call.name}, {"arguments", call.arguments}}}});
          msg["tool_calls"] = std::move(calls);
        }
      }
      c["message"] = std::move(msg);
      c["logprobs"] = gen_.logprobs ? Json{{"content", r.chat_lp}} : Json(nullptr);
      c["finish_reason"] = finish_str(r, made_calls);
    }
    c["stop_reason"] = r.stop_reason;
    if (gen_.return_token_ids) {
      c["token_ids"] = r.tokens;
      c["prompt_token_ids"] = meta_[i].prompt_ids;
    }
    choices.push_back(std::move(c));
  }
  j["choices"] = std::move(choices);
  j["usage"] = usage();
  // Chat: one prompt, so vLLM puts its log-probabilities beside the choices.
  if (ep_ == Endpoint::Chat && gen_.prompt_logprobs && !recs_.empty())
    j["prompt_logprobs"] = prompt_logprobs_json(recs_[0].prompt_lp, *gen_.prompt_logprobs, token_text_);
  return j;
}

}  // namespace kvlm::server

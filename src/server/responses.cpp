#include "server/responses.h"

#include <set>

#include "server/request_json.h"

namespace kvlm::server {

namespace {

// A message's content (a string, or parts of text) as one string.
std::string content_text(const Json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad(where + ".content must be a string or a list of parts, got " + kind(content), "input");
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const Json& p = content[i];
    const std::string pw = where + ".content[" + std::to_string(i) + "]";
    const Json* type = p.is_object() ? field(p, "type") : nullptr;
    if (!type || !type->is_string()) bad(pw + " must be an object with a type", "input");
    const std::string t = type->get<std::string>();
    if (t == "input_text" || t == "output_text" || t == "text" || t == "reasoning_text") {
      const Json* tx = field(p, "text");
      if (!tx || !tx->is_string()) bad(pw + ".text must be a string", "input");
      text += tx->get<std::string>();
    } else if (t == "refusal") {
      if (const Json* r = field(p, "refusal"); r && r->is_string()) text += r->get<std::string>();
    } else {
      bad(pw + ": content of type '" + t + "' is not supported by kvlm (text models only: input_text, output_text)",
          "input");
    }
  }
  return text;
}

// Items (the Responses API's conversation) as chat messages.
void append_messages(const Json& items, Json& messages) {
  for (size_t i = 0; i < items.size(); ++i) {
    const Json& it = items[i];
    const std::string where = "input[" + std::to_string(i) + "]";
    if (!it.is_object()) bad(where + " must be an object, got " + kind(it), "input");
    const Json* type = field(it, "type");
    const std::string t = type && type->is_string() ? type->get<std::string>() : "message";
    if (t == "message") {
      const Json* role = field(it, "role");
      if (!role || !role->is_string()) bad(where + ".role is required", "input");
      std::string r = role->get<std::string>();
      if (r != "user" && r != "assistant" && r != "system" && r != "developer")
        bad(where + ".role must be user, assistant, system or developer, got '" + r.substr(0, 32) + "'", "input");
      if (r == "developer") r = "system";  // chat templates know system
      const Json* content = field(it, "content");
      if (!content) bad(where + ".content is required", "input");
      messages.push_back(Json{{"role", r}, {"content", content_text(*content, where)}});
    } else if (t == "function_call") {
      const Json* name = field(it, "name");
      const Json* args = field(it, "arguments");
      const Json* call_id = field(it, "call_id");
      if (!name || !name->is_string() || !args || !args->is_string() || !call_id || !call_id->is_string())
        bad(where + ": a function_call item needs call_id, name and arguments strings", "input");
      const Json call = {{"id", *call_id}, {"type", "function"}, {"function", {{"name", *name}, {"arguments", *args}}}};
      // Calls after an assistant message (or after each other) belong to that assistant turn.
      if (!messages.empty() && messages.back()["role"] == "assistant") {
        Json& last = messages.back();
        if (!last.contains("tool_calls")) last["tool_calls"] = Json::array();
        last["tool_calls"].push_back(call);
      } else {
        messages.push_back(Json{{"role", "assistant"}, {"content", ""}, {"tool_calls", Json::array({call})}});
      }
    } else if (t == "function_call_output") {
      const Json* call_id = field(it, "call_id");
      const Json* out = field(it, "output");
      if (!call_id || !call_id->is_string() || !out)
        bad(where + ": a function_call_output item needs call_id and output", "input");
      messages.push_back(Json{{"role", "tool"},
                              {"tool_call_id", *call_id},
                              {"content", out->is_string() ? out->get<std::string>() : content_text(*out, where)}});
    } else if (t == "reasoning") {
      continue;  // earlier turns' reasoning: chat templates leave it out of the prompt
    } else {
      bad(where + ": input items of type '" + t.substr(0, 40) +
              "' are not supported by kvlm (message, function_call, function_call_output, reasoning)",
          "input");
    }
  }
}

Json input_items_of(const Json& input) {
  if (input.is_string()) return Json::array({Json{{"type", "message"}, {"role", "user"}, {"content", input}}});
  if (!input.is_array()) bad("input must be a string or a list of items, got " + kind(input), "input");
  Json items = Json::array();
  for (const Json& it : input) {
    Json copy = it;
    if (copy.is_object() && !copy.contains("type")) copy["type"] = "message";
    items.push_back(std::move(copy));
  }
  return items;
}

std::string item_id(const char* prefix) { return make_request_id(prefix); }

Json usage_from_chat(const Json& u) {
  const int64_t in = u.value("prompt_tokens", int64_t(0)), out = u.value("completion_tokens", int64_t(0));
  int64_t cached = 0;
  if (const auto d = u.find("prompt_tokens_details"); d != u.end() && d->is_object()) cached = d->value("cached_tokens", int64_t(0));
  return {{"input_tokens", in},
          {"input_tokens_details", {{"cached_tokens", cached}}},
          {"output_tokens", out},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", in + out}};
}

Json reasoning_item(const std::string& id, const std::string& text) {
  return {{"id", id},
          {"type", "reasoning"},
          {"summary", Json::array()},
          {"content", Json::array({Json{{"type", "reasoning_text"}, {"text", text}}})},
          {"status", "completed"}};
}

Json output_text(const std::string& text, const Json& logprobs) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", Json::array()}, {"logprobs", logprobs}};
}

Json message_item(const std::string& id, const std::string& text, const Json& logprobs, const char* status) {
  return {{"id", id},
          {"type", "message"},
          {"status", status},
          {"role", "assistant"},
          {"content", Json::array({output_text(text, logprobs)})}};
}

Json call_item(const std::string& id, const std::string& call_id, const std::string& name, const std::string& args,
               const char* status) {
  return {{"id", id}, {"type", "function_call"}, {"call_id", call_id}, {"name", name}, {"arguments", args}, {"status", status}};
}

// The Response object around `output`.
Json response_object(const ResponseMeta& m, const std::string& status, Json output, Json usage, const std::string& finish) {
  Json r = Json::object();
  r["id"] = m.id;
  r["object"] = "response";
  r["created_at"] = m.created;
  r["status"] = status;
  r["background"] = false;
  r["error"] = nullptr;
  r["incomplete_details"] = status == "incomplete" ? Json{{"reason", finish == "length" ? "max_output_tokens" : finish}}
                                                   : Json(nullptr);
  r["model"] = m.model;
  r["output"] = std::move(output);
  for (auto it = m.echo.begin(); it != m.echo.end(); ++it) r[it.key()] = it.value();
  r["usage"] = std::move(usage);
  return r;
}

}  // namespace

// ---- the store ------------------------------------------------------------------------------

ResponseStore::ResponseStore(size_t max_responses, size_t max_bytes) : max_responses_(max_responses), max_bytes_(max_bytes) {}

void ResponseStore::put(const std::string& id, Json response, Json input_items, std::optional<std::string> previous) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  const size_t bytes = response.dump().size() + input_items.dump().size() + id.size() + 64;
  if (bytes > max_bytes_) return;  // larger than the whole store: not kept
  if (auto it = entries_.find(id); it != entries_.end()) {
    bytes_ -= it->second.bytes;
    order_.erase(it->second.age);
    entries_.erase(it);
  }
  order_.push_back(id);
  entries_[id] = Entry{std::move(response), std::move(input_items), std::move(previous), bytes, std::prev(order_.end())};
  bytes_ += bytes;
  evict();
}

void ResponseStore::evict() {
  while (!order_.empty() && (entries_.size() > max_responses_ || bytes_ > max_bytes_)) {
    auto it = entries_.find(order_.front());
    bytes_ -= it->second.bytes;
    entries_.erase(it);
    order_.pop_front();
  }
}

std::optional<Json> ResponseStore::response(const std::string& id) const {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.response;
}

bool ResponseStore::erase(const std::string& id) {
  std::lock_guard lock(mu_);
  const auto it = entries_.find(id);
  if (it == entries_.end()) return false;
  bytes_ -= it->second.bytes;
  order_.erase(it->second.age);
  entries_.erase(it);
  return true;
}

size_t ResponseStore::size() const {
  std::lock_guard lock(mu_);
  return entries_.size();
}

Json ResponseStore::conversation(const std::string& id) const {
  std::lock_guard lock(mu_);
  std::vector<const Entry*> chain;
  std::optional<std::string> at = id;
  while (at) {
    const auto it = entries_.find(*at);
    if (it == entries_.end())
      throw ApiError(404,
                     *at == id ? "Response with id '" + id + "' not found (this server keeps the latest responses of "
                                 "requests with store: true, in memory)"
                               : "the conversation of '" + id + "' goes back to response '" + *at +
                                     "', which this server no longer keeps; send the whole conversation as input",
                     "previous_response_id", "response_not_found");
    chain.push_back(&it->second);
    if (chain.size() > entries_.size()) break;  // a cycle cannot happen; never loop on one
    at = it->second.previous;
  }
  Json items = Json::array();
  for (auto e = chain.rbegin(); e != chain.rend(); ++e) {
    for (const Json& it : (*e)->input) items.push_back(it);
    if (const auto out = (*e)->response.find("output"); out != (*e)->response.end())
      for (const Json& it : *out) items.push_back(it);
  }
  return items;
}

// ---- requests -------------------------------------------------------------------------------

ResponsesRequest parse_responses_request(const Json& b, const ResponseStore& store) {
  ResponsesRequest r;
  Json chat = Json::object();
  if (const Json* m = field(b, "model")) chat["model"] = *m;
  for (const char* refused : {"background", "prompt", "conversation"}) {
    const Json* v = field(b, refused);
    if (v && *v != false && !(v->is_object() && v->empty()))
      bad(std::string(refused) == "background"     ? "background responses are not supported by kvlm; stream instead"
          : std::string(refused) == "conversation" ? "conversations are not supported by kvlm; chain responses with previous_response_id"
                                                   : "prompt templates are not supported by kvlm; send instructions and input",
          refused);
  }
  if (const Json* t = field(b, "truncation"); t && *t != "disabled")
    bad("truncation must be \"disabled\": kvlm does not drop earlier turns of a conversation", "truncation");
  r.stream = false;
  if (const Json* s = field(b, "stream")) {
    if (!s->is_boolean()) bad("stream must be a boolean", "stream");
    r.stream = s->get<bool>();
  }
  if (const Json* s = field(b, "store")) {
    if (!s->is_boolean()) bad("store must be a boolean", "store");
    r.store = s->get<bool>();
  }
  Json messages = Json::array();
  Json instructions = nullptr;
  if (const Json* ins = field(b, "instructions")) {
    if (!ins->is_string()) bad("instructions must be a string, got " + kind(*ins), "instructions");
    instructions = *ins;
    messages.push_back(Json{{"role", "system"}, {"content", *ins}});
  }
  if (const Json* prev = field(b, "previous_response_id")) {
    if (!prev->is_string()) bad("previous_response_id must be a string", "previous_response_id");
    if (!store.enabled())
      bad("this server keeps no responses (--responses-store-size 0), so previous_response_id cannot be used; send "
          "the whole conversation as input",
          "previous_response_id");
    r.previous_response_id = prev->get<std::string>();
    append_messages(store.conversation(*r.previous_response_id), messages);
  }
  const Json* input = field(b, "input");
  if (!input) bad("input is required", "input");
  r.input_items = input_items_of(*input);
  append_messages(r.input_items, messages);
  if (messages.empty()) bad("input must hold at least one item", "input");
  chat["messages"] = std::move(messages);

  // Tools: the Responses API's flat function tools become chat tools.
  if (const Json* tools = field(b, "tools")) {
    if (!tools->is_array()) bad("tools must be a list, got " + kind(*tools), "tools");
    Json ct = Json::array();
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json& t = (*tools)[i];
      const std::string where = "tools[" + std::to_string(i) + "]";
      const Json* type = t.is_object() ? field(t, "type") : nullptr;
      if (!type || !type->is_string()) bad(where + " must be an object with a type", "tools");
      if (*type != "function")
        bad(where + ": built-in tools ('" + type->get<std::string>().substr(0, 40) +
                "') are not supported by kvlm; declare a function tool and run it yourself",
            "tools");
      Json fn = Json::object();
      for (const char* k : {"name", "description", "parameters", "strict"})
        if (const Json* v = field(t, k)) fn[k] = *v;
      ct.push_back(Json{{"type", "function"}, {"function", std::move(fn)}});
    }
    if (!ct.empty()) chat["tools"] = std::move(ct);
  }
  if (const Json* tc = field(b, "tool_choice")) {
    if (tc->is_string()) {
      chat["tool_choice"] = *tc;
    } else if (tc->is_object() && field(*tc, "type") && (*tc)["type"] == "function" && field(*tc, "name")) {
      chat["tool_choice"] = Json{{"type", "function"}, {"function", {{"name", (*tc)["name"]}}}};
    } else {
      bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...}", "tool_choice");
    }
  }
  if (const Json* p = field(b, "parallel_tool_calls")) chat["parallel_tool_calls"] = *p;
  if (const Json* mo = field(b, "max_output_tokens")) chat["max_completion_tokens"] = *mo;
  // text.format -> response_format
  if (const Json* text = field(b, "text")) {
    if (!text->is_object()) bad("text must be an object", "text");
    if (const Json* f = field(*text, "format")) {
      const Json* type = f->is_object() ? field(*f, "type") : nullptr;
      if (!type || !type->is_string()) bad("text.format must be an object with a type", "text");
      if (*type == "json_schema") {
        Json js = Json::object();
        for (const char* k : {"name", "schema", "strict", "description"})
          if (const Json* v = field(*f, k)) js[k] = *v;
        if (!js.contains("schema")) bad("text.format json_schema needs a schema", "text");
        chat["response_format"] = Json{{"type", "json_schema"}, {"json_schema", std::move(js)}};
      } else if (*type == "json_object") {
        chat["response_format"] = Json{{"type", "json_object"}};
      } else if (*type != "text") {
        bad("text.format type '" + type->get<std::string>().substr(0, 40) + "' is not supported (text, json_object, json_schema)",
            "text");
      }
    }
  }
  if (const Json* rs = field(b, "reasoning")) {
    if (!rs->is_object()) bad("reasoning must be an object", "reasoning");
    if (const Json* e = field(*rs, "effort")) chat["reasoning_effort"] = *e;
  }
  // Output logprobs (include: ["message.output_text.logprobs"] with top_logprobs).
  bool want_lp = false;
  if (const Json* inc = field(b, "include")) {
    if (!inc->is_array()) bad("include must be a list", "include");
    for (const Json& x : *inc) {
      if (x == "message.output_text.logprobs") want_lp = true;
      else r.ignored_fields.push_back("include: " + (x.is_string() ? x.get<std::string>().substr(0, 60) : x.dump().substr(0, 60)));
    }
  }
  if (const Json* top = field(b, "top_logprobs")) {
    chat["top_logprobs"] = *top;
    want_lp = true;
  }
  if (want_lp) chat["logprobs"] = true;
  for (const char* k : {"temperature", "top_p", "user", "metadata", "service_tier",
                        // vLLM's sampling extensions, as on its chat endpoint
                        "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                        "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens", "chat_template_kwargs",
                        "structured_outputs", "logit_bias", "priority"})
    if (const Json* v = field(b, k)) chat[k] = *v;
  chat["stream"] = r.stream;
  r.chat = std::move(chat);

  static const std::set<std::string> known = {
      "model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "parallel_tool_calls",
      "max_output_tokens", "text", "reasoning", "include", "top_logprobs", "temperature", "top_p", "user", "metadata",
      "service_tier", "stream", "store", "truncation", "background", "prompt", "conversation", "seed", "top_k", "min_p",
      "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos",
      "skip_special_tokens", "chat_template_kwargs", "structured_outputs", "logit_bias", "max_tool_calls",
      "stream_options", "safety_identifier", "prompt_cache_key", "request_id", "priority"};
  for (auto it = b.begin(); it != b.end(); ++it)
    if (!known.count(it.key())) r.ignored_fields.push_back(it.key().substr(0, 64));

  // What the Response object repeats of the request.
  Json e = Json::object();
  e["instructions"] = instructions;
  e["max_output_tokens"] = field(b, "max_output_tokens") ? b["max_output_tokens"] : Json(nullptr);
  e["parallel_tool_calls"] = field(b, "parallel_tool_calls") ? b["parallel_tool_calls"] : Json(true);
  e["previous_response_id"] = r.previous_response_id ? Json(*r.previous_response_id) : Json(nullptr);
  e["reasoning"] = field(b, "reasoning") ? b["reasoning"] : Json{{"effort", nullptr}, {"summary", nullptr}};
  e["store"] = r.store;
  e["temperature"] = field(b, "temperature") ? b["temperature"] : Json(1.0);
  e["text"] = field(b, "text") ? b["text"] : Json{{"format", {{"type", "text"}}}};
  e["tool_choice"] = field(b, "tool_choice") ? b["tool_choice"] : Json("auto");
  e["tools"] = field(b, "tools") ? b["tools"] : Json::array();
  e["top_p"] = field(b, "top_p") ? b["top_p"] : Json(1.0);
  e["truncation"] = "disabled";
  e["user"] = field(b, "user") ? b["user"] : Json(nullptr);
  e["metadata"] = field(b, "metadata") ? b["metadata"] : Json::object();
  r.echo = std::move(e);
  return r;
}

// ---- responses ------------------------------------------------------------------------------

Json response_from_chat(const ResponseMeta& meta, const Json& cc) {
  const Json& choice = cc["choices"][0];
  const Json& msg = choice["message"];
  Json output = Json::array();
  if (const auto rc = msg.find("reasoning_content"); rc != msg.end() && rc->is_string() && !rc->get_ref<const std::string&>().empty())
    output.push_back(reasoning_item(item_id("rs_"), rc->get<std::string>()));
  const std::string content = msg.contains("content") && msg["content"].is_string() ? msg["content"].get<std::string>() : "";
  const Json lp = choice.contains("logprobs") && choice["logprobs"].is_object() ? choice["logprobs"]["content"] : Json::array();
  const bool calls = msg.contains("tool_calls") && !msg["tool_calls"].empty();
  if (!content.empty() || !calls) output.push_back(message_item(item_id("msg_"), content, lp, "completed"));
  if (calls)
    for (const Json& c : msg["tool_calls"])
      output.push_back(call_item(item_id("fc_"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed"));
  const std::string finish = choice.value("finish_reason", std::string("stop"));
  const std::string status = finish == "length" ? "incomplete" : "completed";
  return response_object(meta, status, std::move(output), usage_from_chat(cc["usage"]), finish);
}

std::string ResponsesStream::event(const char* type, Json body) {
  Json j = Json::object();
  j["type"] = type;
  j["sequence_number"] = seq_++;
  for (auto it = body.begin(); it != body.end(); ++it) j[it.key()] = std::move(it.value());
  return std::string("event: ") + type + "\n" + sse_event(j);
}

std::string ResponsesStream::begin() {
  const Json r = response_object(meta_, "in_progress", Json::array(), nullptr, "");
  std::string out = event("response.created", {{"response", r}});  // in order: sequence numbers
  out += event("response.in_progress", {{"response", r}});
  return out;
}

std::string ResponsesStream::open(Open kind) {
  std::string out = close();
  open_ = kind;
  text_.clear();
  logprobs_ = Json::array();
  const int index = int(output_.size());
  if (kind == Open::Reasoning) {
    item_ = Json{{"id", item_id("rs_")}, {"type", "reasoning"}, {"summary", Json::array()}, {"content", Json::array()},
                 {"status", "in_progress"}};
    out += event("response.output_item.added", {{"output_index", index}, {"item", item_}});
    out += event("response.content_part.added", {{"item_id", item_["id"]},
                                                 {"output_index", index},
                                                 {"content_index", 0},
                                                 {"part", {{"type", "reasoning_text"}, {"text", ""}}}});
  } else {
    item_ = Json{{"id", item_id("msg_")}, {"type", "message"}, {"status", "in_progress"}, {"role", "assistant"},
                 {"content", Json::array()}};
    out += event("response.output_item.added", {{"output_index", index}, {"item", item_}});
    out += event("response.content_part.added",
                 {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0}, {"part", output_text("", Json::array())}});
  }
  return out;
}

std::string ResponsesStream::close() {
  if (open_ == Open::None) return {};
  std::string out;
  const int index = int(output_.size());
  const Json id = item_["id"];
  Json done;
  if (open_ == Open::Reasoning) {
    out += event("response.reasoning_text.done", {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"text", text_}});
    out += event("response.content_part.done", {{"item_id", id},
                                                {"output_index", index},
                                                {"content_index", 0},
                                                {"part", {{"type", "reasoning_text"}, {"text", text_}}}});
    done = reasoning_item(id, text_);
  } else {
    out += event("response.output_text.done",
                 {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"text", text_}, {"logprobs", logprobs_}});
    out += event("response.content_part.done",
                 {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"part", output_text(text_, logprobs_)}});
    done = message_item(id, text_, logprobs_, "completed");
  }
  out += event("response.output_item.done", {{"output_index", index}, {"item", done}});
  output_.push_back(std::move(done));
  open_ = Open::None;
  return out;
}

std::string ResponsesStream::events(const std::vector<Json>& chunks) {
  std::string out;
  for (const Json& ch : chunks) {
    if (!ch.contains("choices") || ch["choices"].empty()) continue;
    const Json& c = ch["choices"][0];
    const Json delta = c.value("delta", Json::object());
    if (const auto r = delta.find("reasoning_content"); r != delta.end() && r->is_string() && !r->get_ref<const std::string&>().empty()) {
      if (open_ != Open::Reasoning) out += open(Open::Reasoning);
      text_ += r->get<std::string>();
      out += event("response.reasoning_text.delta",
                   {{"item_id", item_["id"]}, {"output_index", int(output_.size())}, {"content_index", 0}, {"delta", *r}});
    }
    if (const auto t = delta.find("content"); t != delta.end() && t->is_string() && !t->get_ref<const std::string&>().empty()) {
      if (open_ != Open::Message) out += open(Open::Message);
      text_ += t->get<std::string>();
      Json lp = Json::array();
      if (c.contains("logprobs") && c["logprobs"].is_object()) lp = c["logprobs"]["content"];
      for (const Json& x : lp) logprobs_.push_back(x);
      out += event("response.output_text.delta", {{"item_id", item_["id"]},
                                                  {"output_index", int(output_.size())},
                                                  {"content_index", 0},
                                                  {"delta", *t},
                                                  {"logprobs", lp}});
    }
    if (const auto calls = delta.find("tool_calls"); calls != delta.end() && calls->is_array()) {
      out += close();
      for (const Json& call : *calls) {
        const int index = int(output_.size());
        const std::string id = item_id("fc_");
        const std::string name = call["function"]["name"], args = call["function"]["arguments"];
        out += event("response.output_item.added", {{"output_index", index}, {"item", call_item(id, call["id"], name, "", "in_progress")}});
        out += event("response.function_call_arguments.delta", {{"item_id", id}, {"output_index", index}, {"delta", args}});
        out += event("response.function_call_arguments.done",
                     {{"item_id", id}, {"output_index", index}, {"name", name}, {"arguments", args}});
        Json done = call_item(id, call["id"], name, args, "completed");
        out += event("response.output_item.done", {{"output_index", index}, {"item", done}});
        output_.push_back(std::move(done));
      }
    }
    if (const auto f = c.find("finish_reason"); f != c.end() && f->is_string()) finish_ = f->get<std::string>();
  }
  return out;
}

std::string ResponsesStream::end(const Json& chat_usage) {
  std::string out = close();
  if (output_.empty()) {  // an empty reply is still a message
    out += open(Open::Message);
    out += close();
  }
  const std::string status = finish_ == "length" ? "incomplete" : "completed";
  final_ = response_object(meta_, status, output_, usage_from_chat(chat_usage), finish_);
  out += event(status == "incomplete" ? "response.incomplete" : "response.completed", {{"response", final_}});
  return out;
}

std::string ResponsesStream::failed(const ApiError& e) {
  Json r = response_object(meta_, "failed", output_, nullptr, "");
  r["error"] = Json{{"code", e.code().empty() ? "server_error" : e.code()}, {"message", e.what()}};
  return event("response.failed", {{"response", r}});
}

}  // namespace kvlm::server

#include "server/protocol.h"

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <random>
#include <set>

#include "core/error.h"
#include "server/request_fields.h"
#include "server/request_json.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/regex.h"

namespace kvlm::server {

namespace {


// The JSON schema of a json_schema / guided_json / structured_outputs.json field: an object,
// or a string holding one (vLLM accepts both).
Json schema_of(const Json& v, const std::string& param) {
  if (v.is_object() || v.is_boolean()) return v;
  if (v.is_string()) {
    try {
      return Json::parse(v.get_ref<const std::string&>());
    } catch (const Json::exception&) {  // parse_error, or out_of_range for a number like 1e400
      bad(param + " holds a string that is not valid JSON (or has a number out of range); send the schema as an object", param);
    }
  }
  bad(param + " must be a JSON schema (an object), got " + kind(v), param);
}

std::string string_field(const Json& v, const std::string& param) {
  if (!v.is_string()) bad(param + " must be a string, got " + kind(v), param);
  if (v.get_ref<const std::string&>().empty()) bad(param + " must not be empty", param);
  return v.get<std::string>();
}

std::vector<std::string> choice_list(const Json& v, const std::string& param) {
  if (!v.is_array() || v.empty()) bad(param + " must be a non-empty list of strings", param);
  std::vector<std::string> out;
  for (const Json& c : v) {
    if (!c.is_string()) bad(param + " must be a list of strings, found " + kind(c), param);
    out.push_back(c.get<std::string>());
  }
  return out;
}

// The constraint of a request, from whichever of the fields that carry one it uses (two are
// an error: which would win is not obvious). Grammar errors are 400s naming the field.
void parse_structured(const Json& b, GenParams& g, const ModelInfo& info) {
  struct Source {
    std::string param, kind;  // kind: json, json_object, regex, choice, grammar
    Json value;
  };
  std::vector<Source> found;
  if (const Json* rf = field(b, "response_format")) {
    const Json* type = rf->is_object() ? field(*rf, "type") : nullptr;
    if (!type || !type->is_string()) bad("response_format must be an object with a string type", "response_format");
    const std::string& t = type->get_ref<const std::string&>();
    if (t == "json_object") {
      found.push_back({"response_format", "json_object", Json()});
    } else if (t == "json_schema") {
      const Json* js = field(*rf, "json_schema");
      if (!js || !js->is_object()) bad("response_format json_schema needs a json_schema object with a schema", "response_format");
      const Json* schema = field(*js, "schema");
      if (!schema) schema = field(*js, "json_schema");  // vLLM's older spelling
      if (!schema) bad("response_format.json_schema.schema is required", "response_format");
      found.push_back({"response_format", "json", schema_of(*schema, "response_format")});
    } else if (t != "text") {
      bad("response_format type '" + t + "' is not supported (text, json_object, json_schema)", "response_format");
    }
  }
  if (const Json* so = field(b, "structured_outputs")) {
    if (!so->is_object()) bad("structured_outputs must be an object, got " + kind(*so), "structured_outputs");
    for (auto it = so->begin(); it != so->end(); ++it) {
      const std::string& k = it.key();
      const std::string param = "structured_outputs." + k;
      if (it->is_null()) continue;
      if (k == "json") found.push_back({param, "json", schema_of(*it, param)});
      else if (k == "regex") found.push_back({param, "regex", string_field(*it, param)});
      else if (k == "choice") found.push_back({param, "choice", *it});
      else if (k == "grammar") found.push_back({param, "grammar", string_field(*it, param)});
      else if (k == "json_object") {
        if (!it->is_boolean()) bad(param + " must be a boolean", param);
        if (it->get<bool>()) found.push_back({param, "json_object", Json()});
      } else if (k == "disable_any_whitespace" || k == "disable_additional_properties" || k == "disable_fallback") {
        // kvlm's JSON whitespace is bounded and its objects carry no extra keys already.
      } else {
        bad("structured_outputs." + k + " is not supported by kvlm (json, regex, choice, grammar, json_object)", param);
      }
    }
  }
  if (const Json* v = field(b, "guided_json")) found.push_back({"guided_json", "json", schema_of(*v, "guided_json")});
  if (const Json* v = field(b, "guided_regex")) found.push_back({"guided_regex", "regex", string_field(*v, "guided_regex")});
  if (const Json* v = field(b, "guided_choice")) found.push_back({"guided_choice", "choice", *v});
  if (const Json* v = field(b, "guided_grammar")) found.push_back({"guided_grammar", "grammar", string_field(*v, "guided_grammar")});
  for (const char* k : {"guided_whitespace_pattern", "structural_tag"})
    if (field(b, k)) bad(std::string(k) + " is not supported by kvlm", k);
  if (found.empty()) return;
  if (found.size() > 1)
    bad("a request may constrain its output one way; it sets both " + found[0].param + " and " + found[1].param, found[1].param);
  if (!info.has_tokenizer)
    bad("structured outputs need the model's tokenizer (tokenizer.json), which this model lacks", found[0].param);
  const Source& src = found[0];
  try {
    grammar::Grammar gr;
    if (src.kind == "json") gr = grammar::json_schema_grammar(src.value);
    else if (src.kind == "json_object") gr = grammar::json_object_grammar();
    else if (src.kind == "regex") gr = grammar::regex_grammar(src.value.get<std::string>());
    else if (src.kind == "choice") gr = grammar::choice_grammar(choice_list(src.value, src.param));
    else gr = grammar::parse_gbnf(src.value.get<std::string>());
    g.grammar = std::make_shared<const grammar::Grammar>(std::move(gr));
  } catch (const Error& e) {
    bad(src.param + ": " + e.what(), src.param);
  }
  g.grammar_key = src.kind + "\n" + (src.value.is_string() ? src.value.get<std::string>() : src.value.dump());
}

// The parameters both endpoints share.

GenParams parse_common(const Json& b, const ModelInfo& info, const ApiLimits& lim, bool chat) {
  refuse_unimplemented_fields(b, chat);
  GenParams g;
  g.ignored_fields = unrecognized_fields(b, chat);
  if (auto n = opt_int(b, "n")) {
    if (*n < 1 || *n > lim.max_n)
      bad("n must be between 1 and " + std::to_string(lim.max_n) + ", got " + std::to_string(*n), "n");
    g.n = int(*n);
  }
  // Chat: max_completion_tokens replaces the deprecated max_tokens and wins when both are set.
  const char* max_key = chat && field(b, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  if (auto m = opt_int(b, max_key)) {
    if (*m < 1) bad(std::string(max_key) + " must be at least 1, got " + std::to_string(*m), max_key);
    if (*m > INT_MAX) bad(std::string(max_key) + " is out of range (" + std::to_string(*m) + "); at most " + std::to_string(INT_MAX), max_key);
    g.max_tokens = int(*m);
  }
  if (auto m = opt_int(b, "min_tokens")) {
    if (*m < 0) bad("min_tokens must be at least 0, got " + std::to_string(*m), "min_tokens");
    if (g.max_tokens && *m > *g.max_tokens)
      bad("min_tokens (" + std::to_string(*m) + ") must not exceed " + max_key + " (" + std::to_string(*g.max_tokens) + ")",
          "min_tokens");
    g.min_tokens = int(std::min<int64_t>(*m, INT_MAX));
  }
  SamplingParams& s = g.sampling;
  s.temperature = number_in(b, "temperature", 0, 2, false, info.default_temperature.value_or(1.0f));
  s.top_p = number_in(b, "top_p", 0, 1, true, info.default_top_p.value_or(1.0f));
  s.min_p = number_in(b, "min_p", 0, 1, false, info.default_min_p.value_or(0.0f));
  s.presence_penalty = number_in(b, "presence_penalty", -2, 2, false, 0.0f);
  s.frequency_penalty = number_in(b, "frequency_penalty", -2, 2, false, 0.0f);
  if (auto r = opt_number(b, "repetition_penalty")) {
    if (!(*r > 0) || *r > 1e6)
      bad("repetition_penalty must be greater than 0 and at most 1e6 (1 = off), got " + num(*r), "repetition_penalty");
    s.repetition_penalty = float(*r);
  }
  s.top_k = info.default_top_k.value_or(0);
  if (auto k = opt_int(b, "top_k")) {
    if (*k < -1) bad("top_k must be -1 or 0 (off) or at least 1, got " + std::to_string(*k), "top_k");
    s.top_k = int(std::min<int64_t>(*k, INT_MAX));
  }
  if (auto seed = opt_int(b, "seed"))
    if (*seed != -1) g.seed = uint64_t(*seed);  // -1 = random, as vLLM reads it

  if (const Json* stop = field(b, "stop")) {
    if (stop->is_string()) {
      g.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      if (int(stop->size()) > lim.max_stop)
        bad("stop may hold at most " + std::to_string(lim.max_stop) + " strings, got " + std::to_string(stop->size()), "stop");
      for (const auto& s1 : *stop) {
        if (!s1.is_string()) bad("stop must be a string or a list of strings, got a list holding " + kind(s1), "stop");
        g.stop.push_back(s1.get<std::string>());
      }
    } else {
      bad("stop must be a string or a list of strings, got " + kind(*stop), "stop");
    }
    for (const auto& s1 : g.stop) {
      if (s1.empty()) bad("stop strings must not be empty", "stop");
      if (s1.size() > lim.max_stop_bytes)
        bad("a stop string may be at most " + std::to_string(lim.max_stop_bytes) + " bytes long, got " +
                std::to_string(s1.size()),
            "stop");
    }
    if (!g.stop.empty() && !info.has_tokenizer)
      bad("stop strings need the model's tokenizer (tokenizer.json), which this model lacks; use stop_token_ids", "stop");
  }
  if (const Json* ids = field(b, "stop_token_ids")) {
    if (!ids->is_array()) bad("stop_token_ids must be a list of token ids, got " + kind(*ids), "stop_token_ids");
    if (int(ids->size()) > lim.max_stop_token_ids)
      bad("stop_token_ids may hold at most " + std::to_string(lim.max_stop_token_ids) + " ids", "stop_token_ids");
    for (const auto& v : *ids) g.stop_token_ids.push_back(token_id(v, info, "stop_token_ids", "stop token id"));
  }
  g.ignore_eos = opt_bool(b, "ignore_eos").value_or(false);
  g.skip_special_tokens = opt_bool(b, "skip_special_tokens").value_or(true);
  g.include_stop_str_in_output = opt_bool(b, "include_stop_str_in_output").value_or(false);
  g.return_token_ids = opt_bool(b, "return_token_ids").value_or(false);
  g.stream = opt_bool(b, "stream").value_or(false);
  if (const Json* so = field(b, "stream_options")) {
    if (!so->is_object()) bad("stream_options must be an object, got " + kind(*so), "stream_options");
    if (!g.stream) bad("stream_options can only be set when stream is true", "stream_options");
    if (const Json* iu = field(*so, "include_usage")) {
      if (!iu->is_boolean()) bad("stream_options.include_usage must be a boolean, got " + kind(*iu), "stream_options.include_usage");
      g.include_usage = iu->get<bool>();
    }
  }
  if (const Json* lb = field(b, "logit_bias")) {
    if (!lb->is_object()) bad("logit_bias must be an object of {token id: bias}, got " + kind(*lb), "logit_bias");
    if (lb->size() > size_t(info.vocab_size)) bad("logit_bias has more entries than the vocabulary", "logit_bias");
    for (auto it = lb->begin(); it != lb->end(); ++it) {
      // Keys are token ids written as strings ("50256"), as OpenAI's are.
      const std::string& key = it.key();
      int64_t id = -1;
      if (!key.empty() && key.size() <= 10 && key.find_first_not_of("0123456789") == std::string::npos) id = std::stoll(key);
      if (id < 0 || id >= info.vocab_size)
        bad("logit_bias key '" + key.substr(0, 32) + "' is not a token id of this model (0.." + std::to_string(info.vocab_size - 1) + ")",
            "logit_bias");
      if (!it->is_number() || !std::isfinite(it->get<double>()) || it->get<double>() < -100 || it->get<double>() > 100)
        bad("logit_bias values must be numbers from -100 to 100 (token " + key + ")", "logit_bias");
      g.logit_bias.emplace_back(TokenId(id), float(it->get<double>()));
    }
  }
  if (const auto plp = opt_int(b, "prompt_logprobs")) {
    if (*plp < 0 || *plp > lim.max_logprobs)
      bad("prompt_logprobs must be between 0 and " + std::to_string(lim.max_logprobs) + " (--max-logprobs), got " +
              std::to_string(*plp),
          "prompt_logprobs");
    if (g.stream) bad("prompt_logprobs cannot be streamed; send stream: false", "prompt_logprobs");
    g.prompt_logprobs = int(*plp);
  }
  g.priority = parse_priority(b, lim);
  parse_structured(b, g, info);
  return g;
}

void check_choices(const GenParams& g, size_t prompts, const ApiLimits& lim) {
  if (uint64_t(g.n) * prompts > uint64_t(lim.max_choices))
    bad(std::to_string(prompts) + " prompts x n=" + std::to_string(g.n) + " asks for more than " +
            std::to_string(lim.max_choices) + " completions in one request, this server's limit (--max-seqs-per-request); split it",
        "n");
}


Json normalize_messages(const Json& b) {
  const Json* msgs = field(b, "messages");
  if (!msgs) bad("messages is required", "messages");
  if (!msgs->is_array()) bad("messages must be a list of message objects, got " + kind(*msgs), "messages");
  if (msgs->empty()) bad("messages must hold at least one message", "messages");
  Json out = Json::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const Json& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad(where + " must be an object, got " + kind(m), "messages");
    const Json* role = field(m, "role");
    if (!role || !role->is_string() || role->get_ref<const std::string&>().empty())
      bad(where + ".role must be a non-empty string", "messages");
    Json nm = m;
    const Json* content = field(m, "content");
    if (content && content->is_array()) {
      std::string joined;
      for (size_t j = 0; j < content->size(); ++j) {
        const Json& part = (*content)[j];
        const std::string pw = where + ".content[" + std::to_string(j) + "]";
        if (!part.is_object()) bad(pw + " must be an object, got " + kind(part), "messages");
        const Json* type = field(part, "type");
        if (!type || !type->is_string()) bad(pw + ".type must be a string", "messages");
        if (type->get_ref<const std::string&>() != "text")
          bad(pw + " has type '" + type->get<std::string>() + "'; kvlm serves text models and takes only text parts",
              "messages");
        const Json* t = field(part, "text");
        if (!t || !t->is_string()) bad(pw + ".text must be a string", "messages");
        if (j) joined += "\n";
        joined += t->get_ref<const std::string&>();
      }
      nm["content"] = joined;
    } else if (content && !content->is_string()) {
      bad(where + ".content must be a string or a list of content parts, got " + kind(*content), "messages");
    }
    if (auto tc = nm.find("tool_calls"); tc != nm.end()) {
      if (tc->is_null() || (tc->is_array() && tc->empty())) {
        nm.erase(tc);  // templates test `'tool_calls' in message`
      } else {
        if (!tc->is_array()) bad(where + ".tool_calls must be a list, got " + kind(*tc), "messages");
        for (size_t j = 0; j < tc->size(); ++j) {
          Json& call = (*tc)[j];
          const std::string cw = where + ".tool_calls[" + std::to_string(j) + "]";
          if (!call.is_object()) bad(cw + " must be an object", "messages");
          Json* fn = call.contains("function") ? &call["function"] : nullptr;
          if (!fn || !fn->is_object() || !fn->contains("name") || !(*fn)["name"].is_string())
            bad(cw + ".function.name must be a string", "messages");
          // OpenAI sends arguments as a JSON string; the templates iterate them as a mapping
          // (vLLM parses them the same way).
          if (auto a = fn->find("arguments"); a != fn->end() && a->is_string()) {
            try {
              *a = Json::parse(a->get<std::string>());
            } catch (const Json::exception&) {  // parse_error, or out_of_range for a number like 1e400
              bad(cw + ".function.arguments is not valid JSON (or has a number out of range)", "messages");
            }
          }
        }
        if (!field(nm, "content")) nm["content"] = "";  // templates test and slice it
      }
    }
    if (nm["role"] == "tool" && !field(nm, "content")) nm["content"] = "";
    out.push_back(std::move(nm));
  }
  return out;
}

// Finds where a JSON body holds a number too large for a double (1e400): nlohmann's parser
// stops there with out_of_range 406, which names no field. A SAX pass over the body tracks
// the path to the value being read ("max_tokens", "messages[1].content").
class NumberOverflowLocator : public nlohmann::json_sax<nlohmann::json> {
 public:
  std::string path, token;

  bool null() override { return scalar(); }
  bool boolean(bool) override { return scalar(); }
  bool number_integer(number_integer_t) override { return scalar(); }
  bool number_unsigned(number_unsigned_t) override { return scalar(); }
  bool number_float(number_float_t, const string_t&) override { return scalar(); }
  bool string(string_t&) override { return scalar(); }
  bool binary(binary_t&) override { return scalar(); }
  bool start_object(std::size_t) override {
    frames_.push_back({false, {}, 0});
    return true;
  }
  bool key(string_t& k) override {
    frames_.back().key = k;
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return scalar();
  }
  bool start_array(std::size_t) override {
    frames_.push_back({true, {}, 0});
    return true;
  }
  bool end_array() override {
    frames_.pop_back();
    return scalar();
  }
  bool parse_error(std::size_t, const std::string& last_token, const nlohmann::detail::exception&) override {
    for (const Frame& f : frames_) {
      if (f.array) {
        path += '[';
        path += std::to_string(f.index);
        path += ']';
      } else {
        if (!path.empty()) path += '.';
        path += f.key;
      }
    }
    token = last_token;
    return false;
  }

 private:
  struct Frame {
    bool array;
    std::string key;
    size_t index;
  };
  bool scalar() {  // a value ended: the next one in an array has the next index
    if (!frames_.empty() && frames_.back().array) ++frames_.back().index;
    return true;
  }
  std::vector<Frame> frames_;
};

ApiError number_out_of_range(const std::string& body) {
  NumberOverflowLocator loc;
  nlohmann::json::sax_parse(body, &loc);
  const std::string token = loc.token.size() > 40 ? loc.token.substr(0, 40) + "..." : loc.token;
  if (loc.path.empty()) return ApiError(400, "the request body holds a number out of range (" + token + ")");
  return ApiError(400, loc.path + ": the number " + token + " is out of range", loc.path);
}

}  // namespace

std::string_view error_type_for_status(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 405: return "invalid_request_error";
    case 408: return "timeout_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

Json error_json(int status, std::string_view message, std::string_view param, std::string_view code) {
  Json e = Json::object();
  e["message"] = std::string(message);
  e["type"] = std::string(error_type_for_status(status));
  e["param"] = param.empty() ? Json(nullptr) : Json(std::string(param));
  e["code"] = code.empty() ? Json(nullptr) : Json(std::string(code));
  Json j = Json::object();
  j["error"] = std::move(e);
  return j;
}

Json error_json(const ApiError& e) { return error_json(e.status(), e.what(), e.param(), e.code()); }

Json parse_body(std::string_view body, const ApiLimits& limits) {
  size_t i = 0;
  while (i < body.size() && std::isspace(static_cast<unsigned char>(body[i]))) ++i;
  if (i == body.size()) bad("the request body is empty; send a JSON object", "");
  const int max_depth = limits.max_json_depth;
  Json::parser_callback_t depth_check = [max_depth](int depth, Json::parse_event_t ev, Json&) {
    if ((ev == Json::parse_event_t::object_start || ev == Json::parse_event_t::array_start) && depth >= max_depth)
      bad("the request body is nested deeper than " + std::to_string(max_depth) + " levels", "");
    return true;
  };
  Json j;
  try {
    j = Json::parse(body.begin(), body.end(), depth_check, true, false);
  } catch (const Json::parse_error& e) {
    std::string what = e.what();
    if (auto p = what.find("] "); p != std::string::npos && what.rfind("[json.exception", 0) == 0) what = what.substr(p + 2);
    bad("the request body is not valid JSON: " + what, "");
  } catch (const Json::out_of_range& e) {
    if (e.id != 406) throw;  // 406: a number too large for a double (1e400)
    throw number_out_of_range(std::string(body));
  }
  if (!j.is_object()) bad("the request body must be a JSON object, got " + kind(j), "");
  return j;
}

namespace {

// tools / tool_choice / parallel_tool_calls: the tools go to the chat template; the replies'
// calls are parsed (auto) or forced by a grammar (required, a named function).
void parse_tools(const Json& b, const ModelInfo& info, ChatRequest& r) {
  if (field(b, "functions") || field(b, "function_call"))
    bad("functions / function_call are OpenAI's deprecated names; send tools / tool_choice", field(b, "functions") ? "functions" : "function_call");
  const Json* tools = field(b, "tools");
  if (tools && !tools->is_array()) bad("tools must be a list, got " + kind(*tools), "tools");
  std::vector<std::string> names;
  if (tools) {
    if (tools->size() > 128) bad("tools may hold at most 128 functions", "tools");
    for (size_t i = 0; i < tools->size(); ++i) {
      const Json& t = (*tools)[i];
      const std::string w = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) bad(w + " must be an object", "tools");
      const Json* type = field(t, "type");
      if (!type || *type != "function") bad(w + ".type must be \"function\"", "tools");
      const Json* fn = field(t, "function");
      if (!fn || !fn->is_object()) bad(w + ".function must be an object", "tools");
      const Json* name = field(*fn, "name");
      if (!name || !name->is_string()) bad(w + ".function.name must be a string", "tools");
      const std::string& n = name->get_ref<const std::string&>();
      if (n.empty() || n.size() > 64 || n.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.") != std::string::npos)
        bad(w + ".function.name must be 1-64 letters, digits, '_', '-' or '.', got '" + n.substr(0, 80) + "'", "tools");
      if (std::find(names.begin(), names.end(), n) != names.end()) bad(w + ": the function '" + n + "' is listed twice", "tools");
      names.push_back(n);
      if (const Json* params = field(*fn, "parameters"); params && !params->is_object())
        bad(w + ".function.parameters must be a JSON schema object", "tools");
    }
  }
  // tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name"}}.
  std::string choice = tools && !tools->empty() ? "auto" : "none";
  std::string named;
  if (const Json* tc = field(b, "tool_choice")) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required")
        bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice");
    } else if (tc->is_object()) {
      const Json* fn = field(*tc, "function");
      const Json* name = fn && fn->is_object() ? field(*fn, "name") : nullptr;
      if (!name || !name->is_string()) bad("tool_choice must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice");
      named = name->get<std::string>();
      if (std::find(names.begin(), names.end(), named) == names.end())
        bad("tool_choice names '" + named + "', which is not among tools", "tool_choice");
      choice = "named";
    } else {
      bad("tool_choice must be a string or an object, got " + kind(*tc), "tool_choice");
    }
    if (choice != "none" && names.empty()) bad("tool_choice \"" + choice + "\" needs tools", "tool_choice");
  }
  const bool parallel = opt_bool(b, "parallel_tool_calls").value_or(true);
  // Harmony (GPT-OSS) parses every reply: reasoning apart from the answer, calls when there
  // are tools. Its markers are special tokens the parser must see.
  if (parses_every_reply(info.tool_parser)) {
    r.gen.tool_parser = info.tool_parser;
    r.gen.skip_special_tokens = false;
  }
  if (!tools || tools->empty()) return;
  r.template_kwargs["tools"] = *tools;  // rendered by the template whatever the choice
  r.gen.tools = std::make_shared<const Json>(*tools);
  if (choice == "none") return;
  // Only "auto" needs the model's own format, to tell a call from an answer; a forced call is
  // written in forced_call_format's (any model can be made to call).
  if (info.tool_parser == ToolParser::None && choice == "auto")
    bad("this model's chat template has no tool-call format kvlm knows, so a call cannot be told from an answer: "
        "start the server with --tool-call-parser hermes, qwen3_coder or llama3_json, or send tool_choice \"required\" or a "
        "named function (forced through structured outputs), or \"none\"",
        "tools");
  r.gen.tool_parser = info.tool_parser;
  if (choice == "auto") {
    r.tools_must_reach_prompt = true;
    return;
  }
  if (r.gen.grammar) bad("tool_choice \"" + choice + "\" and an output format cannot both constrain the reply", "tool_choice");
  Json chosen = Json::array();
  for (const Json& t : *tools)
    if (choice == "required" || t["function"]["name"] == named) chosen.push_back(t);
  if (info.tool_parser == ToolParser::Harmony) {
    // One function: its whole header goes after the prompt and the grammar covers the
    // arguments. Several: the header up to the function's name goes after the prompt, and the
    // grammar covers the name, the header's special tokens and the arguments.
    try {
      ForcedCall f = chosen.size() == 1 ? harmony_forced_call(chosen[0]) : harmony_required_call(chosen);
      r.gen.reply_prefix = std::move(f.prefix);
      r.gen.grammar = std::make_shared<const grammar::Grammar>(std::move(f.args));
    } catch (const Error& e) {
      bad(e.what(), "tools");
    }
    r.gen.grammar_key = "harmony call\n" + chosen.dump();
    r.gen.grammar_field = "tool_choice";
    return;
  }
  r.gen.tool_parser = forced_call_format(info.tool_parser);
  try {
    r.gen.grammar = std::make_shared<const grammar::Grammar>(tool_call_grammar(r.gen.tool_parser, chosen, parallel && choice == "required"));
  } catch (const Error& e) {
    bad(e.what(), "tools");
  }
  r.gen.grammar_field = "tool_choice";
  r.gen.grammar_key = "tools\n" + std::string(tool_parser_name(r.gen.tool_parser)) + "\n" + choice + "\n" +
                      (parallel ? "1" : "0") + chosen.dump();
}

}  // namespace

CompletionRequest parse_completion_request(const Json& b, const ModelInfo& info, const ApiLimits& lim) {
  check_model(b, info);
  CompletionRequest r;
  r.prompts = parse_prompts(b, info);
  r.gen = parse_common(b, info, lim, false);
  r.gen.echo = opt_bool(b, "echo").value_or(false);
  if (auto lp = opt_int(b, "logprobs")) {
    if (*lp < 0 || *lp > lim.max_logprobs)
      bad("logprobs must be between 0 and " + std::to_string(lim.max_logprobs) + ", got " + std::to_string(*lp), "logprobs");
    r.gen.logprobs = int(*lp);
  }
  if (const Json* s = field(b, "suffix")) {
    if (!s->is_string()) bad("suffix must be a string, got " + kind(*s), "suffix");
    if (!s->get_ref<const std::string&>().empty()) bad("suffix is not supported by kvlm", "suffix");
  }
  if (auto bo = opt_int(b, "best_of"))
    if (*bo != 1 && *bo != r.gen.n) bad("best_of is not supported by kvlm (only best_of = n)", "best_of");
  check_choices(r.gen, r.prompts.size(), lim);
  return r;
}


ChatRequest parse_chat_request(const Json& b, const ModelInfo& info, const ApiLimits& lim) {
  check_model(b, info);
  if (!info.has_chat_template)
    bad("this model has no chat template (no chat_template in tokenizer_config.json, nor tokenizer.chat_template in a GGUF file); use /v1/completions", "messages");
  ChatRequest r;
  r.messages = normalize_messages(b);
  r.gen = parse_common(b, info, lim, true);
  r.gen.reasoning = info.reasoning_parser == ReasoningParser::ThinkTags;
  const bool lp = opt_bool(b, "logprobs").value_or(false);
  const auto top = opt_int(b, "top_logprobs");
  if (top) {
    if (*top < 0 || *top > lim.max_logprobs)
      bad("top_logprobs must be between 0 and " + std::to_string(lim.max_logprobs) + ", got " + std::to_string(*top),
          "top_logprobs");
    if (!lp) bad("top_logprobs needs logprobs set to true", "top_logprobs");
  }
  if (lp) r.gen.logprobs = int(top.value_or(0));
  r.add_generation_prompt = opt_bool(b, "add_generation_prompt").value_or(true);
  if (opt_bool(b, "continue_final_message").value_or(false))
    bad("continue_final_message is not supported by kvlm", "continue_final_message");
  if (opt_bool(b, "echo").value_or(false)) bad("echo is supported by /v1/completions only", "echo");
  if (const Json* kw = field(b, "chat_template_kwargs")) {
    if (!kw->is_object()) bad("chat_template_kwargs must be an object, got " + kind(*kw), "chat_template_kwargs");
    r.template_kwargs = *kw;
    for (const char* reserved : {"messages", "add_generation_prompt"}) r.template_kwargs.erase(reserved);
  }
  if (const Json* re = field(b, "reasoning_effort"); re && !re->is_null()) {
    // As vLLM: handed to the chat template (gpt-oss's reads it), unless the kwargs set it.
    if (!re->is_string() || (*re != "low" && *re != "medium" && *re != "high"))
      bad("reasoning_effort must be \"low\", \"medium\" or \"high\"", "reasoning_effort");
    if (!r.template_kwargs.contains("reasoning_effort")) r.template_kwargs["reasoning_effort"] = *re;
  }
  if (field(b, "chat_template")) bad("a chat_template in the request is not supported; the model's template is used", "chat_template");
  parse_tools(b, info, r);
  // GPT-OSS's template reads an assistant turn's reasoning from `thinking` (and keeps it before
  // a tool call, where the model needs its plan); clients send back the reasoning_content kvlm
  // returned. Not where the turn also has content beside its calls: the template takes one or
  // the other there, and raises on both.
  if (r.gen.tool_parser == ToolParser::Harmony)
    for (Json& m : r.messages) {
      if (!m.is_object() || m.value("role", "") != "assistant" || m.contains("thinking")) continue;
      const auto rc = m.find("reasoning_content");
      if (rc == m.end() || !rc->is_string() || rc->get_ref<const std::string&>().empty()) continue;
      const auto content = m.find("content");
      const bool has_content = content != m.end() && content->is_string() && !content->get_ref<const std::string&>().empty();
      if (m.contains("tool_calls") && has_content) continue;
      m["thinking"] = *rc;
    }
  check_choices(r.gen, 1, lim);
  return r;
}

int resolve_max_tokens(const GenParams& gen, int prompt_len, int max_model_len, bool chat) {
  const char* prompt_param = chat ? "messages" : "prompt";
  if (prompt_len >= max_model_len)
    bad("This model's maximum context length is " + std::to_string(max_model_len) + " tokens, and your prompt has " +
            std::to_string(prompt_len) + " tokens, which leaves no room for the completion; shorten the prompt",
        prompt_param, "context_length_exceeded");
  const int room = max_model_len - prompt_len;
  int max_tokens = 0;
  if (gen.max_tokens) {
    if (*gen.max_tokens > room) {
      const char* key = chat ? "max_completion_tokens" : "max_tokens";
      bad("This model's maximum context length is " + std::to_string(max_model_len) + " tokens. However, you requested " +
              std::to_string(int64_t(prompt_len) + *gen.max_tokens) + " tokens (" + std::to_string(prompt_len) +
              " in the prompt, " + std::to_string(*gen.max_tokens) + " for the completion); lower " + key + " to at most " +
              std::to_string(room) + " or shorten the prompt",
          key, "context_length_exceeded");
    }
    max_tokens = *gen.max_tokens;
  } else {
    max_tokens = chat ? room : std::min(16, room);
  }
  if (gen.min_tokens > max_tokens)
    bad("min_tokens (" + std::to_string(gen.min_tokens) + ") exceeds the " + std::to_string(max_tokens) +
            " tokens this prompt leaves for the completion",
        "min_tokens");
  return max_tokens;
}

std::string finish_reason_str(FinishReason r) {
  const std::string_view n = finish_reason_name(r);
  return n.empty() ? "stop" : std::string(n);
}

Json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  Json u = Json::object();
  u["prompt_tokens"] = prompt_tokens;
  u["completion_tokens"] = completion_tokens;
  u["total_tokens"] = prompt_tokens + completion_tokens;
  u["prompt_tokens_details"] = Json{{"cached_tokens", cached_tokens}};
  return u;
}

std::string dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

std::string sse_event(const Json& j) { return "data: " + dump(j) + "\n\n"; }

std::string without_paths(std::string_view m) {
  std::string out;
  out.reserve(m.size());
  const auto boundary = [](char c) { return c == ' ' || c == '\'' || c == '"' || c == '(' || c == '\t' || c == '\n' || c == '='; };
  for (size_t i = 0; i < m.size();) {
    if (m[i] == '/' && (i == 0 || boundary(m[i - 1]))) {
      size_t j = i;
      while (j < m.size() && !boundary(m[j]) && m[j] != ':' && m[j] != ',' && m[j] != ')') ++j;
      const std::string_view tok = m.substr(i, j - i);
      if (std::count(tok.begin(), tok.end(), '/') >= 2) {
        out += tok.substr(tok.find_last_of('/') + 1);
        i = j;
        continue;
      }
    }
    out += m[i++];
  }
  return out;
}

std::string make_request_id(std::string_view prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}() ^ (uint64_t(std::random_device{}()) << 32)};
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(prefix);
  for (int w = 0; w < 2; ++w) {
    uint64_t v = rng();
    for (int i = 0; i < 16; ++i, v >>= 4) id += kHex[v & 15];
  }
  return id;
}

}  // namespace kvlm::server

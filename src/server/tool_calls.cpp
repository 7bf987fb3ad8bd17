#include "server/tool_calls.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <random>

#include "core/error.h"
#include "text/grammar/json_schema.h"

namespace kvlm::server {

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>", kPythonTag = "<|python_tag|>";

std::string call_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  static const char* hex = "0123456789abcdef";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += hex[rng() & 15];
  return id;
}

std::string_view trim(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

// {"name": ..., "arguments" | "parameters": {...}} as a call; nullopt when it is not one.
std::optional<ToolCall> call_of(std::string_view text) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception&) {  // parse_error, or out_of_range for 1e400
    return std::nullopt;
  }
  if (!j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  Json a = args == j.end() || args->is_null() ? Json::object() : *args;
  if (a.is_string()) {  // some models write the arguments as a JSON string
    try {
      a = Json::parse(a.get<std::string>());
    } catch (const Json::exception&) {  // parse_error, or out_of_range for 1e400
      return std::nullopt;
    }
  }
  if (!a.is_object()) return std::nullopt;
  return ToolCall{call_id(), name->get<std::string>(), a.dump()};
}

// Llama 3 JSON calls: one or more objects separated by ';' (and whitespace). nullopt when
// the text is anything else.
std::optional<std::vector<ToolCall>> llama_calls(std::string_view text) {
  text = trim(text);
  if (text.starts_with(kPythonTag)) text = trim(text.substr(kPythonTag.size()));
  std::vector<ToolCall> calls;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] != '{') return std::nullopt;
    // The object's end: braces outside strings.
    int depth = 0;
    bool in_str = false, esc = false;
    size_t j = i;
    for (; j < text.size(); ++j) {
      const char c = text[j];
      if (in_str) {
        if (esc) esc = false;
        else if (c == '\\') esc = true;
        else if (c == '"') in_str = false;
      } else if (c == '"') {
        in_str = true;
      } else if (c == '{') {
        ++depth;
      } else if (c == '}' && --depth == 0) {
        break;
      }
    }
    if (j == text.size()) return std::nullopt;
    auto call = call_of(text.substr(i, j + 1 - i));
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
    i = j + 1;
    while (i < text.size() && (text[i] == ' ' || text[i] == '\n' || text[i] == '\t' || text[i] == ';')) ++i;
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

// A qwen3_coder value as the tool's schema types it (`schema` may be null): a string as
// written; integer, number, boolean, object, array or null read as JSON (as written when it
// does not parse); without a type, JSON where it parses, else as written.
Json coder_value(std::string_view v, const Json* schema) {
  Json parsed;
  bool ok = false;
  try {
    parsed = Json::parse(v);
    ok = true;
  } catch (const Json::exception&) {  // parse_error, or out_of_range for 1e400
  }
  if (schema && schema->is_object()) {
    const auto t = schema->find("type");
    const auto is = [&](std::string_view name) {
      if (t == schema->end()) return false;
      if (t->is_string()) return t->get_ref<const std::string&>() == name;
      if (t->is_array())
        for (const Json& e : *t)
          if (e.is_string() && e.get_ref<const std::string&>() == name) return true;
      return false;
    };
    const bool text = is("string");
    const bool other = is("integer") || is("number") || is("boolean") || is("object") || is("array") || is("null");
    if (other && ok && !parsed.is_string()) return parsed;  // (a union with string prefers the JSON value)
    if (text || other) return Json(std::string(v));
  }
  return ok ? parsed : Json(std::string(v));  // untyped: JSON where it parses
}

// A qwen3_coder block body: <function=NAME> (<parameter=KEY>\nVALUE\n</parameter>)*
// </function>; nullopt when it is not one.
std::optional<ToolCall> coder_call(std::string_view body, const Json& tools) {
  constexpr std::string_view kFn = "<function=", kFnEnd = "</function>", kPar = "<parameter=", kParEnd = "</parameter>";
  body = trim(body);
  if (!body.starts_with(kFn)) return std::nullopt;
  size_t gt = body.find('>');
  if (gt == std::string_view::npos) return std::nullopt;
  const std::string name(trim(body.substr(kFn.size(), gt - kFn.size())));
  std::string_view rest = body.substr(gt + 1);
  const size_t end = rest.rfind(kFnEnd);
  if (name.empty() || end == std::string_view::npos || !trim(rest.substr(end + kFnEnd.size())).empty()) return std::nullopt;
  rest = rest.substr(0, end);
  const Json* props = nullptr;  // the function's parameters' properties
  if (tools.is_array())
    for (const Json& t : tools) {
      const auto fn = t.find("function");
      if (fn == t.end() || !fn->is_object() || fn->value("name", "") != name) continue;
      const auto params = fn->find("parameters");
      if (params != fn->end() && params->is_object())
        if (const auto p = params->find("properties"); p != params->end() && p->is_object()) props = &*p;
    }
  Json args = Json::object();
  for (;;) {
    rest = rest.substr(std::min(rest.size(), rest.find_first_not_of(" \t\r\n")));
    if (rest.empty()) break;
    if (!rest.starts_with(kPar)) return std::nullopt;
    gt = rest.find('>');
    if (gt == std::string_view::npos) return std::nullopt;
    const std::string key(trim(rest.substr(kPar.size(), gt - kPar.size())));
    rest = rest.substr(gt + 1);
    const size_t vend = rest.find(kParEnd);
    if (key.empty() || vend == std::string_view::npos) return std::nullopt;
    std::string_view v = rest.substr(0, vend);
    if (v.starts_with('\n')) v.remove_prefix(1);
    if (v.ends_with('\n')) v.remove_suffix(1);
    const Json* schema = nullptr;
    if (props)
      if (const auto s = props->find(key); s != props->end()) schema = &*s;
    args[key] = coder_value(v, schema);
    rest = rest.substr(vend + kParEnd.size());
  }
  return ToolCall{call_id(), name, args.dump()};
}

// Pythonic calls: [NAME(KEY=VALUE, ...), ...], VALUE a Python literal (str, int, float,
// True / False / None, list, tuple, dict) or JSON's true / false / null. A recursive-descent
// reader over the text; nullopt when the text is anything else.
class PythonicReader {
 public:
  explicit PythonicReader(std::string_view t) : t_(t) {}
  std::optional<std::vector<ToolCall>> calls() {
    std::vector<ToolCall> out;
    if (!eat('[')) return std::nullopt;
    if (!eat(']')) {
      do {
        auto c = call();
        if (!c) return std::nullopt;
        out.push_back(std::move(*c));
      } while (eat(','));
      if (!eat(']')) return std::nullopt;
    }
    skip();
    if (i_ != t_.size() || out.empty()) return std::nullopt;
    return out;
  }

 private:
  void skip() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\n' || t_[i_] == '\t' || t_[i_] == '\r')) ++i_;
  }
  bool eat(char c) {
    skip();
    if (i_ < t_.size() && t_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  std::string ident() {
    skip();
    const size_t b = i_;
    while (i_ < t_.size() && (std::isalnum(uint8_t(t_[i_])) || t_[i_] == '_' || (i_ > b && t_[i_] == '.'))) ++i_;
    if (i_ > b && std::isdigit(uint8_t(t_[b]))) i_ = b;
    return std::string(t_.substr(b, i_ - b));
  }
  std::optional<ToolCall> call() {
    const std::string name = ident();
    if (name.empty() || !eat('(')) return std::nullopt;
    Json args = Json::object();
    if (!eat(')')) {
      do {
        skip();
        if (i_ < t_.size() && t_[i_] == ')') break;  // a trailing comma
        const std::string key = ident();
        if (key.empty() || !eat('=')) return std::nullopt;
        auto v = value(0);
        if (!v) return std::nullopt;
        args[key] = std::move(*v);
      } while (eat(','));
      if (!eat(')')) return std::nullopt;
    }
    return ToolCall{call_id(), name, args.dump()};
  }
  std::optional<Json> value(int depth) {
    if (depth > 64) return std::nullopt;
    skip();
    if (i_ >= t_.size()) return std::nullopt;
    const char c = t_[i_];
    if (c == '"' || c == '\'') return str();
    if (c == '[' || c == '(') {
      const char close = c == '[' ? ']' : ')';
      ++i_;
      Json a = Json::array();
      if (eat(close)) return a;
      do {
        skip();
        if (i_ < t_.size() && t_[i_] == close) break;
        auto v = value(depth + 1);
        if (!v) return std::nullopt;
        a.push_back(std::move(*v));
      } while (eat(','));
      if (!eat(close)) return std::nullopt;
      return a;
    }
    if (c == '{') {
      ++i_;
      Json o = Json::object();
      if (eat('}')) return o;
      do {
        skip();
        if (i_ < t_.size() && t_[i_] == '}') break;
        auto k = value(depth + 1);
        if (!k || !k->is_string() || !eat(':')) return std::nullopt;
        auto v = value(depth + 1);
        if (!v) return std::nullopt;
        o[k->get<std::string>()] = std::move(*v);
      } while (eat(','));
      if (!eat('}')) return std::nullopt;
      return o;
    }
    const std::string word = ident();
    if (word == "True" || word == "true") return Json(true);
    if (word == "False" || word == "false") return Json(false);
    if (word == "None" || word == "null") return Json(nullptr);
    if (!word.empty()) return std::nullopt;
    // A number: JSON's grammar (Python's literals beyond it — 0x, 1_000 — are not read).
    const size_t b = i_;
    while (i_ < t_.size() && t_[i_] != '\0' && std::strchr("+-0123456789.eE", t_[i_])) ++i_;
    try {
      return Json::parse(t_.substr(b, i_ - b));
    } catch (const Json::exception&) {  // parse_error, or out_of_range for 1e400
      return std::nullopt;
    }
  }
  std::optional<Json> str() {
    const char q = t_[i_++];
    std::string s;
    while (i_ < t_.size() && t_[i_] != q) {
      char c = t_[i_++];
      if (c == '\\') {
        if (i_ >= t_.size()) return std::nullopt;
        c = t_[i_++];
        switch (c) {
          case 'n': s += '\n'; break;
          case 't': s += '\t'; break;
          case 'r': s += '\r'; break;
          case '0': s += '\0'; break;
          case 'u':  // \u and 4 hex digits, \U and 8: a code point, written as UTF-8
          case 'U': {
            uint32_t cp = 0;
            try {
              cp = grammar::parse_hex(t_, i_, c == 'u' ? 4 : 8, [](const std::string&) {});
            } catch (const Error&) {  // truncated, not hex, or past U+10FFFF: not a literal
              return std::nullopt;
            }
            if (cp >= 0xD800 && cp < 0xE000) return std::nullopt;  // a surrogate: not a scalar value
            grammar::append_utf8(s, cp);
            break;
          }
          default: s += c;  // \\ \' \" and anything else as itself
        }
      } else {
        s += c;
      }
    }
    if (i_ >= t_.size()) return std::nullopt;
    ++i_;
    return Json(std::move(s));
  }

  std::string_view t_;
  size_t i_ = 0;
};

constexpr std::string_view kPythonStart = "<|python_start|>", kPythonEnd = "<|python_end|>";

std::optional<std::vector<ToolCall>> pythonic_calls(std::string_view text) {
  text = trim(text);
  if (text.starts_with(kPythonStart)) {
    text.remove_prefix(kPythonStart.size());
    text = trim(text);
    if (text.ends_with(kPythonEnd)) text.remove_suffix(kPythonEnd.size());
  }
  return PythonicReader(text).calls();
}

// Formats whose calls are the whole reply: the calls, or nullopt when the reply is an answer.
std::optional<std::vector<ToolCall>> whole_reply_calls(ToolParser p, std::string_view text) {
  return p == ToolParser::Pythonic ? pythonic_calls(text) : llama_calls(text);
}

// Harmony's markers (special tokens of GPT-OSS's tokenizer, kept in the text it parses).
constexpr std::string_view kMessage = "<|message|>", kChannel = "<|channel|>";
constexpr std::string_view kBodyEnds[] = {"<|end|>", "<|call|>", "<|return|>", "<|start|>"};
constexpr std::string_view kMarkers[] = {"<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                                         "<|call|>", "<|return|>", "<|constrain|>"};

// A harmony call's arguments: its body, as compact JSON when it is a JSON object, else as
// written (the client sees what the model sent).
std::string harmony_arguments(std::string_view body) {
  body = trim(body);
  try {
    const Json j = Json::parse(body);
    if (j.is_object()) return j.dump();
  } catch (const Json::exception&) {  // parse_error, or out_of_range for 1e400
  }
  return std::string(body);
}

// The word after `key` in a harmony header ("" when absent): up to a space, a marker or the end.
std::string header_word(std::string_view header, std::string_view key) {
  const size_t at = header.find(key);
  if (at == std::string_view::npos) return {};
  std::string_view rest = header.substr(at + key.size());
  const size_t b = rest.find_first_not_of(' ');
  if (b == std::string_view::npos) return {};
  rest = rest.substr(b);
  return std::string(rest.substr(0, std::min(rest.find(' '), rest.find('<'))));
}


}  // namespace

size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n)
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  return 0;
}

ToolParser parse_tool_parser(std::string_view name) {
  if (name == "hermes" || name == "qwen" || name == "qwen3") return ToolParser::Hermes;
  if (name == "llama3_json" || name == "llama3" || name == "llama4_json") return ToolParser::Llama3Json;
  if (name == "harmony" || name == "openai" || name == "gpt_oss") return ToolParser::Harmony;
  if (name == "qwen3_coder" || name == "qwen3_xml") return ToolParser::Qwen3Coder;
  if (name == "pythonic" || name == "llama4_pythonic") return ToolParser::Pythonic;
  if (name == "none") return ToolParser::None;
  throw Error("--tool-call-parser '" + std::string(name) +
              "' is not one kvlm has; valid: hermes (Hermes, Qwen 2.5, Qwen 3), qwen3_coder (Qwen3-Coder, Qwen3.5), "
              "llama3_json (Llama 3.1, 3.2), pythonic (Llama 3.2, 4: [f(a=1)]), harmony (GPT-OSS; vLLM's openai), none");
}

std::string_view tool_parser_name(ToolParser p) {
  switch (p) {
    case ToolParser::Hermes: return "hermes";
    case ToolParser::Llama3Json: return "llama3_json";
    case ToolParser::Harmony: return "harmony";
    case ToolParser::Qwen3Coder: return "qwen3_coder";
    case ToolParser::Pythonic: return "pythonic";
    default: return "none";
  }
}

ToolParser detect_tool_parser(std::string_view tpl) {
  if (tpl.find("<|channel|>") != std::string_view::npos && tpl.find("<|message|>") != std::string_view::npos)
    return ToolParser::Harmony;
  if (tpl.find("<function=") != std::string_view::npos && tpl.find("<parameter=") != std::string_view::npos)
    return ToolParser::Qwen3Coder;
  if (tpl.find("<tool_call>") != std::string_view::npos) return ToolParser::Hermes;
  if (tpl.find("\"parameters\"") != std::string_view::npos && tpl.find("ipython") != std::string_view::npos)
    return ToolParser::Llama3Json;
  return ToolParser::None;
}

ExtractedCalls extract_tool_calls(ToolParser p, std::string_view text, const Json* tools) {
  ExtractedCalls out;
  if (p == ToolParser::Llama3Json || p == ToolParser::Pythonic) {
    if (auto calls = whole_reply_calls(p, text)) out.calls = std::move(*calls);
    else out.content = std::string(text);
    return out;
  }
  if (p != ToolParser::Hermes && p != ToolParser::Harmony && p != ToolParser::Qwen3Coder) {
    out.content = std::string(text);
    return out;
  }
  ToolCallStream s(p, tools);
  ToolCallStream::Out a = s.push(text), b = s.finish();
  out.content = a.content + b.content;
  out.reasoning = a.reasoning + b.reasoning;
  out.calls = std::move(a.calls);
  for (auto& c : b.calls) out.calls.push_back(std::move(c));
  if (!out.calls.empty()) out.content = std::string(trim(out.content));
  return out;
}

ToolCallStream::Out ToolCallStream::push_harmony(bool end) {
  Out out;
  for (;;) {
    if (!in_body_) {
      // A header runs to <|message|>: [<|start|>ROLE][ to=RECIPIENT]<|channel|>CHANNEL[ to=...][ <|constrain|>json]
      const size_t at = pending_.find(kMessage);
      if (at == std::string::npos) {
        if (!end) break;
        // The reply ended without another message: text that holds no marker is the model
        // answering outside the format (content); a header cut short is dropped.
        std::string rest = header_ + pending_;
        bool marked = false;
        for (std::string_view m : kMarkers) marked |= rest.find(m) != std::string::npos;
        if (!marked) out.content += rest;
        header_.clear();
        pending_.clear();
        break;
      }
      header_ += pending_.substr(0, at);
      pending_.erase(0, at + kMessage.size());
      channel_ = header_word(header_, kChannel);
      recipient_ = header_word(header_, "to=");  // (<|constrain|>json only says the body is JSON)
      header_.clear();
      in_body_ = true;
      continue;
    }
    size_t stop = std::string::npos, stop_len = 0;
    for (std::string_view m : kBodyEnds)
      if (const size_t p = pending_.find(m); p != std::string::npos && p < stop) {
        stop = p;
        stop_len = m.size();
      }
    const bool call = !recipient_.empty();
    std::string piece;
    if (stop != std::string::npos) {
      piece = pending_.substr(0, stop);
      // The marker ends this body (<|start|> also opens the next header: its role follows).
      pending_.erase(0, stop + stop_len);
    } else if (end) {
      piece = std::move(pending_);
      pending_.clear();
    } else if (call) {
      break;  // a call's arguments are sent whole
    } else {
      size_t hold = 0;
      for (std::string_view m : kMarkers) hold = std::max(hold, partial_tag(pending_, m));
      piece = pending_.substr(0, pending_.size() - hold);
      pending_.erase(0, pending_.size() - hold);
    }
    if (call) {
      call_body_ += piece;
      const std::string name = recipient_.starts_with("functions.") ? recipient_.substr(10) : recipient_;
      out.calls.push_back(ToolCall{call_id(), name, harmony_arguments(call_body_)});
      ++calls_;
      call_body_.clear();
    } else if (channel_ == "analysis") {
      out.reasoning += piece;
    } else {
      out.content += piece;  // final, and commentary without a recipient (a preamble)
    }
    if (stop == std::string::npos) break;
    in_body_ = false;
    channel_.clear();
    recipient_.clear();
  }
  return out;
}

ToolCallStream::Out ToolCallStream::push(std::string_view text) {
  Out out;
  pending_ += text;
  if (p_ == ToolParser::Harmony) return push_harmony(false);
  if (p_ == ToolParser::Llama3Json || p_ == ToolParser::Pythonic) {
    // A reply is a call when it starts with '{' (pythonic: '[') or the python tag: held to
    // the end.
    if (!decided_) {
      const std::string_view t = trim(pending_);
      if (t.empty()) return out;
      const std::string_view tag = p_ == ToolParser::Pythonic ? kPythonStart : kPythonTag;
      if (t.front() == (p_ == ToolParser::Pythonic ? '[' : '{') || t.starts_with(tag)) {
        in_call_ = true;
      } else if (!tag.starts_with(t)) {
        in_call_ = false;
      } else {
        return out;  // may still become the python tag
      }
      decided_ = true;
    }
    if (!in_call_) {
      out.content = std::move(pending_);
      pending_.clear();
    }
    return out;
  }
  if (p_ != ToolParser::Hermes && p_ != ToolParser::Qwen3Coder) {
    out.content = std::move(pending_);
    pending_.clear();
    return out;
  }
  for (;;) {
    if (!in_call_) {
      const size_t at = pending_.find(kOpen);
      if (at != std::string::npos) {
        out.content += pending_.substr(0, at);
        pending_.erase(0, at + kOpen.size());
        in_call_ = true;
        continue;
      }
      const size_t hold = partial_tag(pending_, kOpen);
      out.content += pending_.substr(0, pending_.size() - hold);
      pending_.erase(0, pending_.size() - hold);
      break;
    }
    const size_t end = pending_.find(kClose);
    if (end == std::string::npos) break;
    if (auto call = block_call(std::string_view(pending_).substr(0, end))) {
      out.calls.push_back(std::move(*call));
      ++calls_;
    } else {
      out.content += std::string(kOpen) + pending_.substr(0, end + kClose.size());  // not a call: text
    }
    pending_.erase(0, end + kClose.size());
    in_call_ = false;
  }
  // Between and after calls, whitespace is layout, not content.
  if (calls_ > 0 && trim(out.content).empty()) out.content.clear();
  return out;
}

ToolCallStream::Out ToolCallStream::finish() {
  if (p_ == ToolParser::Harmony) {
    Out out = push_harmony(true);
    in_body_ = false;
    return out;
  }
  Out out;
  if (p_ == ToolParser::Llama3Json || p_ == ToolParser::Pythonic) {
    if (in_call_ || !decided_) {
      if (auto calls = whole_reply_calls(p_, pending_)) {
        out.calls = std::move(*calls);
        calls_ += int(out.calls.size());
      } else {
        out.content = std::move(pending_);
      }
    } else {
      out.content = std::move(pending_);
    }
    pending_.clear();
    return out;
  }
  if (in_call_) {
    // The reply ended inside a call (EOS before </tool_call>): a call if the JSON is whole.
    if (auto call = block_call(pending_)) {
      out.calls.push_back(std::move(*call));
      ++calls_;
    } else {
      out.content = std::string(kOpen) + pending_;
    }
  } else {
    out.content = std::move(pending_);
  }
  pending_.clear();
  in_call_ = false;
  if (calls_ > 0 && trim(out.content).empty()) out.content.clear();
  return out;
}

ToolParser forced_call_format(ToolParser p) {
  return p == ToolParser::None || p == ToolParser::Pythonic ? ToolParser::Llama3Json : p;
}

std::optional<ToolCall> ToolCallStream::block_call(std::string_view body) const {
  return p_ == ToolParser::Qwen3Coder ? coder_call(body, tools_) : call_of(trim(body));
}

namespace {

// A tool's function name and the grammar of its arguments (its parameters schema; an object
// when it has none), for harmony's forced calls.
std::pair<std::string, grammar::Grammar> harmony_arguments(const Json& tool) {
  const Json& fn = tool.at("function");
  std::string name = fn.at("name").get<std::string>();
  const Json params = fn.contains("parameters") && !fn["parameters"].is_null() ? fn["parameters"] : Json{{"type", "object"}};
  try {
    return {name, grammar::json_schema_grammar(params)};
  } catch (const Error& e) {
    throw Error("the tool '" + name + "' parameters: " + e.what());
  }
}

}  // namespace

ForcedCall harmony_forced_call(const Json& tool) {
  auto [name, args] = harmony_arguments(tool);
  return {"<|channel|>commentary to=functions." + name + " <|constrain|>json<|message|>", std::move(args)};
}

ForcedCall harmony_required_call(const Json& tools) {
  grammar::Grammar g;
  const uint32_t root = g.add_rule("root");
  const uint32_t constrain = g.special_token("<|constrain|>"), message = g.special_token("<|message|>");
  for (const Json& tool : tools) {
    const auto [name, args] = harmony_arguments(tool);
    grammar::Sequence call;
    grammar::Grammar::append_literal(call, name + " ");
    call.push_back(grammar::Symbol::ch(constrain));
    grammar::Grammar::append_literal(call, "json");
    call.push_back(grammar::Symbol::ch(message));
    call.push_back(grammar::Symbol::ref(g.embed(args, name + "-")));
    g.add_alt(root, std::move(call));
  }
  g.set_root(root);
  return {"<|channel|>commentary to=functions.", std::move(g)};
}

namespace {

// One qwen3_coder call of `name` whose arguments follow `params`: each property in the
// schema's order (the required ones always, the others optionally) as <parameter=KEY>, a
// string's value free text up to </parameter>, any other value the JSON its schema allows.
// A string's other constraints (enum, pattern, lengths) are not enforced: the format writes
// strings unquoted, and the JSON-schema grammars describe quoted ones. (Left for the serving
// issue; a schema that needs them is better forced in another format.)
grammar::Sequence coder_call_grammar(grammar::Grammar& g, const std::string& name, const Json& params,
                                     const std::string& prefix) {
  using grammar::Grammar;
  using grammar::Sequence;
  using grammar::Symbol;
  Sequence body;
  Grammar::append_literal(body, "<tool_call>\n<function=" + name + ">\n");
  const auto props = params.find("properties");
  std::vector<std::string> required;
  if (const auto r = params.find("required"); r != params.end() && r->is_array())
    for (const Json& k : *r)
      if (k.is_string()) required.push_back(k.get<std::string>());
  if (props != params.end() && props->is_object())
    for (const auto& [key, schema] : props->items()) {
      Sequence one;
      Grammar::append_literal(one, "<parameter=" + key + ">\n");
      Sequence close;
      Grammar::append_literal(close, "\n</parameter>\n");
      if (schema.is_object() && schema.value("type", Json()) == "string") {
        Sequence nl;  // the value runs to </parameter>; its last newline is the format's
        Grammar::append_literal(nl, "\n");
        one.push_back(Symbol::ref(g.add_text_until("</parameter>", nl, prefix + key + "-text")));
      } else {
        try {
          one.push_back(Symbol::ref(g.embed(grammar::json_schema_grammar(schema), prefix + key + "-")));
        } catch (const Error& e) {
          throw Error("tool '" + name + "' parameter '" + key + "': " + e.what());
        }
        one.insert(one.end(), close.begin(), close.end());
      }
      const bool needed = std::ranges::find(required, key) != required.end();
      g.append_repeat(body, one, needed ? 1 : 0, 1, prefix + key);
    }
  Grammar::append_literal(body, "</function>\n</tool_call>");
  return body;
}

}  // namespace

grammar::Grammar tool_call_grammar(ToolParser p, const Json& tools, bool parallel) {
  using grammar::Grammar;
  using grammar::Sequence;
  using grammar::Symbol;
  if (p == ToolParser::None || p == ToolParser::Pythonic)
    throw Error(std::string("no grammar for the ") + (p == ToolParser::None ? "missing" : "pythonic") + " tool-call format");
  Grammar g;
  const uint32_t root = g.add_rule("root");
  const uint32_t call = g.add_rule("call");
  const char* args_key = p == ToolParser::Hermes ? "arguments" : "parameters";
  Sequence sp;
  g.append_repeat(sp, {Symbol::ch(' ')}, 0, 1, "sp");
  for (size_t i = 0; i < tools.size(); ++i) {
    const Json& fn = tools[i].at("function");
    const std::string name = fn.at("name").get<std::string>();
    Json params = fn.contains("parameters") && !fn["parameters"].is_null() ? fn["parameters"] : Json{{"type", "object"}};
    if (p == ToolParser::Qwen3Coder) {
      g.add_alt(call, coder_call_grammar(g, name, params, "t" + std::to_string(i) + "-"));
      continue;
    }
    uint32_t args;
    try {
      args = g.embed(grammar::json_schema_grammar(params), "t" + std::to_string(i) + "-");
    } catch (const Error& e) {
      throw Error("tools[" + std::to_string(i) + "] ('" + name + "') parameters: " + e.what());
    }
    // {"name": "NAME", "arguments": ARGS}
    Sequence body;
    Grammar::append_literal(body, "{\"name\":");
    body.insert(body.end(), sp.begin(), sp.end());
    Grammar::append_literal(body, Json(name).dump() + ",");
    body.insert(body.end(), sp.begin(), sp.end());
    Grammar::append_literal(body, "\"" + std::string(args_key) + "\":");
    body.insert(body.end(), sp.begin(), sp.end());
    body.push_back(Symbol::ref(args));
    Grammar::append_literal(body, "}");
    if (p == ToolParser::Hermes) {
      Sequence wrapped;
      Grammar::append_literal(wrapped, "<tool_call>\n");
      wrapped.insert(wrapped.end(), body.begin(), body.end());
      Grammar::append_literal(wrapped, "\n</tool_call>");
      g.add_alt(call, std::move(wrapped));
    } else {
      g.add_alt(call, std::move(body));
    }
  }
  Sequence r{Symbol::ref(call)};
  if (parallel) {
    Sequence more;
    Grammar::append_literal(more, p == ToolParser::Llama3Json ? "; " : "\n");
    more.push_back(Symbol::ref(call));
    g.append_repeat(r, more, 0, 7, "calls");  // at most 8 calls in one reply
  }
  g.add_alt(root, std::move(r));
  g.set_root(root);
  g.validate();
  return g;
}

}  // namespace kvlm::server

#include "server/request_json.h"

#include <climits>
#include <cmath>
#include <cstdio>

namespace kvlm::server {

[[noreturn]] void bad(const std::string& message, const std::string& param, const std::string& code) {
  throw ApiError(400, message, param, code);
}

std::string kind(const Json& v) {
  switch (v.type()) {
    case Json::value_t::string: return "a string";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "null";
  }
}

// The value of `key`, or nullptr when it is absent or null (OpenAI treats null as unset).
const Json* field(const Json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> opt_bool(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) bad(std::string(key) + " must be a boolean, got " + kind(*v), key);
  return v->get<bool>();
}

std::optional<double> opt_number(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) bad(std::string(key) + " must be a number, got " + kind(*v), key);
  const double d = v->get<double>();
  if (!std::isfinite(d)) bad(std::string(key) + " must be a finite number", key);
  return d;
}

std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// An integer (an integral float such as 2.0 is accepted, as pydantic accepts it).
std::optional<int64_t> opt_int(const Json& body, const char* key) {
  const Json* v = field(body, key);
  if (!v) return std::nullopt;
  if (v->is_number_unsigned()) {
    const uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(INT64_MAX)) bad(std::string(key) + " is too large", key);
    return int64_t(u);
  }
  if (v->is_number_integer()) return v->get<int64_t>();
  if (v->is_number_float()) {
    const double d = v->get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15) return int64_t(d);
    // 2^64 and beyond parse as floats: an integer, but out of range.
    if (std::isfinite(d) && d == std::floor(d)) bad(std::string(key) + " is out of range (" + num(d) + ")", key);
  }
  bad(std::string(key) + " must be an integer, got " + kind(*v), key);
}


float number_in(const Json& body, const char* key, double lo, double hi, bool lo_open, float dflt) {
  const auto v = opt_number(body, key);
  if (!v) return dflt;
  const bool ok = (lo_open ? *v > lo : *v >= lo) && *v <= hi;
  if (!ok)
    bad(std::string(key) + " must be in " + (lo_open ? "(" : "[") + num(lo) + ", " + num(hi) + "], got " + num(*v), key);
  return float(*v);
}

void check_model(const Json& body, const ModelInfo& info) {
  const Json* m = field(body, "model");
  if (!m) return;  // vLLM serves the one model when none is named
  if (!m->is_string()) bad("model must be a string, got " + kind(*m), "model");
  if (m->get_ref<const std::string&>() != info.name)
    throw ApiError(404, "The model '" + m->get<std::string>() + "' does not exist; this server serves '" + info.name + "'",
                   "model", "model_not_found");
}

TokenId token_id(const Json& v, const ModelInfo& info, const char* param, const char* what) {
  if (!v.is_number_integer() && !v.is_number_unsigned())
    bad(std::string(param) + " must hold integer token ids, got " + kind(v), param);
  if (v.is_number_unsigned() ? v.get<uint64_t>() >= uint64_t(info.vocab_size)
                             : (v.get<int64_t>() < 0 || v.get<int64_t>() >= info.vocab_size))
    bad(std::string(what) + " " + v.dump() + " is outside the model's vocabulary (0.." + std::to_string(info.vocab_size - 1) + ")",
        param);
  return TokenId(v.get<int64_t>());
}

// vLLM's `priority`: an integer, lower first; anything but 0 needs --scheduling-policy priority.
int parse_priority(const Json& b, const ApiLimits& lim) {
  const auto p = opt_int(b, "priority");
  if (!p || *p == 0) return 0;
  if (!lim.priority_scheduling)
    bad("priority needs a server started with --scheduling-policy priority (this one schedules first come, first served)",
        "priority");
  if (*p < INT32_MIN || *p > INT32_MAX) bad("priority is out of range", "priority");
  return int(*p);
}

std::vector<TokenId> token_list(const Json& arr, const ModelInfo& info, const char* key) {
  if (arr.empty()) bad(std::string("a token-id ") + key + " must not be empty", key);
  std::vector<TokenId> ids;
  ids.reserve(arr.size());
  const std::string what = std::string(key) + " token id";
  for (const auto& v : arr) ids.push_back(token_id(v, info, key, what.c_str()));
  return ids;
}

// `key` ("prompt", or "input" for embeddings): a string, a list of strings, a list of token
// ids, or a list of token-id lists.
std::vector<Prompt> parse_prompts(const Json& b, const ModelInfo& info, const char* key) {
  const std::string k = key;
  const Json* p = field(b, key);
  if (!p) bad(k + " is required", key);
  const std::string shapes = k + " must be a string, a list of strings, a list of token ids, or a list of token-id lists";
  std::vector<Prompt> out;
  auto text = [&](const Json& s) {
    if (!info.has_tokenizer)
      bad("this model has no tokenizer (tokenizer.json), so " + k + "s must be token ids, e.g. \"" + k + "\": [1, 2, 3]", key);
    out.push_back({.text = s.get<std::string>(), .ids = {}});
  };
  if (p->is_string()) {
    text(*p);
  } else if (p->is_array()) {
    if (p->empty()) bad(k + " must not be an empty list", key);
    const Json& first = p->front();
    if (first.is_string()) {
      for (const auto& s : *p) {
        if (!s.is_string()) bad(shapes + " (found a list mixing strings and " + kind(s) + ")", key);
        text(s);
      }
    } else if (first.is_number()) {
      out.push_back({.text = std::nullopt, .ids = token_list(*p, info, key)});
    } else if (first.is_array()) {
      for (const auto& l : *p) {
        if (!l.is_array()) bad(shapes + " (found a list mixing lists and " + kind(l) + ")", key);
        out.push_back({.text = std::nullopt, .ids = token_list(l, info, key)});
      }
    } else {
      bad(shapes + ", got a list of " + kind(first) + "s", key);
    }
  } else {
    bad(shapes + ", got " + kind(*p), key);
  }
  return out;
}

}  // namespace kvlm::server

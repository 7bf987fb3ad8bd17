#include "text/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "text/jinja/unicode.h"

namespace kvlm::jinja {

// --- ValueDict ---------------------------------------------------------------------------

const Value* ValueDict::find(std::string_view key) const {
  for (const auto& [k, v] : entries_)
    if (k == key) return &v;
  return nullptr;
}

Value* ValueDict::find(std::string_view key) {
  for (auto& [k, v] : entries_)
    if (k == key) return &v;
  return nullptr;
}

void ValueDict::set(std::string key, Value value) {
  if (Value* v = find(key)) {
    *v = std::move(value);
  } else {
    entries_.emplace_back(std::move(key), std::move(value));
  }
}

// --- Value -------------------------------------------------------------------------------

Value Value::undefined(std::string message) {
  Value v;
  v.s_ = std::move(message);
  return v;
}
Value Value::none() {
  Value v;
  v.type_ = Type::None;
  return v;
}
Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::Bool;
  v.b_ = b;
  return v;
}
Value Value::integer(int64_t i) {
  Value v;
  v.type_ = Type::Int;
  v.i_ = i;
  return v;
}
Value Value::number(double d) {
  Value v;
  v.type_ = Type::Float;
  v.f_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.type_ = Type::String;
  v.s_ = std::move(s);
  return v;
}
Value Value::list(ValueList items) {
  Value v;
  v.type_ = Type::List;
  v.list_ = std::make_shared<const ValueList>(std::move(items));
  return v;
}
Value Value::tuple(ValueList items) {
  Value v = list(std::move(items));
  v.type_ = Type::Tuple;
  return v;
}
Value Value::dict(ValueDict d) {
  Value v;
  v.type_ = Type::Dict;
  v.dict_ = std::make_shared<ValueDict>(std::move(d));
  return v;
}
Value Value::make_namespace(ValueDict d) {
  Value v = dict(std::move(d));
  v.type_ = Type::Namespace;
  return v;
}
Value Value::function(std::string name, std::function<Value(const CallArgs&)> fn) {
  Value v;
  v.type_ = Type::Function;
  v.fn_ = std::make_shared<const Function>(Function{std::move(name), std::move(fn)});
  return v;
}
Value Value::loop(LoopInfo info) {
  Value v;
  v.type_ = Type::Loop;
  v.loop_ = std::make_shared<const LoopInfo>(std::move(info));
  return v;
}

Value Value::generator(std::string type, std::string name, std::function<ValueList()> produce) {
  Value v;
  v.type_ = Type::Generator;
  v.gen_ = std::make_shared<GeneratorState>(GeneratorState{std::move(type), std::move(name), std::move(produce), false});
  return v;
}

double Value::as_double() const {
  switch (type_) {
    case Type::Float: return f_;
    case Type::Int: return static_cast<double>(i_);
    case Type::Bool: return b_ ? 1.0 : 0.0;
    default: return 0.0;
  }
}

bool Value::same_object(const Value& o) const {
  if (type_ != o.type_) return false;
  switch (type_) {
    case Type::Undefined:
    case Type::None: return true;
    case Type::Bool: return b_ == o.b_;
    case Type::Int: return i_ == o.i_ && i_ >= -5 && i_ <= 256;  // CPython's small-int cache
    case Type::List:
    case Type::Tuple: return list_ == o.list_;
    case Type::Dict:
    case Type::Namespace: return dict_ == o.dict_;
    case Type::Function: return fn_ == o.fn_;
    case Type::Loop: return loop_ == o.loop_;
    case Type::Generator: return gen_ == o.gen_;
    default: return false;
  }
}

[[noreturn]] void fail_undefined(const Value& v) {
  throw RuntimeError(v.str().empty() ? std::string("undefined value") : v.str());
}

// --- str / repr --------------------------------------------------------------------------

bool truthy(const Value& v) {
  using T = Value::Type;
  switch (v.type()) {
    case T::Undefined:
    case T::None: return false;
    case T::Bool: return v.as_bool();
    case T::Int: return v.as_int() != 0;
    case T::Float: return v.as_double() != 0.0;
    case T::String: return !v.str().empty();
    case T::List:
    case T::Tuple: return !v.items().empty();
    case T::Dict: return !v.dict().empty();
    default: return true;
  }
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  const size_t e_pos = sci.find('e');
  std::string digits = sci.substr(0, e_pos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(e_pos + 1));
  const int decpt = exp10 + 1;  // position of the decimal point relative to the digits
  const int n = static_cast<int>(digits.size());
  std::string out = sign;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= n) {
      out += digits + std::string(decpt - n, '0') + ".0";
    } else {
      out += digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out += digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof e, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    out += e;
  }
  return out;
}

std::string py_str_repr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (size_t i = 0; i < s.size();) {
    const char32_t c = unicode::decode(s, i);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (unicode::is_printable(c)) {
      unicode::append(out, c);
    } else {
      char buf[16];
      if (c < 0x100) std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(c));
      else if (c < 0x10000) std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      else std::snprintf(buf, sizeof buf, "\\U%08x", static_cast<unsigned>(c));
      out += buf;
    }
  }
  out.push_back(quote);
  return out;
}

namespace {
// Containers being printed, so that a namespace holding itself prints as {...} (Python's
// reprlib guard) instead of recursing forever. Only namespaces can form cycles.
thread_local std::vector<const void*> repr_stack;
}  // namespace

std::string repr(const Value& v) {
  using T = Value::Type;
  switch (v.type()) {
    case T::Undefined: return "Undefined";
    case T::None: return "None";
    case T::Bool: return v.as_bool() ? "True" : "False";
    case T::Int: return std::to_string(v.as_int());
    case T::Float: return float_repr(v.as_double());
    case T::String: return py_str_repr(v.str());
    case T::List:
    case T::Tuple: {
      const bool list = v.type() == T::List;
      std::string out = list ? "[" : "(";
      const auto& items = v.items();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += ", ";
        out += repr(items[i]);
      }
      if (!list && items.size() == 1) out += ",";
      out += list ? "]" : ")";
      return out;
    }
    case T::Dict:
    case T::Namespace: {
      const void* self = &v.dict();
      if (std::find(repr_stack.begin(), repr_stack.end(), self) != repr_stack.end())
        return v.is_namespace() ? "<Namespace {...}>" : "{...}";
      repr_stack.push_back(self);
      std::string out = v.is_namespace() ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, val] : v.dict().entries()) {
        if (!first) out += ", ";
        first = false;
        out += py_str_repr(k) + ": " + repr(val);
      }
      out += v.is_namespace() ? "}>" : "}";
      repr_stack.pop_back();
      return out;
    }
    case T::Function: return "<function " + v.function().name + ">";
    case T::Loop:
      return "<LoopContext " + std::to_string(v.loop().index0 + 1) + "/" + std::to_string(v.loop().items->size()) + ">";
    case T::Generator: {
      const GeneratorState& g = v.generator_state();
      return g.type == "generator" ? "<generator object " + g.name + ">" : "<" + g.type + " object>";
    }
  }
  return "";
}

std::string to_str(const Value& v) {
  if (v.is_string()) return v.str();
  if (v.is_undefined()) return "";
  return repr(v);
}

std::string type_name(const Value& v) {
  using T = Value::Type;
  switch (v.type()) {
    case T::Undefined: return "Undefined";
    case T::None: return "NoneType";
    case T::Bool: return "bool";
    case T::Int: return "int";
    case T::Float: return "float";
    case T::String: return "str";
    case T::List: return "list";
    case T::Tuple: return "tuple";
    case T::Dict: return "dict";
    case T::Namespace: return "Namespace";
    case T::Function: return "function";
    case T::Loop: return "LoopContext";
    case T::Generator: return v.generator_state().type;
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_namespace()) return "jinja2.utils.Namespace object";
  if (v.is_loop()) return "jinja2.runtime.LoopContext object";
  if (v.is_undefined()) return "jinja2.runtime.Undefined object";
  return type_name(v) + " object";
}

// --- comparison --------------------------------------------------------------------------

bool equals(const Value& a, const Value& b) {
  using T = Value::Type;
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.type() != b.type()) return false;
  switch (a.type()) {
    case T::Undefined:
    case T::None: return true;
    case T::String: return a.str() == b.str();
    case T::List:
    case T::Tuple: {
      const auto &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i)
        if (!equals(x[i], y[i])) return false;
      return true;
    }
    case T::Dict: {
      if (a.dict().size() != b.dict().size()) return false;
      for (const auto& [k, v] : a.dict().entries()) {
        const Value* w = b.dict().find(k);
        if (!w || !equals(v, *w)) return false;
      }
      return true;
    }
    default: return a.same_object(b);
  }
}

namespace {

bool less(const Value& a, const Value& b, std::string_view op) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) {
    if (a.is_integral() && b.is_integral()) return a.as_int() < b.as_int();
    return a.as_double() < b.as_double();
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str();  // UTF-8 byte order = code point order
  if (a.type() == b.type() && a.is_sequence()) {
    const auto &x = a.items(), &y = b.items();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i)
      if (!equals(x[i], y[i])) return less(x[i], y[i], op);
    return x.size() < y.size();
  }
  throw RuntimeError("'" + std::string(op) + "' not supported between instances of '" + type_name(a) + "' and '" +
                     type_name(b) + "'");
}

}  // namespace

bool compare(const Value& a, const Value& b, std::string_view op) {
  if (op == "<") return less(a, b, op);
  if (op == ">") return less(b, a, op);
  if (op == "<=") return less(a, b, op) || equals(a, b);
  return less(b, a, op) || equals(a, b);  // ">="
}

// --- len / iteration ---------------------------------------------------------------------

int64_t py_len(const Value& v) {
  using T = Value::Type;
  switch (v.type()) {
    case T::Undefined: return 0;
    case T::String: return static_cast<int64_t>(unicode::length(v.str()));
    case T::List:
    case T::Tuple: return static_cast<int64_t>(v.items().size());
    case T::Dict: return static_cast<int64_t>(v.dict().size());
    case T::Loop: return static_cast<int64_t>(v.loop().items->size());
    default: throw RuntimeError("object of type '" + type_name(v) + "' has no len()");
  }
}

ValueList iterate(const Value& v) {
  using T = Value::Type;
  switch (v.type()) {
    case T::Undefined: return {};
    case T::List:
    case T::Tuple: return v.items();
    case T::Dict: {
      ValueList out;
      out.reserve(v.dict().size());
      for (const auto& [k, val] : v.dict().entries()) out.push_back(Value::string(k));
      return out;
    }
    case T::String: {
      ValueList out;
      const std::string& s = v.str();
      for (size_t i = 0; i < s.size();) {
        const size_t start = i;
        unicode::decode(s, i);
        out.push_back(Value::string(s.substr(start, i - start)));
      }
      return out;
    }
    case T::Generator: {
      GeneratorState& g = v.generator_state();
      if (g.consumed) return {};
      g.consumed = true;
      return g.produce();
    }
    default: throw RuntimeError("'" + type_name(v) + "' object is not iterable");
  }
}

// --- JSON --------------------------------------------------------------------------------

namespace {

constexpr int kMaxJsonDepth = 256;

template <class Json>
Value convert(const Json& j, int depth = 0) {
  if (depth > kMaxJsonDepth) throw RuntimeError("the context nests too deeply (more than 256 levels)");
  switch (j.type()) {
    case nlohmann::json::value_t::null: return Value::none();
    case nlohmann::json::value_t::boolean: return Value::boolean(j.template get<bool>());
    case nlohmann::json::value_t::number_integer: return Value::integer(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        throw RuntimeError("integer " + std::to_string(u) + " is too large (kvlm integers are 64-bit)");
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float: return Value::number(j.template get<double>());
    case nlohmann::json::value_t::string: return Value::string(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(convert(x, depth + 1));
      return Value::list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      ValueDict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.set(it.key(), convert(it.value(), depth + 1));
      return Value::dict(std::move(d));
    }
    default: return Value::undefined("unsupported JSON value");
  }
}

void json_string(std::string& out, std::string_view s, bool ensure_ascii) {
  out.push_back('"');
  char buf[16];
  for (size_t i = 0; i < s.size();) {
    const char32_t c = unicode::decode(s, i);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", static_cast<unsigned>(0xD800 + (v >> 10)),
                          static_cast<unsigned>(0xDC00 + (v & 0x3FF)));
          } else {
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          unicode::append(out, c);
        }
    }
  }
  out.push_back('"');
}

void dump(std::string& out, const Value& v, const JsonDumpOptions& o, int level) {
  using T = Value::Type;
  const std::string item_sep = o.has_separators ? o.item_separator : (o.has_indent ? "," : ", ");
  const std::string key_sep = o.has_separators ? o.key_separator : ": ";
  auto newline = [&](int lvl) {
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += o.indent;
  };
  switch (v.type()) {
    case T::None: out += "null"; return;
    case T::Bool: out += v.as_bool() ? "true" : "false"; return;
    case T::Int: out += std::to_string(v.as_int()); return;
    case T::Float: {
      const double d = v.as_double();
      if (std::isnan(d)) out += "NaN";
      else if (std::isinf(d)) out += d > 0 ? "Infinity" : "-Infinity";
      else out += float_repr(d);
      return;
    }
    case T::String: json_string(out, v.str(), o.ensure_ascii); return;
    case T::List:
    case T::Tuple: {
      const auto& items = v.items();
      if (items.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        if (o.has_indent) newline(level + 1);
        dump(out, items[i], o, level + 1);
      }
      if (o.has_indent) newline(level);
      out.push_back(']');
      return;
    }
    case T::Dict: {
      if (v.dict().empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> entries;
      for (const auto& e : v.dict().entries()) entries.push_back(&e);
      if (o.sort_keys)
        std::stable_sort(entries.begin(), entries.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out.push_back('{');
      for (size_t i = 0; i < entries.size(); ++i) {
        if (i) out += item_sep;
        if (o.has_indent) newline(level + 1);
        json_string(out, entries[i]->first, o.ensure_ascii);
        out += key_sep;
        dump(out, entries[i]->second, o, level + 1);
      }
      if (o.has_indent) newline(level);
      out.push_back('}');
      return;
    }
    default: throw RuntimeError("Object of type " + type_name(v) + " is not JSON serializable");
  }
}

}  // namespace

Value from_json(const nlohmann::json& j) { return convert(j); }
Value from_json(const nlohmann::ordered_json& j) { return convert(j); }

std::string to_json(const Value& v, const JsonDumpOptions& options) {
  std::string out;
  dump(out, v, options, 0);
  return out;
}

}  // namespace kvlm::jinja

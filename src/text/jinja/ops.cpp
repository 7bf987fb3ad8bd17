#include "text/jinja/ops.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "text/jinja/filters.h"
#include "text/jinja/unicode.h"

namespace kvlm::jinja {
namespace {

[[noreturn]] void overflow() { throw RuntimeError("integer overflow (kvlm integers are 64-bit)"); }

int64_t checked(int64_t a, int64_t b, char op) {
  int64_t r = 0;
  const bool bad = op == '+' ? __builtin_add_overflow(a, b, &r) : op == '-' ? __builtin_sub_overflow(a, b, &r)
                                                                            : __builtin_mul_overflow(a, b, &r);
  if (bad) overflow();
  return r;
}

Value numeric(std::string_view op, const Value& a, const Value& b) {
  const bool ints = a.is_integral() && b.is_integral();
  const double x = a.as_double(), y = b.as_double();
  if (op == "+" || op == "-" || op == "*") {
    if (ints) return Value::integer(checked(a.as_int(), b.as_int(), op[0]));
    return Value::number(op == "+" ? x + y : op == "-" ? x - y : x * y);
  }
  if (op == "/") {
    if (y == 0) throw RuntimeError(ints ? "division by zero" : "float division by zero");
    return Value::number(x / y);
  }
  if (op == "//" || op == "%") {
    if (ints) {
      const int64_t p = a.as_int(), q = b.as_int();
      if (q == 0) throw RuntimeError("integer division or modulo by zero");
      if (p == INT64_MIN && q == -1) overflow();
      int64_t d = p / q, m = p % q;
      if (m != 0 && ((m < 0) != (q < 0))) {
        --d;
        m += q;
      }
      return Value::integer(op == "//" ? d : m);
    }
    if (y == 0) throw RuntimeError(op == "//" ? "float floor division by zero" : "float modulo");
    double mod = std::fmod(x, y);
    double div = (x - mod) / y;
    if (mod != 0) {
      if ((y < 0) != (mod < 0)) {
        mod += y;
        div -= 1.0;
      }
    } else {
      mod = std::copysign(0.0, y);
    }
    if (op == "%") return Value::number(mod);
    double floordiv;
    if (div != 0) {
      floordiv = std::floor(div);
      if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
      floordiv = std::copysign(0.0, x / y);
    }
    return Value::number(floordiv);
  }
  // **
  if (ints && b.as_int() >= 0) {
    int64_t base = a.as_int(), e = b.as_int(), r = 1;
    while (e > 0) {
      if (e & 1) r = checked(r, base, '*');
      e >>= 1;
      if (e > 0) base = checked(base, base, '*');
    }
    return Value::integer(r);
  }
  if (x == 0 && y < 0) throw RuntimeError("0.0 cannot be raised to a negative power");
  if (x < 0 && y != std::floor(y)) throw RuntimeError("a negative number raised to a fractional power is complex");
  return Value::number(std::pow(x, y));
}

bool is_int_like(const Value& v) { return v.is_integral(); }

Value repeat(const Value& seq, int64_t n) {
  constexpr int64_t kMaxItems = int64_t{1} << 26;  // refuse to build a 64M-element string/list
  const int64_t len = seq.is_string() ? static_cast<int64_t>(seq.str().size()) : static_cast<int64_t>(seq.items().size());
  if (n > 0 && len > 0 && n > kMaxItems / len) throw RuntimeError("repetition result too large");
  if (seq.is_string()) {
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += seq.str();
    return Value::string(std::move(out));
  }
  ValueList out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), seq.items().begin(), seq.items().end());
  return seq.type() == Value::Type::Tuple ? Value::tuple(std::move(out)) : Value::list(std::move(out));
}

// --- str methods ---

std::u32string chars_of(const Value& chars) {
  if (chars.is_none() || chars.is_undefined()) return {};
  if (!chars.is_string()) throw RuntimeError("strip arg must be None or str");
  return unicode::to_u32(chars.str());
}

int64_t cp_index(std::string_view s, size_t byte_pos) { return static_cast<int64_t>(unicode::length(s.substr(0, byte_pos))); }

Value split(const std::string& s, const Value& sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (sep.is_none() || sep.is_undefined()) {
    const std::u32string u = unicode::to_u32(s);
    std::vector<std::u32string> parts;
    if (!from_right) {
      size_t i = 0;
      const size_t n = u.size();
      while (true) {
        while (i < n && unicode::is_space(u[i])) ++i;
        if (i >= n) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(u.substr(i));
          break;
        }
        size_t j = i;
        while (j < n && !unicode::is_space(u[j])) ++j;
        parts.push_back(u.substr(i, j - i));
        i = j;
      }
    } else {
      size_t end = u.size();
      while (true) {
        while (end > 0 && unicode::is_space(u[end - 1])) --end;
        if (end == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          parts.push_back(u.substr(0, end));
          break;
        }
        size_t j = end;
        while (j > 0 && !unicode::is_space(u[j - 1])) --j;
        parts.push_back(u.substr(j, end - j));
        end = j;
      }
      std::reverse(parts.begin(), parts.end());
    }
    for (const auto& p : parts) out.push_back(Value::string(unicode::to_utf8(p)));
    return Value::list(std::move(out));
  }
  if (!sep.is_string()) throw RuntimeError("must be str or None, not " + type_name(sep));
  const std::string& d = sep.str();
  if (d.empty()) throw RuntimeError("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    while (true) {
      const size_t p = (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) ? std::string::npos
                                                                                           : s.find(d, start);
      if (p == std::string::npos) {
        parts.push_back(s.substr(start));
        break;
      }
      parts.push_back(s.substr(start, p - start));
      start = p + d.size();
    }
  } else {
    size_t end = s.size();
    while (true) {
      size_t p = std::string::npos;
      if (!(maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) && end >= d.size())
        p = s.rfind(d, end - d.size());
      if (p == std::string::npos) {
        parts.push_back(s.substr(0, end));
        break;
      }
      parts.push_back(s.substr(p + d.size(), end - p - d.size()));
      end = p;
    }
    std::reverse(parts.begin(), parts.end());
  }
  for (auto& p : parts) out.push_back(Value::string(std::move(p)));
  return Value::list(std::move(out));
}

std::string replace_all(const std::string& s, const std::string& old, const std::string& rep, int64_t count) {
  std::string out;
  int64_t done = 0;
  if (old.empty()) {
    size_t i = 0;
    while (true) {
      if (count < 0 || done < count) {
        out += rep;
        ++done;
      }
      if (i >= s.size()) break;
      const size_t start = i;
      unicode::decode(s, i);
      out.append(s, start, i - start);
    }
    return out;
  }
  size_t start = 0;
  while (count < 0 || done < count) {
    const size_t p = s.find(old, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += rep;
    start = p + old.size();
    ++done;
  }
  out.append(s, start, std::string::npos);
  return out;
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
         c == 0x2028 || c == 0x2029;
}

template <class Pred>
Value all_chars(const std::string& s, Pred pred) {
  if (s.empty()) return Value::boolean(false);
  for (size_t i = 0; i < s.size();)
    if (!pred(unicode::decode(s, i))) return Value::boolean(false);
  return Value::boolean(true);
}

bool affix_matches(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    if (!a.is_string())
      throw RuntimeError(std::string(prefix ? "startswith" : "endswith") + " first arg must be str or a tuple of str, not " +
                         type_name(a));
    const std::string& p = a.str();
    return p.size() <= s.size() && (prefix ? s.compare(0, p.size(), p) == 0 : s.compare(s.size() - p.size(), p.size(), p) == 0);
  };
  if (affix.type() == Value::Type::Tuple) {
    for (const Value& a : affix.items())
      if (one(a)) return true;
    return false;
  }
  return one(affix);
}

bool cased_check(const std::string& s, bool want_lower) {
  bool any = false;
  for (size_t i = 0; i < s.size();) {
    const char32_t c = unicode::decode(s, i);
    if (want_lower ? unicode::is_upper(c) : unicode::is_lower(c)) return false;
    if (unicode::is_cased(c)) any = true;
  }
  return any;
}

Value str_method(const std::string& s, std::string_view m, const CallArgs& ca) {
  const std::string what = "str." + std::string(m) + "()";
  if (m == "startswith" || m == "endswith") {
    Args a(ca, what, {"prefix"});
    if (!a.get(0)) throw RuntimeError(what + " takes at least 1 argument (0 given)");
    return Value::boolean(affix_matches(s, *a.get(0), m == "startswith"));
  }
  if (m == "split" || m == "rsplit") {
    Args a(ca, what, {"sep", "maxsplit"});
    const Value maxsplit = a.get_or(1, Value::integer(-1));
    if (!maxsplit.is_integral()) throw RuntimeError("maxsplit must be an integer");
    return split(s, a.get_or(0, Value::none()), maxsplit.as_int(), m == "rsplit");
  }
  if (m == "strip" || m == "lstrip" || m == "rstrip") {
    Args a(ca, what, {"chars"});
    return Value::string(py_strip(s, a.get_or(0, Value::none()), m != "rstrip", m != "lstrip"));
  }
  if (m == "lower" || m == "upper" || m == "title" || m == "capitalize") {
    Args a(ca, what, {});
    return Value::string(m == "lower" ? unicode::lower(s) : m == "upper" ? unicode::upper(s)
                                                         : m == "title" ? unicode::title(s) : unicode::capitalize(s));
  }
  if (m == "replace") {
    Args a(ca, what, {"old", "new", "count"});
    if (!a.get(0) || !a.get(1) || !a.get(0)->is_string() || !a.get(1)->is_string())
      throw RuntimeError(what + " takes two string arguments");
    const Value count = a.get_or(2, Value::integer(-1));
    return Value::string(replace_all(s, a.get(0)->str(), a.get(1)->str(), count.as_int()));
  }
  if (m == "find" || m == "rfind" || m == "index" || m == "rindex" || m == "count") {
    Args a(ca, what, {"sub"});
    if (!a.get(0) || !a.get(0)->is_string()) throw RuntimeError(what + " argument must be str");
    const std::string& sub = a.get(0)->str();
    if (m == "count") {
      if (sub.empty()) return Value::integer(static_cast<int64_t>(unicode::length(s)) + 1);
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::integer(n);
    }
    const size_t p = (m == "find" || m == "index") ? s.find(sub) : s.rfind(sub);
    if (p == std::string::npos) {
      if (m == "index" || m == "rindex") throw RuntimeError("substring not found");
      return Value::integer(-1);
    }
    return Value::integer(cp_index(s, p));
  }
  if (m == "join") {
    Args a(ca, what, {"iterable"});
    if (!a.get(0)) throw RuntimeError(what + " takes exactly one argument (0 given)");
    std::string out;
    const ValueList items = iterate(*a.get(0));
    for (size_t i = 0; i < items.size(); ++i) {
      if (!items[i].is_string())
        throw RuntimeError("sequence item " + std::to_string(i) + ": expected str instance, " + type_name(items[i]) +
                           " found");
      if (i) out += s;
      out += items[i].str();
    }
    return Value::string(std::move(out));
  }
  if (m == "splitlines") {
    Args a(ca, what, {"keepends"});
    const bool keep = a.get_bool(0, false);
    const std::u32string u = unicode::to_u32(s);
    ValueList out;
    size_t start = 0;
    for (size_t i = 0; i < u.size(); ++i) {
      if (!is_line_break(u[i])) continue;
      size_t end = i + 1;
      if (u[i] == '\r' && i + 1 < u.size() && u[i + 1] == '\n') end = i + 2;
      out.push_back(Value::string(unicode::to_utf8(u.substr(start, (keep ? end : i) - start))));
      start = end;
      i = end - 1;
    }
    if (start < u.size()) out.push_back(Value::string(unicode::to_utf8(u.substr(start))));
    return Value::list(std::move(out));
  }
  if (m == "partition" || m == "rpartition") {
    Args a(ca, what, {"sep"});
    if (!a.get(0) || !a.get(0)->is_string() || a.get(0)->str().empty()) throw RuntimeError(what + " needs a non-empty separator");
    const std::string& d = a.get(0)->str();
    const size_t p = m == "partition" ? s.find(d) : s.rfind(d);
    if (p == std::string::npos) {
      return m == "partition" ? Value::tuple({Value::string(s), Value::string(""), Value::string("")})
                              : Value::tuple({Value::string(""), Value::string(""), Value::string(s)});
    }
    return Value::tuple({Value::string(s.substr(0, p)), Value::string(d), Value::string(s.substr(p + d.size()))});
  }
  if (m == "removeprefix" || m == "removesuffix") {
    Args a(ca, what, {"affix"});
    if (!a.get(0) || !a.get(0)->is_string()) throw RuntimeError(what + " argument must be str");
    const std::string& p = a.get(0)->str();
    if (!affix_matches(s, *a.get(0), m == "removeprefix")) return Value::string(s);
    return Value::string(m == "removeprefix" ? s.substr(p.size()) : s.substr(0, s.size() - p.size()));
  }
  static constexpr std::string_view implemented[] = {"isdigit", "isdecimal", "isnumeric", "isalpha", "isalnum",
                                                     "isspace", "isascii", "islower", "isupper"};
  if (std::find(std::begin(implemented), std::end(implemented), m) == std::end(implemented))
    throw RuntimeError("str." + std::string(m) + "() is not supported by kvlm");
  Args a(ca, what, {});
  if (m == "isdigit" || m == "isdecimal" || m == "isnumeric") return all_chars(s, unicode::is_digit);
  if (m == "isalpha") return all_chars(s, unicode::is_alpha);
  if (m == "isalnum") return all_chars(s, [](char32_t c) { return unicode::is_alpha(c) || unicode::is_digit(c); });
  if (m == "isspace") return all_chars(s, unicode::is_space);
  if (m == "isascii") return Value::boolean(std::all_of(s.begin(), s.end(), [](char c) { return (c & 0x80) == 0; }));
  if (m == "islower") return Value::boolean(cased_check(s, true));
  if (m == "isupper") return Value::boolean(cased_check(s, false));
  throw RuntimeError("str." + std::string(m) + "() is not supported by kvlm");
}

constexpr std::string_view kStrMethods[] = {
    "startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "lower", "upper", "title",
    "capitalize", "replace", "find", "rfind", "index", "rindex", "count", "join", "splitlines", "partition",
    "rpartition", "removeprefix", "removesuffix", "isdigit", "isdecimal", "isnumeric", "isalpha", "isalnum",
    "isspace", "isascii", "islower", "isupper",
    // Python methods kvlm does not implement: calling them is an error, not undefined.
    "format", "format_map", "encode", "casefold", "swapcase", "center", "ljust", "rjust", "zfill", "expandtabs",
    "translate", "istitle", "isidentifier", "isprintable"};

constexpr std::string_view kUnsafe[] = {"append", "extend", "insert", "pop", "remove", "reverse", "sort", "clear",
                                        "popitem", "setdefault", "update"};

bool in(std::string_view name, const auto& list) { return std::find(std::begin(list), std::end(list), name) != std::end(list); }

Value unsafe_method(const Value& obj, std::string_view name) {
  const std::string msg = "access to attribute '" + std::string(name) + "' of '" + type_name(obj) + "' object is unsafe.";
  return Value::function(type_name(obj) + "." + std::string(name), [msg](const CallArgs&) -> Value { throw RuntimeError(msg); });
}

Value dict_method(const Value& d, std::string_view m) {
  const std::string what = "dict." + std::string(m) + "()";
  return Value::function(what, [d, m = std::string(m), what](const CallArgs& ca) -> Value {
    if (m == "get") {
      Args a(ca, what, {"key", "default"});
      if (!a.get(0)) throw RuntimeError("get expected at least 1 argument, got 0");
      const Value* v = a.get(0)->is_string() ? d.dict().find(a.get(0)->str()) : nullptr;
      return v ? *v : a.get_or(1, Value::none());
    }
    Args a(ca, what, {});
    if (m == "copy") return d;
    ValueList out;
    for (const auto& [k, v] : d.dict().entries()) {
      if (m == "items") out.push_back(Value::tuple({Value::string(k), v}));
      else if (m == "keys") out.push_back(Value::string(k));
      else out.push_back(v);
    }
    return Value::list(std::move(out));
  });
}

Value list_method(const Value& l, std::string_view m) {
  const std::string what = type_name(l) + "." + std::string(m) + "()";
  return Value::function(what, [l, m = std::string(m), what](const CallArgs& ca) -> Value {
    if (m == "copy") return Value::list(l.items());
    Args a(ca, what, {"value"});
    if (!a.get(0)) throw RuntimeError(what + " takes exactly one argument (0 given)");
    int64_t n = 0;
    for (size_t i = 0; i < l.items().size(); ++i) {
      if (!equals(l.items()[i], *a.get(0))) continue;
      if (m == "index") return Value::integer(static_cast<int64_t>(i));
      ++n;
    }
    if (m == "index") throw RuntimeError(repr(*a.get(0)) + " is not in " + type_name(l));
    return Value::integer(n);
  });
}

Value no_attribute(const Value& obj, std::string_view name) {
  return Value::undefined(py_str_repr(object_type_repr(obj)) + " has no attribute " + py_str_repr(name));
}

Value loop_attr(const Value& obj, std::string_view name) {
  const LoopInfo& l = obj.loop();
  const auto n = static_cast<int64_t>(l.items->size());
  if (name == "index") return Value::integer(l.index0 + 1);
  if (name == "index0") return Value::integer(l.index0);
  if (name == "revindex") return Value::integer(n - l.index0);
  if (name == "revindex0") return Value::integer(n - l.index0 - 1);
  if (name == "first") return Value::boolean(l.index0 == 0);
  if (name == "last") return Value::boolean(l.index0 == n - 1);
  if (name == "length") return Value::integer(n);
  if (name == "depth") return Value::integer(l.depth0 + 1);
  if (name == "depth0") return Value::integer(l.depth0);
  if (name == "previtem")
    return l.index0 > 0 ? (*l.items)[l.index0 - 1] : Value::undefined("there is no previous item");
  if (name == "nextitem") return l.index0 + 1 < n ? (*l.items)[l.index0 + 1] : Value::undefined("there is no next item");
  if (name == "cycle") {
    const int64_t i = l.index0;
    return Value::function("loop.cycle", [i](const CallArgs& ca) -> Value {
      if (ca.pos.empty()) throw RuntimeError("no items for cycling given");
      return ca.pos[static_cast<size_t>(i) % ca.pos.size()];
    });
  }
  return no_attribute(obj, name);
}

}  // namespace

std::string py_strip(std::string_view s, const Value& chars, bool left, bool right) {
  const std::u32string set = chars_of(chars);
  const bool ws = chars.is_none() || chars.is_undefined();
  auto strip_it = [&](char32_t c) { return ws ? unicode::is_space(c) : set.find(c) != std::u32string::npos; };
  const std::u32string u = unicode::to_u32(s);
  size_t b = 0, e = u.size();
  if (left)
    while (b < e && strip_it(u[b])) ++b;
  if (right)
    while (e > b && strip_it(u[e - 1])) --e;
  return unicode::to_utf8(std::u32string_view(u).substr(b, e - b));
}

Value binary_op(std::string_view op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (op == "%" && a.is_string()) return Value::string(percent_format(a.str(), b));
  if (b.is_undefined()) fail_undefined(b);
  if (a.is_number() && b.is_number()) return numeric(op, a, b);
  using T = Value::Type;
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value::string(a.str() + b.str());
    if ((a.type() == T::List || a.type() == T::Tuple) && a.type() == b.type()) {
      ValueList out = a.items();
      out.insert(out.end(), b.items().begin(), b.items().end());
      return a.type() == T::List ? Value::list(std::move(out)) : Value::tuple(std::move(out));
    }
    if (a.is_string() || a.type() == T::List || a.type() == T::Tuple)
      throw RuntimeError("can only concatenate " + type_name(a) + " (not \"" + type_name(b) + "\") to " + type_name(a));
  }
  if (op == "*") {
    const bool a_seq = a.is_string() || a.is_sequence(), b_seq = b.is_string() || b.is_sequence();
    if (a_seq && is_int_like(b)) return repeat(a, b.as_int());
    if (b_seq && is_int_like(a)) return repeat(b, a.as_int());
    if (a_seq || b_seq) throw RuntimeError("can't multiply sequence by non-int of type '" + type_name(a_seq ? b : a) + "'");
  }
  throw RuntimeError("unsupported operand type(s) for " + std::string(op) + ": '" + type_name(a) + "' and '" +
                     type_name(b) + "'");
}

Value negate(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) overflow();
    return Value::integer(-v.as_int());
  }
  if (v.is_float()) return Value::number(-v.as_double());
  throw RuntimeError("bad operand type for unary -: '" + type_name(v) + "'");
}

Value unary_plus(const Value& v) {
  if (v.is_undefined()) fail_undefined(v);
  if (v.is_integral()) return Value::integer(v.as_int());
  if (v.is_float()) return v;
  throw RuntimeError("bad operand type for unary +: '" + type_name(v) + "'");
}

bool contains(const Value& container, const Value& item) {
  using T = Value::Type;
  switch (container.type()) {
    case T::Undefined: return false;
    case T::String:
      if (!item.is_string())
        throw RuntimeError("'in <string>' requires string as left operand, not " + type_name(item));
      return container.str().find(item.str()) != std::string::npos;
    case T::List:
    case T::Tuple:
      return std::any_of(container.items().begin(), container.items().end(),
                         [&](const Value& v) { return equals(v, item); });
    case T::Generator: {
      const ValueList items = iterate(container);
      return std::any_of(items.begin(), items.end(), [&](const Value& v) { return equals(v, item); });
    }
    case T::Dict:
      if (item.type() == T::List || item.is_dict()) throw RuntimeError("unhashable type: '" + type_name(item) + "'");
      return item.is_string() && container.dict().find(item.str()) != nullptr;
    default: throw RuntimeError("argument of type '" + type_name(container) + "' is not iterable");
  }
}

Value get_attr(const Value& obj, std::string_view name) {
  using T = Value::Type;
  switch (obj.type()) {
    case T::Undefined: fail_undefined(obj);
    case T::Dict:
      if (name == "get" || name == "items" || name == "keys" || name == "values" || name == "copy")
        return dict_method(obj, name);
      if (in(name, kUnsafe)) return unsafe_method(obj, name);
      if (const Value* v = obj.dict().find(name)) return *v;
      return no_attribute(obj, name);
    case T::Namespace:
      if (const Value* v = obj.dict().find(name)) return *v;
      return no_attribute(obj, name);
    case T::String:
      if (in(name, kStrMethods)) {
        const std::string s = obj.str();
        return Value::function("str." + std::string(name),
                               [s, m = std::string(name)](const CallArgs& a) { return str_method(s, m, a); });
      }
      return no_attribute(obj, name);
    case T::List:
    case T::Tuple:
      if (name == "index" || name == "count" || (name == "copy" && obj.type() == T::List)) return list_method(obj, name);
      if (obj.type() == T::List && in(name, kUnsafe)) return unsafe_method(obj, name);
      return no_attribute(obj, name);
    case T::Loop: return loop_attr(obj, name);
    default: return no_attribute(obj, name);
  }
}

Value get_item(const Value& obj, const Value& key) {
  using T = Value::Type;
  if (obj.is_undefined()) fail_undefined(obj);
  auto no_element = [&]() {
    return Value::undefined(object_type_repr(obj) + " has no element " + repr(key));
  };
  switch (obj.type()) {
    case T::Dict:
      if (key.is_string()) {
        if (const Value* v = obj.dict().find(key.str())) return *v;
        return get_attr(obj, key.str());
      }
      return no_element();
    case T::List:
    case T::Tuple:
    case T::String: {
      if (key.is_string()) return get_attr(obj, key.str());
      if (!key.is_integral()) return no_element();
      int64_t i = key.as_int();
      if (obj.is_string()) {
        const std::u32string u = unicode::to_u32(obj.str());
        const auto n = static_cast<int64_t>(u.size());
        if (i < 0) i += n;
        if (i < 0 || i >= n) return no_element();
        std::string out;
        unicode::append(out, u[static_cast<size_t>(i)]);
        return Value::string(std::move(out));
      }
      const auto n = static_cast<int64_t>(obj.items().size());
      if (i < 0) i += n;
      if (i < 0 || i >= n) return no_element();
      return obj.items()[static_cast<size_t>(i)];
    }
    default:
      if (key.is_string()) return get_attr(obj, key.str());
      return no_element();
  }
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  auto bound = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    if (!v.is_integral()) throw RuntimeError(std::string("slice ") + what + " must be an integer or None, not " + type_name(v));
    return v.as_int();
  };
  const int64_t st = bound(step, "step").value_or(1);
  if (st == 0) throw RuntimeError("slice step cannot be zero");
  std::u32string chars;
  const bool is_str = obj.is_string();
  if (is_str) chars = unicode::to_u32(obj.str());
  else if (!obj.is_sequence()) throw RuntimeError("'" + type_name(obj) + "' object is not subscriptable with a slice");
  const int64_t n = is_str ? static_cast<int64_t>(chars.size()) : static_cast<int64_t>(obj.items().size());
  auto adjust = [&](std::optional<int64_t> v, int64_t def) {
    if (!v) return def;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = st < 0 ? -1 : 0;
    } else if (x >= n) {
      x = st < 0 ? n - 1 : n;
    }
    return x;
  };
  const int64_t b = adjust(bound(start, "start"), st < 0 ? n - 1 : 0);
  const int64_t e = adjust(bound(stop, "stop"), st < 0 ? -1 : n);
  std::u32string out_chars;
  ValueList out_items;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
    if (is_str) out_chars.push_back(chars[static_cast<size_t>(i)]);
    else out_items.push_back(obj.items()[static_cast<size_t>(i)]);
  }
  if (is_str) return Value::string(unicode::to_utf8(out_chars));
  return obj.type() == Value::Type::Tuple ? Value::tuple(std::move(out_items)) : Value::list(std::move(out_items));
}

}  // namespace kvlm::jinja

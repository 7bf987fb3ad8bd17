#include "text/jinja/filters.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "text/jinja/ops.h"
#include "text/jinja/unicode.h"

namespace kvlm::jinja {

Args::Args(const CallArgs& args, std::string what, std::initializer_list<std::string_view> names)
    : what_(std::move(what)), slots_(names.size(), nullptr) {
  if (args.pos.size() > names.size())
    throw RuntimeError(what_ + " takes at most " + std::to_string(names.size()) + " argument(s) (" +
                       std::to_string(args.pos.size()) + " given)");
  for (size_t i = 0; i < args.pos.size(); ++i) slots_[i] = &args.pos[i];
  for (const auto& [key, value] : args.kw) {
    const auto it = std::find(names.begin(), names.end(), key);
    if (it == names.end()) throw RuntimeError(what_ + " got an unexpected keyword argument '" + key + "'");
    const auto i = static_cast<size_t>(it - names.begin());
    if (slots_[i]) throw RuntimeError(what_ + " got multiple values for argument '" + key + "'");
    slots_[i] = &value;
  }
}

bool Args::get_bool(size_t i, bool fallback) const { return slots_[i] ? truthy(*slots_[i]) : fallback; }

namespace {

// --- helpers shared by several filters ---

// jinja2's make_attrgetter: "a.b.0" looks up item a, then b, then index 0.
Value lookup_attribute(const Value& item, const Value& attribute) {
  if (attribute.is_integral()) return get_item(item, attribute);
  Value v = item;
  const std::string path = to_str(attribute);
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    int64_t index = 0;
    const auto res = std::from_chars(part.data(), part.data() + part.size(), index);
    const bool numeric = !part.empty() && res.ec == std::errc() && res.ptr == part.data() + part.size();
    v = get_item(v, numeric ? Value::integer(index) : Value::string(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value ignore_case(const Value& v) { return v.is_string() ? Value::string(unicode::lower(v.str())) : v; }

// key(item) for sort/unique/min/max: the attribute (if any), lowercased unless case-sensitive.
Value sort_key(const Value& item, const Value* attribute, bool case_sensitive) {
  Value k = attribute && !attribute->is_none() ? lookup_attribute(item, *attribute) : item;
  return case_sensitive ? k : ignore_case(k);
}

Value call_filter_by_name(const Value& name, const Value& v, const CallArgs& args) {
  const std::string n = to_str(name);
  const FilterFn f = find_filter(n);
  if (!f) throw RuntimeError("no filter named '" + n + "'");
  return f(v, args);
}

bool call_test_by_name(const Value& name, const Value& v, const CallArgs& args) {
  const std::string n = to_str(name);
  const TestFn t = find_test(n);
  if (!t) throw RuntimeError("no test named '" + n + "'");
  return t(v, args);
}

std::optional<double> parse_float(std::string s) {
  s = py_strip(s, Value::none(), true, true);
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_' && i > 0 && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i - 1])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 1])))
      continue;
    clean.push_back(s[i]);
  }
  std::string low = unicode::lower(clean);
  const bool neg = !low.empty() && low[0] == '-';
  const std::string body = (!low.empty() && (low[0] == '-' || low[0] == '+')) ? low.substr(1) : low;
  if (body == "inf" || body == "infinity") return neg ? -HUGE_VAL : HUGE_VAL;
  if (body == "nan") return std::nan("");
  if (clean.empty() || clean.find_first_not_of("0123456789.eE+-") != std::string::npos) return std::nullopt;
  double d = 0;
  const char* b = clean.data() + (clean[0] == '+' ? 1 : 0);
  const auto res = std::from_chars(b, clean.data() + clean.size(), d);
  if (res.ec != std::errc() || res.ptr != clean.data() + clean.size()) return std::nullopt;
  return d;
}

std::optional<int64_t> parse_int(const std::string& text, int base) {
  std::string s = py_strip(text, Value::none(), true, true);
  bool neg = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    neg = s[0] == '-';
    s.erase(0, 1);
  }
  if (base == 0 || base == 16 || base == 8 || base == 2) {
    if (s.size() > 2 && s[0] == '0') {
      const char p = static_cast<char>(s[1] | 0x20);
      const int b = p == 'x' ? 16 : p == 'o' ? 8 : p == 'b' ? 2 : 0;
      if (b && (base == 0 || base == b)) {
        base = b;
        s.erase(0, 2);
        if (!s.empty() && s[0] == '_') s.erase(0, 1);
      }
    }
    if (base == 0) base = 10;
  }
  std::string clean;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '_' && i > 0 && i + 1 < s.size() && s[i + 1] != '_') continue;
    clean.push_back(s[i]);
  }
  if (clean.empty()) return std::nullopt;
  int64_t v = 0;
  const auto res = std::from_chars(clean.data(), clean.data() + clean.size(), v, base);
  if (res.ec != std::errc() || res.ptr != clean.data() + clean.size()) return std::nullopt;
  return neg ? -v : v;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::vector<std::string> split_lines(const std::string& s) {  // str.splitlines()
  std::vector<std::string> out;
  const std::u32string u = unicode::to_u32(s);
  size_t start = 0;
  for (size_t i = 0; i < u.size(); ++i) {
    const char32_t c = u[i];
    if (!(c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
          c == 0x2028 || c == 0x2029))
      continue;
    out.push_back(unicode::to_utf8(u.substr(start, i - start)));
    if (c == '\r' && i + 1 < u.size() && u[i + 1] == '\n') ++i;
    start = i + 1;
  }
  if (start < u.size()) out.push_back(unicode::to_utf8(u.substr(start)));
  return out;
}

template <class Less>
ValueList sorted(ValueList items, bool reverse, Less less) {
  std::stable_sort(items.begin(), items.end(),
                   [&](const Value& a, const Value& b) { return reverse ? less(b, a) : less(a, b); });
  return items;
}

// --- filters ---

Value f_abs(const Value& v, const CallArgs& a) {
  Args(a, "abs()", {});
  if (v.is_integral()) {
    if (v.as_int() == INT64_MIN) throw RuntimeError("integer overflow (kvlm integers are 64-bit)");
    return Value::integer(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (v.is_float()) return Value::number(std::fabs(v.as_double()));
  throw RuntimeError("bad operand type for abs(): '" + type_name(v) + "'");
}

Value f_attr(const Value& v, const CallArgs& a) {
  Args args(a, "attr()", {"name"});
  if (!args.get(0)) throw RuntimeError("attr() missing required argument 'name'");
  const std::string name = to_str(*args.get(0));
  if (v.is_dict() && name != "get" && name != "items" && name != "keys" && name != "values" && name != "copy")
    return Value::undefined("'dict object' has no attribute " + py_str_repr(name));
  return get_attr(v, name);
}

Value f_capitalize(const Value& v, const CallArgs& a) {
  Args(a, "capitalize()", {});
  return Value::string(unicode::capitalize(to_str(v)));
}

Value f_length(const Value& v, const CallArgs& a) {
  Args(a, "length()", {});
  return Value::integer(py_len(v));
}

Value f_default(const Value& v, const CallArgs& a) {
  Args args(a, "default()", {"default_value", "boolean"});
  if (v.is_undefined() || (args.get_bool(1, false) && !truthy(v))) return args.get_or(0, Value::string(""));
  return v;
}

Value f_dictsort(const Value& v, const CallArgs& a) {
  Args args(a, "dictsort()", {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) throw RuntimeError("dictsort() needs a mapping, got " + type_name(v));
  const bool cs = args.get_bool(0, false);
  const std::string by = to_str(args.get_or(1, Value::string("key")));
  if (by != "key" && by != "value") throw RuntimeError("You can only sort by either \"key\" or \"value\"");
  const size_t pos = by == "key" ? 0 : 1;
  ValueList items;
  for (const auto& [k, val] : v.dict().entries()) items.push_back(Value::tuple({Value::string(k), val}));
  return Value::list(sorted(std::move(items), args.get_bool(2, false), [&](const Value& x, const Value& y) {
    const Value kx = cs ? x.items()[pos] : ignore_case(x.items()[pos]);
    const Value ky = cs ? y.items()[pos] : ignore_case(y.items()[pos]);
    return compare(kx, ky, "<");
  }));
}

Value f_escape(const Value& v, const CallArgs& a) {
  Args(a, "escape()", {});
  return Value::string(html_escape(to_str(v)));
}

Value f_first(const Value& v, const CallArgs& a) {
  Args(a, "first()", {});
  const ValueList items = iterate(v);
  return items.empty() ? Value::undefined("No first item, sequence was empty.") : items.front();
}

Value f_last(const Value& v, const CallArgs& a) {
  Args(a, "last()", {});
  if (v.is_generator()) throw RuntimeError("'" + type_name(v) + "' object is not reversible");
  const ValueList items = iterate(v);
  return items.empty() ? Value::undefined("No last item, sequence was empty.") : items.back();
}

Value f_float(const Value& v, const CallArgs& a) {
  Args args(a, "float()", {"default"});
  if (v.is_undefined()) fail_undefined(v);
  if (v.is_number()) return Value::number(v.as_double());
  if (v.is_string())
    if (auto d = parse_float(v.str())) return Value::number(*d);
  return args.get_or(0, Value::number(0.0));
}

Value f_int(const Value& v, const CallArgs& a) {
  Args args(a, "int()", {"default", "base"});
  if (v.is_undefined()) fail_undefined(v);
  const Value fallback = args.get_or(0, Value::integer(0));
  if (v.is_integral()) return Value::integer(v.as_int());
  auto from_double = [&](double d) {
    if (std::isnan(d) || std::isinf(d) || std::fabs(d) >= 9.2e18) return fallback;
    return Value::integer(static_cast<int64_t>(std::trunc(d)));
  };
  if (v.is_float()) return from_double(v.as_double());
  if (v.is_string()) {
    const Value base = args.get_or(1, Value::integer(10));
    if (auto i = parse_int(v.str(), static_cast<int>(base.as_int()))) return Value::integer(*i);
    if (auto d = parse_float(v.str())) return from_double(*d);
  }
  return fallback;
}

Value f_indent(const Value& v, const CallArgs& a) {
  Args args(a, "indent()", {"width", "first", "blank"});
  if (v.is_undefined()) fail_undefined(v);
  if (!v.is_string()) throw RuntimeError("unsupported operand type(s) for +=: '" + type_name(v) + "' and 'str'");
  const Value width = args.get_or(0, Value::integer(4));
  const std::string ind = width.is_string() ? width.str() : std::string(static_cast<size_t>(std::max<int64_t>(0, width.as_int())), ' ');
  const std::vector<std::string> lines = split_lines(to_str(v) + "\n");
  std::string rv;
  if (args.get_bool(2, false)) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else {
    rv = lines.empty() ? "" : lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
  }
  if (args.get_bool(1, false)) rv = ind + rv;
  return Value::string(std::move(rv));
}

Value f_items(const Value& v, const CallArgs& a) {
  Args(a, "items()", {});
  return Value::generator("generator", "do_items", [v]() {
    ValueList out;
    if (v.is_undefined()) return out;
    if (!v.is_dict()) throw RuntimeError("Can only get item pairs from a mapping.");
    for (const auto& [k, val] : v.dict().entries()) out.push_back(Value::tuple({Value::string(k), val}));
    return out;
  });
}

Value f_join(const Value& v, const CallArgs& a) {
  Args args(a, "join()", {"d", "attribute"});
  const std::string sep = to_str(args.get_or(0, Value::string("")));
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += to_str(args.get(1) && !args.get(1)->is_none() ? lookup_attribute(item, *args.get(1)) : item);
  }
  return Value::string(std::move(out));
}

Value f_list(const Value& v, const CallArgs& a) {
  Args(a, "list()", {});
  return Value::list(iterate(v));
}

Value f_lower(const Value& v, const CallArgs& a) {
  Args(a, "lower()", {});
  return Value::string(unicode::lower(to_str(v)));
}

Value f_upper(const Value& v, const CallArgs& a) {
  Args(a, "upper()", {});
  return Value::string(unicode::upper(to_str(v)));
}

Value f_map(const Value& v, const CallArgs& a) {
  return Value::generator("generator", "sync_do_map", [v, a]() {
    ValueList out;
    if (!truthy(v)) return out;
    if (a.pos.empty()) {
      Args args(a, "map()", {"attribute", "default"});
      if (!args.get(0)) throw RuntimeError("map requires a filter argument");
      for (const Value& item : iterate(v)) {
        Value r = lookup_attribute(item, *args.get(0));
        if (r.is_undefined() && args.get(1) && !args.get(1)->is_none()) r = *args.get(1);
        out.push_back(std::move(r));
      }
      return out;
    }
    const CallArgs rest{{a.pos.begin() + 1, a.pos.end()}, a.kw};
    for (const Value& item : iterate(v)) out.push_back(call_filter_by_name(a.pos[0], item, rest));
    return out;
  });
}

Value min_max(const Value& v, const CallArgs& a, bool want_max) {
  Args args(a, want_max ? "max()" : "min()", {"case_sensitive", "attribute"});
  const ValueList items = iterate(v);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  const bool cs = args.get_bool(0, false);
  size_t best = 0;
  Value best_key = sort_key(items[0], args.get(1), cs);
  for (size_t i = 1; i < items.size(); ++i) {
    Value k = sort_key(items[i], args.get(1), cs);
    if (want_max ? compare(best_key, k, "<") : compare(k, best_key, "<")) {
      best = i;
      best_key = std::move(k);
    }
  }
  return items[best];
}
Value f_max(const Value& v, const CallArgs& a) { return min_max(v, a, true); }
Value f_min(const Value& v, const CallArgs& a) { return min_max(v, a, false); }

ValueList select_items(const Value& v, const CallArgs& a, bool by_attr, bool keep_if) {
  if (!truthy(v)) return {};
  size_t off = 0;
  if (by_attr && a.pos.empty()) throw RuntimeError("Missing parameter for attribute name");
  if (by_attr) off = 1;
  const bool has_test = a.pos.size() > off;
  CallArgs rest;
  if (has_test) rest = CallArgs{{a.pos.begin() + static_cast<ptrdiff_t>(off) + 1, a.pos.end()}, a.kw};
  ValueList out;
  for (const Value& item : iterate(v)) {
    const Value x = by_attr ? lookup_attribute(item, a.pos[0]) : item;
    const bool ok = has_test ? call_test_by_name(a.pos[off], x, rest) : truthy(x);
    if (ok == keep_if) out.push_back(item);
  }
  return out;
}
Value select_impl(const Value& v, const CallArgs& a, bool by_attr, bool keep_if) {
  return Value::generator("generator", "select_or_reject",
                          [v, a, by_attr, keep_if]() { return select_items(v, a, by_attr, keep_if); });
}
Value f_select(const Value& v, const CallArgs& a) { return select_impl(v, a, false, true); }
Value f_reject(const Value& v, const CallArgs& a) { return select_impl(v, a, false, false); }
Value f_selectattr(const Value& v, const CallArgs& a) { return select_impl(v, a, true, true); }
Value f_rejectattr(const Value& v, const CallArgs& a) { return select_impl(v, a, true, false); }

Value f_replace(const Value& v, const CallArgs& a) {
  Args args(a, "replace()", {"old", "new", "count"});
  if (!args.get(0) || !args.get(1)) throw RuntimeError("replace() needs the old and new strings");
  CallArgs m{{Value::string(to_str(*args.get(0))), Value::string(to_str(*args.get(1)))}, {}};
  if (args.get(2) && !args.get(2)->is_none()) m.pos.push_back(*args.get(2));
  return get_attr(Value::string(to_str(v)), "replace").function().call(m);
}

Value f_reverse(const Value& v, const CallArgs& a) {
  Args(a, "reverse()", {});
  if (v.is_string()) {
    std::u32string u = unicode::to_u32(v.str());
    std::reverse(u.begin(), u.end());
    return Value::string(unicode::to_utf8(u));
  }
  if (v.is_sequence() || v.is_dict() || v.is_undefined()) {  // reversed(): a reverse iterator
    ValueList items = iterate(v);
    std::reverse(items.begin(), items.end());
    const std::string type = v.is_dict() ? "dict_reversekeyiterator" : v.is_undefined() ? "reversed"
                             : v.type() == Value::Type::List ? "list_reverseiterator" : "reversed";
    return Value::generator(type, "", [items = std::move(items)]() { return items; });
  }
  if (!v.is_generator()) throw RuntimeError("argument must be iterable");
  ValueList items = iterate(v);  // jinja2 falls back to list(value) and reverses it
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_round(const Value& v, const CallArgs& a) {
  Args args(a, "round()", {"precision", "method"});
  const int64_t precision = args.get_or(0, Value::integer(0)).as_int();
  const std::string method = to_str(args.get_or(1, Value::string("common")));
  if (method != "common" && method != "ceil" && method != "floor")
    throw RuntimeError("method must be common, ceil or floor");
  if (!v.is_number()) throw RuntimeError("type " + type_name(v) + " doesn't define __round__ method");
  if (method == "common") {
    if (v.is_integral() && precision >= 0) return Value::integer(v.as_int());
    const double x = v.as_double();
    if (precision >= 0 && precision < 300) {
      char buf[512];
      std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(precision), x);
      return Value::number(std::strtod(buf, nullptr));
    }
    const double p = std::pow(10.0, static_cast<double>(-precision));
    const double r = std::nearbyint(x / p) * p;
    return v.is_integral() ? Value::integer(static_cast<int64_t>(r)) : Value::number(r);
  }
  const double p = std::pow(10.0, static_cast<double>(precision));
  const double x = v.as_double() * p;
  return Value::number((method == "ceil" ? std::ceil(x) : std::floor(x)) / p);
}

Value f_safe(const Value& v, const CallArgs& a) {
  Args(a, "safe()", {});
  return Value::string(to_str(v));
}

Value f_sort(const Value& v, const CallArgs& a) {
  Args args(a, "sort()", {"reverse", "case_sensitive", "attribute"});
  const bool cs = args.get_bool(1, false);
  const Value* attr = args.get(2);
  return Value::list(sorted(iterate(v), args.get_bool(0, false), [&](const Value& x, const Value& y) {
    return compare(sort_key(x, attr, cs), sort_key(y, attr, cs), "<");
  }));
}

Value f_string(const Value& v, const CallArgs& a) {
  Args(a, "string()", {});
  return Value::string(to_str(v));
}

Value f_sum(const Value& v, const CallArgs& a) {
  Args args(a, "sum()", {"attribute", "start"});
  Value total = args.get_or(1, Value::integer(0));
  for (const Value& item : iterate(v))
    total = binary_op("+", total, args.get(0) && !args.get(0)->is_none() ? lookup_attribute(item, *args.get(0)) : item);
  return total;
}

Value f_title(const Value& v, const CallArgs& a) {
  Args(a, "title()", {});
  const std::u32string u = unicode::to_u32(to_str(v));
  auto delim = [](char32_t c) { return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || unicode::is_space(c); };
  std::string out;
  for (size_t i = 0; i < u.size();) {
    size_t j = i;
    const bool d = delim(u[i]);
    while (j < u.size() && delim(u[j]) == d) ++j;
    out += unicode::upper(unicode::to_utf8(u.substr(i, 1)));
    out += unicode::lower(unicode::to_utf8(u.substr(i + 1, j - i - 1)));
    i = j;
  }
  return Value::string(std::move(out));
}

Value f_tojson(const Value& v, const CallArgs& a) {
  Args args(a, "tojson()", {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonDumpOptions o;
  o.ensure_ascii = args.get_bool(0, false);
  if (const Value* ind = args.get(1); ind && !ind->is_none()) {
    o.has_indent = true;
    if (ind->is_string()) o.indent = ind->str();
    else if (ind->is_integral()) o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, ind->as_int())), ' ');
    else throw RuntimeError("tojson() indent must be an integer or a string");
  }
  if (const Value* sep = args.get(2); sep && !sep->is_none()) {
    if (!sep->is_sequence() || sep->items().size() != 2 || !sep->items()[0].is_string() || !sep->items()[1].is_string())
      throw RuntimeError("tojson() separators must be a pair of strings");
    o.has_separators = true;
    o.item_separator = sep->items()[0].str();
    o.key_separator = sep->items()[1].str();
  }
  o.sort_keys = args.get_bool(3, false);
  return Value::string(to_json(v, o));
}

Value f_trim(const Value& v, const CallArgs& a) {
  Args args(a, "trim()", {"chars"});
  return Value::string(py_strip(to_str(v), args.get_or(0, Value::none()), true, true));
}

Value f_unique(const Value& v, const CallArgs& a) {
  Args args(a, "unique()", {"case_sensitive", "attribute"});
  const bool cs = args.get_bool(0, false);
  const Value attribute = args.get_or(1, Value::none());
  return Value::generator("generator", "sync_do_unique", [v, cs, attribute]() {
    ValueList out, seen;
    for (const Value& item : iterate(v)) {
      Value k = sort_key(item, &attribute, cs);
      if (k.type() == Value::Type::List || k.is_dict() || k.is_namespace() || k.is_generator())
        throw RuntimeError("unhashable type: '" + type_name(k) + "'");
      if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, k); })) continue;
      seen.push_back(std::move(k));
      out.push_back(item);
    }
    return out;
  });
}

Value f_wordcount(const Value& v, const CallArgs& a) {
  Args(a, "wordcount()", {});
  int64_t n = 0;
  bool in_word = false;
  const std::string s = to_str(v);
  for (size_t i = 0; i < s.size();) {
    const char32_t c = unicode::decode(s, i);
    const bool w = c == '_' || unicode::is_alpha(c) || unicode::is_digit(c);
    if (w && !in_word) ++n;
    in_word = w;
  }
  return Value::integer(n);
}

// --- tests ---

bool no_args(const CallArgs& a, const char* what) {
  Args(a, what, {});
  return true;
}
const Value& one_arg(const CallArgs& a, const char* what) {
  if (a.pos.size() + a.kw.size() != 1) throw RuntimeError(std::string(what) + " takes exactly one argument");
  return a.pos.empty() ? a.kw[0].second : a.pos[0];
}

bool t_defined(const Value& v, const CallArgs& a) { return no_args(a, "defined") && !v.is_undefined(); }
bool t_undefined(const Value& v, const CallArgs& a) { return no_args(a, "undefined") && v.is_undefined(); }
bool t_none(const Value& v, const CallArgs& a) { return no_args(a, "none") && v.is_none(); }
bool t_boolean(const Value& v, const CallArgs& a) { return no_args(a, "boolean") && v.is_bool(); }
bool t_true(const Value& v, const CallArgs& a) { return no_args(a, "true") && v.is_bool() && v.as_bool(); }
bool t_false(const Value& v, const CallArgs& a) { return no_args(a, "false") && v.is_bool() && !v.as_bool(); }
bool t_integer(const Value& v, const CallArgs& a) { return no_args(a, "integer") && v.is_int(); }
bool t_float(const Value& v, const CallArgs& a) { return no_args(a, "float") && v.is_float(); }
bool t_number(const Value& v, const CallArgs& a) { return no_args(a, "number") && v.is_number(); }
bool t_string(const Value& v, const CallArgs& a) { return no_args(a, "string") && v.is_string(); }
bool t_mapping(const Value& v, const CallArgs& a) { return no_args(a, "mapping") && v.is_dict(); }
bool t_iterable(const Value& v, const CallArgs& a) {
  return no_args(a, "iterable") &&
         (v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict() || v.is_loop() || v.is_generator());
}
bool t_sequence(const Value& v, const CallArgs& a) {
  return no_args(a, "sequence") && (v.is_undefined() || v.is_string() || v.is_sequence() || v.is_dict());
}
bool t_callable(const Value& v, const CallArgs& a) { return no_args(a, "callable") && (v.is_function() || v.is_undefined()); }
bool t_escaped(const Value&, const CallArgs& a) { return !no_args(a, "escaped"); }
bool t_sameas(const Value& v, const CallArgs& a) { return v.same_object(one_arg(a, "sameas")); }
bool t_eq(const Value& v, const CallArgs& a) { return equals(v, one_arg(a, "eq")); }
bool t_ne(const Value& v, const CallArgs& a) { return !equals(v, one_arg(a, "ne")); }
bool t_lt(const Value& v, const CallArgs& a) { return compare(v, one_arg(a, "lt"), "<"); }
bool t_le(const Value& v, const CallArgs& a) { return compare(v, one_arg(a, "le"), "<="); }
bool t_gt(const Value& v, const CallArgs& a) { return compare(v, one_arg(a, "gt"), ">"); }
bool t_ge(const Value& v, const CallArgs& a) { return compare(v, one_arg(a, "ge"), ">="); }
bool t_in(const Value& v, const CallArgs& a) { return contains(one_arg(a, "in"), v); }
bool t_odd(const Value& v, const CallArgs& a) {
  return no_args(a, "odd") && equals(binary_op("%", v, Value::integer(2)), Value::integer(1));
}
bool t_even(const Value& v, const CallArgs& a) {
  return no_args(a, "even") && equals(binary_op("%", v, Value::integer(2)), Value::integer(0));
}
bool t_divisibleby(const Value& v, const CallArgs& a) {
  return equals(binary_op("%", v, one_arg(a, "divisibleby")), Value::integer(0));
}
bool t_lower(const Value& v, const CallArgs& a) {
  return no_args(a, "lower") && truthy(get_attr(Value::string(to_str(v)), "islower").function().call({}));
}
bool t_upper(const Value& v, const CallArgs& a) {
  return no_args(a, "upper") && truthy(get_attr(Value::string(to_str(v)), "isupper").function().call({}));
}
bool t_filter(const Value& v, const CallArgs& a) { return no_args(a, "filter") && v.is_string() && find_filter(v.str()); }
bool t_test(const Value& v, const CallArgs& a) { return no_args(a, "test") && v.is_string() && find_test(v.str()); }

struct FilterEntry {
  std::string_view name;
  FilterFn fn;
};
struct TestEntry {
  std::string_view name;
  TestFn fn;
};

constexpr FilterEntry kFilters[] = {
    {"abs", f_abs},         {"attr", f_attr},         {"capitalize", f_capitalize}, {"count", f_length},
    {"d", f_default},       {"default", f_default},   {"dictsort", f_dictsort},     {"e", f_escape},
    {"escape", f_escape},   {"first", f_first},       {"float", f_float},           {"forceescape", f_escape},
    {"indent", f_indent},   {"int", f_int},           {"items", f_items},           {"join", f_join},
    {"last", f_last},       {"length", f_length},     {"list", f_list},             {"lower", f_lower},
    {"map", f_map},         {"max", f_max},           {"min", f_min},               {"reject", f_reject},
    {"rejectattr", f_rejectattr}, {"replace", f_replace}, {"reverse", f_reverse},   {"round", f_round},
    {"safe", f_safe},       {"select", f_select},     {"selectattr", f_selectattr}, {"sort", f_sort},
    {"string", f_string},   {"sum", f_sum},           {"title", f_title},           {"tojson", f_tojson},
    {"trim", f_trim},       {"unique", f_unique},     {"upper", f_upper},           {"wordcount", f_wordcount},
};

constexpr TestEntry kTests[] = {
    {"boolean", t_boolean}, {"callable", t_callable}, {"defined", t_defined},   {"divisibleby", t_divisibleby},
    {"eq", t_eq},           {"equalto", t_eq},        {"==", t_eq},             {"escaped", t_escaped},
    {"even", t_even},       {"false", t_false},       {"filter", t_filter},     {"float", t_float},
    {"ge", t_ge},           {">=", t_ge},             {"gt", t_gt},             {"greaterthan", t_gt},
    {">", t_gt},            {"in", t_in},             {"integer", t_integer},   {"iterable", t_iterable},
    {"le", t_le},           {"<=", t_le},             {"lessthan", t_lt},       {"lower", t_lower},
    {"lt", t_lt},           {"<", t_lt},              {"mapping", t_mapping},   {"ne", t_ne},
    {"!=", t_ne},           {"none", t_none},         {"number", t_number},     {"odd", t_odd},
    {"sameas", t_sameas},   {"sequence", t_sequence}, {"string", t_string},     {"test", t_test},
    {"true", t_true},       {"undefined", t_undefined}, {"upper", t_upper},
};

}  // namespace

FilterFn find_filter(std::string_view name) {
  for (const auto& f : kFilters)
    if (f.name == name) return f.fn;
  return nullptr;
}

TestFn find_test(std::string_view name) {
  for (const auto& t : kTests)
    if (t.name == name) return t.fn;
  return nullptr;
}

bool is_unsupported_jinja_filter(std::string_view name) {
  static constexpr std::string_view names[] = {
      "batch", "center", "filesizeformat", "format", "groupby", "pprint", "random", "slice", "striptags",
      "truncate", "urlencode", "urlize", "wordwrap", "xmlattr"};
  return std::find(std::begin(names), std::end(names), name) != std::end(names);
}

}  // namespace kvlm::jinja

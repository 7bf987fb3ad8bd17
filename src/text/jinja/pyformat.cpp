// Python's printf-style string formatting, `"..." % args`, for the string `%` operator.
#include <cstdio>

#include "text/jinja/ops.h"
#include "text/jinja/unicode.h"

namespace kvlm::jinja {
namespace {

bool is_mapping_like(const Value& v) {  // PyMapping_Check: has __getitem__, not a tuple or str
  return v.is_dict() || v.type() == Value::Type::List || v.is_undefined();
}

std::string pad(std::string s, int64_t width, bool left) {
  const auto n = static_cast<int64_t>(unicode::length(s));
  if (width <= n) return s;
  const std::string fill(static_cast<size_t>(width - n), ' ');
  return left ? s + fill : fill + s;
}

}  // namespace

std::string percent_format(std::string_view fmt, const Value& args) {
  ValueList positional;
  const Value* mapping = nullptr;
  if (args.type() == Value::Type::Tuple) {
    positional = args.items();
  } else {
    positional.push_back(args);
    if (is_mapping_like(args)) mapping = &args;
  }
  size_t next = 0;
  auto take = [&]() -> const Value& {
    if (next >= positional.size()) throw RuntimeError("not enough arguments for format string");
    return positional[next++];
  };
  std::string out;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out.push_back(fmt[i]);
      continue;
    }
    if (++i >= fmt.size()) throw RuntimeError("incomplete format");
    const Value* arg = nullptr;
    Value keyed;
    if (fmt[i] == '(') {
      const size_t close = fmt.find(')', i);
      if (close == std::string_view::npos) throw RuntimeError("incomplete format key");
      if (!mapping || !mapping->is_dict()) throw RuntimeError("format requires a mapping");
      const std::string key(fmt.substr(i + 1, close - i - 1));
      const Value* v = mapping->dict().find(key);
      if (!v) throw RuntimeError(py_str_repr(key));
      keyed = *v;
      arg = &keyed;
      i = close + 1;
    }
    std::string flags;
    while (i < fmt.size() && std::string_view("-+ #0").find(fmt[i]) != std::string_view::npos) flags.push_back(fmt[i++]);
    auto number = [&](int64_t fallback) {
      if (i < fmt.size() && fmt[i] == '*') {
        ++i;
        const Value& w = take();
        if (!w.is_integral()) throw RuntimeError("* wants int");
        return w.as_int();
      }
      int64_t v = 0;
      bool any = false;
      while (i < fmt.size() && fmt[i] >= '0' && fmt[i] <= '9') v = v * 10 + (fmt[i++] - '0'), any = true;
      return any ? v : fallback;
    };
    const int64_t width = number(-1);
    int64_t precision = -1;
    if (i < fmt.size() && fmt[i] == '.') {
      ++i;
      precision = number(0);
    }
    while (i < fmt.size() && (fmt[i] == 'h' || fmt[i] == 'l' || fmt[i] == 'L')) ++i;
    if (i >= fmt.size()) throw RuntimeError("incomplete format");
    const char conv = fmt[i];
    if (conv == '%') {
      out.push_back('%');
      continue;
    }
    const Value& v = arg ? *arg : take();
    const bool left = flags.find('-') != std::string::npos;
    switch (conv) {
      case 's':
      case 'r':
      case 'a': {
        std::string s = conv == 's' ? to_str(v) : repr(v);
        if (precision >= 0) {
          std::u32string u = unicode::to_u32(s);
          if (static_cast<int64_t>(u.size()) > precision) s = unicode::to_utf8(u.substr(0, static_cast<size_t>(precision)));
        }
        out += pad(std::move(s), width, left);
        break;
      }
      case 'c': {
        std::string s;
        if (v.is_string() && unicode::length(v.str()) == 1) s = v.str();
        else if (v.is_integral() && v.as_int() >= 0 && v.as_int() <= 0x10FFFF) unicode::append(s, static_cast<char32_t>(v.as_int()));
        else throw RuntimeError("%c requires an int or a unicode character, not " + type_name(v));
        out += pad(std::move(s), width, left);
        break;
      }
      case 'd': case 'i': case 'u': case 'o': case 'x': case 'X': case 'e': case 'E': case 'f': case 'F':
      case 'g': case 'G': {
        const bool integral_conv = std::string_view("diuoxX").find(conv) != std::string_view::npos;
        const bool needs_int = conv == 'o' || conv == 'x' || conv == 'X';
        if (!v.is_number() || (needs_int && v.is_float())) {
          if (v.is_undefined()) fail_undefined(v);
          throw RuntimeError(std::string("%") + conv + " format: " + (needs_int ? "an integer" : "a real number") +
                             " is required, not " + type_name(v));
        }
        std::string spec = "%" + flags;
        if (width >= 0) spec += std::to_string(width);
        if (precision >= 0) spec += "." + std::to_string(precision);
        char buf[512];
        if (integral_conv) {
          const long long x = v.is_float() ? static_cast<long long>(v.as_double()) : static_cast<long long>(v.as_int());
          const char c = conv == 'i' || conv == 'u' ? 'd' : conv;
          std::snprintf(buf, sizeof buf, (spec + "ll" + c).c_str(), x);
          std::string s = buf;
          if (conv == 'o' && flags.find('#') != std::string::npos) {  // Python writes 0o17, C 017
            const size_t z = s.find('0');
            if (z != std::string::npos) s.insert(z + 1, "o");
          }
          out += s;
        } else {
          std::snprintf(buf, sizeof buf, (spec + conv).c_str(), v.as_double());
          out += buf;
        }
        break;
      }
      default: throw RuntimeError(std::string("unsupported format character '") + conv + "'");
    }
  }
  if (next < positional.size() && !mapping) throw RuntimeError("not all arguments converted during string formatting");
  return out;
}

}  // namespace kvlm::jinja

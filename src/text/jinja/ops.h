// Python operators and attribute access as jinja2's sandboxed environment performs them:
// arithmetic, `in`, `x.attr` / `x[key]` / slices, and the methods templates call on
// strings (split, strip, startswith, ...), dicts (get, items, keys, values) and lists.
#pragma once

#include <string_view>

#include "text/jinja/value.h"

namespace kvlm::jinja {

// a op b for op in + - * / // % **.
Value binary_op(std::string_view op, const Value& a, const Value& b);
Value negate(const Value& v);
Value unary_plus(const Value& v);
// Python's `item in container`.
bool contains(const Value& container, const Value& item);

// jinja2's `obj.name`: a method for method names, else the dict item / namespace or loop
// attribute, else an undefined value that says what was missing.
Value get_attr(const Value& obj, std::string_view name);
// jinja2's `obj[key]`: the item, else the attribute named key, else undefined.
Value get_item(const Value& obj, const Value& key);
// obj[start:stop:step]; an undefined or None bound is omitted.
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Python's printf-style `fmt % args` (a tuple of arguments, a mapping for %(key)s, or one value).
std::string percent_format(std::string_view fmt, const Value& args);

// Python's str.strip/lstrip/rstrip (chars empty-optional = whitespace).
std::string py_strip(std::string_view s, const Value& chars, bool left, bool right);

}  // namespace kvlm::jinja

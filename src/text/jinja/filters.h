// jinja2's built-in filters and tests, as jinja2 3.1 defines them, with transformers'
// tojson (json.dumps(x, ensure_ascii=False, indent=, separators=, sort_keys=)) in place
// of jinja2's HTML-safe one.
//
// Filters: abs attr capitalize count d default dictsort e escape first float forceescape
// indent int items join last length list lower map max min reject rejectattr replace
// reverse round safe select selectattr sort string sum title tojson trim unique upper
// wordcount. Tests: boolean callable defined divisibleby eq equalto escaped even false
// filter float ge gt greaterthan in integer iterable le lessthan lower lt mapping ne none
// number odd sameas sequence string test true undefined upper, and == != < <= > >=.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja/ast.h"

namespace kvlm::jinja {

FilterFn find_filter(std::string_view name);  // nullptr when kvlm has no such filter
TestFn find_test(std::string_view name);
// A jinja2 built-in filter that kvlm does not implement (for a precise error message).
bool is_unsupported_jinja_filter(std::string_view name);

// Binds call arguments to a Python-style signature, with Python's errors for too many
// positional arguments and unknown or repeated keywords.
class Args {
 public:
  Args(const CallArgs& args, std::string what, std::initializer_list<std::string_view> names);
  const Value* get(size_t i) const { return slots_[i]; }  // nullptr when not passed
  Value get_or(size_t i, Value fallback) const { return slots_[i] ? *slots_[i] : std::move(fallback); }
  bool get_bool(size_t i, bool fallback) const;
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  std::vector<const Value*> slots_;
};

}  // namespace kvlm::jinja

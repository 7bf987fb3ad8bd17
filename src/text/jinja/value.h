// Runtime values of the template interpreter, with Python's semantics: what jinja2 does
// with a value is what CPython does with the equivalent object (str(), repr(), ==, <,
// truthiness, len(), iteration, json.dumps). Integers are 64-bit (Python's are unbounded:
// an overflow is an error here rather than a silently different number).
//
// Lists, tuples and dicts are immutable once built and shared between copies (transformers
// renders with jinja2's ImmutableSandboxedEnvironment, which forbids mutating them too);
// a namespace() is the one mutable container.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvlm::jinja {

// An error found while rendering, before the interpreter has attached the template name and
// the line:column of the expression that failed.
class RuntimeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Value;
using ValueList = std::vector<Value>;

class ValueDict;
struct CallArgs;
struct Function;
struct GeneratorState;
struct LoopInfo;

class Value {
 public:
  enum class Type : uint8_t { Undefined, None, Bool, Int, Float, String, List, Tuple, Dict, Namespace, Function, Loop,
                              Generator };

  Value() = default;  // undefined
  static Value undefined(std::string message);  // `message` is what using it reports
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double d);
  static Value string(std::string s);
  static Value list(ValueList items);
  static Value tuple(ValueList items);
  static Value dict(ValueDict d);
  static Value make_namespace(ValueDict d);
  static Value function(std::string name, std::function<Value(const CallArgs&)> fn);
  static Value loop(LoopInfo info);
  static Value generator(std::string type, std::string name, std::function<ValueList()> produce);

  Type type() const { return type_; }
  bool is_undefined() const { return type_ == Type::Undefined; }
  bool is_none() const { return type_ == Type::None; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_int() const { return type_ == Type::Int; }
  bool is_float() const { return type_ == Type::Float; }
  bool is_number() const { return type_ == Type::Int || type_ == Type::Float || type_ == Type::Bool; }
  bool is_integral() const { return type_ == Type::Int || type_ == Type::Bool; }  // Python int (bool included)
  bool is_string() const { return type_ == Type::String; }
  bool is_sequence() const { return type_ == Type::List || type_ == Type::Tuple; }
  bool is_dict() const { return type_ == Type::Dict; }
  bool is_namespace() const { return type_ == Type::Namespace; }
  bool is_function() const { return type_ == Type::Function; }
  bool is_loop() const { return type_ == Type::Loop; }
  bool is_generator() const { return type_ == Type::Generator; }

  bool as_bool() const { return b_; }
  int64_t as_int() const { return type_ == Type::Bool ? int64_t{b_} : i_; }  // Int or Bool
  double as_double() const;                                                 // any number
  const std::string& str() const { return s_; }                            // String; undefined's message
  const ValueList& items() const { return *list_; }                         // List or Tuple
  const std::shared_ptr<const ValueList>& items_ptr() const { return list_; }
  const ValueDict& dict() const { return *dict_; }                         // Dict or Namespace
  ValueDict& namespace_dict() const { return *dict_; }                      // Namespace: shared, mutable
  const Function& function() const { return *fn_; }
  const LoopInfo& loop() const { return *loop_; }
  GeneratorState& generator_state() const { return *gen_; }

  bool same_object(const Value& other) const;  // Python's `is` for containers and functions

 private:
  Type type_ = Type::Undefined;
  bool b_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  std::string s_;
  std::shared_ptr<const ValueList> list_;
  std::shared_ptr<ValueDict> dict_;
  std::shared_ptr<const Function> fn_;
  std::shared_ptr<const LoopInfo> loop_;
  std::shared_ptr<GeneratorState> gen_;
};

// A dict with insertion order and string keys (every dict a chat template sees comes from
// JSON or from a literal with string keys).
class ValueDict {
 public:
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  void set(std::string key, Value value);
  size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }
  void clear() { entries_.clear(); }

 private:
  std::vector<std::pair<std::string, Value>> entries_;
};

// Positional and keyword arguments of a call, a filter or a test.
struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};

struct Function {
  std::string name;  // for messages: "range", "macro 'm'", "str.split"
  std::function<Value(const CallArgs&)> call;
};

// A Python generator or iterator: what jinja2's map, select, reject, selectattr, rejectattr,
// unique and items filters (generators) and reverse (reverse iterators) return. Lazy (errors
// surface when it is consumed), single use, always truthy, without len().
struct GeneratorState {
  std::string type;  // Python's type name: "generator", "list_reverseiterator", ...
  std::string name;  // for generators, the function: "sync_do_map", "select_or_reject", ...
  std::function<ValueList()> produce;
  bool consumed = false;
};

// The `loop` variable of a for loop.
struct LoopInfo {
  int64_t index0 = 0;
  int64_t depth0 = 0;
  std::shared_ptr<const ValueList> items;  // the (filtered) sequence being iterated
};

// Using an undefined value other than printing, testing or iterating it: jinja2's
// UndefinedError, e.g. "'dict object' has no attribute 'content'".
[[noreturn]] void fail_undefined(const Value& v);

bool truthy(const Value& v);
std::string to_str(const Value& v);  // Python str(); undefined -> ""
std::string repr(const Value& v);    // Python repr()
std::string py_str_repr(std::string_view s);
std::string float_repr(double d);    // Python repr(float): shortest round trip, "1e-05", "2.0"
std::string type_name(const Value& v);         // Python's type name: int, str, dict, NoneType...
std::string object_type_repr(const Value& v);  // jinja2's: "dict object", "None"...

bool equals(const Value& a, const Value& b);  // Python ==
// Python a < b (op is "<", "<=", ">", ">=" for the message); throws for unorderable types.
bool compare(const Value& a, const Value& b, std::string_view op);

int64_t py_len(const Value& v);  // len(); undefined -> 0
// Materializes iter(v): items of a list/tuple, keys of a dict, code points of a string,
// nothing for undefined, what is left of a generator (consuming it). Throws for values
// Python cannot iterate.
ValueList iterate(const Value& v);

Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);

// Python's json.dumps(v, ensure_ascii=..., indent=..., separators=..., sort_keys=...).
struct JsonDumpOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // when has_indent
  bool has_separators = false;
  std::string item_separator, key_separator;  // when has_separators
  bool sort_keys = false;
};
std::string to_json(const Value& v, const JsonDumpOptions& options);

}  // namespace kvlm::jinja

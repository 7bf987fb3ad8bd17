#include "text/jinja/render.h"

#include <chrono>
#include <cstdio>
#include <memory>
#include <unordered_map>

#include "core/error.h"
#include "text/jinja/filters.h"
#include "text/jinja/ops.h"

namespace kvlm::jinja {
namespace {

constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox refuses larger range() calls
constexpr int kMaxCallDepth = 256;

enum class Flow { Normal, Break, Continue };

struct Scope {
  std::unordered_map<std::string, Value> vars;
  std::shared_ptr<Scope> parent;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get()) {
      const auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};
using ScopePtr = std::shared_ptr<Scope>;

// A new frame: `start_undefined` are the names jinja2 resolves to undefined on entry
// (see scoping.h).
ScopePtr child_of(const ScopePtr& parent, const std::vector<std::string>& start_undefined = {}) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  for (const std::string& n : start_undefined) s->vars[n] = Value::undefined(py_str_repr(n) + " is undefined");
  return s;
}

std::string strftime_now(const RenderOptions& options, const std::string& fmt) {
  std::tm tm{};
  long micros = 0;
  if (options.now) {
    tm = *options.now;
  } else {
    const auto now = std::chrono::system_clock::now();
    const std::time_t t = std::chrono::system_clock::to_time_t(now);
    localtime_r(&t, &tm);
    micros = static_cast<long>(
        std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000);
  }
  // Python's datetime.strftime handles %f itself; everything else is the C library's.
  std::string f;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] == '%' && i + 1 < fmt.size() && fmt[i + 1] == 'f') {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%06ld", micros);
      f += buf;
      ++i;
    } else if (fmt[i] == '%' && i + 1 < fmt.size()) {
      f += fmt.substr(i, 2);
      ++i;
    } else {
      f.push_back(fmt[i]);
    }
  }
  if (f.empty()) return "";
  for (size_t size = 256; size <= (1u << 20); size *= 4) {
    std::string out(size, '\0');
    const size_t n = std::strftime(out.data(), out.size(), f.c_str(), &tm);
    if (n > 0) {
      out.resize(n);
      return out;
    }
  }
  return "";
}

class Interpreter {
 public:
  Interpreter(const Template& tpl, const RenderOptions& options) : tpl_(tpl), options_(options) {}

  // Macros hold their defining scope, which holds them, and a namespace may hold itself:
  // reference cycles, broken here when the render ends (however it ends).
  ~Interpreter() {
    for (const ScopePtr& s : macro_scopes_) s->vars.clear();
    for (const Value& ns : namespaces_) ns.namespace_dict().clear();
  }

  std::string run(const Value& context) {
    auto globals = std::make_shared<Scope>();
    add_globals(*globals);
    auto top = child_of(globals);
    if (!context.is_dict()) throw Error(tpl_.name + ": the context must be a JSON object");
    for (const auto& [k, v] : context.dict().entries()) top->vars[k] = v;
    for (const std::string& n : tpl_.start_undefined) top->vars[n] = Value::undefined(py_str_repr(n) + " is undefined");
    std::string out;
    exec(tpl_.body, top, out);
    return out;
  }

 private:
  [[noreturn]] void fail(Loc l, const std::string& msg) const {
    throw Error(tpl_.name + ":" + std::to_string(l.line) + ":" + std::to_string(l.col) + ": " + msg);
  }

  void add_globals(Scope& g) {
    g.vars["range"] = Value::function("range", [](const CallArgs& a) -> Value {
      if (!a.kw.empty()) throw RuntimeError("range() takes no keyword arguments");
      if (a.pos.empty() || a.pos.size() > 3) throw RuntimeError("range expected 1 to 3 arguments, got " + std::to_string(a.pos.size()));
      for (const Value& v : a.pos)
        if (!v.is_integral()) throw RuntimeError("'" + type_name(v) + "' object cannot be interpreted as an integer");
      const int64_t start = a.pos.size() > 1 ? a.pos[0].as_int() : 0;
      const int64_t stop = a.pos.size() > 1 ? a.pos[1].as_int() : a.pos[0].as_int();
      const int64_t step = a.pos.size() > 2 ? a.pos[2].as_int() : 1;
      if (step == 0) throw RuntimeError("range() arg 3 must not be zero");
      ValueList out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
        if (static_cast<int64_t>(out.size()) >= kMaxRange)
          throw RuntimeError("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        out.push_back(Value::integer(i));
        if (__builtin_add_overflow(i, step, &i)) break;
      }
      return Value::list(std::move(out));
    });
    auto make_dict = [](const CallArgs& a, const char* what) {
      if (a.pos.size() > 1) throw RuntimeError(std::string(what) + " expected at most 1 positional argument");
      ValueDict d;
      if (!a.pos.empty()) {
        const Value& src = a.pos[0];
        if (src.is_undefined()) fail_undefined(src);  // dict() looks up .keys first
        if (src.is_dict() || src.is_namespace()) {
          for (const auto& [k, v] : src.dict().entries()) d.set(k, v);
        } else {
          for (const Value& pair : iterate(src)) {
            if (!pair.is_sequence() || pair.items().size() != 2 || !pair.items()[0].is_string())
              throw RuntimeError(std::string(what) + " needs a mapping or (key, value) pairs with string keys");
            d.set(pair.items()[0].str(), pair.items()[1]);
          }
        }
      }
      for (const auto& [k, v] : a.kw) d.set(k, v);
      return d;
    };
    g.vars["namespace"] = Value::function("namespace", [this, make_dict](const CallArgs& a) {
      Value ns = Value::make_namespace(make_dict(a, "namespace()"));
      namespaces_.push_back(ns);
      return ns;
    });
    g.vars["dict"] = Value::function("dict", [make_dict](const CallArgs& a) { return Value::dict(make_dict(a, "dict()")); });
    g.vars["joiner"] = Value::function("joiner", [](const CallArgs& a) {
      Args args(a, "joiner()", {"sep"});
      const std::string sep = to_str(args.get_or(0, Value::string(", ")));
      auto used = std::make_shared<bool>(false);
      return Value::function("joiner", [sep, used](const CallArgs&) {
        const bool first = !*used;
        *used = true;
        return Value::string(first ? "" : sep);
      });
    });
    const std::string name = tpl_.name;
    g.vars["raise_exception"] = Value::function("raise_exception", [name](const CallArgs& a) -> Value {
      Args args(a, "raise_exception()", {"message"});
      throw Error(name + ": " + to_str(args.get_or(0, Value::string(""))));
    });
    const RenderOptions options = options_;
    g.vars["strftime_now"] = Value::function("strftime_now", [options](const CallArgs& a) {
      Args args(a, "strftime_now()", {"format"});
      if (!args.get(0) || !args.get(0)->is_string()) throw RuntimeError("strftime_now() needs a format string");
      return Value::string(strftime_now(options, args.get(0)->str()));
    });
  }

  // --- statements ---

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const StmtPtr& s : body) {
      const Flow f = exec_stmt(*s, scope, out);
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  void spend() {
    if (++steps_ > options_.max_steps)
      throw RuntimeError("the template ran more than " + std::to_string(options_.max_steps) +
                         " steps (a loop that does not end?); rendering stopped");
  }

  Flow exec_stmt(const Stmt& s, const ScopePtr& scope, std::string& out) {
    try {
      spend();
      if (out.size() > options_.max_output_bytes)
        throw RuntimeError("the template wrote more than " + std::to_string(options_.max_output_bytes >> 20) +
                           " MiB; rendering stopped");
      return exec_stmt_impl(s, scope, out);
    } catch (const RuntimeError& e) {
      fail(s.loc, e.what());
    }
  }

  void set_attribute(const std::string& ns_name, const std::string& attr, const Scope& scope, Value v) {
    const Value* ns = scope.find(ns_name);
    if (!ns || !ns->is_namespace()) throw RuntimeError("cannot assign attribute on non-namespace object");
    ns->namespace_dict().set(attr, std::move(v));
  }

  // Assigns to names, or to "ns.attr" targets of a tuple assignment.
  void assign(const std::vector<std::string>& targets, const Value& v, Scope& scope) {
    auto store = [&](const std::string& t, const Value& x) {
      const size_t dot = t.find('.');
      if (dot == std::string::npos) scope.vars[t] = x;
      else set_attribute(t.substr(0, dot), t.substr(dot + 1), scope, x);
    };
    if (targets.size() == 1) {
      store(targets[0], v);
      return;
    }
    const ValueList items = iterate(v);
    if (items.size() > targets.size())
      throw RuntimeError("too many values to unpack (expected " + std::to_string(targets.size()) + ")");
    if (items.size() < targets.size())
      throw RuntimeError("not enough values to unpack (expected " + std::to_string(targets.size()) + ", got " +
                         std::to_string(items.size()) + ")");
    for (size_t i = 0; i < targets.size(); ++i) store(targets[i], items[i]);
  }

  Flow exec_stmt_impl(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.kind) {
      case StmtKind::Data: out += s.text; return Flow::Normal;
      case StmtKind::Output: out += to_str(eval(*s.expr, scope)); return Flow::Normal;
      case StmtKind::If:
        for (const IfBranch& b : s.branches)
          if (!b.cond || truthy(eval(*b.cond, scope))) return exec(b.body, scope, out);
        return Flow::Normal;
      case StmtKind::For: exec_for(s, scope, out); return Flow::Normal;
      case StmtKind::Set: assign(s.targets, eval(*s.expr, scope), *scope); return Flow::Normal;
      case StmtKind::SetAttr: set_attribute(s.targets[0], s.text, *scope, eval(*s.expr, scope)); return Flow::Normal;
      case StmtKind::SetBlock: {  // a {% break %} inside leaves the loop before the assignment
        std::string captured;
        if (const Flow f = exec(s.body, child_of(scope, s.frame_undefined), captured); f != Flow::Normal) return f;
        Value v = Value::string(std::move(captured));
        if (s.expr) v = apply_filters(*s.expr, std::move(v), scope);
        if (s.text.empty()) assign(s.targets, v, *scope);
        else set_attribute(s.targets[0], s.text, *scope, std::move(v));
        return Flow::Normal;
      }
      case StmtKind::Macro:
        scope->vars[s.text] = make_macro(s, scope);
        macro_scopes_.push_back(scope);
        return Flow::Normal;
      case StmtKind::Break: return Flow::Break;
      case StmtKind::Continue: return Flow::Continue;
      case StmtKind::FilterBlock: {
        std::string captured;
        if (const Flow f = exec(s.body, child_of(scope, s.frame_undefined), captured); f != Flow::Normal) return f;
        out += to_str(apply_filters(*s.expr, Value::string(std::move(captured)), scope));
        return Flow::Normal;
      }
      case StmtKind::With: {
        auto inner = child_of(scope, s.frame_undefined);
        for (const auto& [name, expr] : s.assigns) inner->vars[name] = eval(*expr, scope);
        return exec(s.body, inner, out);
      }
      case StmtKind::Scope: return exec(s.body, child_of(scope, s.frame_undefined), out);
    }
    return Flow::Normal;
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    ValueList items = iterate(eval(*s.expr, scope));
    if (s.cond) {
      ValueList kept;
      for (Value& item : items) {
        spend();
        auto probe = child_of(scope);
        assign(s.targets, item, *probe);
        if (truthy(eval(*s.cond, probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (!s.else_body.empty()) exec(s.else_body, child_of(scope, s.else_undefined), out);
      return;
    }
    const auto shared = std::make_shared<const ValueList>(std::move(items));
    for (size_t i = 0; i < shared->size(); ++i) {
      spend();  // an iteration costs a step even with an empty body
      auto iteration = child_of(scope, s.frame_undefined);
      assign(s.targets, (*shared)[i], *iteration);
      iteration->vars["loop"] = Value::loop(LoopInfo{static_cast<int64_t>(i), 0, shared});
      if (exec(s.body, iteration, out) == Flow::Break) break;
    }
  }

  Value make_macro(const Stmt& s, const ScopePtr& defining) {
    const Stmt* m = &s;
    return Value::function("macro '" + s.text + "'", [this, m, defining](const CallArgs& a) -> Value {
      const std::string what = "macro '" + m->text + "'";
      if (a.pos.size() > m->params.size())
        throw RuntimeError(what + " takes not more than " + std::to_string(m->params.size()) + " argument(s)");
      auto sc = child_of(defining, m->frame_undefined);
      std::vector<bool> given(m->params.size(), false);
      for (size_t i = 0; i < a.pos.size(); ++i) {
        sc->vars[m->params[i].name] = a.pos[i];
        given[i] = true;
      }
      for (const auto& [k, v] : a.kw) {
        size_t i = 0;
        while (i < m->params.size() && m->params[i].name != k) ++i;
        if (i == m->params.size()) throw RuntimeError(what + " takes no keyword argument '" + k + "'");
        if (given[i]) throw RuntimeError(what + " got multiple values for argument '" + k + "'");
        sc->vars[k] = v;
        given[i] = true;
      }
      for (size_t i = 0; i < m->params.size(); ++i) {
        if (given[i]) continue;
        const MacroParam& p = m->params[i];
        sc->vars[p.name] = p.default_value ? eval(*p.default_value, sc)
                                           : Value::undefined("parameter " + py_str_repr(p.name) + " was not provided");
      }
      if (depth_ >= kMaxCallDepth) throw RuntimeError("maximum macro recursion depth exceeded");
      ++depth_;
      std::string out;
      try {
        exec(m->body, sc, out);
      } catch (...) {
        --depth_;
        throw;
      }
      --depth_;
      return Value::string(std::move(out));
    });
  }

  // --- expressions ---

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      spend();
      return eval_impl(e, scope);
    } catch (const RuntimeError& err) {
      fail(e.loc, err.what());
    }
  }

  CallArgs eval_args(const Expr& e, const ScopePtr& scope) {
    CallArgs a;
    a.pos.reserve(e.args.size());
    for (const ExprPtr& x : e.args) a.pos.push_back(eval(*x, scope));
    for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x, scope));
    return a;
  }

  // A filter chain whose innermost target is missing ({% filter %}, {% set x | f %}).
  Value apply_filters(const Expr& e, Value subject, const ScopePtr& scope) {
    Value input = e.target ? apply_filters(*e.target, std::move(subject), scope) : std::move(subject);
    try {
      return e.filter(input, eval_args(e, scope));
    } catch (const RuntimeError& err) {
      fail(e.loc, err.what());
    }
  }

  static bool compare_op(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    return compare(a, b, op);
  }

  Value eval_impl(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case ExprKind::Const: return e.value;
      case ExprKind::Name: {
        const Value* v = scope->find(e.name);
        return v ? *v : Value::undefined(py_str_repr(e.name) + " is undefined");
      }
      case ExprKind::List:
      case ExprKind::Tuple: {
        ValueList items;
        items.reserve(e.args.size());
        for (const ExprPtr& x : e.args) items.push_back(eval(*x, scope));
        return e.kind == ExprKind::List ? Value::list(std::move(items)) : Value::tuple(std::move(items));
      }
      case ExprKind::Dict: {
        ValueDict d;
        for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
          Value k = eval(*e.args[i], scope);
          if (!k.is_string()) throw RuntimeError("dict literal keys must be strings in kvlm, got " + type_name(k));
          d.set(k.str(), eval(*e.args[i + 1], scope));
        }
        return Value::dict(std::move(d));
      }
      case ExprKind::Getattr: return get_attr(eval(*e.target, scope), e.name);
      case ExprKind::Getitem: {
        Value obj = eval(*e.target, scope);
        return get_item(obj, eval(*e.args[0], scope));
      }
      case ExprKind::Slice: {
        Value obj = eval(*e.target, scope);
        auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], scope) : Value::none(); };
        return slice(obj, part(0), part(1), part(2));
      }
      case ExprKind::Call: {
        Value fn = eval(*e.target, scope);
        CallArgs args = eval_args(e, scope);
        if (fn.is_undefined()) fail_undefined(fn);
        if (!fn.is_function()) throw RuntimeError("'" + type_name(fn) + "' object is not callable");
        return fn.function().call(args);
      }
      case ExprKind::Filter: {
        Value v = eval(*e.target, scope);
        return e.filter(v, eval_args(e, scope));
      }
      case ExprKind::Test: {
        Value v = eval(*e.target, scope);
        return Value::boolean(e.test(v, eval_args(e, scope)));
      }
      case ExprKind::Not: return Value::boolean(!truthy(eval(*e.target, scope)));
      case ExprKind::Neg: return negate(eval(*e.target, scope));
      case ExprKind::Pos: return unary_plus(eval(*e.target, scope));
      case ExprKind::Binary: {
        Value a = eval(*e.args[0], scope);
        return binary_op(e.name, a, eval(*e.args[1], scope));
      }
      case ExprKind::Concat: {
        std::string s;
        for (const ExprPtr& x : e.args) s += to_str(eval(*x, scope));
        return Value::string(std::move(s));
      }
      case ExprKind::Compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.args[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::And: {
        Value l = eval(*e.args[0], scope);
        return truthy(l) ? eval(*e.args[1], scope) : l;
      }
      case ExprKind::Or: {
        Value l = eval(*e.args[0], scope);
        return truthy(l) ? l : eval(*e.args[1], scope);
      }
      case ExprKind::CondExpr:
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.loc.line) +
                                " evaluated to false and no else section was defined.");
    }
    return Value();
  }

  const Template& tpl_;
  const RenderOptions& options_;
  int depth_ = 0;
  int64_t steps_ = 0;
  std::vector<ScopePtr> macro_scopes_;
  std::vector<Value> namespaces_;
};

}  // namespace

std::string render(const Template& tpl, const Value& context, const RenderOptions& options) {
  return Interpreter(tpl, options).run(context);
}

}  // namespace kvlm::jinja

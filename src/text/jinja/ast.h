// The syntax tree the parser builds and the interpreter walks. Nodes mirror jinja2's
// (jinja2/nodes.py) closely enough that each evaluates exactly as its jinja2 counterpart.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja/value.h"

namespace kvlm::jinja {

struct Loc {
  int line = 0, col = 0;
};

// A filter: fn(value, args) -> result. A test: fn(value, args) -> bool. Both are looked up
// by name when the template is parsed, so an unknown name fails at load time.
using FilterFn = Value (*)(const Value& value, const CallArgs& args);
using TestFn = bool (*)(const Value& value, const CallArgs& args);

enum class ExprKind : uint8_t {
  Const,     // value
  Name,      // name
  List,      // args = items
  Tuple,     // args = items
  Dict,      // args = key0, value0, key1, value1, ...
  Getattr,   // target.name
  Getitem,   // target[args[0]]
  Slice,     // target[args[0]:args[1]:args[2]] (each may be null)
  Call,      // target(args, kwargs)
  Filter,    // target | name(args, kwargs); target is null in {% filter %} / {% set x | f %}
  Test,      // target is name(args, kwargs)
  Not,       // not target
  Neg,       // -target
  Pos,       // +target
  Binary,    // args[0] name args[1], name in + - * / // % **
  Concat,    // args joined with ~
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ... (Python chained comparison)
  And,       // args[0] and args[1]
  Or,        // args[0] or args[1]
  CondExpr,  // args[1] if args[0] else args[2] (args[2] may be null)
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind = ExprKind::Const;
  Loc loc;
  Value value;
  std::string name;
  ExprPtr target;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
  FilterFn filter = nullptr;
  TestFn test = nullptr;
};

enum class StmtKind : uint8_t {
  Data,         // text
  Output,       // {{ expr }}
  If,           // branches
  For,          // for targets in expr [if cond] body [else else_body]
  Set,          // set targets = expr
  SetAttr,      // set targets[0].text = expr (namespace attribute)
  SetBlock,     // set targets[0] [| expr filters] body endset
  Macro,        // macro text(params) body endmacro
  Break,
  Continue,
  FilterBlock,  // filter expr body endfilter
  With,         // with assigns body endwith
  Scope,        // body rendered in place ({% generation %} of transformers)
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct IfBranch {
  ExprPtr cond;  // null for else
  Body body;
};

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // may be null
};

struct Stmt {
  StmtKind kind = StmtKind::Data;
  Loc loc;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;
  std::vector<std::string> targets;
  std::vector<IfBranch> branches;
  Body body, else_body;
  std::vector<MacroParam> params;
  std::vector<std::pair<std::string, ExprPtr>> assigns;
  // Names that start undefined in the frame `body` opens (and, for loops, `else_body`); see
  // scoping.h.
  std::vector<std::string> frame_undefined, else_undefined;
};

// A parsed template.
struct Template {
  std::string name;
  Body body;
  std::vector<std::string> start_undefined;  // see scoping.h
};

}  // namespace kvlm::jinja

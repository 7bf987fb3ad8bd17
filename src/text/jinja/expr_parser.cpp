// Expressions: jinja2/parser.py's parse_tuple ... parse_primary, production for production.
#include <algorithm>

#include "text/jinja/filters.h"
#include "text/jinja/parser_impl.h"

namespace kvlm::jinja {

bool Parser::is_tuple_end(const Ends& /*extra*/) const {
  return cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || is_op(")");
}

ExprPtr Parser::parse_tuple(bool with_condexpr, const Ends& extra_end, bool explicit_parens) {
  const Loc l = loc(cur());
  std::vector<ExprPtr> args;
  bool is_tuple = false;
  while (true) {
    if (!args.empty()) expect_op(",");
    if (is_tuple_end(extra_end)) break;
    args.push_back(parse_expression(with_condexpr));
    if (is_op(",")) is_tuple = true;
    else break;
  }
  if (!is_tuple) {
    if (!args.empty()) return std::move(args[0]);
    if (!explicit_parens) fail(cur(), "expected an expression, got " + describe(cur()));
  }
  auto e = make(ExprKind::Tuple, l);
  e->args = std::move(args);
  return e;
}

ExprPtr Parser::parse_condexpr() {
  ExprPtr e = parse_or();
  while (is_name("if")) {
    const Loc l = loc(cur());
    next();
    auto c = make(ExprKind::CondExpr, l);
    c->args.push_back(parse_or());
    c->args.push_back(std::move(e));
    c->args.push_back(skip_name("else") ? parse_condexpr() : nullptr);
    e = std::move(c);
  }
  return e;
}

ExprPtr Parser::binary(ExprKind kind, Loc l, ExprPtr a, ExprPtr b, std::string op) {
  auto e = make(kind, l);
  e->name = std::move(op);
  e->args.push_back(std::move(a));
  e->args.push_back(std::move(b));
  return e;
}

ExprPtr Parser::parse_or() {
  ExprPtr e = parse_and();
  while (is_name("or")) {
    const Loc l = loc(cur());
    next();
    e = binary(ExprKind::Or, l, std::move(e), parse_and());
  }
  return e;
}

ExprPtr Parser::parse_and() {
  ExprPtr e = parse_not();
  while (is_name("and")) {
    const Loc l = loc(cur());
    next();
    e = binary(ExprKind::And, l, std::move(e), parse_not());
  }
  return e;
}

ExprPtr Parser::parse_not() {
  if (is_name("not")) {
    auto e = make(ExprKind::Not, loc(cur()));
    next();
    e->target = parse_not();
    return e;
  }
  return parse_compare();
}

ExprPtr Parser::parse_compare() {
  const Loc l = loc(cur());
  ExprPtr first = parse_math1();
  std::vector<ExprPtr> operands;
  std::vector<std::string> ops;
  while (true) {
    if (cur().type == Tok::Op &&
        (is_op("==") || is_op("!=") || is_op("<") || is_op("<=") || is_op(">") || is_op(">="))) {
      ops.push_back(cur().text);
      next();
    } else if (is_name("in")) {
      ops.push_back("in");
      next();
    } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
      ops.push_back("not in");
      next();
      next();
    } else {
      break;
    }
    operands.push_back(parse_math1());
  }
  if (ops.empty()) return first;
  auto e = make(ExprKind::Compare, l);
  e->args.push_back(std::move(first));
  for (auto& o : operands) e->args.push_back(std::move(o));
  e->ops = std::move(ops);
  return e;
}

ExprPtr Parser::parse_math1() {
  ExprPtr e = parse_concat();
  while (is_op("+") || is_op("-")) {
    const Loc l = loc(cur());
    std::string op = cur().text;
    next();
    e = binary(ExprKind::Binary, l, std::move(e), parse_concat(), std::move(op));
  }
  return e;
}

ExprPtr Parser::parse_concat() {
  const Loc l = loc(cur());
  ExprPtr first = parse_math2();
  if (!is_op("~")) return first;
  auto e = make(ExprKind::Concat, l);
  e->args.push_back(std::move(first));
  while (skip_op("~")) e->args.push_back(parse_math2());
  return e;
}

ExprPtr Parser::parse_math2() {
  ExprPtr e = parse_pow();
  while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
    const Loc l = loc(cur());
    std::string op = cur().text;
    next();
    e = binary(ExprKind::Binary, l, std::move(e), parse_pow(), std::move(op));
  }
  return e;
}

ExprPtr Parser::parse_pow() {
  ExprPtr e = parse_unary(true);
  while (is_op("**")) {
    const Loc l = loc(cur());
    next();
    e = binary(ExprKind::Binary, l, std::move(e), parse_unary(true), "**");
  }
  return e;
}

ExprPtr Parser::parse_unary(bool with_filter) {
  const DepthGuard guard(*this);
  ExprPtr node;
  if (is_op("-") || is_op("+")) {
    node = make(is_op("-") ? ExprKind::Neg : ExprKind::Pos, loc(cur()));
    next();
    node->target = parse_unary(false);
  } else {
    node = parse_primary();
  }
  node = parse_postfix(std::move(node));
  if (with_filter) node = parse_filter_expr(std::move(node));
  return node;
}

ExprPtr Parser::parse_primary() {
  const Token& t = cur();
  const Loc l = loc(t);
  if (t.type == Tok::Name) {
    ExprPtr e;
    if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
      e = make(ExprKind::Const, l);
      e->value = Value::boolean(t.text == "true" || t.text == "True");
    } else if (t.text == "none" || t.text == "None") {
      e = make(ExprKind::Const, l);
      e->value = Value::none();
    } else {
      e = make(ExprKind::Name, l);
      e->name = t.text;
    }
    next();
    return e;
  }
  if (t.type == Tok::String) {
    std::string s;
    while (cur().type == Tok::String) {  // adjacent literals concatenate
      s += cur().text;
      next();
    }
    auto e = make(ExprKind::Const, l);
    e->value = Value::string(std::move(s));
    return e;
  }
  if (t.type == Tok::Integer || t.type == Tok::Float) {
    auto e = make(ExprKind::Const, l);
    e->value = t.type == Tok::Integer ? Value::integer(t.ival) : Value::number(t.fval);
    next();
    return e;
  }
  if (is_op("(")) {
    next();
    ExprPtr e = parse_tuple(true, {}, true);
    expect_op(")");
    return e;
  }
  if (is_op("[")) return parse_list();
  if (is_op("{")) return parse_dict();
  fail(t, "unexpected " + describe(t) + " in an expression");
}

ExprPtr Parser::parse_list() {
  auto e = make(ExprKind::List, loc(cur()));
  expect_op("[");
  while (!is_op("]")) {
    if (!e->args.empty()) expect_op(",");
    if (is_op("]")) break;
    e->args.push_back(parse_expression(true));
  }
  expect_op("]");
  return e;
}

ExprPtr Parser::parse_dict() {
  auto e = make(ExprKind::Dict, loc(cur()));
  expect_op("{");
  while (!is_op("}")) {
    if (!e->args.empty()) expect_op(",");
    if (is_op("}")) break;
    e->args.push_back(parse_expression(true));
    expect_op(":");
    e->args.push_back(parse_expression(true));
  }
  expect_op("}");
  return e;
}

ExprPtr Parser::parse_postfix(ExprPtr node) {
  while (true) {
    if (is_op(".") || is_op("[")) node = parse_subscript(std::move(node));
    else if (is_op("(")) node = parse_call(std::move(node));
    else return node;
  }
}

ExprPtr Parser::parse_filter_expr(ExprPtr node) {
  while (true) {
    if (is_op("|")) node = parse_filter(std::move(node), false);
    else if (is_name("is")) node = parse_test(std::move(node));
    else if (is_op("(")) node = parse_call(std::move(node));
    else return node;
  }
}

ExprPtr Parser::parse_subscript(ExprPtr node) {
  const Token t = cur();
  next();
  if (t.text == ".") {
    const Token& a = cur();
    if (a.type == Tok::Name) {
      auto e = make(ExprKind::Getattr, loc(t));
      e->name = a.text;
      e->target = std::move(node);
      next();
      return e;
    }
    if (a.type != Tok::Integer) fail(a, "expected an attribute name or number after '.', got " + describe(a));
    auto e = make(ExprKind::Getitem, loc(t));
    e->target = std::move(node);
    auto idx = make(ExprKind::Const, loc(a));
    idx->value = Value::integer(a.ival);
    e->args.push_back(std::move(idx));
    next();
    return e;
  }
  std::vector<ExprPtr> args;
  while (!is_op("]")) {
    if (!args.empty()) expect_op(",");
    args.push_back(parse_subscribed());
  }
  expect_op("]");
  ExprPtr arg;
  if (args.size() == 1) {
    arg = std::move(args[0]);
  } else {  // x[a, b] or x[]: a tuple key, as in Python
    arg = make(ExprKind::Tuple, loc(t));
    for (auto& a : args) {
      if (a->kind == ExprKind::Slice) fail(a->loc, "slices inside a tuple index are not supported");
      arg->args.push_back(std::move(a));
    }
  }
  if (arg->kind == ExprKind::Slice) {
    arg->target = std::move(node);
    arg->loc = loc(t);
    return arg;
  }
  auto e = make(ExprKind::Getitem, loc(t));
  e->target = std::move(node);
  e->args.push_back(std::move(arg));
  return e;
}

ExprPtr Parser::parse_subscribed() {
  const Loc l = loc(cur());
  std::vector<ExprPtr> parts;
  if (is_op(":")) {
    next();
    parts.push_back(nullptr);
  } else {
    ExprPtr e = parse_expression(true);
    if (!is_op(":")) return e;
    next();
    parts.push_back(std::move(e));
  }
  if (is_op(":") || is_op("]") || is_op(",")) parts.push_back(nullptr);
  else parts.push_back(parse_expression(true));
  if (skip_op(":")) parts.push_back(is_op("]") || is_op(",") ? nullptr : parse_expression(true));
  else parts.push_back(nullptr);
  auto s = make(ExprKind::Slice, l);
  s->args = std::move(parts);
  return s;
}

void Parser::parse_call_args(Expr& e) {
  expect_op("(");
  bool need_comma = false;
  while (!is_op(")")) {
    if (need_comma) {
      expect_op(",");
      if (is_op(")")) break;
    }
    if (is_op("*") || is_op("**")) fail(cur(), "*args and **kwargs in calls are not supported");
    if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
      std::string key = cur().text;
      next();
      next();
      e.kwargs.emplace_back(std::move(key), parse_expression(true));
    } else {
      if (!e.kwargs.empty()) fail(cur(), "positional argument follows keyword argument");
      e.args.push_back(parse_expression(true));
    }
    need_comma = true;
  }
  expect_op(")");
}

ExprPtr Parser::parse_call(ExprPtr node) {
  auto e = make(ExprKind::Call, loc(cur()));
  e->target = std::move(node);
  parse_call_args(*e);
  return e;
}

std::string Parser::dotted_name(const char* what) {
  std::string n = expect_name(what);
  while (skip_op(".")) n += "." + expect_name(what);
  return n;
}

ExprPtr Parser::parse_filter(ExprPtr node, bool start_inline) {
  while (is_op("|") || start_inline) {
    if (!start_inline) next();
    start_inline = false;
    const Token at = cur();
    auto e = make(ExprKind::Filter, loc(at));
    e->name = dotted_name("a filter name");
    e->filter = find_filter(e->name);
    if (!e->filter) {
      fail(at, is_unsupported_jinja_filter(e->name) ? "filter '" + e->name + "' is not supported by kvlm"
                                                     : "unknown filter '" + e->name + "'");
    }
    e->target = std::move(node);
    if (is_op("(")) parse_call_args(*e);
    node = std::move(e);
  }
  return node;
}

ExprPtr Parser::parse_test(ExprPtr node) {
  const Token is = cur();
  next();
  const bool negated = skip_name("not");
  const Token at = cur();
  auto e = make(ExprKind::Test, loc(is));
  e->name = dotted_name("a test name");
  e->test = find_test(e->name);
  if (!e->test) fail(at, "unknown test '" + e->name + "'");
  e->target = std::move(node);
  if (is_op("(")) {
    parse_call_args(*e);
  } else if ((cur().type == Tok::Name || cur().type == Tok::String || cur().type == Tok::Integer ||
              cur().type == Tok::Float || is_op("[") || is_op("{")) &&
             !is_name("else") && !is_name("or") && !is_name("and")) {
    if (is_name("is")) fail(cur(), "tests cannot be chained with 'is'");
    e->args.push_back(parse_postfix(parse_primary()));
  }
  if (!negated) return e;
  auto n = make(ExprKind::Not, loc(is));
  n->target = std::move(e);
  return n;
}

}  // namespace kvlm::jinja

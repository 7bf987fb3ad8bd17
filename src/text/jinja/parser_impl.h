// The jinja2 parser's class, shared by parser.cpp (statements) and expr_parser.cpp
// (expressions). Internal to src/text/jinja.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "text/jinja/ast.h"
#include "text/jinja/lexer.h"

namespace kvlm::jinja {

using Ends = std::vector<std::string_view>;

class Parser {
 public:
  Parser(std::vector<Token> tokens, std::string name) : t_(std::move(tokens)), name_(std::move(name)) {}

  Template parse() {
    Template tpl;
    tpl.name = name_;
    tpl.body = subparse({});
    if (cur().type != Tok::Eof) fail(cur(), "unexpected " + describe(cur()));
    return tpl;
  }

 private:
  // --- token stream ---
  const Token& cur() const { return t_[i_]; }
  const Token& peek() const { return t_[std::min(i_ + 1, t_.size() - 1)]; }
  void next() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool is_op(std::string_view op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(std::string_view n) const { return cur().type == Tok::Name && cur().text == n; }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    next();
    return true;
  }
  bool skip_name(std::string_view n) {
    if (!is_name(n)) return false;
    next();
    return true;
  }
  static Loc loc(const Token& t) { return {t.line, t.col}; }

  [[noreturn]] void fail(const Token& at, const std::string& msg) const { fail(loc(at), msg); }
  [[noreturn]] void fail(Loc l, const std::string& msg) const {
    throw Error(name_ + ":" + std::to_string(l.line) + ":" + std::to_string(l.col) + ": " + msg);
  }

  void expect_op(std::string_view op) {
    if (!skip_op(op)) fail(cur(), "expected '" + std::string(op) + "', got " + describe(cur()));
  }
  void expect(Tok type, const char* what) {
    if (cur().type != type) fail(cur(), std::string("expected ") + what + ", got " + describe(cur()));
    next();
  }
  std::string expect_name(const char* what) {
    if (cur().type != Tok::Name) fail(cur(), std::string("expected ") + what + ", got " + describe(cur()));
    std::string n = cur().text;
    next();
    return n;
  }

  // Nesting guard: deeply nested expressions or blocks would otherwise recurse without bound
  // (in the parser and later in the interpreter).
  static constexpr int kMaxDepth = 200;
  struct DepthGuard {
    Parser& p;
    explicit DepthGuard(Parser& parser) : p(parser) {
      if (++p.depth_ > kMaxDepth) p.fail(p.cur(), "the template nests too deeply (more than 200 levels)");
    }
    ~DepthGuard() { --p.depth_; }
  };

  static ExprPtr make(ExprKind kind, Loc l) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->loc = l;
    return e;
  }

  // --- statements (parser.cpp) ---
  struct Open {
    std::string tag;
    Loc loc;
    Ends ends;
  };

  Body subparse(const Ends& ends);
  Body parse_statements(const Ends& ends, bool drop_needle);
  StmtPtr new_stmt(StmtKind kind, const Token& at);
  StmtPtr parse_statement();
  // Names to assign to: `x` or `a, b` (for loops and set); with_namespace also accepts
  // `ns.attr` (returned as "ns.attr").
  std::vector<std::string> parse_targets(const Ends& extra_end, bool with_namespace = false);
  StmtPtr parse_for();
  StmtPtr parse_if();
  StmtPtr parse_set();
  StmtPtr parse_macro();
  StmtPtr parse_filter_block();
  StmtPtr parse_with();
  StmtPtr parse_scope(const char* tag, const char* end);

  // --- expressions (expr_parser.cpp) ---
  // jinja2 passes extra end rules such as 'in' here, but its Token.test_any(tuple) never
  // matches them, so `{% for a, in x %}` is a syntax error there; kvlm keeps that behavior.
  bool is_tuple_end(const Ends& /*extra*/) const;
  ExprPtr parse_tuple(bool with_condexpr, const Ends& extra_end, bool explicit_parens);
  ExprPtr parse_condexpr();
  ExprPtr binary(ExprKind kind, Loc l, ExprPtr a, ExprPtr b, std::string op = {});
  ExprPtr parse_or();
  ExprPtr parse_and();
  ExprPtr parse_not();
  ExprPtr parse_compare();
  ExprPtr parse_concat();
  ExprPtr parse_pow();
  ExprPtr parse_unary(bool with_filter);
  ExprPtr parse_primary();
  ExprPtr parse_list();
  ExprPtr parse_dict();
  ExprPtr parse_postfix(ExprPtr node);
  ExprPtr parse_filter_expr(ExprPtr node);
  ExprPtr parse_subscript(ExprPtr node);
  ExprPtr parse_subscribed();
  void parse_call_args(Expr& e);
  ExprPtr parse_call(ExprPtr node);
  std::string dotted_name(const char* what);
  ExprPtr parse_filter(ExprPtr node, bool start_inline);
  ExprPtr parse_test(ExprPtr node);

  ExprPtr parse_expression(bool with_condexpr) { return with_condexpr ? parse_condexpr() : parse_or(); }
  ExprPtr parse_math1();
  ExprPtr parse_math2();

  std::vector<Token> t_;
  size_t i_ = 0;
  std::string name_;
  std::vector<Open> open_;
  int loop_depth_ = 0;
  int depth_ = 0;
};

}  // namespace kvlm::jinja

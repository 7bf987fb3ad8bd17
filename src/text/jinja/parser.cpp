#include "text/jinja/parser.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "text/jinja/filters.h"
#include "text/jinja/parser_impl.h"
#include "text/jinja/scoping.h"

namespace kvlm::jinja {
namespace {

std::string quote_list(const Ends& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += i + 1 == names.size() ? " or " : ", ";
    out += "{% " + std::string(names[i]) + " %}";
  }
  return out;
}

}  // namespace

Body Parser::subparse(const Ends& ends) {
  Body body;
  while (true) {
    const Token& t = cur();
    if (t.type == Tok::Data) {
      auto s = std::make_unique<Stmt>();
      s->kind = StmtKind::Data;
      s->loc = loc(t);
      s->text = t.text;
      body.push_back(std::move(s));
      next();
    } else if (t.type == Tok::VarBegin) {
      const Token open = t;
      next();
      auto s = std::make_unique<Stmt>();
      s->kind = StmtKind::Output;
      s->loc = loc(open);
      s->expr = parse_tuple(true, {}, false);
      if (cur().type != Tok::VarEnd)
        fail(cur(), "expected '}}' to end the '{{' at " + std::to_string(open.line) + ":" +
                        std::to_string(open.col) + ", got " + describe(cur()));
      next();
      body.push_back(std::move(s));
    } else if (t.type == Tok::BlockBegin) {
      next();
      if (cur().type == Tok::Name && std::find(ends.begin(), ends.end(), cur().text) != ends.end()) return body;
      body.push_back(parse_statement());
      expect(Tok::BlockEnd, "'%}'");
    } else if (t.type == Tok::Eof) {
      return body;
    } else {
      fail(t, "unexpected " + describe(t));
    }
  }
}

Body Parser::parse_statements(const Ends& ends, bool drop_needle) {
  skip_op(":");
  expect(Tok::BlockEnd, "'%}'");
  Body body = subparse(ends);
  if (cur().type == Tok::Eof) {
    const Open& o = open_.back();
    fail(cur(), "unexpected end of template: the {% " + o.tag + " %} at " + std::to_string(o.loc.line) + ":" +
                    std::to_string(o.loc.col) + " is never closed (expected " + quote_list(o.ends) + ")");
  }
  if (drop_needle) next();
  return body;
}

StmtPtr Parser::new_stmt(StmtKind kind, const Token& at) {
  auto s = std::make_unique<Stmt>();
  s->kind = kind;
  s->loc = loc(at);
  return s;
}

StmtPtr Parser::parse_statement() {
  const DepthGuard guard(*this);
  const Token& t = cur();
  if (t.type != Tok::Name) fail(t, "expected a tag name after '{%', got " + describe(t));
  const std::string& n = t.text;
  if (n == "for") return parse_for();
  if (n == "if") return parse_if();
  if (n == "set") return parse_set();
  if (n == "macro") return parse_macro();
  if (n == "filter") return parse_filter_block();
  if (n == "with") return parse_with();
  if (n == "generation") return parse_scope("generation", "endgeneration");
  if (n == "print") {
    auto s = new_stmt(StmtKind::Output, t);
    next();
    s->expr = parse_tuple(true, {}, false);
    return s;
  }
  if (n == "break" || n == "continue") {
    if (loop_depth_ == 0) fail(t, "'" + n + "' outside of a for loop");
    auto s = new_stmt(n == "break" ? StmtKind::Break : StmtKind::Continue, t);
    next();
    return s;
  }
  static constexpr std::string_view unsupported[] = {"call", "include", "import", "from", "extends", "block",
                                                     "autoescape"};
  if (std::find(std::begin(unsupported), std::end(unsupported), n) != std::end(unsupported))
    fail(t, "unsupported tag '" + n + "': kvlm's chat template engine has no {% " + n + " %}");
  std::string msg = "unknown tag '" + n + "'";
  if (!open_.empty()) {
    const Open& o = open_.back();
    msg += " (expected " + quote_list(o.ends) + " to close the {% " + o.tag + " %} at " + std::to_string(o.loc.line) +
           ":" + std::to_string(o.loc.col) + ")";
  }
  fail(t, msg);
}

// Names to assign to: `x` or `a, b` (for loops and set).
std::vector<std::string> Parser::parse_targets(const Ends& extra_end, bool with_namespace) {
  std::vector<std::string> names;
  while (true) {
    if (!names.empty()) expect_op(",");
    if (is_tuple_end(extra_end)) break;
    if (cur().type != Tok::Name || is_name("true") || is_name("false") || is_name("none") || is_name("True") ||
        is_name("False") || is_name("None"))
      fail(cur(), "expected a variable name to assign to, got " + describe(cur()));
    names.push_back(cur().text);
    next();
    if (with_namespace && skip_op(".")) names.back() += "." + expect_name("an attribute name");
    if (!is_op(",")) break;
  }
  if (names.empty()) fail(cur(), "expected a variable name to assign to, got " + describe(cur()));
  return names;
}

StmtPtr Parser::parse_for() {
  auto s = new_stmt(StmtKind::For, cur());
  next();
  s->targets = parse_targets({"in"});
  if (!skip_name("in")) fail(cur(), "expected 'in', got " + describe(cur()));
  s->expr = parse_tuple(false, {"recursive"}, false);
  if (skip_name("if")) s->cond = parse_expression(true);
  if (is_name("recursive")) fail(cur(), "recursive for loops are not supported");
  open_.push_back({"for", s->loc, {"endfor", "else"}});
  ++loop_depth_;
  s->body = parse_statements({"endfor", "else"}, false);
  --loop_depth_;
  const bool has_else = is_name("else");
  next();
  if (has_else) {
    open_.back().ends = {"endfor"};
    s->else_body = parse_statements({"endfor"}, true);
  }
  open_.pop_back();
  return s;
}

StmtPtr Parser::parse_if() {
  auto s = new_stmt(StmtKind::If, cur());
  next();
  open_.push_back({"if", s->loc, {"elif", "else", "endif"}});
  while (true) {
    IfBranch b;
    b.cond = parse_tuple(false, {}, false);
    b.body = parse_statements({"elif", "else", "endif"}, false);
    s->branches.push_back(std::move(b));
    const std::string tag = cur().text;
    next();
    if (tag == "elif") continue;
    if (tag == "else") {
      open_.back().ends = {"endif"};
      IfBranch e;
      e.body = parse_statements({"endif"}, true);
      s->branches.push_back(std::move(e));
    }
    break;
  }
  open_.pop_back();
  return s;
}

StmtPtr Parser::parse_set() {
  const Token& at = cur();
  auto s = new_stmt(StmtKind::Set, at);
  next();
  s->targets = parse_targets({}, true);
  // A single `ns.attr` target: the attribute name goes to text, the namespace to targets.
  if (const size_t dot = s->targets[0].find('.'); s->targets.size() == 1 && dot != std::string::npos) {
    s->text = s->targets[0].substr(dot + 1);
    s->targets[0].resize(dot);
  }
  if (skip_op("=")) {
    if (!s->text.empty()) s->kind = StmtKind::SetAttr;
    s->expr = parse_tuple(true, {}, false);
    return s;
  }
  if (s->targets.size() != 1) fail(at, "a {% set %} block assigns to a single name");
  s->kind = StmtKind::SetBlock;
  if (is_op("|")) s->expr = parse_filter(nullptr, false);
  open_.push_back({"set", s->loc, {"endset"}});
  s->body = parse_statements({"endset"}, true);
  open_.pop_back();
  return s;
}

StmtPtr Parser::parse_macro() {
  auto s = new_stmt(StmtKind::Macro, cur());
  next();
  s->text = expect_name("a macro name");
  expect_op("(");
  bool defaults = false;
  while (!is_op(")")) {
    if (!s->params.empty()) expect_op(",");
    MacroParam p;
    const Token& pt = cur();
    p.name = expect_name("a parameter name");
    if (skip_op("=")) {
      p.default_value = parse_expression(true);
      defaults = true;
    } else if (defaults) {
      fail(pt, "non-default argument follows default argument");
    }
    s->params.push_back(std::move(p));
  }
  expect_op(")");
  const int saved = loop_depth_;
  loop_depth_ = 0;
  open_.push_back({"macro", s->loc, {"endmacro"}});
  s->body = parse_statements({"endmacro"}, true);
  open_.pop_back();
  loop_depth_ = saved;
  return s;
}

StmtPtr Parser::parse_filter_block() {
  auto s = new_stmt(StmtKind::FilterBlock, cur());
  next();
  s->expr = parse_filter(nullptr, true);
  open_.push_back({"filter", s->loc, {"endfilter"}});
  s->body = parse_statements({"endfilter"}, true);
  open_.pop_back();
  return s;
}

StmtPtr Parser::parse_with() {
  auto s = new_stmt(StmtKind::With, cur());
  next();
  while (cur().type != Tok::BlockEnd) {
    if (!s->assigns.empty()) expect_op(",");
    std::string n = expect_name("a variable name");
    expect_op("=");
    s->assigns.emplace_back(std::move(n), parse_expression(true));
  }
  open_.push_back({"with", s->loc, {"endwith"}});
  s->body = parse_statements({"endwith"}, true);
  open_.pop_back();
  return s;
}

StmtPtr Parser::parse_scope(const char* tag, const char* end) {
  auto s = new_stmt(StmtKind::Scope, cur());
  next();
  open_.push_back({tag, s->loc, {end}});
  s->body = parse_statements({end}, true);
  open_.pop_back();
  return s;
}

Template parse_template(std::string_view source, std::string name) {
  const std::string normalized = normalize_template_source(source);
  std::vector<Token> tokens = tokenize(normalized, name);
  Template tpl = Parser(std::move(tokens), std::move(name)).parse();
  resolve_frames(tpl);
  return tpl;
}

}  // namespace kvlm::jinja

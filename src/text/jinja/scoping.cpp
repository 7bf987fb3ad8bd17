#include "text/jinja/scoping.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

namespace kvlm::jinja {
namespace {

using Names = std::set<std::string>;

struct Event {
  std::string name;
  bool store = false;
  bool conditional = false;  // inside an {% if %} branch of the frame
};

void expr_loads(const Expr* e, std::vector<Event>& ev) {
  if (!e) return;
  if (e->kind == ExprKind::Name) ev.push_back({e->name, false, false});
  expr_loads(e->target.get(), ev);
  for (const ExprPtr& a : e->args) expr_loads(a.get(), ev);
  for (const auto& kw : e->kwargs) expr_loads(kw.second.get(), ev);
}

// The loads and stores of one frame in jinja2's visiting order (idtracking.py's
// FrameSymbolVisitor): a statement's expressions before its targets; {% if %} branches are
// part of the frame; loop, macro, with, set-block and filter bodies are child frames.
void frame_events(const Body& body, bool conditional, std::vector<Event>& ev) {
  auto store = [&](const std::string& n) {
    const size_t dot = n.find('.');  // `ns.attr` reads ns
    if (dot == std::string::npos) ev.push_back({n, true, conditional});
    else ev.push_back({n.substr(0, dot), false, conditional});
  };
  for (const StmtPtr& sp : body) {
    const Stmt& s = *sp;
    switch (s.kind) {
      case StmtKind::Output: expr_loads(s.expr.get(), ev); break;
      case StmtKind::If:
        for (const IfBranch& b : s.branches) {
          expr_loads(b.cond.get(), ev);
          frame_events(b.body, true, ev);
        }
        break;
      case StmtKind::For: expr_loads(s.expr.get(), ev); break;
      case StmtKind::Set:
        expr_loads(s.expr.get(), ev);
        for (const std::string& t : s.targets) store(t);
        break;
      case StmtKind::SetAttr:
        expr_loads(s.expr.get(), ev);
        ev.push_back({s.targets[0], false, conditional});
        break;
      case StmtKind::SetBlock:
        if (s.text.empty()) store(s.targets[0]);
        else ev.push_back({s.targets[0], false, conditional});
        break;
      case StmtKind::Macro: store(s.text); break;
      case StmtKind::With:
        for (const auto& a : s.assigns) expr_loads(a.second.get(), ev);
        break;
      case StmtKind::FilterBlock: expr_loads(s.expr.get(), ev); break;
      default: break;
    }
  }
}

class Resolver {
 public:
  // Analyzes the frame made of `body` (with `params` declared on entry), then its children.
  std::vector<std::string> frame(Body& body, const std::vector<std::string>& params) {
    std::vector<Event> ev;
    frame_events(body, false, ev);
    Names refs(params.begin(), params.end());
    for (const Event& e : ev) refs.insert(e.name);
    Names seen(params.begin(), params.end());
    std::vector<std::string> start_undefined;
    for (const Event& e : ev) {
      if (!seen.insert(e.name).second) continue;
      if (e.store && !e.conditional && !in_ancestors(e.name)) start_undefined.push_back(e.name);
    }
    ancestors_.push_back(&refs);
    children(body);
    ancestors_.pop_back();
    return start_undefined;
  }

 private:
  bool in_ancestors(const std::string& n) const {
    return std::any_of(ancestors_.begin(), ancestors_.end(), [&](const Names* r) { return r->count(n) > 0; });
  }

  void children(Body& body) {
    for (StmtPtr& sp : body) {
      Stmt& s = *sp;
      switch (s.kind) {
        case StmtKind::If:
          for (IfBranch& b : s.branches) children(b.body);
          break;
        case StmtKind::For: {
          std::vector<std::string> params = s.targets;
          params.push_back("loop");
          s.frame_undefined = frame(s.body, params);
          s.else_undefined = frame(s.else_body, {});
          break;
        }
        case StmtKind::Macro: {
          std::vector<std::string> params;
          for (const MacroParam& p : s.params) params.push_back(p.name);
          s.frame_undefined = frame(s.body, params);
          break;
        }
        case StmtKind::With: {
          std::vector<std::string> params;
          for (const auto& a : s.assigns) params.push_back(a.first);
          s.frame_undefined = frame(s.body, params);
          break;
        }
        case StmtKind::SetBlock:
        case StmtKind::FilterBlock:
        case StmtKind::Scope: s.frame_undefined = frame(s.body, {}); break;
        default: break;
      }
    }
  }

  std::vector<const Names*> ancestors_;
};

}  // namespace

void resolve_frames(Template& tpl) { tpl.start_undefined = Resolver().frame(tpl.body, {}); }

}  // namespace kvlm::jinja

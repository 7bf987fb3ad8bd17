#include "server/reasoning.h"

#include <algorithm>

#include "core/error.h"
#include "server/tool_calls.h"  // partial_tag

namespace kvlm::server {

namespace {

constexpr std::string_view kOpen = "<think>", kClose = "</think>";

bool space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

}  // namespace

ReasoningParser parse_reasoning_parser(std::string_view name) {
  if (name == "qwen3" || name == "deepseek_r1") return ReasoningParser::ThinkTags;
  if (name == "gpt_oss" || name == "openai_gptoss" || name == "harmony") return ReasoningParser::Harmony;
  throw Error("--reasoning-parser '" + std::string(name) +
              "' is not one kvlm knows: qwen3 or deepseek_r1 (<think> ... </think>), gpt_oss (harmony)");
}

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t open = prompt.rfind(kOpen);
  if (open == std::string_view::npos) return false;
  const size_t close = prompt.rfind(kClose);
  return close == std::string_view::npos || close < open;
}

ReasoningSplit ReasoningStream::push(std::string_view text) {
  held_ += text;
  ReasoningSplit out;
  for (;;) {
    switch (state_) {
      case State::Start: {
        const auto first = std::ranges::find_if_not(held_, space);
        if (first == held_.end()) return out;  // only whitespace so far
        const std::string_view rest(&*first, size_t(held_.end() - first));
        if (rest.starts_with(kOpen)) {
          held_ = std::string(rest.substr(kOpen.size()));
          state_ = State::Reasoning;
          continue;
        }
        if (kOpen.starts_with(rest)) return out;  // may yet be <think>
        state_ = State::Answer;
        continue;
      }
      case State::Reasoning: {
        if (const size_t at = held_.find(kClose); at != std::string::npos) {
          out.reasoning += held_.substr(0, at);
          held_.erase(0, at + kClose.size());
          state_ = State::AfterReasoning;
          continue;
        }
        const size_t keep = partial_tag(held_, kClose);
        out.reasoning += held_.substr(0, held_.size() - keep);
        held_.erase(0, held_.size() - keep);
        return out;
      }
      case State::AfterReasoning: {
        held_.erase(held_.begin(), std::ranges::find_if_not(held_, space));
        if (held_.empty()) return out;
        state_ = State::Answer;
        continue;
      }
      case State::Answer:
        out.content += held_;
        held_.clear();
        return out;
    }
  }
}

ReasoningSplit ReasoningStream::finish() {
  ReasoningSplit out;
  if (state_ == State::Reasoning) out.reasoning = std::move(held_);
  else if (state_ != State::AfterReasoning) out.content = std::move(held_);
  held_.clear();
  return out;
}

grammar::Grammar reasoning_then(const grammar::Grammar& answer, bool in_reasoning) {
  using grammar::Grammar;
  using grammar::Sequence;
  using grammar::Symbol;
  Grammar g;
  const uint32_t root = g.add_rule("root");
  const uint32_t ws = g.add_rule("think-ws");  // whitespace, possibly none
  const Symbol space = Symbol::chars({{' ', ' '}, {'\t', '\t'}, {'\n', '\n'}, {'\r', '\r'}});
  g.add_alt(ws, {space, Symbol::ref(ws)});
  g.add_alt(ws, {});
  const uint32_t ans = g.embed(answer, "answer-");
  // The reasoning: any text up to </think>, then whitespace and the answer.
  const uint32_t think = g.add_text_until(kClose, {Symbol::ref(ws), Symbol::ref(ans)}, "think");
  if (in_reasoning) {
    g.add_alt(root, {Symbol::ref(think)});
  } else {
    Sequence open{Symbol::ref(ws)};
    Grammar::append_literal(open, kOpen);
    open.push_back(Symbol::ref(think));
    g.add_alt(root, std::move(open));
    g.add_alt(root, {Symbol::ref(ans)});
  }
  g.set_root(root);
  g.validate();
  return g;
}

ReasoningSplit split_reasoning(std::string_view text, bool in_reasoning) {
  ReasoningStream s(in_reasoning);
  ReasoningSplit out = s.push(text);
  ReasoningSplit rest = s.finish();
  out.reasoning += rest.reasoning;
  out.content += rest.content;
  return out;
}

}  // namespace kvlm::server

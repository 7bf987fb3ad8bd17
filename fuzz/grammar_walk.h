// What the fuzzers that reach the grammar engine do with a grammar that compiled: compile it
// over a small vocabulary (every byte, some multi-byte tokens) and walk it a few steps, taking
// the first allowed token each time, so the matcher's masks and steps run on it too.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "text/grammar/matcher.h"

namespace kvlm::fuzz {

inline std::shared_ptr<const grammar::TokenVocab> vocab() {
  static const auto v = [] {
    std::vector<std::string> t;
    for (int c = 1; c < 128; ++c) t.emplace_back(1, char(c));
    for (int c = 0x80; c < 0x100; ++c) t.emplace_back(1, char(c));
    for (const char* s : {"{\"", "\": ", "\":", ", ", "true", "false", "null", "<tool_call>", "</tool_call>", "ab", "12",
                          "\xC3\xA9"})
      t.emplace_back(s);
    return std::make_shared<const grammar::TokenVocab>(std::move(t));
  }();
  return v;
}

// Throws kvlm::Error as compiling or matching does.
inline void walk_grammar(const grammar::Grammar& g) {
  auto cg = std::make_shared<const grammar::CompiledGrammar>(g, vocab());
  grammar::Constraint c(cg);
  for (int step = 0; step < 8 && !c.terminated(); ++step) {
    const auto m = c.allowed();
    TokenId pick = -1;
    for (TokenId t = 0; t < vocab()->size() && pick < 0; ++t)
      if (m->test(t)) pick = t;
    if (pick < 0 || !c.accept(pick)) break;
  }
}

}  // namespace kvlm::fuzz

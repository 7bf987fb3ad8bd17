// libFuzzer target: the grammar front ends a client reaches — a regex (structured outputs'
// `regex`, a JSON schema's `pattern`), GBNF text and a JSON schema — whatever their bytes,
// give a grammar or a kvlm::Error, never a crash, a hang or unbounded memory; a grammar that
// compiles runs its initial state, its mask and a few steps. The input's first byte picks
// the front end; the rest is its text. Seeds (fuzz/seeds-grammar) include the bombs of
// issue 47: deep nesting, rule chains, huge repetition counts.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/grammar/grammar.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"

using namespace kvlm;

namespace {

std::shared_ptr<const grammar::TokenVocab> vocab() {
  static const auto v = [] {
    std::vector<std::string> t;
    for (int c = 1; c < 128; ++c) t.emplace_back(1, char(c));
    for (int c = 0x80; c < 0x100; ++c) t.emplace_back(1, char(c));
    for (const char* s : {"{\"", "\": ", "\":", ", ", "true", "false", "null", "ab", "12", "\xC3\xA9"}) t.emplace_back(s);
    return std::make_shared<const grammar::TokenVocab>(std::move(t));
  }();
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    grammar::Grammar g;
    switch (data[0] % 3) {
      case 0: g = grammar::regex_grammar(text); break;
      case 1: g = grammar::parse_gbnf(text); break;
      default: {
        const auto schema = nlohmann::ordered_json::parse(text, nullptr, false);
        if (schema.is_discarded() || !schema.is_object()) return 0;
        g = grammar::json_schema_grammar(schema);
      }
    }
    auto cg = std::make_shared<const grammar::CompiledGrammar>(g, vocab());
    grammar::Constraint c(cg);
    for (int step = 0; step < 8 && !c.terminated(); ++step) {  // the first allowed token each step
      const auto m = c.allowed();
      TokenId pick = -1;
      for (TokenId t = 0; t < vocab()->size() && pick < 0; ++t)
        if (m->test(t)) pick = t;
      if (pick < 0 || !c.accept(pick)) break;
    }
  } catch (const Error&) {
  }
  return 0;
}

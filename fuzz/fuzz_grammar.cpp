// libFuzzer target: the grammar front ends a client reaches — a regex (structured outputs'
// `regex`, a JSON schema's `pattern`), GBNF text and a JSON schema — whatever their bytes,
// give a grammar or a kvlm::Error, never a crash, a hang or unbounded memory; a grammar that
// compiles runs its initial state, its mask and a few steps. The input's first byte picks
// the front end; the rest is its text. Seeds (fuzz/seeds-grammar) include the bombs of
// issue 47: deep nesting, rule chains, huge repetition counts.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "grammar_walk.h"
#include "text/grammar/grammar.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/regex.h"

using namespace kvlm;

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
    fuzz::walk_grammar(g);
  } catch (const Error&) {
  }
  return 0;
}

// Structured outputs' grammar engine: GBNF, regexes and JSON schemas become grammars; the
// matcher accepts exactly their sentences, byte by byte and token by token; the token mask
// equals trying every token; the tokenizers' token bytes are what decoding writes.
#include <chrono>
#include <functional>
#include <random>
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer/tokenizer.h"
#include "text/grammar/grammar.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"

#include "../support/error_text.h"

namespace kvlm::grammar {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;
const fs::path kRepo = fs::path(KVLM_TEST_DATA) / "..";

// A vocabulary of every printable ASCII character, the UTF-8 continuation bytes, a few
// multi-byte tokens and some lead bytes and UTF-8 pieces split across tokens (as byte-level
// BPE splits them).
std::shared_ptr<const TokenVocab> toy_vocab() {
  std::vector<std::string> v;
  for (int c = 32; c < 127; ++c) v.emplace_back(1, char(c));
  for (int c = 0x80; c < 0xC0; ++c) v.emplace_back(1, char(c));  // every continuation byte, as byte-level BPE has
  for (const char* t : {"\n", "\t", "{\"", "\":", "\": ", ", ", "true", "false", "null", "ab", "abc", "12", "-1", "\"}",
                        "\xC3", "\xA9", "\xC3\xA9", "\xE2\x82", "\xAC", "\xE2\x82\xAC", "é!", "",
                        "\xE0", "\xF0", "\xC2", "\xED", "\xF4"})
    v.emplace_back(t);
  return std::make_shared<const TokenVocab>(std::move(v));
}

// Whether `text` is a complete sentence of `g` (and, separately, a viable prefix).
struct Verdict {
  bool prefix, complete;
};
Verdict judge(const Grammar& g, std::string_view text) {
  Constraint c(std::make_shared<const CompiledGrammar>(g, toy_vocab()));
  if (!c.accept_text(text)) return {false, false};
  return {true, c.can_end()};
}
bool matches(const Grammar& g, std::string_view text) { return judge(g, text).complete; }

TEST(Grammar, GbnfAcceptsItsLanguage) {
  const Grammar g = parse_gbnf(R"(
# a list of numbers
root ::= "[" ws (num (ws "," ws num)*)? ws "]"
num  ::= "-"? [0-9]+ ("." [0-9]{1,3})?
ws   ::= [ \t\n]*
)");
  for (const char* ok : {"[]", "[1]", "[ 1 , -2.5,3.125 ]", "[\n12\t]"}) EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* no : {"[", "[1,]", "[1.]", "[1.2345]", "[--1]", "x"}) EXPECT_FALSE(matches(g, no)) << no;
  EXPECT_TRUE(judge(g, "[1, ").prefix);
  EXPECT_FALSE(judge(g, "[1, ").complete);
  EXPECT_FALSE(judge(g, "[1,,").prefix);
}

// add_text_until: any text without the tag, the tag, then what follows — also for a tag that
// overlaps itself, where a naive "restart on mismatch" automaton would miss "aabab".
TEST(Grammar, TextUntilATag) {
  for (const std::string tag : {"</p>", "abab", "aab"}) {
    Grammar g;
    const uint32_t root = g.add_rule("root");
    Sequence then;
    Grammar::append_literal(then, "!");
    g.add_alt(root, {Symbol::ref(g.add_text_until(tag, then, "until"))});
    g.set_root(root);
    g.validate();
    EXPECT_TRUE(matches(g, tag + "!")) << tag;
    EXPECT_TRUE(matches(g, "x y z " + tag + "!")) << tag;
    EXPECT_TRUE(matches(g, tag.substr(0, 1) + tag + "!")) << tag;  // the tag's start just before it
    EXPECT_TRUE(matches(g, tag.substr(0, tag.size() - 1) + "x" + tag + "!")) << tag;
    EXPECT_FALSE(matches(g, "text!")) << tag;
    EXPECT_FALSE(matches(g, tag + tag + "!")) << tag;  // the first tag ends the text
    EXPECT_FALSE(matches(g, "x" + tag)) << tag;
  }
  Grammar g;
  const uint32_t root = g.add_rule("root");
  g.add_alt(root, {Symbol::ref(g.add_text_until("abab", {Symbol::ch('!')}, "until"))});
  g.set_root(root);
  EXPECT_TRUE(matches(g, "aabab!"));
  EXPECT_TRUE(matches(g, "abaabab!"));
  EXPECT_FALSE(matches(g, "ababab!"));  // "abab" already ended at the 4th character
}

TEST(Grammar, GbnfMultiLineAlternativesAndDot) {
  const Grammar g = parse_gbnf("root ::= \"a\"\n  | \"b\" rest\nrest ::= . .\n");
  EXPECT_TRUE(matches(g, "a"));
  EXPECT_TRUE(matches(g, "bxy"));
  EXPECT_TRUE(matches(g, "b\xC3\xA9z"));  // . is a code point, not a byte
  EXPECT_FALSE(matches(g, "bx\n"));
}

TEST(Grammar, GbnfErrorsSayWhere) {
  const auto msg = [](const char* text) {
    try {
      parse_gbnf(text);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg("root ::= foo\n").find("'foo' is used but never defined"), std::string::npos);
  EXPECT_NE(msg("root ::= root \"a\" | \"b\"\n").find("left-recursive"), std::string::npos);
  EXPECT_NE(msg("root ::= x\nx ::= y? x \"a\"\ny ::= \"b\"\n").find("left-recursive"), std::string::npos);
  EXPECT_NE(msg("start ::= \"a\"\n").find("no rule named 'root'"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a").find("unterminated string literal"), std::string::npos);
  EXPECT_NE(msg("root ::= \"a\"\nroot ::= \"b\"\n").find("defined twice"), std::string::npos);
  EXPECT_NE(msg("root ::= [z-a]\n").find("line 1, column"), std::string::npos);
}

TEST(Grammar, TerminatedOnlyWhenNothingMayFollow) {
  const Grammar g = parse_gbnf("root ::= \"ab\" \"c\"?\n");
  Constraint c(std::make_shared<const CompiledGrammar>(g, toy_vocab()));
  ASSERT_TRUE(c.accept_text("ab"));
  EXPECT_TRUE(c.can_end());
  EXPECT_FALSE(c.terminated());
  ASSERT_TRUE(c.accept_text("c"));
  EXPECT_TRUE(c.terminated());
  EXPECT_FALSE(c.accept_text("c"));  // rejected, state unchanged
  EXPECT_TRUE(c.terminated());
}

// A special token a grammar names (a chat format's marker) is allowed exactly where the
// grammar writes it, as a token of its own: never spelled by text, never by a negated class,
// and no other special token with it; the position masks, the full walk and accepting agree,
// and embedding a grammar carries its special tokens over. A token the vocabulary lacks is
// an error at compile time.
TEST(Grammar, SpecialTokensOnlyWhereTheGrammarNamesThem) {
  // ids: 0 "a", 1 "b", 2 "ab", 3 "<|x|>" (special), 4 "<|y|>" (special), 5 "x", 6 "<", 7 "<|x|>" as text
  const std::vector<std::string> bytes = {"a", "b", "ab", "", "", "x", "<", "<|x|>"};
  const auto vocab = std::make_shared<const TokenVocab>(bytes, std::unordered_map<std::string, TokenId>{{"<|x|>", 3}, {"<|y|>", 4}});
  Grammar g;
  const uint32_t root = g.add_rule("root"), text = g.add_rule("text");
  Sequence alt;
  Grammar::append_literal(alt, "a");
  alt.push_back(Symbol::ch(g.special_token("<|x|>")));
  alt.push_back(Symbol::ref(text));
  g.add_alt(root, alt);
  g.add_alt(text, {Symbol::chars({{'z', 'z'}}, /*negated=*/true), Symbol::ref(text)});  // [^z]*
  g.add_alt(text, {});
  g.set_root(root);
  EXPECT_NE(g.to_gbnf().find("<special <|x|>>"), std::string::npos) << g.to_gbnf();
  for (bool position_masks : {true, false}) {
    auto cg = std::make_shared<const CompiledGrammar>(g, vocab, position_masks);
    const auto allowed = [&](const CompiledGrammar::State& st) {
      std::vector<TokenId> ids;
      const std::shared_ptr<const TokenMask> m = cg->mask(st), full = cg->full_walk_mask(st);
      EXPECT_EQ(m->words, full->words);
      for (TokenId t = 0; t < vocab->size(); ++t)
        if (m->test(t)) ids.push_back(t);
      return ids;
    };
    Constraint c(cg);
    CompiledGrammar::State st = cg->initial(), next;
    EXPECT_EQ(allowed(st), (std::vector<TokenId>{0}));  // "a"; not "ab", no special token
    EXPECT_FALSE(c.accept(3));
    ASSERT_TRUE(c.accept(0));
    cg->step(st, 'a', next);
    EXPECT_EQ(allowed(next), (std::vector<TokenId>{3}));  // only <|x|>: not <|y|>, not its text
    EXPECT_FALSE(c.accept(4));
    EXPECT_FALSE(c.accept(7));
    EXPECT_FALSE(c.can_end());
    ASSERT_TRUE(c.accept(3));
    CompiledGrammar::State after;
    ASSERT_TRUE(cg->step_special(next, 3, after));
    EXPECT_FALSE(after.dead());
    EXPECT_FALSE(cg->step_special(next, 4, after));  // a token the grammar never writes
    // [^z]*: any text, but neither special token
    EXPECT_EQ(allowed(after), (std::vector<TokenId>{0, 1, 2, 5, 6, 7}));
    EXPECT_TRUE(c.can_end());
    EXPECT_FALSE(c.accept(3));
    EXPECT_FALSE(c.accept(4));
    ASSERT_TRUE(c.accept(7));  // the marker's text is text
  }
  // Embedded into a grammar with a special token of its own: the indices are remapped.
  Grammar outer;
  const uint32_t o = outer.add_rule("root");
  Sequence first = {Symbol::ch(outer.special_token("<|y|>"))};
  first.push_back(Symbol::ref(outer.embed(g, "inner-")));
  outer.add_alt(o, first);
  outer.set_root(o);
  ASSERT_EQ(outer.special_tokens(), (std::vector<std::string>{"<|y|>", "<|x|>"}));
  Constraint c(std::make_shared<const CompiledGrammar>(outer, vocab));
  EXPECT_FALSE(c.accept(3));
  ASSERT_TRUE(c.accept(4));
  ASSERT_TRUE(c.accept(0));
  EXPECT_FALSE(c.accept(4));
  EXPECT_TRUE(c.accept(3));
  // A special token the vocabulary lacks.
  Grammar missing;
  const uint32_t m = missing.add_rule("root");
  missing.add_alt(m, {Symbol::ch(missing.special_token("<|nope|>"))});
  missing.set_root(m);
  EXPECT_THROW(CompiledGrammar(missing, vocab), Error);
}

TEST(Grammar, ChoiceMatchesExactlyItsStrings) {
  const Grammar g = choice_grammar({"yes", "no", "maybe so"});
  for (const char* ok : {"yes", "no", "maybe so"}) EXPECT_TRUE(matches(g, ok));
  for (const char* no : {"ye", "yess", "maybe", ""}) EXPECT_FALSE(matches(g, no));
}

// Regexes against std::regex (ECMAScript) on every string over a small alphabet.
TEST(Grammar, RegexAgreesWithStdRegex) {
  const std::vector<std::string> patterns = {
      "a*b", "(ab|a)+c?", "[a-c]{2,3}", "a{2}|b{1,}", "[^a]b?", "(a|)(b|c)*", "\\d+", "a.c", "^(a|b)c$", "[ab-]+", "(?:ab){0,2}"};
  const std::string alphabet = "abc1-";
  std::vector<std::string> strings = {""};
  for (int len = 1; len <= 4; ++len) {
    std::vector<std::string> more;
    for (const auto& s : strings)
      if (int(s.size()) == len - 1)
        for (char ch : alphabet) more.push_back(s + ch);
    strings.insert(strings.end(), more.begin(), more.end());
  }
  for (const auto& p : patterns) {
    const Grammar g = regex_grammar(p);
    const std::regex re(p);
    for (const auto& s : strings) EXPECT_EQ(matches(g, s), std::regex_match(s, re)) << "pattern " << p << " on '" << s << "'";
  }
}

TEST(Grammar, RegexRefusesWhatItCannotGuarantee) {
  for (const char* p : {"(a)\\1", "a(?=b)", "\\bword", "a++", "a{3,2}", "(ab", "a)", "[b-a]", "x^y"})
    EXPECT_THROW(regex_grammar(p), Error) << p;
}

TEST(Grammar, IntegerRangesAreExact) {
  struct Case {
    Json schema;
    int lo, hi;  // expected inclusive range within the probe window
  };
  const std::vector<Case> cases = {
      {{{"type", "integer"}, {"minimum", 0}, {"maximum", 120}}, 0, 120},
      {{{"type", "integer"}, {"minimum", -37}, {"maximum", 205}}, -37, 205},
      {{{"type", "integer"}, {"minimum", -250}, {"maximum", -9}}, -250, -9},
      {{{"type", "integer"}, {"exclusiveMinimum", 7}, {"exclusiveMaximum", 100}}, 8, 99},
      {{{"type", "integer"}, {"minimum", 13}}, 13, 100000},
      {{{"type", "integer"}, {"maximum", -5}}, -100000, -5},
      {{{"type", "integer"}, {"minimum", 1.5}, {"maximum", 99.5}}, 2, 99},
  };
  for (const auto& c : cases) {
    const Grammar g = json_schema_grammar(c.schema);
    for (int v = -400; v <= 400; ++v) EXPECT_EQ(matches(g, std::to_string(v)), v >= c.lo && v <= c.hi) << c.schema.dump() << " " << v;
    for (const char* no : {"01", "-0", "+5", "1.0", ""}) EXPECT_FALSE(matches(g, no)) << c.schema.dump() << " " << no;
  }
  // An unbounded side stops at 18 digits.
  const Grammar above13 = json_schema_grammar({{"type", "integer"}, {"minimum", 13}});
  EXPECT_TRUE(matches(above13, "999999999999999999"));
  EXPECT_FALSE(matches(above13, "1000000000000000000"));
  EXPECT_TRUE(matches(json_schema_grammar({{"type", "integer"}}), "-999999999999999999"));
  EXPECT_FALSE(matches(json_schema_grammar({{"type", "number"}}), "1." + std::string(17, '1')));
  EXPECT_THROW(json_schema_grammar({{"type", "integer"}, {"minimum", 5}, {"maximum", 4}}), Error);
}

// Bounded numbers: every probe (sign, up to 3 integer digits, up to 5 fraction digits, trailing
// zeros included) is matched exactly when it is a JSON number without an exponent whose double
// lies within the bounds (-0 only where negatives are allowed); long decimals next to an exclusive bound are matched only when they
// read back as a double beyond it; prefixes that can still reach the range stay viable.
TEST(Grammar, NumberRangesAreExact) {
  struct Case {
    Json schema;
    double lo, hi;
    bool lo_open, hi_open;
  };
  const double inf = INFINITY;
  const std::vector<Case> cases = {
      {{{"type", "number"}, {"minimum", 0}, {"maximum", 1}}, 0, 1, false, false},
      {{{"type", "number"}, {"minimum", -2.5}, {"maximum", 3.25}}, -2.5, 3.25, false, false},
      {{{"type", "number"}, {"exclusiveMinimum", 0.1}, {"exclusiveMaximum", 0.9}}, 0.1, 0.9, true, true},
      {{{"type", "number"}, {"minimum", 0.15}}, 0.15, inf, false, false},
      {{{"type", "number"}, {"maximum", -1.05}}, -inf, -1.05, false, false},
      {{{"type", "number"}, {"minimum", -0.001}, {"maximum", 0.001}}, -0.001, 0.001, false, false},
      {{{"type", "number"}, {"minimum", 10}, {"maximum", 10}}, 10, 10, false, false},
      {{{"type", "number"}, {"exclusiveMinimum", -1}, {"maximum", 0}}, -1, 0, true, false},
      {{{"type", "number"}, {"minimum", 12.5}, {"exclusiveMaximum", 130}}, 12.5, 130, false, true},
      {{{"type", "number"}, {"minimum", -300.75}, {"maximum", -7}}, -300.75, -7, false, false},
  };
  const std::regex json_number("-?(0|[1-9][0-9]*)(\\.[0-9]+)?");
  std::mt19937 rng(7);
  std::vector<std::string> probes = {"0", "-0", "0.0", "-0.0", "1", "1.0", "0.1", "0.9", "0.10", "0.15", "0.149",
                                     "10", "10.0", "10.00001", "9.99999", "130", "129.9999", "12.5", "12.4999",
                                     "-1", "-1.0", "-0.9999", "-1.05", "-1.0500", "-1.04999", "3.25", "3.250", "3.2501",
                                     "-2.5", "-2.50001", "0.001", "-0.001", "0.0011", "-300.75", "-300.76", "-7",
                                     "-6.99999", "01", "1.", ".5", "+1", "1e2", "-", "", "1.5e0", "00.5"};
  for (int i = 0; i < 2000; ++i) {
    std::string p = rng() % 2 ? "-" : "";
    p += std::to_string(rng() % 4 == 0 ? rng() % 400 : rng() % 12);
    if (rng() % 3) {
      p += ".";
      for (int d = 1 + rng() % 5; d > 0; --d) p += char('0' + rng() % 10);
    }
    probes.push_back(p);
  }
  for (const auto& c : cases) {
    const Grammar g = json_schema_grammar(c.schema);
    for (const auto& p : probes) {
      bool want = std::regex_match(p, json_number);
      if (want) {
        const double v = std::stod(p);
        want = (c.lo_open ? v > c.lo : v >= c.lo) && (c.hi_open ? v < c.hi : v <= c.hi);
        if (p[0] == '-' && v == 0) want = want && c.lo < 0;  // a minus sign only where negatives are allowed
      }
      EXPECT_EQ(matches(g, p), want) << c.schema.dump() << " " << p;
    }
  }
  // Beside an exclusive bound, the decimal must read back as a double beyond it: 0.1 + 1e-17
  // is a larger decimal but reads as the double 0.1.
  const Grammar above = json_schema_grammar({{"type", "number"}, {"exclusiveMinimum", 0.1}});
  EXPECT_FALSE(matches(above, "0.1"));
  EXPECT_FALSE(matches(above, "0.10000000000000001"));
  EXPECT_TRUE(matches(above, "0.10000000000000002"));
  EXPECT_TRUE(matches(above, "0.1000000000000001"));
  EXPECT_TRUE(matches(above, "9999999999999999.5"));    // an unbounded side: 16 integer digits
  EXPECT_FALSE(matches(above, "10000000000000000"));
  // Prefixes that can still reach the range are viable, others are not.
  const Grammar mid = json_schema_grammar({{"type", "number"}, {"minimum", 0.15}, {"maximum", 0.5}});
  EXPECT_TRUE(judge(mid, "0.1").prefix);
  EXPECT_FALSE(judge(mid, "0.1").complete);
  EXPECT_FALSE(judge(mid, "0.0").prefix);
  EXPECT_FALSE(judge(mid, "0.6").prefix);
  EXPECT_FALSE(judge(mid, "1").prefix);
  EXPECT_TRUE(matches(mid, "0.5000"));
  EXPECT_FALSE(matches(mid, "0.5001"));
  // A bound finer than 32 fraction digits is moved inwards; tiny ranges still work.
  const Grammar tiny = json_schema_grammar({{"type", "number"}, {"minimum", 1e-40}, {"maximum", 1e-3}});
  EXPECT_FALSE(matches(tiny, "0"));
  EXPECT_TRUE(matches(tiny, "0.001"));
  EXPECT_TRUE(matches(tiny, "0.00000000000000000000000000000001"));
  // Impossible or unsupported bounds are errors naming the schema's place.
  for (const Json& bad : {Json{{"type", "number"}, {"minimum", 2}, {"maximum", 1}},
                          Json{{"type", "number"}, {"exclusiveMinimum", 1}, {"exclusiveMaximum", 1}},
                          Json{{"type", "number"}, {"minimum", 1e17}}, Json{{"type", "number"}, {"maximum", "1"}},
                          Json{{"type", "number"}, {"minimum", 1e-40}, {"maximum", 2e-40}}}) {
    try {
      json_schema_grammar(bad);
      ADD_FAILURE() << "accepted " << bad.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("JSON schema at '#"), std::string::npos) << e.what();
    }
  }
}

TEST(Grammar, JsonSchemaObjectsArraysStrings) {
  const Json schema = Json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 5},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "minItems": 1, "maxItems": 2},
      "when": {"type": "string", "format": "date"},
      "code": {"type": "string", "pattern": "[A-Z]{2}\"[0-9]"},
      "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pt"}]}
    },
    "required": ["name", "tags"],
    "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}
  })");
  const Grammar g = json_schema_grammar(schema);
  for (const char* ok : {R"({"name":"Al","tags":["a"]})", R"({ "name" : "éé", "tags" : [ "b" , 3 ] , "when":"2024-02-28" })",
                         R"({"name":"x\"\u00e9","tags":[3],"code":"AB\"7","next":{"x":-1.5e3}})",
                         R"({"name":"x","tags":["a"],"next":null})"})
    EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* no : {R"({"tags":["a"],"name":"x"})",                 // out of order
                         R"({"name":"","tags":["a"]})",                   // minLength
                         R"({"name":"abcdef","tags":["a"]})",             // maxLength
                         R"({"name":"x","tags":[]})",                     // minItems
                         R"({"name":"x","tags":["a","b","a"]})",          // maxItems
                         R"({"name":"x","tags":["c"]})",                  // enum
                         R"({"name":"x","tags":["a"],"when":"2024-02-30"})",
                         R"({"name":"x","tags":["a"],"code":"AB7"})",
                         R"({"name":"x","tags":["a"],"extra":1})",
                         R"({"name":"x","tags":["a"],"next":{}})",
                         R"({"name":"x"})"})
    EXPECT_FALSE(matches(g, no)) << no;
}

// The string formats beyond the date and time ones: strings each standard allows, and near
// misses it does not.
TEST(Grammar, JsonSchemaFormats) {
  const auto fmt = [](const char* f) { return json_schema_grammar({{"type", "string"}, {"format", f}}); };
  const auto q = [](const std::string& x) { return "\"" + x + "\""; };
  const Grammar host = fmt("hostname"), ip6 = fmt("ipv6"), dur = fmt("duration"), ip4 = fmt("ipv4");
  for (const char* ok : {"localhost", "a.b", "example.com", "my-host.example.co", "x1.y2.z3.w4", "A"})
    EXPECT_TRUE(matches(host, q(ok))) << ok;
  for (const char* no : {"", "-a", "a-", "a..b", "a.b.", ".a", "a_b", "a.b.c.d.e"})
    EXPECT_FALSE(matches(host, q(no))) << no;
  EXPECT_TRUE(matches(host, q(std::string(62, 'a'))));
  EXPECT_FALSE(matches(host, q(std::string(63, 'a'))));
  for (const char* ok : {"::", "::1", "1::", "fe80::1", "2001:db8::8a2e:370:7334", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::",
                         "1::8", "1:2:3:4:5:6::8", "::2:3:4:5:6:7:8", "ABCD:ef01::"})
    EXPECT_TRUE(matches(ip6, q(ok))) << ok;
  for (const char* no : {"", ":", ":::", "1:2:3:4:5:6:7", "1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", "g::", "1:2:3:4:5:6:7:8::"})
    EXPECT_FALSE(matches(ip6, q(no))) << no;
  for (const char* ok : {"P1D", "P1Y", "P1Y2M", "P1Y2M3D", "P1M", "P2W", "PT1H", "PT1H2M", "PT1H2M3S", "PT5M", "PT9S",
                         "P1DT2H", "P3Y6M4DT12H30M5S"})
    EXPECT_TRUE(matches(dur, q(ok))) << ok;
  for (const char* no : {"P", "PT", "1D", "P1", "PD", "P1S", "PT1D", "P1W2D", "P1D1Y", "PT1H1S", "P1DT", "P1.5D"})
    EXPECT_FALSE(matches(dur, q(no))) << no;
  EXPECT_TRUE(matches(ip4, q("192.168.0.255")));
  EXPECT_FALSE(matches(ip4, q("256.1.1.1")));
}

TEST(Grammar, JsonSchemaArrayCountsAreExact) {
  for (int min = 0; min <= 3; ++min)
    for (int max = -1; max <= 4; ++max) {
      if (max >= 0 && max < min) continue;
      Json schema = {{"type", "array"}, {"items", {{"type", "integer"}}}, {"minItems", min}};
      if (max >= 0) schema["maxItems"] = max;
      const Grammar g = json_schema_grammar(schema);
      std::string arr = "[";
      for (int n = 0; n <= 6; ++n) {
        const std::string text = arr + "]";
        EXPECT_EQ(matches(g, text), n >= min && (max < 0 || n <= max)) << schema.dump() << " " << text;
        arr += (n ? ", " : "") + std::to_string(n);
      }
    }
}

TEST(Grammar, JsonSchemaTuplesAndRecursion) {
  const Grammar tuple = json_schema_grammar(Json::parse(R"({"type":"array","prefixItems":[{"type":"integer"},{"type":"boolean"}],"items":false})"));
  EXPECT_TRUE(matches(tuple, "[1,true]"));
  EXPECT_TRUE(matches(tuple, "[1]"));
  EXPECT_TRUE(matches(tuple, "[]"));
  EXPECT_FALSE(matches(tuple, "[1,true,2]"));
  EXPECT_FALSE(matches(tuple, "[true]"));
  const Grammar tree = json_schema_grammar(Json::parse(
      R"({"$ref":"#/$defs/node","$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},"kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v"]}}})"));
  EXPECT_TRUE(matches(tree, R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[{"v":4}]}]})"));
  EXPECT_FALSE(matches(tree, R"({"v":1,"kids":[{"kids":[]}]})"));
}

TEST(Grammar, JsonObjectAcceptsAnyObject) {
  const Grammar g = json_object_grammar();
  for (const char* ok : {"{}", R"({"a":[1,2.5e-3,{"b":null}],"c":"\u0041\n","d":true})", "{ \"a\" : { } }"})
    EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* no : {"[]", "{\"a\":}", "{a:1}", "{\"a\":01}", "{\"a\":\"\x01\"}", "1"}) EXPECT_FALSE(matches(g, no)) << no;
  // Whitespace is what compact and pretty-printed JSON write, no more: a model cannot fill
  // its budget with it.
  EXPECT_TRUE(matches(g, "{\n" + std::string(24, ' ') + "\"a\": 1\n}"));
  EXPECT_TRUE(matches(g, "{\n\t\t\"a\" : [ 1, 2 ]\n}"));
  EXPECT_FALSE(judge(g, "{" + std::string(2, ' ')).prefix);
  EXPECT_FALSE(judge(g, "{\n\n").prefix);
  EXPECT_FALSE(judge(g, "{\n" + std::string(25, ' ')).prefix);
  // The reply starts with the value: no leading whitespace, for json_object and schemas alike.
  EXPECT_FALSE(judge(g, " ").prefix);
  EXPECT_FALSE(judge(g, "\n").prefix);
  const Grammar s = json_schema_grammar(Json::parse(R"({"type":"object","properties":{"a":{"type":"integer"}}})"));
  EXPECT_FALSE(judge(s, " ").prefix);
  EXPECT_FALSE(matches(s, " {\"a\":1}"));
  EXPECT_TRUE(matches(s, "{\"a\":1}"));
}

TEST(Grammar, JsonSchemaRefusesWhatItCannotEnforce) {
  for (const char* s : {R"({"type":"number","multipleOf":0.5})", R"({"not":{"type":"string"}})", R"({"type":"array","uniqueItems":true})",
                        R"({"type":"string","format":"uri"})", R"({"$ref":"#/$defs/missing"})",
                        R"({"$ref":"https://example.com/s.json"})", R"({"allOf":[{"type":"string"},{"maxLength":2}]})",
                        R"({"type":"object","properties":{"a":{}},"required":["b"]})", R"({"type":"frob"})", "false",
                        R"({"type":"object","nullable":["a"]})"}) {  // (found by fuzz_request: a type_error escaped)
    try {
      json_schema_grammar(Json::parse(s));
      ADD_FAILURE() << "accepted " << s;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("JSON schema at '#"), std::string::npos) << e.what();
    }
  }
}

// The mask equals trying each token on its own, in every state of random walks.
TEST(Grammar, MaskEqualsTryingEveryToken) {
  const auto vocab = toy_vocab();
  const std::vector<Grammar> grammars = {
      json_schema_grammar(Json::parse(R"({"type":"object","properties":{"a":{"type":"string","maxLength":3},"b":{"type":"array","items":{"type":"integer","minimum":-5,"maximum":30}}},"required":["a"]})")),
      regex_grammar("(é|€)+[a-c]{1,3}!?"),
      parse_gbnf("root ::= (\"ab\" | [0-9])* \"\\n\"\n"),
  };
  std::mt19937 rng(7);
  for (const auto& g : grammars) {
    auto cg = std::make_shared<const CompiledGrammar>(g, vocab);
    for (int walk = 0; walk < 20; ++walk) {
      Constraint c(cg);
      std::string text;
      for (int step = 0; step < 40 && !c.terminated(); ++step) {
        const auto mask = c.allowed();
        std::vector<TokenId> allowed;
        for (TokenId t = 0; t < vocab->size(); ++t) {
          Constraint probe = c;
          const bool ok = probe.accept(t);
          EXPECT_EQ(mask->test(t), ok) << g.to_gbnf() << " token '" << vocab->bytes(t) << "' at step " << step;
          if (ok) allowed.push_back(t);
        }
        if (allowed.empty()) {
          // A state the mask led to always continues or ends: no partial character or
          // prefix without a completion is ever allowed.
          EXPECT_TRUE(c.can_end()) << "stuck after '" << text << "'";
          break;
        }
        const TokenId t = allowed[rng() % allowed.size()];
        ASSERT_TRUE(c.accept(t));
        text += vocab->bytes(t);
      }
    }
  }
}

// The mask from per-position masks (accepted whatever lies below + the dependent tokens
// walked from the real stacks) equals one walk over the whole vocabulary, state for state,
// on real vocabularies: the bundled model's, and Qwen3's 151k tokens when ../shared is there.
// The grammars put the same positions under many stacks: nested and recursive values, the
// same string field at several depths, bounded strings and counts, nullable rules at the end
// of alternatives, and a position whose rule ends the sentence.
TEST(Grammar, PositionMasksEqualTheFullWalk) {
  const fs::path shared = kRepo / ".." / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json";
  std::vector<fs::path> toks = {kRepo / "models" / "kvlm-tiny" / "tokenizer.json"};
  if (fs::exists(shared)) toks.push_back(shared);
  const std::vector<Grammar> grammars = {
      json_schema_grammar(Json::parse(R"({"type":"object","properties":{
        "name":{"type":"string","maxLength":6},"n":{"type":"integer","minimum":-20,"maximum":300},
        "kids":{"type":"array","items":{"$ref":"#"},"maxItems":2},"tag":{"enum":["a b","c\"d",null,7]},
        "x":{"type":"number"}},"required":["name"]})")),
      json_object_grammar(),
      regex_grammar("([a-z]+ ?){1,4}(\\.|!)"),
      parse_gbnf("root ::= item (\", \" item)* tail\nitem ::= [a-z]* | \"'\" [^']* \"'\"\ntail ::= \"\" | \"!\"\n"),
  };
  for (const fs::path& path : toks) {
    const Tokenizer tok = Tokenizer::load(path);
    const auto vocab = std::make_shared<const TokenVocab>(tok, tok.vocab_size());
    const int walks = vocab->size() > 100000 ? 3 : 12, steps = vocab->size() > 100000 ? 24 : 40;
    std::mt19937 rng(11);
    for (const Grammar& g : grammars) {
      auto cg = std::make_shared<const CompiledGrammar>(g, vocab);
      for (int w = 0; w < walks; ++w) {
        CompiledGrammar::State st = cg->initial(), next;
        std::string text;
        for (int i = 0; i < steps && !CompiledGrammar::terminated(st); ++i) {
          const auto mask = cg->mask(st);
          const auto want = cg->full_walk_mask(st);
          ASSERT_EQ(mask->words, want->words) << path << ": " << g.to_gbnf() << "\nafter '" << text << "'";
          std::vector<TokenId> allowed;
          for (TokenId t = 0; t < vocab->size(); ++t)
            if (mask->test(t)) allowed.push_back(t);
          if (allowed.empty()) break;
          // Mostly short tokens (as models write JSON), sometimes any.
          TokenId t = allowed[rng() % allowed.size()];
          for (int k = 0; k < 4 && rng() % 3 && vocab->bytes(t).size() > 2; ++k) t = allowed[rng() % allowed.size()];
          for (char c : vocab->bytes(t)) {
            cg->step(st, uint8_t(c), next);
            ASSERT_FALSE(next.dead());
            std::swap(st, next);
          }
          text += vocab->bytes(t);
        }
      }
      EXPECT_GT(cg->num_position_masks(), 0u);
    }
  }
}

TEST(Grammar, IncompleteCharactersNeedAPossibleCompletion) {
  // A lone lead byte is allowed only where some code point it starts may follow: E0 starts
  // U+0800..U+0FFF only (E0 80 80 would be an overlong 0), F0 U+10000 and above.
  const auto vocab = toy_vocab();
  const auto allowed = [&](const Grammar& g, const char* bytes) {
    Constraint c(std::make_shared<const CompiledGrammar>(g, vocab));
    for (TokenId t = 0; t < vocab->size(); ++t)
      if (vocab->bytes(t) == bytes) return c.allowed()->test(t);
    ADD_FAILURE() << "no token " << bytes;
    return false;
  };
  const Grammar ascii = parse_gbnf(R"(root ::= [\x00-\x7F]+)");
  for (const char* b : {"\xE0", "\xF0", "\xC2", "\xC3"}) EXPECT_FALSE(allowed(ascii, b)) << "ascii";
  const Grammar bmp = parse_gbnf(R"(root ::= [\u0800-\uFFFF])");
  EXPECT_TRUE(allowed(bmp, "\xE0"));
  EXPECT_FALSE(allowed(bmp, "\xF0"));
  EXPECT_FALSE(allowed(bmp, "\xC3"));
  const Grammar not_brace = parse_gbnf("root ::= [^{]\n");
  for (const char* b : {"\xE0", "\xF0", "\xC3", "\xF4"}) EXPECT_TRUE(allowed(not_brace, b));
}

TEST(Grammar, AmbiguityIsBoundedNotHung) {
  // After n a's every sequence of n pending closers is a parse: 2^n stacks, until the limit.
  const Grammar g = parse_gbnf("root ::= x\nx ::= \"a\" x \"b\" | \"a\" x \"c\" | \"\"\n");
  Constraint c(std::make_shared<const CompiledGrammar>(g, toy_vocab()));
  EXPECT_THROW(
      {
        for (int i = 0; i < 200; ++i) c.accept_text("a");
      },
      Error);
}

// Token bytes are what decoding writes: concatenated over a text's tokens they give the text.
TEST(Grammar, TokenBytesSpellTheText) {
  const std::string text = "Once upon a time, héllo wörld — 3.14 {\"k\": [1, 2]}\n\tend";
  // The bundled model's byte-level BPE; Qwen3's (byte-level) and Phi-3's (SentencePiece with
  // byte fallback) from ../shared when it is beside the repository.
  const fs::path shared = kRepo / ".." / "shared" / "data" / "tokenizers";
  std::vector<fs::path> dirs = {kRepo / "models" / "kvlm-tiny"};
  for (const char* t : {"qwen3", "phi3-mini"})
    if (fs::exists(shared / t / "tokenizer.json")) dirs.push_back(shared / t);
  for (const fs::path& dir : dirs) {
    const Tokenizer tok = Tokenizer::load(dir / "tokenizer.json");
    const auto ids = tok.encode(text, {.add_special_tokens = false});
    std::string joined;
    for (TokenId id : ids) joined += tok.token_bytes(id);
    // SentencePiece models write a prefix space before the first word.
    if (joined.starts_with(' ') && !text.starts_with(' ')) joined.erase(0, 1);
    EXPECT_EQ(joined, text) << dir;
  }
}


// ---- limits: what a client's grammar may cost (issue 47's attacks) ----------------------

using test::error_of;

TEST(GrammarLimits, NestingIsRefusedNotRecursedInto) {
  const int deep = 20000;  // crashed the server (stack overflow) before the limit
  const std::string regex = std::string(deep, '(') + "a" + std::string(deep, ')');
  EXPECT_NE(error_of([&] { regex_grammar(regex); }).find("nested deeper than 256"), std::string::npos);
  const std::string gbnf = "root ::= " + std::string(deep, '(') + "\"a\"" + std::string(deep, ')') + "\n";
  EXPECT_NE(error_of([&] { parse_gbnf(gbnf); }).find("nested deeper than 256"), std::string::npos);
  const Json schema = {{"type", "string"}, {"pattern", regex}};
  EXPECT_NE(error_of([&] { json_schema_grammar(schema); }).find("nested deeper than 256"), std::string::npos);
  // Within the limit, nesting works; and a long regex is not quoted whole in the message.
  EXPECT_TRUE(matches(regex_grammar(std::string(200, '(') + "a" + std::string(200, ')')), "a"));
  EXPECT_LT(error_of([&] { regex_grammar(regex); }).size(), 400u);
}

TEST(GrammarLimits, ALongChainOfRulesCompilesInLinearTimeAndFailsCleanly) {
  // r0 ::= r1 "x", r1 ::= r2 "x", ...: each rule starts with the next. The fixed points took
  // N^2 (22 s at 60,000), and expanding the chain recursed once per rule (a crash).
  const int n = 60000;
  std::string text = "root ::= r0\n";
  for (int i = 0; i < n; ++i) text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"x\"\n";
  text += "r" + std::to_string(n) + " ::= \"y\"\n";
  const auto t0 = std::chrono::steady_clock::now();
  const Grammar g = parse_gbnf(text);
  auto cg = std::make_shared<const CompiledGrammar>(g, toy_vocab());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0);  // a generous bound for a sanitizer build: it is ~0.1 s here
  // The initial state would hold a stack 60,000 entries deep: refused, not a crash.
  EXPECT_NE(error_of([&] { cg->initial(); }).find("nests deeper than"), std::string::npos);
  // A chain within the stack limit matches what it should.
  std::string small = "root ::= r0\n";
  for (int i = 0; i < 500; ++i) small += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"x\"\n";
  small += "r500 ::= \"y\"\n";
  EXPECT_TRUE(matches(parse_gbnf(small), "y" + std::string(500, 'x')));
  EXPECT_FALSE(matches(parse_gbnf(small), "y" + std::string(499, 'x')));
}

TEST(GrammarLimits, NullableChainsAndRunsAreLinear) {
  // r_i ::= r_{i+1} | "a": every rule nullable only through the whole chain.
  const int n = 50000;
  std::string text = "root ::= r0 \"!\"\n";
  for (int i = 0; i < n; ++i) text += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " | \"a\"\n";
  text += "r" + std::to_string(n) + " ::= \"\"\n";
  Grammar g = parse_gbnf(text);
  const std::vector<char> nullable = g.nullable_rules();
  EXPECT_TRUE(nullable[g.rule_named("r0")]);
  EXPECT_TRUE(nullable[g.rule_named("r25000")]);
  EXPECT_FALSE(nullable[g.root()]);
  // A run of 100,000 nullable references in one alternative (FOLLOW's suffixes, once N^2).
  std::string run = "root ::= ";
  for (int i = 0; i < 100000; ++i) run += "e ";
  run += "\"z\"\ne ::= \"q\"?\n";
  const auto t0 = std::chrono::steady_clock::now();
  const Grammar rg = parse_gbnf(run);
  CompiledGrammar cg(rg, toy_vocab());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

TEST(GrammarLimits, SizeIsCappedBeforeTheMemoryIsTaken) {
  // A choice list of 10,000 long strings grew the heap by ~1 GB before.
  std::vector<std::string> many(10000, std::string(1000, 'a'));
  for (size_t i = 0; i < many.size(); ++i) many[i] += std::to_string(i);
  EXPECT_NE(error_of([&] { choice_grammar(many); }).find("characters in all"), std::string::npos);
  EXPECT_NE(error_of([&] {
              Sequence s;
              Grammar::append_literal(s, std::string(kMaxSymbols + 1, 'x'));
            }).find("longer than"),
            std::string::npos);
  // A GBNF text that repeats its way past the symbol budget.
  EXPECT_NE(error_of([&] { parse_gbnf("root ::= (\"abcdefgh\"){100000} (\"ijk\"){100000} (\"x\"){100000}\n"); }).find("symbols"), std::string::npos);
}

TEST(GrammarLimits, ChoicesShareTheirPrefixes) {
  // 10,000 choices: one parse per distinct next character (the matcher refused more than
  // 4,096 parses at once, so a long choice list was "too ambiguous").
  std::vector<std::string> labels;
  for (int i = 0; i < 10000; ++i) labels.push_back("label-" + std::to_string(i));
  labels.push_back("label");
  labels.push_back("");
  labels.push_back("label-7");  // a duplicate
  const Grammar g = choice_grammar(labels);
  auto cg = std::make_shared<const CompiledGrammar>(g, toy_vocab());
  EXPECT_LE(cg->initial().num_stacks(), 2u);
  for (const char* ok : {"label-0", "label-9999", "label-42", "label", ""}) EXPECT_TRUE(matches(g, ok)) << ok;
  for (const char* no : {"label-10000", "label-", "labe", "label-0a", "x"}) EXPECT_FALSE(matches(g, no)) << no;
  EXPECT_TRUE(judge(g, "label-99").prefix);
  // Shared prefixes and one choice a prefix of another.
  const Grammar h = choice_grammar({"ab", "abc", "abd", "b", "abcde"});
  for (const char* ok : {"ab", "abc", "abd", "b", "abcde"}) EXPECT_TRUE(matches(h, ok)) << ok;
  for (const char* no : {"a", "abcd", "abde", "bb", ""}) EXPECT_FALSE(matches(h, no)) << no;
}

TEST(GrammarLimits, MaskDeadlineThrowsGrammarTimeout) {
  auto cg = std::make_shared<const CompiledGrammar>(parse_gbnf("root ::= [a-z]+\n"), toy_vocab());
  cg->set_deadline(std::chrono::steady_clock::now() - std::chrono::seconds(1));
  EXPECT_THROW(cg->mask(cg->initial()), GrammarTimeout);
  cg->set_deadline(std::nullopt);
  EXPECT_GT(cg->mask(cg->initial())->count(), 0);
  EXPECT_GT(cg->table_bytes(), 0u);
}

}  // namespace
}  // namespace kvlm::grammar

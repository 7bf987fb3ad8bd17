// Context-free grammars over Unicode code points: what structured outputs constrain
// generation with. A Grammar is a set of rules, each a list of alternatives, each a sequence
// of symbols: a character class (ranges of code points, possibly negated) or a reference to
// a rule. JSON schemas (json_schema.h), regular expressions (regex.h), choices and GBNF text
// (llama.cpp's grammar format, parsed here) all become one. The matcher (matcher.h) runs it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvlm::grammar {

// What any grammar may cost, whoever wrote it (a request's structured output is the client's
// text): nesting of ( ) groups in a regex or GBNF text, symbols over all alternatives (each
// ~100 bytes here and in the compiled grammar), and rules. Every front end refuses more with
// a kvlm::Error naming the limit, before the memory is taken.
constexpr int kMaxNesting = 256;
constexpr size_t kMaxSymbols = size_t(1) << 18;
constexpr size_t kMaxRules = 200000;

// Special tokens (a chat format's markers, such as harmony's <|constrain|> and <|message|>)
// are not text that characters could spell. A grammar that must write one names it by its
// text (Grammar::special_token), and it stands in the grammar as one code point past
// Unicode's, kSpecialTokenBase + its index in the grammar's list; the compiled grammar finds
// the token's id in its vocabulary and allows that token, and only it, there. Negated classes
// never match these code points, and no UTF-8 text decodes to them.
constexpr uint32_t kSpecialTokenBase = 0x110000;

struct CharRange {
  uint32_t lo, hi;  // inclusive code points
};

struct Symbol {
  enum class Kind : uint8_t { Chars, Ref };
  Kind kind = Kind::Chars;
  bool negated = false;            // Chars: every code point except the ranges
  uint32_t rule = 0;               // Ref
  std::vector<CharRange> ranges;   // Chars

  static Symbol chars(std::vector<CharRange> ranges, bool negated = false);
  static Symbol ch(uint32_t cp) { return chars({{cp, cp}}); }
  static Symbol ref(uint32_t rule);
};
using Sequence = std::vector<Symbol>;

class Grammar {
 public:
  // A new rule without alternatives; `name` is made unique ("value", "value-2", ...).
  uint32_t add_rule(std::string_view name);
  // The rule called `name`, created (without alternatives) when there is none.
  uint32_t rule_named(std::string_view name);
  bool has_rule(std::string_view name) const { return by_name_.count(std::string(name)) > 0; }
  void add_alt(uint32_t rule, Sequence alt) {
    count_symbols(alt.size());
    rules_[rule].alts.push_back(std::move(alt));
  }
  void set_root(uint32_t rule) { root_ = rule; }

  uint32_t root() const { return root_; }
  size_t num_rules() const { return rules_.size(); }
  const std::string& name(uint32_t rule) const { return rules_[rule].name; }
  const std::vector<Sequence>& alts(uint32_t rule) const { return rules_[rule].alts; }

  size_t num_symbols() const { return symbols_; }

  // Builders that append to a sequence (throwing kvlm::Error past kMaxSymbols).
  static void append_literal(Sequence& s, std::string_view utf8);
  // `item` repeated min..max times (max < 0: unbounded). Helper rules are named after `hint`.
  void append_repeat(Sequence& s, const Sequence& item, int min, int max, std::string_view hint);
  // A rule with the given alternatives, referenced from `s`.
  void append_group(Sequence& s, std::vector<Sequence> alts, std::string_view hint);
  // Any text that does not contain `tag` (ASCII), then the tag, then `then`: the tag's
  // matching automaton (Knuth-Morris-Pratt) as one rule per state, so a reasoning block or
  // an XML value is free text up to its closing tag. Returns the start rule.
  uint32_t add_text_until(std::string_view tag, const Sequence& then, std::string_view hint);

  // Copies `other`'s rules into this grammar (names prefixed) and returns the rule its root
  // became: grammars built separately (a tool's arguments schema) compose into one. Its
  // special tokens join this grammar's list.
  uint32_t embed(const Grammar& other, std::string_view prefix);

  // The code point standing for the special token `text` (kSpecialTokenBase + its index,
  // added on first use): Symbol::ch of it writes that token.
  uint32_t special_token(std::string_view text);
  const std::vector<std::string>& special_tokens() const { return specials_; }

  // Per rule: whether it can match the empty string (linear in the grammar's size).
  std::vector<char> nullable_rules() const;

  // Throws kvlm::Error naming the rule: a rule without alternatives (an undefined name),
  // a rule that can reach itself without consuming a character (left recursion, which a
  // top-down matcher cannot run), or more rules than the matcher handles.
  void validate() const;
  // GBNF text of the grammar (for messages and tests).
  std::string to_gbnf() const;

 private:
  struct Rule {
    std::string name;
    std::vector<Sequence> alts;
  };
  void count_symbols(size_t n);
  std::vector<Rule> rules_;
  std::unordered_map<std::string, uint32_t> by_name_;
  std::vector<std::string> specials_;  // special_token's texts, by index
  uint32_t root_ = 0;
  size_t symbols_ = 0;
};

// llama.cpp's GBNF: `name ::= alternatives` with "literals", [character classes], ., rule
// names, ( groups ), | and the postfix operators * + ? {m} {m,} {m,n}; # comments. The
// rule named `root` is the start. Throws kvlm::Error with the line and column of a mistake.
Grammar parse_gbnf(std::string_view text);

// The choices matched literally, as a trie (choices sharing a prefix share its rule), so that
// the matcher follows one parse per distinct next character, not one per choice.
Grammar choice_grammar(const std::vector<std::string>& choices);

// Pieces of syntax the GBNF and regex parsers share. `fail` throws kvlm::Error with the
// parser's position in the message.
using Fail = std::function<void(const std::string&)>;
struct Repeat {
  int min = 0, max = -1;  // max < 0: unbounded
};
// The postfix operator at text[pos] (* + ? {m} {m,} {m,n}), consumed; nullopt when there is
// none. `brace_needs_digit`: a '{' not followed by a digit is not an operator (regexes).
std::optional<Repeat> parse_repeat(std::string_view text, size_t& pos, int max_count, bool brace_needs_digit, const Fail& fail);
// `digits` hex digits at text[pos], consumed: a code point up to U+10FFFF.
uint32_t parse_hex(std::string_view text, size_t& pos, int digits, const Fail& fail);

// UTF-8 helpers shared by the parsers: the code point at s[i] (advancing i); invalid bytes
// throw kvlm::Error with `what` in the message.
uint32_t next_code_point(std::string_view s, size_t& i, std::string_view what);
void append_utf8(std::string& out, uint32_t cp);

}  // namespace kvlm::grammar

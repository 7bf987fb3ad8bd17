// Regular expressions as grammar rules, for structured outputs' `regex` and JSON schema's
// `pattern`. The syntax is the common core of ECMAScript / Python regexes: literals and
// escapes (\d \w \s and their negations, \n \t \xHH \uHHHH, escaped punctuation), classes
// [a-z] [^...], the dot (any character but a newline), groups (...) (?:...) (?<name>...),
// alternation, and the quantifiers * + ? {n} {n,} {n,m} (lazy forms match the same strings).
// The whole text must match (a leading ^ and a trailing $ are allowed and change nothing).
// Backreferences, lookaround, word boundaries and possessive quantifiers are refused: the
// generated text could not be guaranteed to match them.
#pragma once

#include <string_view>

#include "text/grammar/grammar.h"

namespace kvlm::grammar {

// Adds to `g` a rule matching `pattern` and returns it. `json_string`: the rule matches the
// pattern's strings as they are written inside a JSON string (literal characters that JSON
// escapes are written as escapes; character classes leave them out). Throws kvlm::Error
// naming the position of what is not supported.
uint32_t add_regex(Grammar& g, std::string_view pattern, std::string_view rule_name, bool json_string = false);

Grammar regex_grammar(std::string_view pattern);

}  // namespace kvlm::grammar

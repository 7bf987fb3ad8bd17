// Tokenizer for the jinja2 syntax, configured as transformers configures jinja2 for chat
// templates: default delimiters, trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False. It reproduces jinja2's lexer rule for rule (including its
// whitespace-control corner cases), so the text between tags comes out byte for byte as
// jinja2 would emit it. Comments are dropped; {% raw %} blocks become plain text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvlm::jinja {

enum class Tok : uint8_t {
  Data,        // template text
  VarBegin,    // {{
  VarEnd,      // }}
  BlockBegin,  // {%
  BlockEnd,    // %}
  Name,
  String,      // text holds the decoded value
  Integer,     // ival
  Float,       // fval
  Op,          // text holds the operator: + - * / // % ** ~ [ ] ( ) { } == != < <= > >= = . : | , ;
  Eof,
};

struct Token {
  Tok type = Tok::Eof;
  std::string text;
  int64_t ival = 0;
  double fval = 0;
  int line = 1, col = 1;
};

// What jinja2 does to a template source first: \r\n and \r become \n, and one trailing
// newline is dropped.
std::string normalize_template_source(std::string_view source);

// Tokenizes a normalized source. Throws kvlm::Error "<name>:<line>:<col>: ..." on a lexical
// error (unterminated comment/string, unbalanced brackets, a character that starts no token).
std::vector<Token> tokenize(std::string_view source, const std::string& name);

// Python's unicode-escape decoding of a string literal body (\n, \t, \xhh, \uhhhh,
// \Uhhhhhhhh, octal, \<newline>; unknown escapes stay as written). Throws std::runtime_error
// on a malformed \x/\u/\U escape.
std::string decode_string_literal(std::string_view body);

// A human description of a token for error messages: "name 'foo'", "'}}'", "end of template".
std::string describe(const Token& t);

}  // namespace kvlm::jinja

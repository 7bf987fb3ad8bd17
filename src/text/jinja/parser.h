// Parser for the jinja2 subset that chat templates use (see chat_template.h for the list).
// Grammar and operator precedence follow jinja2/parser.py production for production,
// including its quirks (filters bind tighter than arithmetic: `a + b | trim` is
// `a + (b | trim)`; `for x in xs if cond` filters; `not x is defined` is
// `not (x is defined)`).
//
// Everything that can fail before rendering fails here, with "<name>:<line>:<col>: ...":
// syntax errors, unclosed blocks, unknown tags, filters and tests, and the jinja2 features
// kvlm does not implement (include/import/extends/block/call, recursive loops, *args).
#pragma once

#include <string>
#include <string_view>

#include "text/jinja/ast.h"

namespace kvlm::jinja {

Template parse_template(std::string_view source, std::string name);

}  // namespace kvlm::jinja

// The interpreter: renders a parsed template with a context, as jinja2's
// ImmutableSandboxedEnvironment does under transformers' apply_chat_template.
//
// Scoping follows jinja2: {% if %} shares its enclosing scope; every iteration of a
// {% for %} body, every macro call and {% with %} gets a fresh scope whose lookups fall
// back to the enclosing one, so a {% set %} inside a loop is gone at the next iteration
// and after the loop (namespace() attributes are the way out, as in jinja2).
//
// Globals: range, namespace, dict, joiner, raise_exception(msg) (throws
// kvlm::Error("<name>: " + msg)) and strftime_now(fmt) (transformers' helper).
#pragma once

#include <ctime>
#include <optional>
#include <string>

#include "text/jinja/ast.h"

namespace kvlm::jinja {

struct RenderOptions {
  std::optional<std::tm> now;  // what strftime_now() formats; unset = the current local time
  // The budget of one render: statements and expressions evaluated, and bytes written. A
  // template that loops (nested range() loops) or writes without end fails with an error
  // instead of holding a server thread; real chat templates take ~10^2 steps per message.
  int64_t max_steps = 5'000'000;
  size_t max_output_bytes = size_t(64) << 20;
};

// `context` must be a dict. Errors are kvlm::Error "<name>:<line>:<col>: <what went wrong>".
std::string render(const Template& tpl, const Value& context, const RenderOptions& options);

}  // namespace kvlm::jinja

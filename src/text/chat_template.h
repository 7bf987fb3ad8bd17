// Hugging Face chat templates, rendered byte for byte as transformers' apply_chat_template
// renders them with Python's jinja2 (ImmutableSandboxedEnvironment, trim_blocks=True,
// lstrip_blocks=True, transformers' tojson / raise_exception / strftime_now, loop controls),
// by a C++ interpreter of the jinja2 subset chat templates use (src/text/jinja/).
//
// Supported: {{ }}, {% %}, {# #}, whitespace control (-/+), {% raw %}; if/elif/else;
// for/else with loop.* (index, index0, revindex, revindex0, first, last, length, previtem,
// nextitem, cycle), unpacking, `if` filters, break/continue; set (names, tuples,
// namespace attributes, blocks); macro with defaults and keyword arguments; filter and
// with blocks; transformers' {% generation %}; every expression form (literals, [] {} (),
// subscripts, slices, attribute access, calls, filters, tests, `a if c else b`, and/or/not,
// in/not in, chained comparisons, + - * / // % ** ~); Python semantics for values, str(),
// repr(), ==, ordering and truthiness; str/dict/list methods; the filters and tests listed
// in jinja/filters.h; globals range, namespace, dict, joiner, raise_exception, strftime_now.
//
// Not supported (load-time errors): include/import/extends/block/call, recursive loops,
// *args/**kwargs calls, and the jinja2 filters named in jinja/filters.cpp
// (is_unsupported_jinja_filter). Integers are 64-bit.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace kvlm {

namespace jinja {
struct Template;
}

struct ChatTemplateRenderOptions {
  // The local time strftime_now() formats; unset means now. Tests fix it so that templates
  // printing today's date (Llama 3.2, Mistral Small) render reproducibly.
  std::optional<std::tm> now;
};

class ChatTemplate {
 public:
  // Parses the whole template now; unsupported syntax or a syntax error throws kvlm::Error
  // "<name>:<line>:<col>: <what was found>", at load time, never at render time.
  static ChatTemplate parse(std::string_view source, std::string name = "chat template");

  // Renders with `context`, a JSON object: messages, tools, add_generation_prompt, bos_token,
  // eos_token, enable_thinking, any --set variables... (transformers passes messages, tools,
  // documents, add_generation_prompt and the special tokens). raise_exception(msg) in the
  // template throws kvlm::Error("<name>: " + msg); other rendering errors throw kvlm::Error
  // "<name>:<line>:<col>: <message>".
  //
  // Key order matters to templates (`tool | tojson` prints keys in order): nlohmann::json
  // sorts object keys, nlohmann::ordered_json keeps the order of the input document as
  // Python's json.loads does. Parse requests with ordered_json to match transformers.
  std::string render(const nlohmann::json& context, const ChatTemplateRenderOptions& options = {}) const;
  std::string render(const nlohmann::ordered_json& context, const ChatTemplateRenderOptions& options = {}) const;

  const std::string& name() const;

 private:
  std::shared_ptr<const jinja::Template> tpl_;
};

}  // namespace kvlm

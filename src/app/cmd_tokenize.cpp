// kvlm tokenize / detokenize / render-template: the text tools on their own.
#include <fstream>
#include <optional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "config/model_config.h"
#include "core/error.h"
#include "text/text_processor.h"

namespace kvlm::app {

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot read '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A tokenizer.json (a file, or a directory holding one) or a GGUF file's tokenizer.
struct LoadedTokenizer {
  explicit LoadedTokenizer(const std::string& path) {
    if (find_gguf(path)) text.emplace(TextProcessor::load(path));
    else plain.emplace(Tokenizer::load(path));
  }
  const Tokenizer& get() const { return text ? text->tokenizer() : *plain; }
  std::optional<TextProcessor> text;
  std::optional<Tokenizer> plain;
};

}  // namespace

CLI::App* add_tokenize(CLI::App& app, TokenizeFlags& f) {
  auto* cmd = app.add_subcommand("tokenize", "Print the token ids of a text");
  cmd->add_option("--tokenizer", f.tokenizer, "a directory holding tokenizer.json (a model directory works), or a .gguf file")->required();
  auto* t = cmd->add_option("--text", f.text, "the text");
  auto* file = cmd->add_option("--file", f.file, "read the text from a file");
  t->excludes(file);
  cmd->add_flag("--add-special-tokens", f.add_special_tokens, "apply the tokenizer's post-processor (BOS/EOS)");
  cmd->add_flag("--json", f.json, "print {\"ids\": [...]}");
  return cmd;
}

int run_tokenize(const TokenizeFlags& f) {
  if (f.text.empty() && f.file.empty()) throw Error("give --text STR or --file F");
  const LoadedTokenizer loaded(f.tokenizer);
  const Tokenizer& tok = loaded.get();
  const std::string text = f.file.empty() ? f.text : read_file(f.file);
  const auto ids = tok.encode(text, {.add_special_tokens = f.add_special_tokens});
  if (f.json) {
    std::cout << nlohmann::json{{"ids", ids}}.dump() << "\n";
  } else {
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
    std::cout << "\n";
  }
  return 0;
}

CLI::App* add_detokenize(CLI::App& app, TokenizeFlags& f) {
  auto* cmd = app.add_subcommand("detokenize", "Print the text of token ids");
  cmd->add_option("--tokenizer", f.tokenizer, "a directory holding tokenizer.json (a model directory works), or a .gguf file")->required();
  cmd->add_option("--ids", f.ids, "token ids, e.g. 9707,1879")->required();
  cmd->add_flag("--skip-special-tokens", f.skip_special_tokens, "leave special tokens out");
  cmd->add_flag("--json", f.json, "print {\"text\": ...}");
  return cmd;
}

int run_detokenize(const TokenizeFlags& f) {
  const LoadedTokenizer loaded(f.tokenizer);
  const std::string text = loaded.get().decode(parse_token_ids(f.ids), f.skip_special_tokens);
  if (f.json)
    std::cout << nlohmann::json{{"text", text}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  else
    std::cout << text << "\n";
  return 0;
}

CLI::App* add_render_template(CLI::App& app, TemplateFlags& f) {
  auto* cmd = app.add_subcommand("render-template", "Render a chat template for a list of messages");
  auto* t = cmd->add_option("--template", f.template_file, "a .jinja chat template file");
  auto* tk = cmd->add_option("--tokenizer", f.tokenizer, "a directory whose tokenizer_config.json holds the template, or a .gguf file");
  t->excludes(tk);
  cmd->add_option("--messages", f.messages, "a JSON file: a list of {role, content} messages (or {\"messages\": [...], ...})")
      ->required();
  cmd->add_flag("--add-generation-prompt", f.add_generation_prompt, "end with the assistant's turn header");
  cmd->add_option("--set", f.set, "a template variable NAME=VALUE (VALUE as JSON when it parses, e.g. enable_thinking=false)");
  return cmd;
}

int run_render_template(const TemplateFlags& f) {
  if (f.template_file.empty() && f.tokenizer.empty()) throw Error("give --template FILE.jinja or --tokenizer DIR");
  nlohmann::ordered_json doc;
  try {
    doc = nlohmann::ordered_json::parse(read_file(f.messages));
  } catch (const nlohmann::json::exception& e) {
    throw Error(f.messages + " is not valid JSON: " + e.what());
  }
  nlohmann::ordered_json ctx = doc.is_object() ? doc : nlohmann::ordered_json::object();
  if (doc.is_array()) ctx["messages"] = doc;
  if (!ctx.contains("messages") || !ctx["messages"].is_array())
    throw Error(f.messages + ": expected a list of messages or an object with \"messages\"");
  for (const auto& kv : f.set) {
    const size_t eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) throw Error("--set expects NAME=VALUE, got '" + kv + "'");
    const std::string name = kv.substr(0, eq), value = kv.substr(eq + 1);
    try {
      ctx[name] = nlohmann::ordered_json::parse(value);
    } catch (const nlohmann::json::exception&) {
      ctx[name] = value;  // not JSON: a plain string
    }
  }
  std::string out;
  if (!f.tokenizer.empty()) {
    const TextProcessor text = TextProcessor::load(f.tokenizer);
    const nlohmann::ordered_json messages = ctx["messages"];
    ctx.erase("messages");
    out = text.render_chat(messages, f.add_generation_prompt, ctx);
  } else {
    ctx["add_generation_prompt"] = f.add_generation_prompt;
    out = ChatTemplate::parse(read_file(f.template_file), f.template_file).render(ctx);
  }
  std::cout << out << std::flush;
  return 0;
}

}  // namespace kvlm::app

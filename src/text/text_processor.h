// Text in, ids out and back: a model directory's tokenizer.json, tokenizer_config.json and
// chat template — or a GGUF file's tokenizer metadata (text/gguf_tokenizer) — used the way
// transformers uses them. Shared by the CLI and the server.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/tokenizer/tokenizer.h"
#include "text/tokenizer/tokenizer_config.h"

namespace kvlm {

class TextProcessor {
 public:
  // Loads DIR/tokenizer.json (required), DIR/tokenizer_config.json and the chat template
  // (parsed now, so a template kvlm cannot render fails at load, with line and column), or
  // the tokenizer of a GGUF file (DIR itself, or the one .gguf file DIR holds).
  // Throws kvlm::Error when `dir` has no tokenizer, ending with `instead` (what the calling
  // command can do without one, e.g. "give token ids (--prompt-ids) instead").
  static TextProcessor load(const std::filesystem::path& dir, std::string_view instead = {});
  // The tokenizer where one is needed only for text: nullopt when DIR has none, and when a
  // GGUF file's tokenizer cannot be built (a warning says why; token ids still work). A
  // broken tokenizer.json still throws.
  static std::optional<TextProcessor> load_if_usable(const std::filesystem::path& dir);
  // Whether DIR has a tokenizer at all.
  static bool available(const std::filesystem::path& dir);

  const Tokenizer& tokenizer() const { return tok_; }
  const TokenizerConfig& config() const { return cfg_; }
  bool has_chat_template() const { return tpl_.has_value(); }

  // A plain prompt: the tokenizer's post-processor, plus BOS/EOS when tokenizer_config.json
  // asks for them (add_bos_token / add_eos_token) and the post-processor did not add them.
  std::vector<TokenId> encode_prompt(std::string_view text) const;

  // transformers' apply_chat_template: render with messages, add_generation_prompt, the
  // special tokens and any extra variables (tools, enable_thinking...), then tokenize
  // without adding special tokens (the template writes them).
  std::string render_chat(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                          const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;
  std::vector<TokenId> encode_chat(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                   const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  // tokenizer_config.json's eos_token as an id, when it names one.
  std::optional<TokenId> eos_id() const;

 private:
  TextProcessor(Tokenizer tok, TokenizerConfig cfg) : tok_(std::move(tok)), cfg_(std::move(cfg)) {}
  Tokenizer tok_;
  TokenizerConfig cfg_;
  std::optional<ChatTemplate> tpl_;
};

}  // namespace kvlm

// tokenizer_config.json: the special tokens and chat template a model directory declares.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>

namespace kvlm {

struct TokenizerConfig {
  std::optional<std::string> bos_token, eos_token, pad_token, unk_token;
  bool add_bos_token = false, add_eos_token = false;
  std::optional<std::string> chat_template;           // the default template
  std::map<std::string, std::string> named_templates;  // e.g. "tool_use"
};

// Reads DIR/tokenizer_config.json (absent: defaults) and DIR/chat_template.jinja, which
// newer checkpoints ship beside it and which then wins. Throws on malformed JSON.
TokenizerConfig load_tokenizer_config(const std::filesystem::path& dir);

}  // namespace kvlm

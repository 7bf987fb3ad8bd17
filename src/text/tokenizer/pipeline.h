// The stages of a tokenizer.json pipeline around the model: normalizers, pre-tokenizers,
// post-processors and decoders, each parsed from its JSON object at load time. A stage
// type kvlm does not implement fails at load with its name, never at encode time.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/index_types.h"
#include "text/tokenizer/regex.h"

namespace kvlm::tok {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string apply(std::string s) const = 0;
};
// nullptr for a JSON null.
std::unique_ptr<Normalizer> parse_normalizer(const nlohmann::json& j);

// A piece of text on its way to the model; `at_start`: it begins at offset 0 of the input.
struct Piece {
  std::string text;
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};
std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const nlohmann::json& j);

// Adds special tokens around a single sequence (add_special_tokens=true).
struct PostProcessor {
  std::vector<TokenId> prefix, suffix;
};
// `token_id` resolves token strings named by the processor; throws for unknown ones.
PostProcessor parse_post_processor(const nlohmann::json& j);

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
  // The raw bytes one token contributes in the middle of a text: what apply() makes of it
  // without the text-level steps (stripping the text's ends, the first token's prefix
  // space, replacing invalid UTF-8). Structured outputs match grammars against these.
  virtual void piece(std::string& token) const = 0;
};
std::unique_ptr<Decoder> parse_decoder(const nlohmann::json& j);

}  // namespace kvlm::tok

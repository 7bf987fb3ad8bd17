// Hugging Face tokenizer.json in C++: added tokens (special / lstrip / rstrip / normalized /
// single_word), normalizer, pre-tokenizer, BPE model, post-processor and decoder, giving
// the ids the Rust `tokenizers` library gives. Plus tokenizer_config.json (BOS/EOS, chat
// template) and a UTF-8-safe incremental decoder for streaming.
#pragma once

#include <array>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/index_types.h"
#include "text/tokenizer/bpe.h"
#include "text/tokenizer/pipeline.h"

#include <nlohmann/json_fwd.hpp>

namespace kvlm {

struct EncodeOptions {
  bool add_special_tokens = true;  // apply the post-processor (BOS/EOS templates)
  bool parse_special = true;       // special added tokens written in the text become their ids
};

struct AddedToken {
  TokenId id;
  std::string content;
  bool special = false, lstrip = false, rstrip = false, normalized = false, single_word = false;
};

class Tokenizer {
 public:
  // Loads tokenizer.json (a file, or a directory holding one). Throws kvlm::Error for a
  // missing or malformed file or a pipeline stage kvlm does not implement.
  static Tokenizer load(const std::filesystem::path& path);
  static Tokenizer from_json_text(std::string_view text, const std::string& label = "tokenizer.json");
  // A tokenizer.json object whose "model" (ignored if present) is given as data: how a GGUF
  // file's vocabulary becomes a tokenizer without a JSON round trip of its merges.
  static Tokenizer from_parts(const nlohmann::json& pipeline, const tok::BpeSpec& model, const std::string& label);

  // Invalid UTF-8 in `text` is replaced by U+FFFD first (as Python's errors='replace').
  std::vector<TokenId> encode(std::string_view text, const EncodeOptions& opts = {}) const;
  // Throws for an id the vocabulary lacks, unless `skip_unknown` (generated text: a model's
  // vocabulary may be padded past the tokenizer's — Qwen's 151,936 logits for 151,669
  // tokens — and Hugging Face's decode writes nothing for such ids).
  std::string decode(std::span<const TokenId> ids, bool skip_special_tokens = false, bool skip_unknown = false) const;

  // The bytes token `id` adds in the middle of a text (a byte-level token's raw bytes, a
  // <0xXX> token's byte, a Metaspace token with its space): what a grammar matches. Special
  // added tokens and ids outside the vocabulary give nothing.
  std::string token_bytes(TokenId id) const;

  std::optional<TokenId> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(TokenId id) const;
  bool is_special(TokenId id) const;
  // A <0xXX> byte token whose decoding (ByteFallback) depends on the tokens after it.
  bool is_fallback_byte(TokenId id) const;
  int vocab_size() const { return vocab_size_; }  // largest id + 1
  const std::vector<AddedToken>& added_tokens() const { return added_; }

 private:
  struct Segment {
    std::string text;
    size_t offset;        // in the original input
    int added = -1;       // index into added_, or -1 for text
  };
  void split_added(std::vector<Segment>& segs, bool normalized_pass, bool parse_special) const;

  std::unique_ptr<tok::Normalizer> normalizer_;
  std::unique_ptr<tok::PreTokenizer> pre_;
  std::unique_ptr<tok::BpeModel> model_;
  tok::PostProcessor post_;
  std::unique_ptr<tok::Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::vector<std::string> added_match_;  // what each added token matches (normalized content for normalized ones)
  std::vector<int> added_by_id_;          // id -> index into added_, -1 if not added
  std::array<bool, 256> added_first_{};   // first bytes of added_match_ (fast skip)
  // Without a pre-tokenizer (SentencePiece-style BPE) a whole segment is one BPE word. When
  // no vocabulary token has U+2581 after another character, segments are split before each
  // such U+2581 first: the result is identical and the words become short and cacheable.
  bool split_metaspace_ = false;
  std::vector<bool> fallback_byte_;  // id -> is a <0xXX> token of a ByteFallback decoder
  int vocab_size_ = 0;
};

// Streams text for ids as they are generated: never a broken UTF-8 character, and the
// concatenation of everything returned equals tokenizer.decode(all ids) — except that by
// default flush() leaves out an incomplete character at the very end (see there).
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& t, bool skip_special_tokens = true) : tok_(t), skip_(skip_special_tokens) {}
  std::string push(TokenId id);
  // Whatever is still held back. The ids may end inside a character (max_tokens cut it):
  // by default the text ends before it, as vLLM's does (its detokenizer never emits a
  // trailing U+FFFD); keep_incomplete gives decode()'s U+FFFD instead.
  std::string flush(bool keep_incomplete = false);
  const std::vector<TokenId>& ids() const { return ids_; }

 private:
  const Tokenizer& tok_;
  bool skip_;
  std::vector<TokenId> ids_;
  std::string emitted_;     // text returned so far
  size_t prefix_ = 0;       // first id of the decode window
  size_t read_ = 0;         // ids before this one have been emitted
};

}  // namespace kvlm

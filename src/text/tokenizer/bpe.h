// The BPE model of tokenizer.json: vocabulary, ranked merges, byte fallback, unknown
// token, ignore_merges. encode_word() applies merges lowest rank first (leftmost on ties),
// exactly as the Rust tokenizers library does, in O(n log n) per word.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/index_types.h"

namespace kvlm::tok {

// Hash map keyed by std::string and searchable by std::string_view without allocating.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// A BPE model as data: what tokenizer.json's "model" object holds, or what a GGUF file's
// vocabulary implies (text/gguf_tokenizer).
struct BpeSpec {
  std::vector<std::pair<std::string, TokenId>> vocab;  // a token listed twice keeps its last id
  std::vector<std::pair<std::string, std::string>> merges;  // by rank, best first
  std::optional<std::string> unk_token;
  bool byte_fallback = false, fuse_unk = false, ignore_merges = false;
  std::string continuing_prefix, end_suffix;
};
// tokenizer.json's "model" object as a BpeSpec; throws kvlm::Error for another model type.
BpeSpec parse_bpe_spec(const nlohmann::json& model);

class BpeModel {
 public:
  explicit BpeModel(const BpeSpec& spec);

  void encode_word(std::string_view word, std::vector<TokenId>& out) const;
  std::optional<TokenId> token_to_id(std::string_view token) const;
  const std::string* id_to_token(TokenId id) const;  // nullptr when unknown
  TokenId max_id() const { return TokenId(id_to_token_.size()) - 1; }
  // True when no vocabulary token contains `marker` right after a different character, so
  // that no merge can cross such a boundary and a word may be split there first.
  bool marker_starts_tokens(std::string_view marker) const;

 private:
  void merge_word(std::string_view word, std::vector<TokenId>& out) const;

  StringMap<TokenId> vocab_;
  std::vector<std::string> id_to_token_;
  struct Merge {
    int32_t rank;
    TokenId merged;
  };
  std::unordered_map<uint64_t, Merge> merges_;  // key: (left id << 32) | right id
  std::optional<TokenId> unk_;
  bool byte_fallback_ = false, fuse_unk_ = false, ignore_merges_ = false;
  std::string continuing_prefix_, end_suffix_;
  std::array<TokenId, 256> byte_tokens_{};  // ids of <0x00>..<0xFF>, -1 when absent

  // Words seen recently (text is Zipfian, so most words repeat): word -> ids.
  mutable std::mutex cache_mu_;
  mutable StringMap<std::vector<TokenId>> cache_;
};

}  // namespace kvlm::tok

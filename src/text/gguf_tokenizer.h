// A GGUF file's tokenizer: the vocabulary, merges (or scores), token types, special ids and
// chat template that llama.cpp stores as `tokenizer.*` metadata, turned into kvlm's Tokenizer
// and TokenizerConfig. The tokenizer is the one Hugging Face transformers builds from the same
// file (`AutoTokenizer.from_pretrained(..., gguf_file=...)`), stage for stage, so its ids are
// transformers' ids:
//   * `tokenizer.ggml.model` "gpt2": byte-level BPE with the file's merges; tokens spelled
//     outside GPT-2's byte alphabet are respelled into it; the split regex for the
//     `tokenizer.ggml.pre` types transformers knows (llama3, qwen2, ...), GPT-2's otherwise;
//   * "llama" (SentencePiece vocabularies): BPE with byte fallback over merges from the file,
//     or recovered from the vocabulary (pairs of tokens that concatenate to a token, best score
//     first) when the file has none; Llama's Metaspace pre-tokenizer, or Gemma's
//     space-to-U+2581 normalizer for gemma / gemma2 / gemma3 files (whose all-space tokens are
//     respelled with U+2581 and whose merges follow the file's token order, not its scores);
//   * tokens typed CONTROL become special added tokens, USER_DEFINED ones plain added tokens;
//     BOS is added when `tokenizer.ggml.add_bos_token` says so (SentencePiece files without
//     the key: yes), EOS when `add_eos_token` does.
// Anything else (Unigram "t5", WordPiece "bert", RWKV...) is refused by name.
#pragma once

#include <string>
#include <vector>

#include "io/gguf.h"
#include "text/tokenizer/tokenizer.h"
#include "text/tokenizer/tokenizer_config.h"

namespace kvlm {

struct GGUFTokenizer {
  Tokenizer tokenizer;
  TokenizerConfig config;
  std::vector<std::string> notes;  // which metadata keys were read (for `kvlm inspect`)
};

// Throws kvlm::Error naming `label` and the missing or unsupported field.
GGUFTokenizer load_gguf_tokenizer(const GGUFHeader& h, const std::string& label);

// transformers' `generate_merges`: for every token in `order` (with its score), the ways it
// splits into two vocabulary tokens, ordered by their ids; all of them sorted by score, then
// the lengths (in code points) of the two halves, all descending, ties in listing order.
// `vocab`: token -> id. Exposed for tests.
std::vector<std::pair<std::string, std::string>> merges_from_vocab(
    const std::vector<std::pair<std::string, double>>& order, const tok::StringMap<TokenId>& vocab);

}  // namespace kvlm

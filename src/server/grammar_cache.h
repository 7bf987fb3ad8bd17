// The server's compiled grammars for structured outputs: the model's vocabulary as the
// matcher sees it (built once, on the first constrained request), and the last grammars
// compiled, by request key, so that requests with the same schema share their cached masks.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "text/grammar/matcher.h"

namespace kvlm {
class Tokenizer;
}

namespace kvlm::server {

class GrammarCache {
 public:
  // Throws kvlm::Error when the grammar cannot be compiled.
  std::shared_ptr<const grammar::CompiledGrammar> get(const Tokenizer& tok, int vocab_size, const grammar::Grammar& g,
                                                      const std::string& key);

 private:
  // At either limit the cache starts over (grammars in use live on with their requests).
  static constexpr size_t kMaxGrammars = 64;
  static constexpr size_t kMaxBytes = size_t(512) << 20;  // their cached masks
  std::mutex mu_;
  std::shared_ptr<const grammar::TokenVocab> vocab_;
  std::unordered_map<std::string, std::shared_ptr<const grammar::CompiledGrammar>> compiled_;
};

}  // namespace kvlm::server

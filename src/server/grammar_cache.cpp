#include "server/grammar_cache.h"

#include "io/tokenizer/tokenizer.h"

namespace kvlm::server {

std::shared_ptr<const grammar::CompiledGrammar> GrammarCache::get(const Tokenizer& tok, int vocab_size,
                                                                  const grammar::Grammar& g, const std::string& key) {
  std::shared_ptr<const grammar::TokenVocab> vocab;
  {
    std::lock_guard lock(mu_);
    if (auto it = compiled_.find(key); it != compiled_.end()) return it->second;
    if (!vocab_) vocab_ = std::make_shared<const grammar::TokenVocab>(tok, vocab_size);
    vocab = vocab_;
  }
  auto cg = std::make_shared<const grammar::CompiledGrammar>(g, vocab);
  std::lock_guard lock(mu_);
  size_t bytes = 0;
  for (const auto& [k, c] : compiled_) bytes += c->cached_bytes();
  if (compiled_.size() >= kMaxGrammars || bytes > kMaxBytes) compiled_.clear();
  compiled_.emplace(key, cg);
  return cg;
}

}  // namespace kvlm::server

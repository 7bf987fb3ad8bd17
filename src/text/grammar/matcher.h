// Runs a Grammar over generated tokens: which tokens may come next (a mask over the
// vocabulary), and the state after each accepted token.
//
// The matcher is a pushdown recognizer in the style of llama.cpp's grammar sampler: a state
// is a set of stacks of grammar positions; the top of each stack is a character class the
// next code point must match, the entries below are where to continue when the rule on top
// ends (a rule reference in tail position pushes nothing, so repetition written as right
// recursion keeps the stacks flat). Accepting a code point advances every stack whose top
// matches and expands rule references until each top is a character class again; a state
// with an empty stack has matched a complete sentence. Tokens are bytes, so the state also
// carries an incomplete UTF-8 character; a state is dead when no stack survives.
//
// The mask walks the vocabulary sorted by bytes: tokens sharing a prefix share the states
// computed for it, and a dead prefix skips every token under it — the cost is the number of
// distinct token prefixes still alive, not the vocabulary size. Masks are cached per state
// (a JSON string's interior is one state however long the string grows).
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/index_types.h"
#include "text/grammar/grammar.h"

namespace kvlm {
class Tokenizer;
}

namespace kvlm::grammar {

// The vocabulary as the matcher sees it: every token's bytes as they appear inside a text,
// sorted. Special tokens and ids the tokenizer lacks have no bytes and are never allowed by
// a grammar (EOS is the engine's business: see Constraint::can_end).
class TokenVocab {
 public:
  // `vocab_size`: the model's (logits) vocabulary, which may exceed the tokenizer's.
  TokenVocab(const Tokenizer& tok, int vocab_size);
  // For tests: token id i has bytes[i] (empty = never allowed).
  explicit TokenVocab(std::vector<std::string> bytes);
  int size() const { return int(bytes_.size()); }
  const std::string& bytes(TokenId id) const { return bytes_[size_t(id)]; }

 private:
  friend class CompiledGrammar;
  void index();
  std::vector<std::string> bytes_;
  std::vector<TokenId> order_;  // ids with bytes, sorted by bytes
  std::vector<uint32_t> lcp_;   // common prefix length of order_[i] with order_[i - 1]
};

// Bits over the vocabulary: bit t set = token t allowed.
struct TokenMask {
  std::vector<uint64_t> words;
  bool test(TokenId t) const { return (words[size_t(t) >> 6] >> (t & 63)) & 1; }
  int count() const;
};

// A grammar prepared for matching, with its vocabulary and its mask cache; shared by every
// choice of a request (and by requests with the same grammar). Thread-safe.
class CompiledGrammar {
 public:
  // Validates `g` (throws kvlm::Error as Grammar::validate does).
  CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocab> vocab);

  using Stack = std::vector<uint32_t>;
  // The stacks are stored flat (stack i is data[ends[i-1], ends[i])), sorted and unique, so
  // that stepping reuses the vectors' memory: the mask walk steps ~10^5 times per mask.
  struct State {
    std::vector<uint32_t> data;
    std::vector<uint32_t> ends;  // empty = dead
    uint32_t partial = 0;        // bits of an incomplete UTF-8 character
    uint8_t need = 0;            // continuation bytes it still needs
    uint8_t partial_len = 0;     // bytes seen of it
    bool dead() const { return ends.empty(); }
    size_t num_stacks() const { return ends.size(); }
    size_t begin_of(size_t i) const { return i ? ends[i - 1] : 0; }
    size_t size_of(size_t i) const { return ends[i] - begin_of(i); }
    uint32_t top(size_t i) const { return data[ends[i] - 1]; }
    void clear() {
      data.clear();
      ends.clear();
    }
    void push(const Stack& s) {
      data.insert(data.end(), s.begin(), s.end());
      ends.push_back(uint32_t(data.size()));
    }
  };
  State initial() const;
  // The state after `byte`; dead when the grammar cannot continue with it.
  void step(const State& in, uint8_t byte, State& out) const;
  static bool accepting(const State& s);   // a complete sentence (no partial character)
  static bool terminated(const State& s);  // complete, and nothing may follow
  // The tokens allowed after `s`, cached by state.
  std::shared_ptr<const TokenMask> mask(const State& s) const;
  bool cached(const State& s) const;
  const TokenVocab& vocab() const { return *vocab_; }
  size_t num_positions() const { return flat_.size(); }

 private:
  enum Kind : uint8_t { kChars, kRef, kEnd };
  struct Flat {
    Kind kind;
    uint32_t arg;  // kChars: class index; kRef: rule
  };
  struct Class {
    bool negated;
    std::vector<CharRange> ranges;
  };
  bool matches(uint32_t cls, uint32_t cp) const;
  bool may_match(uint32_t cls, uint32_t lo, uint32_t hi) const;  // some code point in [lo, hi]
  void expand(Stack& s, State& out) const;
  void advance(const State& in, uint32_t cp, State& out) const;
  static void normalize(State& s);
  std::shared_ptr<TokenMask> compute_mask(const State& s) const;
  // Sets the bits of the allowed tokens among the sorted vocabulary's [begin, end).
  void walk(const State& s, size_t begin, size_t end, std::vector<uint64_t>& words) const;
  static std::string key(const State& s);

  std::vector<Flat> flat_;
  std::vector<std::vector<uint32_t>> alt_starts_;
  std::vector<Class> classes_;
  uint32_t root_;
  std::shared_ptr<const TokenVocab> vocab_;

  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const TokenMask>> cache_;
};

// One generation's progress through a grammar (one per choice). Not thread-safe: the engine
// uses it from one thread at a time.
class Constraint {
 public:
  explicit Constraint(std::shared_ptr<const CompiledGrammar> g) : g_(std::move(g)), state_(g_->initial()) {}
  // The tokens that keep the output a prefix of a sentence of the grammar (waits for a
  // prefetch of it). Throws kvlm::Error when the grammar proves too ambiguous to match.
  std::shared_ptr<const TokenMask> allowed() const;
  // Starts computing the current state's mask on a background thread, unless it is cached:
  // the engine calls it after each token, so the walk overlaps the next forward pass.
  void prefetch();
  bool can_end() const { return CompiledGrammar::accepting(state_); }
  bool terminated() const { return CompiledGrammar::terminated(state_); }
  int vocab_size() const { return g_->vocab().size(); }
  // Advances by the token's bytes; false (state unchanged) when the grammar rejects them.
  bool accept(TokenId t);
  // Advances by text (for tests and forced prefixes).
  bool accept_text(std::string_view bytes);

 private:
  std::shared_ptr<const CompiledGrammar> g_;
  CompiledGrammar::State state_, scratch_;
  mutable std::shared_future<std::shared_ptr<const TokenMask>> next_;  // the mask of state_, being computed
};

}  // namespace kvlm::grammar

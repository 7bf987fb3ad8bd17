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
//
// A walk over a 150k vocabulary from a permissive state (inside a string) takes tens of
// milliseconds, and states that differ only below their tops (the same string field at
// another depth, or after another key) would each pay it. So the walk is split, as xgrammar
// does: per top of a stack, once, the tokens are sorted into those it accepts whatever lies
// below it, those it rejects whatever lies below, and the few that depend on it (they finish
// the top's rule and go on into what follows — kept only when their next byte can start
// something that follows the rule anywhere in the grammar). A top is the stack's top position
// and, where what may follow its rule is varied (a JSON string's one-character rule is
// followed by any character), the entries below it up to a rule whose follower is narrow (the
// string's closing quote). A state's mask is then the union of its tops' accepted sets plus a
// walk over the dependent tokens alone, from the state's real stacks.
#pragma once

#include <atomic>
#include <bitset>
#include <chrono>
#include <cstdint>
#include <optional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "core/index_types.h"
#include "text/grammar/grammar.h"

namespace kvlm {
class Tokenizer;
}

namespace kvlm::grammar {

// A mask computation past a deadline set with CompiledGrammar::set_deadline.
class GrammarTimeout : public Error {
 public:
  using Error::Error;
};

// The vocabulary as the matcher sees it: every token's bytes as they appear inside a text,
// sorted. Special tokens and ids the tokenizer lacks have no bytes: a grammar allows a special
// token only where it names it (Grammar::special_token, found here by its text), and never
// the others (EOS is the engine's business: see Constraint::can_end).
class TokenVocab {
 public:
  // `vocab_size`: the model's (logits) vocabulary, which may exceed the tokenizer's.
  TokenVocab(const Tokenizer& tok, int vocab_size);
  // For tests: token id i has bytes[i] (empty = never allowed); `specials` by text.
  explicit TokenVocab(std::vector<std::string> bytes, std::unordered_map<std::string, TokenId> specials = {});
  int size() const { return int(bytes_.size()); }
  const std::string& bytes(TokenId id) const { return bytes_[size_t(id)]; }
  // The id of the special token `text`, if the tokenizer has one.
  std::optional<TokenId> special_id(const std::string& text) const;

 private:
  friend class CompiledGrammar;
  void index();
  std::vector<std::string> bytes_;
  std::unordered_map<std::string, TokenId> specials_;
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
  // Validates `g` (throws kvlm::Error as Grammar::validate does). `position_masks` false:
  // every mask by one walk over the whole vocabulary (how masks were made before; for
  // benchmarks).
  CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocab> vocab, bool position_masks = true);

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
  // The state after the special token `t` (out dead when the grammar cannot take it there);
  // false when the grammar never writes `t`.
  bool step_special(const State& in, TokenId t, State& out) const;
  // The tokens allowed after `s`, cached by state.
  std::shared_ptr<const TokenMask> mask(const State& s) const;
  bool cached(const State& s) const;
  // The same mask by one walk over the whole vocabulary, without the per-position split or
  // any cache: the reference the tests hold mask() to.
  std::shared_ptr<TokenMask> full_walk_mask(const State& s) const;
  const TokenVocab& vocab() const { return *vocab_; }
  size_t num_positions() const { return flat_.size(); }
  // Masks per stack top computed so far, and the bytes of every cached mask (for tests,
  // benchmarks and the server's grammar cache budget).
  size_t num_position_masks() const;
  size_t cached_bytes() const;
  // The compiled grammar's own tables (what it holds before any mask is cached).
  size_t table_bytes() const { return table_bytes_; }
  // While set, mask computations throw GrammarTimeout once the time passes (a compile's
  // budget: see server/grammar_cache.h); a walk checks it every thousand tokens.
  void set_deadline(std::optional<std::chrono::steady_clock::time_point> t) const;

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
  // What a token does from a stack with a given top (see the file comment).
  struct PositionMask {
    std::vector<uint64_t> bits;   // accepted whatever lies below: bits over token ids, or
    std::vector<TokenId> ids;     // the ids themselves where fewer (bits then empty)
    std::vector<uint32_t> dependent;      // indices into the sorted vocabulary, ascending
    std::vector<uint32_t> dependent_lcp;  // common prefix with the previous dependent token
    size_t bytes() const { return 8 * bits.size() + 4 * (ids.size() + dependent.size() + dependent_lcp.size()); }
  };
  // A walk's states interned, with their transitions memoized (matcher.cpp).
  struct Dfa;
  bool matches(uint32_t cls, uint32_t cp) const;
  bool may_match(uint32_t cls, uint32_t lo, uint32_t hi) const;  // some code point in [lo, hi]
  void expand(Stack& s, State& out) const;
  void advance(const State& in, uint32_t cp, State& out) const;
  static void normalize(State& s);
  std::shared_ptr<TokenMask> compute_mask(const State& s) const;
  // The top of stack i of `s` (the last `size` entries): see the file comment.
  size_t top_size(const State& s, size_t i) const;
  std::shared_ptr<const PositionMask> position_mask(const uint32_t* top, size_t size) const;
  std::shared_ptr<const PositionMask> compute_position_mask(const Stack& top) const;
  // Sets the bits of the allowed tokens among `items` (indices into the sorted vocabulary,
  // ascending, with their common prefixes): the sorted vocabulary's [begin, end) or a
  // position's dependent tokens. With `follow`, also lists in `dependent` the dead tokens
  // that passed an emptied stack where the next byte is in `follow` (classify).
  template <class Items>
  void walk(const State& s, const Items& items, std::vector<uint64_t>& words, const std::bitset<256>* follow = nullptr,
            std::vector<uint32_t>* dependent = nullptr) const;
  // From the one-stack state {top}: sets the bits of the tokens it accepts and lists the
  // sorted-vocabulary indices in [begin, end) of those that depend on what lies below.
  void classify(const Stack& top, size_t begin, size_t end, std::vector<uint64_t>& words,
                std::vector<uint32_t>& dependent) const;
  // Chunks of the sorted vocabulary walked in parallel (1 on small machines or vocabularies).
  int walk_chunks() const;
  void compute_follow(const Grammar& g);
  // Sets the bits of the special tokens the grammar writes that `s` allows.
  void add_special_tokens(const State& s, std::vector<uint64_t>& words) const;
  static std::string key(const State& s);
  void check_deadline() const;

  std::vector<Flat> flat_;
  std::vector<std::vector<uint32_t>> alt_starts_;
  std::vector<Class> classes_;
  std::vector<uint32_t> rule_of_;            // per position: the rule whose alternative holds it
  std::vector<TokenId> special_ids_;         // the grammar's special tokens' ids, by index
  std::vector<std::bitset<256>> follow_;     // per rule: bytes that may start what follows it
  uint32_t root_;
  std::shared_ptr<const TokenVocab> vocab_;
  bool position_masks_;
  size_t table_bytes_ = 0;
  mutable std::atomic<int64_t> deadline_ns_{0};  // steady clock, 0: none

  mutable std::mutex mu_;
  mutable std::unordered_map<std::string, std::shared_ptr<const TokenMask>> cache_;
  mutable size_t cache_bytes_ = 0;
  mutable std::unordered_map<std::string, std::shared_ptr<const PositionMask>> positions_;  // by top
  mutable size_t position_bytes_ = 0;
};

// Lowers the calling thread's scheduling priority to kGrammarThreadNice: the threads that
// compile grammars and compute masks ahead give way to the engine's (see matcher.cpp).
constexpr int kGrammarThreadNice = 10;
void lower_thread_priority();

// One generation's progress through a grammar (one per choice). Not thread-safe: the engine
// uses it from one thread at a time.
class Constraint {
 public:
  explicit Constraint(std::shared_ptr<const CompiledGrammar> g) : g_(std::move(g)), state_(g_->initial()) {}
  // The tokens that keep the output a prefix of a sentence of the grammar (waits for a
  // prefetch of it). Throws kvlm::Error when the grammar proves too ambiguous to match.
  std::shared_ptr<const TokenMask> allowed() const;
  // Starts computing the current state's mask on a background thread, unless it is cached
  // or already being computed: the engine calls it after each token, so the walk overlaps
  // the next forward pass.
  void prefetch();
  // Whether allowed() would return without waiting; starts the prefetch when none runs.
  bool ready();
  // Waits until allowed() can return without waiting.
  void wait() const;
  // Tests: every prefetch first waits for `gate` (a mask as late as the test wants).
  void hold_prefetch_for_testing(std::shared_future<void> gate) { gate_ = std::move(gate); }
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
  std::shared_future<void> gate_;
  std::shared_ptr<const char> alive_ = std::make_shared<const char>(0);  // a queued prefetch skips when gone
};

}  // namespace kvlm::grammar

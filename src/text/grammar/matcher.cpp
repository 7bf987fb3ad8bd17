#include "text/grammar/matcher.h"

#include <algorithm>
#include <array>
#include <bit>
#include <bitset>
#include <condition_variable>
#include <deque>
#include <functional>
#include <numeric>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/error.h"
#include "text/tokenizer/tokenizer.h"

namespace kvlm::grammar {

namespace {
// A state whose stacks outnumber this is an ambiguous grammar blowing up (e.g. (a|a)*
// nested): the request fails rather than the engine thread stalling on it.
constexpr size_t kMaxStacks = 4096;
// Entries of one stack: how deep a recursive grammar's output may nest (a JSON value nested
// 10,000 levels deep would otherwise grow every state, and its key, without bound).
constexpr size_t kMaxStackDepth = 10000;
// Entries of all of a state's stacks together (4 bytes each): many parses, each deep.
constexpr size_t kMaxStateEntries = size_t(1) << 20;
// Masks kept per grammar (by state, and by position); at a limit that cache starts over.
constexpr size_t kMaxCachedMasks = 4096;
constexpr size_t kMaxCachedMaskBytes = size_t(16) << 20;
constexpr size_t kMaxPositionMaskBytes = size_t(32) << 20;

// The bytes that may start the UTF-8 encoding of a code point in [lo, hi].
void add_lead_bytes(std::bitset<256>& out, uint32_t lo, uint32_t hi) {
  struct Band {
    uint32_t lo, hi, shift, tag;
  };
  static constexpr Band kBands[] = {{0, 0x7F, 0, 0}, {0x80, 0x7FF, 6, 0xC0}, {0x800, 0xFFFF, 12, 0xE0}, {0x10000, 0x10FFFF, 18, 0xF0}};
  for (const Band& b : kBands) {
    const uint32_t a = std::max(lo, b.lo), z = std::min(hi, b.hi);
    for (uint32_t x = a >> b.shift; a <= z && x <= z >> b.shift; ++x) out.set(b.tag | x);
  }
}

// Items of a walk: indices into the sorted vocabulary with the common prefix of each with
// the previous item.
struct RangeItems {
  const std::vector<uint32_t>& lcp;
  size_t begin, end;
  size_t size() const { return end - begin; }
  size_t index(size_t k) const { return begin + k; }
  uint32_t prefix(size_t k) const { return k ? lcp[begin + k] : 0; }
};
struct ListItems {
  const std::vector<uint32_t>& indices;
  const std::vector<uint32_t>& lcp;
  size_t size() const { return indices.size(); }
  size_t index(size_t k) const { return indices[k]; }
  uint32_t prefix(size_t k) const { return lcp[k]; }
};
}  // namespace

// ---- vocabulary -------------------------------------------------------------------------

TokenVocab::TokenVocab(const Tokenizer& tok, int vocab_size) {
  bytes_.resize(size_t(std::max(vocab_size, 0)));
  for (int id = 0; id < vocab_size; ++id) bytes_[size_t(id)] = tok.token_bytes(id);
  for (const AddedToken& a : tok.added_tokens())
    if (a.special && a.id >= 0 && a.id < vocab_size) specials_.emplace(a.content, a.id);
  index();
}

TokenVocab::TokenVocab(std::vector<std::string> bytes, std::unordered_map<std::string, TokenId> specials)
    : bytes_(std::move(bytes)), specials_(std::move(specials)) {
  index();
}

std::optional<TokenId> TokenVocab::special_id(const std::string& text) const {
  const auto it = specials_.find(text);
  if (it == specials_.end()) return std::nullopt;
  return it->second;
}

void TokenVocab::index() {
  order_.clear();
  for (size_t id = 0; id < bytes_.size(); ++id)
    if (!bytes_[id].empty()) order_.push_back(TokenId(id));
  std::sort(order_.begin(), order_.end(), [&](TokenId a, TokenId b) {
    return bytes_[size_t(a)] != bytes_[size_t(b)] ? bytes_[size_t(a)] < bytes_[size_t(b)] : a < b;
  });
  lcp_.assign(order_.size(), 0);
  for (size_t i = 1; i < order_.size(); ++i) {
    const std::string& a = bytes_[size_t(order_[i - 1])];
    const std::string& b = bytes_[size_t(order_[i])];
    uint32_t l = 0;
    while (l < a.size() && l < b.size() && a[l] == b[l]) ++l;
    lcp_[i] = l;
  }
}

int TokenMask::count() const {
  int n = 0;
  for (uint64_t w : words) n += std::popcount(w);
  return n;
}

// ---- compiled grammar -------------------------------------------------------------------

CompiledGrammar::CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocab> vocab, bool position_masks)
    : vocab_(std::move(vocab)), position_masks_(position_masks) {
  g.validate();
  for (const std::string& text : g.special_tokens()) {
    const auto id = vocab_->special_id(text);
    if (!id) throw Error("the grammar writes the special token " + text + ", which this model's tokenizer does not have");
    special_ids_.push_back(*id);
  }
  std::unordered_map<std::string, uint32_t> class_ids;
  alt_starts_.resize(g.num_rules());
  for (uint32_t r = 0; r < g.num_rules(); ++r)
    for (const Sequence& alt : g.alts(r)) {
      alt_starts_[r].push_back(uint32_t(flat_.size()));
      for (const Symbol& s : alt) {
        if (s.kind == Symbol::Kind::Ref) {
          flat_.push_back({kRef, s.rule});
        } else {
          // Classes are interned: most are one character, repeated all over a grammar.
          std::vector<CharRange> rs = s.ranges;
          std::sort(rs.begin(), rs.end(), [](const CharRange& a, const CharRange& b) { return a.lo < b.lo; });
          std::string k(1, s.negated ? '^' : '=');
          k.append(reinterpret_cast<const char*>(rs.data()), rs.size() * sizeof(CharRange));
          const auto [it, added] = class_ids.emplace(std::move(k), uint32_t(classes_.size()));
          if (added) classes_.push_back({s.negated, std::move(rs)});
          flat_.push_back({kChars, it->second});
        }
      }
      flat_.push_back({kEnd, 0});
    }
  rule_of_.resize(flat_.size());
  for (uint32_t r = 0; r < g.num_rules(); ++r)
    for (uint32_t start : alt_starts_[r])
      for (uint32_t p = start;; ++p) {
        rule_of_[p] = r;
        if (flat_[p].kind == kEnd) break;
      }
  root_ = g.root();
  compute_follow(g);
  table_bytes_ = sizeof(Flat) * flat_.size() + 4 * (flat_.size() + rule_of_.size()) + sizeof(std::bitset<256>) * follow_.size() +
                 (sizeof(std::vector<uint32_t>) + 4) * alt_starts_.size();
  for (const Class& c : classes_) table_bytes_ += sizeof(Class) + sizeof(CharRange) * c.ranges.size();
}

// FOLLOW sets as in LL parsing, over lead bytes: first_[r] the bytes a sentence of r may
// start with (nullable: r may be empty), follow_[r] the bytes that may come right after r
// ends, anywhere in the grammar. A superset is safe (a token is only walked more often).
void CompiledGrammar::compute_follow(const Grammar& g) {
  const size_t nr = g.num_rules();
  std::vector<std::bitset<256>> lead(classes_.size()), first(nr);
  for (size_t c = 0; c < classes_.size(); ++c) {
    const Class& k = classes_[c];
    if (!k.negated) {
      for (const CharRange& r : k.ranges) add_lead_bytes(lead[c], r.lo, r.hi);
      continue;
    }
    uint32_t next = 0;  // the complement of the sorted ranges
    for (const CharRange& r : k.ranges) {
      if (r.lo > next) add_lead_bytes(lead[c], next, r.lo - 1);
      next = std::max(next, r.hi + 1);
    }
    if (next <= 0x10FFFF) add_lead_bytes(lead[c], next, 0x10FFFF);
  }
  const std::vector<char> nullable = g.nullable_rules();
  // Sets that include others (`into[a]`: the rules whose set includes a's), closed by a
  // worklist: a rule is revisited only when its set grew, at most 256 times. (A fixed point
  // over all rules takes one pass per link of a chain: N^2 for a chain of N rules.)
  const auto close = [](std::vector<std::bitset<256>>& sets, const std::vector<std::vector<uint32_t>>& into) {
    std::vector<uint32_t> work;
    std::vector<char> queued(sets.size(), 0);
    for (uint32_t r = 0; r < sets.size(); ++r)
      if (sets[r].any() && !into[r].empty()) work.push_back(r), queued[r] = 1;
    while (!work.empty()) {
      const uint32_t a = work.back();
      work.pop_back();
      queued[a] = 0;
      for (uint32_t b : into[a])
        if ((sets[b] | sets[a]) != sets[b]) {
          sets[b] |= sets[a];
          if (!queued[b]) work.push_back(b), queued[b] = 1;
        }
    }
  };
  // FIRST: a rule's alternatives' leading characters, and the FIRST of each reference up to
  // and including the first one that cannot be empty.
  std::vector<std::vector<uint32_t>> into(nr);
  for (uint32_t r = 0; r < nr; ++r)
    for (uint32_t start : alt_starts_[r])
      for (uint32_t p = start; flat_[p].kind != kEnd; ++p) {
        if (flat_[p].kind == kChars) {
          first[r] |= lead[flat_[p].arg];
          break;
        }
        into[flat_[p].arg].push_back(r);
        if (!nullable[flat_[p].arg]) break;
      }
  close(first, into);
  // FOLLOW of a reference: the FIRST of the rest of its alternative, and the FOLLOW of the
  // rule that holds it where that rest may be empty.
  // Each alternative is walked backwards with its suffix's FIRST, so that a long run of
  // nullable references costs its length, not its square.
  follow_.assign(nr, {});
  for (auto& v : into) v.clear();
  for (uint32_t b = 0; b < nr; ++b)
    for (uint32_t start : alt_starts_[b]) {
      uint32_t end = start;
      while (flat_[end].kind != kEnd) ++end;
      std::bitset<256> suffix;
      bool suffix_empty = true;  // the rest may match nothing
      for (uint32_t p = end; p-- > start;) {
        const uint32_t x = flat_[p].arg;
        if (flat_[p].kind == kChars) {
          suffix = lead[x];
          suffix_empty = false;
          continue;
        }
        follow_[x] |= suffix;
        if (suffix_empty) into[b].push_back(x);
        if (nullable[x]) {
          suffix |= first[x];
        } else {
          suffix = first[x];
          suffix_empty = false;
        }
      }
    }
  close(follow_, into);
}

bool CompiledGrammar::matches(uint32_t cls, uint32_t cp) const {
  const Class& c = classes_[cls];
  bool in = false;
  for (const CharRange& r : c.ranges)
    if (cp >= r.lo && cp <= r.hi) {
      in = true;
      break;
    }
  // Special tokens' code points (kSpecialTokenBase + i) match only a class that names them.
  return c.negated ? !in && cp < kSpecialTokenBase : in;
}

bool CompiledGrammar::step_special(const State& in, TokenId t, State& out) const {
  for (size_t i = 0; i < special_ids_.size(); ++i)
    if (special_ids_[i] == t) {
      out.clear();
      if (!in.need) advance(in, kSpecialTokenBase + uint32_t(i), out);
      return true;
    }
  return false;
}

void CompiledGrammar::add_special_tokens(const State& s, std::vector<uint64_t>& words) const {
  if (s.dead() || s.need) return;
  State out;
  for (size_t i = 0; i < special_ids_.size(); ++i) {
    advance(s, kSpecialTokenBase + uint32_t(i), out);
    const TokenId t = special_ids_[i];
    if (!out.dead() && size_t(t) < vocab_->bytes_.size()) words[size_t(t) >> 6] |= uint64_t(1) << (t & 63);
  }
}

bool CompiledGrammar::may_match(uint32_t cls, uint32_t lo, uint32_t hi) const {
  const Class& c = classes_[cls];
  if (!c.negated) {
    for (const CharRange& r : c.ranges)
      if (r.lo <= hi && r.hi >= lo) return true;
    return false;
  }
  // Negated: some code point of [lo, hi] lies outside every range. The ranges are sorted by
  // start; walk the covered prefix of [lo, hi].
  uint32_t next = lo;
  for (const CharRange& r : c.ranges) {
    if (r.lo > next) break;
    if (r.hi >= next) {
      if (r.hi >= hi) return false;
      next = r.hi + 1;
    }
  }
  return true;
}

void CompiledGrammar::expand(Stack& s, State& out) const {
  // Depth first through the references until each top is a character class (or the stack is
  // empty), as a loop with its own frames rather than a recursion: a chain of rules each
  // starting with the next (60,000 of them in a client's GBNF), or a long run of rule ends
  // to pop, would otherwise take one native stack frame each. The grammar has no left
  // recursion (validated), so a path visits each rule at most once without a character
  // consumed: the frames are bounded by the rules. Each frame undoes its change to `s` when
  // left, so `s` is as it came when this returns.
  struct Frame {
    uint32_t p;    // the position popped off `s`
    uint32_t alt;  // the next alternative of its rule to try; kEndFrame: p was a rule's end
    bool cont;     // p + 1 was pushed (the rest of p's alternative)
  };
  constexpr uint32_t kEndFrame = UINT32_MAX;
  thread_local std::vector<Frame> frames;
  const size_t base = frames.size();
  struct Unwind {  // on an exception too: the next expansion starts clean
    size_t base;
    ~Unwind() { frames.resize(base); }
  } unwind{base};
  for (;;) {
    // Down: pop rule ends, enter first alternatives, until a leaf.
    for (;;) {
      if (s.empty() || flat_[s.back()].kind == kChars) {
        if (!s.empty() && out.num_stacks() >= kMaxStacks)
          throw Error("the grammar is too ambiguous to match (more than " + std::to_string(kMaxStacks) +
                      " parses at once); make its alternatives start differently");
        if (s.size() > kMaxStackDepth)
          throw Error("the output nests deeper than " + std::to_string(kMaxStackDepth) + " levels of the grammar");
        if (out.data.size() + s.size() > kMaxStateEntries)
          throw Error("the grammar is too ambiguous to match (its parses hold more than " + std::to_string(kMaxStateEntries) +
                      " positions at once); make its alternatives start differently");
        out.push(s);
        break;
      }
      const uint32_t p = s.back();
      s.pop_back();
      if (flat_[p].kind == kEnd) {
        frames.push_back({p, kEndFrame, false});
        continue;
      }
      // A reference in tail position leaves nothing to return to.
      const bool cont = flat_[p + 1].kind != kEnd;
      if (cont) s.push_back(p + 1);
      frames.push_back({p, 1, cont});
      s.push_back(alt_starts_[flat_[p].arg][0]);  // validated: every rule has an alternative
    }
    // Up: undo frames until one has an alternative left, then go down it.
    for (;;) {
      if (frames.size() == base) return;
      Frame& f = frames.back();
      if (f.alt == kEndFrame) {
        s.push_back(f.p);
        frames.pop_back();
        continue;
      }
      s.pop_back();  // the alternative's start
      const std::vector<uint32_t>& alts = alt_starts_[flat_[f.p].arg];
      if (f.alt < alts.size()) {
        s.push_back(alts[f.alt++]);
        break;
      }
      if (f.cont) s.pop_back();
      s.push_back(f.p);
      frames.pop_back();
    }
  }
}

void CompiledGrammar::set_deadline(std::optional<std::chrono::steady_clock::time_point> t) const {
  deadline_ns_.store(t ? std::max<int64_t>(1, t->time_since_epoch() / std::chrono::nanoseconds(1)) : 0,
                     std::memory_order_relaxed);
}

void CompiledGrammar::check_deadline() const {
  const int64_t d = deadline_ns_.load(std::memory_order_relaxed);
  if (d && std::chrono::steady_clock::now().time_since_epoch() / std::chrono::nanoseconds(1) > d)
    throw GrammarTimeout("the grammar's masks take longer to compute than this server's compile budget");
}

void CompiledGrammar::normalize(State& st) {
  const size_t n = st.num_stacks();
  if (n < 2) return;
  const auto less = [&](size_t a, size_t b) {
    return std::lexicographical_compare(st.data.begin() + long(st.begin_of(a)), st.data.begin() + long(st.ends[a]),
                                        st.data.begin() + long(st.begin_of(b)), st.data.begin() + long(st.ends[b]));
  };
  bool sorted = true;  // the common case: expansion wrote them in order
  for (size_t i = 1; i < n && sorted; ++i) sorted = less(i - 1, i);
  if (sorted) return;
  thread_local std::vector<size_t> order;
  thread_local State out;
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), less);
  out.clear();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = order[k];
    if (k && !less(order[k - 1], i)) continue;  // equal to the previous
    out.data.insert(out.data.end(), st.data.begin() + long(st.begin_of(i)), st.data.begin() + long(st.ends[i]));
    out.ends.push_back(uint32_t(out.data.size()));
  }
  st.data.swap(out.data);
  st.ends.swap(out.ends);
}

void CompiledGrammar::advance(const State& in, uint32_t cp, State& out) const {
  out.clear();
  thread_local Stack s;
  for (size_t i = 0; i < in.num_stacks(); ++i) {
    if (in.size_of(i) == 0 || !matches(flat_[in.top(i)].arg, cp)) continue;
    s.assign(in.data.begin() + long(in.begin_of(i)), in.data.begin() + long(in.ends[i]));
    s.back() += 1;
    expand(s, out);
  }
  normalize(out);
}

CompiledGrammar::State CompiledGrammar::initial() const {
  State st;
  Stack s;
  for (uint32_t start : alt_starts_[root_]) {
    s.assign(1, start);
    expand(s, st);
  }
  normalize(st);
  return st;
}

void CompiledGrammar::step(const State& in, uint8_t b, State& out) const {
  out.partial = 0;
  out.need = 0;
  out.partial_len = 0;
  if (in.dead()) {
    out.clear();
    return;
  }
  uint32_t cp;
  if (in.need == 0) {
    if (b < 0x80) {
      advance(in, b, out);
      return;
    }
    int need;
    if ((b & 0xE0) == 0xC0 && b >= 0xC2) {
      need = 1;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      need = 2;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0 && b <= 0xF4) {
      need = 3;
      cp = b & 0x07;
    } else {
      out.clear();  // not a lead byte
      return;
    }
    out.partial = cp;
    out.need = uint8_t(need);
    out.partial_len = 1;
  } else {
    if ((b & 0xC0) != 0x80) {
      out.clear();
      return;
    }
    cp = (in.partial << 6) | (b & 0x3F);
    if (in.need == 1) {
      // Overlong and surrogate forms are not UTF-8.
      const int len = in.partial_len + 1;
      if ((len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
        out.clear();
        return;
      }
      advance(in, cp, out);
      return;
    }
    out.partial = cp;
    out.need = uint8_t(in.need - 1);
    out.partial_len = uint8_t(in.partial_len + 1);
  }
  // An incomplete character: keep the stacks that some completion could satisfy.
  // The code points its completions can be, without overlong forms (E0 80 80 would be 0).
  const uint32_t shift = 6u * out.need;
  const int len = out.partial_len + out.need;
  const uint32_t least = len == 2 ? 0x80 : len == 3 ? 0x800 : 0x10000;
  const uint32_t lo = std::max(out.partial << shift, least), hi = std::min((out.partial << shift) | ((1u << shift) - 1), 0x10FFFFu);
  // Nor surrogates (ED A0..ED BF start only those).
  const uint32_t lo2 = std::max(lo, 0xE000u), hi1 = std::min(hi, 0xD7FFu);
  const bool below = lo <= hi1, above = lo2 <= hi;
  out.clear();
  if (lo > hi || (!below && !above)) return;
  const auto possible = [&](uint32_t cls) { return (below && may_match(cls, lo, hi1)) || (above && may_match(cls, lo2, hi)); };
  for (size_t i = 0; i < in.num_stacks(); ++i)
    if (in.size_of(i) > 0 && possible(flat_[in.top(i)].arg)) {
      out.data.insert(out.data.end(), in.data.begin() + long(in.begin_of(i)), in.data.begin() + long(in.ends[i]));
      out.ends.push_back(uint32_t(out.data.size()));
    }
}

bool CompiledGrammar::accepting(const State& s) {
  if (s.need) return false;
  for (size_t i = 0; i < s.num_stacks(); ++i)
    if (s.size_of(i) == 0) return true;
  return false;
}

bool CompiledGrammar::terminated(const State& s) {
  return s.need == 0 && !s.dead() && s.data.empty();  // every stack is empty
}

std::string CompiledGrammar::key(const State& s) {
  std::string k;
  k.reserve(12 + 4 * (s.ends.size() + s.data.size()));
  const auto put = [&](uint32_t v) { k.append(reinterpret_cast<const char*>(&v), sizeof v); };
  put(s.partial);
  put(uint32_t(s.need) | uint32_t(s.partial_len) << 8);
  for (uint32_t e : s.ends) put(e);
  put(UINT32_MAX);
  for (uint32_t p : s.data) put(p);
  return k;
}

bool CompiledGrammar::cached(const State& s) const {
  const std::string k = key(s);
  std::lock_guard lock(mu_);
  return cache_.count(k) > 0;
}

size_t CompiledGrammar::num_position_masks() const {
  std::lock_guard lock(mu_);
  return positions_.size();
}

size_t CompiledGrammar::cached_bytes() const {
  std::lock_guard lock(mu_);
  return cache_bytes_ + position_bytes_;
}

std::shared_ptr<const TokenMask> CompiledGrammar::mask(const State& s) const {
  std::string k = key(s);
  {
    std::lock_guard lock(mu_);
    if (auto it = cache_.find(k); it != cache_.end()) return it->second;
  }
  std::shared_ptr<const TokenMask> m = compute_mask(s);
  const size_t bytes = 8 * m->words.size();
  std::lock_guard lock(mu_);
  if (cache_.size() >= kMaxCachedMasks || cache_bytes_ + bytes > kMaxCachedMaskBytes) {
    cache_.clear();
    cache_bytes_ = 0;
  }
  if (cache_.emplace(std::move(k), m).second) cache_bytes_ += bytes;
  return m;
}

int CompiledGrammar::walk_chunks() const {
  // The sorted vocabulary in chunks walked in parallel (each from the state itself; a chunk
  // sets bits in its own copy, merged after) where the machine has cores to spare: a few
  // threads, so that a CPU forward pass running beside it is not starved.
  int chunks = 1;
#ifdef _OPENMP
  if (!omp_in_parallel() && std::thread::hardware_concurrency() >= 8) chunks = std::clamp(omp_get_max_threads(), 1, 4);
#endif
  return vocab_->order_.size() < 4096 ? 1 : chunks;
}

std::shared_ptr<TokenMask> CompiledGrammar::full_walk_mask(const State& s) const {
  auto m = std::make_shared<TokenMask>();
  const TokenVocab& v = *vocab_;
  m->words.assign((size_t(v.size()) + 63) / 64, 0);
  if (s.dead()) return m;
  const size_t n = v.order_.size();
  const int chunks = walk_chunks();
  std::vector<std::vector<uint64_t>> words(static_cast<size_t>(chunks));
  std::exception_ptr failed;
#pragma omp parallel for schedule(static, 1) num_threads(chunks) if (chunks > 1)
  for (int c = 0; c < chunks; ++c) {
    try {
      words[size_t(c)].assign(m->words.size(), 0);
      walk(s, RangeItems{v.lcp_, n * size_t(c) / size_t(chunks), n * size_t(c + 1) / size_t(chunks)}, words[size_t(c)]);
    } catch (...) {
#pragma omp critical(kvlm_grammar_mask)
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  for (const auto& w : words)
    for (size_t i = 0; i < w.size(); ++i) m->words[i] |= w[i];
  add_special_tokens(s, m->words);
  return m;
}

std::shared_ptr<TokenMask> CompiledGrammar::compute_mask(const State& s) const {
  // Inside a character (after a token that split one) the split does not apply: rare.
  if (s.dead() || s.need || !position_masks_) return full_walk_mask(s);
  auto m = std::make_shared<TokenMask>();
  m->words.assign((size_t(vocab_->size()) + 63) / 64, 0);
  // The stacks grouped by their tops: the top's mask, then its dependent tokens walked from
  // the group's stacks. A stack that is its top alone has nothing below: a dependent token
  // (which ends the top's rule and goes on) cannot continue it.
  struct Top {
    size_t stack, size;
  };
  std::vector<Top> tops;
  for (size_t i = 0; i < s.num_stacks(); ++i)
    if (s.size_of(i) > 0) tops.push_back({i, top_size(s, i)});
  const auto top_of = [&](const Top& t) { return s.data.data() + s.ends[t.stack] - t.size; };
  const auto less = [&](const Top& a, const Top& b) {
    return std::lexicographical_compare(top_of(a), top_of(a) + a.size, top_of(b), top_of(b) + b.size);
  };
  std::sort(tops.begin(), tops.end(), less);
  State group;
  for (size_t k = 0; k < tops.size();) {
    const Top& first = tops[k];
    const std::shared_ptr<const PositionMask> pm = position_mask(top_of(first), first.size);
    if (pm->bits.empty()) {
      for (TokenId id : pm->ids) m->words[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
    } else {
      for (size_t w = 0; w < pm->bits.size(); ++w) m->words[w] |= pm->bits[w];
    }
    group.clear();
    for (; k < tops.size() && !less(first, tops[k]); ++k) {
      const size_t i = tops[k].stack;
      if (s.size_of(i) > tops[k].size) {
        group.data.insert(group.data.end(), s.data.begin() + long(s.begin_of(i)), s.data.begin() + long(s.ends[i]));
        group.ends.push_back(uint32_t(group.data.size()));
      }
    }
    if (!group.dead() && !pm->dependent.empty()) walk(group, ListItems{pm->dependent, pm->dependent_lcp}, m->words);
  }
  add_special_tokens(s, m->words);
  return m;
}

size_t CompiledGrammar::top_size(const State& s, size_t i) const {
  // Down from the top position while what may follow the bottom entry's rule starts with
  // many different bytes (each of them would make tokens dependent), up to a few entries.
  constexpr size_t kNarrowFollow = 16, kMaxTop = 4;
  const size_t n = s.size_of(i);
  size_t k = 1;
  while (k < n && k < kMaxTop && follow_[rule_of_[s.data[s.ends[i] - k]]].count() > kNarrowFollow) ++k;
  return k;
}

std::shared_ptr<const CompiledGrammar::PositionMask> CompiledGrammar::position_mask(const uint32_t* top, size_t size) const {
  std::string k(reinterpret_cast<const char*>(top), size * sizeof(uint32_t));
  {
    std::lock_guard lock(mu_);
    if (auto it = positions_.find(k); it != positions_.end()) return it->second;
  }
  std::shared_ptr<const PositionMask> pm = compute_position_mask(Stack(top, top + size));
  std::lock_guard lock(mu_);
  if (auto it = positions_.find(k); it != positions_.end()) return it->second;  // computed meanwhile
  if (position_bytes_ + pm->bytes() > kMaxPositionMaskBytes) {
    positions_.clear();
    position_bytes_ = 0;
  }
  positions_.emplace(std::move(k), pm);
  position_bytes_ += pm->bytes();
  return pm;
}

std::shared_ptr<const CompiledGrammar::PositionMask> CompiledGrammar::compute_position_mask(const Stack& top) const {
  const TokenVocab& v = *vocab_;
  const size_t n = v.order_.size(), num_words = (size_t(v.size()) + 63) / 64;
  const int chunks = walk_chunks();
  std::vector<std::vector<uint64_t>> words(static_cast<size_t>(chunks));
  std::vector<std::vector<uint32_t>> dependent(static_cast<size_t>(chunks));
  std::exception_ptr failed;
#pragma omp parallel for schedule(static, 1) num_threads(chunks) if (chunks > 1)
  for (int c = 0; c < chunks; ++c) {
    try {
      words[size_t(c)].assign(num_words, 0);
      classify(top, n * size_t(c) / size_t(chunks), n * size_t(c + 1) / size_t(chunks), words[size_t(c)], dependent[size_t(c)]);
    } catch (...) {
#pragma omp critical(kvlm_grammar_mask)
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  auto pm = std::make_shared<PositionMask>();
  std::vector<uint64_t> accepted(num_words, 0);
  for (const auto& w : words)
    for (size_t i = 0; i < num_words; ++i) accepted[i] |= w[i];
  size_t count = 0;
  for (uint64_t w : accepted) count += size_t(std::popcount(w));
  if (4 * count < 8 * num_words) {  // the ids take less memory than the bits
    pm->ids.reserve(count);
    for (size_t i = 0; i < num_words; ++i)
      for (uint64_t w = accepted[i]; w; w &= w - 1) pm->ids.push_back(TokenId(64 * i + size_t(std::countr_zero(w))));
  } else {
    pm->bits = std::move(accepted);
  }
  for (const auto& d : dependent) pm->dependent.insert(pm->dependent.end(), d.begin(), d.end());
  // Common prefix of consecutive dependent tokens: the least of the sorted vocabulary's
  // neighbour prefixes between them.
  pm->dependent_lcp.resize(pm->dependent.size());
  for (size_t k = 0; k < pm->dependent.size(); ++k) {
    uint32_t l = 0;
    if (k) {
      l = UINT32_MAX;
      for (size_t i = pm->dependent[k - 1] + 1; i <= pm->dependent[k]; ++i) l = std::min(l, v.lcp_[i]);
    }
    pm->dependent_lcp[k] = l;
  }
  return pm;
}

// A walk steps the same few states over and over (a string's interior is one state; a
// counted string one per count), byte after byte down the sorted vocabulary. Interned, with
// each state's transitions memoized, most of its ~10^5 steps are a table lookup instead of
// a step over stacks.
struct CompiledGrammar::Dfa {
  static constexpr uint32_t kDead = UINT32_MAX, kUnknown = UINT32_MAX - 1;
  // States with a transition table (1 KiB each); later ones are interned but stepped anew.
  static constexpr size_t kMaxTables = 4096;

  const CompiledGrammar& g;
  std::vector<State> states;
  std::vector<uint8_t> accepting;
  std::vector<std::array<uint32_t, 256>> next;
  std::unordered_map<std::string, uint32_t> ids;
  State scratch;

  Dfa(const CompiledGrammar& grammar, const State& start) : g(grammar) { add(start); }
  uint32_t add(const State& s) {
    const auto [it, fresh] = ids.emplace(key(s), uint32_t(states.size()));
    if (fresh) {
      states.push_back(s);
      accepting.push_back(CompiledGrammar::accepting(s));
      if (next.size() < kMaxTables) next.emplace_back().fill(kUnknown);
    }
    return it->second;
  }
  uint32_t step(uint32_t id, uint8_t b) {
    if (id < next.size() && next[id][b] != kUnknown) return next[id][b];
    g.step(states[id], b, scratch);
    const uint32_t to = scratch.dead() ? kDead : add(scratch);
    if (id < next.size()) next[id][b] = to;
    return to;
  }
};

template <class Items>
void CompiledGrammar::walk(const State& s, const Items& items, std::vector<uint64_t>& words, const std::bitset<256>* follow,
                           std::vector<uint32_t>* dependent) const {
  const TokenVocab& v = *vocab_;
  Dfa dfa(*this, s);
  // path[d]: the state after the first d bytes of the current token; valid for d <= alive.
  // dep[d] (with `follow`): the first d bytes passed a point where a stack emptied and the
  // next byte may start what follows its rule.
  std::vector<uint32_t> path(1, 0);
  std::vector<uint8_t> dep(1, 0);
  size_t alive = 0;
  const size_t n = items.size();
  for (size_t k = 0; k < n; ++k) {
    if ((k & 1023) == 0) check_deadline();
    const TokenId id = v.order_[items.index(k)];
    const std::string& b = v.bytes_[size_t(id)];
    size_t d = std::min<size_t>(items.prefix(k), alive);
    bool dead = false;
    if (path.size() < b.size() + 1) {
      path.resize(b.size() + 1);
      dep.resize(b.size() + 1);
    }
    for (; d < b.size(); ++d) {
      const uint8_t c = uint8_t(b[d]);
      if (follow) dep[d + 1] = dep[d] || (dfa.accepting[path[d]] && (*follow)[c]);
      const uint32_t to = dfa.step(path[d], c);
      if (to == Dfa::kDead) {
        dead = true;
        break;
      }
      path[d + 1] = to;
    }
    alive = d;
    if (!dead) {
      words[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
      continue;
    }
    // Every following token that shares the dead prefix b[0..d] ends the same way.
    const bool depends = follow && dep[d + 1];
    if (depends) dependent->push_back(uint32_t(items.index(k)));
    while (k + 1 < n && items.prefix(k + 1) > d) {
      ++k;
      if (depends) dependent->push_back(uint32_t(items.index(k)));
    }
  }
}

void CompiledGrammar::classify(const Stack& top, size_t begin, size_t end, std::vector<uint64_t>& words,
                               std::vector<uint32_t>& dependent) const {
  // A walk from {top}. A stack of it that empties has finished the rule of the top's bottom
  // entry; in a real state the stack below goes on from there, which this walk cannot see: a
  // token that dies after such a point, where the next byte may start what follows that rule,
  // may live in some real state (dependent). The tokens that live, live without the stack
  // below.
  State s0;
  s0.push(top);
  walk(s0, RangeItems{vocab_->lcp_, begin, end}, words, &follow_[rule_of_[top.front()]], &dependent);
}

// ---- one generation ---------------------------------------------------------------------

namespace {

// Masks computed ahead (Constraint::prefetch) run on a few persistent workers: a thread per
// mask, each with its own thread team for the walk (walk_chunks), could take every core from
// the engine thread when many constrained requests run at once. An eighth of the cores (up
// to half of them busy, with the walks' teams) is enough, since the engine does not wait
// for a late mask (Sequence::deferred). The workers run at a lower scheduling priority
// (lower_thread_priority): on a machine with few cores a costly grammar then takes the CPU
// time the forward pass leaves, rather than a core the engine's thread team waits on (which
// stalled every other request's step 25-50x on 2 cores).
class MaskPool {
 public:
  using Task = std::packaged_task<std::shared_ptr<const TokenMask>()>;
  static MaskPool& get() {
    static MaskPool* pool = new MaskPool(std::max(1u, std::thread::hardware_concurrency() / 8));  // lives to exit
    return *pool;
  }
  std::shared_future<std::shared_ptr<const TokenMask>> submit(std::function<std::shared_ptr<const TokenMask>()> f) {
    Task t(std::move(f));
    auto fut = t.get_future().share();
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(t));
    }
    cv_.notify_one();
    return fut;
  }

 private:
  explicit MaskPool(unsigned n) {
    for (unsigned i = 0; i < n; ++i)
      std::thread([this] {
        lower_thread_priority();
        for (;;) {
          Task t;
          {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return !queue_.empty(); });
            t = std::move(queue_.front());
            queue_.pop_front();
          }
          t();  // an exception lands in the future
        }
      }).detach();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
};

}  // namespace

void lower_thread_priority() {
  // Linux's nice value is per thread (the id from gettid); best effort: nothing to do if
  // the system refuses.
  [[maybe_unused]] const int rc = ::setpriority(PRIO_PROCESS, id_t(::syscall(SYS_gettid)), kGrammarThreadNice);
}

std::shared_ptr<const TokenMask> Constraint::allowed() const {
  if (next_.valid()) {
    auto f = std::move(next_);
    next_ = {};
    return f.get();
  }
  return g_->mask(state_);
}

void Constraint::prefetch() {
  if (next_.valid() || terminated() || g_->cached(state_)) return;
  // A mask nobody will read (its request ended while it queued) is skipped.
  next_ = MaskPool::get().submit([g = g_, st = state_, gate = gate_, wanted = std::weak_ptr<const char>(alive_)] {
    if (gate.valid()) gate.wait();
    return wanted.expired() ? nullptr : g->mask(st);
  });
}

bool Constraint::ready() {
  if (!next_.valid()) {
    if (terminated() || g_->cached(state_)) return true;
    prefetch();
  }
  return next_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

void Constraint::wait() const {
  if (next_.valid()) next_.wait();
}

bool Constraint::accept(TokenId t) {
  const TokenVocab& v = g_->vocab();
  if (t < 0 || t >= v.size()) return false;
  if (v.bytes(t).empty()) {  // a special token: only where the grammar names it
    if (!g_->step_special(state_, t, scratch_) || scratch_.dead()) return false;
    std::swap(state_, scratch_);
    next_ = {};
    return true;
  }
  return accept_text(v.bytes(t));
}

bool Constraint::accept_text(std::string_view bytes) {
  CompiledGrammar::State cur = state_;
  for (char c : bytes) {
    g_->step(cur, uint8_t(c), scratch_);
    if (scratch_.dead()) return false;
    std::swap(cur, scratch_);
  }
  state_ = std::move(cur);
  next_ = {};  // computed for the state before
  return true;
}

}  // namespace kvlm::grammar

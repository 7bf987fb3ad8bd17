#include "text/grammar/matcher.h"

#include <algorithm>
#include <bit>
#include <numeric>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/error.h"
#include "io/tokenizer/tokenizer.h"

namespace kvlm::grammar {

namespace {
// A state whose stacks outnumber this is an ambiguous grammar blowing up (e.g. (a|a)*
// nested): the request fails rather than the engine thread stalling on it.
constexpr size_t kMaxStacks = 4096;
// Masks kept per grammar; at the limit the cache starts over.
constexpr size_t kMaxCachedMasks = 4096;
}  // namespace

// ---- vocabulary -------------------------------------------------------------------------

TokenVocab::TokenVocab(const Tokenizer& tok, int vocab_size) {
  bytes_.resize(size_t(std::max(vocab_size, 0)));
  for (int id = 0; id < vocab_size; ++id) bytes_[size_t(id)] = tok.token_bytes(id);
  index();
}

TokenVocab::TokenVocab(std::vector<std::string> bytes) : bytes_(std::move(bytes)) { index(); }

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

CompiledGrammar::CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocab> vocab) : vocab_(std::move(vocab)) {
  g.validate();
  alt_starts_.resize(g.num_rules());
  for (uint32_t r = 0; r < g.num_rules(); ++r)
    for (const Sequence& alt : g.alts(r)) {
      alt_starts_[r].push_back(uint32_t(flat_.size()));
      for (const Symbol& s : alt) {
        if (s.kind == Symbol::Kind::Ref) {
          flat_.push_back({kRef, s.rule});
        } else {
          std::vector<CharRange> rs = s.ranges;
          std::sort(rs.begin(), rs.end(), [](const CharRange& a, const CharRange& b) { return a.lo < b.lo; });
          classes_.push_back({s.negated, std::move(rs)});
          flat_.push_back({kChars, uint32_t(classes_.size() - 1)});
        }
      }
      flat_.push_back({kEnd, 0});
    }
  root_ = g.root();
}

bool CompiledGrammar::matches(uint32_t cls, uint32_t cp) const {
  const Class& c = classes_[cls];
  bool in = false;
  for (const CharRange& r : c.ranges)
    if (cp >= r.lo && cp <= r.hi) {
      in = true;
      break;
    }
  return in != c.negated;
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
  // The grammar has no left recursion (validated), so expansion without a character
  // consumed visits each rule at most once per path: the recursion is bounded by the rules.
  if (s.empty()) {
    out.push(s);
    return;
  }
  const uint32_t p = s.back();
  const Flat f = flat_[p];
  if (f.kind == kChars) {
    if (out.num_stacks() >= kMaxStacks)
      throw Error("the grammar is too ambiguous to match (more than " + std::to_string(kMaxStacks) +
                  " parses at once); make its alternatives start differently");
    out.push(s);
    return;
  }
  s.pop_back();
  if (f.kind == kEnd) {
    expand(s, out);
  } else {
    // A reference in tail position leaves nothing to return to.
    const bool cont = flat_[p + 1].kind != kEnd;
    if (cont) s.push_back(p + 1);
    for (uint32_t start : alt_starts_[f.arg]) {
      s.push_back(start);
      expand(s, out);
      s.pop_back();
    }
    if (cont) s.pop_back();
  }
  s.push_back(p);
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

std::shared_ptr<const TokenMask> CompiledGrammar::mask(const State& s) const {
  std::string k = key(s);
  {
    std::lock_guard lock(mu_);
    if (auto it = cache_.find(k); it != cache_.end()) return it->second;
  }
  std::shared_ptr<const TokenMask> m = compute_mask(s);
  std::lock_guard lock(mu_);
  if (cache_.size() >= kMaxCachedMasks) cache_.clear();
  cache_.emplace(std::move(k), m);
  return m;
}

std::shared_ptr<TokenMask> CompiledGrammar::compute_mask(const State& s) const {
  auto m = std::make_shared<TokenMask>();
  const TokenVocab& v = *vocab_;
  m->words.assign((size_t(v.size()) + 63) / 64, 0);
  if (s.dead()) return m;
  // The sorted vocabulary in chunks walked in parallel (each from the state itself; a chunk
  // sets bits in its own copy, merged after) where the machine has cores to spare: a few
  // threads, so that a CPU forward pass running beside it is not starved.
  const size_t n = v.order_.size();
  int chunks = 1;
#ifdef _OPENMP
  if (!omp_in_parallel() && std::thread::hardware_concurrency() >= 8) chunks = std::clamp(omp_get_max_threads(), 1, 4);
#endif
  if (n < 4096) chunks = 1;
  std::vector<std::vector<uint64_t>> words(static_cast<size_t>(chunks));
  std::exception_ptr failed;
#pragma omp parallel for schedule(static, 1) num_threads(chunks) if (chunks > 1)
  for (int c = 0; c < chunks; ++c) {
    try {
      words[size_t(c)].assign(m->words.size(), 0);
      walk(s, n * size_t(c) / size_t(chunks), n * size_t(c + 1) / size_t(chunks), words[size_t(c)]);
    } catch (...) {
#pragma omp critical(kvlm_grammar_mask)
      failed = std::current_exception();
    }
  }
  if (failed) std::rethrow_exception(failed);
  for (const auto& w : words)
    for (size_t i = 0; i < w.size(); ++i) m->words[i] |= w[i];
  return m;
}

void CompiledGrammar::walk(const State& s, size_t begin, size_t end, std::vector<uint64_t>& words) const {
  const TokenVocab& v = *vocab_;
  // states[d]: the state after the first d bytes of the current token; valid for d <= alive.
  std::vector<State> states(1, s);
  size_t alive = 0;  // states[0..alive] hold for the current token's prefix
  for (size_t i = begin; i < end; ++i) {
    const TokenId id = v.order_[i];
    const std::string& b = v.bytes_[size_t(id)];
    size_t d = std::min<size_t>(i == begin ? 0 : v.lcp_[i], alive);
    bool dead = false;
    while (d < b.size()) {
      if (states.size() < d + 2) states.resize(d + 2);
      step(states[d], uint8_t(b[d]), states[d + 1]);
      if (states[d + 1].dead()) {
        dead = true;
        break;
      }
      ++d;
    }
    alive = d;
    if (!dead) {
      words[size_t(id) >> 6] |= uint64_t(1) << (id & 63);
      continue;
    }
    // Every following token that shares the dead prefix b[0..d] is dead too.
    while (i + 1 < end && v.lcp_[i + 1] > d) ++i;
  }
}

// ---- one generation ---------------------------------------------------------------------

std::shared_ptr<const TokenMask> Constraint::allowed() const {
  if (next_.valid()) {
    auto f = std::move(next_);
    next_ = {};
    return f.get();
  }
  return g_->mask(state_);
}

void Constraint::prefetch() {
  next_ = {};
  if (terminated() || g_->cached(state_)) return;
  next_ = std::async(std::launch::async, [g = g_, st = state_] { return g->mask(st); }).share();
}

bool Constraint::accept(TokenId t) {
  const TokenVocab& v = g_->vocab();
  if (t < 0 || t >= v.size() || v.bytes(t).empty()) return false;
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

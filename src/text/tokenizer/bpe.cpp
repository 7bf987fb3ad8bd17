#include "text/tokenizer/bpe.h"

#include <nlohmann/json.hpp>
#include <queue>

#include "core/error.h"
#include "text/tokenizer/unicode.h"

namespace kvlm::tok {

using nlohmann::json;

namespace {
constexpr size_t kCacheMax = 100000;
constexpr size_t kCacheWordMax = 64;  // bytes; longer words are rare and not cached

uint64_t key(TokenId a, TokenId b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
}  // namespace

BpeSpec parse_bpe_spec(const json& m) {
  if (m.value("type", "BPE") != "BPE")
    throw Error("tokenizer.json: model type '" + m.value("type", "") + "' is not supported (kvlm supports BPE)");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
    throw Error("tokenizer.json: BPE dropout is not supported at inference");
  const json& vocab = m.at("vocab");
  if (!vocab.is_object()) throw Error("tokenizer.json: model.vocab must be an object");
  BpeSpec spec;
  spec.vocab.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const long long id = it.value().get<long long>();
    if (id < 0 || id > (1 << 24)) throw Error("tokenizer.json: vocab id " + std::to_string(id) + " is out of range");
    spec.vocab.emplace_back(it.key(), TokenId(id));
  }
  spec.byte_fallback = m.value("byte_fallback", false);
  spec.fuse_unk = m.value("fuse_unk", false);
  spec.ignore_merges = m.value("ignore_merges", false);
  if (m.contains("continuing_subword_prefix") && m["continuing_subword_prefix"].is_string())
    spec.continuing_prefix = m["continuing_subword_prefix"].get<std::string>();
  if (m.contains("end_of_word_suffix") && m["end_of_word_suffix"].is_string())
    spec.end_suffix = m["end_of_word_suffix"].get<std::string>();
  if (m.contains("unk_token") && m["unk_token"].is_string()) spec.unk_token = m["unk_token"].get<std::string>();
  const json& merges = m.at("merges");
  spec.merges.reserve(merges.size());
  for (const auto& mg : merges) {
    if (mg.is_string()) {  // legacy "a b"
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) throw Error("tokenizer.json: merge '" + s + "' is not 'a b'");
      spec.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
    } else if (mg.is_array() && mg.size() == 2) {
      spec.merges.emplace_back(mg[0].get<std::string>(), mg[1].get<std::string>());
    } else {
      throw Error("tokenizer.json: a merge must be \"a b\" or [\"a\", \"b\"]");
    }
  }
  return spec;
}

BpeModel::BpeModel(const BpeSpec& spec) {
  vocab_.reserve(spec.vocab.size());
  for (const auto& [token, id] : spec.vocab) {
    if (id < 0 || id > (1 << 24)) throw Error("vocab id " + std::to_string(id) + " is out of range");
    if (auto [it, fresh] = vocab_.emplace(token, id); !fresh) {
      id_to_token_[size_t(it->second)].clear();  // as a map: the later id wins, the earlier one has no token
      it->second = id;
    }
    if (size_t(id) >= id_to_token_.size()) id_to_token_.resize(size_t(id) + 1);
    id_to_token_[size_t(id)] = token;
  }
  byte_fallback_ = spec.byte_fallback;
  fuse_unk_ = spec.fuse_unk;
  ignore_merges_ = spec.ignore_merges;
  continuing_prefix_ = spec.continuing_prefix;
  end_suffix_ = spec.end_suffix;
  if (spec.unk_token) {
    auto it = vocab_.find(*spec.unk_token);
    if (it == vocab_.end()) throw Error("unk_token '" + *spec.unk_token + "' is not in the vocabulary");
    unk_ = it->second;
  }
  byte_tokens_.fill(-1);
  if (byte_fallback_) {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      if (auto it = vocab_.find(name); it != vocab_.end()) byte_tokens_[size_t(b)] = it->second;
    }
  }
  merges_.reserve(spec.merges.size());
  int32_t rank = 0;
  std::string joined;
  for (const auto& [a, b] : spec.merges) {
    const auto ia = vocab_.find(a), ib = vocab_.find(b);
    const size_t skip = !continuing_prefix_.empty() && b.starts_with(continuing_prefix_) ? continuing_prefix_.size() : 0;
    joined.assign(a).append(b, skip);
    const auto ij = vocab_.find(joined);
    if (ia == vocab_.end() || ib == vocab_.end() || ij == vocab_.end())
      throw Error("merge '" + a + " " + b + "' uses tokens missing from the vocabulary");
    // A pair listed twice keeps its later rank, as the Rust library's map does.
    merges_.insert_or_assign(key(ia->second, ib->second), Merge{rank++, ij->second});
  }
}

std::optional<TokenId> BpeModel::token_to_id(std::string_view t) const {
  auto it = vocab_.find(t);
  return it == vocab_.end() ? std::nullopt : std::optional<TokenId>(it->second);
}

bool BpeModel::marker_starts_tokens(std::string_view marker) const {
  for (const auto& [tok, id] : vocab_) {
    for (size_t p = tok.find(marker, 1); p != std::string::npos; p = tok.find(marker, p + 1))
      if (p < marker.size() || tok.compare(p - marker.size(), marker.size(), marker) != 0) return false;
  }
  return true;
}

const std::string* BpeModel::id_to_token(TokenId id) const {
  if (id < 0 || size_t(id) >= id_to_token_.size() || id_to_token_[size_t(id)].empty()) return nullptr;
  return &id_to_token_[size_t(id)];
}

void BpeModel::encode_word(std::string_view word, std::vector<TokenId>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() <= kCacheWordMax) {
    std::lock_guard lock(cache_mu_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out.size();
  merge_word(word, out);
  if (word.size() <= kCacheWordMax) {
    std::lock_guard lock(cache_mu_);
    if (cache_.size() >= kCacheMax) cache_.clear();
    cache_.emplace(std::string(word), std::vector<TokenId>(out.begin() + ptrdiff_t(start), out.end()));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<TokenId>& out) const {
  // Symbols: a doubly linked list over the initial characters (or fallback bytes).
  struct Sym {
    TokenId id;
    int prev, next;
    bool alive;
  };
  std::vector<Sym> syms;
  syms.reserve(word.size());
  bool last_unk = false;
  auto push = [&](TokenId id) {
    syms.push_back({id, int(syms.size()) - 1, int(syms.size()) + 1, true});
  };
  for (size_t i = 0; i < word.size();) {
    const auto d = utf8::decode(word, i);
    const std::string_view raw_ch = word.substr(i, size_t(d.len));
    const bool first = i == 0, last = i + size_t(d.len) == word.size();
    i += size_t(d.len);
    auto it = vocab_.end();
    if (continuing_prefix_.empty() && end_suffix_.empty()) {
      it = vocab_.find(raw_ch);  // the common case: no allocation
    } else {
      std::string ch = (first ? std::string() : continuing_prefix_) + std::string(raw_ch) + (last ? end_suffix_ : std::string());
      it = vocab_.find(ch);
    }
    if (it != vocab_.end()) {
      push(it->second);
      last_unk = false;
      continue;
    }
    if (byte_fallback_) {
      const std::string_view raw = word.substr(i - size_t(d.len), size_t(d.len));
      bool all = true;
      for (char c : raw) all &= byte_tokens_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        for (char c : raw) push(byte_tokens_[static_cast<uint8_t>(c)]);
        last_unk = false;
        continue;
      }
    }
    if (unk_) {
      if (!(fuse_unk_ && last_unk)) push(*unk_);
      last_unk = true;
    }
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  // Min-heap of candidate merges: lowest rank first, then leftmost position.
  struct Cand {
    int32_t rank;
    int pos;
    TokenId merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<>> heap;
  auto consider = [&](int pos) {
    const int nx = syms[size_t(pos)].next;
    if (nx < 0) return;
    auto it = merges_.find(key(syms[size_t(pos)].id, syms[size_t(nx)].id));
    if (it != merges_.end()) heap.push({it->second.rank, pos, it->second.merged});
  };
  for (int i = 0; i + 1 < int(syms.size()); ++i) consider(i);
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& s = syms[size_t(c.pos)];
    if (!s.alive || s.next < 0) continue;
    // Stale entry: the pair at this position changed since it was queued.
    auto it = merges_.find(key(s.id, syms[size_t(s.next)].id));
    if (it == merges_.end() || it->second.merged != c.merged) continue;
    Sym& nx = syms[size_t(s.next)];
    s.id = c.merged;
    nx.alive = false;
    s.next = nx.next;
    if (s.next >= 0) syms[size_t(s.next)].prev = c.pos;
    if (s.prev >= 0) consider(s.prev);
    consider(c.pos);
  }
  for (int i = 0; i >= 0; i = syms[size_t(i)].next) out.push_back(syms[size_t(i)].id);
}

}  // namespace kvlm::tok

#include "text/tokenizer/pipeline.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer/unicode.h"

namespace kvlm::tok {

using nlohmann::json;

namespace {

std::string type_of(const json& j, const char* what) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw Error(std::string("tokenizer.json: a ") + what + " has no \"type\"");
  return j["type"].get<std::string>();
}

std::string str_field(const json& j, const char* key, const std::string& def = "") {
  return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : def;
}

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  if (from.empty()) return;
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  for (size_t p; (p = s.find(from, i)) != std::string::npos; i = p + from.size()) out.append(s, i, p - i).append(to);
  out.append(s, i, std::string::npos);
  s.swap(out);
}

// Pattern of Split / Replace: {"String": "..."} (literal) or {"Regex": "..."}.
struct Pattern {
  std::string literal;
  std::optional<Regex> regex;
  explicit Pattern(const json& p) {
    if (p.contains("Regex")) {
      regex.emplace(p["Regex"].get<std::string>());
    } else if (p.contains("String")) {
      literal = p["String"].get<std::string>();
    } else {
      throw Error("tokenizer.json: pattern must be {\"String\": ...} or {\"Regex\": ...}");
    }
  }
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view s) const {
    if (regex) return regex->find_all(s);
    std::vector<std::pair<size_t, size_t>> out;
    if (literal.empty()) return out;
    for (size_t p = 0; (p = s.find(literal, p)) != std::string_view::npos; p += literal.size()) out.emplace_back(p, p + literal.size());
    return out;
  }
};

// ---- normalizers ------------------------------------------------------------------------
struct UnicodeNorm : Normalizer {
  utf8::Form form;
  explicit UnicodeNorm(utf8::Form f) : form(f) {}
  std::string apply(std::string s) const override { return utf8::normalize(s, form); }
};
struct Prepend : Normalizer {
  std::string prefix;
  std::string apply(std::string s) const override { return s.empty() ? s : prefix + s; }
};
struct Replace : Normalizer {
  Pattern pattern;
  std::string content;
  Replace(const json& j) : pattern(j.at("pattern")), content(str_field(j, "content")) {}
  std::string apply(std::string s) const override {
    if (!pattern.regex) {
      replace_all(s, pattern.literal, content);
      return s;
    }
    std::string out;
    size_t last = 0;
    for (auto [b, e] : pattern.find_all(s)) out.append(s, last, b - last).append(content), last = e;
    out.append(s, last, std::string::npos);
    return out;
  }
};
struct NormSequence : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> steps;
  std::string apply(std::string s) const override {
    for (const auto& n : steps) s = n->apply(std::move(s));
    return s;
  }
};

// ---- pre-tokenizers ---------------------------------------------------------------------
enum class SplitBehavior { Isolated, Removed, MergedWithPrevious, MergedWithNext };

struct Split : PreTokenizer {
  Pattern pattern;
  SplitBehavior behavior;
  explicit Split(const json& j) : pattern(j.at("pattern")) {
    if (j.value("invert", false)) throw Error("tokenizer.json: Split with invert=true is not supported");
    const std::string b = str_field(j, "behavior", "Isolated");
    if (b == "Isolated") behavior = SplitBehavior::Isolated;
    else if (b == "Removed") behavior = SplitBehavior::Removed;
    else if (b == "MergedWithPrevious") behavior = SplitBehavior::MergedWithPrevious;
    else if (b == "MergedWithNext") behavior = SplitBehavior::MergedWithNext;
    else throw Error("tokenizer.json: Split behavior '" + b + "' is not supported");
  }
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    out.reserve(pieces.size() * 4);
    for (Piece& p : pieces) {
      const std::string& s = p.text;
      std::vector<std::pair<size_t, size_t>> spans;  // pieces as [b, e)
      const auto matches = pattern.find_all(s);
      size_t last = 0;
      for (size_t k = 0; k < matches.size(); ++k) {
        const auto [b, e] = matches[k];
        switch (behavior) {
          case SplitBehavior::Isolated:
            if (b > last) spans.emplace_back(last, b);
            spans.emplace_back(b, e);
            break;
          case SplitBehavior::Removed:
            if (b > last) spans.emplace_back(last, b);
            break;
          case SplitBehavior::MergedWithPrevious:  // the gap before a match joins it
            spans.emplace_back(last, e);
            break;
          case SplitBehavior::MergedWithNext:  // a match joins the gap after it
            if (k == 0 && b > 0) spans.emplace_back(0, b);
            spans.emplace_back(b, k + 1 < matches.size() ? matches[k + 1].first : s.size());
            break;
        }
        last = e;
      }
      if (behavior == SplitBehavior::MergedWithNext) {
        if (matches.empty()) spans.emplace_back(0, s.size());
      } else if (last < s.size()) {
        spans.emplace_back(last, s.size());
      }
      for (auto [b, e] : spans) out.push_back({s.substr(b, e - b), p.at_start && b == 0});
    }
    pieces.swap(out);
  }
};

struct ByteLevel : PreTokenizer {
  bool add_prefix_space, use_regex;
  std::optional<Regex> gpt2;
  explicit ByteLevel(const json& j)
      : add_prefix_space(j.value("add_prefix_space", true)), use_regex(j.value("use_regex", true)) {
    if (use_regex)
      gpt2.emplace(R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  }
  void apply(std::vector<Piece>& pieces) const override {
    const auto& chars = utf8::byte_chars();
    std::vector<Piece> out;
    out.reserve(pieces.size());
    for (Piece& p : pieces) {
      std::string s = std::move(p.text);
      if (add_prefix_space && !s.empty() && s[0] != ' ') s.insert(s.begin(), ' ');
      std::vector<std::pair<size_t, size_t>> spans;
      if (gpt2) {
        size_t last = 0;
        for (auto [b, e] : gpt2->find_all(s)) {
          if (b > last) spans.emplace_back(last, b);
          spans.emplace_back(b, e);
          last = e;
        }
        if (last < s.size()) spans.emplace_back(last, s.size());
      } else {
        spans.emplace_back(0, s.size());
      }
      for (auto [b, e] : spans) {
        std::string mapped;
        mapped.reserve((e - b) * 2);
        for (size_t i = b; i < e; ++i) mapped += chars[static_cast<uint8_t>(s[i])];
        out.push_back({std::move(mapped), p.at_start && b == 0});
      }
    }
    pieces.swap(out);
  }
};

constexpr std::string_view kMetaspace = "\xE2\x96\x81";  // U+2581

struct Metaspace : PreTokenizer {
  std::string replacement;
  std::string scheme;  // always | first | never
  bool split;
  explicit Metaspace(const json& j)
      : replacement(str_field(j, "replacement", std::string(kMetaspace))),
        scheme(str_field(j, "prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never")),
        split(j.value("split", true)) {
    if (scheme != "always" && scheme != "first" && scheme != "never")
      throw Error("tokenizer.json: Metaspace prepend_scheme '" + scheme + "' is not supported");
  }
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      std::string s = std::move(p.text);
      replace_all(s, " ", replacement);
      const bool prepend = scheme == "always" || (scheme == "first" && p.at_start);
      if (prepend && !s.starts_with(replacement)) s = replacement + s;
      if (!split) {
        out.push_back({std::move(s), p.at_start});
        continue;
      }
      // Split before every replacement character (MergedWithNext).
      size_t start = 0;
      for (size_t pos = s.find(replacement, 1); pos != std::string::npos; pos = s.find(replacement, pos + 1)) {
        out.push_back({s.substr(start, pos - start), p.at_start && start == 0});
        start = pos;
      }
      if (start < s.size()) out.push_back({s.substr(start), p.at_start && start == 0});
    }
    pieces.swap(out);
  }
};

struct Digits : PreTokenizer {
  bool individual;
  explicit Digits(const json& j) : individual(j.value("individual_digits", false)) {}
  void apply(std::vector<Piece>& pieces) const override {
    std::vector<Piece> out;
    for (Piece& p : pieces) {
      const std::string& s = p.text;
      size_t i = 0, start = 0;
      bool in_digits = false;
      while (i < s.size()) {
        const bool d = s[i] >= '0' && s[i] <= '9';
        if ((d && (individual || !in_digits)) || (!d && in_digits)) {
          if (i > start) out.push_back({s.substr(start, i - start), p.at_start && start == 0});
          start = i;
        }
        in_digits = d;
        ++i;
      }
      if (start < s.size()) out.push_back({s.substr(start), p.at_start && start == 0});
    }
    pieces.swap(out);
  }
};

struct PreSequence : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& s : steps) s->apply(pieces);
  }
};

// ---- decoders ---------------------------------------------------------------------------
struct ByteLevelDecoder : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      std::string mapped;
      bool all = true;
      for (size_t i = 0; i < t.size();) {
        const auto d = utf8::decode(t, i);
        const int b = d.valid ? utf8::char_to_byte(d.cp) : -1;
        if (b < 0) {
          all = false;
          break;
        }
        mapped.push_back(char(b));
        i += size_t(d.len);
      }
      bytes += all ? mapped : t;  // a token outside the alphabet (an added token) keeps its bytes
    }
    tokens.assign(1, utf8::sanitize(bytes));
  }
  void piece(std::string& t) const override {
    std::string mapped;
    for (size_t i = 0; i < t.size();) {
      const auto d = utf8::decode(t, i);
      const int b = d.valid ? utf8::char_to_byte(d.cp) : -1;
      if (b < 0) return;  // outside the alphabet: the token's own bytes
      mapped.push_back(char(b));
      i += size_t(d.len);
    }
    t = std::move(mapped);
  }
};
struct ReplaceDecoder : Decoder {
  Pattern pattern;
  std::string content;
  explicit ReplaceDecoder(const json& j) : pattern(j.at("pattern")), content(str_field(j, "content")) {
    if (pattern.regex) throw Error("tokenizer.json: a Replace decoder with a regex pattern is not supported");
  }
  void apply(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) replace_all(t, pattern.literal, content);
  }
  void piece(std::string& t) const override { replace_all(t, pattern.literal, content); }
};
struct ByteFallbackDecoder : Decoder {
  static int byte_of(const std::string& t) {  // "<0xAB>" -> 0xAB
    if (t.size() != 6 || t[0] != '<' || t[1] != '0' || t[2] != 'x' || t[5] != '>') return -1;
    auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    const int h = hex(t[3]), l = hex(t[4]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
  }
  void apply(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    size_t count = 0;
    auto flush = [&] {
      if (count == 0) return;
      if (utf8::is_valid(pending)) {
        out.push_back(pending);
      } else {
        std::string r;
        for (size_t i = 0; i < count; ++i) r += utf8::kReplacement;
        out.push_back(r);
      }
      pending.clear();
      count = 0;
    };
    for (auto& t : tokens) {
      const int b = byte_of(t);
      if (b >= 0) {
        pending.push_back(char(b));
        ++count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    tokens.swap(out);
  }
  void piece(std::string& t) const override {
    if (const int b = byte_of(t); b >= 0) t.assign(1, char(b));
  }
};
struct FuseDecoder : Decoder {
  void apply(std::vector<std::string>& tokens) const override {
    std::string all;
    for (auto& t : tokens) all += t;
    tokens.assign(1, all);
  }
  void piece(std::string&) const override {}
};
struct StripDecoder : Decoder {
  std::string content;
  size_t start, stop;
  explicit StripDecoder(const json& j)
      : content(str_field(j, "content", " ")), start(j.value("start", 0)), stop(j.value("stop", 0)) {}
  void apply(std::vector<std::string>& tokens) const override {
    for (auto& t : tokens) {
      for (size_t i = 0; i < start && t.starts_with(content); ++i) t.erase(0, content.size());
      for (size_t i = 0; i < stop && t.ends_with(content); ++i) t.erase(t.size() - content.size());
    }
  }
  void piece(std::string&) const override {}  // strips the text's ends, not a token's
};
struct MetaspaceDecoder : Decoder {
  std::string replacement;
  bool strip_first;
  explicit MetaspaceDecoder(const json& j)
      : replacement(str_field(j, "replacement", std::string(kMetaspace))),
        strip_first(str_field(j, "prepend_scheme", j.value("add_prefix_space", true) ? "always" : "never") != "never") {}
  void apply(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      replace_all(tokens[i], replacement, " ");
      if (i == 0 && strip_first && tokens[i].starts_with(' ')) tokens[i].erase(0, 1);
    }
  }
  void piece(std::string& t) const override { replace_all(t, replacement, " "); }
};
struct DecSequence : Decoder {
  std::vector<std::unique_ptr<Decoder>> steps;
  void apply(std::vector<std::string>& tokens) const override {
    for (const auto& d : steps) d->apply(tokens);
  }
  void piece(std::string& t) const override {
    for (const auto& d : steps) d->piece(t);
  }
};

}  // namespace

std::unique_ptr<Normalizer> parse_normalizer(const json& j) {
  if (j.is_null()) return nullptr;
  const std::string t = type_of(j, "normalizer");
  if (t == "NFC") return std::make_unique<UnicodeNorm>(utf8::Form::NFC);
  if (t == "NFD") return std::make_unique<UnicodeNorm>(utf8::Form::NFD);
  if (t == "NFKC") return std::make_unique<UnicodeNorm>(utf8::Form::NFKC);
  if (t == "NFKD") return std::make_unique<UnicodeNorm>(utf8::Form::NFKD);
  if (t == "Prepend") {
    auto p = std::make_unique<Prepend>();
    p->prefix = str_field(j, "prepend");
    return p;
  }
  if (t == "Replace") return std::make_unique<Replace>(j);
  if (t == "Sequence") {
    auto s = std::make_unique<NormSequence>();
    for (const auto& x : j.at("normalizers"))
      if (auto n = parse_normalizer(x)) s->steps.push_back(std::move(n));
    return s;
  }
  throw Error("tokenizer.json: normalizer '" + t + "' is not supported (kvlm supports NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence)");
}

std::unique_ptr<PreTokenizer> parse_pre_tokenizer(const json& j) {
  if (j.is_null()) return nullptr;
  const std::string t = type_of(j, "pre_tokenizer");
  if (t == "Split") return std::make_unique<Split>(j);
  if (t == "ByteLevel") return std::make_unique<ByteLevel>(j);
  if (t == "Metaspace") return std::make_unique<Metaspace>(j);
  if (t == "Digits") return std::make_unique<Digits>(j);
  if (t == "Sequence") {
    auto s = std::make_unique<PreSequence>();
    for (const auto& x : j.at("pretokenizers"))
      if (auto p = parse_pre_tokenizer(x)) s->steps.push_back(std::move(p));
    return s;
  }
  throw Error("tokenizer.json: pre_tokenizer '" + t +
              "' is not supported (kvlm supports Split, ByteLevel, Metaspace, Digits, Sequence)");
}

PostProcessor parse_post_processor(const json& j) {
  PostProcessor pp;
  if (j.is_null()) return pp;
  const std::string t = type_of(j, "post_processor");
  if (t == "ByteLevel") return pp;  // only adjusts offsets
  if (t == "Sequence") {
    for (const auto& x : j.at("processors")) {
      PostProcessor p = parse_post_processor(x);
      pp.prefix.insert(pp.prefix.end(), p.prefix.begin(), p.prefix.end());
      pp.suffix.insert(pp.suffix.begin(), p.suffix.begin(), p.suffix.end());
    }
    return pp;
  }
  if (t == "TemplateProcessing") {
    const json& specials = j.contains("special_tokens") ? j["special_tokens"] : json::object();
    bool seen_a = false;
    for (const auto& item : j.at("single")) {
      if (item.contains("Sequence")) {
        seen_a = true;
      } else if (item.contains("SpecialToken")) {
        const std::string id = item["SpecialToken"].at("id").get<std::string>();
        if (!specials.contains(id)) throw Error("tokenizer.json: TemplateProcessing names special token '" + id + "' without ids");
        for (const auto& x : specials[id].at("ids")) (seen_a ? pp.suffix : pp.prefix).push_back(x.get<TokenId>());
      }
    }
    return pp;
  }
  throw Error("tokenizer.json: post_processor '" + t + "' is not supported (kvlm supports TemplateProcessing, ByteLevel, Sequence)");
}

std::unique_ptr<Decoder> parse_decoder(const json& j) {
  if (j.is_null()) return nullptr;
  const std::string t = type_of(j, "decoder");
  if (t == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (t == "Replace") return std::make_unique<ReplaceDecoder>(j);
  if (t == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (t == "Fuse") return std::make_unique<FuseDecoder>();
  if (t == "Strip") return std::make_unique<StripDecoder>(j);
  if (t == "Metaspace") return std::make_unique<MetaspaceDecoder>(j);
  if (t == "Sequence") {
    auto s = std::make_unique<DecSequence>();
    for (const auto& x : j.at("decoders"))
      if (auto d = parse_decoder(x)) s->steps.push_back(std::move(d));
    return s;
  }
  throw Error("tokenizer.json: decoder '" + t +
              "' is not supported (kvlm supports ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)");
}

}  // namespace kvlm::tok

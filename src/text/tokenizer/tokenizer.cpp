#include "text/tokenizer/tokenizer.h"

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer/unicode.h"

namespace kvlm {

using nlohmann::json;

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  std::error_code ec;
  std::filesystem::path file = path;
  if (std::filesystem::is_directory(path, ec)) file = path / "tokenizer.json";
  if (!std::filesystem::exists(file, ec))
    throw Error("no tokenizer.json at '" + path.string() + "'; kvlm reads Hugging Face tokenizer.json files");
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return from_json_text(ss.str(), file.string());
}

Tokenizer Tokenizer::from_json_text(std::string_view text, const std::string& label) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(label + " is not valid JSON: " + e.what());
  }
  tok::BpeSpec spec;
  try {
    if (!j.is_object() || !j.contains("model")) throw Error("no \"model\" object");
    spec = tok::parse_bpe_spec(j["model"]);
  } catch (const json::exception& e) {
    throw Error(label + ": unexpected structure: " + e.what());
  } catch (const Error& e) {
    throw Error(label + ": " + e.what());
  }
  return from_parts(j, spec, label);
}

Tokenizer Tokenizer::from_parts(const json& j, const tok::BpeSpec& model, const std::string& label) {
  Tokenizer t;
  try {
    if (!j.is_object()) throw Error("the pipeline is not a JSON object");
    t.normalizer_ = tok::parse_normalizer(j.value("normalizer", json()));
    t.pre_ = tok::parse_pre_tokenizer(j.value("pre_tokenizer", json()));
    t.model_ = std::make_unique<tok::BpeModel>(model);
    t.post_ = tok::parse_post_processor(j.value("post_processor", json()));
    t.decoder_ = tok::parse_decoder(j.value("decoder", json()));
    t.vocab_size_ = int(t.model_->max_id()) + 1;
    for (const auto& a : j.value("added_tokens", json::array())) {
      AddedToken at{.id = a.at("id").get<TokenId>(),
                    .content = a.at("content").get<std::string>(),
                    .special = a.value("special", false),
                    .lstrip = a.value("lstrip", false),
                    .rstrip = a.value("rstrip", false),
                    .normalized = a.value("normalized", false),
                    .single_word = a.value("single_word", false)};
      if (at.id < 0 || at.id > (1 << 24) || at.content.empty())
        throw Error("added token '" + at.content + "' has an invalid id or empty content");
      t.vocab_size_ = std::max(t.vocab_size_, int(at.id) + 1);
      t.added_match_.push_back(at.normalized && t.normalizer_ ? t.normalizer_->apply(at.content) : at.content);
      t.added_.push_back(std::move(at));
    }
  } catch (const json::exception& e) {
    throw Error(label + ": unexpected structure: " + e.what());
  } catch (const Error& e) {
    throw Error(label + ": " + e.what());
  }
  t.added_by_id_.assign(size_t(t.vocab_size_), -1);
  for (size_t i = 0; i < t.added_.size(); ++i) t.added_by_id_[size_t(t.added_[i].id)] = int(i);
  for (const auto& m : t.added_match_) t.added_first_[static_cast<uint8_t>(m[0])] = true;
  t.split_metaspace_ = !t.pre_ && t.model_->marker_starts_tokens("\xE2\x96\x81");
  const json& dec = j.value("decoder", json());
  if (dec.dump().find("\"ByteFallback\"") != std::string::npos) {
    t.fallback_byte_.assign(size_t(t.vocab_size_), false);
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      if (auto id = t.model_->token_to_id(name)) t.fallback_byte_[size_t(*id)] = true;
    }
  }
  return t;
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  for (const auto& a : added_)
    if (a.content == token) return a.id;
  return model_->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(TokenId id) const {
  if (id >= 0 && id < vocab_size_ && added_by_id_[size_t(id)] >= 0) return added_[size_t(added_by_id_[size_t(id)])].content;
  if (const std::string* s = model_->id_to_token(id)) return *s;
  return std::nullopt;
}

bool Tokenizer::is_fallback_byte(TokenId id) const {
  return id >= 0 && size_t(id) < fallback_byte_.size() && fallback_byte_[size_t(id)];
}

bool Tokenizer::is_special(TokenId id) const {
  return id >= 0 && id < vocab_size_ && added_by_id_[size_t(id)] >= 0 && added_[size_t(added_by_id_[size_t(id)])].special;
}

namespace {

// Whitespace at the end / start of a string (Unicode White_Space), in bytes.
size_t trailing_ws(std::string_view s) {
  size_t n = s.size();
  while (n > 0) {
    size_t b = n - 1;
    while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
    const auto d = utf8::decode(s, b);
    if (!d.valid || !utf8::is_whitespace(d.cp)) break;
    n = b;
  }
  return s.size() - n;
}
size_t leading_ws(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto d = utf8::decode(s, i);
    if (!d.valid || !utf8::is_whitespace(d.cp)) break;
    i += size_t(d.len);
  }
  return i;
}
bool word_char_before(std::string_view s, size_t pos) {
  if (pos == 0) return false;
  size_t b = pos - 1;
  while (b > 0 && (static_cast<uint8_t>(s[b]) & 0xC0) == 0x80) --b;
  const auto d = utf8::decode(s, b);
  return d.valid && utf8::is_alphanumeric(d.cp);
}
bool word_char_at(std::string_view s, size_t pos) {
  if (pos >= s.size()) return false;
  const auto d = utf8::decode(s, pos);
  return d.valid && utf8::is_alphanumeric(d.cp);
}

}  // namespace

// Splits text segments on added tokens, leftmost-longest, as the tokenizers library's
// AddedVocabulary does: first the tokens matched on raw text (normalized=false), then, after
// normalization, those matched on normalized text.
void Tokenizer::split_added(std::vector<Segment>& segs, bool normalized_pass, bool parse_special) const {
  std::vector<Segment> out;
  out.reserve(segs.size());
  for (Segment& seg : segs) {
    if (seg.added >= 0) {
      out.push_back(std::move(seg));
      continue;
    }
    const std::string& s = seg.text;
    size_t last = 0;   // start of the pending text
    size_t pos = 0;
    std::vector<Segment> local;
    while (pos < s.size()) {
      if (!added_first_[static_cast<uint8_t>(s[pos])]) {
        ++pos;
        continue;
      }
      int best = -1;
      size_t best_len = 0;
      for (size_t k = 0; k < added_.size(); ++k) {
        const AddedToken& a = added_[k];
        if (a.normalized != normalized_pass || (a.special && !parse_special)) continue;
        const std::string& m = added_match_[k];
        if (m.size() > best_len && s.compare(pos, m.size(), m) == 0) {
          if (a.single_word && (word_char_before(s, pos) || word_char_at(s, pos + m.size()))) continue;
          best = int(k);
          best_len = m.size();
        }
      }
      if (best < 0) {
        ++pos;
        continue;
      }
      const AddedToken& a = added_[size_t(best)];
      size_t b = pos, e = pos + best_len;
      if (a.lstrip) b -= trailing_ws(std::string_view(s).substr(last, b - last));
      if (a.rstrip) e += leading_ws(std::string_view(s).substr(e));
      if (b > last) local.push_back({s.substr(last, b - last), seg.offset + last, -1});
      local.push_back({a.content, seg.offset + b, best});
      last = pos = e;
    }
    if (last < s.size()) local.push_back({s.substr(last), seg.offset + last, -1});
    for (auto& l : local) out.push_back(std::move(l));
  }
  segs.swap(out);
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, const EncodeOptions& opts) const {
  std::vector<Segment> segs;
  segs.push_back({utf8::is_valid(text) ? std::string(text) : utf8::sanitize(text), 0, -1});
  const bool has_added = !added_.empty();
  if (has_added) split_added(segs, false, opts.parse_special);
  if (normalizer_)
    for (auto& s : segs)
      if (s.added < 0) s.text = normalizer_->apply(std::move(s.text));
  if (has_added) split_added(segs, true, opts.parse_special);

  std::vector<TokenId> ids;
  if (opts.add_special_tokens) ids = post_.prefix;
  std::vector<tok::Piece> pieces;
  for (const auto& s : segs) {
    if (s.added >= 0) {
      ids.push_back(added_[size_t(s.added)].id);
      continue;
    }
    if (s.text.empty()) continue;
    if (split_metaspace_) {
      const std::string_view t = s.text, m = "\xE2\x96\x81";
      size_t start = 0;
      for (size_t p = t.find(m, 1); p != std::string_view::npos; p = t.find(m, p + 1))
        if (t.compare(p - m.size(), m.size(), m) != 0) {
          model_->encode_word(t.substr(start, p - start), ids);
          start = p;
        }
      model_->encode_word(t.substr(start), ids);
      continue;
    }
    pieces.assign(1, tok::Piece{s.text, s.offset == 0});
    if (pre_) pre_->apply(pieces);
    for (const auto& p : pieces) model_->encode_word(p.text, ids);
  }
  if (opts.add_special_tokens) ids.insert(ids.end(), post_.suffix.begin(), post_.suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special_tokens, bool skip_unknown) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (TokenId id : ids) {
    if (id >= 0 && id < vocab_size_ && added_by_id_[size_t(id)] >= 0) {
      const AddedToken& a = added_[size_t(added_by_id_[size_t(id)])];
      if (skip_special_tokens && a.special) continue;
      tokens.push_back(a.content);
    } else if (const std::string* t = model_->id_to_token(id)) {
      tokens.push_back(*t);
    } else if (!skip_unknown) {
      throw Error("token id " + std::to_string(id) + " is not in the tokenizer's vocabulary (size " + std::to_string(vocab_size_) + ")");
    }
  }
  if (!decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  decoder_->apply(tokens);
  std::string out;
  for (auto& t : tokens) out += t;
  return out;
}

std::string Tokenizer::token_bytes(TokenId id) const {
  if (id < 0 || id >= vocab_size_) return {};
  if (added_by_id_[size_t(id)] >= 0) {
    const AddedToken& a = added_[size_t(added_by_id_[size_t(id)])];
    return a.special ? std::string() : a.content;
  }
  const std::string* t = model_->id_to_token(id);
  if (!t) return {};
  std::string piece = *t;
  if (decoder_) decoder_->piece(piece);
  return piece;
}

std::string IncrementalDecoder::push(TokenId id) {
  ids_.push_back(id);
  // ByteFallback decodes a run of byte tokens as a whole (invalid runs become one U+FFFD per
  // byte), so text ending in byte tokens is not final until another token closes the run;
  // a skipped special token does not close it (the decoder never sees it).
  if (tok_.is_fallback_byte(id) || (skip_ && tok_.is_special(id))) return "";
  const std::span<const TokenId> all(ids_);
  const std::string before = tok_.decode(all.subspan(prefix_, read_ - prefix_), skip_, true);
  const std::string now = tok_.decode(all.subspan(prefix_), skip_, true);
  // Hold back while the window's text ends in an incomplete character (decoded as U+FFFD)
  // or has not grown; the window keeps the same start so decoders that treat the first
  // token specially (Strip, Metaspace) do so identically in both decodes.
  if (now.size() <= before.size() || now.ends_with(utf8::kReplacement) || now.compare(0, before.size(), before) != 0)
    return "";
  std::string fresh = now.substr(before.size());
  prefix_ = read_;
  read_ = ids_.size();
  emitted_ += fresh;
  return fresh;
}

std::string IncrementalDecoder::flush(bool keep_incomplete) {
  const std::span<const TokenId> all(ids_);
  std::string full = tok_.decode(all, skip_, true);
  // An incomplete character is at most 3 bytes, each perhaps its own token: the longest
  // prefix of the ids, up to 4 shorter, whose text ends on a complete character. (A text
  // that still ends in U+FFFD without them holds an invalid sequence, which stays.)
  if (!keep_incomplete && full.ends_with(utf8::kReplacement))
    for (size_t cut = 1; cut <= std::min<size_t>(4, ids_.size() - read_); ++cut) {
      std::string shorter = tok_.decode(all.first(ids_.size() - cut), skip_, true);
      if (!shorter.ends_with(utf8::kReplacement)) {
        full = std::move(shorter);
        break;
      }
    }
  std::string rest = full.compare(0, emitted_.size(), emitted_) == 0 ? full.substr(emitted_.size()) : std::string();
  emitted_ += rest;
  prefix_ = read_ = ids_.size();
  return rest;
}

}  // namespace kvlm

#include "text/gguf_tokenizer.h"

#include <algorithm>
#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer/unicode.h"

namespace kvlm {

using nlohmann::json;

namespace {

constexpr const char* kMetaspace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// llama.cpp's token types (llama_token_type).
constexpr int kControl = 3, kUserDefined = 4;

// The split regex of each `tokenizer.ggml.pre` type whose vocabulary transformers rebuilds with
// it (other byte-level types keep GPT-2's regex, as transformers does).
constexpr const char* kLlama3Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen35Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kTekkenSplit =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*)"
    R"(|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kGpt4oSplit =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct PreSplit {
  const char* pre;
  const char* regex;
};
constexpr PreSplit kPreSplits[] = {
    {"llama3", kLlama3Split},     {"llama-v3", kLlama3Split},   {"llama-bpe", kLlama3Split},
    {"falcon3", kLlama3Split},    {"falcon-h1", kLlama3Split},  {"pixtral", kLlama3Split},
    {"midm-2.0", kLlama3Split},   {"lfm2", kLlama3Split},       {"jina-v5-nano", kLlama3Split},
    {"dbrx", kLlama3Split},       {"smaug-bpe", kLlama3Split},  {"tekken", kTekkenSplit},
    {"qwen2", kQwen2Split},       {"deepseek-r1-qwen", kQwen2Split}, {"kormo", kQwen2Split},
    {"f2llmv2", kQwen2Split},     {"megrez", kQwen2Split},      {"qwen35", kQwen35Split},
    {"gpt-4o", kGpt4oSplit},      {"llama4", kGpt4oSplit},      {"kanana2", kGpt4oSplit},
    {"talkie", kGpt4oSplit},      {"minimax-m2", kGpt4oSplit},
};

size_t code_points(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

// Python's str.isspace() for every character, and at least one character.
bool python_blank(std::string_view s) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size();) {
    const auto d = utf8::decode(s, i);
    if (!d.valid || !(utf8::is_whitespace(d.cp) || (d.cp >= 0x1C && d.cp <= 0x1F))) return false;
    i += size_t(d.len);
  }
  return true;
}

// A token written in GPT-2's byte alphabet, as transformers' byte-level builder respells it.
std::string byte_level_spelling(const std::string& token) {
  bool inside = true;
  for (size_t i = 0; i < token.size() && inside;) {
    const auto d = utf8::decode(token, i);
    inside = d.valid && utf8::char_to_byte(d.cp) >= 0;
    i += size_t(d.len);
  }
  if (inside) return token;
  std::string out;
  for (char c : token) out += utf8::byte_chars()[static_cast<uint8_t>(c)];
  return out;
}

std::vector<std::pair<std::string, std::string>> merges_from_file(const std::vector<std::string>& merges,
                                                                  const std::string& label) {
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(merges.size());
  for (const std::string& m : merges) {
    const size_t sp = m.find(' ');
    if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos)
      throw Error(label + ": tokenizer.ggml.merges entry '" + m + "' is not two tokens separated by one space");
    out.emplace_back(m.substr(0, sp), m.substr(sp + 1));
  }
  return out;
}

json template_processing(const std::vector<std::pair<std::string, TokenId>>& prefix,
                         const std::vector<std::pair<std::string, TokenId>>& suffix) {
  json single = json::array(), specials = json::object();
  auto add = [&](const std::pair<std::string, TokenId>& t) {
    single.push_back({{"SpecialToken", {{"id", t.first}, {"type_id", 0}}}});
    specials[t.first] = {{"id", t.first}, {"ids", {t.second}}, {"tokens", {t.first}}};
  };
  for (const auto& t : prefix) add(t);
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  for (const auto& t : suffix) add(t);
  return {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", specials}};
}

}  // namespace

std::vector<std::pair<std::string, std::string>> merges_from_vocab(
    const std::vector<std::pair<std::string, double>>& order, const tok::StringMap<TokenId>& vocab) {
  struct Cand {
    std::string_view left, right;
    double score;
    size_t left_len, right_len;
  };
  std::vector<Cand> all;
  std::vector<Cand> local;
  for (const auto& [token, score] : order) {
    local.clear();
    const std::string_view t = token;
    for (size_t cut = 1; cut < t.size(); ++cut) {
      if ((static_cast<uint8_t>(t[cut]) & 0xC0) == 0x80) continue;  // halves are whole characters
      const std::string_view l = t.substr(0, cut), r = t.substr(cut);
      if (vocab.find(l) != vocab.end() && vocab.find(r) != vocab.end())
        local.push_back({l, r, score, code_points(l), code_points(r)});
    }
    std::stable_sort(local.begin(), local.end(), [&](const Cand& a, const Cand& b) {
      const TokenId al = vocab.find(a.left)->second, bl = vocab.find(b.left)->second;
      if (al != bl) return al < bl;
      return vocab.find(a.right)->second < vocab.find(b.right)->second;
    });
    all.insert(all.end(), local.begin(), local.end());
  }
  std::stable_sort(all.begin(), all.end(), [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.left_len != b.left_len) return a.left_len > b.left_len;
    return a.right_len > b.right_len;
  });
  std::vector<std::pair<std::string, std::string>> out;
  out.reserve(all.size());
  for (const Cand& c : all) out.emplace_back(std::string(c.left), std::string(c.right));
  return out;
}

GGUFTokenizer load_gguf_tokenizer(const GGUFHeader& h, const std::string& label) {
  std::vector<std::string> notes;
  auto note = [&](const char* key) {
    if (h.find(key)) notes.push_back(key);
  };
  const auto type = h.get_string("tokenizer.ggml.model");
  if (!type) throw Error(label + ": the GGUF metadata has no tokenizer.ggml.model, so kvlm cannot build its tokenizer");
  if (*type == "none" || *type == "no_vocab")  // llama.cpp's convention for a file without a vocabulary
    throw Error(label + ": the GGUF file has no vocabulary (tokenizer.ggml.model '" + *type +
                "'): give the prompt as token ids (--prompt-ids)");
  notes.push_back("tokenizer.ggml.model (" + *type + ")");
  const auto tokens_opt = h.get_strings("tokenizer.ggml.tokens");
  if (!tokens_opt || tokens_opt->empty()) throw Error(label + ": the GGUF metadata has no tokenizer.ggml.tokens");
  note("tokenizer.ggml.tokens");
  const std::vector<std::string>& tokens = *tokens_opt;
  const auto types = h.get_numbers("tokenizer.ggml.token_type");
  const auto scores = h.get_numbers("tokenizer.ggml.scores");
  const auto file_merges = h.get_strings("tokenizer.ggml.merges");
  for (const char* k : {"tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges"}) note(k);
  if (types && types->size() != tokens.size())
    throw Error(label + ": tokenizer.ggml.token_type has " + std::to_string(types->size()) + " entries for " +
                std::to_string(tokens.size()) + " tokens");
  if (scores && scores->size() != tokens.size())
    throw Error(label + ": tokenizer.ggml.scores has " + std::to_string(scores->size()) + " entries for " +
                std::to_string(tokens.size()) + " tokens");
  const std::string arch = h.get_string("general.architecture").value_or("");
  const std::string pre = h.get_string("tokenizer.ggml.pre").value_or("default");
  if (h.find("tokenizer.ggml.pre")) notes.push_back("tokenizer.ggml.pre (" + pre + ")");

  auto special_id = [&](const char* key) -> std::optional<std::string> {
    const auto id = h.get_int(key);
    if (!id) return std::nullopt;
    notes.push_back(key);
    if (*id < 0 || size_t(*id) >= tokens.size())
      throw Error(label + ": " + key + " is " + std::to_string(*id) + ", outside the " + std::to_string(tokens.size()) +
                  "-token vocabulary");
    return tokens[size_t(*id)];
  };
  TokenizerConfig cfg;
  cfg.bos_token = special_id("tokenizer.ggml.bos_token_id");
  cfg.eos_token = special_id("tokenizer.ggml.eos_token_id");
  cfg.unk_token = special_id("tokenizer.ggml.unknown_token_id");
  cfg.pad_token = special_id("tokenizer.ggml.padding_token_id");

  // The vocabulary as the tokenizer spells it: byte-level tokens in GPT-2's byte alphabet,
  // Gemma's all-space tokens with U+2581, others as stored.
  const bool byte_level = *type == "gpt2";
  const bool sentencepiece = *type == "llama" || *type == "gemma4";
  const bool gemma = *type == "llama" && (arch == "gemma" || arch == "gemma2" || arch == "gemma3");
  if (!byte_level && !sentencepiece)
    throw Error(label + ": GGUF tokenizer model '" + *type +
                "' is not supported (kvlm builds 'gpt2' byte-level BPE and 'llama' SentencePiece vocabularies)");
  std::vector<std::string> spelled = tokens;
  for (std::string& t : spelled) {
    if (byte_level) {
      t = byte_level_spelling(t);
    } else if (gemma && t.find(' ') != std::string::npos && python_blank(t)) {
      const size_t n = code_points(t);
      t.clear();
      for (size_t k = 0; k < n; ++k) t += kMetaspace;
    }
  }
  tok::BpeSpec spec;
  spec.vocab.reserve(spelled.size());
  tok::StringMap<TokenId> vocab_ids;  // as a map: a token listed twice keeps its last id
  for (size_t i = 0; i < spelled.size(); ++i) {
    spec.vocab.emplace_back(spelled[i], TokenId(i));
    vocab_ids.insert_or_assign(spelled[i], TokenId(i));
  }

  json pipeline = json::object();
  if (byte_level) {
    if (!file_merges) throw Error(label + ": a byte-level (gpt2) GGUF vocabulary without tokenizer.ggml.merges");
    spec.merges = merges_from_file(*file_merges, label);
    pipeline["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                                 {"use_regex", true}};
    pipeline["decoder"] = {{"type", "ByteLevel"}};
  } else {
    // SentencePiece: merges from the file or recovered from the vocabulary, ranked by score
    // (Gemma: by file order).
    if (file_merges) {
      spec.merges = merges_from_file(*file_merges, label);
    } else {
      if (!gemma && !scores)
        throw Error(label + ": a SentencePiece GGUF vocabulary with neither tokenizer.ggml.merges nor tokenizer.ggml.scores");
      // A Python dict: listing order of a token's first occurrence, the value of its last.
      std::vector<std::pair<std::string, double>> order;
      tok::StringMap<size_t> where;
      for (size_t i = 0; i < spelled.size(); ++i) {
        const double s = gemma ? -double(i) : (*scores)[i];
        if (auto it = where.find(spelled[i]); it != where.end()) order[it->second].second = s;
        else where.emplace(spelled[i], order.size()), order.emplace_back(spelled[i], s);
      }
      spec.merges = merges_from_vocab(order, vocab_ids);
    }
    spec.byte_fallback = true;
    spec.fuse_unk = true;
    const json decode_spaces = {{"type", "Replace"}, {"pattern", {{"String", kMetaspace}}}, {"content", " "}};
    if (gemma || *type == "gemma4") {  // transformers' GemmaTokenizer
      if (vocab_ids.count("<unk>")) spec.unk_token = "<unk>";
      pipeline["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMetaspace}};
      pipeline["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"},
                                   {"invert", false}};
      pipeline["decoder"] = {{"type", "Sequence"},
                             {"decoders", {decode_spaces, {{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
    } else if (arch == "phi3") {  // the prefix space from a normalizer
      pipeline["normalizer"] = {
          {"type", "Sequence"},
          {"normalizers",
           {{{"type", "Prepend"}, {"prepend", kMetaspace}},
            {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMetaspace}}}}};
      pipeline["decoder"] = {{"type", "Sequence"},
                             {"decoders", {decode_spaces, {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                           {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
    } else {  // transformers' LlamaTokenizer
      pipeline["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMetaspace}, {"prepend_scheme", "first"},
                                   {"split", false}};
      pipeline["decoder"] = {{"type", "Sequence"},
                             {"decoders", {decode_spaces, {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                                           {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
    }
  }
  // A pre type with a known split regex replaces the pre-tokenizer, whatever the vocabulary
  // type (as transformers' set_split_regex does).
  for (const PreSplit& ps : kPreSplits)
    if (pre == ps.pre)
      pipeline["pre_tokenizer"] = {
          {"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", ps.regex}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}};

  // Added tokens, in transformers' order: the special tokens the tokenizer class it builds
  // with brings by default (GPT2Tokenizer: <|endoftext|>; LlamaTokenizer: <s>, </s>, <unk>;
  // GemmaTokenizer: <bos>, <eos>, <unk>, <pad>, <mask>), then CONTROL tokens as special (in a
  // byte-level vocabulary only those spelled in its alphabet: others are llama.cpp
  // mislabels), then USER_DEFINED ones that are in the vocabulary as plain ones, then the
  // file's own BOS / EOS / UNK / PAD if not yet added. A token outside the vocabulary gets the
  // Rust library's next id: the vocabulary's size, or one past the largest added id once that
  // is larger.
  json added = json::array();
  tok::StringMap<TokenId> added_ids;  // content -> id
  std::optional<TokenId> max_added;
  auto add_token = [&](const std::string& content, bool special) {
    if (content.empty() || added_ids.count(content)) return;
    TokenId id;
    if (auto it = vocab_ids.find(content); it != vocab_ids.end()) id = it->second;
    else id = max_added && *max_added >= TokenId(vocab_ids.size()) ? *max_added + 1 : TokenId(vocab_ids.size());
    max_added = std::max(max_added.value_or(id), id);
    added_ids.emplace(content, id);
    added.push_back({{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", special}});
  };
  std::vector<const char*> class_defaults;
  if (byte_level) class_defaults = {"<|endoftext|>"};
  else if (gemma || *type == "gemma4") class_defaults = {"<bos>", "<eos>", "<unk>", "<pad>", "<mask>"};
  else class_defaults = {"<s>", "</s>", "<unk>"};
  for (const char* t : class_defaults) add_token(t, true);
  if (types) {
    for (size_t i = 0; i < tokens.size(); ++i)
      if (int((*types)[i]) == kControl && (!byte_level || spelled[i] == tokens[i])) add_token(tokens[i], true);
    for (size_t i = 0; i < tokens.size(); ++i)
      if (int((*types)[i]) == kUserDefined && (vocab_ids.count(tokens[i]) || added_ids.count(tokens[i])))
        add_token(tokens[i], false);
  }
  for (const auto& t : {cfg.bos_token, cfg.eos_token, cfg.unk_token, cfg.pad_token})
    if (t) add_token(*t, true);
  pipeline["added_tokens"] = added;

  // BOS / EOS around a plain prompt.
  const auto add_bos = h.get_bool("tokenizer.ggml.add_bos_token");
  const auto add_eos = h.get_bool("tokenizer.ggml.add_eos_token");
  note("tokenizer.ggml.add_bos_token");
  note("tokenizer.ggml.add_eos_token");
  cfg.add_bos_token = *type == "gemma4" ? false : add_bos.value_or(*type == "llama");
  cfg.add_eos_token = add_eos.value_or(false);
  auto token_id = [&](const std::optional<std::string>& t) -> std::optional<std::pair<std::string, TokenId>> {
    if (!t) return std::nullopt;
    const auto it = added_ids.find(*t);  // the named special tokens were all added above
    return it == added_ids.end() ? std::nullopt : std::optional(std::pair{*t, it->second});
  };
  std::vector<std::pair<std::string, TokenId>> prefix, suffix;
  if (cfg.add_bos_token)
    if (auto b = token_id(cfg.bos_token)) prefix.push_back(*b);
  if (cfg.add_eos_token)
    if (auto e = token_id(cfg.eos_token)) suffix.push_back(*e);
  pipeline["post_processor"] = template_processing(prefix, suffix);

  // Chat templates: the default and any named ones (tokenizer.chat_template.NAME).
  for (const GGUFKeyValue& kv : h.metadata) {
    if (kv.key == "tokenizer.chat_template" && kv.value.type == GGUFType::String) {
      cfg.chat_template = kv.value.s;
      notes.push_back(kv.key);
    } else if (kv.key.starts_with("tokenizer.chat_template.") && kv.value.type == GGUFType::String) {
      cfg.named_templates[kv.key.substr(std::string_view("tokenizer.chat_template.").size())] = kv.value.s;
      notes.push_back(kv.key);
    }
  }
  return GGUFTokenizer{.tokenizer = Tokenizer::from_parts(pipeline, spec, label + " (GGUF tokenizer)"),
                       .config = std::move(cfg), .notes = std::move(notes)};
}

}  // namespace kvlm

// Tokenizer pieces on small hand-written tokenizer.json files: each pipeline stage, added
// token flags, byte fallback, unknown tokens, post-processing, streaming, and errors.
// (The genuine tokenizers are compared with Hugging Face in tests/golden/test_tokenizers.cpp.)
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/tokenizer/tokenizer.h"
#include "text/tokenizer/unicode.h"
#include "test_util.h"

using namespace kvlm;
using nlohmann::json;

namespace {

// A byte-level-free toy BPE over characters: vocab a b c ab abc ▁ ▁a, merges a+b, ab+c, ▁+a.
json toy(json normalizer = nullptr, json pre = nullptr, json decoder = nullptr) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}, {"a", 3}, {"b", 4}, {"c", 5}, {"ab", 6}, {"abc", 7}, {"\u2581", 8},
                {"\u2581a", 9}, {"<0xC3>", 10}, {"<0xA9>", 11}, {"1", 12}, {"2", 13}, {" ", 14}};
  return {{"normalizer", normalizer},
          {"pre_tokenizer", pre},
          {"post_processor", nullptr},
          {"decoder", decoder},
          {"added_tokens",
           {{{"id", 1}, {"content", "<s>"}, {"special", true}},
            {{"id", 2}, {"content", "</s>"}, {"special", true}, {"rstrip", true}},
            {{"id", 15}, {"content", "<x>"}, {"special", true}, {"lstrip", true}},
            {{"id", 16}, {"content", "cab"}, {"special", false}, {"single_word", true}}}},
          {"model",
           {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a b", "ab c", "\u2581 a"}}, {"unk_token", "<unk>"},
            {"byte_fallback", true}, {"fuse_unk", true}}}};
}

Tokenizer make(const json& j) { return Tokenizer::from_json_text(j.dump()); }

}  // namespace

TEST(Tokenizer, BpeMergesByteFallbackAndUnk) {
  const Tokenizer t = make(toy());
  EXPECT_EQ(t.encode("abc"), (std::vector<TokenId>{7}));
  EXPECT_EQ(t.encode("abab"), (std::vector<TokenId>{6, 6}));
  EXPECT_EQ(t.encode("ca"), (std::vector<TokenId>{5, 3}));
  EXPECT_EQ(t.encode("é"), (std::vector<TokenId>{10, 11}));  // not in vocab: its UTF-8 bytes
  EXPECT_EQ(t.encode("zzq"), (std::vector<TokenId>{0}));     // no byte tokens either: one fused <unk>
  EXPECT_EQ(t.decode(std::vector<TokenId>{7, 6}), "abc ab");  // no decoder: tokens joined with spaces
  EXPECT_EQ(t.vocab_size(), 17);
}

TEST(Tokenizer, AddedTokenFlags) {
  const Tokenizer t = make(toy());
  EXPECT_EQ(t.encode("<s>ab</s>  c"), (std::vector<TokenId>{1, 6, 2, 5}));  // </s> rstrip eats the spaces
  EXPECT_EQ(t.encode("ab  <x>c"), (std::vector<TokenId>{6, 15, 5}));       // <x> lstrip eats them
  EXPECT_EQ(t.encode("cab"), (std::vector<TokenId>{16}));                  // single word: matched alone
  EXPECT_EQ(t.encode("acab"), (std::vector<TokenId>{3, 5, 6}));            // inside a word: not matched
  // Special tokens written in text are text when parsing them is off.
  EXPECT_EQ(t.encode("<s>", {.parse_special = false}), (std::vector<TokenId>{0}));
  EXPECT_EQ(t.decode(std::vector<TokenId>{1, 6}, true), "ab");
  EXPECT_TRUE(t.is_special(1));
  EXPECT_FALSE(t.is_special(16));
  EXPECT_EQ(t.token_to_id("<x>"), TokenId(15));
  EXPECT_EQ(t.id_to_token(9), "\u2581a");
  EXPECT_ERROR_CONTAINS(t.decode(std::vector<TokenId>{99}), "token id 99");
}

TEST(Tokenizer, SentencePieceStylePipeline) {
  const json norm = {{"type", "Sequence"},
                     {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}}, {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
  const json dec = {{"type", "Sequence"},
                    {"decoders",
                     {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                      {{"type", "ByteFallback"}},
                      {{"type", "Fuse"}},
                      {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  Tokenizer t = make(toy(norm, nullptr, dec));
  EXPECT_EQ(t.encode("a ab"), (std::vector<TokenId>{9, 8, 6}));
  EXPECT_EQ(t.decode(t.encode("a ab")), "a ab");
  EXPECT_EQ(t.decode(std::vector<TokenId>{10, 11}), "\u00e9");      // byte tokens fuse into UTF-8
  EXPECT_EQ(t.decode(std::vector<TokenId>{10}), "\xEF\xBF\xBD");    // a lone lead byte: U+FFFD
  // Metaspace pre-tokenizer with prepend_scheme "first": only the start of the input.
  const json meta = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}};
  Tokenizer m = make(toy(nullptr, meta, {{"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}}));
  EXPECT_EQ(m.encode("a"), (std::vector<TokenId>{9}));
  EXPECT_EQ(m.encode("<s>a"), (std::vector<TokenId>{1, 3}));
  EXPECT_EQ(m.decode(std::vector<TokenId>{9, 8, 6}), "a ab");
}

TEST(Tokenizer, SplitAndDigitsPreTokenizers) {
  const json pre = {{"type", "Sequence"},
                    {"pretokenizers",
                     {{{"type", "Split"}, {"pattern", {{"Regex", "\\p{N}"}}}, {"behavior", "Isolated"}, {"invert", false}},
                      {{"type", "Digits"}, {"individual_digits", true}}}}};
  const Tokenizer t = make(toy(nullptr, pre));
  EXPECT_EQ(t.encode("ab12c"), (std::vector<TokenId>{6, 12, 13, 5}));
  const json removed = {{"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "Removed"}};
  EXPECT_EQ(make(toy(nullptr, removed)).encode("ab c"), (std::vector<TokenId>{6, 5}));
  const json next = {{"type", "Split"}, {"pattern", {{"String", "c"}}}, {"behavior", "MergedWithNext"}};
  EXPECT_EQ(make(toy(nullptr, next)).encode("abcab"), (std::vector<TokenId>{6, 5, 6}));  // "ab" "cab"->c,ab
}

TEST(Tokenizer, PostProcessorAddsSpecialTokens) {
  json j = toy();
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                     {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}}},
                         {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}},
                                             {"</s>", {{"id", "</s>"}, {"ids", {2}}, {"tokens", {"</s>"}}}}}}};
  const Tokenizer t = make(j);
  EXPECT_EQ(t.encode("ab"), (std::vector<TokenId>{1, 6, 2}));
  EXPECT_EQ(t.encode("ab", {.add_special_tokens = false}), (std::vector<TokenId>{6}));
}

TEST(Tokenizer, LoadErrorsNameTheProblem) {
  EXPECT_ERROR_CONTAINS(Tokenizer::from_json_text("{"), "not valid JSON");
  json j = toy();
  j["model"]["type"] = "Unigram";
  EXPECT_ERROR_CONTAINS(make(j), "model type 'Unigram' is not supported");
  j = toy();
  j["pre_tokenizer"] = {{"type", "BertPreTokenizer"}};
  EXPECT_ERROR_CONTAINS(make(j), "pre_tokenizer 'BertPreTokenizer' is not supported");
  j = toy();
  j["model"]["merges"] = {"a zz"};
  EXPECT_ERROR_CONTAINS(make(j), "merge 'a zz' uses tokens missing");
  j = toy();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_ERROR_CONTAINS(make(j), "does not compile");
  EXPECT_ERROR_CONTAINS(Tokenizer::load("/nonexistent/dir"), "no tokenizer.json");
}

TEST(Tokenizer, StreamingNeverBreaksCharacters) {
  const json dec = {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
  const Tokenizer t = make(toy(nullptr, nullptr, dec));
  IncrementalDecoder inc(t);
  EXPECT_EQ(inc.push(3), "a");
  EXPECT_EQ(inc.push(10), "");  // byte tokens are held back until their run ends
  EXPECT_EQ(inc.push(11), "");
  EXPECT_EQ(inc.push(3), "\u00e9a");
  EXPECT_EQ(inc.push(10), "");
  IncrementalDecoder same = inc;
  EXPECT_EQ(same.flush(true), "\xEF\xBF\xBD");  // the stream ended inside a character: decode()'s text
  EXPECT_EQ(inc.flush(), "");                     // or, by default, the text ends before it (as vLLM's)
  // A run that turns invalid decodes as one U+FFFD per byte, even after a valid "é" —
  // streaming must agree with decoding everything at once.
  IncrementalDecoder inc2(t);
  std::string s = inc2.push(3);
  for (TokenId id : {10, 11, 10}) s += inc2.push(id);
  IncrementalDecoder inc3 = inc2;
  s += inc2.flush(true);
  EXPECT_EQ(s, t.decode(std::vector<TokenId>{3, 10, 11, 10}));
  EXPECT_EQ(s, "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  // Cut there, the text keeps the complete "é" and leaves out the byte after it.
  EXPECT_EQ(inc3.flush(), "\u00e9");
  // An invalid byte inside the text stays (U+FFFD), only the incomplete end goes.
  IncrementalDecoder inc4(t);
  std::string s4;
  for (TokenId id : {3, 11, 3, 10}) s4 += inc4.push(id);
  s4 += inc4.flush();
  EXPECT_EQ(s4, "a\xEF\xBF\xBD" "a");
}

// A model's vocabulary may be padded past the tokenizer's (Qwen: 151,936 logits, 151,669
// tokens): generated text skips such ids as Hugging Face's decode does; an explicit decode
// of them is still an error.
TEST(Tokenizer, PaddingIdsDecodeToNothingInGeneratedText) {
  const Tokenizer t = make(toy());
  const TokenId pad = TokenId(t.vocab_size() + 5);
  EXPECT_THROW(t.decode(std::vector<TokenId>{3, pad}), Error);
  EXPECT_EQ(t.decode(std::vector<TokenId>{3, pad, 3}, false, true), t.decode(std::vector<TokenId>{3, 3}));
  IncrementalDecoder inc(t);
  std::string s = inc.push(3);
  s += inc.push(pad);
  s += inc.push(3);
  s += inc.flush();
  EXPECT_EQ(s, t.decode(std::vector<TokenId>{3, 3}));
  EXPECT_EQ(t.token_bytes(pad), "");
}

TEST(Utf8, SanitizeAndTails) {
  EXPECT_EQ(utf8::sanitize("a\xC3"), "a\xEF\xBF\xBD");
  EXPECT_EQ(utf8::sanitize("\xE2\x82x"), "\xEF\xBF\xBDx");            // one U+FFFD for a truncated sequence
  EXPECT_EQ(utf8::sanitize("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate: three
  EXPECT_EQ(utf8::sanitize("\xF0\x9F\xA6\x99"), "\xF0\x9F\xA6\x99");
  EXPECT_EQ(utf8::incomplete_tail("ab\xF0\x9F\xA6"), 3u);
  EXPECT_EQ(utf8::incomplete_tail("ab\xC3"), 1u);
  EXPECT_EQ(utf8::incomplete_tail("ab\xC3\xA9"), 0u);
  EXPECT_EQ(utf8::incomplete_tail("ab\xFF"), 0u);
  EXPECT_EQ(utf8::normalize("e\xCC\x81", utf8::Form::NFC), "\xC3\xA9");
  EXPECT_EQ(utf8::char_to_byte(U'\u0120'), 32);  // GPT-2's "Ġ" is the space byte
  EXPECT_EQ(utf8::byte_chars()[10], "\xC4\x8A");  // "Ċ" is newline
}

// Tokenizers built from GGUF metadata (text/gguf_tokenizer.h): small GGUF files written by
// llama.cpp's `gguf` package, one per way of building (SentencePiece with merges recovered
// from scores, Gemma's variant, byte-level BPE with a known and an unknown split regex), give
// the ids, decodings and prompts Hugging Face transformers gives for the same files
// (tools/make_gguf_tokenizer_goldens.py) — the special tokens of the tokenizer class
// transformers builds with included, new ids past the vocabulary where the file lacks them
// (Llama 3's <|endoftext|>); transformers' merge recovery in its own order; and
// every malformed or unsupported tokenizer is a clear error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/gguf_tokenizer.h"
#include "text/text_processor.h"
#include "../support/gguf_writer.h"

namespace kvlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::GGUFWriter;

const fs::path kDir = fs::path(KVLM_TEST_DATA) / "data" / "gguf" / "tokenizers";

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class GGUFTokenizers : public ::testing::TestWithParam<std::string> {};

TEST_P(GGUFTokenizers, MatchTransformers) {
  const std::string name = GetParam();
  const TextProcessor text = TextProcessor::load(kDir / (name + ".gguf"));
  const Tokenizer& tok = text.tokenizer();
  const json exp = json::parse(read(kDir / (name + ".json")));
  ASSERT_GT(exp["cases"].size(), 10u);
  for (const auto& c : exp["cases"]) {
    const std::string t = c["text"].get<std::string>();
    const auto ids = c["ids"].get<std::vector<TokenId>>();
    EXPECT_EQ(tok.encode(t), ids) << name << ": " << json(t).dump();
    EXPECT_EQ(tok.encode(t, {.parse_special = false}), c["plain"].get<std::vector<TokenId>>()) << name << ": " << json(t).dump();
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << name << ": " << json(t).dump();
    EXPECT_EQ(tok.decode(ids, true), c["skip"].get<std::string>()) << name << ": " << json(t).dump();
    EXPECT_EQ(text.encode_prompt(t), c["prompt"].get<std::vector<TokenId>>()) << name << ": " << json(t).dump();
  }
  if (exp["bos"].is_string()) EXPECT_EQ(text.config().bos_token, exp["bos"].get<std::string>());
  else EXPECT_FALSE(text.config().bos_token.has_value());
  if (exp["eos"].is_string()) EXPECT_EQ(text.config().eos_token, exp["eos"].get<std::string>());
  else EXPECT_FALSE(text.config().eos_token.has_value());
}

INSTANTIATE_TEST_SUITE_P(Files, GGUFTokenizers, ::testing::Values("spm-llama", "spm-gemma3", "spm-nospecial", "spm-phi3", "bpe-qwen2", "bpe-default", "bpe-llama3"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n)
                             if (ch == '-') ch = '_';
                           return n;
                         });

TEST(GGUFTokenizer, TheSplitRegexFollowsThePreType) {
  // qwen2 splits digits one by one; GPT-2's regex keeps "123" together for the merges.
  const TextProcessor qwen = TextProcessor::load(kDir / "bpe-qwen2.gguf");
  const TextProcessor other = TextProcessor::load(kDir / "bpe-default.gguf");
  EXPECT_NE(qwen.tokenizer().encode("123"), other.tokenizer().encode("123"));
  EXPECT_EQ(qwen.tokenizer().encode("123").size(), 3u);
}

// transformers' generate_merges: per token its splits by (left id, right id), then all by
// score, left length, right length (descending, stable).
TEST(GGUFTokenizer, MergesFromVocabFollowTransformersOrder) {
  tok::StringMap<TokenId> vocab{{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"bc", 4}, {"abc", 5}, {"\xC3\xA9", 6}, {"\xC3\xA9" "a", 7}};
  const std::vector<std::pair<std::string, double>> order{{"a", 0}, {"b", 0}, {"c", 0}, {"ab", -1}, {"bc", -2}, {"abc", -3},
                                                          {"\xC3\xA9", 0}, {"\xC3\xA9" "a", -3}};
  const auto m = merges_from_vocab(order, vocab);
  const std::vector<std::pair<std::string, std::string>> want{
      {"a", "b"}, {"b", "c"}, {"ab", "c"}, {"a", "bc"}, {"\xC3\xA9", "a"}};
  EXPECT_EQ(m, want);
}

std::vector<uint8_t> tokenizer_file(const std::string& model, const std::vector<std::string>& tokens,
                                    const std::function<void(GGUFWriter&)>& more = {}) {
  return test::gguf_metadata_file([&](GGUFWriter& w) {
    w.key("general.architecture", GGUFType::String).str("llama");
    w.key("tokenizer.ggml.model", GGUFType::String).str(model);
    w.strings("tokenizer.ggml.tokens", tokens);
    if (more) more(w);
  });
}

void expect_error(const std::vector<uint8_t>& file, const std::string& what) {
  try {
    load_gguf_tokenizer(parse_gguf(file, "t.gguf"), "t.gguf");
    ADD_FAILURE() << "accepted; expected an error saying " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(GGUFTokenizer, UnsupportedOrDamagedTokenizersAreClearErrors) {
  expect_error(tokenizer_file("t5", {"a", "b"}), "GGUF tokenizer model 't5' is not supported");
  expect_error(tokenizer_file("bert", {"a"}), "'bert' is not supported");
  expect_error(test::gguf_metadata_file([](GGUFWriter& w) { w.key("general.architecture", GGUFType::String).str("llama"); }),
               "no tokenizer.ggml.model");
  // llama.cpp's mark for a file without a vocabulary (tools/make_random_gguf.py writes it)
  expect_error(tokenizer_file("none", {"t0", "t1"}), "has no vocabulary (tokenizer.ggml.model 'none'): give the prompt as token ids");
  expect_error(tokenizer_file("gpt2", {}), "no tokenizer.ggml.tokens");
  expect_error(tokenizer_file("gpt2", {"a", "b"}), "without tokenizer.ggml.merges");
  expect_error(tokenizer_file("llama", {"a", "b"}), "neither tokenizer.ggml.merges nor tokenizer.ggml.scores");
  expect_error(tokenizer_file("gpt2", {"a", "b", "ab"},
                              [](GGUFWriter& w) {
                                w.strings("tokenizer.ggml.merges", {"a b"});
                                w.numbers<int32_t>("tokenizer.ggml.token_type", GGUFType::Int32, {1, 1});
                              }),
               "tokenizer.ggml.token_type has 2 entries for 3 tokens");
  expect_error(tokenizer_file("llama", {"a", "b"},
                              [](GGUFWriter& w) { w.numbers<float>("tokenizer.ggml.scores", GGUFType::Float32, {0.f}); }),
               "tokenizer.ggml.scores has 1 entries for 2 tokens");
  expect_error(tokenizer_file("gpt2", {"a", "b", "ab"}, [](GGUFWriter& w) { w.strings("tokenizer.ggml.merges", {"ab"}); }),
               "'ab' is not two tokens");
  expect_error(tokenizer_file("gpt2", {"a", "b", "ab"}, [](GGUFWriter& w) { w.strings("tokenizer.ggml.merges", {"a c"}); }),
               "missing from the vocabulary");
  expect_error(tokenizer_file("gpt2", {"a", "b", "ab"},
                              [](GGUFWriter& w) {
                                w.strings("tokenizer.ggml.merges", {"a b"});
                                w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(7);
                              }),
               "tokenizer.ggml.bos_token_id is 7, outside the 3-token vocabulary");
}

TEST(GGUFTokenizer, ChatTemplatesAndSpecialTokensComeFromTheMetadata) {
  const auto file = tokenizer_file("gpt2", {"a", "b", "ab", "<|end|>"}, [](GGUFWriter& w) {
    w.strings("tokenizer.ggml.merges", {"a b"});
    w.numbers<int32_t>("tokenizer.ggml.token_type", GGUFType::Int32, {1, 1, 1, 3});
    w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(3);
    w.key("tokenizer.ggml.add_eos_token", GGUFType::Bool).pod<uint8_t>(1);
    w.key("tokenizer.chat_template", GGUFType::String).str("{{ messages[0]['content'] }}{{ eos_token }}");
    w.key("tokenizer.chat_template.tool_use", GGUFType::String).str("tools");
  });
  const GGUFTokenizer t = load_gguf_tokenizer(parse_gguf(file, "t.gguf"), "t.gguf");
  EXPECT_EQ(t.config.chat_template, "{{ messages[0]['content'] }}{{ eos_token }}");
  EXPECT_EQ(t.config.named_templates.at("tool_use"), "tools");
  EXPECT_EQ(t.config.eos_token, "<|end|>");
  EXPECT_FALSE(t.config.add_bos_token);  // byte-level files without the key: no BOS
  EXPECT_TRUE(t.config.add_eos_token);
  EXPECT_EQ(t.tokenizer.encode("ab"), (std::vector<TokenId>{2, 3}));  // the post-processor appends EOS
  EXPECT_EQ(t.tokenizer.encode("ab<|end|>", {.add_special_tokens = false}), (std::vector<TokenId>{2, 3}));
  EXPECT_TRUE(t.tokenizer.is_special(3));
  EXPECT_NE(std::ranges::find(t.notes, "tokenizer.chat_template"), t.notes.end());
}

}  // namespace
}  // namespace kvlm

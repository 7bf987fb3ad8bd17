// kvlm's tokenizer against Hugging Face `tokenizers` (expected ids made by
// tools/make_tokenizer_goldens.py from the genuine tokenizer.json files in
// ../shared/data/tokenizers) and against llama.cpp's own tokenizer test vectors.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "text/tokenizer/tokenizer.h"
#include "text/tokenizer/unicode.h"
#include "../support/tokenizer_corpus.h"

using namespace kvlm;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const fs::path kData = fs::path(KVLM_TEST_DATA) / "data" / "tokenizers";
const fs::path kShared = fs::path(KVLM_SHARED_DIR) / "data";

using test::show;
std::string read(const fs::path& p) { return test::read_file(p); }

struct Corpus {
  std::vector<std::string> texts;  // raw bytes (invalid UTF-8 kept as is)
};

const Corpus& corpus() {
  static const Corpus c{test::tokenizer_corpus(kData / "corpus.json")};
  return c;
}

bool have_shared() { return fs::exists(kShared / "tokenizers"); }

}  // namespace

class HfTokenizers : public ::testing::TestWithParam<std::string> {};

TEST_P(HfTokenizers, IdsDecodeAndStreamingMatch) {
  if (!have_shared()) GTEST_SKIP() << "../shared/data is not beside the repository";
  const std::string name = GetParam();
  const Tokenizer tok = Tokenizer::load(kShared / "tokenizers" / name);
  const json exp = json::parse(read(kData / "expected" / (name + ".json")));
  const auto& cases = exp["cases"];
  const auto& texts = corpus().texts;
  ASSERT_EQ(cases.size(), texts.size());
  ASSERT_GT(texts.size(), 2000u);
  int enc_bad = 0, plain_bad = 0, dec_bad = 0, skip_bad = 0, stream_bad = 0, roundtrip = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const auto& c = cases[i];
    const auto want = c["ids"].get<std::vector<TokenId>>();
    const auto got = tok.encode(texts[i]);
    if (got != want && ++enc_bad <= 5) ADD_FAILURE() << name << " case " << i << " ids differ for: " << show(texts[i]);
    const auto want_plain = c.contains("plain") ? c["plain"].get<std::vector<TokenId>>() : want;
    if (tok.encode(texts[i], {.parse_special = false}) != want_plain && ++plain_bad <= 5)
      ADD_FAILURE() << name << " case " << i << " ids (special tokens as text) differ";
    // The Python side encoded errors="replace"-decoded text; without a "decoded" entry, decode
    // gave that text back.
    const std::string decoded = c.contains("decoded") ? c["decoded"].get<std::string>() : utf8::sanitize(texts[i]);
    if (tok.decode(want) != decoded && ++dec_bad <= 5)
      ADD_FAILURE() << name << " case " << i << " decode differs: " << show(tok.decode(want)) << " vs " << show(decoded);
    const std::string skipped = c.contains("skip") ? c["skip"].get<std::string>() : decoded;
    if (tok.decode(want, true) != skipped && ++skip_bad <= 5) ADD_FAILURE() << name << " case " << i << " decode(skip special) differs";
    roundtrip += !c.contains("decoded");
    // Streaming: pieces are never broken UTF-8 and add up to the one-shot decode (its U+FFFD
    // for an incomplete end included: flush(true)).
    IncrementalDecoder inc(tok, false);
    std::string streamed;
    bool broken = false;
    for (TokenId id : want) {
      const std::string piece = inc.push(id);
      broken |= !utf8::is_valid(piece) && piece.find(utf8::kReplacement) == std::string::npos;
      streamed += piece;
    }
    streamed += inc.flush(true);
    if ((streamed != tok.decode(want) || broken) && ++stream_bad <= 5)
      ADD_FAILURE() << name << " case " << i << " streamed text differs: " << show(streamed);
  }
  std::printf("[tokenizer] %-10s %zu strings: ids %d mismatches, ids with specials as text %d, decode %d, decode(skip) %d, "
              "streaming %d; %d strings round-trip exactly\n",
              name.c_str(), texts.size(), enc_bad, plain_bad, dec_bad, skip_bad, stream_bad, roundtrip);
  EXPECT_EQ(enc_bad + plain_bad + dec_bad + skip_bad + stream_bad, 0);
}

// Streaming on arbitrary id sequences (what a sampler may produce): byte tokens that do not
// form characters, special tokens, anything — the pieces must add up to the one-shot decode
// (flush(true): an incomplete end as U+FFFD, as decode gives it).
TEST_P(HfTokenizers, StreamingRandomIdsEqualsOneShot) {
  if (!have_shared()) GTEST_SKIP() << "../shared/data is not beside the repository";
  const Tokenizer tok = Tokenizer::load(kShared / "tokenizers" / GetParam());
  std::mt19937 rng(11);
  int bad = 0;
  for (int n = 0; n < 600; ++n) {
    std::vector<TokenId> ids(1 + rng() % 40);
    for (auto& id : ids) {
      const uint32_t r = rng() % 10;
      id = r < 4 ? TokenId(rng() % 300) : r < 5 ? TokenId(tok.vocab_size() - 1 - rng() % 30) : TokenId(rng() % uint32_t(tok.vocab_size()));
      while (!tok.id_to_token(id)) id = TokenId(rng() % uint32_t(tok.vocab_size()));
    }
    for (bool skip : {false, true}) {
      IncrementalDecoder inc(tok, skip);
      std::string s;
      for (TokenId id : ids) s += inc.push(id);
      s += inc.flush(true);
      bad += s != tok.decode(ids, skip);
    }
  }
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(Files, HfTokenizers, ::testing::Values("qwen3", "qwen2-base", "phi3-mini"),
                         [](const auto& i) { return i.param == "qwen2-base" ? std::string("qwen2_base") : i.param == "phi3-mini" ? std::string("phi3_mini") : i.param; });

// llama.cpp's tokenizer test vectors (tests strings separated by "\n__ggml_vocab_test__\n",
// expected ids one line per string); the SPM vocabulary is Llama-2's, which phi3-mini carries.
class LlamaCppVectors : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(LlamaCppVectors, Match) {
  if (!have_shared()) GTEST_SKIP() << "../shared/data is not beside the repository";
  const auto [vocab, tokenizer] = GetParam();
  const Tokenizer tok = Tokenizer::load(kShared / "tokenizers" / tokenizer);
  const std::string inp = read(kShared / "llama.cpp-vocab-tests" / ("ggml-vocab-" + vocab + ".gguf.inp"));
  std::istringstream out(read(kShared / "llama.cpp-vocab-tests" / ("ggml-vocab-" + vocab + ".gguf.out")));
  const std::string sep = "\n__ggml_vocab_test__\n";
  size_t pos = 0, n = 0, bad = 0;
  std::string line;
  while (pos < inp.size()) {
    const size_t e = inp.find(sep, pos);
    ASSERT_NE(e, std::string::npos);
    const std::string text = inp.substr(pos, e - pos);
    pos = e + sep.size();
    ASSERT_TRUE(std::getline(out, line));
    std::vector<TokenId> want;
    std::istringstream ls(line);
    for (TokenId id; ls >> id;) want.push_back(id);
    ++n;
    if (tok.encode(text, {.add_special_tokens = false, .parse_special = false}) != want) {
      ++bad;
      ADD_FAILURE() << vocab << ": " << show(text);
    }
  }
  std::printf("[llama.cpp vectors] %-10s (%s): %zu strings, %zu mismatches\n", vocab.c_str(), tokenizer.c_str(), n, bad);
  EXPECT_GT(n, 40u);
}

INSTANTIATE_TEST_SUITE_P(Vocabs, LlamaCppVectors,
                         ::testing::Values(std::make_pair(std::string("qwen2"), std::string("qwen2-base")),
                                           std::make_pair(std::string("llama-spm"), std::string("phi3-mini"))),
                         [](const auto& i) { return i.param.first == "qwen2" ? std::string("qwen2") : std::string("llama_spm"); });

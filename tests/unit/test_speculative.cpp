// Speculative decoding: the --speculative-config parser, n-gram lookup, and drafting in the
// engine — the output must be the plain output, token for token.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "config/speculative_config.h"
#include "core/error.h"
#include "engine/ngram_proposer.h"
#include "offline/generate.h"
#include "../support/greedy_compare.h"

namespace kvlm {
namespace {

namespace fs = std::filesystem;
const fs::path kTiny = fs::path(KVLM_TEST_DATA) / ".." / "models" / "kvlm-tiny";

void expect_error(const std::string& json, const std::string& needle) {
  try {
    parse_speculative_config(json);
    ADD_FAILURE() << "accepted " << json;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(SpeculativeConfig, ParsesVllmKeysWithItsDefaults) {
  auto c = parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":4})");
  EXPECT_EQ(c.method, SpecMethod::Ngram);
  EXPECT_EQ(c.num_speculative_tokens, 4);
  EXPECT_EQ(c.prompt_lookup_min, 5);
  EXPECT_EQ(c.prompt_lookup_max, 5);
  c = parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":4})");
  EXPECT_EQ(c.prompt_lookup_min, 4);
  EXPECT_EQ(c.prompt_lookup_max, 4);
  c = parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":6})");
  EXPECT_EQ(c.prompt_lookup_min, 2);
  EXPECT_EQ(c.prompt_lookup_max, 6);
  EXPECT_EQ(describe(c), "ngram, 3 tokens, n-grams of 2 to 6 tokens");
  c = parse_speculative_config(R"({"method":"dflash","model":"/m","num_speculative_tokens":15,"kv_cache_dtype":"fp8"})");
  EXPECT_EQ(c.method, SpecMethod::DFlash);
  EXPECT_EQ(c.model, "/m");
  ASSERT_TRUE(c.kv_cache_dtype.has_value());
  EXPECT_EQ(*c.kv_cache_dtype, KVCacheDType::Fp8);
  EXPECT_EQ(c.disable_by_batch_size, 0);
  c = parse_speculative_config(R"({"method":"dflash","model":"/m","num_speculative_tokens":7,"disable_by_batch_size":8})");
  EXPECT_EQ(c.disable_by_batch_size, 8);
  EXPECT_EQ(describe(c), "dflash, 7 tokens, drafter /m, paused above 8 running sequences");
}

TEST(SpeculativeConfig, MistakesNameTheKeyAndTheValidValues) {
  expect_error("{", "not valid JSON");
  expect_error("[1]", "must be a JSON object");
  expect_error(R"({"num_speculative_tokens":4})", "\"method\" is required; valid methods are: ngram, dflash");
  expect_error(R"({"method":"eagle","num_speculative_tokens":4})", "unknown method 'eagle'; valid methods are: ngram, dflash");
  expect_error(R"({"method":"ngram"})", "\"num_speculative_tokens\" is required");
  expect_error(R"({"method":"ngram","num_speculative_tokens":0})", "between 1 and 64");
  expect_error(R"({"method":"ngram","num_speculative_tokens":"4"})", "must be an integer");
  expect_error(R"({"method":"ngram","num_speculative_tokens":4,"model":"x"})",
               "unknown key 'model' for method ngram; valid keys are: method, num_speculative_tokens, prompt_lookup_max, "
               "prompt_lookup_min, disable_by_batch_size");
  expect_error(R"({"method":"ngram","num_speculative_tokens":4,"disable_by_batch_size":0})", "at least 1");
  expect_error(R"({"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":3,"prompt_lookup_max":2})",
               "prompt_lookup_min <= prompt_lookup_max");
  expect_error(R"({"method":"dflash","num_speculative_tokens":4})", "needs \"model\"");
  expect_error(R"({"method":"dflash","model":"m","num_speculative_tokens":4,"kv_cache_dtype":"fp4"})",
               "valid values are");
  expect_error(R"({"method":"dflash","model":"m","num_speculative_tokens":4,"prompt_lookup_max":3})",
               "unknown key 'prompt_lookup_max' for method dflash");
}

TEST(NgramLookup, LongestEarliestMatchProposesWhatFollowed) {
  using V = std::vector<TokenId>;
  // "a b c d x a b c" -> the suffix "a b c" occurred at 0: propose "d x a".
  EXPECT_EQ(ngram_lookup(V{1, 2, 3, 4, 9, 1, 2, 3}, 1, 5, 3), (V{4, 9, 1}));
  // k is capped by what follows.
  EXPECT_EQ(ngram_lookup(V{1, 2, 3, 4, 9, 1, 2, 3}, 1, 5, 10), (V{4, 9, 1, 2, 3}));
  // The longest match wins over an earlier shorter one: "3" occurs at 0 (followed by 7),
  // "2 3" at 4 (followed by 8).
  EXPECT_EQ(ngram_lookup(V{3, 7, 5, 5, 2, 3, 8, 6, 2, 3}, 1, 3, 1), (V{8}));
  // Among equally long matches the earliest.
  EXPECT_EQ(ngram_lookup(V{5, 1, 5, 2, 5}, 1, 3, 1), (V{1}));
  // Matches shorter than min_n propose nothing; nothing to match, nothing proposed.
  EXPECT_TRUE(ngram_lookup(V{3, 7, 5, 5, 2, 3, 8, 6, 2, 3}, 3, 5, 2).empty());
  EXPECT_TRUE(ngram_lookup(V{1, 2, 3, 4}, 1, 5, 2).empty());
  EXPECT_TRUE(ngram_lookup(V{1}, 1, 5, 2).empty());
  // max_n bounds the match length used (a longer repetition still matches, at max_n).
  EXPECT_EQ(ngram_lookup(V{1, 2, 3, 4, 1, 2, 3, 4}, 2, 2, 2), (V{1, 2}));
  // A run of one token proposes the run.
  EXPECT_EQ(ngram_lookup(V{7, 7, 7, 7}, 2, 3, 4), (V{7}));
}

// Greedy generation with n-gram drafting gives the tokens of plain generation, on a trained
// model and prompts that repeat (where drafts are accepted) and ones that do not (parting
// only after a near tie of the plain run: support/greedy_compare.h).
TEST(NgramDrafting, GreedyOutputIsThePlainOutput) {
  const std::vector<std::vector<TokenId>> prompts{
      {1, 450, 871, 450, 871, 450},
      {1, 10, 11, 12, 13, 14, 10, 11, 12, 13, 14, 10, 11},
      {1, 200, 301, 57, 99, 1000, 1500, 1900},
  };
  uint64_t accepted = 0, drafted = 0;
  int parted = 0;
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8PerTokenHead}) {
    ModelOptions o;
    o.model_dir = kTiny;
    o.cache.kv_cache_dtype = dt;
    auto plain = LoadedModel::load(o);
    o.speculative = parse_speculative_config(
        R"({"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1,"prompt_lookup_max":4})");
    auto spec = LoadedModel::load(o);
    for (const auto& p : prompts) {
      GenerateRequest g;
      g.prompt = p;
      g.max_tokens = 48;
      g.sampling.temperature = 0;
      g.ignore_eos = true;
      const GenerateResult b = generate(*spec, g);
      g.logprobs = 2;
      const GenerateResult a = generate(*plain, g);
      parted += test::expect_same_greedy(a, b, std::string(kv_cache_dtype_name(dt)));
      EXPECT_EQ(a.drafts, 0u);
      accepted += b.accepted_tokens;
      drafted += b.draft_tokens;
    }
  }
  EXPECT_GT(drafted, 0u);
  EXPECT_GT(accepted, 0u) << "a trained model continuing repeated text accepted no n-gram draft";
  EXPECT_LE(parted, 1) << "drafted and plain greedy outputs part (at near ties) for more than one of 6 runs";
}

}  // namespace
}  // namespace kvlm

// Embeddings (--runner pooling): pooling configurations read as sentence-transformers writes
// them, the Pooler, and the engine's pooled vectors against transformers' (tests/golden/embed,
// made by tools/make_embedding_goldens.py) — last-token, mean and CLS pooling, chunked prefill,
// batches, Matryoshka cuts, a bare base model's tensor names, every KV format.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "engine/llm_engine.h"
#include "offline/embed.h"

#include "../support/error_text.h"

using namespace kvlm;
namespace fs = std::filesystem;

namespace {

const fs::path kEmbed = fs::path(KVLM_TEST_DATA) / "golden" / "embed";

nlohmann::json golden() {
  std::ifstream in(kEmbed / "expected.json");
  return nlohmann::json::parse(in);
}

// A copy of the golden model whose Pooling module says `mode` (pooling_mode_* keys set true).
fs::path model_with_pooling(const std::string& tag, const std::vector<std::string>& modes, bool normalize = true) {
  const fs::path dir = fs::temp_directory_path() / ("kvlm_embed_" + tag + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(kEmbed / "model", dir, fs::copy_options::recursive);
  nlohmann::json pc = {{"word_embedding_dimension", 64},
                       {"pooling_mode_cls_token", false},
                       {"pooling_mode_mean_tokens", false},
                       {"pooling_mode_lasttoken", false},
                       {"include_prompt", true}};
  for (const auto& m : modes) pc[m] = true;
  std::ofstream(dir / "1_Pooling" / "config.json") << pc.dump();
  if (!normalize) {
    nlohmann::json mods = nlohmann::json::parse(std::ifstream(dir / "modules.json"));
    mods.erase(2);
    std::ofstream(dir / "modules.json") << mods.dump();
  }
  return dir;
}

float max_diff(const std::vector<float>& a, const nlohmann::json& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i].get<float>()));
  return m;
}

std::vector<std::vector<TokenId>> golden_inputs(const nlohmann::json& g) {
  std::vector<std::vector<TokenId>> v;
  for (const auto& in : g["inputs"]) v.push_back(in["ids"].get<std::vector<TokenId>>());
  return v;
}

using test::error_of;

}  // namespace

TEST(Pooling, SentenceTransformersConfigsAreReadOrRefusedByField) {
  const auto pc = read_sentence_transformers(kEmbed / "model");
  ASSERT_TRUE(pc);
  EXPECT_EQ(pc->type, PoolingType::Last);
  EXPECT_TRUE(pc->normalize);
  EXPECT_FALSE(read_sentence_transformers(fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed"));
  const PoolingConfig r = resolve_pooling(kEmbed / "model");
  EXPECT_TRUE(r.matryoshka);  // is_matryoshka in config.json
  const PoolingConfig plain = resolve_pooling(fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed");
  EXPECT_EQ(plain.type, PoolingType::Last);
  EXPECT_TRUE(plain.normalize);
  EXPECT_FALSE(plain.matryoshka);

  const fs::path mean = model_with_pooling("mean_cfg", {"pooling_mode_mean_tokens"}, /*normalize=*/false);
  EXPECT_EQ(read_sentence_transformers(mean)->type, PoolingType::Mean);
  EXPECT_FALSE(read_sentence_transformers(mean)->normalize);
  const fs::path two = model_with_pooling("two", {"pooling_mode_mean_tokens", "pooling_mode_lasttoken"});
  EXPECT_NE(error_of([&] { read_sentence_transformers(two); }).find("exactly one of"), std::string::npos);
  const fs::path max = model_with_pooling("max", {"pooling_mode_max_tokens"});
  EXPECT_NE(error_of([&] { read_sentence_transformers(max); }).find("'pooling_mode_max_tokens' pooling is not supported"),
            std::string::npos);
  std::ofstream(two / "modules.json") << R"([{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}])";
  EXPECT_NE(error_of([&] { read_sentence_transformers(two); }).find("sentence_transformers.models.Dense' is not supported"),
            std::string::npos);
  std::ofstream(two / "modules.json") << "{not json";
  EXPECT_NE(error_of([&] { read_sentence_transformers(two); }).find("is not valid JSON"), std::string::npos);
  for (const auto& d : {mean, two, max}) fs::remove_all(d);
}

TEST(Pooling, PoolerPoolsChunksAndCutsBeforeNormalizing) {
  // rows: [1 2], [3 4], [5 6] arriving as two chunks
  const std::vector<float> a{1, 2, 3, 4}, b{5, 6};
  Pooler last(PoolingType::Last, 2), mean(PoolingType::Mean, 2), cls(PoolingType::Cls, 2);
  for (Pooler* p : {&last, &mean, &cls}) {
    p->add(a, 0);
    p->add(b, 2);
    EXPECT_EQ(p->rows_seen(), 3);
  }
  EXPECT_EQ(last.finish(false), (std::vector<float>{5, 6}));
  EXPECT_EQ(mean.finish(false), (std::vector<float>{3, 4}));
  EXPECT_EQ(cls.finish(false), (std::vector<float>{1, 2}));
  const auto n = mean.finish(true);
  EXPECT_FLOAT_EQ(n[0], 0.6f);
  EXPECT_FLOAT_EQ(n[1], 0.8f);
  EXPECT_EQ(last.finish(true, 1), (std::vector<float>{1.0f}));  // cut to 1, then normalized
}

TEST(Embed, LastTokenPoolingMatchesTransformers) {
  const auto g = golden();
  ModelOptions o;
  o.model_dir = kEmbed / "model";  // runner auto: modules.json makes it a pooling model
  o.dtype = DType::F32;            // an fp32 KV cache: transformers' float32 within rounding
  auto m = LoadedModel::load(o);
  ASSERT_TRUE(m->pooling());
  EXPECT_EQ(m->pooling()->type, PoolingType::Last);
  const auto inputs = golden_inputs(g);
  for (const int chunk : {2048, 7}) {  // whole prompts, and prompts prefilled 7 tokens a step
    const auto got = embed_prompts(*m, inputs, EmbedOptions{.max_num_batched_tokens = chunk});
    ASSERT_EQ(got.size(), inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_LT(max_diff(got[i], g["inputs"][i]["last"]), 2e-5f) << "input " << i << " chunk " << chunk;
      double norm = 0;
      for (const float x : got[i]) norm += double(x) * x;
      EXPECT_NEAR(norm, 1.0, 1e-5);
    }
  }
  const auto cut = embed_prompts(*m, inputs, EmbedOptions{.dimensions = 16});
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_LT(max_diff(cut[i], g["inputs"][i]["last16"]), 2e-5f) << i;
  EXPECT_NE(error_of([&] { embed_prompts(*m, inputs, EmbedOptions{.dimensions = 65}); }).find("between 1 and the model's 64"),
            std::string::npos);
  // A pooling model generates nothing: a generation request is refused by the engine.
  EngineRequest gen{.id = "g", .prompt = {1, 2, 3}, .max_tokens = 4};
  LLMEngine llm(*m, SchedulerConfig{.max_num_seqs = 1, .max_num_batched_tokens = 64, .max_model_len = 64, .num_blocks = 8});
  EXPECT_NE(error_of([&] { llm.add_request(gen); }).find("embedding model (--runner pooling)"), std::string::npos);
}

TEST(Embed, MeanAndClsPoolingMatchTransformersInEveryKVFormat) {
  const auto g = golden();
  const auto inputs = golden_inputs(g);
  const fs::path mean_dir = model_with_pooling("mean", {"pooling_mode_mean_tokens"});
  for (const char* kv : {"auto", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"}) {
    ModelOptions o;
    o.model_dir = mean_dir;
    o.dtype = DType::F32;  // "auto" then stores fp32 K/V
    o.cache.kv_cache_dtype = parse_kv_cache_dtype(kv);
    auto m = LoadedModel::load(o);
    ASSERT_EQ(m->pooling()->type, PoolingType::Mean);
    const auto got = embed_prompts(*m, inputs, EmbedOptions{.max_num_batched_tokens = 9});
    // fp32 KV: transformers' float32 vectors; quantized KV: close (cosine), as the cache costs.
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (std::string(kv) == "auto") {
        EXPECT_LT(max_diff(got[i], g["inputs"][i]["mean"]), 2e-5f) << i;
      } else {
        double dot = 0;
        for (size_t k = 0; k < got[i].size(); ++k) dot += double(got[i][k]) * g["inputs"][i]["mean"][k].get<double>();
        EXPECT_GT(dot, 0.99) << kv << " input " << i;
      }
    }
  }
  fs::remove_all(mean_dir);
  // CLS (the first token's vector): with causal attention it is the first token's alone, which
  // equals the last-token vector of the 1-token input.
  const fs::path cls_dir = model_with_pooling("cls", {"pooling_mode_cls_token"});
  ModelOptions o;
  o.model_dir = cls_dir;
  o.dtype = DType::F32;
  auto m = LoadedModel::load(o);
  const auto got = embed_prompts(*m, inputs);
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_LT(max_diff(got[i], g["inputs"][0]["last"]), 2e-5f) << i;
  fs::remove_all(cls_dir);
}

// A text's vector is the same bits wherever it sits in a batch and whatever shares its step:
// the CPU runs a pooling model's matrices one sequence at a time (OpenBLAS's sgemm otherwise
// rounds a row by its place among the call's rows, ~1e-5 on these vectors).
TEST(Embed, ATextGetsTheSameBitsInAnyBatch) {
  const fs::path mean_dir = model_with_pooling("batch", {"pooling_mode_mean_tokens"});
  ModelOptions o;
  o.model_dir = mean_dir;
  o.dtype = DType::F32;
  auto m = LoadedModel::load(o);
  std::vector<TokenId> a;
  for (int i = 0; i < 23; ++i) a.push_back(TokenId(5 + (i * 37) % 200));
  const std::vector<TokenId> b = {9, 8, 7, 6, 5}, c = {40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52};
  const std::vector<std::vector<TokenId>> only_a = {a};
  const auto alone = embed_prompts(*m, only_a)[0];
  for (const auto& batch : {std::vector{b, a, c, a}, std::vector{c, c, b, a, b}, std::vector{a, a, a}}) {
    const auto got = embed_prompts(*m, batch);
    for (size_t i = 0; i < batch.size(); ++i)
      if (batch[i] == a) EXPECT_EQ(got[i], alone) << "a text at place " << i << " of " << batch.size();
  }
  fs::remove_all(mean_dir);
}

// Tensor parallelism (CPU ranks): rank 0 hands back the hidden states, equal to one rank's.
TEST(Embed, TensorParallelPoolsAsOneRank) {
  const auto g = golden();
  const auto inputs = golden_inputs(g);
  ModelOptions o;
  o.model_dir = kEmbed / "model";
  o.dtype = DType::F32;
  const auto one = embed_prompts(*LoadedModel::load(o), inputs, EmbedOptions{.max_num_batched_tokens = 9});
  o.tensor_parallel_size = 2;
  auto tp = LoadedModel::load(o);
  ASSERT_EQ(tp->tensor_parallel_size(), 2);
  const auto two = embed_prompts(*tp, inputs, EmbedOptions{.max_num_batched_tokens = 9});
  for (size_t i = 0; i < inputs.size(); ++i) EXPECT_LT(max_diff(two[i], nlohmann::json(one[i])), 1e-5f) << i;
}

TEST(Embed, RunnerFlagAndBareCheckpointsSayWhatToDo) {
  ModelOptions o;
  o.model_dir = kEmbed / "model";
  o.dtype = DType::F32;
  o.runner = "generate";
  auto gen = LoadedModel::load(o);  // tied: loads, and generates (meaninglessly) as vLLM would
  EXPECT_FALSE(gen->pooling());
  o.runner = "embed";
  EXPECT_NE(error_of([&] { LoadedModel::load(o); }).find("--runner must be auto, generate or pooling"), std::string::npos);
  // An untied bare checkpoint (Qwen3-Embedding-4B/8B: no lm_head): pooling loads, generate says why not.
  const fs::path untied = fs::temp_directory_path() / ("kvlm_embed_untied_" + std::to_string(::getpid()));
  fs::remove_all(untied);
  fs::copy(kEmbed / "model", untied, fs::copy_options::recursive);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(untied / "config.json"));
  cfg["tie_word_embeddings"] = false;
  std::ofstream(untied / "config.json") << cfg.dump();
  o.model_dir = untied;
  o.runner = "generate";
  EXPECT_NE(error_of([&] { LoadedModel::load(o); }).find("serve it with --runner pooling"), std::string::npos);
  o.runner = "pooling";
  auto pooled = LoadedModel::load(o);
  const auto g = golden();
  const auto got = embed_prompts(*pooled, golden_inputs(g));
  EXPECT_LT(max_diff(got[2], g["inputs"][2]["last"]), 2e-5f);
  // A generative model asked to pool: last token, normalized, no Matryoshka.
  o.model_dir = fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-mixed";
  auto lm = LoadedModel::load(o);
  EXPECT_EQ(embed_prompts(*lm, std::vector<std::vector<TokenId>>{{1, 5, 9}})[0].size(), 64u);
  EXPECT_NE(error_of([&] { embed_prompts(*lm, std::vector<std::vector<TokenId>>{{1, 5, 9}}, EmbedOptions{.dimensions = 8}); })
                .find("does not support `dimensions`"),
            std::string::npos);
  fs::remove_all(untied);
}

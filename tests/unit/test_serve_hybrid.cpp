// The serving engine on hybrid models (Gated DeltaNet layers beside full attention: Qwen3.5,
// Qwen3-Next): per-sequence recurrent states through continuous batching, chunked prefill and
// preemption; prefix caching through state snapshots; the multimodal wrappers' language model;
// tensor parallelism; bf16 states — checked against single-request generation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"
#include "engine/engine_args.h"
#include "engine/llm_engine.h"
#include "io/safetensors.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "serve_test_util.h"
#include "test_util.h"
#include "../support/greedy_compare.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::testing;

namespace {

const fs::path kTests = KVLM_TEST_DATA;
const fs::path kQwen35 = kTests / "golden" / "models" / "qwen3.5";
const fs::path kQwen3Next = kTests / "golden" / "models" / "qwen3-next";

// A hybrid model (Qwen3.5: Gated DeltaNet layers around a full-attention layer): each running
// sequence carries its recurrent state in its own slot through chunked prefill (budget 23 cuts
// prompts anywhere), batching and preemption (a preempted sequence resumes from the state
// snapshot its prefix hit ends with, or recomputes from a fresh state, in whatever slot it
// gets next).
TEST(Scheduler, BatchedEqualsSequentialHybridLinearAttention) {
  check_batched_equals_sequential(kQwen35, KVCacheDType::Auto, 200, 23);
}
TEST(Scheduler, BatchedEqualsSequentialHybridLinearAttentionUnderPreemption) {
  check_batched_equals_sequential(kQwen35, KVCacheDType::Int8PerTokenHead, 16, 23);
}
// Qwen3-Next: the states beside mixtures of experts with a shared expert, batched and preempted.
TEST(Scheduler, BatchedEqualsSequentialHybridMixtureOfExperts) {
  check_batched_equals_sequential(kQwen3Next, KVCacheDType::Auto, 200, 23);
  check_batched_equals_sequential(kQwen3Next, KVCacheDType::Fp8E4M3, 16, 23);
}
// A multimodal checkpoint around the language model in `src`, laid out as released: config.json
// with the model's config as text_config (tied embeddings and dtype at the top level), the
// tensors under `prefix` instead of "model." (lm_head under `head`), and a vision tower's tensor
// (`vision`) beside them.
fs::path wrap_multimodal(const fs::path& src, const std::string& arch, const std::string& model_type,
                         const std::string& prefix, const std::string& head, const std::string& vision) {
  const fs::path dir = fs::temp_directory_path() / ("kvlm_" + model_type + "_vl_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  nlohmann::json text = read_json_file(src / "config.json");
  text.erase("architectures");
  nlohmann::json cfg = {{"architectures", {arch}},
                        {"model_type", model_type},
                        {"tie_word_embeddings", text["tie_word_embeddings"]},
                        {"torch_dtype", text["torch_dtype"]},
                        {"vision_config", {{"depth", 1}, {"hidden_size", 8}}},
                        {"text_config", text}};
  cfg["text_config"].erase("tie_word_embeddings");
  cfg["text_config"].erase("torch_dtype");
  std::ofstream(dir / "config.json") << cfg.dump(2);
  fs::copy_file(src / "generation_config.json", dir / "generation_config.json");
  const SafetensorsFile in(src / "model.safetensors");
  std::vector<TensorToWrite> out;
  for (const TensorInfo& t : in.header().tensors) {
    const TensorView v = in.view(t);
    const std::string name =
        t.name.starts_with("model.") ? prefix + t.name.substr(6) : t.name == "lm_head.weight" ? head : t.name;
    out.push_back({name, t.dtype, t.shape, v.bytes});
  }
  const std::vector<float> patch(2 * 3 * 4, 0.5f);
  out.push_back({vision, DType::F32, {2, 3, 4}, {reinterpret_cast<const uint8_t*>(patch.data()), patch.size() * 4}});
  write_safetensors(dir / "model.safetensors", out);
  return dir;
}

// The released Qwen3.5 checkpoints are multimodal (Qwen3_5ForConditionalGeneration, tensors
// under model.language_model. as transformers 5 writes them): kvlm runs the language model, with
// the same tokens as the causal checkpoint of the same weights.
TEST(Scheduler, Qwen35ConditionalGenerationRunsItsLanguageModel) {
  const fs::path dir = wrap_multimodal(kQwen35, "Qwen3_5ForConditionalGeneration", "qwen3_5", "model.language_model.",
                                       "lm_head.weight", "model.visual.patch_embed.proj.weight");
  auto plain = load(kQwen35);
  auto wrapped = load(dir);
  EXPECT_EQ(wrapped->config().wrapper, "Qwen3_5ForConditionalGeneration");
  EXPECT_EQ(wrapped->config().num_linear_layers(), plain->config().num_linear_layers());
  std::mt19937 rng(3);
  const auto prompt = random_prompt(rng, 70, plain->config().vocab_size);
  EXPECT_EQ(one_at_a_time(*wrapped, prompt, 12), one_at_a_time(*plain, prompt, 12));
  fs::remove_all(dir);
}

// Gemma 3 above 1B ships as Gemma3ForConditionalGeneration (transformers 4.5x: tensors under
// language_model.model., the head under language_model.lm_head, a SigLIP vision tower): the same
// tokens as the causal checkpoint (the text_config defaults: ModelConfig tests).
TEST(Scheduler, Gemma3ConditionalGenerationRunsItsLanguageModel) {
  const fs::path src = kTests / "golden" / "models" / "gemma3-swa";
  const fs::path dir = wrap_multimodal(src, "Gemma3ForConditionalGeneration", "gemma3", "language_model.model.",
                                       "language_model.lm_head.weight",
                                       "vision_tower.vision_model.embeddings.patch_embedding.weight");
  auto plain = load(src);
  auto wrapped = load(dir);
  EXPECT_EQ(wrapped->config().wrapper, "Gemma3ForConditionalGeneration");
  std::mt19937 rng(4);
  const auto prompt = random_prompt(rng, 40, plain->config().vocab_size);
  EXPECT_EQ(one_at_a_time(*wrapped, prompt, 12), one_at_a_time(*plain, prompt, 12));
  fs::remove_all(dir);
}

// Prefix caching on a hybrid model (Qwen3.5): a hit resumes from the recurrent-state snapshot
// kept where an earlier prompt's last full page ended (32 of 40 tokens, pages of 8), and a
// prompt that goes past it keeps its own (40 of 43); the tokens are those of a run without any
// cache. With one snapshot slot, other traffic takes it, and the repeat computes everything.
// The tokens' log-probabilities are checked too: a tiny random model's greedy tokens survive a
// wrong state (a hit resuming from the slot's previous state moves the log-probabilities by
// 0.12-0.29), other chunkings move them by at most 4e-5.
TEST(Scheduler, PrefixCacheOnAHybridModelResumesFromStateSnapshots) {
  auto e = load(kQwen35, KVCacheDType::Auto, 8);
  std::mt19937 rng(5);
  const int vocab = e->config().vocab_size;
  const auto shared = random_prompt(rng, 40, vocab);  // 5 full pages
  auto longer = shared;
  longer.insert(longer.end(), {5, 6, 7});
  auto longest = longer;
  longest.insert(longest.end(), {9, 10, 11, 12, 13, 14, 15});
  const auto want_shared = one_at_a_time(*e, shared, 6);
  const auto want_longer = one_at_a_time(*e, longer, 6);
  const auto want_longest = one_at_a_time(*e, longest, 6);
  std::map<std::string, Collected> alone;  // each prompt without a cache
  {
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 64, .max_model_len = 128,
                                     .enable_prefix_caching = false, .num_blocks = 64});
    for (const auto& [id, p] : {std::pair{"first", shared}, {"again", shared}, {"longer", longer}, {"longest", longest}}) {
      le.add_request(with_logprobs(make(id, p, 6, alone)));
      run_to_end(le);
    }
  }
  for (const int budget : {64, 13}) {  // whole prompts, and chunks that straddle the snapshot points
    std::map<std::string, Collected> out;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = budget, .max_model_len = 128,
                                     .enable_prefix_caching = true, .num_blocks = 64});
    EXPECT_EQ(le.config().state_snapshots, 2);
    le.add_request(with_logprobs(make("first", shared, 6, out)));
    run_to_end(le);
    le.add_request(with_logprobs(make("again", shared, 6, out)));
    run_to_end(le);
    le.add_request(with_logprobs(make("longer", longer, 6, out)));
    run_to_end(le);
    le.add_request(with_logprobs(make("longest", longest, 6, out)));
    run_to_end(le);
    for (const char* id : {"first", "again", "longer", "longest"})
      EXPECT_LT(max_logprob_diff(out[id], alone[id]), 1e-3) << id << ", budget " << budget;
    EXPECT_EQ(out["first"].cached, 0);
    EXPECT_EQ(out["again"].cached, 32);
    EXPECT_EQ(out["longer"].cached, 32);
    EXPECT_EQ(out["longest"].cached, 40);
    EXPECT_EQ(out["first"].tokens, want_shared) << "budget " << budget;
    EXPECT_EQ(out["again"].tokens, want_shared) << "budget " << budget;
    EXPECT_EQ(out["longer"].tokens, want_longer) << "budget " << budget;
    EXPECT_EQ(out["longest"].tokens, want_longest) << "budget " << budget;
    EXPECT_EQ(le.snapshots().size(), 2);
    EXPECT_EQ(le.blocks().num_used(), 0);
  }
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 64, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = 64, .state_snapshots = 1});
  le.add_request(make("first", shared, 6, out));
  run_to_end(le);
  le.add_request(make("other", random_prompt(rng, 30, vocab), 2, out));
  run_to_end(le);
  le.add_request(make("again", shared, 6, out));
  run_to_end(le);
  EXPECT_EQ(out["again"].cached, 0) << "its pages are cached, but its snapshot was given to another prompt";
  EXPECT_EQ(out["again"].tokens, want_shared);
}

// n-gram drafting on a hybrid model rolls the recurrent state back (serve_test_util.h).
TEST(Scheduler, HybridDraftsRollTheRecurrentStateBack) {
  ModelOptions o;
  o.model_dir = kQwen35;
  o.cache.block_size = 8;
  check_hybrid_drafts(o, "cpu");
}

// DFlash's drafter is not built for hybrid models: refused before loading, naming what works.
TEST(Scheduler, HybridModelsRefuseDFlashDrafting) {
  ModelOptions o;
  o.model_dir = kQwen35;
  o.speculative = parse_speculative_config(R"({"method":"dflash","model":"/nonexistent","num_speculative_tokens":4})");
  EXPECT_ERROR_CONTAINS(LoadedModel::load(o), "DFlash drafting is not supported on models with Gated DeltaNet layers");
}

// Two tensor-parallel ranks (each its key heads' Gated DeltaNet states, allocated and copied on
// every rank): batched, chunked, with a prefix hit resuming from a snapshot, they give one
// rank's tokens, log-probabilities within fp32 summation noise (the ranks sum out_proj's
// partial products in another order).
TEST(Scheduler, HybridOverTwoTensorParallelRanks) {
  ModelOptions o;
  o.model_dir = kQwen35;
  o.cache.block_size = 8;
  o.dtype = DType::F32;
  auto one = LoadedModel::load(o);
  o.tensor_parallel_size = 2;
  auto two = LoadedModel::load(o);
  ASSERT_EQ(two->tensor_parallel_size(), 2);
  std::mt19937 rng(9);
  const auto shared = random_prompt(rng, 40, one->config().vocab_size);
  const auto other = random_prompt(rng, 21, one->config().vocab_size);
  std::map<std::string, Collected> want, got;
  for (auto* e : {one.get(), two.get()}) {
    auto& out = e == one.get() ? want : got;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 13, .max_model_len = 128,
                                     .enable_prefix_caching = true, .num_blocks = 64});
    le.add_request(with_logprobs(make("first", shared, 6, out)));
    le.add_request(with_logprobs(make("other", other, 6, out)));
    run_to_end(le);
    le.add_request(with_logprobs(make("again", shared, 6, out)));
    run_to_end(le);
  }
  EXPECT_EQ(got["again"].cached, 32) << "the repeat resumes from its snapshot on both ranks";
  for (const char* id : {"first", "other", "again"}) {
    EXPECT_EQ(got[id].tokens, want[id].tokens) << id;
    EXPECT_LT(max_logprob_diff(got[id], want[id]), 1e-4) << id;
  }
}

// --mamba-ssm-cache-dtype bfloat16: the delta rule's matrices held in bf16 (half the state's
// bytes, counted by the memory plan), rounded once a step; the logits move, but by much less
// than a model's differences (teacher-forced over 90 tokens in chunks of 7 and one by one).
TEST(Scheduler, HybridStateInBfloat16) {
  ModelOptions o;
  o.model_dir = kQwen35;
  auto f32 = LoadedModel::load(o);
  o.cache.linear_state_dtype = DType::BF16;
  auto b16 = LoadedModel::load(o);
  const LinearAttentionConfig& l = *b16->config().linear_attention;
  EXPECT_EQ(l.state_dtype, DType::BF16);
  EXPECT_EQ(l.state_bytes(), 1920u + 3072u);  // the fp32 window (3 x 160 values) + 4 x 16 x 24 bf16 values
  EXPECT_EQ(f32->config().linear_attention->state_bytes(), 1920u + 6144u);
  MemoryOptions mo;
  mo.kv_cache_memory = 1 << 22;
  mo.max_num_seqs = 8;
  EXPECT_EQ(plan_kv_memory(*b16, mo).state_bytes, 16u * 4u * l.state_bytes());
  std::mt19937 rng(8);
  const int V = f32->config().vocab_size;
  const auto prompt = random_prompt(rng, 90, V);
  for (const int chunk : {7, 1}) {
    const std::vector<float> a = all_logits(*f32, prompt, chunk), b = all_logits(*b16, prompt, chunk);
    double kld = 0, max_abs = 0, scale = 0;
    for (size_t t = 0; t < prompt.size(); ++t) {
      const float* x = a.data() + t * size_t(V);
      const float* y = b.data() + t * size_t(V);
      const double lx = log_sum_exp({x, size_t(V)}), ly = log_sum_exp({y, size_t(V)});
      for (int i = 0; i < V; ++i) {
        kld += std::exp(x[i] - lx) * ((x[i] - lx) - (y[i] - ly)) / double(prompt.size());
        max_abs = std::max(max_abs, double(std::fabs(x[i] - y[i])));
        scale = std::max(scale, double(std::fabs(x[i])));
      }
    }
    std::printf("[bf16 state] chunks of %d: max|dlogit| %.3e of %.1f, mean KLD %.2e\n", chunk, max_abs, scale, kld);
    EXPECT_GT(max_abs, 0.0) << "the bf16 state changed nothing: is it applied?";
    EXPECT_LT(kld, 1e-3);
  }
  ModelArgs args;
  args.mamba_ssm_cache_dtype = "float16";
  try {
    args.cache_config(ArgStyle::Flag);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--mamba-ssm-cache-dtype must be auto, float32 or bfloat16"), std::string::npos)
        << e.what();
  }
}

// Without state snapshots a hybrid model cannot resume from a hit: prefix caching is turned off.
TEST(Scheduler, HybridModelWithoutSnapshotsComputesEverything) {
  auto e = load(kQwen35, KVCacheDType::Auto, 8);
  std::mt19937 rng(5);
  const auto p = random_prompt(rng, 40, e->config().vocab_size);
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 2, .max_num_batched_tokens = 64, .max_model_len = 128,
                                   .enable_prefix_caching = true, .num_blocks = 64, .state_snapshots = 0});
  EXPECT_FALSE(le.config().enable_prefix_caching);
  le.add_request(make("a", p, 3, out));
  run_to_end(le);
  le.add_request(make("b", p, 3, out));
  run_to_end(le);
  EXPECT_EQ(out["b"].cached, 0);
  EXPECT_EQ(out["a"].tokens, out["b"].tokens);
}

}  // namespace

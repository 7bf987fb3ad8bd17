// DFlash on the GPU: the CUDA runner's drafter — its context pass inside the target's step,
// its blocks eagerly and as CUDA graphs — against the CPU runner's, and drafted greedy
// generation against plain greedy generation on the GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cuda_test_util.h"
#include "model/cuda/cuda_runner.h"
#include "model/loaded_model.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "text/text_processor.h"
#include "../support/random_drafter.h"

namespace kvlm {
namespace {

namespace fs = std::filesystem;
const fs::path kTiny = fs::path(KVLM_SOURCE_DIR) / "models" / "kvlm-tiny";

ModelOptions options(Device dev, KVCacheDType dt, const test::Drafter* d) {
  ModelOptions o;
  o.model_dir = kTiny;
  o.device = dev;
  o.cache.kv_cache_dtype = dt;
  if (d)
    o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + d->dir.string() +
                                             R"(","num_speculative_tokens":7})");
  return o;
}

// The drafter's logits for one block after the same prompt, on both devices: the features,
// the context K/V and the block all go through the GPU's bf16 path, so they agree within
// that precision.
TEST(CudaDFlash, DrafterBlockMatchesTheCpuRunner) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const test::Drafter D = test::make_drafter("cuda-block");
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto cpu = LoadedModel::load(options(Device::Cpu, dt, &D));
    auto gpu = LoadedModel::load(options(Device::Cuda, dt, &D));
    ASSERT_TRUE(gpu->model().has_drafter());
    const int bs = 16, n = 37, B = D.block;
    std::vector<std::vector<float>> got;
    for (LoadedModel* m : {cpu.get(), gpu.get()}) {
      m->model().allocate_kv(6, bs);
      const std::vector<BlockId> table{4, 1, 5, 0};
      auto slot = [&](int p) { return SlotId(table[size_t(p / bs)]) * bs + p % bs; };
      std::vector<TokenId> prompt;
      std::vector<Position> pos;
      std::vector<SlotId> slots;
      for (int p = 0; p < n; ++p) prompt.push_back(TokenId(30 + 53 * p % 1850)), pos.push_back(p), slots.push_back(slot(p));
      const AttnSeq seq{.q_begin = 0, .q_len = n, .kv_len = n, .block_table = table};
      const std::vector<int32_t> last{n - 1};
      std::vector<float> logits(1911);
      m->model().forward({.tokens = prompt, .positions = pos, .slots = slots, .seqs = {&seq, 1}, .logit_rows = last},
                         logits);
      std::vector<TokenId> bt{prompt.back()};
      std::vector<Position> bpos{n};
      std::vector<SlotId> bslots{slot(n)};
      for (int j = 1; j < B; ++j) bt.push_back(D.mask), bpos.push_back(n + j), bslots.push_back(slot(n + j));
      const AttnSeq bseq{.q_begin = 0, .q_len = B, .kv_len = n + B, .block_table = table};
      std::vector<int32_t> rows;
      for (int j = 1; j < B; ++j) rows.push_back(j);
      std::vector<float> out(rows.size() * 1911);
      const ForwardBatch block{.tokens = bt, .positions = bpos, .slots = bslots, .seqs = {&bseq, 1}, .logit_rows = rows};
      m->model().draft(block, out);
      got.push_back(out);
      if (m == gpu.get()) {
        // The same block again (it stores the same K/V): captured as a graph, then replayed.
        auto& cr = dynamic_cast<CudaModelRunner&>(m->model());
        const int before = cr.num_cuda_graphs();
        std::vector<float> again(out.size());
        for (int rep = 0; rep < 2; ++rep) {
          m->model().draft(block, again);
          double d = 0;
          for (size_t i = 0; i < out.size(); ++i) d = std::max(d, double(std::fabs(out[i] - again[i])));
          EXPECT_LT(d, 0.02) << "drafter block, graph run " << rep << " vs eager";
        }
        EXPECT_EQ(cr.num_cuda_graphs(), before + 1) << "the drafter's block ran as a CUDA graph";
      }
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got[0].size(); ++i) {
      worst = std::max(worst, double(std::fabs(got[0][i] - got[1][i])));
      scale = std::max(scale, double(std::fabs(got[0][i])));
    }
    std::printf("[cuda-dflash] %-20s drafter logits max|cuda-cpu| = %.3e of %.3e\n",
                std::string(kv_cache_dtype_name(dt)).c_str(), worst, scale);
    EXPECT_LT(worst, 0.03 * scale + 0.03);
  }
  fs::remove_all(D.dir);
}

// Drafted greedy generation on the GPU gives the GPU's plain greedy tokens, except at a
// near-tie: a verification step's rows go through the prefill kernels and other GEMM shapes
// than one-row decode, so where the target's top logits are within bf16 noise of each other
// the two runs may pick different ones. A divergence is accepted only there (the drafted
// token's logit within 0.05 of the top one, teacher-forced on the plain run's tokens), and
// counted; the comparison stops at the first one (the continuations differ after it).
TEST(CudaDFlash, DraftedGreedyIsPlainGreedy) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const test::Drafter D = test::make_drafter("cuda-greedy");
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    auto plain = LoadedModel::load(options(Device::Cuda, dt, nullptr));
    auto spec = LoadedModel::load(options(Device::Cuda, dt, &D));
    GenerateRequest g;
    g.prompt = {1, 200, 301, 57, 99, 1000, 1500, 1900, 42, 42, 7};
    g.max_tokens = 48;
    g.sampling.temperature = 0;
    g.ignore_eos = true;
    const GenerateResult a = generate(*plain, g), b = generate(*spec, g);
    ASSERT_EQ(a.tokens.size(), b.tokens.size());
    const auto diff = std::ranges::mismatch(a.tokens, b.tokens);
    if (diff.in1 != a.tokens.end()) {
      const size_t i = size_t(diff.in1 - a.tokens.begin());
      std::vector<TokenId> ctx = g.prompt;
      ctx.insert(ctx.end(), a.tokens.begin(), a.tokens.begin() + std::ptrdiff_t(i));
      const std::vector<float> all = all_logits(*plain, ctx, 64);
      const std::span<const float> row = std::span<const float>(all).last(1911);
      const float top = *std::ranges::max_element(row);
      const float gap_plain = top - row[size_t(a.tokens[i])], gap_drafted = top - row[size_t(b.tokens[i])];
      std::printf("[cuda-dflash] %-20s near-tie at output %zu: plain %d (top - logit %.4f), drafted %d (%.4f)\n",
                  std::string(kv_cache_dtype_name(dt)).c_str(), i, a.tokens[i], gap_plain, b.tokens[i], gap_drafted);
      EXPECT_LT(gap_plain, 0.05f);
      EXPECT_LT(gap_drafted, 0.05f) << "drafted output " << i << " is not a near-tie of the target's top token";
    }
    EXPECT_GT(b.drafts, 0u);
    std::printf("[cuda-dflash] %-20s %llu drafts, %llu / %llu accepted\n", std::string(kv_cache_dtype_name(dt)).c_str(),
                (unsigned long long)b.drafts, (unsigned long long)b.accepted_tokens, (unsigned long long)b.draft_tokens);
  }
  fs::remove_all(D.dir);
}

// The bundled, trained drafter on the bundled task prompts, BF16 and FP8 caches: drafted
// greedy answers (to EOS) against plain greedy answers on the GPU. Every divergence must be at
// a near-tie of the target (the two tokens' logits within 0.05 of the top one, teacher-forced
// on the plain run's tokens; the issue's report asks how many are below 1e-3): counted, and
// printed with their margins.
TEST(CudaDFlash, TrainedDrafterKeepsTheTaskAnswers) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const fs::path drafter = fs::path(KVLM_SOURCE_DIR) / "models" / "kvlm-tiny-dflash";
  const TextProcessor text = TextProcessor::load(kTiny);
  std::vector<std::vector<TokenId>> prompts;
  std::ifstream in(kTiny / "eval" / "arithmetic.jsonl");
  for (std::string line; prompts.size() < 32 && std::getline(in, line);)
    prompts.push_back(text.encode_prompt(nlohmann::json::parse(line)["prompt"].get<std::string>()));
  ASSERT_EQ(prompts.size(), 32u);
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8PerTokenHead}) {
    SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)));
    ModelOptions o = options(Device::Cuda, dt, nullptr);
    auto plain = LoadedModel::load(o);
    o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + drafter.string() +
                                             R"(","num_speculative_tokens":7})");
    auto spec = LoadedModel::load(o);
    int same = 0, ties = 0, below_1e3 = 0;
    uint64_t drafts = 0, accepted = 0;
    for (const auto& p : prompts) {
      GenerateRequest g;
      g.prompt = p;
      g.max_tokens = 96;
      g.sampling.temperature = 0;
      const GenerateResult a = generate(*plain, g), b = generate(*spec, g);
      drafts += b.drafts;
      accepted += b.accepted_tokens;
      const auto diff = std::ranges::mismatch(a.tokens, b.tokens);
      if (diff.in1 == a.tokens.end() && diff.in2 == b.tokens.end()) {
        ++same;
        continue;
      }
      ASSERT_TRUE(diff.in1 != a.tokens.end() && diff.in2 != b.tokens.end()) << "one answer is a prefix of the other";
      const size_t i = size_t(diff.in1 - a.tokens.begin());
      std::vector<TokenId> ctx = p;
      ctx.insert(ctx.end(), a.tokens.begin(), a.tokens.begin() + std::ptrdiff_t(i));
      const std::vector<float> all = all_logits(*plain, ctx, 64);
      const std::span<const float> row = std::span<const float>(all).last(1911);
      const float top = *std::ranges::max_element(row);
      const float gap = std::max(top - row[size_t(a.tokens[i])], top - row[size_t(b.tokens[i])]);
      ++ties;
      below_1e3 += gap < 1e-3f;
      std::printf("[cuda-dflash] %-20s divergence at output %zu: plain %d, drafted %d, top-2 margin %.4f\n",
                  std::string(kv_cache_dtype_name(dt)).c_str(), i, a.tokens[i], b.tokens[i], gap);
      EXPECT_LT(gap, 0.05f) << "a drafted answer left the target's greedy path away from a near-tie";
    }
    std::printf("[cuda-dflash] %-20s trained drafter, 32 task prompts: %d identical, %d diverge at near-ties "
                "(%d with a margin below 1e-3); mean acceptance length %.2f\n",
                std::string(kv_cache_dtype_name(dt)).c_str(), same, ties, below_1e3,
                drafts ? 1.0 + double(accepted) / double(drafts) : 0.0);
    EXPECT_GT(accepted, 2 * drafts) << "the trained drafter should average over 3 tokens per step here";
  }
}

}  // namespace
}  // namespace kvlm

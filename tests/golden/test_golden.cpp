// kvlm against Hugging Face transformers (tools/make_goldens.py, run on the GPU machine).
//
// For every golden model:
//  * unquantized (fp32 KV, --dtype float32): teacher-forced logits at every position match
//    transformers' fp32 logits to fp32 tolerance, with prefill split into 7-token chunks so
//    multi-token queries over existing context and page boundaries are exercised; free-running
//    greedy generation reproduces transformers' 16 greedy tokens; the per-layer attention kinds
//    kvlm derives from config.json equal the ones transformers derived.
//  * every KV mode: KL divergence of the next-token distributions from transformers' stays under
//    the mode's bound, and greedy decisions agree wherever the reference's top-2 margin exceeds
//    twice the logit error the quantized cache caused at that position.
//  * tensor parallelism on the CPU (ranks as threads): every size that splits the model gives
//    the one-rank logits to fp32 tolerance and the golden greedy tokens with an fp32 cache,
//    and stays within each mode's bounds of transformers with FP8 and per-token-head caches.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "offline/generate.h"
#include "offline/score.h"
#include "io/safetensors.h"
#include "core/error.h"
#include "model/tensor_parallel.h"
#include "kld_bounds.h"

using namespace kvlm;
using namespace kvlm::test;
namespace fs = std::filesystem;

namespace {

const fs::path kGolden = fs::path(KVLM_TEST_DATA) / "golden";

struct Golden {
  std::string name;
  fs::path model_dir;
  nlohmann::json meta;
  std::vector<TokenId> prompt, greedy;
  std::vector<float> logits;  // [T][V]
  int vocab = 0;
};

Golden load_golden(const std::string& name) {
  Golden g;
  g.name = name;
  std::ifstream in(kGolden / "expected" / (name + ".json"));
  g.meta = nlohmann::json::parse(in);
  g.prompt = g.meta["prompt_ids"].get<std::vector<TokenId>>();
  g.greedy = g.meta["greedy_ids"].get<std::vector<TokenId>>();
  g.model_dir = name == "stories260K" ? fs::path(KVLM_SOURCE_DIR) / "models" / "stories260K" : kGolden / "models" / name;
  SafetensorsFile f(kGolden / "expected" / (name + ".logits.safetensors"));
  const TensorInfo* t = f.find("logits");
  g.vocab = int(t->shape[1]);
  g.logits.resize(size_t(t->numel()));
  convert_to_f32(t->dtype, f.view(*t).bytes, g.logits);
  return g;
}

// The golden run's greedy request: its prompt, as many tokens as transformers generated,
// prefilled in chunks of 5.
GenerateRequest greedy_request(const Golden& g) {
  GenerateRequest req;
  req.prompt = g.prompt;
  req.sampling.temperature = 0;
  req.max_tokens = int(g.greedy.size());
  req.ignore_eos = true;
  req.prefill_chunk = 5;
  return req;
}

std::vector<std::string> golden_names() {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(kGolden / "expected"))
    if (e.path().extension() == ".json") out.push_back(e.path().stem().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::unique_ptr<LoadedModel> load(const Golden& g, KVCacheDType dt, std::optional<DType> dtype, int tp = 1) {
  ModelOptions o;
  o.model_dir = g.model_dir;
  o.cache.kv_cache_dtype = dt;
  o.dtype = dtype;
  o.tensor_parallel_size = tp;
  return LoadedModel::load(o);
}

// Teacher-forced logits over prompt + greedy, prefilled in chunks of `chunk`.
std::vector<float> teacher_forced(LoadedModel& e, const Golden& g, int chunk) {
  std::vector<TokenId> all = g.prompt;
  all.insert(all.end(), g.greedy.begin(), g.greedy.end());
  return all_logits(e, all, chunk);
}

struct Stats {
  double max_abs = 0, mean_kld = 0, max_kld = 0, top1 = 0;
  int decisions_checked = 0, decisions_failed = 0;
};

// Compares rows [0, T) of `got` with the golden logits. Decisions are checked on the
// positions that predict generated tokens (prompt_len - 1 ... T - 2).
Stats compare(const Golden& g, const std::vector<float>& got) {
  Stats s;
  const size_t V = size_t(g.vocab), T = got.size() / V;
  int agree = 0;
  for (size_t t = 0; t < T; ++t) {
    const float* a = g.logits.data() + t * V;
    const float* b = got.data() + t * V;
    double row_err = 0, ma = -1e30, mb = -1e30;
    for (size_t i = 0; i < V; ++i) {
      row_err = std::max(row_err, double(std::fabs(a[i] - b[i])));
      ma = std::max(ma, double(a[i]));
      mb = std::max(mb, double(b[i]));
    }
    s.max_abs = std::max(s.max_abs, row_err);
    double za = 0, zb = 0;
    for (size_t i = 0; i < V; ++i) {
      za += std::exp(a[i] - ma);
      zb += std::exp(b[i] - mb);
    }
    double kld = 0;  // KL(reference || kvlm)
    for (size_t i = 0; i < V; ++i) {
      const double lpa = a[i] - ma - std::log(za), lpb = b[i] - mb - std::log(zb);
      kld += std::exp(lpa) * (lpa - lpb);
    }
    s.mean_kld += kld / double(T);
    s.max_kld = std::max(s.max_kld, kld);
    size_t ia = 0, ib = 0;
    for (size_t i = 1; i < V; ++i) {
      if (a[i] > a[ia]) ia = i;
      if (b[i] > b[ib]) ib = i;
    }
    agree += ia == ib;
    if (t + 1 >= g.prompt.size() && t + 1 < T) {
      double second = -1e30;
      for (size_t i = 0; i < V; ++i)
        if (i != ia) second = std::max(second, double(a[i]));
      const double margin = a[ia] - second;
      if (margin > 2 * row_err) {
        ++s.decisions_checked;
        s.decisions_failed += ia != ib;
      }
    }
  }
  s.top1 = double(agree) / double(T);
  return s;
}

}  // namespace

class Goldens : public ::testing::TestWithParam<std::string> {};

TEST_P(Goldens, UnquantizedMatchesTransformers) {
  const Golden g = load_golden(GetParam());
  auto e = load(g, KVCacheDType::Auto, DType::F32);
  ASSERT_EQ(e->plan().layers[0].k.storage, DType::F32);
  // Attention kinds: kvlm's reading of config.json == transformers'.
  const auto& hf = g.meta["hf_layer_types"];
  ASSERT_EQ(hf.size(), e->config().layers.size());
  for (size_t i = 0; i < hf.size(); ++i) {
    EXPECT_EQ(e->config().is_linear_layer(int(i)), hf[i] == "linear_attention") << "layer " << i;
    const bool sliding = hf[i] == "sliding_attention";
    EXPECT_EQ(e->config().layers[i].kind == AttentionKind::Sliding, sliding) << "layer " << i;
    if (sliding) EXPECT_EQ(e->config().layers[i].window, g.meta["hf_sliding_window"].get<int>());
  }
  const auto got = teacher_forced(*e, g, 7);
  ASSERT_EQ(got.size(), g.logits.size());
  const Stats s = compare(g, got);
  double scale = 0;
  for (float x : g.logits) scale = std::max(scale, double(std::fabs(x)));
  scale = std::max(1.0, scale);
  // The same logits prefilled one token at a time and in one piece: how far kvlm's own
  // summation orders move this model on this input.
  double spread = 0;
  for (int chunk : {1, int(g.prompt.size() + g.greedy.size())}) {
    const auto other = teacher_forced(*e, g, chunk);
    for (size_t i = 0; i < got.size(); ++i) spread = std::max(spread, double(std::fabs(other[i] - got[i])));
  }
  std::printf("[golden] %-12s %-20s max|dlogit|=%.2e (max|logit| %.1f) kld=%.1e top1=%.3f chunking spread %.1e\n",
              g.name.c_str(), "fp32 KV", s.max_abs, scale, s.max_kld, s.top1, spread);
  // fp32 vs fp32 with different summation orders: relative error ~1e-6 per op, grown through a
  // few layers; 2e-5 of the logit range is ~20x the values measured on most goldens. Some
  // models amplify that noise far more: the hybrid MoE goldens (Gated DeltaNet layers, router
  // logits of std 16) move by 1-2e-3 between kvlm's own chunkings, and transformers' forward and
  // cached generate differ by 1.7e-4 on them. Such a model is held to 4x its own spread — while
  // the spread itself (a chunking-dependent result) must stay under 5e-4 of the logit range.
  EXPECT_LT(spread, 5e-4 * scale) << "the logits depend on how the prompt is chunked";
  EXPECT_LT(s.max_abs, std::max(2e-5 * scale, 4 * spread));
  EXPECT_EQ(s.top1, 1.0);

  const GenerateRequest req = greedy_request(g);
  EXPECT_EQ(generate(*e, req).tokens, g.greedy);
}

TEST_P(Goldens, QuantizedModesStayClose) {
  const Golden g = load_golden(GetParam());
  for (const KldBounds& b : kKldBounds) {
    auto e = load(g, b.dt, std::nullopt);
    const Stats s = compare(g, teacher_forced(*e, g, 16));
    std::printf("[golden] %-12s %-20s max|dlogit|=%.2e mean_kld=%.2e max_kld=%.2e top1=%.3f decisions %d/%d\n", g.name.c_str(),
                std::string(kv_cache_dtype_name(b.dt)).c_str(), s.max_abs, s.mean_kld, s.max_kld, s.top1,
                s.decisions_checked - s.decisions_failed, s.decisions_checked);
    const auto [mean_bound, max_bound] = kld_bounds(b, g.name, g.meta);
    EXPECT_LT(s.mean_kld, mean_bound) << kv_cache_dtype_name(b.dt);
    EXPECT_LT(s.max_kld, max_bound) << kv_cache_dtype_name(b.dt);
    EXPECT_EQ(s.decisions_failed, 0) << kv_cache_dtype_name(b.dt);
  }
}

TEST_P(Goldens, TensorParallelMatchesOneRank) {
  const Golden g = load_golden(GetParam());
  const ModelConfig cfg = LoadedModel::load(ModelOptions{.model_dir = g.model_dir})->config();
  int sizes = 0;
  for (const int n : {2, 4, 8}) {
    try {
      tp_layout(cfg, n);
    } catch (const Error&) {
      continue;  // a size that does not split this model (tested in test_tensor_parallel)
    }
    ++sizes;
    for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8E4M3, KVCacheDType::Fp8PerTokenHead,
                                  KVCacheDType::Int8PerTokenHead}) {
      auto one_rank = load(g, dt, DType::F32);
      const auto one = teacher_forced(*one_rank, g, 7);
      auto e = load(g, dt, DType::F32, n);
      ASSERT_EQ(e->tensor_parallel_size(), n);
      const auto got = teacher_forced(*e, g, 7);
      ASSERT_EQ(got.size(), one.size());
      double max_abs = 0, scale = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        max_abs = std::max(max_abs, double(std::fabs(got[i] - one[i])));
        scale = std::max(scale, double(std::fabs(one[i])));
      }
      std::printf("[golden] %-12s tp=%d %-20s max|dlogit| vs one rank=%.2e (max|logit| %.1f)\n", g.name.c_str(), n,
                  std::string(kv_cache_dtype_name(dt)).c_str(), max_abs, scale);
      // The ranks sum o/down partial products in another order than one rank: fp32 rounding,
      // ~1e-6 relative, grown through the layers (measured ≤ 2.9e-5 with max|logit| 19). The
      // hybrid MoE goldens amplify such noise (FP32MatchesTransformers): there the bound is 4x
      // one rank's own spread between chunkings, a change of summation order as this is. A
      // quantized cache rounds K/V computed from those sums, and a value on a rounding edge
      // may land on the other code (measured up to 2.4e-2): there the run must stay as close
      // to transformers as one rank does, by the mode's bounds.
      if (dt == KVCacheDType::Auto) {
        double spread = 0;
        for (int chunk : {1, int(g.prompt.size() + g.greedy.size())}) {
          const auto other = teacher_forced(*one_rank, g, chunk);
          for (size_t i = 0; i < one.size(); ++i) spread = std::max(spread, double(std::fabs(other[i] - one[i])));
        }
        EXPECT_LT(max_abs, std::max(4e-6 * std::max(1.0, scale), 4 * spread)) << "one rank's chunking spread " << spread;
      } else {
        const Stats st = compare(g, got);
        const auto [mean_bound, max_bound] = kld_bounds(dt, g.name, g.meta);
        EXPECT_LT(st.mean_kld, mean_bound) << kv_cache_dtype_name(dt);
        EXPECT_LT(st.max_kld, max_bound) << kv_cache_dtype_name(dt);
        EXPECT_EQ(st.decisions_failed, 0) << kv_cache_dtype_name(dt);
      }
      if (dt == KVCacheDType::Auto) {
        const GenerateRequest req = greedy_request(g);
        EXPECT_EQ(generate(*e, req).tokens, g.greedy);
      }
    }
  }
  EXPECT_GT(sizes, 0) << "no tensor-parallel size splits " << g.name;
}

INSTANTIATE_TEST_SUITE_P(HF, Goldens, ::testing::ValuesIn(golden_names()), [](const auto& info) {
  std::string n = info.param;
  for (char& c : n)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
});

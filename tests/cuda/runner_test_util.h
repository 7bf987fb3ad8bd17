// What the CUDA runner tests share: the transformers goldens (tests/golden), loading a
// checkpoint on a device with a KV format and compute dtype, teacher-forced logits and their
// comparison (largest difference, KL divergence, greedy decisions the margin allows).
#pragma once

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda_test_util.h"
#include "io/safetensors.h"
#include "model/cuda/cuda_runner.h"
#include "model/loaded_model.h"
#include "offline/score.h"

namespace kvlm::test {

struct Golden {
  std::string name;
  std::filesystem::path model_dir;
  std::vector<TokenId> prompt, greedy;
  std::vector<float> logits;  // [T][V]
  int vocab = 0;
  nlohmann::json meta;
};

inline std::filesystem::path golden_dir() { return test::repo_root() / "tests" / "golden"; }

// The goldens' names (tests/golden/expected/*.json), sorted.
inline std::vector<std::string> golden_names() {
  std::vector<std::string> out;
  const std::filesystem::path dir = golden_dir() / "expected";
  if (!std::filesystem::exists(dir)) return out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().extension() == ".json") out.push_back(e.path().stem().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Every KV cache mode the runners take.
inline constexpr KVCacheDType kModes[] = {KVCacheDType::Auto,           KVCacheDType::BFloat16,        KVCacheDType::Float16,
                                          KVCacheDType::Fp8E4M3,        KVCacheDType::Fp8E5M2,         KVCacheDType::Fp8PerTokenHead,
                                          KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead};

// The models and KV modes a reduced run (test::reduced()) keeps.
inline bool reduced_model(const std::string& name) { return name == "qwen3-mixed" || name == "llama-mqa-hd"; }
inline bool reduced_mode(KVCacheDType dt) {
  return dt == KVCacheDType::Auto || dt == KVCacheDType::Fp8E4M3 || dt == KVCacheDType::Fp8PerTokenHead;
}

inline Golden load_golden(const std::string& name) {
  Golden g;
  g.name = name;
  std::ifstream in(golden_dir() / "expected" / (name + ".json"));
  g.meta = nlohmann::json::parse(in);
  const auto& meta = g.meta;
  g.prompt = meta["prompt_ids"].get<std::vector<TokenId>>();
  g.greedy = meta["greedy_ids"].get<std::vector<TokenId>>();
  g.model_dir = name == "stories260K" ? test::repo_root() / "models" / "stories260K" : golden_dir() / "models" / name;
  SafetensorsFile f(golden_dir() / "expected" / (name + ".logits.safetensors"));
  const TensorInfo* t = f.find("logits");
  g.vocab = int(t->shape[1]);
  g.logits.resize(size_t(t->numel()));
  convert_to_f32(t->dtype, f.view(*t).bytes, g.logits);
  return g;
}

inline std::unique_ptr<LoadedModel> load(const std::filesystem::path& dir, KVCacheDType dt, Device dev, std::optional<DType> dtype = std::nullopt,
                             int block_size = 16, int keep_sink = 0, int keep_recent = 0) {
  ModelOptions o;
  o.model_dir = dir;
  o.cache.kv_cache_dtype = dt;
  o.cache.block_size = block_size;
  o.cache.keep_sink = keep_sink;
  o.cache.keep_recent = keep_recent;
  o.device = dev;
  o.dtype = dtype;
  return LoadedModel::load(o);
}

inline CudaModelRunner& cuda_of(LoadedModel& e) {
  auto* r = dynamic_cast<CudaModelRunner*>(&e.model());
  if (!r) throw std::runtime_error("not a CUDA runner");
  return *r;
}

// Teacher-forced logits over `tokens`, prefilled in chunks of `chunk`.
inline std::vector<float> teacher_forced(LoadedModel& e, const std::vector<TokenId>& all, int chunk) {
  return all_logits(e, all, chunk);
}

struct Stats {
  double max_abs = 0, scale = 0, mean_kld = 0, max_kld = 0;
  std::vector<double> row_err;
  int decisions_checked = 0, decisions_failed = 0;
};

// `ref` vs `got`, [T][V] each. Decisions are checked on rows >= first_decision.
inline Stats compare(const std::vector<float>& ref, const std::vector<float>& got, int V, size_t first_decision = 0) {
  Stats s;
  const size_t T = ref.size() / size_t(V);
  for (size_t t = 0; t < T; ++t) {
    const float* a = ref.data() + t * size_t(V);
    const float* b = got.data() + t * size_t(V);
    double err = 0, ma = -1e30, mb = -1e30;
    for (int i = 0; i < V; ++i) {
      err = std::max(err, std::isnan(b[i]) ? 1e30 : std::fabs(double(a[i]) - b[i]));
      ma = std::max(ma, double(a[i]));
      mb = std::max(mb, double(b[i]));
      s.scale = std::max(s.scale, std::fabs(double(a[i])));
    }
    s.row_err.push_back(err);
    s.max_abs = std::max(s.max_abs, err);
    double za = 0, zb = 0;
    for (int i = 0; i < V; ++i) {
      za += std::exp(a[i] - ma);
      zb += std::exp(b[i] - mb);
    }
    double kld = 0;
    for (int i = 0; i < V; ++i) {
      const double lpa = a[i] - ma - std::log(za), lpb = b[i] - mb - std::log(zb);
      kld += std::exp(lpa) * (lpa - lpb);
    }
    s.mean_kld += kld / double(T);
    s.max_kld = std::max(s.max_kld, kld);
    if (t < first_decision) continue;
    int ia = 0, ib = 0;
    for (int i = 1; i < V; ++i) {
      if (a[i] > a[ia]) ia = i;
      if (b[i] > b[ib]) ib = i;
    }
    double second = -1e30;
    for (int i = 0; i < V; ++i)
      if (i != ia) second = std::max(second, double(a[i]));
    if (a[ia] - second > 2 * err) {
      ++s.decisions_checked;
      s.decisions_failed += ia != ib;
    }
  }
  return s;
}

}  // namespace kvlm::test

// LoadedModel: a loaded model ready to run — config, per-layer KV plan with a backend chosen
// for every layer, and weights. plan_model() is the weight-free part, shared with
// `kvlm inspect`, so what inspect prints is exactly what generate runs.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "attention/selector.h"
#include "config/cache_config.h"
#include "config/kv_plan.h"
#include "config/model_config.h"
#include "io/checkpoint.h"
#include "model/cpu/cpu_runner.h"

namespace kvlm {

enum class DeviceRequest { Auto, Cpu, Cuda };
DeviceRequest parse_device(std::string_view s);  // throws with the valid values
// The device a request maps to on this machine and build; throws when it cannot be met.
Device resolve_device(DeviceRequest r);

struct ModelPlan {
  ModelConfig config;
  DType dtype = DType::BF16;
  KVPlan plan;
};

// config.json + checkpoint headers -> per-layer KV plan with backends assigned.
// Warnings of the plan are returned in plan.warnings, not printed.
// `dtype` overrides the model's dtype (--dtype), which `auto` KV caches follow.
ModelPlan plan_model(const std::filesystem::path& dir, const Checkpoint& ckpt, const CacheConfig& cache,
                     const SelectionContext& ctx, std::optional<DType> dtype = std::nullopt);

// Parses --dtype: auto (nullopt), float32, bfloat16, float16. Throws with the valid values.
std::optional<DType> parse_model_dtype(std::string_view s);

struct ModelOptions {
  std::filesystem::path model_dir;
  CacheConfig cache;
  Device device = Device::Cpu;
  std::optional<DType> dtype;  // --dtype; nullopt = the checkpoint's
  bool enforce_eager = false;  // --enforce-eager: no CUDA graphs
  int gpu = 0;                 // the CUDA device index the runner lives on
};

class LoadedModel {
 public:
  static std::unique_ptr<LoadedModel> load(const ModelOptions& opts);

  const ModelConfig& config() const { return plan_->config; }
  const KVPlan& plan() const { return plan_->plan; }
  DType dtype() const { return plan_->dtype; }
  int block_size() const { return block_size_; }
  ModelRunner& model() { return *model_; }
  const ModelRunner& model() const { return *model_; }
  // Puts `wrap(current runner)` in its place (tests: a runner that decorates the real one).
  template <class F>
  void wrap_model(F&& wrap) {
    model_ = wrap(std::move(model_));
  }

 private:
  std::unique_ptr<ModelPlan> plan_;  // heap: the model and caches point into it
  std::unique_ptr<ModelRunner> model_;
  int block_size_ = 16;
};

}  // namespace kvlm

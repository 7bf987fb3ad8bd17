#include "model/loaded_model.h"

#include <algorithm>

#include "attention/registry.h"
#include "attention/selector.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#ifdef KVLM_WITH_CUDA
#include "model/cuda/cuda_runner.h"
#endif

namespace kvlm {

DeviceRequest parse_device(std::string_view s) {
  if (s == "auto") return DeviceRequest::Auto;
  if (s == "cpu") return DeviceRequest::Cpu;
  if (s == "cuda") return DeviceRequest::Cuda;
  throw Error("invalid --device '" + std::string(s) + "'; valid values are: auto, cpu, cuda");
}

Device resolve_device(DeviceRequest r) {
  if (r == DeviceRequest::Cpu) return Device::Cpu;
  if (r == DeviceRequest::Auto) {
    // The GPU (device 0, the one the CUDA runner uses) when a CUDA backend has code for it:
    // at or above its minimum compute capability and, where it declares tiers, inside one
    // (a build for sm_90a only has nothing a 10.0 GPU can run).
    const auto gpus = cuda_devices();
    if (gpus.empty()) return Device::Cpu;
    const int cc = gpus.front().compute_capability;
    for (const auto& b : builtin_backend_caps())
      if (b.device == Device::Cuda && cc >= b.min_compute_capability &&
          (b.compute_tiers.empty() || find_compute_tier(b, cc) != nullptr))
        return Device::Cuda;
    return Device::Cpu;
  }
  if (!built_with_cuda()) throw Error("--device cuda: this kvlm was built without CUDA (KVLM_CUDA=OFF); use --device cpu");
  if (cuda_devices().empty())
    throw Error("--device cuda: no usable CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES); use --device cpu");
  return Device::Cuda;
}

std::optional<DType> parse_model_dtype(std::string_view s) {
  if (s == "auto") return std::nullopt;
  if (s == "float32") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16") return DType::F16;
  throw Error("invalid --dtype '" + std::string(s) + "'; valid values are: auto, float32, bfloat16, float16");
}

ModelPlan plan_model(const std::filesystem::path& dir, const Checkpoint& ckpt, const CacheConfig& cache,
                     const SelectionContext& ctx, std::optional<DType> dtype) {
  ModelPlan mp;
  mp.config = load_model_config(dir);
  mp.dtype = dtype ? *dtype : model_dtype(mp.config, ckpt);
  // The CUDA runner computes in bfloat16 or float16: a float32 checkpoint is converted to
  // bfloat16 (and says so); an explicit --dtype float32 cannot be honoured there.
  bool converted = false;
  if (ctx.device == Device::Cuda && mp.dtype == DType::F32) {
    if (dtype)
      throw Error("--dtype float32 is not supported with --device cuda: the CUDA runner computes in bfloat16 or "
                  "float16 (fp32 accumulation); use --dtype bfloat16 or float16, or --device cpu for float32");
    mp.dtype = DType::BF16;
    converted = true;
  }
  const auto layers = attention_layers(mp.config);
  mp.plan = build_kv_plan(cache, layers, mp.dtype, mp.config.kv_scheme,
                          [&](const AttentionLayerDesc& l) { return find_kv_scales(ckpt, l); });
  if (converted)
    mp.plan.warnings.push_back("the checkpoint is float32; on CUDA kvlm computes in bfloat16 (weights converted at load). "
                               "Pass --dtype float16 for float16, or --device cpu to compute in float32");
  SelectionContext c = ctx;
  if (c.device == Device::Cuda && c.compute_capability == 0)
    if (const auto gpus = cuda_devices(); !gpus.empty()) c.compute_capability = gpus.front().compute_capability;
  assign_backends(mp.plan, builtin_backend_caps(), c);
  return mp;
}

std::unique_ptr<LoadedModel> LoadedModel::load(const ModelOptions& opts) {
  validate_block_size(opts.cache.block_size);
  auto e = std::unique_ptr<LoadedModel>(new LoadedModel());
  const Checkpoint ckpt = Checkpoint::open(opts.model_dir);
  SelectionContext ctx{.device = opts.device, .compute_capability = 0, .forced = opts.cache.attention_backend};
  e->plan_ = std::make_unique<ModelPlan>(plan_model(opts.model_dir, ckpt, opts.cache, ctx, opts.dtype));
  for (const auto& w : e->plan_->plan.warnings) log::warn(w);
  if (opts.device == Device::Cuda) {
#ifdef KVLM_WITH_CUDA
    e->model_ = std::make_unique<CudaModelRunner>(e->plan_->config, ckpt, e->plan_->plan, e->plan_->dtype,
                                                  CudaRunnerOptions{.device = opts.gpu, .cuda_graphs = !opts.enforce_eager});
#else
    throw Error("--device cuda: this kvlm was built without CUDA (KVLM_CUDA=OFF); use --device cpu");
#endif
  } else {
    std::vector<const AttentionBackend*> backends;
    for (const auto& l : e->plan_->plan.layers) backends.push_back(&backend_by_name(l.backend));
    e->model_ = std::make_unique<CpuModelRunner>(e->plan_->config, ckpt, e->plan_->plan, std::move(backends));
  }
  e->block_size_ = opts.cache.block_size;
  return e;
}

}  // namespace kvlm

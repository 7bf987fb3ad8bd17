#include "engine/engine.h"

#include "attention/registry.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"

namespace kvlm {

DeviceRequest parse_device(std::string_view s) {
  if (s == "auto") return DeviceRequest::Auto;
  if (s == "cpu") return DeviceRequest::Cpu;
  if (s == "cuda") return DeviceRequest::Cuda;
  throw Error("invalid --device '" + std::string(s) + "'; valid values are: auto, cpu, cuda");
}

Device resolve_device(DeviceRequest r) {
  bool cuda_backend = false;
  for (const auto& b : builtin_backend_caps()) cuda_backend |= b.device == Device::Cuda;
  if (r == DeviceRequest::Cpu) return Device::Cpu;
  if (r == DeviceRequest::Auto) return cuda_backend && !cuda_devices().empty() ? Device::Cuda : Device::Cpu;
  if (!built_with_cuda()) throw Error("--device cuda: this kvlm was built without CUDA (KVLM_CUDA=OFF); use --device cpu");
  const auto gpus = cuda_devices();
  if (gpus.empty()) throw Error("--device cuda: no usable CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES); use --device cpu");
  if (!cuda_backend)
    throw Error("--device cuda: found " + gpus.front().name +
                ", but this release has no CUDA model runner yet (it is being built); use --device cpu");
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
  const auto layers = attention_layers(mp.config);
  mp.plan = build_kv_plan(cache, layers, mp.dtype, mp.config.kv_scheme,
                          [&](const AttentionLayerDesc& l) { return find_kv_scales(ckpt, l); });
  assign_backends(mp.plan, builtin_backend_caps(), ctx);
  return mp;
}

std::unique_ptr<Engine> Engine::load(const EngineOptions& opts) {
  validate_block_size(opts.cache.block_size);
  auto e = std::unique_ptr<Engine>(new Engine());
  const Checkpoint ckpt = Checkpoint::open(opts.model_dir);
  SelectionContext ctx{.device = opts.device, .compute_capability = 0, .forced = opts.cache.attention_backend};
  e->plan_ = std::make_unique<ModelPlan>(plan_model(opts.model_dir, ckpt, opts.cache, ctx, opts.dtype));
  for (const auto& w : e->plan_->plan.warnings) log::warn(w);
  std::vector<const AttentionBackend*> backends;
  for (const auto& l : e->plan_->plan.layers) backends.push_back(&backend_by_name(l.backend));
  e->model_ = std::make_unique<DecoderModel>(e->plan_->config, ckpt, e->plan_->plan, std::move(backends));
  e->block_size_ = opts.cache.block_size;
  return e;
}

}  // namespace kvlm

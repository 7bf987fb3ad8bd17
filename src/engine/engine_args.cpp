#include "engine/engine_args.h"

#include <algorithm>

#include "config/speculative_config.h"
#include "config/weight_quant.h"
#include "core/error.h"

namespace kvlm {

std::string arg_name(ArgStyle style, std::string_view dashed) {
  std::string s(dashed);
  if (style == ArgStyle::Flag) return "--" + s;
  std::ranges::replace(s, '-', '_');
  return s;
}

CacheConfig ModelArgs::cache_config(ArgStyle style) const {
  CacheConfig c;
  c.set_kv_dtypes(parse_kv_cache_dtypes(kv_cache_dtype, arg_name(style, "kv-cache-dtype")));
  if (!cache_type_k.empty() || !cache_type_v.empty()) {
    const std::string k_name = arg_name(style, "cache-type-k"), v_name = arg_name(style, "cache-type-v");
    if (kv_cache_dtype != "auto")
      throw Error(k_name + " / " + v_name + " set K's and V's dtypes; give them or " + arg_name(style, "kv-cache-dtype") +
                  " (which takes k=A,v=B too), not both");
    // A side not given keeps the default (auto), as in llama.cpp.
    c.kv_cache_dtype = cache_type_k.empty() ? KVCacheDType::Auto : parse_kv_cache_dtype(cache_type_k, k_name);
    c.v_cache_dtype = cache_type_v.empty() ? KVCacheDType::Auto : parse_kv_cache_dtype(cache_type_v, v_name);
  }
  c.skip_layers = parse_skip_layers(kv_cache_dtype_skip_layers);
  if (!kv_cache_plan.empty()) c.plan_file = load_kv_plan_file(kv_cache_plan);
  c.rotation = parse_kv_rotation(kv_cache_rotation);
  validate_keep_tokens(kv_cache_keep_sink, arg_name(style, "kv-cache-keep-sink"));
  validate_keep_tokens(kv_cache_keep_recent, arg_name(style, "kv-cache-keep-recent"));
  c.keep_sink = kv_cache_keep_sink;
  c.keep_recent = kv_cache_keep_recent;
  validate_block_size(block_size);
  c.block_size = block_size;
  if (!attention_backend.empty()) c.attention_backend = attention_backend;
  c.linear_state_dtype = parse_linear_state_dtype(mamba_ssm_cache_dtype, arg_name(style, "mamba-ssm-cache-dtype"));
  return c;
}

ModelOptions ModelArgs::model_options(const std::filesystem::path& dir, ArgStyle style) const {
  ModelOptions o;
  o.model_dir = dir;
  o.cache = cache_config(style);
  const DeviceChoice d = resolve_device(device);
  o.device = d.device;
  o.gpu = d.gpu;
  o.dtype = parse_model_dtype(dtype);
  o.enforce_eager = enforce_eager;
  o.dequantize_weights = dequantize_weights;
  resolve_weight_quant(std::nullopt, quantization);  // an unknown method fails here, not after loading
  o.quantization = quantization;
  o.runner = runner;
  if (tensor_parallel_size < 1)
    throw Error(arg_name(style, "tensor-parallel-size") + " must be at least 1, got " + std::to_string(tensor_parallel_size));
  o.tensor_parallel_size = tensor_parallel_size;
  o.expert_parallel = enable_expert_parallel;
  if (!speculative_config.empty()) o.speculative = parse_speculative_config(speculative_config);
  return o;
}

MemoryOptions ServingArgs::memory_options(ArgStyle style) const {
  MemoryOptions m;
  if (!kv_cache_memory.empty()) m.kv_cache_memory = parse_byte_size(kv_cache_memory);
  m.gpu_memory_utilization = gpu_memory_utilization;
  const auto at_least = [&](int v, int lo, const char* name) {
    if (v < lo)
      throw Error(arg_name(style, name) + " must be " + (lo == 0 ? "positive" : "at least " + std::to_string(lo)) +
                  ", got " + std::to_string(v));
  };
  at_least(max_model_len, 0, "max-model-len");
  at_least(max_num_seqs, 1, "max-num-seqs");
  at_least(max_num_batched_tokens, 1, "max-num-batched-tokens");
  m.max_model_len = max_model_len;
  m.max_num_seqs = max_num_seqs;
  m.max_num_batched_tokens = max_num_batched_tokens;
  m.prefix_caching = enable_prefix_caching;
  if (!(kv_offload_gib >= 0 && kv_offload_gib < 1e6))
    throw Error(arg_name(style, "kv-offload-gib") + " must be a size in GiB, 0 or more, got " + std::to_string(kv_offload_gib));
  m.kv_offload_bytes = uint64_t(kv_offload_gib * double(1ull << 30));
  if (!(kv_offload_disk_gib >= 0 && kv_offload_disk_gib < 1e9))
    throw Error(arg_name(style, "kv-offload-disk-gib") + " must be a size in GiB, 0 or more, got " +
                std::to_string(kv_offload_disk_gib));
  if (kv_offload_dir.empty() != (kv_offload_disk_gib == 0))
    throw Error(kv_offload_dir.empty()
                    ? arg_name(style, "kv-offload-disk-gib") + " sizes the disk tier of " + arg_name(style, "kv-offload-dir") +
                          ": give the directory too"
                    : arg_name(style, "kv-offload-dir") + " needs " + arg_name(style, "kv-offload-disk-gib") +
                          ": how much of the disk the tier may use");
  if (!kv_offload_dir.empty() && kv_offload_gib == 0)
    throw Error(arg_name(style, "kv-offload-dir") + ": pages reach the disk tier through the host tier; give " +
                arg_name(style, "kv-offload-gib") + " too (a few GiB is enough)");
  m.kv_offload_disk_bytes = uint64_t(kv_offload_disk_gib * double(1ull << 30));
  if (scheduling_policy != "fcfs" && scheduling_policy != "priority")
    throw Error(arg_name(style, "scheduling-policy") + " must be fcfs or priority, got '" + scheduling_policy + "'");
  return m;
}

SchedulerConfig ServingArgs::scheduler_config(const MemoryPlan& plan) const {
  SchedulerConfig c;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = plan.max_model_len;
  c.enable_prefix_caching = enable_prefix_caching;
  c.num_blocks = plan.num_blocks;
  c.state_snapshots = plan.state_snapshots;
  c.kv_offload_pages = plan.offload_pages;
  c.kv_offload_dir = kv_offload_dir;
  c.kv_offload_disk_bytes = plan.offload_disk_bytes;
  c.kv_offload_exact_pages = plan.offload_exact_pages;
  c.kv_offload_exact_disk_bytes = plan.offload_exact_disk_bytes;
  c.priority = scheduling_policy == "priority";
  return c;
}

}  // namespace kvlm

// What loads a model and shapes its serving engine, by vLLM's names, with kvlm's defaults in
// this one place (vLLM's EngineArgs): the CLI's flags (app/cli_common.h, commands.h) and the
// Python package's LLM(...) keywords (python/src/core.cpp) fill these, and both resolve them
// here, so a default or a check cannot differ between the two.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "kv/cache_config.h"
#include "engine/memory_plan.h"
#include "engine/scheduler.h"
#include "model/loaded_model.h"

namespace kvlm {

// How an error names an option: "--kv-cache-keep-sink" on the command line,
// "kv_cache_keep_sink" in Python.
enum class ArgStyle { Flag, Keyword };
std::string arg_name(ArgStyle style, std::string_view dashed);

struct ModelArgs {
  std::string kv_cache_dtype = "auto";  // one dtype, or K and V apart: "k=A,v=B"
  std::string cache_type_k, cache_type_v;  // llama.cpp's names for K's and V's dtypes ("": not given)
  std::string kv_cache_plan;  // a plan file's path ("": none)
  std::string kv_cache_rotation = "auto";
  int kv_cache_keep_sink = 0;
  int kv_cache_keep_recent = 0;
  std::string kv_cache_dtype_skip_layers;
  std::string attention_backend;
  std::string device = "auto";
  std::string dtype = "auto";
  std::string quantization;       // "" or fp8
  bool dequantize_weights = false;  // GGUF: dequantize the blocks at load (the old path)
  int block_size = 16;
  bool enforce_eager = false;
  int tensor_parallel_size = 1;
  bool enable_expert_parallel = false;
  std::string speculative_config;  // JSON; empty: no drafting
  std::string runner = "auto";     // auto | generate | pooling
  std::string mamba_ssm_cache_dtype = "auto";  // auto | float32 | bfloat16 (hybrid models' recurrent state)

  // Parsed and validated; throws kvlm::Error naming the option as `style` writes it.
  CacheConfig cache_config(ArgStyle style) const;
  // The model in `dir` with these options (device resolved); the caller adds what is its own
  // (several processes on the CLI).
  ModelOptions model_options(const std::filesystem::path& dir, ArgStyle style) const;
};

struct ServingArgs {
  int max_model_len = 0;  // 0 = the model's context
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;
  bool enable_prefix_caching = true;
  std::string kv_cache_memory;  // bytes, e.g. 2GiB; empty = the planner's default
  double gpu_memory_utilization = 0.9;
  std::string scheduling_policy = "fcfs";  // fcfs | priority
  double kv_offload_gib = 0;  // the prefix cache's host tier (engine/host_kv_tier.h); 0 = none
  std::string kv_offload_dir;    // its disk tier (engine/disk_kv_tier.h); "" = none
  double kv_offload_disk_gib = 0;

  MemoryOptions memory_options(ArgStyle style) const;  // parses and validates; throws kvlm::Error
  SchedulerConfig scheduler_config(const MemoryPlan& plan) const;
};

}  // namespace kvlm

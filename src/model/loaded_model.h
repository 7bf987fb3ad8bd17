// LoadedModel: a loaded model ready to run — config, per-layer KV plan with a backend chosen
// for every layer, and weights. plan_model() is the weight-free part, shared with
// `kvlm inspect`, so what inspect prints is exactly what generate runs.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "attention/selector.h"
#include "kv/cache_config.h"
#include "kv/kv_plan.h"
#include "config/model_config.h"
#include "config/pooling_config.h"
#include "config/speculative_config.h"
#include "io/checkpoint.h"
#include "model/communicator.h"
#include "model/distributed.h"
#include "model/cpu/cpu_runner.h"

namespace kvlm {

// Where --device puts the model: the CPU, or one GPU by its index among the visible ones.
struct DeviceChoice {
  Device device = Device::Cpu;
  int gpu = 0;  // CUDA device index (Device::Cuda)
};
// Parses and resolves --device: auto (the first GPU when a CUDA backend can run on it, else
// the CPU), cpu, cuda (GPU 0) or cuda:N. Throws with the valid values, or when the choice
// cannot be met on this machine and build.
DeviceChoice resolve_device(std::string_view flag);

struct ModelPlan {
  ModelConfig config;
  DType dtype = DType::BF16;
  KVPlan plan;  // the target's layers, then a drafter's (model "draft")
  // A DFlash drafter (--speculative-config method dflash), checked against the target.
  std::optional<ModelConfig> drafter;
  std::filesystem::path drafter_dir;
  std::string drafter_prefix;  // its tensors' name prefix ("" or "model.")
  // The checkpoint's k/v scale tensors of the target's attention layers (by KV layer), so that
  // the plan can be built again without the checkpoint (LoadedModel::replan_kv).
  struct LayerScales {
    int layer = 0;  // the attention layer's index in the model
    std::optional<CheckpointScales> scales;
    std::string error;  // why they could not be read (thrown when a plan asks for them)
  };
  std::vector<LayerScales> kv_scales;
};

// config.json + checkpoint headers -> per-layer KV plan with backends assigned.
// Warnings of the plan are returned in plan.warnings, not printed.
// `dtype` overrides the model's dtype (--dtype), which `auto` KV caches follow.
// With a DFlash `spec`, the drafter is opened, checked against the target (hidden size,
// vocabulary, layer ids, block size) and its layers join the plan: the spec's
// kv_cache_dtype when given, else the target's cache options (an index in
// --kv-cache-dtype-skip-layers names a target layer; the sliding_window rule applies to
// every model, and a drafter has no sliding layers).
// `quantization` is --quantization ("" or "fp8": resolve_weight_quant), which sets
// config.weight_quant.
ModelPlan plan_model(const std::filesystem::path& dir, const Checkpoint& ckpt, const CacheConfig& cache,
                     const SelectionContext& ctx, std::optional<DType> dtype = std::nullopt,
                     const SpeculativeConfig* spec = nullptr, std::string_view quantization = {});

// The backend selection context of `device` (the compute capability of GPU `gpu`).
SelectionContext selection_context(Device device, int gpu, const CacheConfig& cache);

// Parses --dtype: auto (nullopt), float32, bfloat16, float16. Throws with the valid values.
std::optional<DType> parse_model_dtype(std::string_view s);

struct ModelOptions {
  std::filesystem::path model_dir;
  CacheConfig cache;
  Device device = Device::Cpu;
  std::optional<DType> dtype;  // --dtype; nullopt = the checkpoint's
  bool enforce_eager = false;  // --enforce-eager: no CUDA graphs
  int gpu = 0;                 // the CUDA device index the runner lives on (--device cuda:N)
  std::optional<SpeculativeConfig> speculative;  // --speculative-config
  std::string quantization;    // --quantization: "" or "fp8" (quantize 16-bit linear weights at load)
  // --dequantize-weights: a GGUF file's quantized matrices are dequantized at load (fp32 on the
  // CPU, the compute dtype on CUDA) instead of staying in their blocks (CUDA: grouped codes).
  bool dequantize_weights = false;
  // --tensor-parallel-size: ranks (GPUs gpu, gpu + 1, ...; on the CPU, threads) that each hold
  // a slice of every layer (model/tensor_parallel.h).
  int tensor_parallel_size = 1;
  // --enable-expert-parallel: a mixture of experts splits whole experts over the ranks.
  bool expert_parallel = false;
  // Several processes (model/distributed.h): this process is node dist.node_rank of
  // dist.nnodes, driving tensor_parallel_size / nnodes ranks.
  DistConfig dist;
  // --runner, as vLLM's: generate (next-token logits), pooling (an embedding model: the
  // runner hands back final hidden states, ModelRunner::set_pooling), or auto — pooling when
  // the directory holds sentence-transformers' modules.json, else generate.
  std::string runner = "auto";
};

// Resolves --runner for `dir`: the pooling configuration when the model runs as an embedding
// model, nullopt when it generates. Throws with the valid values.
std::optional<PoolingConfig> resolve_runner(std::string_view runner, const std::filesystem::path& dir);

// --enable-expert-parallel on the model's config; throws when it is not a mixture of experts.
void apply_expert_parallel(ModelConfig& config, bool enabled);

// Checks --tensor-parallel-size against the model and the machine before anything loads:
// the size splits the model (tp_layout), enough GPUs are visible, NCCL is built in, no DFlash
// drafter. Throws kvlm::Error saying what would work.
void check_tensor_parallel(const ModelOptions& opts, const ModelConfig& config);

class LoadedModel {
 public:
  static std::unique_ptr<LoadedModel> load(const ModelOptions& opts);

  const ModelConfig& config() const { return plan_->config; }
  // The whole model's KV plan (every KV head: what inspect shows).
  const KVPlan& plan() const { return plan_->plan; }
  // What one rank holds: the plan of rank 0 under tensor parallelism (its KV heads: the bytes
  // per token each GPU stores), else plan().
  const KVPlan& rank_plan() const { return rank_plans_.empty() ? plan_->plan : *rank_plans_.front(); }
  int tensor_parallel_size() const { return tp_; }
  DType dtype() const { return plan_->dtype; }
  int block_size() const { return block_size_; }
  int gpu() const { return gpu_; }  // the CUDA device index (Device::Cuda runners)
  // The GPUs this process drives: one, or its tensor-parallel ranks' (gpu(), gpu() + 1, ...).
  int num_local_gpus() const { return local_ranks_; }
  // Another node of several processes: runs node 0's commands on its ranks until node 0 stops
  // it (model/distributed.h dist_follow). Returns 0; throws when node 0 goes away.
  int follow();
  // The drafter the serving engine proposes tokens with (--speculative-config), if any.
  const std::optional<SpeculativeConfig>& speculative() const { return speculative_; }
  // The DFlash drafter loaded next to the model (method dflash), if any.
  const std::optional<ModelConfig>& drafter_config() const { return plan_->drafter; }
  // An embedding model (--runner pooling): how its prompts become vectors; nullopt: it generates.
  const std::optional<PoolingConfig>& pooling() const { return pooling_; }
  // Builds the target's KV plan again from `cache` (formats, rotation, exact tokens: a plan
  // file, say) and holds the KV cache in it from the next request on (the runner's pool is
  // reallocated by the next engine). For `kvlm calibrate`'s search: one rank, no drafter, no
  // request running; throws kvlm::Error otherwise (and when a layer would need another backend).
  void replan_kv(const CacheConfig& cache);
  ModelRunner& model() { return *model_; }
  const ModelRunner& model() const { return *model_; }
  // What the bytes of a KV page depend on, as text: the model's and drafter's weight files
  // (name, size, modification time), the compute dtype and weight options, the device, tensor
  // parallelism and every layer's KV format — the root of the names the prefix cache's lower
  // tiers give pages (engine/page_hash.h), so that a page on disk is never read by another
  // model or plan.
  std::string kv_identity() const;
  // Puts `wrap(current runner)` in its place (tests: a runner that decorates the real one).
  template <class F>
  void wrap_model(F&& wrap) {
    model_ = wrap(std::move(model_));
  }

 private:
  void load_tensor_parallel(const ModelOptions& opts, const Checkpoint& ckpt);

  std::unique_ptr<ModelPlan> plan_;  // heap: the model and caches point into it
  std::vector<std::unique_ptr<KVPlan>> rank_plans_;  // tensor parallelism: each rank's plan
  std::unique_ptr<DistLeader> dist_leader_;          // several processes: node 0's connections
  std::unique_ptr<DistSocket> dist_follower_;        // another node's connection to node 0
  std::unique_ptr<CommGroup> group_;                 // tensor parallelism: the ranks' communicators
  std::unique_ptr<DistCommands> dist_commands_;      // node 0: the calls it sends to the others
  std::unique_ptr<ModelRunner> model_;               // after what it points into: destroyed first
  int tp_ = 1;
  int local_ranks_ = 1;
  int block_size_ = 16;
  int gpu_ = 0;
  std::optional<SpeculativeConfig> speculative_;
  std::optional<PoolingConfig> pooling_;
  std::string source_identity_;  // kv_identity's part fixed at load
};

}  // namespace kvlm

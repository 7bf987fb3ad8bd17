// The CUDA model runner: a model definition (model/architecture.h) executed by the CUDA ops
// (cuda_ops.h) on one GPU, with its paged KV pool in device memory. No CUDA header here (a
// stream is a void*); the implementation is cuda_runner.cpp.
//
// Precision: weights are uploaded once in the compute dtype, bfloat16 or float16 (the
// checkpoint's own when it is one of those; a float32 checkpoint is converted to bfloat16
// at load, which plan_model announces with a warning; --dtype float32 is refused on CUDA).
// GEMMs run on cuBLASLt with fp32 accumulation, norms / RoPE / softmax in fp32, the residual
// stream in fp32, attention queries in bf16 (the paged attention kernels' input), logits in
// fp32. K/V are quantized from fp32 straight into each layer's page format.
//
// Memory: one allocation for the weights, one for the KV pool (allocate_kv), one scratch
// arena for a step's activations and metadata that only grows (first use of a larger
// batch), so a steady state calls no cudaMalloc; plus pinned host staging for the step's
// metadata and logits.
//
// Decode steps (every sequence one query token, logits for every row) can run as CUDA
// graphs captured per padded batch size (set_cuda_graphs); see cuda_runner.cpp.
#pragma once

#include <memory>

#include "kv/kv_plan.h"
#include "io/checkpoint.h"
#include "kv/kv_cache.h"
#include "model/architecture.h"
#include "model/communicator.h"
#include "model/model_runner.h"

namespace kvlm {

struct CudaRunnerOptions {
  int device = 0;            // the CUDA device index the runner's memory, stream and kernels live on
  bool cuda_graphs = true;   // decode steps as CUDA graphs (--enforce-eager: off)
  bool small_m_gemv = true;  // the small-m GEMV kernels for m <= 8 (off: cuBLASLt for every m; measurements)
  // GGUF matrices stay quantized on the GPU as grouped integer codes (io/grouped_codes.h) where
  // their block type has a layout (Q4_0 .. Q8_0, Q2_K .. Q6_K) and the GPU has bf16 tensor
  // cores (sm_80+); off (--dequantize-weights): dequantized to the compute dtype at load.
  bool keep_blocks = true;
  // Tensor parallelism (model/tensor_parallel.h): the runner is rank comm->rank() of
  // comm->world_size(), loads that rank's slice of the weights (the constructor's config is
  // the whole model's, its plan the rank's: shard_kv_plan) and all-reduces through `comm`
  // (which must outlive it). A rank other than 0 forms no logits: forward_follower only.
  Communicator* comm = nullptr;
};

class CudaModelRunner final : public ModelRunner {
 public:
  // Uploads every weight the architecture's definition names (checked as on the CPU) to GPU
  // opts.device; every call makes that device current before it touches the GPU. `compute` is DType::BF16 or DType::F16. Every layer of `plan` must have
  // been assigned the "cuda" attention backend; the plan must outlive the runner. Throws
  // kvlm::Error.
  // `drafter` (optional): a DFlash drafter whose layers are the plan's after the target's.
  CudaModelRunner(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan, DType compute,
                  CudaRunnerOptions opts = {}, const DrafterSource* drafter = nullptr);
  ~CudaModelRunner() override;

  const ModelConfig& config() const override { return cfg_; }
  Device device() const override { return Device::Cuda; }
  size_t num_parameters() const override;
  size_t block_tensors() const;
  size_t embedding_bytes() const;  // of the embedding table as held (grouped codes or 16-bit)
  size_t expert_bytes() const;     // of a mixture's stacked expert matrices (WeightSpec::experts) as held
  size_t weight_bytes() const override;

  void allocate_kv(int num_blocks, int block_size, int num_exact_pages = 0) override;
  void kv_plan_changed() override;
  // Gated DeltaNet states (hybrid models): `slots` per linear layer, fp32, zeroed.
  void allocate_states(int slots) override;
  void copy_states(std::span<const StateCopy> copies) override;
  int kv_num_blocks() const override;
  size_t kv_bytes() const override;
  void forward(const ForwardBatch& batch, std::span<float> logits) override;
  void forward_follower(const ForwardBatch& batch) override;
  void copy_blocks(std::span<const PageCopy> copies) override;
  size_t kv_page_bytes(int block_size, PageKind kind = PageKind::Pages) const override;
  void save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out,
                  PageKind kind = PageKind::Pages) override;
  void load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in,
                  PageKind kind = PageKind::Pages) override;
  HostBytes allocate_host(size_t bytes) override;
  void wait_pages() override;
  std::function<void()> page_fence() override;
  PageCopyTimes page_copy_times() override;
  double measure_host_to_device_bandwidth() override;

  // Sampling on the GPU (ops/cuda/sampling.h): only token ids, and the logits of the rows
  // that are not sampled there, cross to the host.
  bool samples_on_device() const override { return true; }
  void forward_sampled(const ForwardBatch& batch, std::span<const RowSampling> rows, std::span<TokenId> tokens,
                       std::span<float> host_logits, const RowMaskFn& mask) override;

  // Optional extension (greedy sampling on the GPU): runs the batch as forward() does and
  // writes, per logit row, the token with the largest logit (ties: the lowest id, as the
  // host Sampler) — only the ids cross to the host, not [rows][vocab] logits.
  void forward_greedy(const ForwardBatch& batch, std::span<TokenId> tokens);
  // The drafter (DFlash): its context pass runs inside every forward (and its CUDA graphs),
  // its blocks eagerly; draft_greedy argmaxes on the GPU.
  bool has_drafter() const override;
  void draft(const ForwardBatch& blocks, std::span<float> logits) override;
  void draft_greedy(const ForwardBatch& blocks, std::span<TokenId> tokens) override;

  DType compute_dtype() const;
  int device_index() const;
  // CUDA graphs for decode steps (CudaRunnerOptions::cuda_graphs at construction). Off:
  // every step launches its kernels one by one.
  void set_cuda_graphs(bool on);
  void set_pooling(bool on) override;
  int num_cuda_graphs() const;  // captured so far
  // The small-m GEMV kernels (CudaRunnerOptions::small_m_gemv at construction).
  void set_small_m_gemv(bool on);
  // Tests: fill the step's scratch (activations, q, attention output, logits) with NaN
  // bytes before each forward, so a kernel that leaves part of its output unwritten shows.
  void set_poison_scratch(bool on);
  // Tests: copies layer `layer`'s device pages into `out` (a host pool of the same plan,
  // num_blocks and block_size).
  void download_kv_layer(size_t layer, LayerKVCache& out) const;

 private:
  // Runs the target's step (and the drafter's context pass), or with `draft` the drafter's
  // blocks; returns the device logits of the logit rows.
  float* enqueue(const ForwardBatch& batch, bool draft = false);
  // Copies the logits of `rows` (indices into the step's logit rows) to `out`, [rows][vocab]
  // — or, given `slots`, rows[i] to out's row slots[i] — and waits for the stream.
  void copy_logit_rows(const float* dev, std::span<const int32_t> rows, std::span<float> out,
                       std::span<const int32_t> slots = {});
  // The argmax of the step's logit rows on the GPU, to `tokens` (one per row); waits.
  void argmax_to_host(const float* dev, std::span<TokenId> tokens);

  struct Impl;
  class WeightUploader;
  ModelConfig cfg_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm

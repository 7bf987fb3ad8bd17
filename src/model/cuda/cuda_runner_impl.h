// The CUDA model runner's state (CudaModelRunner::Impl) and the buffers it holds, shared by
// its sources: cuda_runner.cpp (loading, the KV pool, a step's layout, graphs and forward) and
// cuda_runner_sampling.cpp (what a step hands back: logits, sampled tokens, the drafter's
// passes). Private to them.
#pragma once

#include "model/cuda/cuda_runner.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "attention/selector.h"
#include "kv/cache_config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/numeric.h"
#include "model/architecture.h"
#include "model/cuda/cuda_ops.h"
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/model_ops.h"
#include "ops/cuda/moe.h"
#include "ops/cuda/sampling.h"

namespace kvlm {

namespace cuda_runner_detail {

inline constexpr int kMaxGraphBatch = 256;  // sequences
inline constexpr int kMaxGraphQ = 32;       // rows per sequence
inline constexpr size_t kMaxGraphs = 512;

inline size_t align_up(size_t n) { return Carver::align_up(n); }

inline std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(size_t(1) << 30));
  return buf;
}

inline int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// One device allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void allocate(size_t bytes, const std::string& what) {
    reset();
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
      throw Error("cannot allocate " + gib(bytes) + " of GPU memory for " + what + " (" + gib(free_b) + " free of " +
                  gib(total_b) + "): " + cudaGetErrorString(err));
    }
    bytes_ = bytes;
  }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Pinned host memory that only grows.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* reserve(size_t bytes) {
    if (bytes > bytes_) {
      const size_t want = std::max(bytes, bytes_ * 2);
      if (ptr_) cudaFreeHost(ptr_);
      ptr_ = nullptr;
      bytes_ = 0;
      KVLM_CUDA_CHECK(cudaHostAlloc(&ptr_, want, cudaHostAllocDefault));
      bytes_ = want;
    }
    return static_cast<uint8_t*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The shape of one step (padded, for a graph).
struct StepShape {
  int T = 0, R = 0, S = 0, MB = 1, max_q = 1, max_kv = 1;
};

// Where a step's buffers sit in the scratch arena, as offsets: the metadata (one host ->
// device copy of [0, meta_bytes)), the sampling buffers, then the forward's activations up to
// `total`, among them the logits.
struct StepLayout {
  size_t tokens = 0, positions = 0, slots = 0, cu = 0, kv_lens = 0, tables = 0, logit_rows = 0, meta_bytes = 0;
  size_t exact_slots = 0, exact_tables = 0;  // exact sink / recent tokens (a runner with exact pages)
  size_t state_slots = 0;                    // hybrid models: each sequence's Gated DeltaNet state slot
  size_t ids = 0, sample = 0, ops_begin = 0;
  size_t logits = SIZE_MAX;  // SIZE_MAX: no logit rows
  size_t total = 0;
};

// Makes the runner's device current for the scope of a call, and restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    KVLM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) KVLM_CUDA_CHECK(cudaSetDevice(device));
    switched_ = previous_ != device;
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

}  // namespace cuda_runner_detail

// (one component's private header: its two sources use the helpers unqualified)
using namespace cuda_runner_detail;

struct CudaModelRunner::Impl {
  int device = 0;
  ModelConfig cfg;
  const KVPlan* plan = nullptr;
  DType act = DType::BF16;
  cudaStream_t stream = nullptr;
  cuda::Gemm gemm;
  SingleProcessCommunicator single;
  Communicator* comm = &single;  // a tensor-parallel rank's (CudaRunnerOptions::comm) or the single process's
  std::unique_ptr<ModelDefinition> def;
  size_t state_bytes = 0;  // a Gated DeltaNet layer's state slot on this rank (its key heads)
  std::unique_ptr<DraftDefinition> draft_def;  // a DFlash drafter, if loaded
  std::vector<Weight> draft_w;                 // its weights, then the target's embedding and LM head
  std::unique_ptr<CudaOps> ops;
  DeviceBuffer weights, draft_weights, kv_tensor_scales, gemm_ws, kv, kv_pools, exact_pools, pairs_dev, scratch, exact, states;
  DeviceBuffer page_staging;  // the host tier's packed pages in passing (cuda_runner_pages.cpp)
  int staging_pages(size_t page_bytes);
  struct PageTable {
    const cuda::KVPagePools* layers;
    int num_layers;
    int num_ids;  // valid page ids: [0, num_ids)
  };
  PageTable page_table(PageKind kind) const;
  // The host tier's copies in flight, timed: start and end events of one save_pages or
  // load_pages call, until they complete (cuda_runner_pages.cpp).
  struct CopyTiming {
    cudaEvent_t start = nullptr, end = nullptr;
    bool load = false;
  };
  std::deque<CopyTiming> copy_timings;
  std::vector<cudaEvent_t> spare_events;
  cudaEvent_t take_event();
  void harvest_copies(ModelRunner::PageCopyTimes& t);  // adds the completed copies to t
  template <typename F>
  void timed_copies(ModelRunner::PageCopyTimes& t, bool load, F&& enqueue) {
    harvest_copies(t);
    const cudaEvent_t start = take_event(), end = take_event();
    KVLM_CUDA_CHECK(cudaEventRecord(start, stream));
    enqueue();
    KVLM_CUDA_CHECK(cudaEventRecord(end, stream));
    copy_timings.push_back({.start = start, .end = end, .load = load});
  }
  int state_slots = 0;  // allocate_states
  PinnedBuffer meta_host, logits_host, pairs_host, sample_host;
  std::vector<Weight> w;
  size_t num_params = 0, weight_bytes = 0;
  size_t block_tensors = 0;  // GGUF tensors kept as grouped codes
  bool keep_blocks = true;       // CudaRunnerOptions::keep_blocks
  // The parts of the matrices held as grouped integer codes (Weight::codes points into them).
  std::deque<std::vector<WeightCodes>> weight_codes;
  // The largest FP8 or grouped-code weight: its dequantized copy for GEMMs of m > 16.
  size_t fp8_scratch_elems = 0;
  int fp8_max_cols = 0;          // the largest input size of an FP8 weight (the FP8 GEMM's activations)
  // How the FP8 GEMMs quantize their activations when every FP8 weight kept does it alike (0:
  // per token, 128: per 128-value group, -1: mixed; none: no FP8 weight): CudaOps::set_fp8_scratch.
  std::optional<int> fp8_act_group;
  bool fp8_policy_said = false;  // the startup line about where FP8 weights live, once
  DeviceBuffer fp8_scratch;
  std::vector<CudaKVLayer> lkv;
  int num_blocks = 0, block_size = 0;
  int num_exact = 0;          // exact pages (layers with exact sink / recent tokens)
  int num_exact_layers = 0;   // layers with exact pages: exact_pools' entries
  size_t exact_page_bytes = 0;  // of one layer's K (equally V) exact page, per keeping layer
  size_t kv_bytes = 0;
  bool poison = false;
  TokenId* ids = nullptr;                   // the last step's argmax / sampled ids
  cuda::SampleRowParams* sample = nullptr;  // the last step's per-row sampling parameters
  DeviceBuffer masks;                       // the last step's token masks (forward_sampled's masked rows)
  cudaEvent_t forward_done = nullptr;       // forward_sampled: the forward pass has run
  std::vector<cudaEvent_t> copy_events;     // forward's chunked logits copy
  bool graphs_on = true;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    StepLayout layout;
    uint64_t last_used = 0;
  };
  uint64_t graph_clock = 0;
  // A graph's shape: sequences, rows per sequence (the most), rows, block-table stride, logit
  // rows, and whether it is the drafter's pass.
  using GraphKey = std::tuple<int, int, int, int, int, bool>;
  std::set<GraphKey> graph_seen;      // run once eagerly (forgotten past 4 * kMaxGraphs keys)
  std::map<GraphKey, Graph> graphs;  // captured

  ~Impl() {
    clear_graphs();
    for (cudaEvent_t e : copy_events) cudaEventDestroy(e);
    for (const CopyTiming& t : copy_timings) cudaEventDestroy(t.start), cudaEventDestroy(t.end);
    for (cudaEvent_t e : spare_events) cudaEventDestroy(e);
    if (forward_done) cudaEventDestroy(forward_done);
    if (stream) cudaStreamDestroy(stream);
  }

  // The per-layer KV table (lkv) and the static FP8 scales from *plan (the pages come with
  // allocate_kv).
  void build_kv_layers();
  // Waits for the stream, then frees the KV pool and exact pages (the graphs point into them).
  void drop_kv() {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(stream));
    clear_graphs();
    kv.reset();
    exact.reset();
    num_blocks = block_size = num_exact = num_exact_layers = 0;
    kv_bytes = 0;
  }

  void clear_graphs() {
    for (auto& [k, g] : graphs) cudaGraphExecDestroy(g.exec);
    graphs.clear();
    graph_seen.clear();
  }

  CudaStep device_step(const StepShape& s, const StepLayout& l) const {
    uint8_t* base = scratch.data();
    return CudaStep{.T = s.T, .R = s.R, .S = s.S, .MB = s.MB, .max_q = s.max_q, .max_kv = s.max_kv,
                    .tokens = reinterpret_cast<const TokenId*>(base + l.tokens),
                    .positions = reinterpret_cast<const Position*>(base + l.positions),
                    .slots = reinterpret_cast<const SlotId*>(base + l.slots),
                    .cu_q_lens = reinterpret_cast<const int32_t*>(base + l.cu),
                    .kv_lens = reinterpret_cast<const int32_t*>(base + l.kv_lens),
                    .block_tables = reinterpret_cast<const BlockId*>(base + l.tables),
                    .logit_rows = reinterpret_cast<const int32_t*>(base + l.logit_rows),
                    .exact_slots = num_exact ? reinterpret_cast<const SlotId*>(base + l.exact_slots) : nullptr,
                    .exact_tables = num_exact ? reinterpret_cast<const BlockId*>(base + l.exact_tables) : nullptr,
                    .state_slots = cfg.linear_attention ? reinterpret_cast<const int32_t*>(base + l.state_slots) : nullptr};
  }

  // Measures the step's layout: the metadata, then the forward run by the ops in measuring
  // mode (nothing launched).
  // One pass of the step's ops: the target's forward (then the drafter's context pass over
  // the same rows, from the features the forward captured), or the drafter's blocks.
  Tensor run_pass(bool draft) {
    if (draft) return draft_def->forward(*ops, draft_w);
    const Tensor logits = def->forward(*ops, w);
    if (draft_def) draft_def->context(*ops, draft_w, ops->features());
    return logits;
  }

  StepLayout measure(const StepShape& s, bool draft) {
    StepLayout l;
    Carver c;
    auto take = [&](size_t bytes) { return size_t(reinterpret_cast<uintptr_t>(c.take_bytes(bytes))); };
    l.tokens = take(size_t(s.T) * sizeof(TokenId));
    l.positions = take(size_t(s.T) * sizeof(Position));
    l.slots = take(size_t(s.T) * sizeof(SlotId));
    l.cu = take((size_t(s.S) + 1) * sizeof(int32_t));
    l.kv_lens = take(size_t(s.S) * sizeof(int32_t));
    l.tables = take(size_t(s.S) * size_t(s.MB) * sizeof(BlockId));
    l.logit_rows = take(size_t(std::max(s.R, 1)) * sizeof(int32_t));
    if (num_exact) {
      l.exact_slots = take(size_t(s.T) * sizeof(SlotId));
      l.exact_tables = take(size_t(s.S) * size_t(s.MB) * sizeof(BlockId));
    }
    if (cfg.linear_attention) l.state_slots = take(size_t(s.S) * sizeof(int32_t));
    l.meta_bytes = c.off;
    l.ids = take(size_t(std::max(s.R, 1)) * sizeof(TokenId));
    l.sample = take(size_t(std::max(s.R, 1)) * sizeof(cuda::SampleRowParams));
    l.ops_begin = c.off;
    ops->begin_step(CudaStep{.T = s.T, .R = s.R, .S = s.S, .MB = s.MB, .max_q = s.max_q, .max_kv = s.max_kv}, c,
                    /*measure=*/true);
    const Tensor logits = run_pass(draft);
    if (logits) l.logits = size_t(reinterpret_cast<uintptr_t>(logits.data));
    l.total = ops->arena_end();
    return l;
  }

  // The arena for `l`, grown (never shrunk) when too small; growing drops graphs.
  void reserve_scratch(const StepLayout& l) {
    if (l.total > scratch.bytes()) {
      KVLM_CUDA_CHECK(cudaStreamSynchronize(stream));
      clear_graphs();
      scratch.allocate(std::max(l.total, scratch.bytes() + scratch.bytes() / 2), "activations");
    }
  }

  // Every kernel of a step after the metadata upload: eager or under graph capture.
  void run_forward(const StepShape& s, const StepLayout& l, bool draft) {
    ops->begin_step(device_step(s, l), Carver{reinterpret_cast<uintptr_t>(scratch.data()), l.ops_begin}, false);
    const Tensor logits = run_pass(draft);
    const size_t at = logits ? size_t(static_cast<uint8_t*>(logits.data) - scratch.data()) : SIZE_MAX;
    KVLM_CHECK(at == l.logits, "the forward carved a different layout than it measured");
  }
};

}  // namespace kvlm

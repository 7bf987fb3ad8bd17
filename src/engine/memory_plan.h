// How many KV pages the pool gets, and what that means in tokens and concurrency.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "kv/kv_plan.h"
#include "model/loaded_model.h"

namespace kvlm {

struct MemoryOptions {
  std::optional<uint64_t> kv_cache_memory;  // --kv-cache-memory bytes (CPU and GPU)
  double gpu_memory_utilization = 0.9;      // --gpu-memory-utilization (GPU, fraction of total)
  int max_model_len = 0;                    // 0 = the model's context
  int max_num_seqs = 256;
  int max_num_batched_tokens = 2048;
  bool prefix_caching = true;  // hybrid models: the prefix cache's state snapshots count too
  uint64_t kv_offload_bytes = 0;  // --kv-offload-gib: the prefix cache's host tier (0: none)
  uint64_t kv_offload_disk_bytes = 0;  // --kv-offload-disk-gib: its disk tier (0: none)
};

struct MemoryPlan {
  int num_blocks = 0;
  int num_exact_pages = 0;          // exact sink / recent tokens (exact_pages_needed)
  uint64_t exact_bytes = 0;         // their pool, all keeping layers
  uint64_t state_bytes = 0;         // hybrid models: the Gated DeltaNet states of max_num_seqs sequences and the snapshots
  int state_snapshots = 0;          // hybrid models with prefix caching: snapshots kept (SchedulerConfig::state_snapshots)
  int draft_states = 0;             // hybrid models with drafting: states kept for rejected drafts (SchedulerConfig::draft_states)
  int block_size = 16;
  uint64_t kv_bytes = 0;            // the pool
  uint64_t bytes_per_block = 0;     // all layers
  uint64_t bytes_per_token = 0;     // all layers, per the KV plan
  int64_t capacity_tokens = 0;      // num_blocks * block_size
  int max_model_len = 0;
  double max_concurrency = 0;       // capacity_tokens / max_model_len
  int64_t offload_pages = 0;        // the host tier's pages (engine/host_kv_tier.h), 0 = none
  uint64_t offload_bytes = 0;
  uint64_t offload_disk_bytes = 0;  // the disk tier's (engine/disk_kv_tier.h), 0 = none
  // With exact sink / recent tokens, the tiers' share for exact pages (the pool's share of its
  // bytes; 0 = none: hits end before pages that lost their exact copies), out of the sizes above.
  int64_t offload_exact_pages = 0;
  uint64_t offload_exact_bytes = 0, offload_exact_disk_bytes = 0;
  std::string summary;              // the startup log lines
};

// Exact pages (kv/kv_cache.h) for exact sink / recent tokens, so that every running sequence
// holds its own (sinks, its recent window, the pages its step writes): per sequence the sink
// pages, ceil((recent - 1) / block) + 2 window pages, and a step's max_num_batched_tokens in
// pages on top. 0 when the plan keeps no exact tokens. (Should a load still run the pool dry,
// the scheduler waits or preempts as for KV pages.)
int exact_pages_needed(const KVPlan& plan, int block_size, int max_num_seqs, int max_num_batched_tokens);

// Throws kvlm::Error with what to change when the pool cannot hold one max_model_len
// sequence.
MemoryPlan plan_kv_memory(const LoadedModel& engine, const MemoryOptions& opts);

// Activation memory one step of max_num_batched_tokens rows may take on the GPU, an upper
// estimate (what plan_kv_memory reserves before the KV pool).
uint64_t activation_bytes(const ModelConfig& c, const MemoryOptions& o);

// Parses "4GiB", "512MiB", "2G", "1000000" into bytes; throws with the accepted forms.
uint64_t parse_byte_size(std::string_view s);

}  // namespace kvlm

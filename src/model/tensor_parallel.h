// Tensor parallelism (Megatron-style): how a model splits over `world` ranks, one GPU (or, in
// CPU tests, one thread) each.
//
// Every rank holds the whole residual stream and a slice of every layer: q/k/v and gate/up
// are column-parallel (each rank computes its own heads and its part of the MLP width), o and
// down row-parallel (each rank multiplies its slice of the input and an all-reduce sums the
// partial outputs: two per layer, model/ops.h all_reduce_sum). Attention needs no
// communication: a rank holds the query heads it computes and the KV heads they read, so its
// KV pool holds 1/world of every token (when a model has fewer KV heads than ranks, each KV
// head is held by world / num_kv_heads ranks, as vLLM does). The embedding table is
// replicated (a lookup reads one row per token); the LM head runs on rank 0 only, which is
// the rank that samples, so an untied LM head is loaded there alone. The biases of o and down
// are added once, by rank 0, before the sum.
//
// This file is the arithmetic — which heads, rows and columns rank r holds — and the
// per-rank model config and KV plan; load_weights (model/weights.h) slices the checkpoint's
// tensors with it, and model/tp_runner.h runs the ranks.
#pragma once

#include <cstdint>
#include <string>

#include "kv/kv_plan.h"
#include "config/model_config.h"

namespace kvlm {

class Communicator;

// A rank's place in its group.
struct TpRank {
  int rank = 0;
  int world = 1;
};

// What each rank holds of a model.
struct TpLayout {
  int q_heads = 0;         // query heads per rank
  int kv_heads = 0;        // KV heads per rank
  int kv_replicas = 1;     // ranks that hold each KV head (> 1 when the model has fewer KV heads than ranks)
  int64_t intermediate = 0;  // MLP width per rank
  int64_t expert_width = 0;  // a mixture of experts' per-expert width per rank: the whole width
                             // under expert parallelism (whole experts per rank), else a share
};

// Checks that `world` ranks can split `c` and says how; throws kvlm::Error naming the config
// field and the sizes that would work when they cannot (world must divide num_attention_heads
// and intermediate_size; num_key_value_heads must be a multiple or a divisor of world).
TpLayout tp_layout(const ModelConfig& c, int world);

// The sizes world > 1 tensor-parallel sizes that split `c` (for error messages): "1, 2, 4".
std::string valid_tp_sizes(const ModelConfig& c, int max_world = 8);

// The config rank r computes with: its heads, KV heads and MLP width, and of a mixture of
// experts its share of every expert's width or (MoeConfig::expert_parallel) its experts
// (hidden size, vocabulary and everything else unchanged).
ModelConfig shard_config(const ModelConfig& c, TpRank r);
// The whole model's config to declare the weights `world` ranks load their slices from
// (ModelConfig::weight_split): the checkpoint's shapes, fused tensors cut into per-head sections.
ModelConfig weight_config(const ModelConfig& c, int world);

// The KV plan of rank r: every layer with the rank's query and KV heads, per-KV-head scales
// reduced to the rank's heads. Bytes per token are per rank.
KVPlan shard_kv_plan(const KVPlan& plan, TpRank r);

// The units [begin, begin + count) of `units` equal units that rank r holds: units / world
// each when world divides units, else (fewer units than ranks, world a multiple) the one unit
// r / (world / units). Throws kvlm::Error when neither holds.
struct UnitRange {
  int64_t begin = 0, count = 0;
};
UnitRange shard_units(int64_t units, TpRank r);


}  // namespace kvlm

#include "model/tensor_parallel.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

namespace {

// Why `world` ranks cannot split `c`, or "" when they can.
std::string split_problem(const ModelConfig& c, int world) {
  const std::string n = std::to_string(world);
  if (c.num_heads % world != 0)
    return "num_attention_heads " + std::to_string(c.num_heads) + " is not divisible by " + n;
  if (c.num_kv_heads % world != 0 && world % c.num_kv_heads != 0)
    return "num_key_value_heads " + std::to_string(c.num_kv_heads) + " neither divides nor is divisible by " + n;
  const bool dense_layers = std::ranges::find(c.moe_layers, false) != c.moe_layers.end() || c.moe_layers.empty();
  if (dense_layers && c.intermediate_size % world != 0)
    return "intermediate_size " + std::to_string(c.intermediate_size) + " is not divisible by " + n;
  // Experts split tensor-parallel inside each expert: every rank holds its share of every
  // expert's width; or whole experts per rank (expert parallelism).
  if (c.moe && c.moe->expert_parallel && c.moe->num_experts % world != 0)
    return "its " + std::to_string(c.moe->num_experts) + " experts do not divide over " + n +
           " ranks (--enable-expert-parallel holds whole experts per rank)";
  if (c.moe && !c.moe->expert_parallel && c.moe->expert_size % world != 0)
    return "the experts' width " + std::to_string(c.moe->expert_size) + " (moe_intermediate_size) is not divisible by " + n;
  if (c.moe && c.moe->shared_expert_size % world != 0)
    return "the shared expert's width " + std::to_string(c.moe->shared_expert_size) +
           " (shared_expert_intermediate_size) is not divisible by " + n;
  // Gated DeltaNet layers split by key heads: a rank holds whole key heads and their value heads.
  if (c.linear_attention && c.linear_attention->k_heads % world != 0)
    return "linear_num_key_heads " + std::to_string(c.linear_attention->k_heads) + " is not divisible by " + n;
  return {};
}

}  // namespace

std::string valid_tp_sizes(const ModelConfig& c, int max_world) {
  std::string s;
  for (int w = 1; w <= max_world; ++w)
    if (split_problem(c, w).empty()) s += (s.empty() ? "" : ", ") + std::to_string(w);
  return s;
}

TpLayout tp_layout(const ModelConfig& c, int world) {
  if (world < 1) throw Error("--tensor-parallel-size must be at least 1, got " + std::to_string(world));
  KVLM_CHECK(c.num_heads > 0 && c.num_kv_heads > 0 && c.intermediate_size > 0, "tp_layout of an empty config");
  if (const std::string why = split_problem(c, world); !why.empty())
    throw Error("--tensor-parallel-size " + std::to_string(world) + " cannot split this model: " + why +
                " (config.json); sizes that work: " + valid_tp_sizes(c));
  TpLayout t;
  t.q_heads = c.num_heads / world;
  t.kv_heads = c.num_kv_heads >= world ? c.num_kv_heads / world : 1;
  t.kv_replicas = c.num_kv_heads >= world ? 1 : world / c.num_kv_heads;
  t.intermediate = c.intermediate_size / world;
  if (c.moe) t.expert_width = c.moe->expert_parallel ? c.moe->expert_size : c.moe->expert_size / world;
  return t;
}

ModelConfig shard_config(const ModelConfig& c, TpRank rank) {
  const int world = rank.world;
  const TpLayout t = tp_layout(c, world);
  ModelConfig r = c;
  r.num_heads = t.q_heads;
  r.num_kv_heads = t.kv_heads;
  r.intermediate_size = int(t.intermediate);
  if (r.moe && r.moe->expert_parallel) {
    r.moe->local_experts = r.moe->num_experts / world;
    r.moe->expert_begin = rank.rank * r.moe->local_experts;
  }
  if (r.moe) r.moe->expert_size = int(t.expert_width);
  if (r.moe) r.moe->shared_expert_size /= world;
  if (r.linear_attention) {
    r.linear_attention->k_heads /= world;
    r.linear_attention->v_heads /= world;
  }
  return r;
}

ModelConfig weight_config(const ModelConfig& c, int world) {
  ModelConfig w = c;
  w.weight_split = world;
  return w;
}

UnitRange shard_units(int64_t units, TpRank r) {
  KVLM_CHECK(r.world >= 1 && r.rank >= 0 && r.rank < r.world, "shard_units: rank outside its group");
  if (units % r.world == 0) return {r.rank * (units / r.world), units / r.world};
  if (units > 0 && r.world % units == 0) return {r.rank / (r.world / units), 1};
  throw Error(std::to_string(units) + " units cannot be split over " + std::to_string(r.world) +
              " tensor-parallel ranks");
}

KVPlan shard_kv_plan(const KVPlan& plan, TpRank r) {
  KVPlan out = plan;
  if (r.world == 1) return out;
  for (KVLayerSpec& l : out.layers) {
    AttentionLayerDesc& a = l.attn;
    const std::string where = "layer " + std::to_string(a.layer) + " of model " + a.model;
    if (a.num_q_heads % r.world != 0)
      throw Error(where + ": " + std::to_string(a.num_q_heads) + " query heads cannot be split over " +
                  std::to_string(r.world) + " tensor-parallel ranks");
    const UnitRange kv = shard_units(a.num_kv_heads, r);
    auto slice = [&](std::vector<float>& s) {
      if (s.size() == size_t(a.num_kv_heads))
        s = std::vector<float>(s.begin() + kv.begin, s.begin() + kv.begin + kv.count);
    };
    slice(l.k_scale);
    slice(l.v_scale);
    a.num_q_heads /= r.world;
    a.num_kv_heads = int(kv.count);
  }
  return out;
}

}  // namespace kvlm

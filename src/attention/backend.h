// The attention backend interface and its capability declaration.
//
// A backend states what it truly handles as data — a whitelist (seed 004) — and the
// selector (selector.h) picks one per layer from those declarations alone. A backend is
// only ever handed layers whose spec passed its capability check.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kv/kv_plan.h"
#include "core/index_types.h"
#include "kv/kv_cache.h"
#include "kv/kv_formats.h"

namespace kvlm {

enum class Device : uint8_t { Cpu, Cuda };
std::string_view device_name(Device d);

// One range of compute capabilities and what a GPU backend's build runs there. A backend
// with tiers runs exactly on the GPUs its tiers cover (the selector refuses the others), and
// the tiers say where the same kernels run differently: which device code the driver loads
// and which KV formats have their FP8 conversions done in software there (sm_80 has no FP8
// conversion instructions; the results are the same, the cost per key is higher).
struct ComputeTier {
  int min_cc = 0;                       // inclusive, major * 10 + minor
  int max_cc = 0;                       // inclusive; 0 = no upper bound
  std::string code;                     // e.g. "sm_80", "sm_90a", "compute_89 PTX, JIT-compiled by the driver"
  std::vector<KVStorage> software_fp8;  // formats whose FP8 conversions run in software here
  std::string software_fp8_why;         // e.g. "sm_80 has no FP8 conversion instructions"
  std::string note;                     // anything else that differs, e.g. "no programmatic dependent launch"
  bool covers(int cc) const { return cc >= min_cc && (max_cc == 0 || cc <= max_cc); }
};

struct BackendCapabilities {
  std::string name;
  Device device = Device::Cpu;
  // Whitelists: a layer fits only if its K's and its V's (storage, quant mode) pairs are listed here.
  std::vector<KVStorage> kv_formats;
  // K and V in different formats (KVLayerSpec::k != v): the pairs kv_pair_in(k, v, *kv_pairs)
  // admits (kv/kv_formats.h); nullopt: only layers whose K and V formats are equal.
  std::optional<KVFormatSet> kv_pairs;
  bool holds_pair(const KVStorage& k, const KVStorage& v) const {
    return k == v || (kv_pairs && kv_pair_in(k, v, *kv_pairs));
  }
  std::vector<int> head_sizes;          // empty: any even head size up to max_head_size
  int max_head_size = 1024;
  bool causal = true;
  bool sliding_window = false;
  bool non_causal = false;
  // Reads exact sink / recent tokens (KVLayerSpec::keep_sink / keep_recent) from the exact pages.
  bool exact_tokens = false;
  // Adds learned attention sinks (AttentionLayerDesc::sinks, AttentionCall::sinks) to the
  // softmax's denominator.
  bool attention_sinks = false;
  int min_compute_capability = 0;       // e.g. 80 for sm_80; 0 = no requirement (CPU)
  int priority = 0;                     // higher wins among backends that fit
  std::string description;
  // GPU backends: the compute capabilities this build runs on, in ascending order, from
  // min_compute_capability up (empty: every one from min_compute_capability up, one way).
  std::vector<ComputeTier> compute_tiers;
};

// One sequence of a flattened batch. Its new tokens were already stored in the cache, so
// query row i (0 <= i < q_len) sits at position kv_len - q_len + i.
struct AttnSeq {
  int32_t q_begin = 0;  // first row in the query / output buffers
  int32_t q_len = 0;
  int32_t kv_len = 0;   // tokens cached for this sequence, including the new ones
  // Hybrid models: the sequence's slot among its Gated DeltaNet layers' states
  // (ModelRunner::allocate_states), -1 when the model has none.
  int32_t state_slot = -1;
  std::span<const BlockId> block_table;  // [ceil(kv_len / block_size)] page ids
  // Layers with exact sink / recent tokens: per entry of block_table, the exact page that
  // holds the same tokens in the model dtype, or -1 where no query of this call reads one
  // exact (kv_key_exact). Empty when no layer keeps exact tokens.
  std::span<const BlockId> exact_table;
};

struct AttentionCall {
  std::span<const float> q;    // [num_tokens][num_q_heads][head_dim], RoPE applied
  std::span<float> out;        // [num_tokens][num_q_heads][head_dim]
  std::span<const AttnSeq> seqs;
  float softmax_scale = 1.0f;  // usually head_dim^-0.5
  // Layers with attention sinks: [num_q_heads] logits s_h (already in score units, not scaled
  // by softmax_scale): out = sum_j exp(x_j - m) v_j / (sum_j exp(x_j - m) + exp(s_h - m)). Empty
  // otherwise; -inf gives the plain softmax.
  std::span<const float> sinks;
};

struct KVWrite {
  std::span<const float> k;      // [num_tokens][num_kv_heads][head_dim], RoPE applied
  std::span<const float> v;      // [num_tokens][num_kv_heads][head_dim]
  std::span<const SlotId> slots; // [num_tokens]: block_id * block_size + offset
  // Layers with exact tokens: [num_tokens] exact page * block_size + offset, -1 = not kept.
  std::span<const SlotId> exact_slots;
};

class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual const BackendCapabilities& caps() const = 0;
  // Quantize (per the layer's spec) and scatter K/V rows into the layer's pages.
  virtual void store_kv(LayerKVCache& cache, const KVWrite& w) const = 0;
  // Attention of the queries over the paged cache, with the mask of the layer's kind:
  // full (causal), sliding (causal, window) or non-causal (every cached token). With the
  // queries being a sequence's last q_len positions, non-causal is also a prefix plus a
  // bidirectional block: what a DFlash drafter's block of mask tokens attends to.
  virtual void attend(const LayerKVCache& cache, const AttentionCall& call) const = 0;
};

}  // namespace kvlm

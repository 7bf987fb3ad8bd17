// The KV plan: the one place where every attention layer — of the target model or of a
// draft model — gets its KV-cache spec. Nothing else builds a default (seed 000); every
// consumer (storage, KV-store op, attention backend, capacity planner, `kvlm inspect`)
// reads the layer's KVLayerSpec, never the global option (seed 001).
//
// build_kv_plan is a pure function of (cache options, the attention layers, the model
// dtype, the checkpoint's declared KV scheme, the checkpoint's scale tensors).
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/cache_config.h"
#include "config/model_config.h"
#include "kv/attention_mask.h"
#include "core/dtype.h"

namespace kvlm {

// One attention layer as the model describes it, before any cache decision.
struct AttentionLayerDesc {
  std::string model = "target";  // "target" or the name of a draft model
  int layer = 0;                 // index within its model
  AttentionKind kind = AttentionKind::Full;
  int window = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  bool sinks = false;  // a learned logit per query head joins the softmax's denominator (GPT-OSS)
};

// Hybrid models' Gated DeltaNet layers (ModelConfig::linear_layers) are not among them: the plan
// and the pool hold the attention layers only, in order (KV layer i is the i-th of them).
std::vector<AttentionLayerDesc> attention_layers(const ModelConfig& m, const std::string& model_name = "target");

enum class DTypeSource : uint8_t { PlanFile, Explicit, CheckpointScheme, ModelDType, SkipRule };
std::string_view dtype_source_name(DTypeSource s);

enum class ScaleSource : uint8_t { None, CheckpointTensor, Default, PerTokenHeadDynamic };
std::string_view scale_source_name(ScaleSource s);

// Result of the global precedence rule, before per-layer skip rules.
struct KVDTypeResolution {
  KVStorage storage;
  DTypeSource source;
  std::string note;  // e.g. "overrides checkpoint compressed-tensors kv_cache_scheme"
};

// explicit user dtype > checkpoint quantization_config KV scheme > model dtype (seed 002).
// Throws kvlm::Error when `auto` meets a checkpoint scheme kvlm cannot hold.
KVDTypeResolution resolve_kv_dtype(KVCacheDType requested, const std::optional<CheckpointKVScheme>& scheme,
                                   DType model_dtype);

// Per-tensor scales found in a checkpoint for one layer. Vectors hold 1 value (per layer)
// or num_kv_heads values (per kv head).
struct CheckpointScales {
  std::vector<float> k, v;
  std::string k_name, v_name;  // tensor names, for inspect
};
using ScaleLookup = std::function<std::optional<CheckpointScales>(const AttentionLayerDesc&)>;

// K or V: the two halves of a layer's cache, which may be held in different formats.
enum class KVSide : uint8_t { K, V };

struct KVLayerSpec {
  AttentionLayerDesc attn;
  // The formats of K's and V's pages (kv/kv_formats.h's table): equal unless the plan sets them
  // apart.
  KVStorage k{DType::BF16, KVQuantMode::None};
  KVStorage v{DType::BF16, KVQuantMode::None};
  const KVStorage& format(KVSide side) const { return side == KVSide::K ? k : v; }
  bool quantized() const { return k.mode != KVQuantMode::None || v.mode != KVQuantMode::None; }
  // Where each side's format came from (the precedence of kv/kv_plan_file.h).
  DTypeSource dtype_source = DTypeSource::ModelDType;  // K's
  DTypeSource v_dtype_source = DTypeSource::ModelDType;
  DTypeSource source(KVSide side) const { return side == KVSide::K ? dtype_source : v_dtype_source; }
  bool from_plan_file = false;  // the plan file has an entry for this layer
  ScaleSource scale_source = ScaleSource::None;
  std::vector<float> k_scale{1.0f}, v_scale{1.0f};  // Fp8PerTensor only: 1 or num_kv_heads
  std::string k_scale_name, v_scale_name;
  std::string backend;  // filled by the attention backend selector
  // Hadamard, per side (core/hadamard.h's R with `rotation_seed`'s signs, after RoPE): K's
  // rotates q and K (scores unchanged), V's rotates V and, back, the attention output. Only
  // quantized sides rotate.
  bool rotate_k = false;
  bool rotate_v = false;
  uint32_t rotation_seed = 0;
  bool rotates() const { return rotate_k || rotate_v; }
  bool rotates(KVSide side) const { return side == KVSide::K ? rotate_k : rotate_v; }
  // Exact sink / recent tokens (quantized layers only; 0 = none): besides its quantized row,
  // every token a query may read exact is also held in `exact_storage` (the model dtype) in
  // the exact pages (kv_cache.h), and a query reads key j exact when kv_key_exact
  // (kv/attention_mask.h) says so.
  int keep_sink = 0;
  int keep_recent = 0;
  DType exact_storage = DType::BF16;
  bool keeps_exact() const { return keep_sink > 0 || keep_recent > 0; }
  // Bytes of one token's exact K and V rows (0 without exact tokens).
  size_t exact_bytes_per_token() const;

  // Bytes one token occupies in this layer: K and V codes, plus a 32-bit scale slot per
  // (token, head) for each per-token-head side.
  size_t bytes_per_token() const;
  float k_scale_for(int kv_head) const { return k_scale.size() == 1 ? k_scale[0] : k_scale[size_t(kv_head)]; }
  float v_scale_for(int kv_head) const { return v_scale.size() == 1 ? v_scale[0] : v_scale[size_t(kv_head)]; }
};

struct KVPlan {
  KVCacheDTypes requested;        // K's, and V's when set apart
  KVDTypeResolution resolution;    // K's
  KVDTypeResolution v_resolution;  // V's (= resolution unless requested.v)
  std::string plan_file;           // --kv-cache-plan's source, when one was given
  std::vector<KVLayerSpec> layers;
  std::vector<std::string> warnings;  // for the caller to print (the function stays pure)

  size_t bytes_per_token() const;
  // Exact sink / recent tokens: the largest setting of any layer (every keeping layer has the
  // same one) and the bytes of one exact token over all keeping layers.
  int keep_sink() const;
  int keep_recent() const;
  size_t exact_bytes_per_token() const;
};

// The plan's global KV format, for one-line summaries: "int8 int8_per_token_head", "bfloat16",
// or "K int8 int8_per_token_head, V int4 int4_per_token_head" when K and V are apart; with a
// plan file, its name and how many layers hold each format.
std::string describe_kv_resolution(const KVPlan& plan);

KVPlan build_kv_plan(const CacheConfig& cache, std::span<const AttentionLayerDesc> layers, DType model_dtype,
                     const std::optional<CheckpointKVScheme>& scheme, const ScaleLookup& scales);

// The KVCacheDType that stores `s` (nullopt for a float32 cache, which no dtype names).
std::optional<KVCacheDType> kv_cache_dtype_of(const KVStorage& s);

// A complete plan file for `plan`: every layer's K and V format, rotation, seed and exact
// tokens, so that --kv-cache-plan with it resolves to the same plan under any other options —
// except a float32 side (no KV cache dtype names it), which is left out and so follows the
// model dtype (float32) unless --kv-cache-dtype says otherwise.
KVPlanFile kv_plan_file_of(const KVPlan& plan, const std::string& architecture, int num_layers);

// A layer's rotation in one word: "none", "hadamard" (K and V), "hadamard_k" or "hadamard_v".
std::string kv_rotation_text(const KVLayerSpec& l);

// One layer of a KV plan as `kvlm inspect --json` writes it (the chat page and the Python
// package's kvlm.inspect show the same).
nlohmann::json kv_layer_json(const KVLayerSpec& l);

}  // namespace kvlm

// CacheConfig: the user's KV-cache options, parsed and validated from CLI text once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "kv/kv_plan_file.h"

namespace kvlm {

// --kv-cache-dtype-skip-layers: layer indices and/or the attention type `sliding_window`.
struct SkipLayers {
  std::vector<int> indices;
  bool sliding_window = false;
  bool empty() const { return indices.empty() && !sliding_window; }
};

// Parses "0,5,sliding_window" (commas and/or spaces). Throws kvlm::Error on anything else.
// Indices are range-checked later against the model (build_kv_plan).
SkipLayers parse_skip_layers(std::string_view text);

// --kv-cache-rotation: how quantized layers rotate q / K / V before K and V are stored
// (core/hadamard.h). Auto: Hadamard for 4-bit layers, none for the others.
enum class KVRotation : uint8_t { Auto, None, Hadamard };
std::string_view kv_rotation_name(KVRotation r);
// "auto", "none" or "hadamard"; anything else is a kvlm::Error naming them.
KVRotation parse_kv_rotation(std::string_view s);

// --mamba-ssm-cache-dtype: "auto" or "float32" (F32), "bfloat16" (BF16); anything else is a
// kvlm::Error naming them, the option spelled as `flag`.
DType parse_linear_state_dtype(std::string_view s, std::string_view flag);

// The KV dtypes a user asked for: K's, and V's when it is set apart from K's.
struct KVCacheDTypes {
  KVCacheDType k = KVCacheDType::Auto;
  std::optional<KVCacheDType> v;  // nullopt: the same as K's
  bool operator==(const KVCacheDTypes&) const = default;
};

// --kv-cache-dtype's text: one dtype for K and V ("int8_per_token_head"), or K and V apart
// ("k=int8_per_token_head,v=int4_per_token_head"; a side left out is `auto`). Throws
// kvlm::Error naming the valid values and the form (`option` names the flag or keyword).
KVCacheDTypes parse_kv_cache_dtypes(std::string_view text, std::string_view option = "--kv-cache-dtype");
// The text parse_kv_cache_dtypes reads back: "auto", "fp8", "k=int8_per_token_head,v=auto".
std::string kv_cache_dtypes_text(const KVCacheDTypes& d);

struct CacheConfig {
  // --kv-cache-dtype: K's dtype, and V's unless v_cache_dtype is set (`k=A,v=B`,
  // --cache-type-k / --cache-type-v: K and V apart; each side resolves as one dtype would).
  KVCacheDType kv_cache_dtype = KVCacheDType::Auto;
  std::optional<KVCacheDType> v_cache_dtype;
  KVCacheDTypes kv_dtypes() const { return {kv_cache_dtype, v_cache_dtype}; }
  void set_kv_dtypes(const KVCacheDTypes& d) {
    kv_cache_dtype = d.k;
    v_cache_dtype = d.v;
  }
  SkipLayers skip_layers;
  // --kv-cache-plan: per-layer formats, rotation and exact tokens, above every other rule
  // (kv/kv_plan_file.h).
  std::optional<KVPlanFile> plan_file;
  KVRotation rotation = KVRotation::Auto;
  // --kv-cache-keep-sink / --kv-cache-keep-recent: tokens every quantized layer also holds in
  // the model dtype (kv_plan.h's kv_key_exact says which keys a query reads exact).
  int keep_sink = 0;
  int keep_recent = 0;
  int block_size = 16;                       // tokens per KV page
  std::optional<std::string> attention_backend;  // --attention-backend: force one by name
  // --mamba-ssm-cache-dtype (vLLM's name): hybrid models' Gated DeltaNet state matrices in fp32
  // (the default) or bf16 (half the state memory; LinearAttentionConfig::state_dtype).
  DType linear_state_dtype = DType::F32;
};

// Throws kvlm::Error unless 0 <= keep <= 65536 (`flag` names the option in the message).
void validate_keep_tokens(int keep, std::string_view flag);

// Throws kvlm::Error unless block_size is a power of two in [1, 256].
void validate_block_size(int block_size);

}  // namespace kvlm

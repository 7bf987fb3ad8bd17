// Tensor element types and the KV-cache precision vocabulary.
//
// Three enums, each parsed from text exactly once at the boundary (CLI flag, config.json,
// safetensors header) and never compared as strings afterwards (seed 003):
//   DType        — how elements are stored in a tensor or a KV page.
//   KVCacheDType — what the user asked for with --kv-cache-dtype.
//   KVQuantMode  — how one layer's KV page is quantized; derived per layer by the plan.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace kvlm {

// I4: 4-bit KV codes 0..15, two per byte (the int4 KV format: kv/kv_format.h's kvfmt::I4).
enum class DType : uint8_t { F32, F16, BF16, F8E4M3, F8E5M2, I8, I32, I64, U8, Bool, F64, I4 };

// Bytes of one element; an error for I4 (half a byte: use dtype_bits / dtype_bytes).
size_t dtype_size(DType t);
size_t dtype_bits(DType t);
// Bytes of n elements (n * bits / 8; an error when that is not a whole number of bytes).
size_t dtype_bytes(DType t, size_t n);
std::string_view dtype_name(DType t);  // "float32", "bfloat16", "fp8_e4m3", "int8", ...
// safetensors header names ("F32", "BF16", "F8_E4M3", ...); nullopt for unknown names.
std::optional<DType> dtype_from_safetensors(std::string_view s);
std::string_view dtype_safetensors_name(DType t);
// config.json "torch_dtype"/"dtype" values ("bfloat16", "float16", "float32", "half", ...).
std::optional<DType> dtype_from_torch_name(std::string_view s);

// --kv-cache-dtype values, exactly the whitelist below; `fp8` is an alias of fp8_e4m3 that
// is kept distinct only so messages can echo what the user typed.
enum class KVCacheDType : uint8_t {
  Auto,
  Float16,
  BFloat16,
  Fp8,
  Fp8E4M3,
  Fp8E5M2,
  Fp8PerTokenHead,
  Int8PerTokenHead,
  Int4PerTokenHead,
};

std::span<const KVCacheDType> all_kv_cache_dtypes();
std::string_view kv_cache_dtype_name(KVCacheDType d);
// Throws kvlm::Error naming every valid value when `s` is not one of them (`option` names the
// flag or keyword the value came from).
KVCacheDType parse_kv_cache_dtype(std::string_view s, std::string_view option = "--kv-cache-dtype");

enum class KVQuantMode : uint8_t {
  None,              // stored in an unquantized float type (f32 / f16 / bf16)
  Fp8PerTensor,      // one static scale per layer for K and one for V (or per kv head)
  Fp8PerTokenHead,   // E4M3 codes, fp32 scale per (token, kv head) computed at write time
  Int8PerTokenHead,  // int8 codes, fp32 scale per (token, kv head) computed at write time
  Int4PerTokenHead,  // int4 codes (two per byte), f16 step and zero point per (token, kv head) at write time
};

std::string_view kv_quant_mode_name(KVQuantMode m);
inline bool is_per_token_head(KVQuantMode m) {
  return m == KVQuantMode::Fp8PerTokenHead || m == KVQuantMode::Int8PerTokenHead ||
         m == KVQuantMode::Int4PerTokenHead;
}

// What a user-level KV dtype means for storage. `Auto` has no fixed meaning: the plan
// resolves it (checkpoint scheme or model dtype).
struct KVStorage {
  DType storage;
  KVQuantMode mode;
  bool operator==(const KVStorage&) const = default;
};
std::optional<KVStorage> kv_storage_of(KVCacheDType d);

}  // namespace kvlm

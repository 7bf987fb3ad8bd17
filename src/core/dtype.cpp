#include "core/dtype.h"

#include <array>

#include "core/error.h"

namespace kvlm {

namespace {

struct DTypeInfo {
  DType type;
  size_t bits;
  std::string_view name;
  std::string_view safetensors;
};

constexpr std::array<DTypeInfo, 12> kDTypes{{
    {DType::F32, 32, "float32", "F32"},
    {DType::F16, 16, "float16", "F16"},
    {DType::BF16, 16, "bfloat16", "BF16"},
    {DType::F8E4M3, 8, "fp8_e4m3", "F8_E4M3"},
    {DType::F8E5M2, 8, "fp8_e5m2", "F8_E5M2"},
    {DType::I8, 8, "int8", "I8"},
    {DType::I32, 32, "int32", "I32"},
    {DType::I64, 64, "int64", "I64"},
    {DType::U8, 8, "uint8", "U8"},
    {DType::Bool, 8, "bool", "BOOL"},
    {DType::F64, 64, "float64", "F64"},
    {DType::I4, 4, "int4", ""},  // no safetensors name: KV pages only
}};

const DTypeInfo& info(DType t) {
  for (const auto& i : kDTypes)
    if (i.type == t) return i;
  KVLM_CHECK(false, "unknown DType");
}

struct KVDTypeInfo {
  KVCacheDType dtype;
  std::string_view name;
  std::optional<KVStorage> storage;
};

constexpr std::array<KVDTypeInfo, 9> kKVDTypes{{
    {KVCacheDType::Auto, "auto", std::nullopt},
    {KVCacheDType::Float16, "float16", KVStorage{DType::F16, KVQuantMode::None}},
    {KVCacheDType::BFloat16, "bfloat16", KVStorage{DType::BF16, KVQuantMode::None}},
    {KVCacheDType::Fp8, "fp8", KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}},
    {KVCacheDType::Fp8E4M3, "fp8_e4m3", KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}},
    {KVCacheDType::Fp8E5M2, "fp8_e5m2", KVStorage{DType::F8E5M2, KVQuantMode::Fp8PerTensor}},
    {KVCacheDType::Fp8PerTokenHead, "fp8_per_token_head",
     KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTokenHead}},
    {KVCacheDType::Int8PerTokenHead, "int8_per_token_head",
     KVStorage{DType::I8, KVQuantMode::Int8PerTokenHead}},
    {KVCacheDType::Int4PerTokenHead, "int4_per_token_head",
     KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead}},
}};

constexpr std::array<KVCacheDType, 9> kAllKV{
    KVCacheDType::Auto,    KVCacheDType::Float16, KVCacheDType::BFloat16,        KVCacheDType::Fp8,
    KVCacheDType::Fp8E4M3, KVCacheDType::Fp8E5M2, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
    KVCacheDType::Int4PerTokenHead,
};

const KVDTypeInfo& kv_info(KVCacheDType d) {
  for (const auto& i : kKVDTypes)
    if (i.dtype == d) return i;
  KVLM_CHECK(false, "unknown KVCacheDType");
}

}  // namespace

size_t dtype_size(DType t) {
  const size_t bits = info(t).bits;
  KVLM_CHECK(bits % 8 == 0, "dtype_size of a sub-byte type; use dtype_bytes");
  return bits / 8;
}
size_t dtype_bits(DType t) { return info(t).bits; }
size_t dtype_bytes(DType t, size_t n) {
  const size_t bits = n * info(t).bits;
  KVLM_CHECK(bits % 8 == 0, "a partial byte of sub-byte elements");
  return bits / 8;
}
std::string_view dtype_name(DType t) { return info(t).name; }
std::string_view dtype_safetensors_name(DType t) { return info(t).safetensors; }

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  for (const auto& i : kDTypes)
    if (!i.safetensors.empty() && i.safetensors == s) return i.type;
  return std::nullopt;
}

std::optional<DType> dtype_from_torch_name(std::string_view s) {
  if (s.starts_with("torch.")) s.remove_prefix(6);
  if (s == "float32" || s == "float") return DType::F32;
  if (s == "float16" || s == "half") return DType::F16;
  if (s == "bfloat16") return DType::BF16;
  return std::nullopt;
}

std::span<const KVCacheDType> all_kv_cache_dtypes() { return kAllKV; }
std::string_view kv_cache_dtype_name(KVCacheDType d) { return kv_info(d).name; }
std::optional<KVStorage> kv_storage_of(KVCacheDType d) { return kv_info(d).storage; }

KVCacheDType parse_kv_cache_dtype(std::string_view s, std::string_view option) {
  for (const auto& i : kKVDTypes)
    if (i.name == s) return i.dtype;
  std::string valid;
  for (const auto& i : kKVDTypes) valid += (valid.empty() ? "" : ", ") + std::string(i.name);
  throw Error("invalid " + std::string(option) + " '" + std::string(s) + "'; valid values are: " + valid);
}

std::string_view kv_quant_mode_name(KVQuantMode m) {
  switch (m) {
    case KVQuantMode::None: return "none";
    case KVQuantMode::Fp8PerTensor: return "fp8_per_tensor";
    case KVQuantMode::Fp8PerTokenHead: return "fp8_per_token_head";
    case KVQuantMode::Int8PerTokenHead: return "int8_per_token_head";
    case KVQuantMode::Int4PerTokenHead: return "int4_per_token_head";
  }
  KVLM_CHECK(false, "unknown KVQuantMode");
}

}  // namespace kvlm

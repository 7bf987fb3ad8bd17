// The KV page formats kvlm stores, in one table. Every whitelist (the CPU backend's, the CUDA
// capability declaration's), every "unsupported KV format" error and every storage size is
// derived from it. Adding a format is one row here plus its codec: kvfmt's (kv/kv_format.h,
// the CPU reference) and, for a row marked `cuda`, the device one (ops/cuda/kv_codec.cuh); each
// codec list is checked against this table at compile time (check_codecs).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace kvlm {

struct KVFormat {
  KVStorage kv;  // the element type of the codes and how a row is scaled
  bool cuda;     // the CUDA kernels read and write it
};

inline constexpr KVFormat kKVFormats[] = {
    {{DType::F32, KVQuantMode::None}, false},  // the CPU reference's pages
    {{DType::F16, KVQuantMode::None}, true},
    {{DType::BF16, KVQuantMode::None}, true},
    {{DType::F8E4M3, KVQuantMode::Fp8PerTensor}, true},  // a static scale per layer or KV head
    {{DType::F8E5M2, KVQuantMode::Fp8PerTensor}, true},
    {{DType::F8E4M3, KVQuantMode::Fp8PerTokenHead}, true},  // a dynamic scale per token and KV head
    {{DType::I8, KVQuantMode::Int8PerTokenHead}, true},
    {{DType::I4, KVQuantMode::Int4PerTokenHead}, true},  // a dynamic f16 step and zero point per token and KV head
};

// Which formats a device's kernels hold.
enum class KVFormatSet : uint8_t { All, Cuda };

constexpr bool kv_format_in(const KVFormat& f, KVFormatSet set) { return set == KVFormatSet::All || f.cuda; }

// The table's entry for `kv`, or nullptr.
constexpr const KVFormat* find_kv_format(KVStorage kv) {
  for (const KVFormat& f : kKVFormats)
    if (f.kv == kv) return &f;
  return nullptr;
}

// K and V in different formats (KVLayerSpec::k != v). The CPU reference reads any two of its
// formats. The CUDA kernels are compiled for every pair they read, so they hold two of the four
// below: bfloat16 (16-bit, the model dtype of most checkpoints) and the three per-token-head
// formats. With these pairs a calibration can measure each side quantized alone (the other in
// 16 bits) and assemble any mix of them (kvlm calibrate, docs/results/accuracy-real.md).
// Every pair's kernels are instantiated from this list (ops/cuda/kv_codec.cuh's
// dispatch_cuda_kv_pair) and the CUDA backend's capabilities quote it.
inline constexpr KVStorage kCudaSplitFormats[] = {
    {DType::BF16, KVQuantMode::None},
    {DType::F8E4M3, KVQuantMode::Fp8PerTokenHead},
    {DType::I8, KVQuantMode::Int8PerTokenHead},
    {DType::I4, KVQuantMode::Int4PerTokenHead},
};

// Whether a device's kernels read K in `k` beside V in `v` (equal formats: the format's row).
constexpr bool kv_pair_in(KVStorage k, KVStorage v, KVFormatSet set) {
  const KVFormat* fk = find_kv_format(k);
  const KVFormat* fv = find_kv_format(v);
  if (!fk || !fv || !kv_format_in(*fk, set) || !kv_format_in(*fv, set)) return false;
  if (k == v || set == KVFormatSet::All) return true;
  bool k_listed = false, v_listed = false;
  for (const KVStorage& x : kCudaSplitFormats) {
    k_listed |= x == k;
    v_listed |= x == v;
  }
  return k_listed && v_listed;
}
// "any two of bfloat16/none, ...": the K != V pairs of `set`, for error messages.
std::string describe_kv_pairs(KVFormatSet set);

// The (storage, mode) pairs of `set`, in table order: a backend's whitelist.
std::vector<KVStorage> kv_formats_of(KVFormatSet set);
// "float32/float16/bfloat16 with none, fp8_e4m3/fp8_e5m2 with fp8_per_tensor, ...": the pairs of
// `set`, grouped by quant mode, for error messages.
std::string describe_kv_formats(KVFormatSet set);
// Throws kvlm::Error "<who>: unsupported KV format: storage X with quant mode Y; supported: ...".
[[noreturn]] void throw_unsupported_kv(KVStorage kv, KVFormatSet set, std::string_view who);

// "int8/int8_per_token_head": one format, as errors name it.
std::string kv_format_name(KVStorage kv);
// A K and a V format, each named by `name`: one name when equal, else "K <k>, V <v>".
template <class Name>
std::string kv_pair_name(const KVStorage& k, const KVStorage& v, Name&& name) {
  return k == v ? name(k) : "K " + name(k) + ", V " + name(v);
}

// Bytes of one row (one token, one KV head) of `head_dim` codes, and of the row's scale slot:
// 4 bytes for the per-token-head modes (an fp32 scale; int4: an f16 step and an f16 zero
// point), 0 for the others (per-tensor scales live in the plan, not the pages).
size_t kv_row_code_bytes(KVStorage kv, int head_dim);
size_t kv_row_scale_bytes(KVStorage kv);

// A compile-time list of codec types, each with `static constexpr KVStorage kKV`: the formats
// one device's kernels implement, and the one (storage, mode) switch over them.
template <class... Codecs>
struct KVCodecList {};

// Whether `list` holds exactly the formats of `set`, each once (for a static_assert beside it).
template <class... Codecs>
constexpr bool check_codecs(KVCodecList<Codecs...>, KVFormatSet set) {
  size_t rows = 0;
  for (const KVFormat& f : kKVFormats) {
    if (!kv_format_in(f, set)) continue;
    ++rows;
    if (((Codecs::kKV == f.kv ? 1 : 0) + ... + 0) != 1) return false;
  }
  return rows == sizeof...(Codecs);
}

namespace kv_detail {
template <class First, class... Rest, class F>
decltype(auto) dispatch(KVStorage kv, F& f, KVFormatSet set, std::string_view who) {
  if (First::kKV == kv) return f(First{});
  if constexpr (sizeof...(Rest) > 0)
    return dispatch<Rest...>(kv, f, set, who);
  else
    throw_unsupported_kv(kv, set, who);
}
}  // namespace kv_detail

// Calls f(Codec{}) with the codec of `kv` in `list`; a pair outside it is a kvlm::Error naming
// `who` and the formats of `set` (never a pass-through: seed 003).
template <class... Codecs, class F>
decltype(auto) dispatch_kv_codec(KVCodecList<Codecs...>, KVStorage kv, KVFormatSet set, std::string_view who, F&& f) {
  return kv_detail::dispatch<Codecs...>(kv, f, set, who);
}

}  // namespace kvlm

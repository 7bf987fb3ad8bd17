#include "kv/kv_formats.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

std::vector<KVStorage> kv_formats_of(KVFormatSet set) {
  std::vector<KVStorage> out;
  for (const KVFormat& f : kKVFormats)
    if (kv_format_in(f, set)) out.push_back(f.kv);
  return out;
}

std::string describe_kv_formats(KVFormatSet set) {
  // Grouped by quant mode, in the order the modes first appear in the table.
  std::vector<KVQuantMode> modes;
  for (const KVFormat& f : kKVFormats)
    if (kv_format_in(f, set) && std::find(modes.begin(), modes.end(), f.kv.mode) == modes.end())
      modes.push_back(f.kv.mode);
  std::string out;
  for (const KVQuantMode m : modes) {
    std::string storages;
    for (const KVFormat& f : kKVFormats)
      if (kv_format_in(f, set) && f.kv.mode == m)
        storages += (storages.empty() ? "" : "/") + std::string(dtype_name(f.kv.storage));
    out += (out.empty() ? "" : ", ") + storages + " with " + std::string(kv_quant_mode_name(m));
  }
  return out;
}

void throw_unsupported_kv(KVStorage kv, KVFormatSet set, std::string_view who) {
  throw Error(std::string(who) + ": unsupported KV format: storage " + std::string(dtype_name(kv.storage)) +
              " with quant mode " + std::string(kv_quant_mode_name(kv.mode)) + "; supported: " + describe_kv_formats(set));
}

std::string describe_kv_pairs(KVFormatSet set) {
  if (set == KVFormatSet::All) return "any two of " + describe_kv_formats(set);
  std::string s;
  for (const KVStorage& kv : kCudaSplitFormats) s += (s.empty() ? "" : ", ") + kv_format_name(kv);
  return "any two of " + s;
}

std::string kv_format_name(KVStorage kv) {
  return std::string(dtype_name(kv.storage)) + "/" + std::string(kv_quant_mode_name(kv.mode));
}

size_t kv_row_code_bytes(KVStorage kv, int head_dim) {
  KVLM_CHECK(find_kv_format(kv) != nullptr, "kv_row_code_bytes of a format outside the table");
  return dtype_bytes(kv.storage, size_t(head_dim));
}

size_t kv_row_scale_bytes(KVStorage kv) {
  KVLM_CHECK(find_kv_format(kv) != nullptr, "kv_row_scale_bytes of a format outside the table");
  return is_per_token_head(kv.mode) ? sizeof(float) : 0;
}

}  // namespace kvlm

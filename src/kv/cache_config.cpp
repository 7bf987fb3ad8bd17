#include "kv/cache_config.h"

#include <charconv>

#include "core/error.h"

namespace kvlm {

SkipLayers parse_skip_layers(std::string_view text) {
  SkipLayers out;
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && (text[i] == ',' || text[i] == ' ')) ++i;
    size_t j = i;
    while (j < text.size() && text[j] != ',' && text[j] != ' ') ++j;
    if (j == i) break;
    const std::string_view tok = text.substr(i, j - i);
    i = j;
    if (tok == "sliding_window") {
      out.sliding_window = true;
      continue;
    }
    int v = -1;
    auto [p, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (ec != std::errc() || p != tok.data() + tok.size() || v < 0)
      throw Error("invalid --kv-cache-dtype-skip-layers entry '" + std::string(tok) +
                  "'; expected layer indices (0, 1, ...) and/or 'sliding_window', separated by commas");
    out.indices.push_back(v);
  }
  return out;
}

KVCacheDTypes parse_kv_cache_dtypes(std::string_view text, std::string_view option) {
  if (text.find('=') == std::string_view::npos) return {parse_kv_cache_dtype(text, option), std::nullopt};
  const std::string form = "; write " + std::string(option) + " k=DTYPE,v=DTYPE (for example k=int8_per_token_head,"
                           "v=int4_per_token_head; a side left out is auto) or one DTYPE for both";
  KVCacheDTypes out;
  bool seen_k = false, seen_v = false;
  for (bool last = false; !last;) {  // every comma-separated entry, empty ones included
    const size_t cut = text.find(',');
    last = cut == std::string_view::npos;
    const std::string_view item = text.substr(0, cut);
    if (!last) text = text.substr(cut + 1);
    const size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq == std::string_view::npos ? item.size() : eq);
    if (eq == std::string_view::npos || (key != "k" && key != "v"))
      throw Error("invalid " + std::string(option) + " entry '" + std::string(item) + "'" + form);
    bool& seen = key == "k" ? seen_k : seen_v;
    if (seen) throw Error(std::string(option) + " sets " + std::string(key) + " twice" + form);
    seen = true;
    const KVCacheDType d = parse_kv_cache_dtype(item.substr(eq + 1), std::string(option) + " " + std::string(key) + "=");
    if (key == "k")
      out.k = d;
    else
      out.v = d;
  }
  if (!out.v) out.v = KVCacheDType::Auto;  // k=A alone: V keeps the default, as llama.cpp's --cache-type-k
  return out;
}

std::string kv_cache_dtypes_text(const KVCacheDTypes& d) {
  if (!d.v) return std::string(kv_cache_dtype_name(d.k));
  return "k=" + std::string(kv_cache_dtype_name(d.k)) + ",v=" + std::string(kv_cache_dtype_name(*d.v));
}

std::string_view kv_rotation_name(KVRotation r) {
  switch (r) {
    case KVRotation::Auto: return "auto";
    case KVRotation::None: return "none";
    case KVRotation::Hadamard: return "hadamard";
  }
  return "?";
}

KVRotation parse_kv_rotation(std::string_view s) {
  for (KVRotation r : {KVRotation::Auto, KVRotation::None, KVRotation::Hadamard})
    if (s == kv_rotation_name(r)) return r;
  throw Error("invalid --kv-cache-rotation '" + std::string(s) +
              "'; valid values are: auto (Hadamard for 4-bit layers), none, hadamard (every quantized layer)");
}

DType parse_linear_state_dtype(std::string_view s, std::string_view flag) {
  if (s == "auto" || s == "float32") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  throw Error(std::string(flag) + " must be auto, float32 or bfloat16, got '" + std::string(s) + "'");
}

void validate_block_size(int b) {
  if (b < 1 || b > 256 || (b & (b - 1)) != 0)
    throw Error("invalid --block-size " + std::to_string(b) + "; use a power of two between 1 and 256 (16 is the usual choice)");
}

void validate_keep_tokens(int keep, std::string_view flag) {
  if (keep < 0 || keep > 65536)
    throw Error("invalid " + std::string(flag) + " " + std::to_string(keep) +
                "; give a token count between 0 and 65536 (the measured settings are sink 4, recent 64)");
}

}  // namespace kvlm

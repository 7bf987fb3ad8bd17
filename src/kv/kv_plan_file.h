// The KV plan file (--kv-cache-plan plan.json): per attention layer, K's and V's formats,
// the rotation of each side and its seed, and the exact sink / recent tokens. It is the top of
// the precedence that build_kv_plan applies side by side:
//
//   plan file > explicit --kv-cache-dtype (and the skip rule) > checkpoint KV scheme > model dtype
//
// A field a layer's entry leaves out falls through to the rule below it, so a plan may name
// only the layers (or the sides) it changes. `kvlm calibrate --kld-budget` writes complete
// plans; `kvlm inspect --write-kv-plan` writes the resolved plan of any options as a start.
//
//   {
//     "kvlm_kv_plan": 1,
//     "model": {"architecture": "LlamaForCausalLM", "num_layers": 30},       (optional; checked)
//     "layers": [
//       {"layer": 0, "k": "bfloat16", "v": "int8_per_token_head"},
//       {"layer": 5, "k": "int8_per_token_head", "v": "int4_per_token_head",
//        "rotation": {"k": "hadamard", "v": "hadamard"}, "rotation_seed": 3,
//        "keep_sink": 4, "keep_recent": 0},
//       {"model": "draft", "layer": 0, "k": "fp8_per_token_head"}
//     ],
//     "calibration": {...}                                   (what calibrate measured; not read)
//   }
//
// "rotation" is "none", "hadamard" (every quantized side) or {"k": ..., "v": ...}. Unknown
// keys, duplicate layers and wrong types are errors that name the file and the entry.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/dtype.h"

namespace kvlm {

struct KVPlanEntry {
  std::string model = "target";  // "target" or a drafter's model name ("draft")
  int layer = 0;                  // the layer's index in its model (as `kvlm inspect` numbers them)
  std::optional<KVCacheDType> k, v;
  std::optional<bool> rotate_k, rotate_v;
  std::optional<uint32_t> rotation_seed;
  std::optional<int> keep_sink, keep_recent;
  std::string where() const;  // "layer 5" / "draft layer 0", for messages
};

struct KVPlanFile {
  std::string source;  // the path (or "<text>"), for messages
  std::optional<std::string> architecture;
  std::optional<int> num_layers;
  std::vector<KVPlanEntry> entries;
  nlohmann::json calibration;  // carried for the reader; kvlm does not act on it
  const KVPlanEntry* find(std::string_view model, int layer) const;
};

// Parses a plan file's JSON text. Throws kvlm::Error naming `source`, the entry and the valid
// values on anything malformed.
KVPlanFile parse_kv_plan_file(std::string_view text, const std::string& source);
// Reads and parses `path` (errors name the file; a missing file says so).
KVPlanFile load_kv_plan_file(const std::filesystem::path& path);

// The JSON of a plan file whose entries are `entries` (every field that is set is written).
nlohmann::json kv_plan_file_json(const KVPlanFile& f);

}  // namespace kvlm

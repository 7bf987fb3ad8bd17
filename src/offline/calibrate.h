// `kvlm calibrate`: static FP8 KV-cache scales from activations, written as a new model
// directory in the compressed-tensors format that kvlm, vLLM and other engines read.
//
// The model runs the calibration samples with an unquantized cache; every layer's K (as it
// is stored: after the q/k norm and RoPE) and V are observed before storage, and
//   scale = max(absmax / 448, 1e-8)        (448 = FP8 E4M3's largest finite value)
// per layer, or per KV head with `per_head` (compressed-tensors strategy "attn_head").
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "model/loaded_model.h"

namespace kvlm {

struct LayerKVStats {
  int layer = 0;
  std::vector<float> k_absmax, v_absmax;  // per KV head
  std::vector<float> k_scale, v_scale;    // 1 (per layer) or num_kv_heads values
};

struct CalibrationResult {
  std::vector<LayerKVStats> layers;
  int num_samples = 0;
  int64_t num_tokens = 0;
  bool per_head = false;
};

// Runs each sample (token ids) through the engine's CPU runner and derives the scales.
// Throws kvlm::Error when the engine does not run on the CPU or a sample is empty.
CalibrationResult calibrate_kv(LoadedModel& engine, const std::vector<std::vector<TokenId>>& samples, bool per_head);

// Writes `out`: every file of `in` linked (hard link, else copied), the weight files
// renamed into a sharded set with one more shard holding model.layers.N.self_attn.{k,v}_scale,
// a model.safetensors.index.json naming them all, and config.json with a compressed-tensors
// quantization_config whose kv_cache_scheme declares static FP8 KV scales. `in` is never
// modified. Throws kvlm::Error when `out` exists and is not empty, or is `in`.
void write_calibrated_model(const std::filesystem::path& in, const std::filesystem::path& out, const CalibrationResult& r);

}  // namespace kvlm

// --speculative-config: which drafter proposes tokens for the target to verify, with vLLM's
// JSON keys. Parsed and validated once; unknown methods and keys are errors that list the
// valid ones.
//
//   {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}
//   {"method": "dflash", "model": DIR, "num_speculative_tokens": K, "kv_cache_dtype": "fp8"}
// Either method also takes "disable_by_batch_size": N (drafting pauses for a step while more
// than N sequences are running: at large batches a step is no longer bound by reading the
// weights, and verifying drafts costs more than it gains).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "core/dtype.h"

namespace kvlm {

enum class SpecMethod { Ngram, DFlash };
std::string_view spec_method_name(SpecMethod m);  // "ngram", "dflash"

struct SpeculativeConfig {
  SpecMethod method = SpecMethod::Ngram;
  int num_speculative_tokens = 0;  // K: tokens proposed per step (>= 1)
  // ngram: the longest suffix of the sequence of [prompt_lookup_min, prompt_lookup_max]
  // tokens that occurred before proposes the tokens that followed it. vLLM's defaults: both
  // 5 when neither is given, the given one when one is.
  int prompt_lookup_min = 0;
  int prompt_lookup_max = 0;
  // dflash: the drafter's model directory, and the KV dtype of its layers (default: the
  // target's cache options, skip rules included).
  std::string model;
  std::optional<KVCacheDType> kv_cache_dtype;
  int disable_by_batch_size = 0;  // 0: draft at every batch size
};

// Parses the flag's JSON text. Throws kvlm::Error naming the key and the valid values.
SpeculativeConfig parse_speculative_config(std::string_view json);

// One line for the logs and `kvlm inspect`: "ngram, 4 tokens, n-grams of 2 to 5 tokens".
std::string describe(const SpeculativeConfig& c);

}  // namespace kvlm

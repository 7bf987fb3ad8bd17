// A GGUF file as a Hugging Face model: the config.json its metadata describes (so that one
// parser, config/model_config, validates GGUF and safetensors models alike) and, for every
// Hugging Face tensor name, the GGUF tensor it comes from and what undoes llama.cpp's
// conversion of it:
//   * Llama q_proj / k_proj: convert_hf_to_gguf.py reorders each head's rows from the
//     rotate-half layout to interleaved pairs (its `permute`); kvlm's RoPE is rotate-half, so
//     the rows are put back;
//   * Gemma norms: the converter stores 1 + w (Gemma's RMSNorm scales by 1 + w); the 1 is
//     taken off again.
// Architectures: llama (Llama 2/3, SmolLM, Mistral), qwen2, qwen3, gemma3. Anything else is
// refused by name.
#pragma once

#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/gguf.h"

namespace kvlm {

struct GGUFTensorSource {
  std::string gguf_name;
  int unpermute_heads = 0;  // > 0: undo the Llama q/k row permutation over this many heads
  bool minus_one = false;   // Gemma norm: stored 1 + w
};

struct GGUFModel {
  nlohmann::json config;  // a Hugging Face config.json
  // Its generation_config.json: the file's general.sampling.* keys, else llama.cpp's defaults
  // (a GGUF file carries no generation config; sampling at temperature 1.0 with no cut-off
  // makes small chat models ramble).
  nlohmann::json generation_config;
  std::map<std::string, GGUFTensorSource> tensors;  // Hugging Face name -> source
  std::vector<std::string> notes;  // where each config field came from (for `kvlm inspect`)
  // The tensor of per-frequency rope divisors (Llama 3.1-style scaling), if the file has one:
  // its values belong in config["rope_freq_factors"] (add_rope_freq_factors reads them).
  std::string rope_freqs;
};

// Throws kvlm::Error naming `label` and the missing or unsupported field.
GGUFModel map_gguf_model(const GGUFHeader& h, const std::string& label);

// Puts the file's rope_freqs.weight values into m.config["rope_freq_factors"] (no-op without).
void add_rope_freq_factors(const GGUFFile& f, GGUFModel& m);

// The tensor's values in fp32, [rows][cols] as Hugging Face lays them out, undone as `src` says.
std::vector<float> load_gguf_tensor(const GGUFFile& f, const GGUFTensorSource& src);

// The inverse of convert_hf_to_gguf.py's Llama `permute` on a [heads * head_dim][cols] matrix
// (rows of each head: pairs (2i, 2i + 1) back to (i, i + head_dim / 2)). In place.
void unpermute_llama_heads(std::vector<float>& w, int heads, int64_t rows, int64_t cols);
// Row `row` of the Hugging Face layout is this row of the GGUF tensor (`rows` rows of `heads`
// heads): what unpermute_llama_heads moves, for a loader that moves whole rows of blocks.
int64_t llama_head_source_row(int64_t row, int heads, int64_t rows);

}  // namespace kvlm

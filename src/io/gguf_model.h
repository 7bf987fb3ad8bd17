// A GGUF file as a Hugging Face model: the config.json its metadata describes (so that one
// parser, config/model_config, validates GGUF and safetensors models alike) and, for every
// Hugging Face tensor name, the GGUF tensor it comes from and what undoes llama.cpp's
// conversion of it:
//   * Llama q_proj / k_proj: convert_hf_to_gguf.py reorders each head's rows from the
//     rotate-half layout to interleaved pairs (its `permute`); kvlm's RoPE is rotate-half, so
//     the rows are put back;
//   * Gemma norms: the converter stores 1 + w (Gemma's RMSNorm scales by 1 + w); the 1 is
//     taken off again;
//   * Qwen3-MoE experts: the converter stacks every expert's gate, up and down projection into
//     one [experts][rows][cols] tensor per layer (ffn_{gate,up,down}_exps); each expert's
//     Hugging Face tensor is its slice (whole rows of blocks, so quantized experts stay in
//     their blocks).
// Architectures: llama (Llama 2/3, SmolLM, Mistral), qwen2, qwen3, qwen3moe, gemma3. Anything
// else is refused by name.
#pragma once

#include <map>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/gguf.h"

namespace kvlm {

struct GGUFTensorSource {
  std::string gguf_name;
  int unpermute_heads = 0;  // > 0: undo the Llama q/k row permutation over this many heads
  bool minus_one = false;   // Gemma norm: stored 1 + w
  int expert = -1;          // >= 0: this expert's [rows][cols] slice of a 3-D [experts][rows][cols] tensor
};

// The bytes of `src`'s values inside its GGUF tensor `t` (its expert's slice, or all of it).
std::span<const uint8_t> gguf_source_bytes(const GGUFFile& f, const GGUFTensorInfo& t, const GGUFTensorSource& src);
// "GGUF tensor 'blk.0.attn_q.weight'", "expert 5 of GGUF tensor 'blk.3.ffn_up_exps.weight'".
std::string gguf_source_label(const GGUFTensorSource& src);
// Its shape as Hugging Face lays it out (outermost first; an expert's slice drops the expert axis).
std::vector<int64_t> gguf_source_shape(const GGUFTensorInfo& t, const GGUFTensorSource& src);

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

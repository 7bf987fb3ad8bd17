// FP8 weight quantization: what a checkpoint's quantization_config declares about its linear
// weights (llm-compressor's compressed-tensors, NVIDIA ModelOpt, the block-wise "fp8" of Qwen and
// DeepSeek), or what --quantization fp8 asks of a 16-bit checkpoint, validated once.
//
// Loading is driven by each tensor's dtype: a float8_e4m3fn weight needs its scale tensor
// (`<module>.<scale_name>`, shaped as `scaling` says) and is dequantized as code * scale; a
// 16/32-bit weight is dense whatever the config says (the ignore lists are informational).
// Everything kvlm cannot run — another bit width, integer weights, zero points, group
// scales, an activation scheme other than FP8 per token / per tensor — is refused here, at
// config time, with the field that says so.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace kvlm {

// How a weight's FP8 codes are scaled: W[r][c] = code[r][c] * scale[...].
enum class Fp8Scaling : uint8_t {
  Tensor,   // one scale (shape [], [1])
  Channel,  // one per output row ([rows, 1] or [rows])
  Block,    // one per block_rows x block_cols tile ([ceil(rows / br), ceil(cols / bc)])
};
std::string_view fp8_scaling_name(Fp8Scaling s);

// The activations the checkpoint was calibrated for (what a GPU FP8 GEMM quantizes x with).
enum class Fp8Activations : uint8_t {
  None,           // weight-only (W8A16): activations stay 16-bit
  DynamicToken,   // one scale per token, computed on the fly
  DynamicTensor,  // one scale per tensor, computed on the fly
  DynamicBlock,   // one scale per token and 128 input features (block-wise fp8)
  StaticTensor,   // one calibrated scale per layer: the `input_scale` tensor
};
std::string_view fp8_activations_name(Fp8Activations a);

struct WeightQuantConfig {
  std::string origin;  // "compressed-tensors", "modelopt", "fp8", "--quantization fp8"
  Fp8Scaling scaling = Fp8Scaling::Channel;
  int block_rows = 0, block_cols = 0;   // Block
  std::string scale_name = "weight_scale";  // the scale tensor's suffix: weight_scale / weight_scale_inv
  Fp8Activations activations = Fp8Activations::DynamicToken;
  std::vector<std::string> ignore;      // modules the checkpoint leaves unquantized (as declared)
  bool on_the_fly = false;              // --quantization fp8: kvlm quantizes 16-bit linear weights at load

  // "FP8 E4M3 weights, per-channel scales, dynamic per-token activations (compressed-tensors)".
  std::string describe() const;
};

// The FP8 weight scheme of config.json's quantization_config; nullopt when it declares none
// (no quantization_config, or one that only describes the KV cache). Throws kvlm::Error for a
// scheme kvlm cannot run, naming the field and what would work.
std::optional<WeightQuantConfig> parse_weight_quant(const nlohmann::json& config);

// 4-bit weights (AWQ's GEMM layout, GPTQ, compressed-tensors pack-quantized W4A16: integer codes;
// MXFP4: E2M1 codes with an E8M0 scale per 32): io/int4_checkpoint.h reads them.
struct Int4Scheme {
  enum class Kind : uint8_t { Awq, Gptq, CompressedTensors, Mxfp4 } kind = Kind::Awq;
  int group = 0;            // input columns per scale; 0: the whole row (group_size -1, strategy channel)
  bool zeros_minus_one = false;  // GPTQ checkpoint_format gptq: stored zero points are z - 1
  bool symmetric = false;   // compressed-tensors without weight_zero_point: codes centred on 8
  std::string describe() const;  // "AWQ 4-bit, groups of 128"
};

// The scheme of config.json's quantization_config when it is AWQ, GPTQ, compressed-tensors
// pack-quantized integer weights or MXFP4; nullopt for any other quant_method (or compressed-tensors'
// FP8 formats) or none. Throws kvlm::Error for what kvlm cannot run (another bit width, AWQ's
// GEMV layout or no zero points, quantized activations beside 4-bit weights), naming the field
// and what would work.
std::optional<Int4Scheme> parse_int4_scheme(const nlohmann::json& config);

// --quantization: "" (none asked) or "fp8". With "fp8", a checkpoint without FP8 weights gets
// per-channel FP8 quantized at load (`on_the_fly`), one that has them keeps its own scheme.
// Throws for any other value.
std::optional<WeightQuantConfig> resolve_weight_quant(std::optional<WeightQuantConfig> checkpoint,
                                                      std::string_view quantization_flag);

}  // namespace kvlm

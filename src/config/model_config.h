// ModelConfig: what kvlm needs from a Hugging Face config.json (+ generation_config.json),
// validated once at load time. Accepts both the Hub's legacy fields (`torch_dtype`,
// `rope_theta`, `rope_scaling`) and transformers-5 fields (`dtype`, `rope_parameters`).
#pragma once

#include <algorithm>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "config/arch_spec.h"
#include "config/weight_quant.h"
#include "core/dtype.h"
#include "core/index_types.h"

namespace kvlm {

enum class RopeType { Default, Linear, Llama3, Yarn };
std::string_view rope_type_name(RopeType t);

struct RopeConfig {
  RopeType type = RopeType::Default;
  double theta = 10000.0;
  double factor = 1.0;             // linear, llama3
  double low_freq_factor = 1.0;    // llama3
  double high_freq_factor = 4.0;   // llama3
  int original_max_position = 8192;  // llama3, yarn
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn: the band of dimensions between extrapolation and interpolation
  bool truncate = true;            // yarn: round the band's ends to whole dimensions
  // yarn: cos and sin are multiplied by this (transformers' attention_factor; default
  // 0.1 ln(factor) + 1), so attention scores by its square.
  double attention_factor = 1.0;
  // Per-frequency divisors stored in a GGUF file (rope_freqs.weight, how llama.cpp carries
  // Llama 3.1-style scaling): inv_freq[i] /= freq_factors[i] after the type's own scaling.
  // config.json key "rope_freq_factors" (kvlm's own, written for GGUF models).
  std::vector<double> freq_factors;
  // Partial rotary embedding (Qwen3-Next, Qwen3.5: partial_rotary_factor 0.25): only the first
  // rotary_dim dimensions of each head rotate (rotate-half within them); 0 = the whole head.
  int rotary_dim = 0;
};

// The gate activation of the gated MLP: out = f(gate) * up.
enum class GluActivation : uint8_t {
  Silu,         // Llama, Qwen, Mistral (hidden_act silu)
  GeluTanh,     // Gemma (gelu_pytorch_tanh)
  SwigluClamp,  // GPT-OSS: gate, up clamped to `limit` (up to +-limit), gate * sigmoid(alpha gate) * (up + 1)
};
std::string_view glu_activation_name(GluActivation a);

enum class AttentionKind : uint8_t { Full, Sliding, NonCausal };
std::string_view attention_kind_name(AttentionKind k);

struct LayerAttention {
  AttentionKind kind = AttentionKind::Full;
  int window = 0;  // Sliding: a query at position p sees keys at positions > p - window
};

// The KV-cache scheme a checkpoint declares in config.json's quantization_config.
struct CheckpointKVScheme {
  std::string origin;                 // e.g. "compressed-tensors kv_cache_scheme"
  std::optional<KVStorage> storage;   // nullopt: declared but not something kvlm can hold
  bool per_head_scales = false;       // compressed-tensors strategy "attn_head"
  std::string unsupported_reason;     // set when storage is nullopt
};

// A DFlash drafter's own fields (config.json: block_size, dflash_config.mask_token_id,
// dflash_config.target_layer_ids, num_target_layers). Its features are the outputs of the
// target's layers target_layer_ids (Hugging Face's hidden_states[id + 1]), concatenated.
struct DFlashConfig {
  int block_size = 0;                 // the drafted block: the last token, then block_size - 1 masks
  TokenId mask_token_id = 0;
  std::vector<int> target_layer_ids;
  int num_target_layers = 0;          // 0 when config.json does not say
};

// A mixture-of-experts MLP (config.json: num_experts / num_local_experts,
// num_experts_per_tok, moe_intermediate_size, norm_topk_prob, decoder_sparse_step,
// mlp_only_layers, swiglu_limit). Each token's router logits (h Wr^T, + bias) choose its top_k
// experts; their weights are a softmax over the top_k logits (norm_topk: Qwen3-MoE with
// norm_topk_prob, GPT-OSS) or over all experts' (Qwen3-MoE without); the token's output is the
// weighted sum of its experts' gated MLPs.
struct MoeConfig {
  int num_experts = 0;
  int top_k = 0;
  int expert_size = 0;          // each expert's intermediate size
  bool norm_topk = true;
  bool router_bias = false;     // GPT-OSS
  bool expert_bias = false;     // GPT-OSS: gate/up and down biases per expert
  // GPT-OSS from a GGUF file: one tensor per expert and projection (mlp.experts.E.{gate,up,
  // down}_proj.{weight,bias}, as Qwen3-MoE's) instead of the fused, transposed tensors of the
  // Hugging Face checkpoints. Set by the GGUF mapping (config key per_expert_tensors).
  bool per_expert_tensors = false;
  GluActivation act = GluActivation::Silu;
  float swiglu_alpha = 1.702f, swiglu_limit = 7.0f;  // SwigluClamp
  // Qwen3-Next / Qwen3.5-MoE: a shared expert, a gated MLP of this width that every row runs,
  // its output scaled by sigmoid(x . shared_gate) and added to the routed experts'. 0: none.
  int shared_expert_size = 0;
  // Tensor parallelism: each rank holds its share of every expert's width, or with
  // expert_parallel (--enable-expert-parallel) whole experts: rank r of W holds experts
  // [expert_begin, expert_begin + local_experts) = [r E / W, (r + 1) E / W), routes every token
  // over all E, and sums only its experts' outputs (the block's all-reduce adds the ranks').
  bool expert_parallel = false;
  int expert_begin = 0;
  int local_experts = 0;        // 0: all of them (one rank, or tensor parallel inside experts)
  int held_experts() const { return local_experts > 0 ? local_experts : num_experts; }
};

// Gated DeltaNet layers (Qwen3-Next, Qwen3.5: config.json linear_num_key_heads,
// linear_num_value_heads, linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim).
// Such a layer holds no KV cache but a state per sequence: the causal conv's last
// conv_kernel - 1 inputs of q | k | v, and a [key dim][value dim] matrix per value head
// (ops/cpu/linear_attention.h).
struct LinearAttentionConfig {
  int k_heads = 0, v_heads = 0;  // v_heads a multiple of k_heads
  int k_dim = 0, v_dim = 0;      // per head
  int conv_kernel = 0;
  int key_dim() const { return k_heads * k_dim; }
  int value_dim() const { return v_heads * v_dim; }
  int conv_dim() const { return 2 * key_dim() + value_dim(); }  // q | k | v
  // The fused input projection's width: q | k | v, the output gate z, b, a.
  int in_proj_dim() const { return conv_dim() + value_dim() + 2 * v_heads; }
  // The delta rule's matrices are held in state_dtype: fp32, or bf16 (--mamba-ssm-cache-dtype
  // bfloat16, set at load from CacheConfig::linear_state_dtype); the conv window is fp32 always.
  DType state_dtype = DType::F32;
  // One sequence's state in one layer: conv window values, then the delta rule's matrices.
  size_t conv_state_values() const { return size_t(conv_kernel - 1) * size_t(conv_dim()); }
  size_t matrix_values() const { return size_t(v_heads) * size_t(k_dim) * size_t(v_dim); }
  size_t state_values() const { return conv_state_values() + matrix_values(); }
  // Its bytes, as a slot holds them: the fp32 window, then the matrices in state_dtype, rounded
  // up to 16 (slots stay aligned for vector loads). Every runner and the memory plan use this.
  size_t state_bytes() const {
    const size_t b = conv_state_values() * sizeof(float) + matrix_values() * dtype_size(state_dtype);
    return (b + 15) / 16 * 16;
  }
};

struct ModelConfig {
  const ArchSpec* arch = nullptr;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  GluActivation hidden_act = GluActivation::Silu;
  RopeConfig rope;                      // full-attention layers (all layers unless rope_local)
  std::optional<RopeConfig> rope_local; // sliding-window layers, when they have their own (Gemma 3)
  // Attention scores are scaled by query_pre_attn_scalar^-0.5 (Gemma); nullopt: head_dim^-0.5.
  std::optional<double> query_pre_attn_scalar;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;   // Qwen2 always; Llama/Mistral/Qwen3 with attention_bias
  bool o_bias = false;     // attention_bias on Llama/Mistral/Qwen3
  bool mlp_bias = false;   // Llama mlp_bias
  bool qk_norm = false;    // Qwen3: RMSNorm over head_dim on q and k before RoPE
  std::optional<DType> declared_dtype;  // torch_dtype / dtype, when present
  std::vector<LayerAttention> layers;   // one per decoder layer
  std::optional<TokenId> bos_token_id;
  std::vector<TokenId> eos_token_ids;   // generation_config.json wins over config.json
  std::optional<CheckpointKVScheme> kv_scheme;
  std::optional<WeightQuantConfig> weight_quant;  // FP8 linear weights (or --quantization fp8)
  std::optional<DFlashConfig> dflash;   // a DFlash drafter (DFlashDraftModel)
  std::optional<MoeConfig> moe;         // a mixture-of-experts model
  std::vector<bool> moe_layers;         // per layer: its MLP is the mixture (else the dense intermediate_size MLP)
  bool attention_sinks = false;         // GPT-OSS: a learned logit per head joins each softmax's denominator
  // Qwen3-Next / Qwen3.5: q_proj gives each head its query, then as many gate values; the
  // attention output is multiplied by sigmoid(gate) before o_proj.
  bool attn_output_gate = false;
  // A multimodal checkpoint's class (Qwen3_5ForConditionalGeneration) when kvlm runs its
  // language model (ArchSpec::wrappers), else empty.
  std::string wrapper;
  std::optional<LinearAttentionConfig> linear_attention;  // hybrid models' Gated DeltaNet layers
  // The tensor-parallel ranks the weights are declared for: runners set it on the whole model's
  // config they load a rank's slices with. Only then does an architecture cut a fused tensor
  // into per-head sections (Qwen3.5's in_proj_qkv), which a single rank loads whole.
  int weight_split = 1;
  std::vector<bool> linear_layers;      // per layer: a Gated DeltaNet layer (no KV cache), else attention
  bool is_linear_layer(int i) const { return !linear_layers.empty() && linear_layers[size_t(i)]; }
  int num_linear_layers() const { return int(std::count(linear_layers.begin(), linear_layers.end(), true)); }
  // Layers with a KV cache (attention_layers): all but the Gated DeltaNet ones.
  int num_kv_layers() const { return num_layers - num_linear_layers(); }
  // Sampling defaults from generation_config.json, used when the user gives no flag.
  std::optional<float> default_temperature, default_top_p, default_min_p;
  std::optional<int> default_top_k;
};

// Parses a config.json document. `generation_config` may be null. Throws kvlm::Error naming
// the field for anything missing, mistyped, inconsistent or unsupported.
ModelConfig parse_model_config(const nlohmann::json& config, const nlohmann::json* generation_config);

// The GGUF file a --model path names: the path itself when it is a .gguf file, or the one
// .gguf file of a directory without config.json. nullopt otherwise (a Hugging Face
// directory, or nothing there); a directory with several .gguf files is an error.
std::optional<std::filesystem::path> find_gguf(const std::filesystem::path& path);

// Throws a clear error unless `dir` is a directory holding config.json, or a GGUF model
// (find_gguf).
void check_model_dir(const std::filesystem::path& dir);

// Reads DIR/config.json and, if present, DIR/generation_config.json. A ModelOpt export's
// DIR/hf_quant_config.json stands in for a quantization_config that config.json lacks.
ModelConfig load_model_config(const std::filesystem::path& dir);

// Reads and parses a JSON file, with errors that name the file.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace kvlm

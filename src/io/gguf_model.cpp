#include "io/gguf_model.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string_view>
#include <tuple>

#include "core/error.h"
#include "io/ggml_dequant.h"

namespace kvlm {

namespace {

struct ArchInfo {
  const char* gguf;
  const char* hf_class;
  const char* model_type;
};
constexpr ArchInfo kArchs[] = {
    {"llama", "LlamaForCausalLM", "llama"},
    {"qwen2", "Qwen2ForCausalLM", "qwen2"},
    {"qwen3", "Qwen3ForCausalLM", "qwen3"},
    {"qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe"},
    {"gemma3", "Gemma3ForCausalLM", "gemma3_text"},
    {"gpt-oss", "GptOssForCausalLM", "gpt_oss"},
};

// GGUF per-layer tensor names (after "blk.N.") and their Hugging Face names (after
// "model.layers.N."), by architecture family.
struct NamePair {
  const char* gguf;
  const char* hf;
};
constexpr NamePair kLlamaLayer[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},     {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.weight", "self_attn.k_proj.weight"},     {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.weight", "self_attn.v_proj.weight"},     {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.weight", "self_attn.o_proj.weight"}, {"attn_output.bias", "self_attn.o_proj.bias"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"}, {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},       {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};
constexpr NamePair kGemmaLayer[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"ffn_norm.weight", "pre_feedforward_layernorm.weight"},
    {"post_ffw_norm.weight", "post_feedforward_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},      {"attn_k.weight", "self_attn.k_proj.weight"},
    {"attn_v.weight", "self_attn.v_proj.weight"},      {"attn_output.weight", "self_attn.o_proj.weight"},
    {"attn_q_norm.weight", "self_attn.q_norm.weight"}, {"attn_k_norm.weight", "self_attn.k_norm.weight"},
    {"ffn_gate.weight", "mlp.gate_proj.weight"},       {"ffn_up.weight", "mlp.up_proj.weight"},
    {"ffn_down.weight", "mlp.down_proj.weight"},
};
constexpr NamePair kGptOssLayer[] = {
    {"attn_norm.weight", "input_layernorm.weight"},
    {"post_attention_norm.weight", "post_attention_layernorm.weight"},
    {"attn_q.weight", "self_attn.q_proj.weight"},     {"attn_q.bias", "self_attn.q_proj.bias"},
    {"attn_k.weight", "self_attn.k_proj.weight"},     {"attn_k.bias", "self_attn.k_proj.bias"},
    {"attn_v.weight", "self_attn.v_proj.weight"},     {"attn_v.bias", "self_attn.v_proj.bias"},
    {"attn_output.weight", "self_attn.o_proj.weight"}, {"attn_output.bias", "self_attn.o_proj.bias"},
    {"attn_sinks.weight", "self_attn.sinks"},
    {"ffn_gate_inp.weight", "mlp.router.weight"},      {"ffn_gate_inp.bias", "mlp.router.bias"},
};

}  // namespace

GGUFModel map_gguf_model(const GGUFHeader& h, const std::string& label) {
  const auto arch = h.get_string("general.architecture");
  if (!arch) throw Error(label + ": no general.architecture in the GGUF metadata");
  const ArchInfo* info = nullptr;
  for (const ArchInfo& a : kArchs)
    if (*arch == a.gguf) info = &a;
  if (!info)
    throw Error(label + ": GGUF architecture '" + *arch +
                "' is not supported (kvlm runs llama, qwen2, qwen3, qwen3moe, gemma3 and gpt-oss GGUF files)");
  const std::string p = *arch + ".";
  GGUFModel m;
  nlohmann::json& c = m.config;
  // Every config.json field with the metadata key (or rule) it came from, for `kvlm inspect`.
  auto from = [&](const std::string& field, const std::string& source) {
    m.notes.push_back(field + " = " + c[field].dump() + "  <- " + source);
  };
  auto need_int = [&](const std::string& field, const std::string& key) {
    const auto v = h.get_int(key);
    if (!v) throw Error(label + ": the GGUF metadata has no " + key);
    if (*v <= 0 || *v > (int64_t(1) << 31)) throw Error(label + ": " + key + " is " + std::to_string(*v));
    c[field] = *v;
    from(field, key);
    return *v;
  };
  c["architectures"] = {info->hf_class};
  from("architectures", "general.architecture");
  nlohmann::json& gen = m.generation_config;
  gen["do_sample"] = true;
  for (const auto& [field, key, dflt] : {std::tuple{"temperature", "general.sampling.temp", 0.8},
                                         std::tuple{"top_k", "general.sampling.top_k", 40.0},
                                         std::tuple{"top_p", "general.sampling.top_p", 0.95},
                                         std::tuple{"min_p", "general.sampling.min_p", 0.05}}) {
    const auto v = h.get_float(key);
    const double x = v && std::isfinite(*v) ? *v : dflt;
    if (std::string_view(field) == "top_k") gen[field] = int64_t(x);
    else gen[field] = x;
    m.notes.push_back(std::string("generation_config ") + field + " = " + gen[field].dump() + "  <- " +
                      (v ? std::string(key) : std::string("llama.cpp's default (no ") + key + " in the file)"));
  }
  c["model_type"] = info->model_type;
  const int64_t layers = need_int("num_hidden_layers", p + "block_count");
  const int64_t hidden = need_int("hidden_size", p + "embedding_length");
  const int64_t heads = need_int("num_attention_heads", p + "attention.head_count");
  need_int("intermediate_size", p + "feed_forward_length");
  if (h.find(p + "attention.head_count_kv")) {
    need_int("num_key_value_heads", p + "attention.head_count_kv");
  } else {
    c["num_key_value_heads"] = heads;
    from("num_key_value_heads", "no " + p + "attention.head_count_kv: as many as the query heads");
  }
  int64_t head_dim = hidden / heads;
  if (h.find(p + "attention.key_length")) {
    head_dim = need_int("head_dim", p + "attention.key_length");
  } else {
    c["head_dim"] = head_dim;
    from("head_dim", "no " + p + "attention.key_length: embedding_length / head_count");
  }
  if (const auto vl = h.get_int(p + "attention.value_length"); vl && *vl != head_dim)
    throw Error(label + ": attention.value_length differs from key_length; kvlm needs one head size");
  need_int("max_position_embeddings", p + "context_length");
  const auto eps = h.get_float(p + "attention.layer_norm_rms_epsilon");
  if (!eps) throw Error(label + ": the GGUF metadata has no " + p + "attention.layer_norm_rms_epsilon");
  c["rms_norm_eps"] = *eps;
  from("rms_norm_eps", p + "attention.layer_norm_rms_epsilon");
  const auto theta = h.get_float(p + "rope.freq_base");
  c["rope_theta"] = theta.value_or(10000.0);
  from("rope_theta", theta ? p + "rope.freq_base" : "no " + p + "rope.freq_base: llama.cpp's default 10000");
  if (const auto scaling = h.get_string(p + "rope.scaling.type"); scaling && *scaling != "none") {
    if (*scaling != "linear" && *scaling != "yarn")
      throw Error(label + ": rope scaling '" + *scaling + "' is not supported (kvlm reads none, linear and yarn)");
    const auto factor = h.get_float(p + "rope.scaling.factor");
    if (!factor) throw Error(label + ": " + *scaling + " rope scaling without " + p + "rope.scaling.factor");
    c["rope_scaling"] = {{"rope_type", *scaling}, {"factor", *factor}};
    std::string keys = p + "rope.scaling.type, " + p + "rope.scaling.factor";
    if (*scaling == "yarn") {
      // YaRN as transformers computes it: the context the model was trained at, llama.cpp's
      // beta defaults (32, 1) unless the file names them, and the frequency band's ends
      // rounded to whole dimensions (transformers' truncate) except for GPT-OSS, whose
      // config turns that off.
      const auto orig = h.get_int(p + "rope.scaling.original_context_length");
      if (!orig || *orig <= 0)
        throw Error(label + ": yarn rope scaling without " + p + "rope.scaling.original_context_length");
      c["rope_scaling"]["original_max_position_embeddings"] = *orig;
      c["rope_scaling"]["beta_fast"] = h.get_float(p + "rope.scaling.yarn_beta_fast").value_or(32.0);
      c["rope_scaling"]["beta_slow"] = h.get_float(p + "rope.scaling.yarn_beta_slow").value_or(1.0);
      c["rope_scaling"]["truncate"] = *arch != "gpt-oss";
      keys += ", " + p + "rope.scaling.original_context_length (beta_fast 32, beta_slow 1 unless the file has " + p +
              "rope.scaling.yarn_beta_*; truncate " + (*arch != "gpt-oss" ? "true" : "false: GPT-OSS's config") + ")";
    }
    from("rope_scaling", keys);
  }
  if (const GGUFTensorInfo* rf = h.find_tensor("rope_freqs.weight")) {
    if (*arch != "llama")
      throw Error(label + ": per-frequency rope factors (rope_freqs.weight) in a " + *arch + " model are not supported");
    if (rf->numel() * 2 != (h.find(p + "attention.key_length") ? *h.get_int(p + "attention.key_length") : hidden / heads))
      throw Error(label + ": rope_freqs.weight has " + std::to_string(rf->numel()) + " values; head_dim / 2 expected");
    m.rope_freqs = "rope_freqs.weight";
    m.notes.push_back("rope_freq_factors = [" + std::to_string(rf->numel()) +
                      " values]  <- the rope_freqs.weight tensor (Llama 3.1-style frequency scaling, as llama.cpp applies it)");
  }
  const auto tokens = h.get_strings("tokenizer.ggml.tokens");
  if (!tokens) throw Error(label + ": the GGUF metadata has no tokenizer.ggml.tokens (the vocabulary)");
  c["vocab_size"] = tokens->size();
  from("vocab_size", "the length of tokenizer.ggml.tokens");
  const bool tied = h.find_tensor("output.weight") == nullptr;
  c["tie_word_embeddings"] = tied;
  from("tie_word_embeddings", tied ? "no output.weight tensor" : "an output.weight tensor");
  c["torch_dtype"] = "bfloat16";  // the weights are dequantized; bf16 is the compute dtype GGUF models come from
  from("torch_dtype", "the compute dtype: bf16 on the GPU, fp32 on the CPU (where quantized matrices stay in their blocks)");
  if (const auto bos = h.get_int("tokenizer.ggml.bos_token_id")) {
    c["bos_token_id"] = *bos;
    from("bos_token_id", "tokenizer.ggml.bos_token_id");
  }
  std::vector<int64_t> eos;
  for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"})
    if (const auto e = h.get_int(key); e && std::ranges::find(eos, *e) == eos.end()) eos.push_back(*e);
  std::string eos_from = "tokenizer.ggml.eos_token_id and tokenizer.ggml.eot_token_id";
  if (*arch == "gpt-oss") {
    // Harmony: a reply ends at <|return|> (the answer) or <|call|> (a tool call), as
    // generation_config.json says for the safetensors; <|end|> closes each message (the
    // analysis before the answer too), so it never stops generation.
    auto id_of = [&](std::string_view text) -> int64_t {
      const auto it = std::ranges::find(*tokens, text);
      return it == tokens->end() ? -1 : int64_t(it - tokens->begin());
    };
    std::erase(eos, id_of("<|end|>"));
    for (const char* t : {"<|return|>", "<|call|>"})
      if (const int64_t id = id_of(t); id >= 0 && std::ranges::find(eos, id) == eos.end()) eos.push_back(id);
    eos_from += ", and harmony's <|return|> and <|call|> (never <|end|>, which closes the analysis too)";
  }
  if (!eos.empty()) {
    c["eos_token_id"] = eos;
    from("eos_token_id", eos_from);
  }
  const bool gemma = *arch == "gemma3", gpt_oss = *arch == "gpt-oss";
  if (*arch == "llama") {
    c["attention_bias"] = h.find_tensor("blk.0.attn_q.bias") != nullptr;
    from("attention_bias", "whether a blk.0.attn_q.bias tensor exists");
    c["hidden_act"] = "silu";
  } else if (gpt_oss) {
    // llama.cpp's gpt-oss: every layer a mixture of experts with biased router and experts, the
    // clamped SwiGLU at alpha 1.702 and limit 7 (constants in its graph; GptOssConfig's
    // defaults), even layers sliding (its swa pattern 2, as GptOssConfig's layer_types), a sink
    // logit per query head. The experts come per expert (slices of the stacked tensors).
    const auto window = h.get_int(p + "attention.sliding_window");
    if (!window || *window <= 0) throw Error(label + ": gpt-oss without " + p + "attention.sliding_window");
    c["sliding_window"] = *window;
    from("sliding_window", p + "attention.sliding_window (even layers slide: llama.cpp's gpt-oss)");
    c["attention_bias"] = h.find_tensor("blk.0.attn_q.bias") != nullptr;
    from("attention_bias", "whether a blk.0.attn_q.bias tensor exists");
    c["hidden_act"] = "silu";
    c["swiglu_alpha"] = 1.702;
    c["swiglu_limit"] = 7.0;
    from("swiglu_limit", "llama.cpp's gpt-oss: the clamped SwiGLU's limit 7 and alpha 1.702");
    need_int("num_local_experts", p + "expert_count");
    need_int("num_experts_per_tok", p + "expert_used_count");
    if (c["num_experts_per_tok"].get<int64_t>() > c["num_local_experts"].get<int64_t>())
      throw Error(label + ": " + p + "expert_used_count exceeds " + p + "expert_count");
    if (h.find(p + "expert_feed_forward_length")) need_int("intermediate_size", p + "expert_feed_forward_length");
    c["per_expert_tensors"] = true;
    from("per_expert_tensors", "GGUF: each expert's weights are a slice of blk.N.ffn_{gate,up,down}_exps");
  } else if (!gemma) {
    c["hidden_act"] = "silu";
  } else {
    c["hidden_activation"] = "gelu_pytorch_tanh";
    const auto window = h.get_int(p + "attention.sliding_window");
    if (!window) throw Error(label + ": gemma3 without " + p + "attention.sliding_window");
    c["sliding_window"] = *window;
    from("sliding_window", p + "attention.sliding_window");
    // llama.cpp's gemma3: every 6th layer global, local RoPE base 10000, and queries scaled by
    // head_dim^-0.5 except Gemma 3 27B (hidden / heads).
    const auto pattern = h.get_int(p + "attention.sliding_window_pattern");
    c["sliding_window_pattern"] = pattern.value_or(6);
    from("sliding_window_pattern", pattern ? p + "attention.sliding_window_pattern" : "llama.cpp's gemma3: every 6th layer global");
    c["rope_local_base_freq"] = 10000.0;
    from("rope_local_base_freq", "llama.cpp's gemma3: 10000 for the sliding layers");
    c["query_pre_attn_scalar"] = layers == 62 ? hidden / heads : head_dim;
    from("query_pre_attn_scalar", "llama.cpp's gemma3: head_dim (hidden / heads for the 62-layer 27B)");
  }

  const bool moe = *arch == "qwen3moe";
  int64_t experts = gpt_oss ? c["num_local_experts"].get<int64_t>() : 0;
  if (moe) {
    // llama.cpp's qwen3moe: softmax over every expert, the top expert_used_count of them, their
    // weights renormalized (build_moe_ffn's norm_w, fixed to true; a file may say otherwise
    // through expert_weights_norm). A layer without ffn_gate_inp is a dense MLP (Qwen3-MoE's
    // mlp_only_layers; llama.cpp itself wants every layer sparse).
    experts = need_int("num_experts", p + "expert_count");
    const int64_t used = need_int("num_experts_per_tok", p + "expert_used_count");
    if (used > experts)
      throw Error(label + ": " + p + "expert_used_count " + std::to_string(used) + " exceeds expert_count " +
                  std::to_string(experts));
    need_int("moe_intermediate_size", p + "expert_feed_forward_length");
    const auto norm = h.get_bool(p + "expert_weights_norm");
    c["norm_topk_prob"] = norm.value_or(true);
    from("norm_topk_prob", norm ? p + "expert_weights_norm" : "llama.cpp's qwen3moe: the top-k weights renormalized");
    nlohmann::json dense = nlohmann::json::array();
    for (int64_t i = 0; i < layers; ++i)
      if (!h.find_tensor("blk." + std::to_string(i) + ".ffn_gate_inp.weight")) dense.push_back(i);
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = dense;
    from("mlp_only_layers", "the layers without a blk.N.ffn_gate_inp.weight (router) tensor");
  }

  // Tensors.
  auto add = [&](const std::string& hf, const std::string& gg, int unpermute = 0, int expert = -1) {
    if (!h.find_tensor(gg)) return;
    m.tensors[hf] = GGUFTensorSource{.gguf_name = gg, .unpermute_heads = unpermute,
                                     .minus_one = gemma && gg.ends_with("norm.weight"), .expert = expert};
  };
  // A stacked tensor of `experts` experts' [rows][cols] (or a bias's [rows]) as one Hugging
  // Face tensor per expert, each its slice; `missing` says why the tensor must be there.
  auto add_experts = [&](const std::string& gg, const std::string& f, const std::string& hf, size_t dims,
                         const std::string& missing) {
    const GGUFTensorInfo* t = h.find_tensor(gg);
    if (!t) throw Error(label + ": " + missing + " " + gg);
    if (t->ne.size() != dims || t->ne.back() != experts)
      throw Error(label + ": " + gg + " is not [" + std::to_string(experts) + " experts]" +
                  (dims == 3 ? "[rows][cols]" : "[rows]") + " (expert_count says " + std::to_string(experts) + ")");
    for (int64_t e = 0; e < experts; ++e) add(f + "mlp.experts." + std::to_string(e) + "." + hf, gg, 0, int(e));
  };
  add("model.embed_tokens.weight", "token_embd.weight");
  add("model.norm.weight", "output_norm.weight");
  add("lm_head.weight", "output.weight");
  const int kv_heads = c["num_key_value_heads"].get<int>();
  for (int64_t i = 0; i < layers; ++i) {
    const std::string g = "blk." + std::to_string(i) + ".", f = "model.layers." + std::to_string(i) + ".";
    const auto& table = gemma     ? std::span<const NamePair>(kGemmaLayer)
                        : gpt_oss ? std::span<const NamePair>(kGptOssLayer)
                                  : std::span<const NamePair>(kLlamaLayer);
    for (const NamePair& n : table) {
      int unpermute = 0;
      if (*arch == "llama" && std::string_view(n.gguf).starts_with("attn_q.")) unpermute = int(heads);
      if (*arch == "llama" && std::string_view(n.gguf).starts_with("attn_k.")) unpermute = kv_heads;
      add(f + n.hf, g + n.gguf, unpermute);
    }
    if (gpt_oss) {
      if (h.find_tensor(g + "ffn_gate_up_exps.weight"))
        throw Error(label + ": " + g + "ffn_gate_up_exps.weight (gate and up fused, convert_hf_to_gguf.py's "
                    "--fuse-gate-up-exps) is not supported yet; convert without it (separate ffn_gate_exps / ffn_up_exps)");
      for (const auto& [gg, hf] : {std::pair{"ffn_gate_exps", "gate_proj"}, std::pair{"ffn_up_exps", "up_proj"},
                                   std::pair{"ffn_down_exps", "down_proj"}})
        for (const auto& [suffix, dims] : {std::pair{".weight", size_t(3)}, std::pair{".bias", size_t(2)}})
          add_experts(g + gg + suffix, f, std::string(hf) + suffix, dims, "gpt-oss layer " + std::to_string(i) + " has no");
      continue;
    }
    if (!moe || !h.find_tensor(g + "ffn_gate_inp.weight")) continue;
    add(f + "mlp.gate.weight", g + "ffn_gate_inp.weight");
    for (const auto& [gg, hf] : {std::pair{"ffn_gate_exps.weight", "gate_proj.weight"},
                                 std::pair{"ffn_up_exps.weight", "up_proj.weight"},
                                 std::pair{"ffn_down_exps.weight", "down_proj.weight"}})
      add_experts(g + gg, f, hf, 3, "layer " + std::to_string(i) + " has a router but no");
  }
  std::set<std::string_view> used;
  for (const auto& [hf, src] : m.tensors) used.insert(src.gguf_name);
  for (const GGUFTensorInfo& t : h.tensors) {
    if (!used.count(t.name) && t.name != "rope_freqs.weight")
      throw Error(label + ": GGUF tensor '" + t.name + "' has no place in a " + *arch +
                  " model; the file is not what its metadata says");
  }
  return m;
}

int64_t llama_head_source_row(int64_t row, int heads, int64_t rows) {
  const int64_t hd = rows / heads, half = hd / 2, h = row / hd, j = row % hd;
  return h * hd + (j < half ? 2 * j : 2 * (j - half) + 1);  // Hugging Face's halves from GGUF's pairs
}

void unpermute_llama_heads(std::vector<float>& w, int heads, int64_t rows, int64_t cols) {
  if (heads <= 0 || rows % heads != 0 || (rows / heads) % 2 != 0 || int64_t(w.size()) != rows * cols)
    throw Error("unpermute_llama_heads: " + std::to_string(rows) + " rows are not " + std::to_string(heads) +
                " heads of an even size");
  std::vector<float> out(w.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = w.data() + llama_head_source_row(r, heads, rows) * cols;
    std::copy(src, src + cols, out.data() + r * cols);
  }
  w.swap(out);
}

void add_rope_freq_factors(const GGUFFile& f, GGUFModel& m) {
  if (m.rope_freqs.empty()) return;
  const std::vector<float> v = load_gguf_tensor(f, GGUFTensorSource{.gguf_name = m.rope_freqs});
  for (float x : v)
    if (!(x > 0) || !std::isfinite(x)) throw Error(f.path().string() + ": rope_freqs.weight holds " + std::to_string(x));
  m.config["rope_freq_factors"] = v;
}

std::string gguf_source_label(const GGUFTensorSource& src) {
  const std::string t = "GGUF tensor '" + src.gguf_name + "'";
  return src.expert < 0 ? t : "expert " + std::to_string(src.expert) + " of " + t;
}

std::vector<int64_t> gguf_source_shape(const GGUFTensorInfo& t, const GGUFTensorSource& src) {
  if (src.expert < 0) return t.shape;
  return std::vector<int64_t>(t.shape.begin() + 1, t.shape.end());  // the expert axis is the outermost
}

std::span<const uint8_t> gguf_source_bytes(const GGUFFile& f, const GGUFTensorInfo& t, const GGUFTensorSource& src) {
  const std::span<const uint8_t> all = f.data(t);
  if (src.expert < 0) return all;
  if (t.ne.size() < 2 || src.expert >= t.ne.back())
    throw Error(f.path().string() + ": GGUF tensor '" + t.name + "' has no expert " + std::to_string(src.expert));
  const size_t per = all.size() / size_t(t.ne.back());  // whole rows of blocks: the file's size check saw to it
  return all.subspan(size_t(src.expert) * per, per);
}

std::vector<float> load_gguf_tensor(const GGUFFile& f, const GGUFTensorSource& src) {
  const GGUFTensorInfo* t = f.header().find_tensor(src.gguf_name);
  if (!t) throw Error(f.path().string() + ": no GGUF tensor '" + src.gguf_name + "'");
  int64_t n = 1;
  for (int64_t d : gguf_source_shape(*t, src)) n *= d;
  std::vector<float> v(static_cast<size_t>(n));
  dequantize_ggml(t->type, gguf_source_bytes(f, *t, src), v);
  if (src.unpermute_heads > 0) {
    const int64_t cols = t->ne[0], rows = t->numel() / cols;
    if (t->ne.size() == 1) unpermute_llama_heads(v, src.unpermute_heads, t->ne[0], 1);  // a bias
    else unpermute_llama_heads(v, src.unpermute_heads, rows, cols);
  }
  if (src.minus_one)
    for (float& x : v) x -= 1.0f;
  return v;
}

}  // namespace kvlm

#include "config/model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"

namespace kvlm {

using nlohmann::json;
namespace jg = json_get;

std::string_view arch_name(Arch a) {
  switch (a) {
    case Arch::Llama: return "LlamaForCausalLM";
    case Arch::Qwen2: return "Qwen2ForCausalLM";
    case Arch::Qwen3: return "Qwen3ForCausalLM";
    case Arch::Mistral: return "MistralForCausalLM";
    case Arch::Gemma3: return "Gemma3ForCausalLM";
    case Arch::DFlashDraft: return "DFlashDraftModel";
  }
  return "?";
}

std::string_view glu_activation_name(GluActivation a) {
  switch (a) {
    case GluActivation::Silu: return "silu";
    case GluActivation::GeluTanh: return "gelu_pytorch_tanh";
  }
  return "?";
}

std::string_view rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::Default: return "default";
    case RopeType::Linear: return "linear";
    case RopeType::Llama3: return "llama3";
  }
  return "?";
}

std::string_view attention_kind_name(AttentionKind k) {
  switch (k) {
    case AttentionKind::Full: return "full";
    case AttentionKind::Sliding: return "sliding";
    case AttentionKind::NonCausal: return "non-causal";
  }
  return "?";
}

namespace {

constexpr std::string_view kWhere = "config.json";

Arch parse_arch(const json& cfg) {
  const auto* archs = jg::find(cfg, "architectures");
  std::string name;
  if (archs && archs->is_array() && !archs->empty() && (*archs)[0].is_string()) {
    name = (*archs)[0].get<std::string>();
  } else if (auto mt = jg::opt_string(cfg, "model_type", kWhere)) {
    // Some configs carry only model_type.
    if (*mt == "llama") return Arch::Llama;
    if (*mt == "qwen2") return Arch::Qwen2;
    if (*mt == "qwen3") return Arch::Qwen3;
    if (*mt == "mistral") return Arch::Mistral;
    if (*mt == "gemma3_text") return Arch::Gemma3;
    name = "model_type " + *mt;
  } else {
    throw Error("config.json: no 'architectures' list and no 'model_type'; is this a Hugging Face model directory?");
  }
  for (Arch a : {Arch::Llama, Arch::Qwen2, Arch::Qwen3, Arch::Mistral, Arch::Gemma3, Arch::DFlashDraft})
    if (arch_name(a) == name) return a;
  throw Error("config.json: unsupported architecture '" + name +
              "'; kvlm supports LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM, "
              "Gemma3ForCausalLM (and DFlashDraftModel drafters)");
}

// `params`: transformers-5 rope_parameters (or one layer type's entry of it); else the Hub's
// rope_theta (default `theta`) plus an optional rope_scaling object.
RopeConfig parse_rope(const json& cfg, const json* params, double theta, const std::string& params_where) {
  RopeConfig r;
  r.theta = theta;
  const json* scaling = jg::find(cfg, "rope_scaling");
  if (params && !params->is_object()) throw Error(params_where + " must be an object");
  if (scaling && !scaling->is_object()) throw Error("config.json: 'rope_scaling' must be an object or null");
  const json* s = params ? params : scaling;
  if (auto t = jg::opt_number(cfg, "rope_theta", kWhere)) r.theta = *t;
  if (params)
    if (auto t = jg::opt_number(*params, "rope_theta", params_where)) r.theta = *t;
  if (!(r.theta > 0)) throw Error("config.json: rope_theta must be positive");
  if (!s) return r;
  const std::string where = params ? params_where : "config.json rope_scaling";
  std::string type = jg::opt_string(*s, "rope_type", where).value_or("");
  if (type.empty()) type = jg::opt_string(*s, "type", where).value_or("default");
  if (type == "default") return r;
  auto factor = jg::opt_number(*s, "factor", where);
  if (type == "linear") {
    r.type = RopeType::Linear;
    if (!factor || *factor <= 0) throw Error(where + ": linear rope scaling needs a positive 'factor'");
    r.factor = *factor;
    return r;
  }
  if (type == "llama3") {
    r.type = RopeType::Llama3;
    if (!factor || *factor <= 0) throw Error(where + ": llama3 rope scaling needs a positive 'factor'");
    r.factor = *factor;
    r.low_freq_factor = jg::opt_number(*s, "low_freq_factor", where).value_or(1.0);
    r.high_freq_factor = jg::opt_number(*s, "high_freq_factor", where).value_or(4.0);
    r.original_max_position = int(jg::opt_int(*s, "original_max_position_embeddings", where).value_or(8192));
    if (r.high_freq_factor <= r.low_freq_factor)
      throw Error(where + ": llama3 rope scaling needs high_freq_factor > low_freq_factor");
    if (r.original_max_position <= 0) throw Error(where + ": original_max_position_embeddings must be positive");
    return r;
  }
  throw Error(where + ": rope type '" + type + "' is not supported; kvlm supports default, linear, llama3");
}

std::optional<CheckpointKVScheme> parse_kv_scheme(const json& cfg) {
  const json* qc = jg::find(cfg, "quantization_config");
  if (!qc) return std::nullopt;
  if (!qc->is_object()) throw Error("config.json: 'quantization_config' must be an object");
  const std::string where = "config.json quantization_config";
  const std::string method = jg::opt_string(*qc, "quant_method", where).value_or("");
  if (method == "compressed-tensors") {
    const json* kvs = jg::find(*qc, "kv_cache_scheme");
    if (!kvs) return std::nullopt;
    if (!kvs->is_object()) throw Error(where + ": 'kv_cache_scheme' must be an object or null");
    CheckpointKVScheme s;
    s.origin = "compressed-tensors kv_cache_scheme";
    const auto bits = jg::opt_int(*kvs, "num_bits", where + ".kv_cache_scheme").value_or(8);
    const auto type = jg::opt_string(*kvs, "type", where + ".kv_cache_scheme").value_or("float");
    const auto strategy = jg::opt_string(*kvs, "strategy", where + ".kv_cache_scheme").value_or("tensor");
    const bool dynamic = jg::opt_bool(*kvs, "dynamic", where + ".kv_cache_scheme").value_or(false);
    if (bits == 8 && type == "float" && !dynamic && (strategy == "tensor" || strategy == "attn_head")) {
      s.storage = KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
      s.per_head_scales = strategy == "attn_head";
    } else {
      s.unsupported_reason = "the checkpoint declares a KV cache scheme kvlm cannot hold (" + s.origin +
                             " num_bits=" + std::to_string(bits) + " type=" + type + " strategy=" + strategy +
                             (dynamic ? " dynamic" : "") + ")";
    }
    return s;
  }
  if (method == "modelopt") {
    // ModelOpt writes the algorithm at the top level of quantization_config, or nested
    // under "quantization" (hf_quant_config.json layout).
    const json* src = qc;
    if (const json* nested = jg::find(*qc, "quantization"); nested && nested->is_object()) src = nested;
    auto algo = jg::opt_string(*src, "kv_cache_quant_algo", where);
    if (!algo) return std::nullopt;
    CheckpointKVScheme s;
    s.origin = "modelopt kv_cache_quant_algo";
    if (*algo == "FP8") {
      s.storage = KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
    } else {
      s.unsupported_reason = "the checkpoint declares kv_cache_quant_algo '" + *algo + "', which kvlm cannot hold";
    }
    return s;
  }
  return std::nullopt;
}

std::vector<TokenId> token_list(const json& obj, std::string_view key, std::string_view where) {
  std::vector<TokenId> out;
  const json* v = jg::find(obj, key);
  if (!v) return out;
  auto one = [&](const json& x) {
    if (!x.is_number_integer() || x.get<long long>() < 0)
      throw Error(std::string(where) + ": '" + std::string(key) + "' must be a token id or a list of token ids");
    out.push_back(TokenId(x.get<long long>()));
  };
  if (v->is_array())
    for (const auto& x : *v) one(x);
  else
    one(*v);
  return out;
}

// A positive integer field, capped at `max` so that a corrupt config cannot make kvlm try
// to allocate absurd amounts before any tensor is checked.
int positive(const json& cfg, std::string_view key, long long max = 1 << 30) {
  const long long v = jg::req_int(cfg, key, kWhere);
  if (v <= 0) throw Error("config.json: '" + std::string(key) + "' must be a positive integer, got " + std::to_string(v));
  if (v > max)
    throw Error("config.json: '" + std::string(key) + "' is " + std::to_string(v) + ", above the largest value kvlm accepts (" +
                std::to_string(max) + "); is the file corrupt?");
  return int(v);
}

// DFlash's fields; every drafter layer attends non-causally (the block sees itself whole and
// the context before it). target_layer_ids default as the DFlash reference code builds them:
// one layer for a 1-layer drafter (the middle one), else spread evenly over [1, N - 3].
DFlashConfig parse_dflash(const json& cfg, ModelConfig& m) {
  DFlashConfig d;
  const std::string where = "config.json (DFlash drafter)";
  d.block_size = int(jg::req_int(cfg, "block_size", where));
  if (d.block_size < 2 || d.block_size > 64)
    throw Error(where + ": block_size must be between 2 and 64, got " + std::to_string(d.block_size));
  d.num_target_layers = int(jg::opt_int(cfg, "num_target_layers", where).value_or(0));
  const json* dc = jg::find(cfg, "dflash_config");
  if (!dc || !dc->is_object()) throw Error(where + ": 'dflash_config' (mask_token_id, target_layer_ids) is missing");
  const auto mask = jg::opt_int(*dc, "mask_token_id", where + " dflash_config");
  if (!mask) throw Error(where + ": dflash_config.mask_token_id is missing");
  if (*mask < 0 || *mask >= m.vocab_size)
    throw Error(where + ": dflash_config.mask_token_id " + std::to_string(*mask) + " is outside the vocabulary");
  d.mask_token_id = TokenId(*mask);
  if (const json* ids = jg::find(*dc, "target_layer_ids")) {
    if (!ids->is_array() || ids->empty()) throw Error(where + ": dflash_config.target_layer_ids must be a non-empty list");
    for (const json& v : *ids) {
      if (!v.is_number_integer() || v.get<long long>() < 0)
        throw Error(where + ": dflash_config.target_layer_ids must hold non-negative layer indices");
      d.target_layer_ids.push_back(int(v.get<long long>()));
    }
  } else {
    if (d.num_target_layers <= 0)
      throw Error(where + ": dflash_config.target_layer_ids is missing and there is no num_target_layers to derive it");
    const int n = d.num_target_layers, k = m.num_layers;
    if (k == 1) {
      d.target_layer_ids = {n / 2};
    } else {
      const double start = 1, span = double(n - 3) - start;
      for (int i = 0; i < k; ++i) d.target_layer_ids.push_back(int(std::nearbyint(start + double(i) * span / double(k - 1))));  // Python's round: ties to even
    }
  }
  for (const auto& l : m.layers)
    if (l.kind == AttentionKind::Sliding)
      throw Error(where + ": sliding-window drafter layers are not supported (a DFlash block attends to its whole context)");
  for (auto& l : m.layers) l = {AttentionKind::NonCausal, 0};
  return d;
}

}  // namespace

ModelConfig parse_model_config(const json& cfg, const json* gen) {
  if (!cfg.is_object()) throw Error("config.json: the top level must be a JSON object");
  ModelConfig m;
  m.arch = parse_arch(cfg);
  m.hidden_size = positive(cfg, "hidden_size", 1 << 17);
  m.intermediate_size = positive(cfg, "intermediate_size", 1 << 20);
  m.num_layers = positive(cfg, "num_hidden_layers", 1024);
  m.num_heads = positive(cfg, "num_attention_heads", 1024);
  m.num_kv_heads = jg::find(cfg, "num_key_value_heads") ? positive(cfg, "num_key_value_heads", 1024) : m.num_heads;
  m.vocab_size = positive(cfg, "vocab_size", 1 << 24);
  if (jg::find(cfg, "head_dim")) {
    m.head_dim = positive(cfg, "head_dim", 1024);
  } else {
    if (m.hidden_size % m.num_heads != 0)
      throw Error("config.json: hidden_size " + std::to_string(m.hidden_size) + " is not divisible by num_attention_heads " +
                  std::to_string(m.num_heads) + " and no head_dim is given");
    m.head_dim = m.hidden_size / m.num_heads;
  }
  if (m.num_heads % m.num_kv_heads != 0)
    throw Error("config.json: num_attention_heads " + std::to_string(m.num_heads) + " is not a multiple of num_key_value_heads " +
                std::to_string(m.num_kv_heads));
  if (m.head_dim % 2 != 0) throw Error("config.json: head_dim must be even for rotary embeddings, got " + std::to_string(m.head_dim));
  m.max_position_embeddings = jg::find(cfg, "max_position_embeddings") ? positive(cfg, "max_position_embeddings") : 2048;
  m.rms_norm_eps = jg::opt_number(cfg, "rms_norm_eps", kWhere).value_or(1e-6);
  if (!(m.rms_norm_eps >= 0)) throw Error("config.json: rms_norm_eps must be non-negative");
  const bool gemma = m.arch == Arch::Gemma3;
  // Gemma configs name the activation hidden_activation; the others hidden_act.
  std::optional<std::string> act = jg::opt_string(cfg, gemma ? "hidden_activation" : "hidden_act", kWhere);
  if (!act && gemma) act = jg::opt_string(cfg, "hidden_act", kWhere);
  if (gemma) {
    if (act && *act != "gelu_pytorch_tanh")
      throw Error("config.json: hidden_activation '" + *act + "' is not supported for Gemma 3; kvlm supports gelu_pytorch_tanh");
    m.hidden_act = GluActivation::GeluTanh;
  } else if (act && *act != "silu") {
    throw Error("config.json: hidden_act '" + *act + "' is not supported; kvlm supports silu");
  }
  const json* rope_params = jg::find(cfg, "rope_parameters");
  if (gemma) {
    // Global layers: rope_theta (default 1e6) with rope_scaling; sliding layers: plain RoPE
    // with rope_local_base_freq (default 1e4). transformers 5 writes both as rope_parameters
    // keyed by layer type.
    const json* full = rope_params && rope_params->is_object() ? jg::find(*rope_params, "full_attention") : nullptr;
    const json* local = rope_params && rope_params->is_object() ? jg::find(*rope_params, "sliding_attention") : nullptr;
    m.rope = parse_rope(cfg, full ? full : (local ? nullptr : rope_params), 1e6, "config.json rope_parameters.full_attention");
    RopeConfig l;
    l.theta = jg::opt_number(cfg, "rope_local_base_freq", kWhere).value_or(1e4);
    if (local) {
      const json none = json::object();
      l = parse_rope(none, local, l.theta, "config.json rope_parameters.sliding_attention");
    }
    if (!(l.theta > 0)) throw Error("config.json: rope_local_base_freq must be positive");
    m.rope_local = l;
    m.query_pre_attn_scalar = jg::opt_number(cfg, "query_pre_attn_scalar", kWhere).value_or(256.0);
    if (!(*m.query_pre_attn_scalar > 0)) throw Error("config.json: query_pre_attn_scalar must be positive");
    for (const char* cap : {"final_logit_softcapping", "attn_logit_softcapping"})
      if (jg::opt_number(cfg, cap, kWhere))
        throw Error(std::string("config.json: ") + cap + " is set; kvlm does not implement logit soft-capping (Gemma 2)");
  } else {
    m.rope = parse_rope(cfg, rope_params, 10000.0, "config.json rope_parameters");
    if (const json* ff = jg::find(cfg, "rope_freq_factors")) {
      if (!ff->is_array() || ff->size() != size_t(m.head_dim / 2))
        throw Error("config.json: rope_freq_factors must be a list of head_dim / 2 = " + std::to_string(m.head_dim / 2) +
                    " numbers");
      for (const json& f : *ff) {
        if (!f.is_number() || !(f.get<double>() > 0) || !std::isfinite(f.get<double>()))
          throw Error("config.json: rope_freq_factors must hold positive finite numbers");
        m.rope.freq_factors.push_back(f.get<double>());
      }
    }
  }
  m.tie_word_embeddings = jg::opt_bool(cfg, "tie_word_embeddings", kWhere).value_or(gemma);
  const bool attention_bias = jg::opt_bool(cfg, "attention_bias", kWhere).value_or(false);
  switch (m.arch) {
    case Arch::Qwen2:
      m.qkv_bias = true;  // Qwen2 always has q/k/v biases and no o_proj bias.
      break;
    case Arch::Qwen3:
    case Arch::DFlashDraft:
      m.qk_norm = true;
      m.qkv_bias = m.o_bias = attention_bias;
      break;
    case Arch::Llama:
    case Arch::Mistral:
      m.qkv_bias = m.o_bias = attention_bias;
      m.mlp_bias = jg::opt_bool(cfg, "mlp_bias", kWhere).value_or(false);
      break;
    case Arch::Gemma3:
      m.qk_norm = true;
      m.qkv_bias = m.o_bias = attention_bias;
      break;
  }
  std::optional<std::string> dt = jg::opt_string(cfg, "torch_dtype", kWhere);
  if (!dt) dt = jg::opt_string(cfg, "dtype", kWhere);
  if (dt) {
    m.declared_dtype = dtype_from_torch_name(*dt);
    if (!m.declared_dtype) throw Error("config.json: torch_dtype '" + *dt + "' is not supported; kvlm loads bfloat16, float16 and float32");
  }

  // Per-layer attention. Mirrors transformers: sliding_window is dropped unless
  // use_sliding_window (Qwen2/Qwen3); layer_types, when absent, marks layers at or after
  // max_window_layers as sliding (Qwen2/Qwen3) or every layer (Mistral).
  int window = 0;  // 0: no sliding window
  if (auto w = jg::opt_int(cfg, "sliding_window", kWhere)) {
    if (*w <= 0) throw Error("config.json: sliding_window must be positive or null");
    window = int(std::min<long long>(*w, 1 << 30));
  }
  const bool qwen = m.arch == Arch::Qwen2 || m.arch == Arch::Qwen3 || m.arch == Arch::DFlashDraft;
  if (qwen && !jg::opt_bool(cfg, "use_sliding_window", kWhere).value_or(false)) window = 0;
  if (m.arch == Arch::Llama) window = 0;
  if (gemma && !jg::find(cfg, "sliding_window")) window = 4096;  // transformers' Gemma3TextConfig default
  m.layers.assign(size_t(m.num_layers), LayerAttention{});
  if (const json* lt = jg::find(cfg, "layer_types")) {
    if (!lt->is_array() || lt->size() != size_t(m.num_layers))
      throw Error("config.json: 'layer_types' must be a list with one entry per layer (" + std::to_string(m.num_layers) + ")");
    for (size_t i = 0; i < lt->size(); ++i) {
      const json& t = (*lt)[i];
      if (!t.is_string()) throw Error("config.json: layer_types[" + std::to_string(i) + "] must be a string");
      const std::string s = t.get<std::string>();
      if (s == "sliding_attention") {
        if (window > 0) m.layers[i] = {AttentionKind::Sliding, window};
      } else if (s != "full_attention") {
        throw Error("config.json: layer_types[" + std::to_string(i) + "] is '" + s +
                    "'; kvlm supports full_attention and sliding_attention");
      }
    }
  } else if (gemma && window > 0) {
    // No layer_types: every sliding_window_pattern-th layer is global, the others sliding.
    std::optional<long long> pattern = jg::opt_int(cfg, "sliding_window_pattern", kWhere);
    if (!pattern) pattern = jg::opt_int(cfg, "_sliding_window_pattern", kWhere);
    const long long every = pattern.value_or(6);
    if (every <= 0) throw Error("config.json: sliding_window_pattern must be positive");
    for (int i = 0; i < m.num_layers; ++i)
      if ((i + 1) % every != 0) m.layers[size_t(i)] = {AttentionKind::Sliding, window};
  } else if (window > 0) {
    const long long first_sliding = qwen ? jg::opt_int(cfg, "max_window_layers", kWhere).value_or(m.num_layers) : 0;
    for (int i = 0; i < m.num_layers; ++i)
      if (i >= first_sliding) m.layers[size_t(i)] = {AttentionKind::Sliding, window};
  }

  const auto bos = token_list(cfg, "bos_token_id", kWhere);
  if (!bos.empty()) m.bos_token_id = bos.front();
  m.eos_token_ids = token_list(cfg, "eos_token_id", kWhere);
  if (gen) {
    auto g = token_list(*gen, "eos_token_id", "generation_config.json");
    if (!g.empty()) m.eos_token_ids = std::move(g);
    auto gb = token_list(*gen, "bos_token_id", "generation_config.json");
    if (!gb.empty()) m.bos_token_id = gb.front();
    constexpr std::string_view kGen = "generation_config.json";
    // Sampling defaults only apply when the checkpoint asks for sampling (do_sample true).
    if (jg::opt_bool(*gen, "do_sample", kGen).value_or(false)) {
      if (auto t = jg::opt_number(*gen, "temperature", kGen)) m.default_temperature = float(*t);
      if (auto t = jg::opt_number(*gen, "top_p", kGen)) m.default_top_p = float(*t);
      if (auto t = jg::opt_int(*gen, "top_k", kGen)) m.default_top_k = int(*t);
      if (auto t = jg::opt_number(*gen, "min_p", kGen)) m.default_min_p = float(*t);
    }
  }
  for (TokenId t : m.eos_token_ids)
    if (t >= m.vocab_size) throw Error("config.json: eos_token_id " + std::to_string(t) + " is outside the vocabulary");
  m.kv_scheme = parse_kv_scheme(cfg);
  m.weight_quant = parse_weight_quant(cfg);
  if (m.arch == Arch::DFlashDraft) m.dflash = parse_dflash(cfg, m);
  return m;
}

json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::parse_error& e) {
    throw Error(path.string() + " is not valid JSON: " + e.what());
  }
}

std::optional<std::filesystem::path> find_gguf(const std::filesystem::path& path) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) {
    if (path.extension() == ".gguf") return path;
    return std::nullopt;
  }
  if (!std::filesystem::is_directory(path, ec) || std::filesystem::exists(path / "config.json", ec)) return std::nullopt;
  std::vector<std::filesystem::path> found;
  for (const auto& e : std::filesystem::directory_iterator(path, ec))
    if (e.is_regular_file(ec) && e.path().extension() == ".gguf") found.push_back(e.path());
  if (found.size() > 1)
    throw Error("'" + path.string() + "' holds " + std::to_string(found.size()) +
                " .gguf files; point --model at the one to load");
  if (found.empty()) return std::nullopt;
  return found.front();
}

void check_model_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  if (find_gguf(dir)) return;
  if (std::filesystem::is_regular_file(dir, ec))
    throw Error("--model '" + dir.string() + "' is a file but not a .gguf file; point --model at a Hugging Face model "
                "directory or a GGUF file");
  if (!std::filesystem::exists(dir, ec)) {
    // ORG/NAME that is not a local path is a Hugging Face Hub id: kvlm reads local files only.
    const std::string p = dir.generic_string();
    const auto slash = p.find('/');
    const bool hub_id = dir.is_relative() && slash != std::string::npos && slash > 0 && slash + 1 < p.size() &&
                        p.find('/', slash + 1) == std::string::npos && p[0] != '.';
    if (hub_id)
      throw Error("'" + p + "' is not a local path: kvlm does not download models. Fetch it first, e.g. "
                  "`huggingface-cli download " + p + " --local-dir models/" + p.substr(slash + 1) +
                  "`, then pass --model models/" + p.substr(slash + 1) + " (a .gguf file works too)");
    throw Error("model '" + p + "' does not exist; give a Hugging Face model directory (with config.json) or a .gguf file");
  }
  if (!std::filesystem::is_directory(dir, ec))
    throw Error("model '" + dir.string() + "' is not a directory or a .gguf file");
  if (!std::filesystem::exists(dir / "config.json", ec))
    throw Error("'" + dir.string() + "' has no config.json (nor a .gguf file); point --model at a Hugging Face model "
                "directory or a GGUF file");
}

ModelConfig load_model_config(const std::filesystem::path& dir) {
  check_model_dir(dir);
  std::error_code ec;
  const auto cfg_path = dir / "config.json";
  json cfg = read_json_file(cfg_path);
  // ModelOpt writes its scheme to hf_quant_config.json ({"quantization": {"quant_algo": ...}});
  // newer exports also copy it into config.json, which then wins.
  if (const auto hq = dir / "hf_quant_config.json"; std::filesystem::exists(hq, ec) && cfg.is_object() &&
                                                   !json_get::find(cfg, "quantization_config")) {
    const json h = read_json_file(hq);
    const json* q = json_get::find(h, "quantization");
    if (!q || !q->is_object()) throw Error(hq.string() + ": expected a 'quantization' object (a ModelOpt export)");
    cfg["quantization_config"] = {{"quant_method", "modelopt"}, {"quantization", *q}};
  }
  const auto gen_path = dir / "generation_config.json";
  if (std::filesystem::exists(gen_path, ec)) {
    const json gen = read_json_file(gen_path);
    return parse_model_config(cfg, &gen);
  }
  return parse_model_config(cfg, nullptr);
}

}  // namespace kvlm

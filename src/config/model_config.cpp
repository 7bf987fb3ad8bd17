#include "config/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"

namespace kvlm {

using nlohmann::json;
namespace jg = json_get;

std::string_view glu_activation_name(GluActivation a) {
  switch (a) {
    case GluActivation::Silu: return "silu";
    case GluActivation::GeluTanh: return "gelu_pytorch_tanh";
    case GluActivation::SwigluClamp: return "clamped swiglu";
  }
  return "?";
}

std::string_view rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::Default: return "default";
    case RopeType::Linear: return "linear";
    case RopeType::Llama3: return "llama3";
    case RopeType::Yarn: return "yarn";
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

const ArchSpec* parse_arch(const json& cfg) {
  const auto* archs = jg::find(cfg, "architectures");
  std::string name;
  if (archs && archs->is_array() && !archs->empty() && (*archs)[0].is_string()) {
    name = (*archs)[0].get<std::string>();
    for (const ArchSpec* a : architectures())
      if (a->name == name) return a;
  } else if (auto mt = jg::opt_string(cfg, "model_type", kWhere)) {
    // Some configs carry only model_type.
    for (const ArchSpec* a : architectures())
      if (std::ranges::find(a->model_types, *mt) != a->model_types.end()) return a;
    name = "model_type " + *mt;
  } else {
    throw Error("config.json: no 'architectures' list and no 'model_type'; is this a Hugging Face model directory?");
  }
  std::string known;
  for (const ArchSpec* a : architectures())
    if (a->make) known += (known.empty() ? "" : ", ") + std::string(a->name);
  throw Error("config.json: unsupported architecture '" + name + "'; kvlm supports " + known +
              " (and DFlashDraftModel drafters)");
}

}  // namespace

std::string_view arch_name(const ArchSpec* a) { return a ? a->name : std::string_view("?"); }

namespace arch_config {

// `params`: transformers-5 rope_parameters (or one layer type's entry of it); else the Hub's
// rope_theta (default `theta`) plus an optional rope_scaling object.
RopeConfig parse_rope(const json& cfg, const json* params, double theta, const std::string& params_where) {
  using namespace json_get;
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
  if (type == "yarn") {
    r.type = RopeType::Yarn;
    if (!factor || *factor <= 0) throw Error(where + ": yarn rope scaling needs a positive 'factor'");
    r.factor = *factor;
    r.beta_fast = jg::opt_number(*s, "beta_fast", where).value_or(32.0);
    r.beta_slow = jg::opt_number(*s, "beta_slow", where).value_or(1.0);
    r.truncate = jg::opt_bool(*s, "truncate", where).value_or(true);
    // The length the model was trained at (required, as transformers 5 requires it).
    const auto orig = jg::opt_int(*s, "original_max_position_embeddings", where);
    if (!orig) throw Error(where + ": yarn rope scaling needs original_max_position_embeddings");
    r.original_max_position = int(std::min<long long>(*orig, 1 << 30));
    if (r.original_max_position <= 0) throw Error(where + ": original_max_position_embeddings must be positive");
    // attention_factor, else 0.1 ln(factor) + 1 (1 for factor <= 1), or DeepSeek's ratio of
    // two such terms when mscale and mscale_all_dim are both given.
    auto mscale_of = [&](double m) { return r.factor <= 1.0 ? 1.0 : 0.1 * m * std::log(r.factor) + 1.0; };
    const double ms = jg::opt_number(*s, "mscale", where).value_or(0.0);
    const double ms_all = jg::opt_number(*s, "mscale_all_dim", where).value_or(0.0);
    r.attention_factor = jg::opt_number(*s, "attention_factor", where)
                             .value_or(ms != 0.0 && ms_all != 0.0 ? mscale_of(ms) / mscale_of(ms_all) : mscale_of(1.0));
    if (!(r.attention_factor > 0)) throw Error(where + ": yarn's attention_factor must be positive");
    if (!(r.beta_fast > 0) || !(r.beta_slow > 0)) throw Error(where + ": yarn's beta_fast and beta_slow must be positive");
    return r;
  }
  throw Error(where + ": rope type '" + type + "' is not supported; kvlm supports default, linear, llama3, yarn");
}

void parse_standard_rope(const json& cfg, ModelConfig& m) {
  m.rope = parse_rope(cfg, jg::find(cfg, "rope_parameters"), 10000.0, "config.json rope_parameters");
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

void require_silu(const json& cfg, std::string_view family) {
  if (auto act = jg::opt_string(cfg, "hidden_act", kWhere); act && *act != "silu")
    throw Error("config.json: hidden_act '" + *act + "' is not supported for " + std::string(family) +
                "; kvlm supports silu");
}

int sliding_window(const json& cfg) {
  const auto w = jg::opt_int(cfg, "sliding_window", kWhere);
  if (!w) return 0;
  if (*w <= 0) throw Error("config.json: sliding_window must be positive or null");
  return int(std::min<long long>(*w, 1 << 30));
}

void set_layer_windows(const json& cfg, ModelConfig& m, int window, const std::function<bool(int)>& sliding_by_default) {
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
    return;
  }
  if (window > 0)
    for (int i = 0; i < m.num_layers; ++i)
      if (sliding_by_default(i)) m.layers[size_t(i)] = {AttentionKind::Sliding, window};
}

void set_qwen_layer_windows(const json& cfg, ModelConfig& m) {
  const int window = jg::opt_bool(cfg, "use_sliding_window", kWhere).value_or(false) ? sliding_window(cfg) : 0;
  const long long first_sliding = jg::opt_int(cfg, "max_window_layers", kWhere).value_or(m.num_layers);
  set_layer_windows(cfg, m, window, [&](int i) { return i >= first_sliding; });
}

void parse_expert_counts(const json& cfg, std::string_view preferred, MoeConfig& e) {
  const std::string_view other = preferred == "num_experts" ? "num_local_experts" : "num_experts";
  e.num_experts = positive_int(cfg, jg::find(cfg, preferred) ? preferred : other, 1 << 12);
  e.top_k = positive_int(cfg, "num_experts_per_tok", 1 << 12);
  if (e.top_k > e.num_experts)
    throw Error("config.json: num_experts_per_tok " + std::to_string(e.top_k) + " exceeds the " +
                std::to_string(e.num_experts) + " experts");
}

void set_sparse_layers(const json& cfg, ModelConfig& m) {
  const int step = positive_int(cfg, "decoder_sparse_step", 1024, 1);
  std::vector<bool> dense(size_t(m.num_layers), false);
  if (const json* d = jg::find(cfg, "mlp_only_layers"); d && !d->is_null()) {
    if (!d->is_array()) throw Error("config.json: mlp_only_layers must be a list of layer indices");
    for (const json& v : *d) {
      if (!v.is_number_integer() || v.get<long long>() < 0 || v.get<long long>() >= m.num_layers)
        throw Error("config.json: mlp_only_layers holds " + v.dump() + ", not a layer index below " +
                    std::to_string(m.num_layers));
      dense[size_t(v.get<long long>())] = true;
    }
  }
  m.moe_layers.assign(size_t(m.num_layers), false);
  for (int i = 0; i < m.num_layers; ++i) m.moe_layers[size_t(i)] = !dense[size_t(i)] && (i + 1) % step == 0;
}

int positive_int(const json& cfg, std::string_view key, long long max, std::optional<int> fallback) {
  if (fallback && !jg::find(cfg, key)) return *fallback;
  const long long v = jg::req_int(cfg, key, kWhere);
  if (v <= 0) throw Error("config.json: '" + std::string(key) + "' must be a positive integer, got " + std::to_string(v));
  if (v > max)
    throw Error("config.json: '" + std::string(key) + "' is " + std::to_string(v) + ", above the largest value kvlm accepts (" +
                std::to_string(max) + "); is the file corrupt?");
  return int(v);
}

}  // namespace arch_config

namespace {

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

}  // namespace

namespace {

// A multimodal checkpoint whose language model kvlm runs (ArchSpec::wrappers): that model's
// config, text_config, named by the text architecture, with what the wrapper keeps at its top
// level (tied embeddings, dtype, token ids, quantization) where text_config leaves it out.
std::optional<json> wrapped_text_config(const json& cfg) {
  const json* archs = jg::find(cfg, "architectures");
  if (!archs || !archs->is_array() || archs->empty() || !(*archs)[0].is_string()) return std::nullopt;
  const std::string name = (*archs)[0].get<std::string>();
  for (const ArchSpec* a : architectures()) {
    if (std::ranges::find(a->wrappers, name) == a->wrappers.end()) continue;
    const json* text = jg::find(cfg, "text_config");
    if (!text || !text->is_object())
      throw Error("config.json: " + name + " keeps its language model's config in 'text_config', which is missing");
    json t = *text;
    t["architectures"] = json::array({std::string(a->name)});
    for (const char* k : {"tie_word_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
                          "quantization_config", "max_position_embeddings"})
      if (!t.contains(k) && cfg.contains(k)) t[k] = cfg[k];
    if (a->text_defaults) a->text_defaults(t);
    return t;
  }
  return std::nullopt;
}

}  // namespace

ModelConfig parse_model_config(const json& cfg, const json* gen) {
  using arch_config::positive_int;
  if (!cfg.is_object()) throw Error("config.json: the top level must be a JSON object");
  if (const std::optional<json> text = wrapped_text_config(cfg)) {
    ModelConfig m = parse_model_config(*text, gen);
    m.wrapper = jg::find(cfg, "architectures")->at(0).get<std::string>();
    return m;
  }
  ModelConfig m;
  m.arch = parse_arch(cfg);
  m.hidden_size = positive_int(cfg, "hidden_size", 1 << 17);
  m.intermediate_size = positive_int(cfg, "intermediate_size", 1 << 20);
  m.num_layers = positive_int(cfg, "num_hidden_layers", 1024);
  m.num_heads = positive_int(cfg, "num_attention_heads", 1024);
  m.num_kv_heads = positive_int(cfg, "num_key_value_heads", 1024, m.num_heads);
  m.vocab_size = positive_int(cfg, "vocab_size", 1 << 24);
  if (jg::find(cfg, "head_dim")) {
    m.head_dim = positive_int(cfg, "head_dim", 1024);
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
  m.max_position_embeddings = positive_int(cfg, "max_position_embeddings", 1 << 30, 2048);
  m.rms_norm_eps = jg::opt_number(cfg, "rms_norm_eps", kWhere).value_or(1e-6);
  if (!(m.rms_norm_eps >= 0)) throw Error("config.json: rms_norm_eps must be non-negative");
  m.tie_word_embeddings = jg::opt_bool(cfg, "tie_word_embeddings", kWhere).value_or(false);
  std::optional<std::string> dt = jg::opt_string(cfg, "torch_dtype", kWhere);
  if (!dt) dt = jg::opt_string(cfg, "dtype", kWhere);
  if (dt) {
    m.declared_dtype = dtype_from_torch_name(*dt);
    if (!m.declared_dtype) throw Error("config.json: torch_dtype '" + *dt + "' is not supported; kvlm loads bfloat16, float16 and float32");
  }
  m.layers.assign(size_t(m.num_layers), LayerAttention{});

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
  // What is particular to the architecture (model/arch/*.cpp): activation, RoPE, biases, q/k
  // norms, per-layer attention, experts.
  m.arch->parse(cfg, m);
  if (m.moe) {
    KVLM_CHECK(m.moe_layers.size() == size_t(m.num_layers), "an MoE architecture left moe_layers unset");
  } else {
    m.moe_layers.assign(size_t(m.num_layers), false);
  }
  return m;
}

json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open " + path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {  // parse_error, or out_of_range for a number like 1e400
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

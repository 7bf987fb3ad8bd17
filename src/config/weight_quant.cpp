#include "config/weight_quant.h"

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"

namespace kvlm {

using nlohmann::json;
namespace jg = json_get;

std::string_view fp8_scaling_name(Fp8Scaling s) {
  switch (s) {
    case Fp8Scaling::Tensor: return "per-tensor";
    case Fp8Scaling::Channel: return "per-channel";
    case Fp8Scaling::Block: return "block";
  }
  return "?";
}

std::string_view fp8_activations_name(Fp8Activations a) {
  switch (a) {
    case Fp8Activations::None: return "16-bit (weight-only)";
    case Fp8Activations::DynamicToken: return "dynamic per-token";
    case Fp8Activations::DynamicTensor: return "dynamic per-tensor";
    case Fp8Activations::DynamicBlock: return "dynamic per-token-group of 128";
    case Fp8Activations::StaticTensor: return "static per-tensor (input_scale)";
  }
  return "?";
}

std::string WeightQuantConfig::describe() const {
  std::string s = "FP8 E4M3 weights, " + std::string(fp8_scaling_name(scaling)) + " scales";
  if (scaling == Fp8Scaling::Block) s += " " + std::to_string(block_rows) + "x" + std::to_string(block_cols);
  s += ", " + std::string(fp8_activations_name(activations)) + " activations (" + origin + ")";
  return s;
}

namespace {

const std::string kWhat = "kvlm runs FP8 E4M3 weights (compressed-tensors float-quantized, modelopt FP8, fp8), "
                          "4-bit weights (AWQ, GPTQ, compressed-tensors pack-quantized W4A16, MXFP4) and "
                          "bfloat16/float16/float32 checkpoints";

std::vector<std::string> string_list(const json& obj, std::string_view key, const std::string& where) {
  std::vector<std::string> out;
  const json* v = jg::find(obj, key);
  if (!v) return out;
  if (!v->is_array()) throw Error(where + ": '" + std::string(key) + "' must be a list of module names");
  for (const json& x : *v) {
    if (!x.is_string()) throw Error(where + ": '" + std::string(key) + "' must be a list of module names");
    out.push_back(x.get<std::string>());
  }
  return out;
}

// A [rows, cols] block shape.
void parse_block(const json& v, const std::string& where, WeightQuantConfig& q) {
  if (!v.is_array() || v.size() != 2 || !v[0].is_number_integer() || !v[1].is_number_integer() ||
      v[0].get<long long>() <= 0 || v[1].get<long long>() <= 0 || v[0].get<long long>() > 65536 ||
      v[1].get<long long>() > 65536)
    throw Error(where + " must be two positive integers [rows, cols], e.g. [128, 128]; got " + v.dump());
  q.scaling = Fp8Scaling::Block;
  q.block_rows = int(v[0].get<long long>());
  q.block_cols = int(v[1].get<long long>());
}

// One compressed-tensors config group's weights and input activations.
WeightQuantConfig parse_ct_group(const json& g, const std::string& where) {
  WeightQuantConfig q;
  q.origin = "compressed-tensors";
  if (!g.is_object()) throw Error(where + " must be an object");
  const json* w = jg::find(g, "weights");
  if (!w || !w->is_object()) throw Error(where + ": 'weights' must be an object describing the weight quantization");
  const std::string ww = where + ".weights";
  const auto bits = jg::opt_int(*w, "num_bits", ww).value_or(8);
  const auto type = jg::opt_string(*w, "type", ww).value_or("int");
  if (bits != 8 || type != "float")
    throw Error(ww + ": num_bits " + std::to_string(bits) + " type '" + type + "' weights are not supported; " + kWhat);
  if (!jg::opt_bool(*w, "symmetric", ww).value_or(true))
    throw Error(ww + ": asymmetric (zero-point) FP8 weights are not supported; " + kWhat);
  if (jg::opt_bool(*w, "dynamic", ww).value_or(false))
    throw Error(ww + ": dynamic weight scales are not supported (FP8 checkpoints store their weight scales)");
  const std::string strategy = jg::opt_string(*w, "strategy", ww).value_or("tensor");
  if (strategy == "tensor") {
    q.scaling = Fp8Scaling::Tensor;
  } else if (strategy == "channel") {
    q.scaling = Fp8Scaling::Channel;
  } else if (strategy == "block") {
    const json* b = jg::find(*w, "block_structure");
    if (!b) throw Error(ww + ": strategy 'block' needs 'block_structure' [rows, cols]");
    parse_block(*b, ww + ".block_structure", q);
  } else {
    throw Error(ww + ": strategy '" + strategy + "' is not supported; kvlm runs FP8 weights with tensor, channel or "
                "block scales");
  }
  if (jg::find(g, "output_activations"))
    throw Error(where + ": output activation quantization is not supported; kvlm runs weight and input-activation "
                "FP8 schemes");
  const json* a = jg::find(g, "input_activations");
  if (!a) {
    q.activations = Fp8Activations::None;
    return q;
  }
  if (!a->is_object()) throw Error(where + ": 'input_activations' must be an object or null");
  const std::string aw = where + ".input_activations";
  const auto abits = jg::opt_int(*a, "num_bits", aw).value_or(8);
  const auto atype = jg::opt_string(*a, "type", aw).value_or("int");
  const std::string astrategy = jg::opt_string(*a, "strategy", aw).value_or("tensor");
  const bool dynamic = jg::opt_bool(*a, "dynamic", aw).value_or(false);
  if (abits != 8 || atype != "float")
    throw Error(aw + ": num_bits " + std::to_string(abits) + " type '" + atype +
                "' activations are not supported; kvlm runs FP8 (num_bits 8, type float) or 16-bit activations");
  if (!jg::opt_bool(*a, "symmetric", aw).value_or(true))
    throw Error(aw + ": asymmetric (zero-point) activations are not supported");
  if (astrategy == "token" && dynamic) q.activations = Fp8Activations::DynamicToken;
  else if (astrategy == "tensor") q.activations = dynamic ? Fp8Activations::DynamicTensor : Fp8Activations::StaticTensor;
  else if (astrategy == "group" && dynamic && jg::opt_int(*a, "group_size", aw).value_or(0) == 128)
    q.activations = Fp8Activations::DynamicBlock;
  else
    throw Error(aw + ": strategy '" + astrategy + "'" + (dynamic ? " dynamic" : " static") +
                " is not supported; kvlm runs dynamic per-token, dynamic or static per-tensor, and dynamic "
                "per-token-group-of-128 FP8 activations");
  return q;
}

std::optional<WeightQuantConfig> parse_compressed_tensors(const json& qc, const std::string& where) {
  const json* groups = jg::find(qc, "config_groups");
  if (!groups) return std::nullopt;  // a KV-cache-only config (kv_cache_scheme)
  if (!groups->is_object()) throw Error(where + ": 'config_groups' must be an object");
  if (groups->empty()) return std::nullopt;
  if (auto fmt = jg::opt_string(qc, "format", where); fmt && *fmt != "float-quantized" && *fmt != "naive-quantized")
    throw Error(where + ": format '" + *fmt + "' is not supported; " + kWhat);
  std::optional<WeightQuantConfig> out;
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    WeightQuantConfig q = parse_ct_group(it.value(), where + ".config_groups." + it.key());
    if (out && (out->scaling != q.scaling || out->block_rows != q.block_rows || out->block_cols != q.block_cols ||
                out->activations != q.activations))
      throw Error(where + ": config groups with different schemes ('" + it.key() +
                  "' differs from the first) are not supported; kvlm runs one FP8 scheme per checkpoint");
    out = q;
  }
  out->ignore = string_list(qc, "ignore", where);
  return out;
}

std::optional<WeightQuantConfig> parse_modelopt(const json& qc, const std::string& where) {
  const json* src = &qc;
  if (const json* nested = jg::find(qc, "quantization"); nested && nested->is_object()) src = nested;
  const auto algo = jg::opt_string(*src, "quant_algo", where);
  if (!algo) return std::nullopt;  // a KV-cache-only export
  WeightQuantConfig q;
  q.origin = "modelopt";
  if (*algo == "FP8") {
    q.scaling = Fp8Scaling::Tensor;
    q.activations = Fp8Activations::StaticTensor;
  } else if (*algo == "FP8_PER_CHANNEL_PER_TOKEN") {
    q.scaling = Fp8Scaling::Channel;
    q.activations = Fp8Activations::DynamicToken;
  } else {
    throw Error(where + ": modelopt quant_algo '" + *algo + "' is not supported; kvlm runs modelopt quant_algo FP8 "
                "and FP8_PER_CHANNEL_PER_TOKEN, compressed-tensors and fp8 FP8 checkpoints, and 16/32-bit ones");
  }
  q.ignore = string_list(*src, jg::find(*src, "exclude_modules") ? "exclude_modules" : "ignore", where);
  return q;
}

std::optional<WeightQuantConfig> parse_fp8(const json& qc, const std::string& where) {
  WeightQuantConfig q;
  q.origin = "fp8";
  const std::string fmt = jg::opt_string(qc, "fmt", where).value_or("e4m3");
  if (fmt != "e4m3") throw Error(where + ": fmt '" + fmt + "' is not supported; kvlm runs e4m3 FP8 weights");
  const std::string act = jg::opt_string(qc, "activation_scheme", where).value_or("dynamic");
  if (act != "dynamic" && act != "static")
    throw Error(where + ": activation_scheme '" + act + "' is not supported; use dynamic or static");
  if (const json* b = jg::find(qc, "weight_block_size")) {
    parse_block(*b, where + ".weight_block_size", q);
    q.scale_name = "weight_scale_inv";
    if (act == "static") throw Error(where + ": block-wise FP8 weights with static activation scales are not supported");
    q.activations = Fp8Activations::DynamicBlock;
  } else {
    q.scaling = Fp8Scaling::Tensor;
    q.activations = act == "static" ? Fp8Activations::StaticTensor : Fp8Activations::DynamicTensor;
  }
  q.ignore = string_list(qc, jg::find(qc, "modules_to_not_convert") ? "modules_to_not_convert" : "ignored_layers", where);
  return q;
}

}  // namespace

std::string Int4Scheme::describe() const {
  const std::string groups = group ? "groups of " + std::to_string(group) : std::string("one scale per output row");
  if (kind == Kind::Mxfp4) return "MXFP4 (E2M1 codes, an E8M0 scale per 32)";
  if (kind == Kind::CompressedTensors)
    return "compressed-tensors W4A16, " + groups + (symmetric ? ", symmetric" : ", zero points");
  return std::string(kind == Kind::Awq ? "AWQ" : zeros_minus_one ? "GPTQ" : "GPTQ v2") + " 4-bit, " + groups;
}

namespace {

// compressed-tensors' pack-quantized format: integer weights packed 8 to an int32 along the
// input (llm-compressor's W4A16 recipes). nullopt when no config group is pack-quantized (an
// FP8 checkpoint, or one that only declares the KV cache).
std::optional<Int4Scheme> parse_ct_int4(const json& qc, const std::string& where) {
  const json* groups = jg::find(qc, "config_groups");
  if (!groups || !groups->is_object() || groups->empty()) return std::nullopt;
  const std::string top = jg::opt_string(qc, "format", where).value_or("");
  const std::string what = "kvlm runs compressed-tensors pack-quantized 4-bit integer weights with 16-bit "
                           "activations (W4A16: group or channel strategy, symmetric or with zero points)";
  std::optional<Int4Scheme> out;
  std::string first;
  size_t packed = 0;
  for (auto it = groups->begin(); it != groups->end(); ++it)
    if (jg::opt_string(it.value(), "format", where).value_or(top) == "pack-quantized") ++packed;
  if (packed == 0) return std::nullopt;
  if (packed != groups->size())
    throw Error(where + ": config groups in different formats (pack-quantized beside others) are not supported; " +
                what);
  for (auto it = groups->begin(); it != groups->end(); ++it) {
    const std::string gw = where + ".config_groups." + it.key();
    const json* w = jg::find(it.value(), "weights");
    if (!w || !w->is_object()) throw Error(gw + ": 'weights' must be an object describing the weight quantization");
    const std::string ww = gw + ".weights";
    const auto bits = jg::opt_int(*w, "num_bits", ww).value_or(8);
    const auto type = jg::opt_string(*w, "type", ww).value_or("int");
    if (type != "int" || bits != 4)
      throw Error(ww + ": num_bits " + std::to_string(bits) + " type '" + type + "' is not supported; " + what +
                  " (or a 16-bit copy of the model)");
    if (jg::opt_bool(*w, "dynamic", ww).value_or(false))
      throw Error(ww + ": dynamic weight scales are not supported; " + what);
    if (jg::find(it.value(), "input_activations") || jg::find(it.value(), "output_activations"))
      throw Error(gw + ": quantized activations beside 4-bit weights (e.g. W4A8) are not supported; " + what +
                  " (input_activations null)");
    Int4Scheme s;
    s.kind = Int4Scheme::Kind::CompressedTensors;
    s.symmetric = jg::opt_bool(*w, "symmetric", ww).value_or(true);
    const std::string strategy = jg::opt_string(*w, "strategy", ww).value_or("");
    if (strategy == "group") {
      const long long g = jg::opt_int(*w, "group_size", ww).value_or(0);
      if (g <= 0) throw Error(ww + ": strategy 'group' needs a positive group_size; got " + std::to_string(g));
      s.group = int(g);
    } else if (strategy != "channel") {
      throw Error(ww + ": strategy '" + strategy + "' is not supported; " + what);
    }
    if (out && (out->group != s.group || out->symmetric != s.symmetric))
      throw Error(where + ": config groups with different weight schemes ('" + it.key() + "' differs from '" + first +
                  "') are not supported; " + what + ", one scheme per checkpoint");
    if (!out) first = it.key();
    out = s;
  }
  return out;
}

}  // namespace

std::optional<Int4Scheme> parse_int4_scheme(const json& config) {
  const json* qc = jg::find(config, "quantization_config");
  if (!qc || !qc->is_object()) return std::nullopt;
  const std::string where = "config.json quantization_config";
  const std::string method = jg::opt_string(*qc, "quant_method", where).value_or("");
  if (method == "compressed-tensors") return parse_ct_int4(*qc, where);
  if (method == "mxfp4") return Int4Scheme{.kind = Int4Scheme::Kind::Mxfp4, .group = 32};
  if (method != "awq" && method != "gptq") return std::nullopt;
  Int4Scheme s;
  s.kind = method == "awq" ? Int4Scheme::Kind::Awq : Int4Scheme::Kind::Gptq;
  const std::string what = "kvlm runs 4-bit AWQ (GEMM layout, zero points) and 4-bit GPTQ checkpoints";
  const long long bits = jg::opt_int(*qc, method == "awq" ? (jg::find(*qc, "w_bit") ? "w_bit" : "bits") : "bits", where)
                             .value_or(4);
  if (bits != 4)
    throw Error(where + ": " + std::to_string(bits) + "-bit " + (method == "awq" ? "AWQ" : "GPTQ") +
                " weights are not supported; " + what + " (or a 16-bit copy of the model)");
  const long long group =
      jg::opt_int(*qc, method == "awq" && jg::find(*qc, "q_group_size") ? "q_group_size" : "group_size", where)
          .value_or(128);
  if (group != -1 && (group <= 0 || group % 8 != 0))
    throw Error(where + ": group_size " + std::to_string(group) + " is not a positive multiple of 8 (or -1)");
  s.group = group == -1 ? 0 : int(group);
  if (s.kind == Int4Scheme::Kind::Awq) {
    const std::string version = jg::opt_string(*qc, "version", where).value_or("gemm");
    if (version != "gemm" && version != "GEMM")
      throw Error(where + ": AWQ version '" + version + "' packs its weights differently; " + what +
                  " (version \"gemm\", the layout AutoAWQ and vLLM use)");
    if (!jg::opt_bool(*qc, "zero_point", where).value_or(true))
      throw Error(where + ": AWQ without zero points is not supported; " + what);
  } else {
    const std::string format = jg::opt_string(*qc, "checkpoint_format", where).value_or("gptq");
    if (format != "gptq" && format != "gptq_v2")
      throw Error(where + ": GPTQ checkpoint_format '" + format + "' is not supported; " + what +
                  " (checkpoint_format gptq or gptq_v2)");
    s.zeros_minus_one = format == "gptq";
  }
  return s;
}

std::optional<WeightQuantConfig> parse_weight_quant(const json& cfg) {
  const json* qc = jg::find(cfg, "quantization_config");
  if (!qc) return std::nullopt;
  if (!qc->is_object()) throw Error("config.json: 'quantization_config' must be an object");
  const std::string where = "config.json quantization_config";
  const std::string method = jg::opt_string(*qc, "quant_method", where).value_or("");
  if (method == "compressed-tensors") {
    // 4-bit integer weights are the checkpoint's to read (io/int4_checkpoint.h).
    if (parse_ct_int4(*qc, where)) return std::nullopt;
    return parse_compressed_tensors(*qc, where);
  }
  if (method == "modelopt") return parse_modelopt(*qc, where);
  if (method == "fp8") return parse_fp8(*qc, where);
  if (method.empty()) return std::nullopt;
  // 4-bit AWQ / GPTQ / MXFP4: the checkpoint dequantizes them (io/int4_checkpoint.h); checked
  // here too, so that what kvlm cannot run is refused with the config, before any tensor is read.
  if (method == "awq" || method == "gptq" || method == "mxfp4") {
    parse_int4_scheme(cfg);
    return std::nullopt;
  }
  throw Error(where + ": quant_method '" + method + "' is not supported; " + kWhat);
}

std::optional<WeightQuantConfig> resolve_weight_quant(std::optional<WeightQuantConfig> checkpoint,
                                                      std::string_view flag) {
  if (flag.empty()) return checkpoint;
  if (flag != "fp8")
    throw Error("invalid --quantization '" + std::string(flag) +
                "'; valid values: fp8 (quantize a 16-bit checkpoint's linear weights to FP8 at load, per output "
                "channel; FP8 checkpoints need no flag)");
  if (checkpoint) return checkpoint;  // already FP8: its own scales are the better ones
  WeightQuantConfig q;
  q.origin = "--quantization fp8";
  q.scaling = Fp8Scaling::Channel;
  q.activations = Fp8Activations::DynamicToken;
  q.ignore = {"lm_head"};
  q.on_the_fly = true;
  return q;
}

}  // namespace kvlm

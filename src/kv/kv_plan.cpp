#include "kv/kv_plan.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/hadamard.h"
#include "kv/kv_formats.h"

namespace kvlm {

std::vector<AttentionLayerDesc> attention_layers(const ModelConfig& m, const std::string& model_name) {
  std::vector<AttentionLayerDesc> out;
  out.reserve(m.layers.size());
  for (int i = 0; i < m.num_layers; ++i) {
    if (m.is_linear_layer(i)) continue;  // a Gated DeltaNet layer holds a state, not K/V
    const auto& l = m.layers[size_t(i)];
    out.push_back({.model = model_name,
                   .layer = i,
                   .kind = l.kind,
                   .window = l.window,
                   .num_q_heads = m.num_heads,
                   .num_kv_heads = m.num_kv_heads,
                   .head_dim = m.head_dim,
                   .sinks = m.attention_sinks});
  }
  return out;
}

std::string_view dtype_source_name(DTypeSource s) {
  switch (s) {
    case DTypeSource::PlanFile: return "plan file";
    case DTypeSource::Explicit: return "explicit";
    case DTypeSource::CheckpointScheme: return "checkpoint scheme";
    case DTypeSource::ModelDType: return "model dtype";
    case DTypeSource::SkipRule: return "skip rule";
  }
  return "?";
}

std::string_view scale_source_name(ScaleSource s) {
  switch (s) {
    case ScaleSource::None: return "none";
    case ScaleSource::CheckpointTensor: return "checkpoint";
    case ScaleSource::Default: return "default 1.0";
    case ScaleSource::PerTokenHeadDynamic: return "per-token-head dynamic";
  }
  return "?";
}

KVDTypeResolution resolve_kv_dtype(KVCacheDType requested, const std::optional<CheckpointKVScheme>& scheme,
                                   DType model_dtype) {
  if (requested != KVCacheDType::Auto) {
    KVDTypeResolution r{*kv_storage_of(requested), DTypeSource::Explicit, ""};
    if (scheme) r.note = "explicit --kv-cache-dtype overrides the checkpoint's " + scheme->origin;
    return r;
  }
  if (scheme) {
    if (!scheme->storage)
      throw Error(scheme->unsupported_reason +
                  "; pass an explicit --kv-cache-dtype (for example bfloat16 or fp8_per_token_head) to override it");
    return {*scheme->storage, DTypeSource::CheckpointScheme, "from the checkpoint's " + scheme->origin};
  }
  KVLM_CHECK(model_dtype == DType::F32 || model_dtype == DType::F16 || model_dtype == DType::BF16,
             "model dtype must be a float type");
  return {KVStorage{model_dtype, KVQuantMode::None}, DTypeSource::ModelDType, ""};
}

size_t KVLayerSpec::bytes_per_token() const {
  const auto row = [&](const KVStorage& kv) { return kv_row_code_bytes(kv, attn.head_dim) + kv_row_scale_bytes(kv); };
  return size_t(attn.num_kv_heads) * (row(k) + row(v));
}

size_t KVLayerSpec::exact_bytes_per_token() const {
  return keeps_exact() ? 2 * size_t(attn.num_kv_heads) * size_t(attn.head_dim) * dtype_size(exact_storage) : 0;
}

size_t KVPlan::bytes_per_token() const {
  size_t total = 0;
  for (const auto& l : layers) total += l.bytes_per_token();
  return total;
}

int KVPlan::keep_sink() const {
  int n = 0;
  for (const auto& l : layers) n = std::max(n, l.keep_sink);
  return n;
}

int KVPlan::keep_recent() const {
  int n = 0;
  for (const auto& l : layers) n = std::max(n, l.keep_recent);
  return n;
}

size_t KVPlan::exact_bytes_per_token() const {
  size_t total = 0;
  for (const auto& l : layers) total += l.exact_bytes_per_token();
  return total;
}

namespace {

void check_scales(const std::vector<float>& s, const std::string& name, const AttentionLayerDesc& a) {
  if (s.size() != 1 && s.size() != size_t(a.num_kv_heads))
    throw Error("checkpoint scale tensor '" + name + "' has " + std::to_string(s.size()) + " values; expected 1 or " +
                std::to_string(a.num_kv_heads) + " (one per KV head)");
  for (float x : s)
    if (!std::isfinite(x) || x <= 0)
      throw Error("checkpoint scale tensor '" + name + "' holds " + std::to_string(x) + "; KV scales must be positive and finite");
}

// The plan file's entries for the models among `layers` name layers that exist and hold a KV
// cache, and its declared layer count is the target's.
void check_plan_file(const KVPlanFile& f, std::span<const AttentionLayerDesc> layers, int target_layers) {
  if (f.num_layers && target_layers > 0 && *f.num_layers != target_layers)
    throw Error("KV plan file " + f.source + " was written for a model with " + std::to_string(*f.num_layers) +
                " layers; this one has " + std::to_string(target_layers) +
                ". Write a plan for this model (`kvlm calibrate --kld-budget`, or `kvlm inspect --write-kv-plan`)");
  for (const auto& e : f.entries) {
    const bool model_here = std::ranges::any_of(layers, [&](const auto& a) { return a.model == e.model; });
    if (!model_here) continue;  // another model's entries (a drafter's): checked when its plan is built
    if (std::ranges::none_of(layers, [&](const auto& a) { return a.model == e.model && a.layer == e.layer; })) {
      int n = 0;
      for (const auto& a : layers)
        if (a.model == e.model) n = std::max(n, a.layer + 1);
      throw Error("KV plan file " + f.source + " names " + e.where() + ", but " +
                  (e.layer < n ? "that layer holds no KV cache (a linear-attention layer)"
                               : "the " + e.model + " model has layers 0.." + std::to_string(n - 1)));
    }
  }
}

// Whether a side rotates: the plan file's choice for it, else the global rule (Hadamard: every
// quantized side; Auto: the quantized sides of a layer with a 4-bit side).
bool side_rotates(const CacheConfig& cache, const KVLayerSpec& s, KVSide side, const KVPlanEntry* entry,
                  const std::string& where) {
  const KVStorage& f = s.format(side);
  const char* name = side == KVSide::K ? "K" : "V";
  const std::optional<bool>& planned = !entry ? std::nullopt : side == KVSide::K ? entry->rotate_k : entry->rotate_v;
  const bool pow2 = num::is_pow2(s.attn.head_dim);
  if (planned) {
    if (!*planned) return false;
    if (f.mode == KVQuantMode::None)
      throw Error(where + " asks for a Hadamard rotation of " + name + ", which is held in " +
                  std::string(dtype_name(f.storage)) + "; only quantized sides rotate (give it \"none\")");
    if (!pow2)
      throw Error(where + " asks for a Hadamard rotation, which needs a power-of-two head_dim; the layer has " +
                  std::to_string(s.attn.head_dim) + ". Give it \"rotation\": \"none\"");
    return true;
  }
  if (f.mode == KVQuantMode::None) return false;
  if (cache.rotation == KVRotation::Hadamard) {
    if (!pow2)
      throw Error("--kv-cache-rotation hadamard needs a power-of-two head_dim; " + s.attn.model + " layer " +
                  std::to_string(s.attn.layer) + " has " + std::to_string(s.attn.head_dim) +
                  ". Use --kv-cache-rotation none");
    return true;
  }
  // Auto leaves per-tensor FP8 sides alone: their static scales (calibrated or 1.0) are of
  // unrotated values.
  return cache.rotation == KVRotation::Auto && (s.k.storage == DType::I4 || s.v.storage == DType::I4) && pow2 &&
         f.mode != KVQuantMode::Fp8PerTensor;
}

}  // namespace

KVPlan build_kv_plan(const CacheConfig& cache, std::span<const AttentionLayerDesc> layers, DType model_dtype,
                     const std::optional<CheckpointKVScheme>& scheme, const ScaleLookup& scales) {
  KVPlan plan;
  validate_keep_tokens(cache.keep_sink, "--kv-cache-keep-sink");
  validate_keep_tokens(cache.keep_recent, "--kv-cache-keep-recent");
  plan.requested = cache.kv_dtypes();
  plan.resolution = resolve_kv_dtype(cache.kv_cache_dtype, scheme, model_dtype);
  plan.v_resolution = cache.v_cache_dtype ? resolve_kv_dtype(*cache.v_cache_dtype, scheme, model_dtype) : plan.resolution;

  int target_layers = 0;
  for (const auto& l : layers)
    if (l.model == "target") target_layers = std::max(target_layers, l.layer + 1);
  for (int idx : cache.skip_layers.indices)
    if (idx >= target_layers)
      throw Error("--kv-cache-dtype-skip-layers names layer " + std::to_string(idx) + " but the model has " +
                  std::to_string(target_layers) + " layers (0.." + std::to_string(target_layers - 1) + ")");
  const KVPlanFile* file = cache.plan_file ? &*cache.plan_file : nullptr;
  if (file) {
    check_plan_file(*file, layers, target_layers);
    plan.plan_file = file->source;
  }

  int defaulted = 0, unrotated_int4 = 0;
  for (const auto& a : layers) {
    KVLayerSpec s;
    s.attn = a;
    s.k = plan.resolution.storage;
    s.v = plan.v_resolution.storage;
    s.dtype_source = plan.resolution.source;
    s.v_dtype_source = plan.v_resolution.source;
    const bool skip_index = a.model == "target" && std::ranges::find(cache.skip_layers.indices, a.layer) !=
                                                       cache.skip_layers.indices.end();
    const bool skip_sliding = cache.skip_layers.sliding_window && a.kind == AttentionKind::Sliding;
    if (skip_index || skip_sliding) {
      if (s.k.mode != KVQuantMode::None) s.k = KVStorage{model_dtype, KVQuantMode::None}, s.dtype_source = DTypeSource::SkipRule;
      if (s.v.mode != KVQuantMode::None) s.v = KVStorage{model_dtype, KVQuantMode::None}, s.v_dtype_source = DTypeSource::SkipRule;
    }
    const KVPlanEntry* entry = file ? file->find(a.model, a.layer) : nullptr;
    const std::string where = entry ? "KV plan file " + file->source + ": " + entry->where() : "";
    if (entry) {
      s.from_plan_file = true;
      if (entry->k) s.k = *kv_storage_of(*entry->k), s.dtype_source = DTypeSource::PlanFile;
      if (entry->v) s.v = *kv_storage_of(*entry->v), s.v_dtype_source = DTypeSource::PlanFile;
    }
    if (s.k.mode == KVQuantMode::Fp8PerTensor || s.v.mode == KVQuantMode::Fp8PerTensor) {
      std::optional<CheckpointScales> found = scales ? scales(a) : std::nullopt;
      if (found) {
        check_scales(found->k, found->k_name, a);
        check_scales(found->v, found->v_name, a);
        s.k_scale = found->k;
        s.v_scale = found->v;
        s.k_scale_name = found->k_name;
        s.v_scale_name = found->v_name;
        s.scale_source = ScaleSource::CheckpointTensor;
      } else {
        s.scale_source = ScaleSource::Default;
        ++defaulted;
      }
    } else if (is_per_token_head(s.k.mode) || is_per_token_head(s.v.mode)) {
      s.scale_source = ScaleSource::PerTokenHeadDynamic;
    }
    if ((s.k.storage == DType::I4 || s.v.storage == DType::I4) && a.head_dim % 8 != 0)
      throw Error("int4_per_token_head packs 8 values per 32-bit word; " + a.model + " layer " + std::to_string(a.layer) +
                  " has head_dim " + std::to_string(a.head_dim) +
                  ". Use int8_per_token_head or fp8_per_token_head for this model, or keep the layer unquantized with "
                  "--kv-cache-dtype-skip-layers");
    s.rotate_k = side_rotates(cache, s, KVSide::K, entry, where);
    s.rotate_v = side_rotates(cache, s, KVSide::V, entry, where);
    s.rotation_seed = entry && entry->rotation_seed ? *entry->rotation_seed : 0;
    if (s.scale_source == ScaleSource::CheckpointTensor)
      for (KVSide side : {KVSide::K, KVSide::V})
        if (s.rotates(side) && s.format(side).mode == KVQuantMode::Fp8PerTensor)
          throw Error((entry ? where + "'s rotation" : std::string("--kv-cache-rotation hadamard")) +
                      " cannot use the checkpoint's per-tensor KV scales of " + a.model + " layer " +
                      std::to_string(a.layer) + " (" + (side == KVSide::K ? s.k_scale_name : s.v_scale_name) +
                      "): they were calibrated on unrotated K/V. Use a per-token-head dtype with the rotation, or "
                      "no rotation");
    if (cache.rotation == KVRotation::Auto && (s.k.storage == DType::I4 || s.v.storage == DType::I4) &&
        !num::is_pow2(a.head_dim))
      ++unrotated_int4;
    if (s.quantized()) {
      s.keep_sink = entry && entry->keep_sink ? *entry->keep_sink : cache.keep_sink;
      s.keep_recent = entry && entry->keep_recent ? *entry->keep_recent : cache.keep_recent;
      s.exact_storage = model_dtype;
    } else if (entry && (entry->keep_sink.value_or(0) > 0 || entry->keep_recent.value_or(0) > 0)) {
      throw Error(where + " keeps exact sink / recent tokens, but its K and V are held unquantized (" +
                  std::string(dtype_name(s.k.storage)) + "): every token is exact already. Drop keep_sink / keep_recent "
                  "there, or quantize the layer");
    }
    plan.layers.push_back(std::move(s));
  }
  if (cache.rotation == KVRotation::Hadamard &&
      std::ranges::none_of(plan.layers, [](const KVLayerSpec& l) { return l.rotates(); }))
    plan.warnings.push_back("--kv-cache-rotation hadamard has no effect: no layer's KV cache is quantized "
                            "(the rotation applies to quantized layers only)");
  if ((cache.keep_sink > 0 || cache.keep_recent > 0) &&
      std::ranges::none_of(plan.layers, [](const KVLayerSpec& l) { return l.keeps_exact(); }))
    plan.warnings.push_back("--kv-cache-keep-sink / --kv-cache-keep-recent have no effect: no layer's KV cache is "
                            "quantized (every token is held in the model dtype already)");
  if (unrotated_int4 > 0)
    plan.warnings.push_back(std::to_string(unrotated_int4) +
                            " int4 layers are not rotated: the Hadamard rotation needs a power-of-two head_dim. "
                            "Expect a larger accuracy cost than the measured int4 figures");
  if (defaulted > 0)
    plan.warnings.push_back(std::to_string(defaulted) + " of " + std::to_string(layers.size()) +
                            " layers store FP8 per-tensor KV without checkpoint scales; using scale 1.0, which can "
                            "cost accuracy. Calibrated scales (k_scale/v_scale tensors) or "
                            "--kv-cache-dtype fp8_per_token_head avoid this.");
  return plan;
}

std::optional<KVCacheDType> kv_cache_dtype_of(const KVStorage& s) {
  for (KVCacheDType d : all_kv_cache_dtypes())
    if (d != KVCacheDType::Auto && d != KVCacheDType::Fp8 && kv_storage_of(d) == s) return d;
  return std::nullopt;
}

KVPlanFile kv_plan_file_of(const KVPlan& plan, const std::string& architecture, int num_layers) {
  KVPlanFile f;
  f.architecture = architecture;
  f.num_layers = num_layers;
  for (const auto& l : plan.layers) {
    KVPlanEntry e;
    e.model = l.attn.model;
    e.layer = l.attn.layer;
    // A float32 side (a float32 model's unquantized cache) has no dtype name: it is left out,
    // and resolves as the model dtype again unless other options say otherwise.
    e.k = kv_cache_dtype_of(l.k);
    e.v = kv_cache_dtype_of(l.v);
    e.rotate_k = l.rotate_k;
    e.rotate_v = l.rotate_v;
    if (l.rotation_seed != 0) e.rotation_seed = l.rotation_seed;
    if (l.quantized()) {
      e.keep_sink = l.keep_sink;
      e.keep_recent = l.keep_recent;
    }
    f.entries.push_back(std::move(e));
  }
  return f;
}

std::string describe_kv_resolution(const KVPlan& plan) {
  auto one = [](const KVStorage& kv) {
    std::string s(dtype_name(kv.storage));
    if (kv.mode != KVQuantMode::None) s += " " + std::string(kv_quant_mode_name(kv.mode));
    return s;
  };
  if (plan.plan_file.empty()) return kv_pair_name(plan.resolution.storage, plan.v_resolution.storage, one);
  // A plan file: how many layers hold each format, in the order they first appear.
  std::vector<std::pair<std::string, int>> mix;
  for (const auto& l : plan.layers) {
    const std::string f = kv_pair_name(l.k, l.v, one);
    auto it = std::ranges::find_if(mix, [&](const auto& m) { return m.first == f; });
    if (it == mix.end()) mix.emplace_back(f, 1);
    else ++it->second;
  }
  std::string s = "plan file " + plan.plan_file + " (";
  for (size_t i = 0; i < mix.size(); ++i)
    s += (i ? "; " : "") + std::to_string(mix[i].second) + (mix[i].second == 1 ? " layer " : " layers ") + mix[i].first;
  return s + ")";
}

std::string kv_rotation_text(const KVLayerSpec& l) {
  if (l.rotate_k == l.rotate_v) return l.rotate_k ? "hadamard" : "none";
  return l.rotate_k ? "hadamard_k" : "hadamard_v";
}

nlohmann::json kv_layer_json(const KVLayerSpec& l) {
  nlohmann::json e{{"model", l.attn.model},
                   {"layer", l.attn.layer},
                   {"attention", std::string(attention_kind_name(l.attn.kind))},
                   {"kv_dtype", std::string(dtype_name(l.k.storage))},
                   {"quant_mode", std::string(kv_quant_mode_name(l.k.mode))},
                   {"dtype_source", std::string(dtype_source_name(l.dtype_source))},
                   {"scale_source", std::string(scale_source_name(l.scale_source))},
                   {"rotation", kv_rotation_text(l)},
                   {"backend", l.backend},
                   {"num_kv_heads", l.attn.num_kv_heads},
                   {"head_dim", l.attn.head_dim},
                   {"bytes_per_token", l.bytes_per_token()},
                   {"keep_sink", l.keep_sink},
                   {"keep_recent", l.keep_recent},
                   {"exact_bytes_per_token", l.exact_bytes_per_token()}};
  if (l.keeps_exact()) e["exact_dtype"] = std::string(dtype_name(l.exact_storage));
  if (l.attn.kind == AttentionKind::Sliding) e["window"] = l.attn.window;
  if (l.scale_source == ScaleSource::CheckpointTensor) {
    e["k_scale_tensor"] = l.k_scale_name;
    e["v_scale_tensor"] = l.v_scale_name;
  }
  if (l.k != l.v) {  // K and V apart: each side's format
    e["v_dtype"] = std::string(dtype_name(l.v.storage));
    e["v_quant_mode"] = std::string(kv_quant_mode_name(l.v.mode));
  }
  if (l.v_dtype_source != l.dtype_source) e["v_dtype_source"] = std::string(dtype_source_name(l.v_dtype_source));
  if (l.rotation_seed != 0) e["rotation_seed"] = l.rotation_seed;
  if (l.k.mode == KVQuantMode::Fp8PerTensor) e["k_scale"] = l.k_scale;
  if (l.v.mode == KVQuantMode::Fp8PerTensor) e["v_scale"] = l.v_scale;
  return e;
}

}  // namespace kvlm

#include "attention/selector.h"

#include <algorithm>

#include "core/error.h"
#include "kv/kv_formats.h"

namespace kvlm {

std::string_view device_name(Device d) { return d == Device::Cpu ? "cpu" : "cuda"; }

std::string describe_kv_format(const KVLayerSpec& l) { return kv_pair_name(l.k, l.v, kv_format_name); }

std::string describe_layer(const KVLayerSpec& l) {
  std::string kind(attention_kind_name(l.attn.kind));
  if (l.attn.kind == AttentionKind::Sliding) kind += "(" + std::to_string(l.attn.window) + ")";
  return (l.attn.model == "target" ? "" : l.attn.model + " ") + "layer " + std::to_string(l.attn.layer) + " (" + kind +
         ", KV " + describe_kv_format(l) + ", head_dim " +
         std::to_string(l.attn.head_dim) + ")";
}

std::string compute_capability_name(int cc) { return std::to_string(cc / 10) + "." + std::to_string(cc % 10); }

const ComputeTier* find_compute_tier(const BackendCapabilities& c, int cc) {
  for (const auto& t : c.compute_tiers)
    if (t.covers(cc)) return &t;
  return nullptr;
}

namespace {
std::string tier_range(const ComputeTier& t) {
  if (t.max_cc == 0) return compute_capability_name(t.min_cc) + " and up";
  if (t.max_cc == t.min_cc) return compute_capability_name(t.min_cc);
  return compute_capability_name(t.min_cc) + "-" + compute_capability_name(t.max_cc);
}
}  // namespace

std::string describe_compute_tiers(const BackendCapabilities& c) {
  std::string s;
  for (const auto& t : c.compute_tiers) {
    s += (s.empty() ? "" : "; ") + tier_range(t) + ": " + t.code;
    std::string extra;
    if (!t.software_fp8.empty()) extra = "FP8 converted in software";
    if (!t.note.empty()) extra += (extra.empty() ? "" : ", ") + t.note;
    if (!extra.empty()) s += " (" + extra + ")";
  }
  return s;
}

std::optional<std::string> rejection_reason(const BackendCapabilities& c, const KVLayerSpec& l, const SelectionContext& ctx) {
  if (c.device != ctx.device)
    return "runs on " + std::string(device_name(c.device)) + ", not " + std::string(device_name(ctx.device));
  if (c.min_compute_capability > 0 && ctx.compute_capability < c.min_compute_capability)
    return "needs compute capability " + compute_capability_name(c.min_compute_capability) + " or higher, device has " +
           compute_capability_name(ctx.compute_capability);
  if (!c.compute_tiers.empty() && !find_compute_tier(c, ctx.compute_capability))
    return "has no device code for compute capability " + compute_capability_name(ctx.compute_capability) +
           " in this build (it covers " + describe_compute_tiers(c) +
           "); rebuild with CMAKE_CUDA_ARCHITECTURES including an architecture this GPU runs";
  for (const KVSide side : {KVSide::K, KVSide::V}) {
    const KVStorage& fmt = l.format(side);
    if (std::ranges::find(c.kv_formats, fmt) == c.kv_formats.end())
      return "does not handle " + std::string(l.k == l.v ? "KV " : side == KVSide::K ? "K " : "V ") +
             std::string(dtype_name(fmt.storage)) + " with quant mode " + std::string(kv_quant_mode_name(fmt.mode));
  }
  if (!c.holds_pair(l.k, l.v)) {
    if (!c.kv_pairs)
      return "holds K and V in one format only (this layer: " + describe_kv_format(l) +
             "); give K and V one --kv-cache-dtype, or run on the CPU backend";
    return "does not read " + describe_kv_format(l) + " (K and V apart it reads " + describe_kv_pairs(*c.kv_pairs) +
           "); choose one of those pairs, give K and V one format, or run on the CPU backend";
  }
  const int hd = l.attn.head_dim;
  if (c.head_sizes.empty() ? (hd % 2 != 0 || hd > c.max_head_size)
                           : std::ranges::find(c.head_sizes, hd) == c.head_sizes.end()) {
    std::string sizes;
    for (int s : c.head_sizes) sizes += (sizes.empty() ? "" : ", ") + std::to_string(s);
    return "does not support head_dim " + std::to_string(hd) +
           (c.head_sizes.empty() ? " (even sizes up to " + std::to_string(c.max_head_size) + ")" : " (supports " + sizes + ")");
  }
  switch (l.attn.kind) {
    case AttentionKind::Full:
      if (!c.causal) return std::string("does not support causal attention");
      break;
    case AttentionKind::Sliding:
      if (!c.sliding_window) return std::string("does not support sliding-window attention");
      break;
    case AttentionKind::NonCausal:
      if (!c.non_causal) return std::string("does not support non-causal attention");
      break;
  }
  if (l.attn.sinks && !c.attention_sinks)
    return std::string("does not add learned attention sinks to its softmax (this model's attention needs them)");
  if (l.keeps_exact() && !c.exact_tokens)
    return std::string("cannot read exact sink / recent tokens (--kv-cache-keep-sink / --kv-cache-keep-recent); "
                       "drop those flags or choose a backend that can");
  return std::nullopt;
}

std::optional<std::string> selection_note(const BackendCapabilities& c, const KVLayerSpec& l, const SelectionContext& ctx) {
  const ComputeTier* t = find_compute_tier(c, ctx.compute_capability);
  auto soft = [&](const KVStorage& kv) { return std::ranges::find(t->software_fp8, kv) != t->software_fp8.end(); };
  if (!t || (!soft(l.k) && !soft(l.v))) return std::nullopt;
  return "the " + c.name + " backend converts FP8 in software for KV " + describe_kv_format(l) + " on compute capability " +
         compute_capability_name(ctx.compute_capability) + " (" + t->code + " code" +
         (t->software_fp8_why.empty() ? "" : ": " + t->software_fp8_why) +
         "): the same results as the conversion instructions, more work per key";
}

const BackendCapabilities& select_backend(const KVLayerSpec& l, std::span<const BackendCapabilities> backends,
                                          const SelectionContext& ctx) {
  if (ctx.forced) {
    auto it = std::ranges::find_if(backends, [&](const auto& b) { return b.name == *ctx.forced; });
    if (it == backends.end()) {
      std::string names;
      for (const auto& b : backends) names += (names.empty() ? "" : ", ") + b.name;
      throw Error("unknown --attention-backend '" + *ctx.forced + "'; available backends: " + names);
    }
    if (auto why = rejection_reason(*it, l, ctx))
      throw Error("--attention-backend " + it->name + " cannot run " + describe_layer(l) + ": it " + *why);
    return *it;
  }
  const BackendCapabilities* best = nullptr;
  std::string reasons;
  for (const auto& b : backends) {
    if (auto why = rejection_reason(b, l, ctx)) {
      reasons += "\n  " + b.name + ": " + *why;
    } else if (!best || b.priority > best->priority) {
      best = &b;
    }
  }
  if (!best)
    throw Error("no attention backend can run " + describe_layer(l) + " on " + std::string(device_name(ctx.device)) +
                ". Reasons:" + reasons);
  return *best;
}

void assign_backends(KVPlan& plan, std::span<const BackendCapabilities> backends, const SelectionContext& ctx) {
  for (auto& l : plan.layers) {
    const BackendCapabilities& b = select_backend(l, backends, ctx);
    l.backend = b.name;
    if (auto note = selection_note(b, l, ctx); note && std::ranges::find(plan.warnings, *note) == plan.warnings.end())
      plan.warnings.push_back(*note);
  }
}

}  // namespace kvlm

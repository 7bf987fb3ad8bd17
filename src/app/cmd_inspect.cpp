// kvlm inspect: print the resolved per-layer KV plan without loading weights.
#include <fstream>
#include <iomanip>
#include <map>
#include <numeric>
#include <optional>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "attention/registry.h"
#include "core/error.h"
#include "core/log.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "io/checkpoint.h"
#include "text/gguf_tokenizer.h"
#include "model/architecture.h"
#include "model/loaded_model.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"
#include "ops/cpu/quant_matmul.h"

namespace kvlm::app {

CLI::App* add_inspect(CLI::App& app, InspectFlags& f) {
  auto* cmd = app.add_subcommand("inspect", "Show the per-layer KV-cache plan a model would run with");
  f.model.add_to(*cmd);
  f.model.add_speculative_to(*cmd);
  cmd->add_flag("--json", f.json, "print the plan as JSON");
  cmd->add_option("--write-kv-plan", f.write_kv_plan,
                  "also write the resolved KV plan as a plan file (every layer's K and V format, rotation, exact "
                  "tokens) to edit and pass back with --kv-cache-plan");
  return cmd;
}

namespace {

std::string kind_str(const KVLayerSpec& l) {
  std::string s(attention_kind_name(l.attn.kind));
  if (l.attn.kind == AttentionKind::Sliding) s += "(" + std::to_string(l.attn.window) + ")";
  if (l.attn.sinks) s += "+sinks";
  return s;
}

// Parameters: all of them (every weight the architecture's definition loads, as shaped by
// config.json), and those one token reads: all but the experts its router leaves out and, when
// the LM head has its own matrix, all but one row of the embedding table. Per layer: the
// MLP's total and per-token counts.
struct ParamCounts {
  int64_t total = 0, active = 0;
  std::vector<int64_t> mlp_total, mlp_active;
};
ParamCounts count_params(const ModelConfig& c) {
  ParamCounts p;
  const std::unique_ptr<ModelDefinition> def = make_model_definition(c);
  for (const WeightSpec& s : def->weights().specs)
    if (!s.pieces.empty()) p.total += s.rows() * s.cols();
  const int64_t H = c.hidden_size;
  p.active = p.total - (c.tie_word_embeddings ? 0 : (int64_t(c.vocab_size) - 1) * H);
  for (int i = 0; i < c.num_layers; ++i) {
    int64_t total = 0, active = 0;
    if (c.moe && c.moe_layers[size_t(i)]) {
      const MoeConfig& m = *c.moe;
      const int64_t router = int64_t(m.num_experts) * (H + (m.router_bias ? 1 : 0));
      const int64_t expert = 3 * H * m.expert_size + (m.expert_bias ? 2 * int64_t(m.expert_size) + H : 0);
      const int64_t shared = m.shared_expert_size > 0 ? 3 * H * m.shared_expert_size + H : 0;  // with its gate
      total = router + int64_t(m.num_experts) * expert + shared;
      active = router + int64_t(m.top_k) * expert + shared;
    } else {
      total = active = 3 * H * c.intermediate_size + (c.mlp_bias ? 2 * int64_t(c.intermediate_size) + H : 0);
    }
    p.mlp_total.push_back(total);
    p.mlp_active.push_back(active);
    p.active -= total - active;
  }
  return p;
}

// 212K, 3.3M, 30.5B: a parameter count in three digits or so.
std::string human_count(int64_t n) {
  std::ostringstream s;
  const double v = double(n);
  const auto [div, unit] = v >= 1e9 ? std::pair{1e9, "B"} : v >= 1e6 ? std::pair{1e6, "M"} : std::pair{1e3, "K"};
  s << std::fixed << std::setprecision(v / div >= 100 ? 0 : 1) << v / div << unit;
  return s.str();
}

// "dense 96", "8 experts x 32, top 2 (1.3M of 4.8M per token)" or, with a shared expert,
// "6 experts x 32, top 2 + shared 48 (22K of 47K per token)".
std::string mlp_str(const ModelConfig& c, const ParamCounts& p, int layer) {
  if (!c.moe || !c.moe_layers[size_t(layer)]) return "dense " + std::to_string(c.intermediate_size);
  const MoeConfig& m = *c.moe;
  return std::to_string(m.num_experts) + " experts x " + std::to_string(m.expert_size) + ", top " +
         std::to_string(m.top_k) + (m.shared_expert_size > 0 ? " + shared " + std::to_string(m.shared_expert_size) : "") +
         " (" + human_count(p.mlp_active[size_t(layer)]) + " of " +
         human_count(p.mlp_total[size_t(layer)]) + " per token)";
}

// One property of a layer's KV format: the same for K and V, or "k:A v:B".
template <class F>
std::string kv_side_str(const KVLayerSpec& l, F&& name) {
  return l.k == l.v ? name(l.k) : "k:" + name(l.k) + " v:" + name(l.v);
}

// Where the layer's formats came from: one source, or "k:plan file v:explicit".
std::string source_str(const KVLayerSpec& l) {
  const auto k = std::string(dtype_source_name(l.dtype_source)), v = std::string(dtype_source_name(l.v_dtype_source));
  return k == v ? k : "k:" + k + " v:" + v;
}

// The rotation: "none", "hadamard", "hadamard_k" / "hadamard_v" (one side), with a non-default seed.
std::string rotation_str(const KVLayerSpec& l) {
  std::string s = kv_rotation_text(l);
  if (l.rotates() && l.rotation_seed != 0) s += " seed " + std::to_string(l.rotation_seed);
  return s;
}

std::string scale_str(const KVLayerSpec& l) {
  if (l.scale_source == ScaleSource::CheckpointTensor) {
    // Show the k tensor's name; the v tensor follows the same pattern.
    std::string s = l.k_scale_name;
    if (l.k_scale.size() > 1) s += " [" + std::to_string(l.k_scale.size()) + " heads]";
    return s;
  }
  if (l.k == l.v && l.k.mode == KVQuantMode::Int4PerTokenHead) return "per-token-head dynamic, zero point";
  return std::string(scale_source_name(l.scale_source));
}

// A GGUF model: the file, its tensor types, and where every config field and the tokenizer
// came from in its metadata.
struct GGUFProvenance {
  std::string file;
  uint32_t version = 0;
  uint64_t bytes = 0;
  std::map<std::string, int> tensor_types;
  std::vector<std::string> config, tokenizer;
};

// From the checkpoint's open file: no second mapping or parse of the metadata.
std::optional<GGUFProvenance> gguf_provenance(const Checkpoint& ckpt) {
  const GGUFFile* f = ckpt.gguf_file();
  if (!f) return std::nullopt;
  GGUFProvenance g{.file = f->path().string(), .version = f->header().version, .bytes = f->size()};
  for (const auto& t : f->header().tensors) ++g.tensor_types[ggml_type_name(t.type)];
  g.config = ckpt.gguf_notes();
  try {
    g.tokenizer = load_gguf_tokenizer(f->header(), g.file).notes;
  } catch (const Error& e) {
    g.tokenizer = {std::string("none usable: ") + e.what()};
  }
  return g;
}

// How the device would hold the weights: per layer (-1: the embedding, LM head and final norm)
// the bytes of each format, and for a GGUF file which of its quantized tensors keep their
// blocks (the CPU reads Q4_0 .. Q6_K as stored; a GPU converts them to 4- or 8-bit grouped
// codes, io/grouped_codes.h) and which are dequantized at load.
struct HeldWeights {
  std::map<int, std::map<std::string, size_t>> layers;
  std::map<std::string, int> kept, dequantized;  // GGUF tensor type -> tensors
  size_t bytes = 0;
  std::map<std::string, size_t> layer(int i) const {
    const auto it = layers.find(i);
    return it == layers.end() ? std::map<std::string, size_t>{} : it->second;
  }
};
HeldWeights held_weights(const ModelConfig& cfg, const Checkpoint& ckpt, Device device, DType dtype, bool keep_blocks,
                         int tp) {
  HeldWeights h;
  const std::unique_ptr<ModelDefinition> def = make_model_definition(weight_config(cfg, tp));
  for (const WeightSpec& s : def->weights().specs) {
    const bool sliced = sliced_by_tp(s, tp);
    for (const WeightPiece& p : s.pieces) {
      int layer = -1;
      if (p.name.starts_with("model.layers.")) layer = std::atoi(p.name.c_str() + 13);
      const std::vector<int64_t> shape = p.held_shape();  // a section or group of rows: those rows
      const int64_t numel = std::accumulate(shape.begin(), shape.end(), int64_t(1), std::multiplies<>());
      const auto b = s.role == WeightRole::Matrix ? ckpt.blocks(p.name) : std::nullopt;
      std::string format;
      size_t bytes = 0;
      if (b && device == Device::Cpu && keep_blocks && !sliced && p.layout == PieceLayout::Plain &&
          ops::cpu::held_block_type(b->type) != 0) {
        // a 4-bit checkpoint's grouped rows become Q4_1 blocks (cpu_runner.cpp)
        const uint32_t held = ops::cpu::held_block_type(b->type);
        format = held != b->type ? block_type_name(b->type) + " as " + ggml_type_name(held) : ggml_type_name(b->type);
        bytes = size_t(b->rows) * (held != b->type ? ops::cpu::block_row_bytes(held, b->cols) : b->row_bytes);
        ++h.kept[format];
      } else if (const auto l = b ? grouped_layout_of_ggml(b->type) : std::nullopt;
                 l && device == Device::Cuda && keep_blocks && !sliced && p.layout == PieceLayout::Plain) {
        format = is_grouped_rows_type(b->type) ? block_type_name(b->type) + " codes"
                                                : ggml_type_name(b->type) + " as " + std::to_string(l->bits) + "-bit codes";
        bytes = size_t(b->rows) * grouped_row_bytes(*l, b->cols);
        ++h.kept[block_type_name(b->type)];
      } else {
        DType held = DType::F32;
        if (device == Device::Cuda && (s.role == WeightRole::Matrix || s.role == WeightRole::Bias))
          held = cfg.weight_quant && s.linear ? DType::F8E4M3 : dtype;
        format = std::string(dtype_name(held));
        bytes = size_t(numel) * dtype_size(held);
        if (b) ++h.dequantized[block_type_name(b->type)];
      }
      h.layers[layer][format] += bytes;
      h.bytes += bytes;
    }
  }
  return h;
}

// "Q4_K 1.2 MB + float32 5.1 KB" (decimal units, as the file sizes above).
std::string formats_str(const std::map<std::string, size_t>& f) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  for (const auto& [format, bytes] : f) {
    s << (s.tellp() > 0 ? " + " : "") << format << " ";
    if (bytes >= 100000) s << double(bytes) / 1e6 << " MB";
    else s << double(bytes) / 1e3 << " KB";
  }
  return s.str();
}

}  // namespace

int run_inspect(const InspectFlags& f) {
  const auto dir = f.model.model_dir();
  const CacheConfig cache = f.model.cache_config();
  const std::optional<SpeculativeConfig> spec =
      f.model.speculative_config.empty() ? std::nullopt
                                         : std::optional(parse_speculative_config(f.model.speculative_config));
  const DeviceChoice dc = resolve_device(f.model.device);
  const Device device = dc.device;
  const Checkpoint ckpt = Checkpoint::open(dir);
  ModelPlan mp = plan_model(dir, ckpt, cache, selection_context(dc.device, dc.gpu, cache),
                            parse_model_dtype(f.model.dtype), spec ? &*spec : nullptr, f.model.quantization);
  apply_expert_parallel(mp.config, f.model.enable_expert_parallel);
  const KVPlan& plan = mp.plan;
  const std::optional<GGUFProvenance> gguf = gguf_provenance(ckpt);
  size_t draft_bytes = 0;  // of the bytes per token, the drafter's layers'
  for (const auto& l : plan.layers)
    if (l.attn.model != "target") draft_bytes += l.bytes_per_token();
  const ModelConfig& cfg = mp.config;
  // Tensor parallelism: what each rank holds (tp_layout throws with the sizes that work).
  const int tp = f.model.tensor_parallel_size;
  const TpLayout layout = tp_layout(cfg, tp);
  if (tp > 1 && mp.drafter)
    throw Error("--tensor-parallel-size " + std::to_string(tp) + ": DFlash drafting runs on one GPU for now");
  struct RankShare {
    int q0, q1, kv0, kv1;  // [first, last] query and KV heads
    int64_t m0, m1;        // dense MLP columns [first, last]
    int64_t e0, e1;        // every expert's columns [first, last], or with expert parallelism its experts
    size_t kv_bytes;       // KV bytes per token the rank holds
  };
  const bool dense_mlp = !cfg.moe || std::ranges::find(cfg.moe_layers, false) != cfg.moe_layers.end();
  const bool ep = cfg.moe && cfg.moe->expert_parallel;
  const int64_t expert_cols = cfg.moe ? (ep ? cfg.moe->num_experts : cfg.moe->expert_size) / tp : 0;
  std::vector<RankShare> shares;
  for (int r = 0; r < tp && tp > 1; ++r) {
    const UnitRange kv = shard_units(cfg.num_kv_heads, {r, tp});
    shares.push_back({r * layout.q_heads, (r + 1) * layout.q_heads - 1, int(kv.begin), int(kv.begin + kv.count - 1),
                      r * layout.intermediate, (r + 1) * layout.intermediate - 1, r * expert_cols,
                      (r + 1) * expert_cols - 1, shard_kv_plan(plan, {r, tp}).bytes_per_token()});
  }
  const HeldWeights held = held_weights(cfg, ckpt, device, mp.dtype, !f.model.dequantize_weights, tp);
  // The same model with an unquantized cache in the model dtype, for the capacity ratio.
  size_t baseline = 0;
  for (const auto& l : plan.layers) baseline += 2 * size_t(l.attn.num_kv_heads) * size_t(l.attn.head_dim) * dtype_size(mp.dtype);

  if (!f.write_kv_plan.empty()) {
    const nlohmann::json pj = kv_plan_file_json(kv_plan_file_of(plan, std::string(arch_name(cfg.arch)), cfg.num_layers));
    std::ofstream out(f.write_kv_plan);
    if (!(out << pj.dump(2) << "\n"))
      throw Error("cannot write --write-kv-plan file " + f.write_kv_plan);
    log::info("wrote the KV plan of " + std::to_string(plan.layers.size()) + " layers to " + f.write_kv_plan +
              " (pass it back with --kv-cache-plan)");
  }
  if (f.json) {
    nlohmann::json j;
    j["model"] = dir.string();
    j["architecture"] = std::string(arch_name(cfg.arch));
    j["model_dtype"] = std::string(dtype_name(mp.dtype));
    j["device"] = std::string(device_name(device));
    j["kv_cache_dtype"] = kv_cache_dtypes_text(plan.requested);
    auto resolved = [](const KVDTypeResolution& r) {
      return nlohmann::json{{"storage", std::string(dtype_name(r.storage.storage))},
                            {"quant_mode", std::string(kv_quant_mode_name(r.storage.mode))},
                            {"source", std::string(dtype_source_name(r.source))},
                            {"note", r.note}};
    };
    j["resolved"] = resolved(plan.resolution);  // K's (and V's unless v_resolved is present)
    if (plan.requested.v) j["v_resolved"] = resolved(plan.v_resolution);
    if (cfg.kv_scheme) j["checkpoint_kv_scheme"] = cfg.kv_scheme->origin;
    if (const auto& q = cfg.weight_quant) {
      nlohmann::json w{{"format", "fp8_e4m3"},
                       {"scaling", std::string(fp8_scaling_name(q->scaling))},
                       {"activations", std::string(fp8_activations_name(q->activations))},
                       {"origin", q->origin},
                       {"quantized_at_load", q->on_the_fly},
                       {"ignore", q->ignore}};
      if (q->scaling == Fp8Scaling::Block) w["block"] = {q->block_rows, q->block_cols};
      j["weights"] = w;
    } else {
      j["weights"] = {{"format", std::string(dtype_name(mp.dtype))}};
    }
    j["weights"]["bytes"] = held.bytes;
    j["weights"]["outside_layers"] = held.layer(-1);
    if (gguf)
      j["gguf"] = {{"file", gguf->file}, {"version", gguf->version}, {"bytes", gguf->bytes},
                   {"tensor_types", gguf->tensor_types}, {"kept_in_blocks", held.kept},
                   {"dequantized_at_load", held.dequantized}, {"config_from", gguf->config},
                   {"tokenizer_from", gguf->tokenizer}};
    const ParamCounts params = count_params(cfg);
    j["parameters"] = params.total;
    j["parameters_per_token"] = params.active;
    nlohmann::json layers = nlohmann::json::array();
    for (const auto& l : plan.layers) {
      nlohmann::json e = kv_layer_json(l);
      e["attention_sinks"] = l.attn.sinks;
      if (l.attn.model == "target") {
        const int i = l.attn.layer;
        e["weights"] = held.layer(i);
        if (cfg.moe && cfg.moe_layers[size_t(i)])
          e["mlp"] = {{"kind", "experts"}, {"experts", cfg.moe->num_experts}, {"top_k", cfg.moe->top_k},
                      {"expert_size", cfg.moe->expert_size}, {"shared_expert_size", cfg.moe->shared_expert_size},
                      {"parameters", params.mlp_total[size_t(i)]},
                      {"parameters_per_token", params.mlp_active[size_t(i)]}};
        else
          e["mlp"] = {{"kind", "dense"}, {"intermediate_size", cfg.intermediate_size},
                      {"parameters", params.mlp_total[size_t(i)]}};
      }
      layers.push_back(e);
    }
    j["layers"] = layers;
    if (const auto& la = cfg.linear_attention) {  // hybrid models: the layers without KV
      nlohmann::json lin = nlohmann::json::array();
      for (int i = 0; i < cfg.num_layers; ++i)
        if (cfg.is_linear_layer(i))
          lin.push_back({{"layer", i}, {"kind", "gated_deltanet"}, {"state_bytes_per_sequence", la->state_bytes()},
                         {"state_dtype", std::string(dtype_name(la->state_dtype))},
                         {"weights", held.layer(i)}});
      j["linear_layers"] = lin;
      j["linear_state_bytes_per_sequence"] = la->state_bytes() * size_t(cfg.num_linear_layers());
    }
    j["kv_bytes_per_token"] = plan.bytes_per_token();
    j["exact_bytes_per_token"] = plan.exact_bytes_per_token();
    j["model_dtype_kv_bytes_per_token"] = baseline;
    j["warnings"] = plan.warnings;
    if (tp > 1) {
      nlohmann::json ranks = nlohmann::json::array();
      for (const RankShare& r : shares)
        ranks.push_back({{"q_heads", {r.q0, r.q1}}, {"kv_heads", {r.kv0, r.kv1}},
                         {"mlp_columns", dense_mlp ? nlohmann::json{r.m0, r.m1} : nlohmann::json(nullptr)},
                         {ep ? "experts" : "expert_columns", cfg.moe ? nlohmann::json{r.e0, r.e1} : nlohmann::json(nullptr)},
                         {"kv_bytes_per_token", r.kv_bytes}});
      j["tensor_parallel"] = {{"size", tp}, {"kv_head_replicas", layout.kv_replicas}, {"ranks", ranks}};
    }
    if (spec) {
      nlohmann::json s{{"method", std::string(spec_method_name(spec->method))},
                       {"num_speculative_tokens", spec->num_speculative_tokens}};
      if (spec->method == SpecMethod::Ngram) {
        s["prompt_lookup_min"] = spec->prompt_lookup_min;
        s["prompt_lookup_max"] = spec->prompt_lookup_max;
        s["draft_kv_bytes_per_token"] = 0;  // no drafter model, no KV
      } else if (mp.drafter) {
        s["model"] = spec->model;
        s["block_size"] = mp.drafter->dflash->block_size;
        s["mask_token_id"] = mp.drafter->dflash->mask_token_id;
        s["target_layer_ids"] = mp.drafter->dflash->target_layer_ids;
        s["draft_kv_bytes_per_token"] = draft_bytes;
      }
      j["speculative"] = s;
    }
    nlohmann::json backends = nlohmann::json::array();
    for (const auto& b : builtin_backend_caps())
      backends.push_back({{"name", b.name}, {"device", std::string(device_name(b.device))}, {"priority", b.priority},
                          {"description", b.description}});
    j["backends"] = backends;
    std::cout << j.dump(2) << std::endl;
    return 0;
  }

  const ParamCounts params = count_params(cfg);
  std::cout << "model      " << dir.string() << "\n"
            << "           " << arch_name(cfg.arch) << ", " << cfg.num_layers << " layers, " << cfg.num_heads << " q heads / "
            << cfg.num_kv_heads << " kv heads, head_dim " << cfg.head_dim << ", model dtype " << dtype_name(mp.dtype) << "\n"
            << "           " << human_count(params.total) << " parameters"
            << (cfg.moe ? ", " + human_count(params.active) + " read per token (" + std::to_string(cfg.moe->top_k) + " of " +
                              std::to_string(cfg.moe->num_experts) + " experts)"
                        : std::string())
            << "\n";
  if (gguf) {
    std::cout << "gguf       version " << gguf->version << ", " << gguf->bytes / 1000000 << " MB, tensors:";
    for (const auto& [type, n] : gguf->tensor_types) std::cout << " " << n << " " << type;
    std::cout << (device == Device::Cuda ? "\n           kept quantized (grouped codes):" : "\n           kept in their blocks:");
    for (const auto& [type, n] : held.kept) std::cout << " " << n << " " << type;
    if (held.kept.empty()) std::cout << " none";
    std::cout << "; dequantized at load:";
    for (const auto& [type, n] : held.dequantized) std::cout << " " << n << " " << type;
    if (held.dequantized.empty()) std::cout << " none";
    std::cout << (f.model.dequantize_weights ? " (--dequantize-weights)" : "")
              << "\n           config.json fields from the metadata:\n";
    for (const auto& n : gguf->config) std::cout << "             " << n << "\n";
    std::cout << "           tokenizer and chat template from:";
    for (const auto& n : gguf->tokenizer) std::cout << " " << n;
    std::cout << "\n";
  }
  if (const auto& q = cfg.weight_quant) {
    std::cout << "weights    " << q->describe();
    if (!q->ignore.empty()) {
      std::cout << "; left unquantized:";
      for (const auto& n : q->ignore) std::cout << " " << n;
    }
    std::cout << "\n";
  } else if (const auto& s = ckpt.int4_scheme()) {
    const std::string held(device == Device::Cuda ? dtype_name(mp.dtype) : std::string_view("float32"));
    const bool mx = s->kind == Int4Scheme::Kind::Mxfp4;
    std::cout << "weights    " << s->describe() << ": " << ckpt.int4_modules() << " modules, "
              << (f.model.dequantize_weights ? "dequantized to " + held + " at load (--dequantize-weights)\n"
                  : mx ? std::string("each expert kept as its MXFP4 blocks (") +
                             (device == Device::Cuda ? "4-bit E2M1 codes" : "the block kernels read them") +
                             "; \"MXFP4\" below)\n"
                  : device == Device::Cuda
                      ? "kept as 4-bit grouped codes where their groups fit the kernels (\"4-bit gN codes\" below), "
                        "else dequantized to " + held + " at load\n"
                      : "kept 4-bit as Q4_1 blocks where their groups fit the kernels (\"4-bit gN as Q4_1\" below), "
                        "else dequantized to " + held + " at load\n");
  } else {
    std::cout << "weights    " << dtype_name(mp.dtype) << "\n";
  }
  std::cout << "           " << std::fixed << std::setprecision(1) << double(held.bytes) / 1e6 << " MB as "
            << device_name(device) << " holds them; outside the layers: " << formats_str(held.layer(-1)) << "\n";
  if (cfg.kv_scheme) std::cout << "checkpoint declares " << cfg.kv_scheme->origin << "\n";
  auto resolved = [](const KVDTypeResolution& r) {
    return std::string(dtype_name(r.storage.storage)) + " / " + std::string(kv_quant_mode_name(r.storage.mode)) + " (" +
           std::string(dtype_source_name(r.source)) + (r.note.empty() ? "" : "; " + r.note) + ")";
  };
  std::cout << "kv cache   --kv-cache-dtype " << kv_cache_dtypes_text(plan.requested) << " -> "
            << (plan.requested.v ? "K " + resolved(plan.resolution) + ", V " + resolved(plan.v_resolution)
                                 : resolved(plan.resolution))
            << "\n\n";
  std::vector<std::vector<std::string>> rows{
      {"layer", "attention", "kv dtype", "quant", "dtype from", "scale source", "rotation", "exact tokens", "backend",
       "bytes/token", "mlp", "weights"}};
  // Rows in layer order: a hybrid model's Gated DeltaNet layers (no KV: a state per sequence)
  // between its attention layers; a drafter's layers after the target's.
  const size_t state_bytes = cfg.linear_attention ? cfg.linear_attention->state_bytes() : 0;
  size_t next_linear = 0;
  auto linear_rows_before = [&](int layer) {
    for (; next_linear < size_t(cfg.num_layers) && int(next_linear) < layer; ++next_linear)
      if (cfg.is_linear_layer(int(next_linear)))
        rows.push_back({std::to_string(next_linear), "linear (Gated DeltaNet)", "-", "-", "-", "-", "-", "-",
                        device == Device::Cuda ? "cuda" : "cpu",
                        "0 (" + std::to_string(state_bytes) + " B/seq)", mlp_str(cfg, params, int(next_linear)),
                        formats_str(held.layer(int(next_linear)))});
  };
  for (const auto& l : plan.layers) {
    linear_rows_before(l.attn.model == "target" ? l.attn.layer : cfg.num_layers);
    // Exact sink / recent tokens: "sink 4 + recent 64, bf16 256 B/token" (bytes of one exact token).
    std::string exact = "none";
    if (l.keeps_exact())
      exact = "sink " + std::to_string(l.keep_sink) + " + recent " + std::to_string(l.keep_recent) + ", " +
              std::string(dtype_name(l.exact_storage)) + " " + std::to_string(l.exact_bytes_per_token()) + " B/token";
    rows.push_back({(l.attn.model == "target" ? "" : l.attn.model + ":") + std::to_string(l.attn.layer), kind_str(l),
                    kv_side_str(l, [](const KVStorage& kv) { return std::string(dtype_name(kv.storage)); }),
                    kv_side_str(l, [](const KVStorage& kv) { return std::string(kv_quant_mode_name(kv.mode)); }),
                    source_str(l), scale_str(l), rotation_str(l), exact,
                    l.backend, std::to_string(l.bytes_per_token()),
                    l.attn.model == "target" ? mlp_str(cfg, params, l.attn.layer) : std::string("dense"),
                    l.attn.model == "target" ? formats_str(held.layer(l.attn.layer)) : std::string("-")});
  }
  linear_rows_before(cfg.num_layers);
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size(); ++c) {
      const bool numeric = c == 0 || c + 3 == r.size();
      if (c + 1 == r.size()) {  // the last column unpadded
        std::cout << r[c] << "\n";
        continue;
      }
      std::cout << (numeric ? std::right : std::left) << std::setw(int(width[c])) << r[c] << "  ";
    }
  }
  std::ostringstream ratio;
  ratio << std::fixed << std::setprecision(2) << double(baseline) / double(plan.bytes_per_token());
  std::cout << "\ntotal KV bytes per token: " << plan.bytes_per_token() << " (" << dtype_name(mp.dtype) << " cache: " << baseline
            << ", " << ratio.str() << "x the tokens in the same memory)\n";
  if (state_bytes > 0)
    std::cout << "linear-attention state: " << state_bytes * size_t(cfg.num_linear_layers()) << " bytes per running sequence ("
              << cfg.num_linear_layers() << " Gated DeltaNet layers x " << state_bytes
              << ": an fp32 conv window and the delta-rule matrices in " << dtype_name(cfg.linear_attention->state_dtype)
              << ", --mamba-ssm-cache-dtype), allocated for every --max-num-seqs slot and, with prefix caching, as many "
                 "snapshots\n";
  if (plan.exact_bytes_per_token() > 0)
    std::cout << "exact sink / recent tokens: " << plan.exact_bytes_per_token()
              << " bytes per exact token, on top, for the first " << plan.keep_sink() << " and the latest "
              << plan.keep_recent() << " tokens of every running sequence (see the KV cache line at startup)\n";
  if (tp > 1) {
    std::cout << "tensor parallel: " << tp << " ranks (one GPU each); attention and MLP split by heads and columns, "
              << (cfg.linear_attention ? "Gated DeltaNet layers by key heads, " : "")
              << "o" << (cfg.linear_attention ? ", out_proj" : "") << " and down summed by an all-reduce"
              << (ep ? "; whole experts per rank (--enable-expert-parallel), their outputs summed by the same all-reduce"
                     : "")
              << (layout.kv_replicas > 1 ? "; " + std::to_string(cfg.num_kv_heads) + " KV heads for " +
                                               std::to_string(tp) + " ranks: each KV head held by " +
                                               std::to_string(layout.kv_replicas) + " ranks"
                                         : "")
              << "\n";
    for (size_t r = 0; r < shares.size(); ++r) {
      const RankShare& x = shares[r];
      std::cout << "  rank " << r << ": q heads " << x.q0 << "-" << x.q1 << ", kv heads " << x.kv0 << "-" << x.kv1
                << (dense_mlp ? ", MLP columns " + std::to_string(x.m0) + "-" + std::to_string(x.m1) : "")
                << (!cfg.moe ? std::string()
                    : ep     ? ", experts " + std::to_string(x.e0) + "-" + std::to_string(x.e1)
                             : ", columns " + std::to_string(x.e0) + "-" + std::to_string(x.e1) + " of every expert")
                << ", " << x.kv_bytes << " KV bytes per token";
      if (const auto& la = cfg.linear_attention) {  // Gated DeltaNet layers: by key heads, their value heads along
        const int kh = la->k_heads / tp, vh = la->v_heads / tp;
        std::cout << ", linear key heads " << int(r) * kh << "-" << (int(r) + 1) * kh - 1 << " (value heads "
                  << int(r) * vh << "-" << (int(r) + 1) * vh - 1 << ", "
                  << shard_config(cfg, {int(r), tp}).linear_attention->state_bytes() * size_t(cfg.num_linear_layers())
                  << " state bytes per sequence)";
      }
      std::cout << (r == 0 ? " (and the LM head)" : "") << "\n";
    }
  }
  if (spec && spec->method == SpecMethod::Ngram) std::cout << "drafting   " << describe(*spec) << " (no drafter model: no draft KV)\n";
  if (spec && mp.drafter) {
    std::cout << "drafting   " << describe(*spec) << ": DFlash, blocks of " << mp.drafter->dflash->block_size
              << ", features of target layers";
    for (int l : mp.drafter->dflash->target_layer_ids) std::cout << " " << l;
    std::cout << "; its " << mp.drafter->num_layers << " layer(s) above (draft:N) hold " << draft_bytes
              << " of the bytes per token\n";
  }
  for (const auto& w : plan.warnings) std::cout << "warning: " << w << "\n";
  return 0;
}

}  // namespace kvlm::app

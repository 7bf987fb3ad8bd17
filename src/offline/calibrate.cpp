#include "offline/calibrate.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/cpu/cpu_runner.h"
#include "offline/score.h"

namespace kvlm {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr float kFp8E4M3Max = 448.0f;

float scale_of(float absmax) { return std::max(absmax / kFp8E4M3Max, 1e-8f); }

ojson read_ojson(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw Error("cannot read " + p.string());
  try {
    return ojson::parse(f);
  } catch (const std::exception& e) {
    throw Error(p.string() + " is not valid JSON: " + e.what());
  }
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << text;
  if (!f.flush()) throw Error("cannot write " + p.string());
}

// Hard link when the file system allows it (no bytes copied), else a copy.
void link_or_copy(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::create_hard_link(from, to, ec);
  if (!ec) return;
  fs::copy_file(from, to, fs::copy_options::none, ec);
  if (ec) throw Error("cannot copy " + from.string() + " to " + to.string() + ": " + ec.message());
}

std::string scale_name(int layer, char kv) {
  return "model.layers." + std::to_string(layer) + ".self_attn." + kv + "_scale";
}

}  // namespace

CalibrationResult calibrate_kv(LoadedModel& engine, const std::vector<std::vector<TokenId>>& samples, bool per_head) {
  auto* cpu = dynamic_cast<CpuModelRunner*>(&engine.model());
  if (!cpu) throw Error("calibration runs on the CPU runner; load the model with --device cpu");
  if (samples.empty()) throw Error("no calibration samples");
  const KVPlan& plan = engine.plan();
  CalibrationResult r;
  r.per_head = per_head;
  for (const auto& l : plan.layers) {
    LayerKVStats s;
    s.layer = l.attn.layer;
    s.k_absmax.assign(size_t(l.attn.num_kv_heads), 0.0f);
    s.v_absmax.assign(size_t(l.attn.num_kv_heads), 0.0f);
    r.layers.push_back(std::move(s));
  }
  cpu->set_kv_observer([&](size_t li, std::span<const float> k, std::span<const float> v) {
    LayerKVStats& s = r.layers[li];
    const size_t heads = s.k_absmax.size(), d = size_t(plan.layers[li].attn.head_dim);
    for (size_t i = 0; i < k.size(); ++i) {
      const size_t h = (i / d) % heads;
      s.k_absmax[h] = std::max(s.k_absmax[h], std::fabs(k[i]));
      s.v_absmax[h] = std::max(s.v_absmax[h], std::fabs(v[i]));
    }
  });
  struct Reset {
    CpuModelRunner* m;
    ~Reset() { m->set_kv_observer({}); }
  } reset{cpu};
  for (const auto& sample : samples) {
    if (sample.empty()) throw Error("a calibration sample has no tokens");
    score_tokens(engine, sample, 512, {});
    ++r.num_samples;
    r.num_tokens += int64_t(sample.size());
  }
  for (auto& s : r.layers) {
    if (per_head) {
      for (float a : s.k_absmax) s.k_scale.push_back(scale_of(a));
      for (float a : s.v_absmax) s.v_scale.push_back(scale_of(a));
    } else {
      s.k_scale = {scale_of(*std::max_element(s.k_absmax.begin(), s.k_absmax.end()))};
      s.v_scale = {scale_of(*std::max_element(s.v_absmax.begin(), s.v_absmax.end()))};
    }
  }
  return r;
}

void write_calibrated_model(const fs::path& in, const fs::path& out, const CalibrationResult& r) {
  std::error_code ec;
  if (!fs::is_directory(in, ec)) throw Error("model directory '" + in.string() + "' does not exist");
  if (fs::exists(out, ec)) {
    if (fs::equivalent(in, out, ec)) throw Error("--out must differ from --model: the input directory is never modified");
    if (!fs::is_directory(out, ec) || !fs::is_empty(out, ec))
      throw Error("--out '" + out.string() + "' exists and is not an empty directory; choose a new directory");
  }
  const fs::path config_path = in / "config.json";
  ojson config = read_ojson(config_path);
  if (auto it = config.find("quantization_config"); it != config.end() && it->is_object()) {
    const std::string method = it->value("quant_method", "");
    if (!method.empty() && method != "compressed-tensors")
      throw Error("the model already has a '" + method +
                  "' quantization_config; kvlm calibrate writes compressed-tensors KV scales and cannot merge them into it");
  }

  // Which tensors live in which file, and the scale tensors to add.
  ojson index;
  std::set<std::string> weight_files;
  const fs::path in_index = in / "model.safetensors.index.json";
  std::map<std::string, std::string> rename;  // input weight file -> output name
  if (fs::exists(in_index, ec)) {
    index = read_ojson(in_index);
    for (auto& [name, file] : index["weight_map"].items()) {
      weight_files.insert(file.get<std::string>());
      rename[file.get<std::string>()] = file.get<std::string>();
    }
  } else if (fs::exists(in / "model.safetensors", ec)) {
    const SafetensorsFile f(in / "model.safetensors");
    index = ojson{{"metadata", ojson::object()}, {"weight_map", ojson::object()}};
    // A single file becomes shard 1 of 2, so that no loader finds a model.safetensors that
    // lacks the scales (transformers prefers it over an index when both exist).
    const std::string shard = "model-00001-of-00002.safetensors";
    for (const auto& t : f.header().tensors) index["weight_map"][t.name] = shard;
    weight_files.insert("model.safetensors");
    rename["model.safetensors"] = shard;
  } else {
    throw Error("'" + in.string() + "' has no model.safetensors or model.safetensors.index.json");
  }
  const std::string scales_file = rename.count("model.safetensors") ? "model-00002-of-00002.safetensors" : "kv_scales.safetensors";

  fs::create_directories(out, ec);
  if (ec) throw Error("cannot create " + out.string() + ": " + ec.message());
  for (const auto& entry : fs::directory_iterator(in)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file()) continue;
    if (name == "config.json" || name == "model.safetensors.index.json") continue;  // rewritten below
    const auto r_it = rename.find(name);
    link_or_copy(entry.path(), out / (r_it != rename.end() ? r_it->second : name));
  }

  // The scales shard.
  std::vector<std::vector<uint8_t>> storage;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, const std::vector<float>& v) {
    storage.emplace_back(v.size() * sizeof(float));
    std::memcpy(storage.back().data(), v.data(), storage.back().size());
    std::vector<int64_t> shape;
    if (v.size() > 1) shape.push_back(int64_t(v.size()));
    tensors.push_back({name, DType::F32, shape, storage.back()});
    index["weight_map"][name] = scales_file;
  };
  storage.reserve(r.layers.size() * 2);
  for (const auto& l : r.layers) {
    add(scale_name(l.layer, 'k'), l.k_scale);
    add(scale_name(l.layer, 'v'), l.v_scale);
  }
  write_safetensors(out / scales_file, tensors);
  write_text(out / "model.safetensors.index.json", index.dump(2) + "\n");

  ojson qc = config.contains("quantization_config") && config["quantization_config"].is_object()
                 ? config["quantization_config"]
                 : ojson{{"quant_method", "compressed-tensors"}, {"format", "dense"}, {"config_groups", ojson::object()},
                         {"ignore", ojson::array()}, {"quantization_status", "compressed"}};
  qc["kv_cache_scheme"] = ojson{{"num_bits", 8}, {"type", "float"}, {"strategy", r.per_head ? "attn_head" : "tensor"},
                                {"dynamic", false}, {"symmetric", true}};
  config["quantization_config"] = qc;
  write_text(out / "config.json", config.dump(2) + "\n");
}

}  // namespace kvlm

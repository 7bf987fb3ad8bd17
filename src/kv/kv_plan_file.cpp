#include "kv/kv_plan_file.h"

#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"

namespace kvlm {

std::string KVPlanEntry::where() const {
  return (model == "target" ? std::string() : model + " ") + "layer " + std::to_string(layer);
}

const KVPlanEntry* KVPlanFile::find(std::string_view m, int layer) const {
  for (const auto& e : entries)
    if (e.model == m && e.layer == layer) return &e;
  return nullptr;
}

namespace {

using json = nlohmann::json;

std::string type_name(const json& j) { return j.type_name(); }

// "none" / "hadamard" -> false / true.
bool parse_rotation_word(const json& j, const std::string& what) {
  if (j.is_string()) {
    const auto s = j.get<std::string>();
    if (s == "none") return false;
    if (s == "hadamard") return true;
  }
  throw Error(what + " must be \"none\" or \"hadamard\", got " + j.dump());
}

int parse_int(const json& j, const std::string& what, int lo, int hi) {
  if (!j.is_number_integer()) throw Error(what + " must be an integer, got " + j.dump());
  const auto v = j.get<int64_t>();
  if (v < lo || v > hi)
    throw Error(what + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(v));
  return int(v);
}

std::optional<KVCacheDType> parse_side(const json& j, const std::string& what) {
  if (!j.is_string()) throw Error(what + " must be a KV cache dtype string, got " + j.dump());
  KVCacheDType d;
  try {
    d = parse_kv_cache_dtype(j.get<std::string>(), "dtype");
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
  if (d == KVCacheDType::Auto) return std::nullopt;  // the same as leaving the side out
  return d;
}

KVPlanEntry parse_entry(const json& j, const std::string& at) {
  if (!j.is_object()) throw Error(at + " must be an object, got " + type_name(j));
  KVPlanEntry e;
  if (!j.contains("layer")) throw Error(at + " has no \"layer\" (the layer's index, as `kvlm inspect` numbers them)");
  for (const auto& [key, val] : j.items()) {
    const std::string what = at + " \"" + key + "\"";
    if (key == "layer") e.layer = parse_int(val, what, 0, 1 << 20);
    else if (key == "model") {
      if (!val.is_string() || val.get<std::string>().empty()) throw Error(what + " must be a model name (\"target\" or \"draft\")");
      e.model = val.get<std::string>();
    } else if (key == "k") e.k = parse_side(val, what);
    else if (key == "v") e.v = parse_side(val, what);
    else if (key == "rotation") {
      if (val.is_object()) {
        for (const auto& [side, word] : val.items()) {
          if (side == "k") e.rotate_k = parse_rotation_word(word, what + " \"k\"");
          else if (side == "v") e.rotate_v = parse_rotation_word(word, what + " \"v\"");
          else throw Error(what + " has an unknown side \"" + side + "\"; the sides are \"k\" and \"v\"");
        }
      } else {
        const bool r = parse_rotation_word(val, what);
        e.rotate_k = e.rotate_v = r;
      }
    } else if (key == "rotation_seed") e.rotation_seed = uint32_t(parse_int(val, what, 0, 1 << 30));
    else if (key == "keep_sink") e.keep_sink = parse_int(val, what, 0, 65536);
    else if (key == "keep_recent") e.keep_recent = parse_int(val, what, 0, 65536);
    else
      throw Error(at + " has an unknown key \"" + key +
                  "\"; a layer's keys are layer, model, k, v, rotation, rotation_seed, keep_sink, keep_recent");
  }
  return e;
}

}  // namespace

KVPlanFile parse_kv_plan_file(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& ex) {
    throw Error("KV plan file " + source + " is not valid JSON: " + ex.what());
  }
  const std::string in = "KV plan file " + source;
  if (!j.is_object()) throw Error(in + " must hold a JSON object, got " + type_name(j));
  if (!j.contains("kvlm_kv_plan"))
    throw Error(in + " has no \"kvlm_kv_plan\": 1 (the format's version); is it a kvlm KV plan? "
                "`kvlm calibrate --kld-budget` and `kvlm inspect --write-kv-plan` write one");
  if (j["kvlm_kv_plan"] != 1)
    throw Error(in + " is version " + j["kvlm_kv_plan"].dump() + "; this kvlm reads version 1");
  KVPlanFile f;
  f.source = source;
  for (const auto& [key, val] : j.items()) {
    if (key == "kvlm_kv_plan") continue;
    if (key == "calibration") f.calibration = val;
    else if (key == "model") {
      if (!val.is_object()) throw Error(in + ": \"model\" must be an object");
      for (const auto& [mk, mv] : val.items()) {
        if (mk == "architecture") {
          if (!mv.is_string()) throw Error(in + ": \"model\" \"architecture\" must be a string");
          f.architecture = mv.get<std::string>();
        } else if (mk == "num_layers") f.num_layers = parse_int(mv, in + ": \"model\" \"num_layers\"", 1, 1 << 20);
        // Other keys describe the model for the reader (name, dtype) and are not checked.
      }
    } else if (key == "layers") {
      if (!val.is_array()) throw Error(in + ": \"layers\" must be an array of per-layer entries");
      std::set<std::pair<std::string, int>> seen;
      for (size_t i = 0; i < val.size(); ++i) {
        KVPlanEntry e = parse_entry(val[i], in + ": layers[" + std::to_string(i) + "]");
        if (!seen.insert({e.model, e.layer}).second)
          throw Error(in + ": " + e.where() + " appears twice in \"layers\"");
        f.entries.push_back(std::move(e));
      }
    } else
      throw Error(in + " has an unknown key \"" + key + "\"; its keys are kvlm_kv_plan, model, layers, calibration");
  }
  if (!j.contains("layers")) throw Error(in + " has no \"layers\" array");
  return f;
}

KVPlanFile load_kv_plan_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw Error("cannot read KV plan file " + path.string() + " (--kv-cache-plan)");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_kv_plan_file(ss.str(), path.string());
}

json kv_plan_file_json(const KVPlanFile& f) {
  json j{{"kvlm_kv_plan", 1}};
  json model = json::object();
  if (f.architecture) model["architecture"] = *f.architecture;
  if (f.num_layers) model["num_layers"] = *f.num_layers;
  if (!model.empty()) j["model"] = model;
  json layers = json::array();
  for (const auto& e : f.entries) {
    json l = json::object();
    if (e.model != "target") l["model"] = e.model;
    l["layer"] = e.layer;
    if (e.k) l["k"] = std::string(kv_cache_dtype_name(*e.k));
    if (e.v) l["v"] = std::string(kv_cache_dtype_name(*e.v));
    auto word = [](bool r) { return r ? "hadamard" : "none"; };
    if (e.rotate_k && e.rotate_v && *e.rotate_k == *e.rotate_v) l["rotation"] = word(*e.rotate_k);
    else if (e.rotate_k || e.rotate_v) {
      json r = json::object();
      if (e.rotate_k) r["k"] = word(*e.rotate_k);
      if (e.rotate_v) r["v"] = word(*e.rotate_v);
      l["rotation"] = r;
    }
    if (e.rotation_seed) l["rotation_seed"] = *e.rotation_seed;
    if (e.keep_sink) l["keep_sink"] = *e.keep_sink;
    if (e.keep_recent) l["keep_recent"] = *e.keep_recent;
    layers.push_back(std::move(l));
  }
  j["layers"] = std::move(layers);
  if (!f.calibration.is_null()) j["calibration"] = f.calibration;
  return j;
}

}  // namespace kvlm

#include "config/pooling_config.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"

namespace kvlm {

using json = nlohmann::json;

std::string_view pooling_type_name(PoolingType t) {
  switch (t) {
    case PoolingType::Last: return "last";
    case PoolingType::Mean: return "mean";
    case PoolingType::Cls: return "cls";
  }
  return "?";
}

namespace {

bool flag(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_boolean()) throw Error(where + ": '" + key + "' must be true or false");
  return it->get<bool>();
}

}  // namespace

std::optional<PoolingConfig> read_sentence_transformers(const std::filesystem::path& dir) {
  std::error_code ec;
  const std::filesystem::path modules_path = dir / "modules.json";
  if (!std::filesystem::is_directory(dir, ec) || !std::filesystem::exists(modules_path, ec)) return std::nullopt;
  const json modules = read_json_file(modules_path);
  if (!modules.is_array()) throw Error(modules_path.string() + ": expected a list of modules");
  PoolingConfig pc;
  pc.normalize = false;
  bool pooling = false;
  for (const json& m : modules) {
    if (!m.is_object() || !m.contains("type") || !m["type"].is_string())
      throw Error(modules_path.string() + ": every module needs a 'type' string");
    const std::string type = m["type"].get<std::string>();
    const std::string path = m.value("path", std::string());
    const auto is = [&](const char* name) { return type == std::string("sentence_transformers.models.") + name; };
    if (is("Transformer")) continue;
    if (is("Normalize")) {
      pc.normalize = true;
      continue;
    }
    if (is("Pooling")) {
      const std::filesystem::path cfg_path = dir / path / "config.json";
      const json c = read_json_file(cfg_path);
      const std::string where = cfg_path.string();
      if (!c.is_object()) throw Error(where + ": expected an object");
      std::vector<PoolingType> modes;
      if (flag(c, "pooling_mode_lasttoken", where)) modes.push_back(PoolingType::Last);
      if (flag(c, "pooling_mode_mean_tokens", where)) modes.push_back(PoolingType::Mean);
      if (flag(c, "pooling_mode_cls_token", where)) modes.push_back(PoolingType::Cls);
      for (const char* unsupported :
           {"pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens"})
        if (flag(c, unsupported, where))
          throw Error(where + ": '" + unsupported +
                      "' pooling is not supported; kvlm pools by the last token, the mean or the first (CLS) token");
      if (modes.size() != 1)
        throw Error(where + ": exactly one of pooling_mode_lasttoken, pooling_mode_mean_tokens and "
                    "pooling_mode_cls_token must be true (concatenated poolings are not supported)");
      if (c.contains("include_prompt") && !c["include_prompt"].is_null() && !flag(c, "include_prompt", where))
        throw Error(where + ": include_prompt false (pooling that leaves out an instruction prefix) is not supported");
      pc.type = modes.front();
      pooling = true;
      continue;
    }
    throw Error(modules_path.string() + ": module '" + type +
                "' is not supported; kvlm runs a Transformer, then Pooling, then optionally Normalize");
  }
  if (!pooling) throw Error(modules_path.string() + ": no sentence_transformers.models.Pooling module");
  pc.source = "modules.json";
  return pc;
}

PoolingConfig resolve_pooling(const std::filesystem::path& dir) {
  std::optional<PoolingConfig> st = read_sentence_transformers(dir);
  PoolingConfig pc = st ? *st : PoolingConfig{.source = "the default for a decoder: the last token, normalized"};
  std::error_code ec;
  const std::filesystem::path cfg_path = dir / "config.json";
  if (std::filesystem::is_directory(dir, ec) && std::filesystem::exists(cfg_path, ec)) {
    const json cfg = read_json_file(cfg_path);
    const std::string where = cfg_path.string();
    if (cfg.is_object()) {
      pc.matryoshka = flag(cfg, "is_matryoshka", where);
      if (const auto it = cfg.find("matryoshka_dimensions"); it != cfg.end() && !it->is_null()) {
        if (!it->is_array() || it->empty()) throw Error(where + ": 'matryoshka_dimensions' must be a list of sizes");
        for (const json& d : *it) {
          if (!d.is_number_integer() || d.get<int64_t>() < 1)
            throw Error(where + ": 'matryoshka_dimensions' must hold positive integers");
          pc.matryoshka_dimensions.push_back(d.get<int>());
        }
        pc.matryoshka = true;
      }
    }
  }
  return pc;
}

Pooler::Pooler(PoolingType type, int width) : type_(type), width_(width), acc_(size_t(width), 0.0) {
  KVLM_CHECK(width > 0, "pooling width must be positive");
}

void Pooler::add(std::span<const float> rows, int first_row) {
  const size_t W = size_t(width_);
  KVLM_CHECK(rows.size() % W == 0, "pooled rows are not whole rows");
  const int n = int(rows.size() / W);
  for (int r = 0; r < n; ++r) {
    const std::span<const float> row = rows.subspan(size_t(r) * W, W);
    const int p = first_row + r;
    if (type_ == PoolingType::Mean) {
      for (size_t i = 0; i < W; ++i) acc_[i] += double(row[i]);
    } else if (type_ == PoolingType::Last || p == 0) {
      std::copy(row.begin(), row.end(), acc_.begin());
    }
  }
  seen_ += n;
}

std::vector<float> Pooler::finish(bool normalize, int dims) const {
  KVLM_CHECK(seen_ > 0, "pooling a prompt with no rows");
  const size_t n = dims > 0 ? std::min(size_t(dims), acc_.size()) : acc_.size();
  std::vector<double> v(acc_.begin(), acc_.begin() + std::ptrdiff_t(n));
  if (type_ == PoolingType::Mean)
    for (double& x : v) x /= double(seen_);
  if (normalize) {
    double ss = 0;
    for (const double x : v) ss += x * x;
    // torch.nn.functional.normalize's eps: a zero vector stays zero.
    const double inv = 1.0 / std::max(std::sqrt(ss), 1e-12);
    for (double& x : v) x *= inv;
  }
  return std::vector<float>(v.begin(), v.end());
}

}  // namespace kvlm

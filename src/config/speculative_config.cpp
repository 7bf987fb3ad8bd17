#include "config/speculative_config.h"

#include <algorithm>
#include <array>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"

namespace kvlm {

std::string_view spec_method_name(SpecMethod m) { return m == SpecMethod::Ngram ? "ngram" : "dflash"; }

namespace {

constexpr std::string_view kWhere = "--speculative-config";
constexpr std::array<std::string_view, 2> kMethods{"ngram", "dflash"};
// The keys each method takes (vLLM's names).
constexpr std::array<std::string_view, 5> kNgramKeys{"method", "num_speculative_tokens", "prompt_lookup_max",
                                                     "prompt_lookup_min", "disable_by_batch_size"};
constexpr std::array<std::string_view, 5> kDFlashKeys{"method", "model", "num_speculative_tokens", "kv_cache_dtype",
                                                      "disable_by_batch_size"};

template <size_t N>
std::string join(const std::array<std::string_view, N>& a) {
  std::string s;
  for (auto v : a) s += (s.empty() ? "" : ", ") + std::string(v);
  return s;
}

}  // namespace

SpeculativeConfig parse_speculative_config(std::string_view text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    throw Error(std::string(kWhere) + " is not valid JSON: " + std::string(text) +
                R"( (example: {"method":"ngram","num_speculative_tokens":4}))");
  }
  if (!j.is_object())
    throw Error(std::string(kWhere) + R"( must be a JSON object, e.g. {"method":"ngram","num_speculative_tokens":4})");
  using namespace json_get;
  const auto method = opt_string(j, "method", kWhere);
  if (!method) throw Error(std::string(kWhere) + ": \"method\" is required; valid methods are: " + join(kMethods));
  SpeculativeConfig c;
  if (*method == "ngram") c.method = SpecMethod::Ngram;
  else if (*method == "dflash") c.method = SpecMethod::DFlash;
  else throw Error(std::string(kWhere) + ": unknown method '" + *method + "'; valid methods are: " + join(kMethods));
  for (const auto& [key, value] : j.items()) {
    const bool known = c.method == SpecMethod::Ngram ? std::ranges::find(kNgramKeys, key) != kNgramKeys.end()
                                                     : std::ranges::find(kDFlashKeys, key) != kDFlashKeys.end();
    if (!known)
      throw Error(std::string(kWhere) + ": unknown key '" + key + "' for method " + *method + "; valid keys are: " +
                  (c.method == SpecMethod::Ngram ? join(kNgramKeys) : join(kDFlashKeys)));
  }
  const auto k = opt_int(j, "num_speculative_tokens", kWhere);
  if (!k) throw Error(std::string(kWhere) + ": \"num_speculative_tokens\" is required (the tokens proposed per step)");
  if (*k < 1 || *k > 64)
    throw Error(std::string(kWhere) + ": num_speculative_tokens must be between 1 and 64, got " + std::to_string(*k));
  c.num_speculative_tokens = int(*k);
  if (const auto n = opt_int(j, "disable_by_batch_size", kWhere)) {
    if (*n < 1)
      throw Error(std::string(kWhere) + ": disable_by_batch_size must be at least 1 (the running sequences above "
                                        "which drafting pauses), got " + std::to_string(*n));
    c.disable_by_batch_size = int(std::min<int64_t>(*n, 1 << 30));
  }
  if (c.method == SpecMethod::Ngram) {
    auto lo = opt_int(j, "prompt_lookup_min", kWhere), hi = opt_int(j, "prompt_lookup_max", kWhere);
    if (!lo && !hi) lo = hi = 5;
    else if (!lo) lo = hi;
    else if (!hi) hi = lo;
    if (*lo < 1 || *hi > 1024 || *lo > *hi)
      throw Error(std::string(kWhere) + ": need 1 <= prompt_lookup_min <= prompt_lookup_max <= 1024, got " +
                  std::to_string(*lo) + " and " + std::to_string(*hi));
    c.prompt_lookup_min = int(*lo);
    c.prompt_lookup_max = int(*hi);
  } else {
    const auto model = opt_string(j, "model", kWhere);
    if (!model || model->empty())
      throw Error(std::string(kWhere) + ": method dflash needs \"model\", the drafter's model directory");
    c.model = *model;
    if (const auto dt = opt_string(j, "kv_cache_dtype", kWhere)) c.kv_cache_dtype = parse_kv_cache_dtype(*dt);
  }
  return c;
}

std::string describe(const SpeculativeConfig& c) {
  std::string s = std::string(spec_method_name(c.method)) + ", " + std::to_string(c.num_speculative_tokens) +
                  " token" + (c.num_speculative_tokens == 1 ? "" : "s");
  if (c.method == SpecMethod::Ngram)
    s += ", n-grams of " + std::to_string(c.prompt_lookup_min) + " to " + std::to_string(c.prompt_lookup_max) + " tokens";
  else
    s += ", drafter " + c.model;
  if (c.disable_by_batch_size > 0)
    s += ", paused above " + std::to_string(c.disable_by_batch_size) + " running sequences";
  return s;
}

}  // namespace kvlm

// kvlm calibrate: static FP8 KV scales from calibration text, written as a new model
// directory (compressed-tensors kv_cache_scheme + k_scale/v_scale tensors).
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "config/model_config.h"
#include "core/error.h"
#include "core/log.h"
#include "offline/calibrate.h"
#include "text/text_processor.h"

namespace kvlm::app {

CLI::App* add_calibrate(CLI::App& app, CalibrateFlags& f) {
  auto* cmd = app.add_subcommand("calibrate",
                                 "Compute static FP8 KV-cache scales and write a model directory that carries them");
  f.model.add_to(*cmd);
  cmd->add_option("--out,-o", f.out, "new model directory to write (must not exist or be empty)")->required();
  cmd->add_option("--dataset", f.dataset,
                  "calibration text: a .txt file (cut into windows) or .jsonl with a \"text\" or \"prompt\" field per "
                  "line (default: <model>/calibration.txt, else the model's eval/heldout.txt)");
  cmd->add_option("--num-samples", f.num_samples, "samples to run")->capture_default_str()->check(CLI::Range(1, 100000));
  cmd->add_option("--max-length", f.max_length, "tokens per sample at most")->capture_default_str()->check(CLI::Range(8, 1 << 20));
  cmd->add_flag("--per-head", f.per_head, "one scale per KV head (compressed-tensors strategy attn_head) instead of per layer");
  return cmd;
}

namespace {

std::filesystem::path default_dataset(const std::filesystem::path& model) {
  for (const auto& p : {model / "calibration.txt", model / "eval" / "heldout.txt"})
    if (std::filesystem::exists(p)) return p;
  throw Error("no calibration text given and none found in the model directory; pass --dataset FILE (.txt or .jsonl)");
}

std::vector<std::vector<TokenId>> load_samples(const std::filesystem::path& path, const std::optional<TextProcessor>& text,
                                               int num, int max_length) {
  std::ifstream f(path);
  if (!f) throw Error("cannot read --dataset " + path.string());
  std::vector<std::vector<TokenId>> out;
  // A long token stream becomes consecutive windows of max_length tokens.
  auto cut_windows = [&](const std::vector<TokenId>& ids) {
    for (size_t i = 0; i < ids.size() && int(out.size()) < num; i += size_t(max_length))
      out.emplace_back(ids.begin() + ptrdiff_t(i), ids.begin() + ptrdiff_t(std::min(ids.size(), i + size_t(max_length))));
  };
  if (path.extension() == ".ids") {  // token ids, for models without a tokenizer
    std::stringstream ss;
    ss << f.rdbuf();
    cut_windows(parse_token_ids(ss.str()));
  } else if (path.extension() == ".jsonl") {
    std::string line;
    for (int lineno = 1; std::getline(f, line) && int(out.size()) < num; ++lineno) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(line);
      } catch (const std::exception& e) {
        throw Error(path.string() + ":" + std::to_string(lineno) + ": not valid JSON (" + e.what() + ")");
      }
      std::string s;
      for (const char* key : {"text", "prompt"})
        if (j.is_object() && j.contains(key) && j[key].is_string()) {
          s = j[key].get<std::string>();
          break;
        }
      if (s.empty()) throw Error(path.string() + ":" + std::to_string(lineno) + ": expected a \"text\" or \"prompt\" string");
      if (!text) throw Error("the model has no tokenizer.json; give --dataset as a .ids file of token ids");
      auto ids = text->encode_prompt(s);
      if (int(ids.size()) > max_length) ids.resize(size_t(max_length));
      out.push_back(std::move(ids));
    }
  } else {
    if (!text) throw Error("the model has no tokenizer.json; give --dataset as a .ids file of token ids");
    std::stringstream ss;
    ss << f.rdbuf();
    cut_windows(text->encode_prompt(ss.str()));
  }
  if (out.empty()) throw Error("--dataset " + path.string() + " gave no calibration samples");
  return out;
}

}  // namespace

int run_calibrate(const CalibrateFlags& f) {
  ModelOptions opts = f.model.model_options();
  if (find_gguf(opts.model_dir))
    throw Error("kvlm calibrate writes a Hugging Face model directory with k/v scale tensors beside the input's "
                "safetensors; a GGUF model cannot be calibrated yet. The per-token-head modes "
                "(--kv-cache-dtype fp8_per_token_head, int8_per_token_head) compute their scales as they write and need "
                "no calibration");
  if (opts.tensor_parallel_size != 1)
    throw Error("kvlm calibrate runs the model on the CPU as one rank (it reads every KV head); drop "
                "--tensor-parallel-size: the scales it writes serve every tensor-parallel size");
  if (opts.device != Device::Cpu) {
    log::info("calibration runs on the CPU runner");
    opts.device = Device::Cpu;
  }
  // Observe unquantized K/V: the cache follows the model dtype whatever the checkpoint says.
  opts.cache.set_kv_dtypes({KVCacheDType::BFloat16, std::nullopt});
  opts.cache.skip_layers = {};
  const std::optional<TextProcessor> text = TextProcessor::load_if_usable(opts.model_dir);
  const auto dataset = f.dataset.empty() ? default_dataset(opts.model_dir) : std::filesystem::path(f.dataset);
  const auto samples = load_samples(dataset, text, f.num_samples, f.max_length);
  auto engine = LoadedModel::load(opts);
  const CalibrationResult r = calibrate_kv(*engine, samples, f.per_head);
  write_calibrated_model(opts.model_dir, f.out, r);

  std::printf("calibrated %zu layers on %d samples (%lld tokens) from %s\n", r.layers.size(), r.num_samples,
              (long long)r.num_tokens, dataset.string().c_str());
  std::printf("%5s  %10s  %10s  %12s  %12s\n", "layer", "K absmax", "V absmax", "k_scale", "v_scale");
  for (const auto& l : r.layers) {
    const float ka = *std::max_element(l.k_absmax.begin(), l.k_absmax.end());
    const float va = *std::max_element(l.v_absmax.begin(), l.v_absmax.end());
    const float ks = *std::max_element(l.k_scale.begin(), l.k_scale.end());
    const float vs = *std::max_element(l.v_scale.begin(), l.v_scale.end());
    std::printf("%5d  %10.4g  %10.4g  %12.6g  %12.6g%s\n", l.layer, ka, va, ks, vs, f.per_head ? "  (max over heads)" : "");
  }
  std::printf("wrote %s: --kv-cache-dtype auto now selects FP8 with these scales (see `kvlm inspect --model %s`)\n",
              f.out.c_str(), f.out.c_str());
  return 0;
}

}  // namespace kvlm::app

// kvlm calibrate: static FP8 KV scales from calibration text, written as a new model
// directory (compressed-tensors kv_cache_scheme + k_scale/v_scale tensors); or, with
// --kld-budget, the KV plan file with the fewest bytes per token within a KL divergence budget.
#include <cmath>
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
#include "offline/kv_plan_search.h"
#include "text/text_processor.h"

namespace kvlm::app {

CLI::App* add_calibrate(CLI::App& app, CalibrateFlags& f) {
  auto* cmd = app.add_subcommand(
      "calibrate",
      "With --kld-budget: measure each layer's K and V sensitivity and write the KV plan file with the fewest bytes "
      "per token within the budget. Without: compute static FP8 KV-cache scales and write a model directory that "
      "carries them");
  f.model.add_to(*cmd);
  cmd->add_option("--out,-o", f.out,
                  "with --kld-budget: the plan file to write (JSON, for --kv-cache-plan); without: the new model "
                  "directory (must not exist or be empty)")
      ->required();
  cmd->add_option("--kld-budget", f.kld_budget,
                  "search the KV plan (per layer: K and V formats, rotation and its signs) with the fewest bytes per "
                  "token whose KL divergence against a 16-bit cache stays within this (e.g. 1e-3) on the text");
  cmd->add_option("--ctx", f.ctx,
                  "--kld-budget: tokens per window (the second half of each is scored). A quantized cache costs more "
                  "the more keys a query reads: measure at the context you serve (Gemma 3 270M: a plan at 6.4e-4 on "
                  "512-token windows measured 1.6e-3 on 1024-token ones)")
      ->capture_default_str()
      ->check(CLI::Range(16, 1 << 20));
  cmd->add_option("--exact-tokens", f.exact_tokens,
                  "--kld-budget: SINK,RECENT exact tokens an INT4 layer may keep (0,0: none), measured as options "
                  "of their own; they cost (SINK + RECENT) exact rows per sequence, counted at --context")
      ->capture_default_str();
  cmd->add_option("--context", f.context,
                  "--kld-budget: the context the plan serves, in tokens: plans are ranked by their bytes per token "
                  "there, exact rows (a fixed cost per sequence) included; 0: exact rows not counted")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  cmd->add_option("--windows", f.windows,
                  "--kld-budget: windows of the text the formats are chosen on (these and the check windows are spread "
                  "evenly over the text)")
      ->capture_default_str()
      ->check(CLI::Range(1, 100000));
  cmd->add_option("--check-windows", f.check_windows,
                  "--kld-budget: other windows of the text, never used to choose: a plan is accepted only if its KLD "
                  "there is within the budget too (0: no check; a plan can fit one passage of text and miss others)")
      ->capture_default_str()
      ->check(CLI::Range(0, 100000));
  cmd->add_option("--dataset,--text", f.dataset,
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

static int run_plan_search(const CalibrateFlags& f) {
  check_outputs_spare_inputs({{"--out", f.out}}, {{"--text", f.dataset}, {"--kv-cache-plan", f.model.kv_cache_plan}});
  ModelOptions opts = f.model.model_options();
  if (opts.tensor_parallel_size != 1 || opts.speculative)
    throw Error("kvlm calibrate --kld-budget measures the model alone on one device; drop --tensor-parallel-size and "
                "--speculative-config (the plan it writes serves them)");
  // The baseline is a 16-bit cache (on the CPU the model computes in float32, on a GPU in its
  // dtype); the search picks rotation signs on the CPU only.
  opts.cache.set_kv_dtypes({KVCacheDType::BFloat16, std::nullopt});
  opts.cache.skip_layers = {};
  opts.cache.plan_file.reset();
  opts.cache.keep_sink = opts.cache.keep_recent = 0;  // the plan's entries say which layers keep exact tokens
  int sink = 0, recent = 0;
  {
    const auto comma = f.exact_tokens.find(',');
    try {
      if (comma == std::string::npos) throw std::invalid_argument("no comma");
      size_t a = 0, b = 0;
      sink = std::stoi(f.exact_tokens.substr(0, comma), &a);
      recent = std::stoi(f.exact_tokens.substr(comma + 1), &b);
      if (a != comma || b != f.exact_tokens.size() - comma - 1) throw std::invalid_argument("trailing text");
    } catch (const std::exception&) {
      throw Error("--exact-tokens takes SINK,RECENT (e.g. 4,64, or 0,0 for none), got '" + f.exact_tokens + "'");
    }
    validate_keep_tokens(sink, "--exact-tokens' SINK");
    validate_keep_tokens(recent, "--exact-tokens' RECENT");
  }
  const std::optional<TextProcessor> text = TextProcessor::load_if_usable(opts.model_dir);
  const auto dataset = f.dataset.empty() ? default_dataset(opts.model_dir) : std::filesystem::path(f.dataset);
  std::vector<TokenId> tokens;
  for (const auto& s : load_samples(dataset, text, 1 << 20, 1 << 20)) tokens.insert(tokens.end(), s.begin(), s.end());
  auto engine = LoadedModel::load(opts);
  PlanSearchOptions so{.kld_budget = f.kld_budget, .ctx = f.ctx, .max_windows = f.windows,
                       .check_windows = f.check_windows, .keep_sink = sink,
                       .keep_recent = recent, .context = f.context, .base = opts.cache};
  // A search takes minutes: each stage says where it is (stderr, whatever the log level).
  so.progress = [](const std::string& s) { std::fprintf(stderr, "kvlm: calibrate: %s\n", s.c_str()); };
  const PlanSearchResult r = search_kv_plan(*engine, tokens, so);

  std::printf("KV plan search on %s: %d windows of %d tokens (%lld scored) and %d check windows, %d plans measured in "
              "%.0f s\n",
              dataset.string().c_str(), r.windows, f.ctx, (long long)r.scored_tokens, r.check_windows, r.plans_measured,
              r.seconds);
  const auto units = [&](const LayerSensitivity& l) {
    return r.split_kv ? std::vector<std::pair<const char*, const std::vector<SideOption>*>>{{"K", &l.k}, {"V", &l.v}}
                      : std::vector<std::pair<const char*, const std::vector<SideOption>*>>{{"KV", &l.kv}};
  };
  std::printf("\nper layer, %s quantized at a time: KLD against the bfloat16 cache\n%6s %5s",
              r.split_kv ? "one side" : "one layer (K and V in one format on this device)", "layer", "seed");
  for (const auto& [side, options] : units(r.layers.front()))
    for (const auto& o : *options)
      if (o.dtype != KVCacheDType::BFloat16)
        std::printf(" %17s", (std::string(side) + " " + choice_name(o.dtype, o.rotate, o.exact)).c_str());
  std::printf("\n");
  for (const auto& l : r.layers) {
    std::printf("%6d %5u", l.layer, l.seed);
    for (const auto& [side, options] : units(l))
      for (const auto& o : *options)
        if (o.dtype != KVCacheDType::BFloat16) std::printf(" %17.2e", o.kld);
    std::printf("\n");
  }
  std::printf("\ncandidates (budget %.3g: KLD + 2 standard errors within it on the search windows, then on the check "
              "windows; ranked by bytes per token at %s, exact rows included); bfloat16: %zu B/token\n",
              f.kld_budget, f.context > 0 ? (std::to_string(f.context) + " tokens of context").c_str() : "any context",
              r.bf16_bytes_per_token);
  std::printf("  %-38s %8s %11s %10s %7s %9s %8s %8s %9s %8s\n", "plan", "B/token", "exact B/seq", "B/tok@ctx", "vs bf16",
              "KLD", "+-", "same top", "check KLD", "+-");
  for (size_t i = 0; i < r.candidates.size(); ++i) {
    const auto& c = r.candidates[i];
    char checked[40] = "";
    if (c.checked) std::snprintf(checked, sizeof checked, " %9.2e %8.1e", c.check_kld, c.check_kld_err);
    else std::snprintf(checked, sizeof checked, " %9s %8s", "-", "");
    std::printf("%s %-38s %8zu %11zu %10.0f %6.2fx %9.2e %8.1e %7.2f%%%s%s\n", r.best == i ? "*" : " ", c.name.c_str(),
                c.bytes_per_token, c.exact_bytes_per_sequence, c.bytes_at(f.context),
                double(r.bf16_bytes_per_token) / c.bytes_at(f.context), c.kld, c.kld_err, 100 * c.same_top, checked,
                !c.within_search ? "  over" : c.checked && !c.within ? "  over on the check windows" : "");
  }
  KVPlanFile out;
  if (r.best) {
    out = r.candidates[*r.best].file;
  } else {
    out = kv_plan_file_of(engine->plan(), std::string(arch_name(engine->config().arch)), engine->config().num_layers);
    std::printf("\nno quantized plan fits within %.3g: every candidate's KLD is over (on the search or the check "
                "windows); writing the bfloat16 plan. Raise --kld-budget, or measure on more text (--windows) if the "
                "margins are the problem\n",
                f.kld_budget);
  }
  const PlanCandidate* best = r.best ? &r.candidates[*r.best] : nullptr;
  out.calibration = {{"kld_budget", f.kld_budget},
                     {"plan", best ? best->name : "bfloat16"},
                     {"kld", best ? best->kld : 0.0},
                     {"kld_err", best ? best->kld_err : 0.0},
                     {"check_kld", best && best->checked ? nlohmann::json(best->check_kld) : nlohmann::json()},
                     {"check_kld_err", best && best->checked ? nlohmann::json(best->check_kld_err) : nlohmann::json()},
                     {"same_top", best ? best->same_top : 1.0},
                     {"bytes_per_token", engine->plan().bytes_per_token()},
                     {"exact_bytes_per_sequence", best ? best->exact_bytes_per_sequence : 0},
                     {"bf16_bytes_per_token", r.bf16_bytes_per_token},
                     {"text", dataset.string()},
                     {"ctx", f.ctx},
                     {"context", f.context},
                     {"windows", r.windows},
                     {"check_windows", r.check_windows},
                     {"scored_tokens", r.scored_tokens}};
  std::ofstream file(f.out);
  if (!(file << kv_plan_file_json(out).dump(2) << "\n")) throw Error("cannot write " + f.out);
  // The table's measure: bytes per token at --context, exact rows included.
  const double bytes = best ? best->bytes_at(f.context) : double(engine->plan().bytes_per_token());
  std::printf("\nwrote %s (%.0f B/token at %s, %.2fx fewer than bfloat16): run with --kv-cache-plan %s; check it on "
              "other text with `kvlm eval perplexity --kv-cache-plan %s --kl-divergence-base ...`\n",
              f.out.c_str(), bytes, f.context > 0 ? (std::to_string(f.context) + " tokens of context").c_str() : "any context",
              double(r.bf16_bytes_per_token) / bytes, f.out.c_str(), f.out.c_str());
  return 0;
}

int run_calibrate(const CalibrateFlags& f) {
  if (!std::isnan(f.kld_budget)) {
    if (!(f.kld_budget > 0 && f.kld_budget < 10))
      throw Error("--kld-budget must be a KL divergence in (0, 10), e.g. 1e-3; got " + std::to_string(f.kld_budget));
    return run_plan_search(f);
  }
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

// kvlm eval perplexity / kvlm eval task: the accuracy cost of a KV precision, measured.
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "offline/eval.h"

namespace kvlm::app {

CLI::App* add_eval(CLI::App& app, EvalFlags& f) {
  auto* eval = app.add_subcommand("eval", "Measure a model and KV precision: perplexity / KL divergence, task accuracy");
  eval->require_subcommand(1);
  auto* ppl = eval->add_subcommand("perplexity", "Perplexity over a text file in windows; KL divergence against a saved run");
  f.model.add_to(*ppl);
  auto* txt = ppl->add_option("--text", f.text_file, "text file to score (with the model's tokenizer)");
  auto* ids = ppl->add_option("--token-ids", f.token_ids_file, "or a file of token ids (whitespace or comma separated)");
  txt->excludes(ids);
  ppl->add_option("--ctx", f.ctx, "tokens per window (the second half of each is scored)")->capture_default_str();
  ppl->add_option("--max-chunks", f.max_chunks, "score at most this many windows (0: all)")->capture_default_str();
  add_output_file(*ppl, "--save-logits", f.save_logits, "save this run's log-probabilities (the baseline for --kl-divergence-base)");
  ppl->add_option("--kl-divergence-base", f.kld_base, "compare with a run saved by --save-logits: KLD, same-top %, delta PPL");
  ppl->add_flag("--decode-steps", f.decode_steps,
                "score each token of a window's second half in a step of its own, as generation runs it (the "
                "batch-1 kernels, e.g. CUDA's int8-activation GEMV over 4-bit weights, instead of the prefill "
                "ones); slower, and comparable with a run saved either way");
  add_output_file(*ppl, "--json", f.json_out, "also write the results as JSON to this file");
  auto* task = eval->add_subcommand("task", "Exact-match accuracy on a JSONL task file, through the batching engine");
  f.model.add_to(*task);
  f.model.add_speculative_to(*task);
  task->add_option("--data", f.data, "JSONL: {\"prompt\", \"answer\", \"regex\"?, \"stop\"?} per line")->required();
  task->add_option("--max-tokens", f.max_tokens, "tokens to generate per item at most")->capture_default_str();
  task->add_option("--limit", f.limit, "evaluate the first N items only (0: all)")->capture_default_str();
  task->add_option("--max-num-seqs", f.max_num_seqs, "items run concurrently")->capture_default_str();
  task->add_option("--log-samples", f.log_samples, "write every item's completion and verdict to this JSONL file");
  add_output_file(*task, "--json", f.json_out, "also write the results as JSON to this file");
  return eval;
}

namespace {

void write_json(const std::string& path, const nlohmann::ordered_json& j) {
  if (path.empty()) return;
  std::ofstream f(path);
  f << j.dump(2) << "\n";
  if (!f.flush()) throw Error("cannot write " + path);
}

// "fp8_e4m3", or "auto -> bfloat16", with "+ N skipped layers" when a skip rule applied.
// "bfloat16", or the FP8 weight scheme (a checkpoint's or --quantization fp8's).
std::string weights_label(const LoadedModel& e) {
  return e.config().weight_quant ? e.config().weight_quant->describe() : std::string(dtype_name(e.dtype()));
}

std::string kv_label(const LoadedModel& e) {
  const KVPlan& p = e.plan();
  if (!p.plan_file.empty()) return describe_kv_resolution(p);
  std::string s = kv_cache_dtypes_text(p.requested);
  if ((p.requested.k == KVCacheDType::Auto || p.requested.v == KVCacheDType::Auto) && !p.layers.empty())
    s += " -> " + describe_kv_format(p.layers.front());
  int skipped = 0;
  for (const auto& l : p.layers) skipped += l.dtype_source == DTypeSource::SkipRule;
  if (skipped) s += " (" + std::to_string(skipped) + " layers kept at the model dtype)";
  return s;
}

int run_perplexity(const EvalFlags& f) {
  check_outputs_spare_inputs({{"--json", f.json_out}, {"--save-logits", f.save_logits}},
                             {{"--kv-cache-plan", f.model.kv_cache_plan}, {"--kl-divergence-base", f.kld_base},
                              {"--text", f.text_file}, {"--token-ids", f.token_ids_file}});
  const ModelOptions opts = f.model.model_options();
  if (f.text_file.empty() && f.token_ids_file.empty()) throw Error("give the text to score: --text FILE or --token-ids FILE");
  const std::string& file = f.text_file.empty() ? f.token_ids_file : f.text_file;
  std::ifstream in(file);
  if (!in) throw Error("cannot read " + file);
  std::stringstream ss;
  ss << in.rdbuf();
  std::vector<TokenId> tokens;
  if (!f.text_file.empty()) {
    if (!TextProcessor::available(opts.model_dir))
      throw Error("'" + opts.model_dir.string() + "' has no tokenizer.json; give --token-ids instead of --text");
    tokens = TextProcessor::load(opts.model_dir).encode_prompt(ss.str());
  } else {
    tokens = parse_token_ids(ss.str());
  }
  auto engine = LoadedModel::load(opts);
  PerplexityOptions po;
  po.ctx = f.ctx;
  po.max_chunks = f.max_chunks;
  po.decode_steps = f.decode_steps;
  if (!f.save_logits.empty()) po.save_logits = f.save_logits;
  if (!f.kld_base.empty()) po.kld_base = f.kld_base;
  std::unique_ptr<log::Progress> bar;
  const auto r = eval_perplexity(*engine, tokens, po, [&](int done, int total) {
    if (!bar) bar = std::make_unique<log::Progress>("perplexity windows", size_t(total), log::Progress::Unit::Items);
    bar->update(size_t(done));
  });
  bar.reset();
  const size_t bpt = engine->plan().bytes_per_token();
  std::printf("model      %s\nweights    %s\nkv cache   %s (%zu bytes/token)\ntext       %s: %zu tokens, %d windows of %d, %lld scored%s\n",
              opts.model_dir.c_str(), weights_label(*engine).c_str(), kv_label(*engine).c_str(), bpt, file.c_str(), tokens.size(), r.chunks,
              f.ctx, (long long)r.scored_tokens, f.decode_steps ? " one per step (--decode-steps)" : "");
  std::printf("PPL        %.4f +/- %.4f\n", r.ppl, r.ppl_err);
  nlohmann::ordered_json j{{"model", opts.model_dir.string()}, {"weights", weights_label(*engine)},
                           {"kv_cache_dtype", kv_label(*engine)},
                           {"kv_bytes_per_token", bpt}, {"ctx", f.ctx}, {"windows", r.chunks},
                           {"scored_tokens", r.scored_tokens}, {"decode_steps", f.decode_steps},
                           {"ppl", r.ppl}, {"ppl_err", r.ppl_err}};
  if (r.has_base) {
    std::printf("base PPL   %.4f\ndelta PPL  %+.4f +/- %.4f (95%%)\n", r.base_ppl, r.delta_ppl, r.delta_ppl_ci95);
    std::printf("KLD        mean %.6f +/- %.6f, median %.6f, p99 %.6f, max %.6f\n", r.kld_mean, r.kld_mean_err,
                r.kld_median, r.kld_p99, r.kld_max);
    std::printf("same top   %.2f%%\n", 100.0 * r.same_top);
    j["base_ppl"] = r.base_ppl;
    j["delta_ppl"] = r.delta_ppl;
    j["delta_ppl_ci95"] = r.delta_ppl_ci95;
    j["kld_mean"] = r.kld_mean;
    j["kld_median"] = r.kld_median;
    j["kld_p99"] = r.kld_p99;
    j["kld_max"] = r.kld_max;
    j["same_top"] = r.same_top;
    j["kld_windows"] = r.kld_windows;  // each window's mean: how the divergence varies with the text
  }
  write_json(f.json_out, j);
  return 0;
}

int run_task(const EvalFlags& f) {
  check_outputs_spare_inputs({{"--json", f.json_out}, {"--log-samples", f.log_samples}},
                             {{"--kv-cache-plan", f.model.kv_cache_plan}, {"--data", f.data}});
  const ModelOptions opts = f.model.model_options();
  if (!TextProcessor::available(opts.model_dir))
    throw Error("'" + opts.model_dir.string() + "' has no tokenizer.json; task evaluation reads text");
  const TextProcessor text = TextProcessor::load(opts.model_dir);
  const auto items = load_task_file(f.data);
  auto engine = LoadedModel::load(opts);
  TaskOptions to;
  to.max_tokens = f.max_tokens;
  to.limit = f.limit;
  to.max_num_seqs = f.max_num_seqs;
  std::unique_ptr<log::Progress> bar;
  const auto r = eval_task(*engine, text, items, to, [&](int done, int total) {
    if (!bar) bar = std::make_unique<log::Progress>("items", size_t(total), log::Progress::Unit::Items);
    bar->update(size_t(done));
  });
  bar.reset();
  const size_t n = r.outcomes.size();
  if (!f.log_samples.empty()) {
    std::ofstream log(f.log_samples);
    for (size_t i = 0; i < n; ++i) {
      const auto& o = r.outcomes[i];
      log << nlohmann::json{{"index", i},
                            {"prompt", items[i].prompt},
                            {"answer", items[i].answer},
                            {"completion", o.completion},
                            {"extracted", o.extracted ? nlohmann::json(*o.extracted) : nlohmann::json(nullptr)},
                            {"correct", o.correct}}
                 .dump()
          << "\n";
    }
    if (!log.flush()) throw Error("cannot write --log-samples " + f.log_samples);
  }
  std::printf("model      %s\nweights    %s\nkv cache   %s (%zu bytes/token)\ntask       %s: %zu items\n",
              opts.model_dir.c_str(), weights_label(*engine).c_str(), kv_label(*engine).c_str(), engine->plan().bytes_per_token(), f.data.c_str(), n);
  std::printf("accuracy   %.2f%% (%d / %zu exact match)\n", 100.0 * r.accuracy, r.correct, n);
  std::printf("time       %.1f s, %lld prompt + %lld generated tokens (%.0f generated tokens/s)\n", r.seconds,
              (long long)r.prompt_tokens, (long long)r.completion_tokens, double(r.completion_tokens) / std::max(r.seconds, 1e-9));
  write_json(f.json_out, nlohmann::ordered_json{{"model", opts.model_dir.string()}, {"weights", weights_label(*engine)},
                                                {"kv_cache_dtype", kv_label(*engine)},
                                                {"kv_bytes_per_token", engine->plan().bytes_per_token()},
                                                {"data", f.data}, {"items", n}, {"correct", r.correct},
                                                {"accuracy", r.accuracy}, {"seconds", r.seconds}});
  return 0;
}

}  // namespace

int run_eval(CLI::App& eval_cmd, const EvalFlags& f) {
  if (eval_cmd.get_subcommand("perplexity")->parsed()) return run_perplexity(f);
  return run_task(f);
}

}  // namespace kvlm::app

// kvlm generate: run one prompt (token ids) through the model and print the continuation.
#include <cstdio>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "core/error.h"
#include "engine/generate.h"

namespace kvlm::app {

CLI::App* add_generate(CLI::App& app, GenerateFlags& f) {
  auto* cmd = app.add_subcommand("generate", "Generate a continuation of a prompt given as token ids");
  f.model.add_to(*cmd);
  cmd->add_option("--prompt-ids", f.prompt_ids, "prompt token ids, e.g. 1,403,407")->required();
  cmd->add_option("--max-tokens", f.max_tokens, "tokens to generate at most")->capture_default_str();
  cmd->add_option("--temperature", f.temperature, "sampling temperature, 0 = greedy (default: the model's generation_config, else 1.0)");
  cmd->add_option("--top-k", f.top_k, "keep the k most likely tokens (0 or -1: off)");
  cmd->add_option("--top-p", f.top_p, "nucleus sampling mass in (0, 1] (1: off)");
  cmd->add_option("--seed", f.seed, "random seed; the same seed gives the same output (default: random, reported)");
  cmd->add_flag("--ignore-eos", f.ignore_eos, "keep generating past end-of-sequence tokens");
  cmd->add_option("--logprobs", f.logprobs, "report the top-K log-probabilities of each generated token");
  cmd->add_option("--prefill-chunk", f.prefill_chunk, "prompt tokens per forward step")->capture_default_str();
  cmd->add_flag("--json", f.json, "print one JSON object instead of a summary");
  return cmd;
}

namespace {

nlohmann::json logprob_entry(TokenId t, float lp) { return {{"token_id", t}, {"logprob", lp}}; }

std::string ids_str(const std::vector<TokenId>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? " " : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace

int run_generate(const GenerateFlags& f) {
  EngineOptions opts;
  opts.model_dir = f.model.model_dir();
  opts.cache = f.model.cache_config();
  opts.device = resolve_device(parse_device(f.model.device));
  opts.dtype = parse_model_dtype(f.model.dtype);
  GenerateRequest req;
  req.prompt = parse_token_ids(f.prompt_ids);
  req.max_tokens = f.max_tokens;
  req.ignore_eos = f.ignore_eos;
  req.logprobs = f.logprobs;
  req.prefill_chunk = f.prefill_chunk;
  req.seed = f.seed ? *f.seed : std::random_device{}() * 0x9e3779b97f4a7c15ull;

  auto engine = Engine::load(opts);
  const ModelConfig& cfg = engine->config();
  req.sampling.temperature = f.temperature.value_or(cfg.default_temperature.value_or(1.0f));
  req.sampling.top_k = f.top_k.value_or(cfg.default_top_k.value_or(0));
  req.sampling.top_p = f.top_p.value_or(cfg.default_top_p.value_or(1.0f));
  const GenerateResult r = generate(*engine, req);

  const double prefill_tps = r.prefill_seconds > 0 ? double(r.prompt.size()) / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode_seconds > 0 && r.tokens.size() > 1 ? double(r.tokens.size() - 1) / r.decode_seconds : 0.0;
  if (f.json) {
    nlohmann::json j;
    j["model"] = opts.model_dir.string();
    j["architecture"] = std::string(arch_name(cfg.arch));
    j["kv_cache_dtype"] = std::string(kv_cache_dtype_name(opts.cache.kv_cache_dtype));
    j["prompt_token_ids"] = r.prompt;
    j["token_ids"] = r.tokens;
    j["finish_reason"] = r.finish_reason;
    j["seed"] = req.seed;
    j["sampling"] = {{"temperature", req.sampling.temperature}, {"top_k", req.sampling.top_k}, {"top_p", req.sampling.top_p}};
    if (req.logprobs > 0) {
      nlohmann::json lps = nlohmann::json::array();
      for (const auto& lp : r.logprobs) {
        nlohmann::json top = nlohmann::json::array();
        for (const auto& [t, v] : lp.top) top.push_back(logprob_entry(t, v));
        auto e = logprob_entry(lp.token, lp.logprob);
        e["top_logprobs"] = top;
        lps.push_back(e);
      }
      j["logprobs"] = lps;
    }
    j["usage"] = {{"prompt_tokens", r.prompt.size()}, {"completion_tokens", r.tokens.size()}};
    j["kv_cache"] = {{"bytes_per_token", engine->plan().bytes_per_token()}, {"pool_bytes", r.kv_bytes}};
    j["timing"] = {{"prefill_seconds", r.prefill_seconds},
                   {"decode_seconds", r.decode_seconds},
                   {"prefill_tokens_per_second", prefill_tps},
                   {"decode_tokens_per_second", decode_tps}};
    std::cout << j.dump() << std::endl;
    return 0;
  }
  std::cout << "model       " << opts.model_dir.string() << " (" << arch_name(cfg.arch) << ", " << cfg.num_layers << " layers, "
            << engine->model().num_parameters() << " parameters)\n"
            << "kv cache    " << kv_cache_dtype_name(opts.cache.kv_cache_dtype) << " -> "
            << dtype_name(engine->plan().resolution.storage.storage) << " ("
            << dtype_source_name(engine->plan().resolution.source) << "), " << engine->plan().bytes_per_token()
            << " bytes/token\n"
            << "prompt      " << ids_str(r.prompt) << "  (" << r.prompt.size() << " tokens)\n"
            << "generated   " << ids_str(r.tokens) << "  (" << r.tokens.size() << " tokens, finish: " << r.finish_reason
            << ")\n";
  if (req.logprobs > 0) {
    for (size_t i = 0; i < r.logprobs.size(); ++i) {
      std::cout << "  [" << i << "] " << r.logprobs[i].token << " (" << r.logprobs[i].logprob << ")  top:";
      for (const auto& [t, v] : r.logprobs[i].top) std::cout << " " << t << ":" << v;
      std::cout << "\n";
    }
  }
  char line[160];
  std::snprintf(line, sizeof line, "speed       prefill %.1f tok/s, decode %.1f tok/s (seed %llu)\n", prefill_tps, decode_tps,
                (unsigned long long)req.seed);
  std::cout << line;
  return 0;
}

}  // namespace kvlm::app

// kvlm generate: one prompt (text, a chat message, or token ids) through the model; text
// streams to stdout as it is generated, a one-line summary goes to stderr.
#include <cstdio>
#include <iostream>
#include <random>

#include <nlohmann/json.hpp>

#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "offline/generate.h"
#include "text/text_output.h"
#include "text/text_processor.h"

namespace kvlm::app {

void SamplingFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--max-tokens", max_tokens, "tokens to generate at most")->capture_default_str();
  cmd.add_option("--temperature", temperature, "sampling temperature, 0 = greedy (default: the model's generation_config, else 1.0)");
  cmd.add_option("--top-k", top_k, "keep the k most likely tokens (0 or -1: off)");
  cmd.add_option("--top-p", top_p, "nucleus sampling mass in (0, 1] (1: off)");
  cmd.add_option("--min-p", min_p, "drop tokens less likely than min-p x the most likely one (0: off)");
  cmd.add_option("--repetition-penalty", repetition_penalty, "penalize tokens already in the prompt or output (1: off)");
  cmd.add_option("--presence-penalty", presence_penalty, "penalize tokens already generated, once (0: off)");
  cmd.add_option("--frequency-penalty", frequency_penalty, "penalize tokens by how often they were generated (0: off)");
  cmd.add_option("--seed", seed, "random seed; the same seed gives the same output (default: random, reported)");
  cmd.add_option("--stop", stop, "stop when this text is generated (repeatable); it is not printed");
  cmd.add_flag("--ignore-eos", ignore_eos, "keep generating past end-of-sequence tokens");
}

CLI::App* add_generate(CLI::App& app, GenerateFlags& f) {
  auto* cmd = app.add_subcommand("generate", "Generate a continuation of a prompt (text or token ids)");
  f.model.add_to(*cmd);
  f.model.add_speculative_to(*cmd);
  auto* text = cmd->add_option("--prompt,-p", f.prompt, "prompt text (needs the model's tokenizer: tokenizer.json, or the GGUF file's own)");
  auto* ids = cmd->add_option("--prompt-ids", f.prompt_ids, "prompt token ids, e.g. 1,403,407");
  text->excludes(ids);
  cmd->add_flag("--chat", f.chat, "apply the model's chat template to --prompt as one user message");
  f.sampling.add_to(*cmd);
  cmd->add_option("--logprobs", f.logprobs, "report the top-K log-probabilities of each generated token");
  cmd->add_option("--prefill-chunk", f.prefill_chunk, "prompt tokens per forward step")->capture_default_str();
  cmd->add_flag("--json", f.json, "print one JSON object instead of streaming text");
  return cmd;
}

SamplingParams SamplingFlags::params(const ModelConfig& cfg) const {
  SamplingParams p;
  p.temperature = temperature.value_or(cfg.default_temperature.value_or(1.0f));
  p.top_k = top_k.value_or(cfg.default_top_k.value_or(0));
  p.top_p = top_p.value_or(cfg.default_top_p.value_or(1.0f));
  p.min_p = min_p.value_or(cfg.default_min_p.value_or(0.0f));
  p.repetition_penalty = repetition_penalty.value_or(1.0f);
  p.presence_penalty = presence_penalty.value_or(0.0f);
  p.frequency_penalty = frequency_penalty.value_or(0.0f);
  return p;
}

GenerateRequest SamplingFlags::request(const ModelConfig& cfg) const {
  GenerateRequest req;
  req.max_tokens = max_tokens;
  req.ignore_eos = ignore_eos;
  req.seed = seed ? *seed : std::random_device{}() * 0x9e3779b97f4a7c15ull;
  req.sampling = params(cfg);
  return req;
}

std::string describe_sampling(const SamplingParams& p, const ModelConfig& cfg) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "temperature %.2g, top_k %d, top_p %.2g, min_p %.2g", double(p.temperature), p.top_k,
                double(p.top_p), double(p.min_p));
  const bool defaults = cfg.default_temperature || cfg.default_top_k || cfg.default_top_p || cfg.default_min_p;
  return std::string("sampling: ") + buf +
         (defaults ? " (the model's generation defaults where no flag is given)" : " (no generation defaults in the model)");
}

void print_summary(const GenerateResult& r, const LoadedModel& e) {
  std::fflush(stdout);  // the streamed text first, also when stdout is a pipe
  if (log::level() < log::Level::Warn) return;
  const double prefill_tps = r.prefill_seconds > 0 ? double(r.prompt.size()) / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode_seconds > 0 && r.tokens.size() > 1 ? double(r.tokens.size() - 1) / r.decode_seconds : 0.0;
  std::string exact;
  if (e.plan().exact_bytes_per_token() > 0)
    exact = ", exact sink " + std::to_string(e.plan().keep_sink()) + " + recent " + std::to_string(e.plan().keep_recent());
  std::string weights = e.config().weight_quant ? ", FP8 weights (" + e.config().weight_quant->origin + ")" : "";
  if (e.tensor_parallel_size() > 1)
    weights += ", tensor parallel " + std::to_string(e.tensor_parallel_size()) + " (" +
               std::to_string(e.rank_plan().bytes_per_token()) + " KV B/token per rank)";
  std::fprintf(stderr, "kvlm: %zu prompt tokens, %zu generated (%s), prefill %.1f tok/s, decode %.1f tok/s, KV %s (%zu B/token%s)%s\n",
               r.prompt.size(), r.tokens.size(), r.finish_reason.c_str(), prefill_tps, decode_tps,
               describe_kv_resolution(e.plan()).c_str(), e.plan().bytes_per_token(),
               exact.c_str(), weights.c_str());
  if (e.speculative() && r.tokens.size() > 1) {
    // The saving drafting buys is forward passes of the target model; whether that shows in
    // wall time depends on how much cheaper a pass over one row is than over k+1 rows (a lot
    // on a GPU, where a decode pass streams the weights once; little on a small CPU).
    const uint64_t plain = r.tokens.size() - 1;
    std::fprintf(stderr,
                 "kvlm: drafting (%s): %zu tokens after the first took %llu forward passes of the model instead of %llu "
                 "(%.2fx fewer); %llu of %llu draft tokens accepted, mean acceptance length %.2f\n",
                 describe(*e.speculative()).c_str(), r.tokens.size() - 1, (unsigned long long)r.decode_steps,
                 (unsigned long long)plain, r.decode_steps ? double(plain) / double(r.decode_steps) : 0.0,
                 (unsigned long long)r.accepted_tokens, (unsigned long long)r.draft_tokens,
                 r.drafts ? 1.0 + double(r.accepted_tokens) / double(r.drafts) : 0.0);
  }
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
  if (f.prompt.empty() && f.prompt_ids.empty()) throw Error("give a prompt: --prompt TEXT or --prompt-ids 1,2,3");
  if (f.chat && f.prompt.empty()) throw Error("--chat needs --prompt TEXT");
  ModelOptions opts = f.model.model_options();
  // Text needs the tokenizer; load it first so a missing one fails before the weights load.
  std::optional<TextProcessor> text;
  if (!f.prompt.empty()) text = TextProcessor::load(opts.model_dir, "give token ids (--prompt-ids) instead");
  else text = TextProcessor::load_if_usable(opts.model_dir);

  auto engine = LoadedModel::load(opts);
  const ModelConfig& cfg = engine->config();
  GenerateRequest req = f.sampling.request(cfg);
  log::info(describe_sampling(req.sampling, cfg));
  req.logprobs = f.logprobs;
  req.prefill_chunk = f.prefill_chunk;
  if (!f.prompt_ids.empty()) {
    req.prompt = parse_token_ids(f.prompt_ids);
  } else if (f.chat) {
    req.prompt = text->encode_chat(nlohmann::ordered_json::array({{{"role", "user"}, {"content", f.prompt}}}), true);
  } else {
    req.prompt = text->encode_prompt(f.prompt);
  }
  // The tokenizer's end token ends a reply too, unless --ignore-eos (a GGUF file's
  // <|im_end|> is the tokenizer's EOS, not the model's; vLLM's ignore_eos drops both).
  if (text && !req.ignore_eos)
    if (auto eos = text->eos_id()) req.extra_eos.push_back(*eos);
  if (!f.sampling.stop.empty() && !text) throw Error("--stop needs the model's tokenizer.json (it matches text)");

  // Streaming: decode incrementally, hold back what could be the start of a stop string.
  std::string out_text;
  std::optional<TextOutput> tout;
  const bool stream = text && !f.json;
  if (text) tout.emplace(text->tokenizer(), f.sampling.stop);
  auto emit = [&](const std::string& s) {
    out_text += s;
    if (stream && !s.empty()) {
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::fflush(stdout);
    }
  };
  const GenerateResult r = generate(*engine, req, [&](TokenId id) {
    if (!tout) return true;
    emit(tout->push(id));
    return !tout->stopped();
  });
  if (tout) emit(tout->finish());
  if (stream) std::fputs("\n", stdout);

  if (f.json) {
    nlohmann::json j;
    j["model"] = opts.model_dir.string();
    j["architecture"] = std::string(arch_name(cfg.arch));
    j["kv_cache_dtype"] = kv_cache_dtypes_text(opts.cache.kv_dtypes());
    j["prompt_token_ids"] = r.prompt;
    j["token_ids"] = r.tokens;
    if (text) j["text"] = out_text;
    j["finish_reason"] = r.finish_reason;
    if (tout && tout->stopped()) j["stop_reason"] = tout->matched();
    j["seed"] = req.seed;
    j["sampling"] = {{"temperature", req.sampling.temperature}, {"top_k", req.sampling.top_k}, {"top_p", req.sampling.top_p},
                     {"min_p", req.sampling.min_p}, {"repetition_penalty", req.sampling.repetition_penalty},
                     {"presence_penalty", req.sampling.presence_penalty}, {"frequency_penalty", req.sampling.frequency_penalty}};
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
    const double prefill_tps = r.prefill_seconds > 0 ? double(r.prompt.size()) / r.prefill_seconds : 0.0;
    const double decode_tps = r.decode_seconds > 0 && r.tokens.size() > 1 ? double(r.tokens.size() - 1) / r.decode_seconds : 0.0;
    j["usage"] = {{"prompt_tokens", r.prompt.size()}, {"completion_tokens", r.tokens.size()}};
    j["kv_cache"] = {{"bytes_per_token", engine->plan().bytes_per_token()}, {"pool_bytes", r.kv_bytes}};
    j["timing"] = {{"decode_steps", r.decode_steps},
                   {"prefill_seconds", r.prefill_seconds},
                   {"decode_seconds", r.decode_seconds},
                   {"prefill_tokens_per_second", prefill_tps},
                   {"decode_tokens_per_second", decode_tps}};
    if (engine->speculative())
      j["speculative"] = {{"method", std::string(spec_method_name(engine->speculative()->method))},
                          {"drafts", r.drafts},
                          {"draft_tokens", r.draft_tokens},
                          {"accepted_tokens", r.accepted_tokens}};
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << std::endl;
  } else if (!text) {
    std::cout << "prompt      " << ids_str(r.prompt) << "  (" << r.prompt.size() << " tokens)\n"
              << "generated   " << ids_str(r.tokens) << "  (" << r.tokens.size() << " tokens, finish: " << r.finish_reason
              << ")\n";
    for (size_t i = 0; i < r.logprobs.size(); ++i) {
      std::cout << "  [" << i << "] " << r.logprobs[i].token << " (" << r.logprobs[i].logprob << ")  top:";
      for (const auto& [t, v] : r.logprobs[i].top) std::cout << " " << t << ":" << v;
      std::cout << "\n";
    }
    std::cout << std::flush;
  }
  print_summary(r, *engine);
  return 0;
}

}  // namespace kvlm::app

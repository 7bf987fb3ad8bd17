// The `kvlm` subcommands. Each has a flags struct, a function that registers its options
// on the CLI, and a run function returning the process exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <cmath>
#include <string>

#include "app/cli_common.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"
#include "offline/generate.h"

namespace kvlm::app {

// Sampling and stopping flags shared by generate and chat.
struct SamplingFlags {
  int max_tokens = 256;
  std::optional<float> temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
  std::optional<int> top_k;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  void add_to(CLI::App& cmd);
  // The sampling these flags ask for, the model's generation defaults filling the rest.
  SamplingParams params(const ModelConfig& cfg) const;
  // A request with them (the prompt still to set); a fresh random seed without --seed.
  GenerateRequest request(const ModelConfig& cfg) const;
};
// One line for the user: the sampling in effect and where it came from.
std::string describe_sampling(const SamplingParams& p, const ModelConfig& cfg);
// The speeds and KV figures after a generation (stderr).
void print_summary(const GenerateResult& r, const LoadedModel& e);

struct GenerateFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string prompt;      // text
  std::string prompt_ids;  // or token ids
  bool chat = false;
  int logprobs = 0;
  int prefill_chunk = 512;
  bool json = false;
};
CLI::App* add_generate(CLI::App& app, GenerateFlags& f);
int run_generate(const GenerateFlags& f);

struct ChatFlags {
  ModelFlags model;
  SamplingFlags sampling;
  std::string system;
};
CLI::App* add_chat(CLI::App& app, ChatFlags& f);
int run_chat(const ChatFlags& f);

struct TokenizeFlags {
  std::string tokenizer, text, file, ids;
  bool add_special_tokens = false, skip_special_tokens = false, json = false;
};
CLI::App* add_tokenize(CLI::App& app, TokenizeFlags& f);
int run_tokenize(const TokenizeFlags& f);
CLI::App* add_detokenize(CLI::App& app, TokenizeFlags& f);
int run_detokenize(const TokenizeFlags& f);

struct TemplateFlags {
  std::string template_file, tokenizer, messages;
  bool add_generation_prompt = false;
  std::vector<std::string> set;
};
CLI::App* add_render_template(CLI::App& app, TemplateFlags& f);
int run_render_template(const TemplateFlags& f);

struct InspectFlags {
  ModelFlags model;
  bool json = false;
  std::string write_kv_plan;  // --write-kv-plan FILE
};
CLI::App* add_inspect(CLI::App& app, InspectFlags& f);
int run_inspect(const InspectFlags& f);

struct CalibrateFlags {
  ModelFlags model;
  std::string out, dataset;
  int num_samples = 64;
  int max_length = 1024;
  bool per_head = false;
  // --kld-budget: search the KV plan with the fewest bytes within this KL divergence instead
  // (offline/kv_plan_search.h); --out is then the plan file.
  double kld_budget = std::nan("");  // NaN: not given
  int ctx = 1024;
  int windows = 4;
  int check_windows = 2;  // windows after the search's that only check the chosen plan
  std::string exact_tokens = "4,64";  // SINK,RECENT an INT4 layer may keep
  int context = 4096;  // the served context, at which exact rows count as bytes per token
};
CLI::App* add_calibrate(CLI::App& app, CalibrateFlags& f);
int run_calibrate(const CalibrateFlags& f);

struct EvalFlags {
  ModelFlags model;
  // perplexity
  std::string text_file, token_ids_file, save_logits, kld_base, json_out;
  int ctx = 512;
  int max_chunks = 0;
  bool decode_steps = false;
  // task
  std::string data, log_samples;
  int max_tokens = 256;
  int limit = 0;
  int max_num_seqs = 64;
};
// `kvlm eval perplexity` and `kvlm eval task`; returns the parent command.
CLI::App* add_eval(CLI::App& app, EvalFlags& f);
int run_eval(CLI::App& eval_cmd, const EvalFlags& f);

// The serving engine's flags (vLLM's names), shared by serve and bench throughput: ServingArgs
// (engine/engine_args.h, shared with the Python package) bound to the command line.
struct ServingFlags : ServingArgs {
  void add_to(CLI::App& cmd);
  MemoryOptions memory_options() const { return ServingArgs::memory_options(ArgStyle::Flag); }
};

struct ServeFlags {
  ModelFlags model;
  ServingFlags serving;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;  // empty: KVLM_API_KEY, else none
  std::string served_model_name;
  double drain_timeout = 10;
  int max_connections = 1024;
};
CLI::App* add_serve(CLI::App& app, ServeFlags& f);
int run_serve(const ServeFlags& f);

struct BenchThroughputFlags {
  ModelFlags model;
  ServingFlags serving;
  int num_prompts = 1000;
  int input_len = 1024;
  int output_len = 128;
  std::string dataset;  // JSONL: {"prompt": text | "prompt_token_ids": [...], "output_len": N}
  uint64_t seed = 0;
  float temperature = 1.0f;  // vllm bench throughput samples at 1
  bool ignore_eos = true;    // --no-ignore-eos: requests end at EOS (throughput counts the tokens made)
  int num_warmups = 0;       // requests run (and not timed) before the timed ones
  std::string json;
};
struct BenchServeFlags {
  std::string base_url = "http://127.0.0.1:8000";
  std::string endpoint = "/v1/completions";
  std::string model;  // default: the server's (GET /v1/models)
  std::string api_key;
  int num_prompts = 1000;
  double request_rate = 0;  // requests per second; 0 = all at once (inf)
  int max_concurrency = 0;  // 0 = unlimited
  int input_len = 1024;
  int output_len = 128;
  int vocab_size = 0;  // random prompts: token ids below this (default: the server's)
  std::string dataset;
  bool ignore_eos = false;
  uint64_t seed = 0;
  double timeout = 600;
  std::string json;
};
// kvlm bench multiturn: conversations over one shared system prompt, turn after turn, each
// turn's prompt the whole history (what the prefix cache and its host tier serve).
struct BenchMultiturnFlags {
  ModelFlags model;
  ServingFlags serving;
  int conversations = 16;
  int turns = 4;
  int system_len = 1024;  // the shared system prompt's tokens
  int user_len = 64;      // each turn's new user message
  int output_len = 64;    // each answer (greedy, EOS ignored)
  int max_concurrency = 0;  // turns in flight at once (0: one per conversation)
  uint64_t seed = 0;
  std::string json;
};
struct BenchFlags {
  BenchThroughputFlags throughput;
  BenchServeFlags serve;
  BenchMultiturnFlags multiturn;
  CLI::App* throughput_cmd = nullptr;
  CLI::App* serve_cmd = nullptr;
  CLI::App* multiturn_cmd = nullptr;
};
CLI::App* add_bench(CLI::App& app, BenchFlags& f);
int run_bench(const BenchFlags& f);
int run_bench_multiturn(const BenchMultiturnFlags& f);  // cmd_bench_multiturn.cpp

}  // namespace kvlm::app

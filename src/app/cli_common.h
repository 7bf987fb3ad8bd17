// Options and helpers shared by the `kvlm` subcommands.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "kv/cache_config.h"
#include "engine/engine_args.h"
#include "model/loaded_model.h"

namespace kvlm::app {

// Flags that pick the model and shape its KV cache, as vLLM names them: ModelArgs
// (engine/engine_args.h, shared with the Python package) and what only the command line has.
struct ModelFlags : ModelArgs {
  std::string model;  // empty: the bundled default model
  int nnodes = 0;                 // --nnodes (0: WORLD_SIZE, else 1)
  int node_rank = -1;             // --node-rank (-1: RANK, else 0)
  std::string distributed_init;   // --distributed-init tcp://HOST:PORT (empty: MASTER_ADDR/MASTER_PORT)
  double distributed_timeout = 600;

  std::string model_positional;  // `kvlm generate MODEL`, as `vllm serve MODEL`

  void add_to(CLI::App& cmd);
  // --speculative-config, for the commands that decode (generate, chat, serve, bench, eval
  // task, inspect).
  void add_speculative_to(CLI::App& cmd);
  // The model asked for, positional or --model (both: they must agree); empty: none given.
  std::string model_arg() const;
  std::filesystem::path model_dir() const;   // resolves the bundled default
  CacheConfig cache_config() const { return ModelArgs::cache_config(ArgStyle::Flag); }
  // All of the above, device resolved. On a follower node of several processes (--node-rank
  // > 0) it does not return: the process loads its ranks, runs node 0's commands until node 0
  // stops, and exits (model/distributed.h) — so every command that loads a model follows.
  ModelOptions model_options() const;
};

struct ServeFlags;  // commands.h

// kvlm serve's flags beyond ServeFlags: the rest of vLLM's `vllm serve` command line and the
// connection layer's deadlines. docs/serving-flags.md lists every vLLM flag and what kvlm
// does with it.
struct ServeExtraFlags {
  std::string chat_template;     // a file, or the template itself
  std::string tokenizer;         // a directory other than the model's
  std::string generation_config = "auto";  // auto (the model's), vllm (none), or a directory
  std::optional<uint64_t> seed;
  std::string log_level;         // --uvicorn-log-level
  std::string allowed_origins;   // JSON list (vLLM) or comma-separated
  int max_logprobs = 20;
  int max_seqs_per_request = 256;    // prompts x n of one request
  double grammar_compile_timeout = 10;  // seconds a structured output's grammar may take to compile
  int responses_store_size = 1000;      // /v1/responses kept for previous_response_id (0: none)
  std::string tool_call_parser;  // hermes | qwen3_coder | llama3_json | pythonic | harmony | none; empty: the chat template's
  std::string reasoning_parser;  // qwen3 | deepseek_r1 | gpt_oss; empty: none
  bool enable_auto_tool_choice = false;  // vLLM's switch; kvlm parses calls whenever it knows the format
  bool disable_log_requests = false;
  bool disable_log_stats = false;
  double log_stats_interval = 10;  // seconds (vLLM: VLLM_LOG_STATS_INTERVAL)
  int header_timeout = 10;
  int read_timeout = 30;
  int keep_alive_timeout = 30;
  // vLLM flags kvlm refuses, or accepts only in the form it supports: checked in run_serve.
  struct Refused {
    CLI::Option* opt = nullptr;
    std::string value;
    std::function<bool(const std::string&)> accept;  // null: any use is refused
    std::string why;
    bool ignored = false;  // accepted with a warning that it changes nothing
  };
  std::vector<std::unique_ptr<Refused>> refused;

  void add_to(CLI::App& serve_cmd);
  // Throws kvlm::Error naming the first refused flag given and why.
  void check_refused() const;
};

int run_serve(const ServeFlags& f, const ServeExtraFlags& x);

// The option names of `cmd` (and of the parents it falls through to) nearest to `arg` by edit
// distance, for "did you mean" (empty when nothing is close).
std::string closest_flag(const CLI::App& cmd, const std::string& arg);

// The bundled default model directory (models/kvlm-tiny next to the sources or binary).
std::filesystem::path default_model_dir();

// Parses "1,2,3" / "1 2 3" into token ids; throws kvlm::Error on anything else.
std::vector<TokenId> parse_token_ids(std::string_view text);

// An option naming a file to write (eval's and bench's --json FILE, --save-logits FILE): a value
// that looks like an option is refused, naming what the option wants (`--json --kv-cache-dtype
// bfloat16` otherwise took the next flag's place and left its value as a stray model name).
CLI::Option* add_output_file(CLI::App& cmd, const std::string& name, std::string& into, const std::string& help);

// Throws kvlm::Error when an output file (name, path; empty paths skipped) is one of the
// command's inputs (name, path): writing it would destroy the input (a --json pointed at the
// --kv-cache-plan file overwrote the plan).
void check_outputs_spare_inputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                const std::vector<std::pair<std::string, std::string>>& inputs);


}  // namespace kvlm::app

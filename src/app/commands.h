// The `kvlm` subcommands. Each has a flags struct, a function that registers its options
// on the CLI, and a run function returning the process exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "app/cli_common.h"

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
};

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
};
CLI::App* add_inspect(CLI::App& app, InspectFlags& f);
int run_inspect(const InspectFlags& f);

struct CalibrateFlags {
  ModelFlags model;
  std::string out, dataset;
  int num_samples = 64;
  int max_length = 1024;
  bool per_head = false;
};
CLI::App* add_calibrate(CLI::App& app, CalibrateFlags& f);
int run_calibrate(const CalibrateFlags& f);

struct EvalFlags {
  ModelFlags model;
  // perplexity
  std::string text_file, save_logits, kld_base, json_out;
  int ctx = 512;
  int max_chunks = 0;
  // task
  std::string data, log_samples;
  int max_tokens = 256;
  int limit = 0;
  int max_num_seqs = 64;
};
// `kvlm eval perplexity` and `kvlm eval task`; returns the parent command.
CLI::App* add_eval(CLI::App& app, EvalFlags& f);
int run_eval(CLI::App& eval_cmd, const EvalFlags& f);

}  // namespace kvlm::app

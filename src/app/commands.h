// The `kvlm` subcommands. Each has a flags struct, a function that registers its options
// on the CLI, and a run function returning the process exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "app/cli_common.h"

namespace kvlm::app {

struct GenerateFlags {
  ModelFlags model;
  std::string prompt_ids;
  int max_tokens = 16;
  std::optional<float> temperature;
  std::optional<int> top_k;
  std::optional<float> top_p;
  std::optional<uint64_t> seed;
  bool ignore_eos = false;
  int logprobs = 0;
  int prefill_chunk = 512;
  bool json = false;
};
CLI::App* add_generate(CLI::App& app, GenerateFlags& f);
int run_generate(const GenerateFlags& f);

struct InspectFlags {
  ModelFlags model;
  bool json = false;
};
CLI::App* add_inspect(CLI::App& app, InspectFlags& f);
int run_inspect(const InspectFlags& f);

}  // namespace kvlm::app

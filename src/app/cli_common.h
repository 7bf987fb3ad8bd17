// Options and helpers shared by the `kvlm` subcommands.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <optional>
#include <string>

#include "config/cache_config.h"
#include "model/loaded_model.h"

namespace kvlm::app {

// Flags that pick the model and shape its KV cache, as vLLM names them.
struct ModelFlags {
  std::string model;  // empty: the bundled default model
  std::string kv_cache_dtype = "auto";
  std::string kv_cache_rotation = "auto";
  int keep_sink = 0;
  int keep_recent = 0;
  std::string skip_layers;
  std::string attention_backend;
  std::string device = "auto";
  std::string dtype = "auto";
  std::string quantization;  // --quantization: "" or fp8
  int block_size = 16;
  bool enforce_eager = false;
  std::string speculative_config;  // JSON; empty: no drafting

  void add_to(CLI::App& cmd);
  // --speculative-config, for the commands that decode (generate, chat, serve, bench, eval
  // task, inspect).
  void add_speculative_to(CLI::App& cmd);
  std::filesystem::path model_dir() const;   // resolves the bundled default
  CacheConfig cache_config() const;          // parses and validates; throws kvlm::Error
  ModelOptions model_options() const;      // all of the above, device resolved
};

// The bundled default model directory (models/kvlm-tiny next to the sources or binary).
std::filesystem::path default_model_dir();

// Parses "1,2,3" / "1 2 3" into token ids; throws kvlm::Error on anything else.
std::vector<TokenId> parse_token_ids(std::string_view text);

}  // namespace kvlm::app

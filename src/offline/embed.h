// Embeddings through the serving engine: with a pooling runner (--runner pooling) each prompt
// becomes one request whose prompt rows' final hidden states come back and are pooled
// (config/pooling_config.h) — the same LLMEngine, scheduler, chunked prefill and prefix cache
// as serving. The server's /v1/embeddings makes its requests with embedding_request() too.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <vector>

#include "config/pooling_config.h"
#include "engine/request.h"
#include "model/loaded_model.h"

namespace kvlm {

class LLMEngine;

// The engine request that computes `prompt`'s rows for `type` pooling: nothing generated; only
// the last row for last-token pooling (a prefix-cache hit then serves the rest), every row
// otherwise.
EngineRequest embedding_request(std::string id, std::vector<TokenId> prompt, PoolingType type);

struct EmbedOptions {
  int dimensions = 0;                // 0: the hidden size; else a Matryoshka cut (the model must allow it)
  int max_num_batched_tokens = 2048;
  int max_num_seqs = 64;
};

// Checks `dimensions` against the model's pooling configuration; throws kvlm::Error saying
// what is allowed.
void check_dimensions(const PoolingConfig& pc, int hidden, int dimensions);

// One vector per prompt, in order. `model` must be a pooling model (LoadedModel::pooling).
std::vector<std::vector<float>> embed_prompts(LoadedModel& model, std::span<const std::vector<TokenId>> prompts,
                                              const EmbedOptions& opts = {});
// The same through an engine that exists (the Python LLM's), which must be idle; `normalize`
// overrides the model's pooling configuration.
std::vector<std::vector<float>> embed_prompts(LLMEngine& llm, const LoadedModel& model,
                                              std::span<const std::vector<TokenId>> prompts, int dimensions,
                                              std::optional<bool> normalize = std::nullopt);

}  // namespace kvlm

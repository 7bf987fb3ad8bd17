#include "offline/embed.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "engine/llm_engine.h"

namespace kvlm {

EngineRequest embedding_request(std::string id, std::vector<TokenId> prompt, PoolingType type) {
  EngineRequest r;
  r.id = std::move(id);
  r.prompt = std::move(prompt);
  r.max_tokens = 0;
  r.prompt_logits = true;
  r.prompt_logits_from = type == PoolingType::Last ? std::max(int(r.prompt.size()) - 1, 0) : 0;
  return r;
}

void check_dimensions(const PoolingConfig& pc, int hidden, int dimensions) {
  if (dimensions == 0 || dimensions == hidden) return;
  if (!pc.matryoshka)
    throw Error("this model does not support `dimensions` (its config.json declares no Matryoshka training: "
                "is_matryoshka or matryoshka_dimensions); leave it out to get all " +
                std::to_string(hidden) + " dimensions");
  if (dimensions < 1 || dimensions > hidden)
    throw Error("dimensions must be between 1 and the model's " + std::to_string(hidden) + ", got " +
                std::to_string(dimensions));
  const auto& allowed = pc.matryoshka_dimensions;
  if (!allowed.empty() && std::ranges::find(allowed, dimensions) == allowed.end()) {
    std::string list;
    for (const int d : allowed) list += (list.empty() ? "" : ", ") + std::to_string(d);
    throw Error("this model was trained for dimensions " + list + " (matryoshka_dimensions), got " +
                std::to_string(dimensions));
  }
}

namespace {

const PoolingConfig& pooling_of(const LoadedModel& model) {
  if (!model.pooling())
    throw Error("this model runs as a generative model; load it with --runner pooling (runner=\"pooling\") to embed");
  return *model.pooling();
}

// Checks the prompts; returns the longest.
int check_prompts(std::span<const std::vector<TokenId>> prompts, int max_len) {
  int longest = 1;
  for (const auto& p : prompts) {
    if (p.empty()) throw Error("an input to embed is empty (no tokens)");
    if (int(p.size()) > max_len)
      throw Error("an input has " + std::to_string(p.size()) + " tokens; the model takes at most " + std::to_string(max_len));
    longest = std::max(longest, int(p.size()));
  }
  return longest;
}

}  // namespace

std::vector<std::vector<float>> embed_prompts(LLMEngine& llm, const LoadedModel& model,
                                              std::span<const std::vector<TokenId>> prompts, int dimensions,
                                              std::optional<bool> normalize) {
  const PoolingConfig& pc = pooling_of(model);
  const int hidden = model.config().hidden_size;
  check_dimensions(pc, hidden, dimensions);
  if (llm.has_work()) throw Error("embedding needs the engine idle; finish or abort its requests first");
  std::vector<std::optional<Pooler>> poolers(prompts.size());
  std::string error;
  for (size_t i = 0; i < prompts.size(); ++i) {
    poolers[i].emplace(pc.type, hidden);
    EngineRequest r = embedding_request("embed-" + std::to_string(i), prompts[i], pc.type);
    r.on_output = [&, i](const RequestOutput& o) {
      if (!o.prompt_logits.empty()) poolers[i]->add(o.prompt_logits, o.prompt_logits_begin);
      if (o.finish_reason == FinishReason::Error && error.empty()) error = o.error;
      return true;
    };
    try {
      llm.add_request(std::move(r));
    } catch (...) {
      for (size_t j = 0; j < i; ++j) llm.abort("embed-" + std::to_string(j));
      while (llm.has_work()) llm.step();
      throw;
    }
  }
  while (llm.has_work()) llm.step();
  if (!error.empty()) throw Error(error);
  std::vector<std::vector<float>> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) out[i] = poolers[i]->finish(normalize.value_or(pc.normalize), dimensions);
  return out;
}

std::vector<std::vector<float>> embed_prompts(LoadedModel& model, std::span<const std::vector<TokenId>> prompts,
                                              const EmbedOptions& opts) {
  check_dimensions(pooling_of(model), model.config().hidden_size, opts.dimensions);
  if (prompts.empty()) return {};
  const int longest = check_prompts(prompts, model.config().max_position_embeddings);
  const int bs = model.block_size();
  const int seqs = std::clamp(int(prompts.size()), 1, std::max(1, opts.max_num_seqs));
  LLMEngine llm(model, SchedulerConfig{.max_num_seqs = seqs,
                                       .max_num_batched_tokens = std::max(opts.max_num_batched_tokens, 1),
                                       .max_model_len = longest,
                                       .enable_prefix_caching = false,
                                       .num_blocks = seqs * ((longest + bs - 1) / bs)});
  return embed_prompts(llm, model, prompts, opts.dimensions);
}

}  // namespace kvlm

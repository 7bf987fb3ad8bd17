#include "offline/score.h"

#include <algorithm>
#include <exception>

#include "core/error.h"
#include "engine/llm_engine.h"

namespace kvlm {

void score_tokens(LoadedModel& model, std::span<const TokenId> tokens, int chunk, const LogitRows& rows,
                  int from_row, int scored_step) {
  if (tokens.empty()) throw Error("nothing to score: the token sequence is empty");
  if (chunk < 1) throw Error("the scoring chunk must be at least 1 token");
  const int n = int(tokens.size()), bs = model.block_size();
  KVLM_CHECK(from_row >= 0 && from_row < n, "the first scored row is outside the sequence");
  const int max_len = model.config().max_position_embeddings;
  if (n > max_len)
    throw Error("this sequence has " + std::to_string(n) + " tokens but the model supports " + std::to_string(max_len) +
                " (max_position_embeddings); use a shorter window");
  const int len = n;
  LLMEngine llm(model, SchedulerConfig{.max_num_seqs = 1,
                                       .max_num_batched_tokens = chunk,
                                       .max_model_len = len,
                                       .enable_prefix_caching = false,
                                       .num_blocks = (len + bs - 1) / bs});
  std::string error;
  std::exception_ptr failure;
  int next = from_row;
  if (scored_step < 0) throw Error("the scored rows' step must be 0 (the chunk) or more");
  EngineRequest req{.id = "score", .prompt = {tokens.begin(), tokens.end()}, .max_tokens = 0,
                    .prompt_logits = bool(rows), .prompt_logits_from = from_row, .prompt_logits_step = scored_step};
  req.on_output = [&](const RequestOutput& out) {
    if (!out.prompt_logits.empty()) {
      KVLM_CHECK(out.prompt_logits_begin == next, "prompt logits arrived out of order");
      const int got = int(out.prompt_logits.size() / size_t(model.config().vocab_size));
      try {
        rows(next, out.prompt_logits);
      } catch (...) {
        failure = std::current_exception();  // the engine swallows a callback's exception
        return false;
      }
      next += got;
    }
    if (out.finish_reason == FinishReason::Error) error = out.error;
    return true;
  };
  llm.add_request(std::move(req));
  while (llm.has_work()) llm.step();
  if (failure) std::rethrow_exception(failure);
  if (!error.empty()) throw Error(error);
  KVLM_CHECK(!rows || next == n, "not every prompt row was scored");
}

std::vector<float> all_logits(LoadedModel& model, std::span<const TokenId> tokens, int chunk) {
  const size_t vocab = size_t(model.config().vocab_size);
  std::vector<float> out(tokens.size() * vocab);
  score_tokens(model, tokens, chunk, [&](int first, std::span<const float> rows) {
    std::copy(rows.begin(), rows.end(), out.begin() + std::ptrdiff_t(size_t(first) * vocab));
  });
  return out;
}

}  // namespace kvlm

// Teacher forcing through the serving engine: a token sequence runs as one prompt whose
// every row's next-token logits are wanted and nothing is generated — what `kvlm eval
// perplexity`, `kvlm calibrate` and the golden tests need. The same LLMEngine, scheduler and
// runners as serving, so what is scored is what is served.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "core/index_types.h"
#include "model/loaded_model.h"

namespace kvlm {

// Rows [first, first + n) of the prompt's logits, [n][vocab] fp32, valid during the call.
using LogitRows = std::function<void(int first, std::span<const float> rows)>;

// Runs `tokens` through `model` in steps of at most `chunk` tokens (the runner's KV pool is
// reallocated for exactly this sequence) and hands the logits of rows [from_row, n) to `rows`,
// in order; row p follows token p. Rows before `from_row` are run without the LM head (a
// perplexity window's context half). An empty `rows` runs the prompt without asking for logits
// (the KV observer of calibration sees it). scored_step > 0: rows from `from_row` on run at most
// that many a step (1: each as a decode step runs it; EngineRequest::prompt_logits_step). Throws
// kvlm::Error when the model cannot run it.
void score_tokens(LoadedModel& model, std::span<const TokenId> tokens, int chunk, const LogitRows& rows,
                  int from_row = 0, int scored_step = 0);

// Every row's logits at once, [tokens][vocab].
std::vector<float> all_logits(LoadedModel& model, std::span<const TokenId> tokens, int chunk);

}  // namespace kvlm

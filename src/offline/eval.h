// `kvlm eval`: perplexity (with KL divergence against a saved baseline, as
// llama-perplexity --kl-divergence reports it) and exact-match task accuracy.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/loaded_model.h"
#include "text/text_processor.h"

namespace kvlm {

// ---------------------------------------------------------------- perplexity
struct PerplexityOptions {
  int ctx = 512;          // tokens per window; the second half of each window is scored
  int max_chunks = 0;     // 0 = all windows the text fills
  std::optional<std::filesystem::path> save_logits;  // write this run's log-probs
  std::optional<std::filesystem::path> kld_base;     // compare with a saved run
  // Score each token of a window's second half in a step of its own, as decode runs it (the
  // batch-1 kernels: on CUDA the int8-activation GEMV over 4-bit codes) instead of in prefill
  // chunks; the context half still runs as a prefill. Its logits compare with either kind of
  // saved run.
  bool decode_steps = false;
};

struct PerplexityResult {
  int chunks = 0;
  int64_t scored_tokens = 0;
  double ppl = 0, ppl_err = 0;  // exp(mean NLL) and its standard error
  // Against the baseline (when kld_base is given):
  bool has_base = false;
  double base_ppl = 0;
  double delta_ppl = 0, delta_ppl_ci95 = 0;  // PPL - base PPL, and the half-width of its 95% CI
  double kld_mean = 0, kld_mean_err = 0, kld_median = 0, kld_p99 = 0, kld_max = 0;
  double same_top = 0;  // fraction of scored tokens whose most likely token is the baseline's
  std::vector<double> kld_windows;  // each window's mean KLD (tokens within a window are not independent)
};

// Runs the windows of `tokens` through the engine. `progress(done, total)` after each window.
PerplexityResult eval_perplexity(LoadedModel& engine, const std::vector<TokenId>& tokens, const PerplexityOptions& opts,
                                 const std::function<void(int, int)>& progress = {});

// ---------------------------------------------------------------- tasks
struct TaskItem {
  std::string prompt;       // raw text, special tokens written out (e.g. a rendered chat)
  std::string answer;       // expected answer, compared after trimming spaces
  std::string regex;        // extracts the answer from the completion (group 1, else the match)
  std::vector<std::string> stop;
};

// Reads JSONL: {"prompt": str, "answer": str|number, "regex"?: str, "stop"?: str|[str]}.
// Throws kvlm::Error naming the line of any malformed item.
std::vector<TaskItem> load_task_file(const std::filesystem::path& path);

// The answer `regex` finds in `completion` (first capture group, else the whole match), or
// the trimmed completion when `regex` is empty; nullopt when the regex does not match.
std::optional<std::string> extract_answer(const std::string& completion, const std::string& regex);

struct TaskOptions {
  int max_tokens = 256;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 4096;
  int limit = 0;  // 0 = every item
};

struct TaskOutcome {
  std::string completion;
  std::optional<std::string> extracted;
  bool correct = false;
  int prompt_tokens = 0, completion_tokens = 0;
};

struct TaskResult {
  std::vector<TaskOutcome> outcomes;
  int correct = 0;
  double accuracy = 0;
  double seconds = 0;
  int64_t prompt_tokens = 0, completion_tokens = 0;
};

// Greedy generation of every item through the batching engine; `progress(done, total)`
// is called from the calling thread.
TaskResult eval_task(LoadedModel& engine, const TextProcessor& text, const std::vector<TaskItem>& items,
                     const TaskOptions& opts, const std::function<void(int, int)>& progress = {});

}  // namespace kvlm

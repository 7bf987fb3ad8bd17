// `kvlm calibrate --kld-budget`: the KV plan with the fewest bytes per token whose KL
// divergence against a 16-bit cache stays within a budget, measured on calibration text.
//
//  1. The baseline: every layer's K and V in bfloat16; its log-probs are the reference every
//     other plan's KLD is taken against (`kvlm eval perplexity`'s windows and arithmetic).
//     While it runs on the CPU runner, each layer's K and V rows are sampled to choose the
//     layer's rotation signs: the seed whose 4-bit codes reconstruct the rows best
//     (core/hadamard.h); on a GPU every layer keeps the default signs.
//  2. Sensitivity: for every layer and side, each candidate format alone (int8 rotated, fp8,
//     int4 rotated, int4 rotated with the layer's exact sink / recent tokens; the rest 16-bit),
//     its KLD and same-top-token rate.
//  3. Assembly: per (layer, side) the options on the lower convex hull of (bytes, KLD), taken
//     greedily by bytes saved per unit of KLD up to a KLD target; the assembled plan is then
//     measured end to end, and the target bisected so that the measured upper bound (mean +
//     2 standard errors) stays within the budget.
//  4. The uniform modes are measured too; the answer is the candidate with the fewest bytes
//     within the budget (none when no quantized plan fits: then the 16-bit one).
// Windows: max_windows + check_windows of the text's, spread evenly over it (search and check
// alternating). Check windows are never used to choose formats.
// A plan within the budget on the search windows is measured again there and is accepted only if
// it stays within the budget (the bisection of step 3 and the final choice both ask), so that a
// plan fitted to one passage of text is caught before it ships. A bound is the mean KLD plus
// two standard errors, the larger of the per-token one and the one across windows (the tokens of
// one window are not independent: per-token errors alone under-stated the shift between texts).
// Bytes are counted at the served context (PlanSearchOptions::context): a plan's pages per
// token plus its exact sink / recent rows, a fixed cost per sequence, spread over the context.
// The assembly counts a layer's exact rows once, whichever of its sides took them.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kv/kv_plan_file.h"
#include "model/loaded_model.h"

namespace kvlm {

struct PlanSearchOptions {
  double kld_budget = 1e-3;
  int ctx = 1024;        // tokens per window (the second half of each is scored)
  int max_windows = 4;   // windows of the calibration text the formats are chosen on
  int check_windows = 2; // other windows, which only check a chosen plan (0: none)
  int bisect_steps = 6;  // end-to-end measurements of assembled plans
  int num_seeds = 16;    // rotation sign seeds tried per layer (on the sampled rows)
  // Exact sink / recent tokens a layer's INT4 option may keep (0 and 0: no such options).
  int keep_sink = 4, keep_recent = 64;
  // The context the plan serves: exact rows per sequence count as bytes per token over it
  // (0: not counted, as if contexts were unbounded).
  int context = 4096;
  CacheConfig base;      // other cache options every candidate keeps (block size, backend)
  std::function<void(const std::string&)> progress;  // one line per stage
};

// One format for one side of one layer (or both sides), as measured alone.
struct SideOption {
  KVCacheDType dtype = KVCacheDType::BFloat16;
  bool rotate = false;
  bool exact = false;  // with the layer's exact sink / recent tokens
  size_t bytes = 0;  // per token, this side of this layer (all KV heads)
  size_t exact_bytes_per_sequence = 0;  // `exact`: the layer's exact rows (K and V), per sequence
  double kld = 0, same_top = 1;
};

struct LayerSensitivity {
  int layer = 0;
  uint32_t seed = 0;                 // the rotation signs chosen for the layer
  // [0] is 16-bit (KLD 0). K's and V's options apart, or — where the attention backend holds a
  // layer's K and V in one format only (BackendCapabilities::kv_pairs unset) — `kv`, both sides
  // in each format (bytes of both).
  std::vector<SideOption> k, v, kv;
};

struct PlanCandidate {
  std::string name;  // "uniform int8+rot", "uniform K int8+rot V int4+rot", "assembled (target 4e-4)"
  KVPlanFile file;
  size_t bytes_per_token = 0;
  size_t exact_bytes_per_sequence = 0;  // the exact sink / recent rows, a fixed cost per sequence
  double kld = 0, kld_err = 0, same_top = 0;  // on the search windows
  bool within_search = false;  // kld + 2 * kld_err <= budget
  // On the check windows, where measured (a candidate within on the search windows that was a
  // contender: the bisection's, and the cheapest ones at the end).
  bool checked = false;
  double check_kld = 0, check_kld_err = 0;
  bool within = false;  // within on the search windows and, when there are check windows, on them
  // Bytes per token at `context` tokens: the pages' plus the exact rows' share (context 0: the pages').
  double bytes_at(int context) const {
    return double(bytes_per_token) + (context > 0 ? double(exact_bytes_per_sequence) / context : 0.0);
  }
};

struct PlanSearchResult {
  std::vector<LayerSensitivity> layers;
  std::vector<PlanCandidate> candidates;
  std::optional<size_t> best;  // index into candidates: the fewest bytes (at the context) within the budget
  size_t bf16_bytes_per_token = 0;
  bool split_kv = true;  // the layers' K and V were chosen apart (LayerSensitivity::k, v) or together (kv)
  int windows = 0, check_windows = 0;
  int64_t scored_tokens = 0;
  int plans_measured = 0;
  double seconds = 0;
};

// "int8+rot", "int4+rot+exact": a format, its rotation and exact tokens, short, for tables.
std::string choice_name(KVCacheDType d, bool rotate, bool exact = false);

// Runs the search on `model` (one rank, no drafter; CPU or CUDA) over `tokens`. The
// model's KV plan is left at the best candidate's (or bf16). Throws kvlm::Error when the text
// is shorter than one window or the model cannot be replanned.
PlanSearchResult search_kv_plan(LoadedModel& model, const std::vector<TokenId>& tokens, const PlanSearchOptions& opts);

}  // namespace kvlm

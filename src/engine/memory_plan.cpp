#include "engine/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "core/device.h"
#include "core/error.h"
#include "core/units.h"
#include "model/model_runner.h"
#include "model/tensor_parallel.h"

namespace kvlm {

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v);
  for (int i = int(s.size()) - 3; i > (v < 0 ? 1 : 0); i -= 3) s.insert(size_t(i), ",");
  return s;
}

// The host memory the kernel says is available (MemAvailable), or 0 when it cannot tell.
uint64_t host_available_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (f >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  return 0;
}

}  // namespace

// Activation memory of one step on the GPU, an upper estimate: the residual stream and its
// normed copy, q/k/v, the attention output, the MLP's gate/up, in the model dtype, for
// max_num_batched_tokens rows; fp32 logits for max_num_seqs rows; the split-KV workspace
// and GEMM workspace as a flat allowance. A hybrid's linear-attention layers add their fused
// projection (model dtype) and fp32 working rows: the conv's output, the delta rule's, and the
// chunked form's gates, W and U (ops/cuda/gated_deltanet.h). The host tier (--kv-offload-gib)
// adds the staging buffer its copies pass through (model/model_runner.h's kPageStagingBytes).
uint64_t activation_bytes(const ModelConfig& c, const MemoryOptions& o) {
  const uint64_t rows = uint64_t(std::max(o.max_num_batched_tokens, 1));
  uint64_t per_row = 2ull * (3ull * uint64_t(c.hidden_size) + uint64_t(c.num_heads + 2 * c.num_kv_heads) * uint64_t(c.head_dim) +
                             uint64_t(c.num_heads) * uint64_t(c.head_dim) + 2ull * uint64_t(c.intermediate_size));
  if (const auto& l = c.linear_attention)
    per_row += 2ull * uint64_t(l->in_proj_dim()) +
               4ull * (uint64_t(l->conv_dim()) + uint64_t(l->value_dim()) + uint64_t(l->v_heads) * uint64_t(2 + l->k_dim + l->v_dim));
  const uint64_t logits = 2ull * uint64_t(std::max(o.max_num_seqs, 1)) * uint64_t(c.vocab_size) * 4ull;
  const uint64_t staging = o.kv_offload_bytes > 0 ? kPageStagingBytes : 0;  // the host tier's copies in passing
  return rows * per_row + logits + 512 * kMiB + staging;
}

uint64_t parse_byte_size(std::string_view s) {
  const std::string what = "invalid size '" + std::string(s) +
                           "'; give bytes as a number with an optional unit, e.g. 2GiB, 512MiB, 4G, 1000000";
  size_t i = 0;
  while (i < s.size() && (std::isdigit((unsigned char)s[i]) || s[i] == '.')) ++i;
  if (i == 0) throw Error(what);
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(std::string(s.substr(0, i)), &used);
    if (used != i) throw Error(what);
  } catch (const std::logic_error&) {
    throw Error(what);
  }
  std::string unit(s.substr(i));
  for (auto& ch : unit) ch = char(std::tolower((unsigned char)ch));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kb") mult = 1e3;
  else if (unit == "m" || unit == "mb") mult = 1e6;
  else if (unit == "g" || unit == "gb") mult = 1e9;
  else if (unit == "t" || unit == "tb") mult = 1e12;
  else if (unit == "ki" || unit == "kib") mult = 1024.0;
  else if (unit == "mi" || unit == "mib") mult = double(kMiB);
  else if (unit == "gi" || unit == "gib") mult = double(kGiB);
  else if (unit == "ti" || unit == "tib") mult = double(kGiB) * 1024.0;
  else throw Error(what);
  const double bytes = v * mult;
  if (!(bytes >= 1) || bytes > 1e18) throw Error(what);
  return uint64_t(bytes);
}

int exact_pages_needed(const KVPlan& plan, int block_size, int max_num_seqs, int max_num_batched_tokens) {
  if (plan.exact_bytes_per_token() == 0) return 0;
  auto pages = [&](int64_t tokens) { return (tokens + block_size - 1) / block_size; };
  const int64_t sink = pages(plan.keep_sink());
  const int64_t recent = plan.keep_recent() > 0 ? pages(plan.keep_recent() - 1) + 2 : 0;
  const int64_t step = plan.keep_recent() > 0 ? pages(std::max(max_num_batched_tokens, 1)) : 0;
  const int64_t n = int64_t(std::max(max_num_seqs, 1)) * (sink + recent) + step;
  return int(std::min<int64_t>(n, int64_t(1) << 30));
}

MemoryPlan plan_kv_memory(const LoadedModel& engine, const MemoryOptions& opts) {
  const ModelConfig& mc = engine.config();
  MemoryPlan mp;
  mp.block_size = engine.block_size();
  // Under tensor parallelism each rank holds its KV heads of every token: the pool, its pages
  // and bytes per token are per rank (one GPU's), and every rank has the same pages.
  const KVPlan& plan = engine.rank_plan();
  const int tp = engine.tensor_parallel_size();
  mp.bytes_per_token = plan.bytes_per_token();
  mp.bytes_per_block = mp.bytes_per_token * uint64_t(mp.block_size);
  KVLM_CHECK(mp.bytes_per_block > 0, "a KV plan without bytes");
  mp.max_model_len = opts.max_model_len > 0 ? opts.max_model_len : mc.max_position_embeddings;
  if (mp.max_model_len > mc.max_position_embeddings)
    throw Error("--max-model-len " + std::to_string(mp.max_model_len) + " exceeds the model's context length of " +
                std::to_string(mc.max_position_embeddings) + " tokens (max_position_embeddings)");
  if (opts.gpu_memory_utilization <= 0 || opts.gpu_memory_utilization > 1)
    throw Error("--gpu-memory-utilization must be in (0, 1], got " + std::to_string(opts.gpu_memory_utilization));

  mp.num_exact_pages = exact_pages_needed(plan, mp.block_size, opts.max_num_seqs, opts.max_num_batched_tokens);
  mp.exact_bytes = uint64_t(mp.num_exact_pages) * uint64_t(mp.block_size) * plan.exact_bytes_per_token();
  // A hybrid model's recurrent states: one per --max-num-seqs slot in every Gated DeltaNet
  // layer (ModelRunner::allocate_states), and as many snapshots for prefix-cache hits
  // (engine/state_snapshots.h), out of the same budget as the pages.
  // Per rank under tensor parallelism, as the pages are: a rank holds its key heads' states.
  const std::optional<LinearAttentionConfig> rank_linear =
      tp > 1 && mc.linear_attention ? shard_config(mc, TpRank{.rank = 0, .world = tp}).linear_attention
                                    : mc.linear_attention;
  const uint64_t state_per_seq = rank_linear ? rank_linear->state_bytes() * uint64_t(mc.num_linear_layers()) : 0;
  const int seqs = std::max(opts.max_num_seqs, 1);
  mp.state_snapshots = mc.linear_attention && opts.prefix_caching ? seqs : 0;
  // Drafting keeps each sequence's state from before a verification, for a rejected draft to
  // roll back to (Scheduler::save_draft_states).
  mp.draft_states = mc.linear_attention && engine.speculative() ? seqs : 0;
  mp.state_bytes = state_per_seq * uint64_t(seqs + mp.state_snapshots + mp.draft_states);
  std::string source;
  uint64_t budget = 0;
  if (opts.kv_cache_memory) {
    budget = *opts.kv_cache_memory;
    source = "--kv-cache-memory";
  } else if (engine.model().device() == Device::Cuda) {
    // The GPU with the least free memory decides (tensor parallelism: every rank's pool is
    // alike); this process's GPUs only (other nodes' ranks run elsewhere).
    auto mem = cuda_memory_info(engine.gpu());
    for (int r = 1; r < engine.num_local_gpus() && mem; ++r) {
      const auto m = cuda_memory_info(engine.gpu() + r);
      if (!m) mem.reset();
      else if (m->free < mem->free) mem = m;
    }
    if (!mem) throw Error("cannot read the GPU's memory (cudaMemGetInfo failed); give the pool size with --kv-cache-memory");
    // vLLM's rule: this instance may use `utilization` of the device's total memory; what is
    // in use now (our weights, other processes) and the activations of one step come off.
    const double allowed = double(mem->total) * opts.gpu_memory_utilization;
    const double used = double(mem->total - mem->free);
    const double act = double(activation_bytes(mc, opts));
    const double left = allowed - used - act;
    if (left < double(mp.bytes_per_block))
      throw Error("no GPU memory is left for the KV cache: " + human_bytes(uint64_t(used)) + " in use (weights included) and " +
                  human_bytes(uint64_t(act)) + " reserved for activations, of " + human_bytes(uint64_t(allowed)) +
                  " allowed by --gpu-memory-utilization " + std::to_string(opts.gpu_memory_utilization) +
                  "; raise it, lower --max-num-batched-tokens, or free the GPU");
    budget = uint64_t(left);
    source = "--gpu-memory-utilization " + std::to_string(opts.gpu_memory_utilization).substr(0, 4);
  } else {
    // CPU default: enough for kCpuFullSequences sequences of max_model_len (fewer when
    // max_num_seqs is lower), at most 4 GiB (vLLM's CPU backend's default). Shorter requests
    // run more at once, since pages are taken as tokens come; a CPU serves few long sequences
    // at a useful speed, and the bundled model's 4 GiB pool took 7-20 s to start and 4.4 GB.
    constexpr int kCpuFullSequences = 16;
    const uint64_t tokens = std::max(uint64_t(std::clamp(opts.max_num_seqs, 1, kCpuFullSequences)) * uint64_t(mp.max_model_len),
                                     uint64_t(mp.max_model_len + mp.block_size));
    const uint64_t want = tokens * mp.bytes_per_token + mp.exact_bytes;
    budget = std::min<uint64_t>(4 * kGiB, want) + mp.state_bytes;  // the states on top of the pages' default
    source = "the CPU default: " + std::to_string(kCpuFullSequences) +
             " sequences of --max-model-len; set --kv-cache-memory to change";
  }
  // The exact pages come out of the same budget.
  if (mp.exact_bytes > 0 && mp.exact_bytes + mp.bytes_per_block > budget) {
    char why[320];
    std::snprintf(why, sizeof why,
                  "the exact sink / recent tokens (--kv-cache-keep-sink %d, --kv-cache-keep-recent %d) need %s for %d "
                  "sequences, more than the KV cache's %s from ",
                  plan.keep_sink(), plan.keep_recent(), human_bytes(mp.exact_bytes).c_str(),
                  opts.max_num_seqs, human_bytes(budget).c_str());
    throw Error(why + source + "; lower --max-num-seqs or the kept tokens, or give the cache more memory");
  }
  budget -= mp.exact_bytes;
  if (mp.state_bytes > 0 && mp.state_bytes + mp.bytes_per_block > budget)
    throw Error("the linear-attention states of " + std::to_string(opts.max_num_seqs) + " sequences (--max-num-seqs)" +
                (mp.state_snapshots > 0 ? " and as many prefix-cache snapshots" : "") +
                (mp.draft_states > 0 ? " and as many copies for drafts to roll back to" : "") + " need " +
                human_bytes(mp.state_bytes) + " (" + human_bytes(state_per_seq) + " each), more than the " + human_bytes(budget) +
                " from " + source + " leaves; lower --max-num-seqs" +
                (mp.state_snapshots > 0 ? ", turn prefix caching off (--no-enable-prefix-caching)," : "") +
                (mp.draft_states > 0 ? " drop --speculative-config," : "") +
                " or give the cache more memory");
  budget -= mp.state_bytes;
  mp.num_blocks = int(std::min<uint64_t>(budget / mp.bytes_per_block, uint64_t(1) << 30));
  mp.kv_bytes = uint64_t(mp.num_blocks) * mp.bytes_per_block;
  mp.capacity_tokens = int64_t(mp.num_blocks) * mp.block_size;
  if (mp.capacity_tokens < mp.max_model_len)
    throw Error("the KV cache (" + human_bytes(budget) + " from " + source + ") holds " + with_commas(mp.capacity_tokens) +
                " tokens at " + std::to_string(mp.bytes_per_token) + " bytes per token, fewer than one request of " +
                with_commas(mp.max_model_len) + " tokens (--max-model-len); give it more memory (at least " +
                human_bytes(uint64_t(mp.max_model_len + mp.block_size) * mp.bytes_per_token) +
                "), lower --max-model-len, or choose a smaller --kv-cache-dtype");
  mp.max_concurrency = double(mp.capacity_tokens) / double(mp.max_model_len);

  char line[512];
  std::snprintf(line, sizeof line,
                "KV cache: %s (%s) = %s pages x %d tokens = %s tokens at %llu bytes/token\n"
                "maximum concurrency for %s tokens per request: %.2fx",
                human_bytes(mp.kv_bytes).c_str(), source.c_str(), with_commas(mp.num_blocks).c_str(), mp.block_size,
                with_commas(mp.capacity_tokens).c_str(), (unsigned long long)mp.bytes_per_token,
                with_commas(mp.max_model_len).c_str(), mp.max_concurrency);
  mp.summary = line;
  if (tp > 1) {
    std::snprintf(line, sizeof line, "\n(per rank: each of the %d tensor-parallel ranks holds this pool for its KV heads; "
                  "%s of KV memory in all)", tp, human_bytes(mp.kv_bytes * uint64_t(tp)).c_str());
    mp.summary += line;
  }
  if (mp.state_bytes > 0) {
    std::snprintf(line, sizeof line, "\nlinear-attention states: %s for %d sequences (--max-num-seqs)%s%s, %s each",
                  human_bytes(mp.state_bytes).c_str(), seqs,
                  mp.state_snapshots > 0 ? " and as many prefix-cache snapshots" : "",
                  mp.draft_states > 0 ? " and as many copies for drafts to roll back to" : "",
                  human_bytes(state_per_seq).c_str());
    mp.summary += line;
  }
  if (mp.num_exact_pages > 0) {
    std::snprintf(line, sizeof line,
                  "\nexact sink/recent tokens: %s (sink %d, recent %d per sequence, %zu bytes/token) = %d pages for "
                  "%d sequences",
                  human_bytes(mp.exact_bytes).c_str(), plan.keep_sink(), plan.keep_recent(),
                  plan.exact_bytes_per_token(), mp.num_exact_pages, opts.max_num_seqs);
    mp.summary += line;
  }
  if (opts.kv_offload_bytes > 0) {
    if (!opts.prefix_caching)
      throw Error("--kv-offload-gib keeps the pages the prefix cache evicts: it needs prefix caching (drop "
                  "--no-enable-prefix-caching)");
    const size_t page = engine.model().kv_page_bytes(mp.block_size);
    if (page == 0)
      throw Error("--kv-offload-gib: the KV pages of ranks on other nodes cannot be copied to this host's memory; "
                  "drop --kv-offload-gib or run tensor parallelism on one node");
    // Exact sink / recent tokens: exact pages get the share of the budget they have of the pool,
    // so that a hit on pages from the tiers keeps the exact copies its query reads.
    const size_t exact_page = mp.num_exact_pages > 0 ? engine.model().kv_page_bytes(mp.block_size, PageKind::Exact) : 0;
    const double exact_share =
        exact_page > 0 ? double(mp.exact_bytes) / double(mp.exact_bytes + uint64_t(mp.num_blocks) * mp.bytes_per_block) : 0;
    mp.offload_exact_pages = exact_page > 0 ? int64_t(double(opts.kv_offload_bytes) * exact_share / double(exact_page)) : 0;
    if (mp.offload_exact_pages < 2) mp.offload_exact_pages = 0;  // too little room: hits end before them, as without
    mp.offload_exact_bytes = uint64_t(mp.offload_exact_pages) * exact_page;
    mp.offload_pages = int64_t((opts.kv_offload_bytes - mp.offload_exact_bytes) / page);
    mp.offload_bytes = uint64_t(mp.offload_pages) * page;
    if (mp.offload_pages < 2)
      throw Error("--kv-offload-gib: " + human_bytes(opts.kv_offload_bytes) + " holds fewer than 2 pages of " +
                  human_bytes(page) +
                  (mp.offload_exact_bytes > 0 ? " beside " + human_bytes(mp.offload_exact_bytes) + " of exact sink / recent pages"
                                              : std::string()) +
                  "; give the host tier more memory");
    if (const uint64_t avail = host_available_bytes(); avail > 0 && mp.offload_bytes + mp.offload_exact_bytes > avail)
      throw Error("--kv-offload-gib: the host tier's " + human_bytes(mp.offload_bytes + mp.offload_exact_bytes) +
                  " is more than the " +
                  human_bytes(avail) + " of host memory available; give it less");
    std::snprintf(line, sizeof line, "\nhost tier (--kv-offload-gib): %s = %s pages = %s tokens, %.2fx the pool's",
                  human_bytes(mp.offload_bytes).c_str(), with_commas(mp.offload_pages).c_str(),
                  with_commas(mp.offload_pages * mp.block_size).c_str(),
                  double(mp.offload_pages) / double(std::max(mp.num_blocks, 1)));
    mp.summary += line;
    if (exact_page > 0) {
      std::snprintf(line, sizeof line, "; exact sink/recent tokens: %s = %s exact pages%s",
                    human_bytes(mp.offload_exact_bytes).c_str(), with_commas(mp.offload_exact_pages).c_str(),
                    mp.offload_exact_pages == 0 ? " (too little room: hits end before pages read exact)" : "");
      mp.summary += line;
    }
    if (opts.kv_offload_disk_bytes > 0) {
      mp.offload_exact_disk_bytes =
          mp.offload_exact_pages > 0 ? uint64_t(double(opts.kv_offload_disk_bytes) * exact_share) : 0;
      if (mp.offload_exact_disk_bytes < 2 * exact_page) mp.offload_exact_disk_bytes = 0;
      mp.offload_disk_bytes = opts.kv_offload_disk_bytes - mp.offload_exact_disk_bytes;
      const uint64_t disk_pages = mp.offload_disk_bytes / page;  // about: each file adds a header
      std::snprintf(line, sizeof line, "\ndisk tier (--kv-offload-disk-gib): %s = about %s pages = %s tokens",
                    human_bytes(mp.offload_disk_bytes).c_str(), with_commas(int64_t(disk_pages)).c_str(),
                    with_commas(int64_t(disk_pages) * mp.block_size).c_str());
      mp.summary += line;
      if (mp.offload_exact_disk_bytes > 0) {
        std::snprintf(line, sizeof line, "; exact pages: %s", human_bytes(mp.offload_exact_disk_bytes).c_str());
        mp.summary += line;
      }
    }
  }
  return mp;
}

}  // namespace kvlm

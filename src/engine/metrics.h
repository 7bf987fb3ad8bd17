// Counters and histograms of the serving engine, read as a consistent snapshot by the
// server's /metrics route (Prometheus text) and by `kvlm bench`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvlm {

// A Prometheus-style histogram: counts[i] = observations <= bounds[i] (not cumulative here;
// counts has bounds.size() + 1 entries, the last for +Inf).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v);
};

struct EngineStats {
  // Gauges.
  int num_running = 0;
  int num_waiting = 0;
  // The most sequences run in one step since the engine last went idle (every request
  // finished): exact, where sampling num_running from another thread can miss a short run.
  int peak_running = 0;
  int num_blocks = 0;              // pages in the KV pool
  int num_free_blocks = 0;         // free or evictable (cached but unreferenced)
  double kv_usage = 0;             // fraction of pages referenced by live sequences
  // Counters.
  uint64_t prompt_tokens_total = 0;      // prompt tokens computed (cache hits excluded)
  uint64_t generation_tokens_total = 0;
  uint64_t preemptions_total = 0;
  uint64_t recomputed_tokens_total = 0;  // tokens of preempted sequences computed again on resuming
  // Hybrid models: drafts not wholly accepted, whose sequence's recurrent state was rolled back
  // (Scheduler::rewind_draft) and its accepted tokens computed again.
  uint64_t spec_state_rewinds_total = 0;
  uint64_t prefix_cache_queries_total = 0;  // prompt tokens looked up in the prefix cache
  uint64_t prefix_cache_hits_total = 0;     // of those, tokens found
  // The prefix cache's host tier (--kv-offload-gib; engine/host_kv_tier.h): pages held (gauge)
  // and its capacity, pages and bytes copied there and back, entries replaced, tokens found there.
  int kv_offload_pages = 0, kv_offload_capacity = 0;
  uint64_t kv_offload_stored_bytes_total = 0, kv_offload_restored_bytes_total = 0;
  // Time the copies took where they ran (ModelRunner::page_copy_times; the copies completed so far).
  double kv_offload_store_seconds_total = 0, kv_offload_restore_seconds_total = 0;
  uint64_t kv_offload_stored_total = 0, kv_offload_restored_total = 0, kv_offload_evictions_total = 0;
  uint64_t kv_offload_hit_tokens_total = 0;
  // Its exact pages (exact sink / recent tokens): held (gauge) and capacity, kept and restored
  // (their bytes are in the totals above, their copies' time too).
  int kv_offload_exact_pages = 0, kv_offload_exact_capacity = 0;
  uint64_t kv_offload_exact_stored_total = 0, kv_offload_exact_restored_total = 0;
  // and their disk tier's (beside the pages' one, under another root).
  int kv_offload_exact_disk_pages = 0;
  uint64_t kv_offload_exact_disk_written_total = 0, kv_offload_exact_disk_read_total = 0;
  uint64_t kv_offload_exact_disk_damaged_total = 0;
  // What bringing a page back costs, from host memory and (the read alone) from disk, against
  // computing its tokens again, measured (engine/tier_costs.h; 0: not yet), and whether hits
  // take pages from each tier now (they do while it pays).
  double kv_offload_restore_page_seconds = 0, kv_offload_disk_page_seconds = 0, kv_offload_recompute_page_seconds = 0;
  bool kv_offload_host_in_use = true, kv_offload_disk_in_use = true;
  // Its disk tier (--kv-offload-dir; engine/disk_kv_tier.h): pages held (gauge) and its capacity,
  // pages written and read back (read into the host tier, then restored from there), files
  // replaced, damaged or foreign files ignored, and the time its writes and reads took.
  int kv_offload_disk_pages = 0, kv_offload_disk_capacity = 0;
  uint64_t kv_offload_disk_written_total = 0, kv_offload_disk_read_total = 0, kv_offload_disk_evictions_total = 0;
  uint64_t kv_offload_disk_damaged_total = 0, kv_offload_disk_bytes_per_page = 0;
  double kv_offload_disk_write_seconds_total = 0, kv_offload_disk_read_seconds_total = 0;
  // Requests set aside while their prefix was read from disk (others were scheduled meanwhile),
  // and those waiting so now (gauge).
  uint64_t kv_offload_disk_restoring_total = 0;
  int num_restoring = 0;
  uint64_t requests_total = 0;              // accepted
  std::map<std::string, uint64_t> requests_finished_total;  // by finish reason
  uint64_t steps_total = 0;
  // Tokens of constrained requests drawn a step or more late because their grammar mask was
  // not computed when their step ended (the rest of the batch did not wait for it).
  uint64_t grammar_deferred_tokens_total = 0;
  // Masked rows of a runner that samples on its device whose mask was not ready when the
  // forward pass ended: their logits came back, to be drawn on the host (or deferred).
  uint64_t grammar_late_masks_total = 0;
  // Speculative decoding: drafts verified (one per sequence and step), their tokens, and of
  // those the accepted ones. Mean acceptance length = 1 + accepted / drafts.
  uint64_t spec_drafts_total = 0;
  uint64_t spec_draft_tokens_total = 0;
  uint64_t spec_accepted_tokens_total = 0;
  // Where the engine thread's time goes (seconds): scheduling and batch layout, drafting
  // (--speculative-config: the proposer, a drafter model's forward included), the model's
  // forward pass (including sampling done by the runner on its device), host sampling.
  double schedule_seconds_total = 0;
  double draft_seconds_total = 0;
  double forward_seconds_total = 0;
  double sample_seconds_total = 0;
  // Latencies in seconds.
  Histogram time_to_first_token{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0}};
  Histogram inter_token_latency{{0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5}};
  Histogram e2e_request_latency{{0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0}};
};

}  // namespace kvlm

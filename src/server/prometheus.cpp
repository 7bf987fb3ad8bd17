#include "server/prometheus.h"

#include <malloc.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace kvlm::server {

std::string escape_label(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

namespace {

std::string fmt(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Prefer the short form when it reads back exactly (0.1, not 0.10000000000000001).
  char shortbuf[64];
  std::snprintf(shortbuf, sizeof shortbuf, "%g", v);
  return std::strtod(shortbuf, nullptr) == v ? shortbuf : buf;
}

// kvlm metrics that mean what a vLLM metric means, written again under vLLM's names so that
// dashboards and alerts built for vLLM (its Grafana dashboard, KEDA/HPA rules) work unchanged.
// Some have two vLLM names (the V0 one a dashboard may still use).
const std::map<std::string, std::vector<std::string>>& vllm_aliases() {
  static const std::map<std::string, std::vector<std::string>> m{
      {"kvlm:num_requests_running", {"vllm:num_requests_running"}},
      {"kvlm:num_requests_waiting", {"vllm:num_requests_waiting"}},
      {"kvlm:kv_cache_usage_perc", {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}},
      {"kvlm:prompt_tokens_total", {"vllm:prompt_tokens_total"}},
      {"kvlm:generation_tokens_total", {"vllm:generation_tokens_total"}},
      {"kvlm:num_preemptions_total", {"vllm:num_preemptions_total"}},
      {"kvlm:prefix_cache_queries_total", {"vllm:prefix_cache_queries_total"}},
      {"kvlm:prefix_cache_hits_total", {"vllm:prefix_cache_hits_total"}},
      {"kvlm:request_success_total", {"vllm:request_success_total"}},
      {"kvlm:spec_decode_num_drafts_total", {"vllm:spec_decode_num_drafts_total"}},
      {"kvlm:spec_decode_num_draft_tokens_total", {"vllm:spec_decode_num_draft_tokens_total"}},
      {"kvlm:spec_decode_num_accepted_tokens_total", {"vllm:spec_decode_num_accepted_tokens_total"}},
      {"kvlm:time_to_first_token_seconds", {"vllm:time_to_first_token_seconds"}},
      {"kvlm:inter_token_latency_seconds", {"vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"}},
      {"kvlm:e2e_request_latency_seconds", {"vllm:e2e_request_latency_seconds"}},
  };
  return m;
}

class Writer {
 public:
  explicit Writer(const std::string& model) : labels_("model_name=\"" + escape_label(model) + "\"") {}

  // A metric family under its name and its vLLM aliases: the header, then samples(name).
  template <class F>
  void family(const std::string& name, const char* type, const char* help, F&& samples) {
    write_family(name, type, help, samples);
    if (const auto it = vllm_aliases().find(name); it != vllm_aliases().end())
      for (const std::string& alias : it->second) write_family(alias, type, help, samples);
  }
  void sample(const std::string& name, double v, const std::string& extra = {}) {
    out_ += name + "{" + labels_ + (extra.empty() ? "" : "," + extra) + "} " + fmt(v) + "\n";
  }
  void gauge(const std::string& name, const char* help, double v) {
    family(name, "gauge", help, [&](const std::string& n) { sample(n, v); });
  }
  void counter(const std::string& name, const char* help, double v) {
    family(name, "counter", help, [&](const std::string& n) { sample(n, v); });
  }
  void histogram(const std::string& name, const char* help, const Histogram& h) {
    family(name, "histogram", help, [&](const std::string& n) {
      uint64_t cum = 0;
      for (size_t i = 0; i < h.bounds.size(); ++i) {
        cum += i < h.counts.size() ? h.counts[i] : 0;
        sample(n + "_bucket", double(cum), "le=\"" + fmt(h.bounds[i]) + "\"");
      }
      sample(n + "_bucket", double(h.count), "le=\"+Inf\"");
      sample(n + "_sum", h.sum);
      sample(n + "_count", double(h.count));
    });
  }
  std::string take() { return std::move(out_); }

 private:
  template <class F>
  void write_family(const std::string& name, const char* type, const char* help, F& samples) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
    samples(name);
  }
  std::string labels_;
  std::string out_;
};

}  // namespace

std::string format_prometheus(const EngineStats& s, const HttpStats& http, const std::string& model_name) {
  Writer w(model_name);
  w.gauge("kvlm:num_requests_running", "Requests in the running batch.", s.num_running);
  w.gauge("kvlm:num_requests_waiting", "Requests waiting to be scheduled (new or preempted).", s.num_waiting);
  w.gauge("kvlm:kv_cache_usage_perc", "Fraction of KV-cache pages held by live requests (1 = full).", s.kv_usage);
  w.gauge("kvlm:kv_cache_blocks", "KV-cache pages in the pool.", s.num_blocks);
  w.gauge("kvlm:kv_cache_free_blocks", "KV-cache pages free or evictable (cached, unreferenced).", s.num_free_blocks);
  w.counter("kvlm:prompt_tokens_total", "Prompt tokens computed (prefix-cache hits excluded).", double(s.prompt_tokens_total));
  w.counter("kvlm:generation_tokens_total", "Tokens generated.", double(s.generation_tokens_total));
  w.counter("kvlm:num_preemptions_total", "Requests preempted (pages released, recomputed or restored later) for lack of KV pages.",
            double(s.preemptions_total));
  w.counter("kvlm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            double(s.prefix_cache_queries_total));
  w.counter("kvlm:recomputed_tokens_total",
            "Tokens of preempted sequences computed again when they resumed (not found in the prefix cache or its tiers).",
            double(s.recomputed_tokens_total));
  w.counter("kvlm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", double(s.prefix_cache_hits_total));
  if (s.kv_offload_capacity > 0) {
    w.gauge("kvlm:kv_offload_pages", "Pages held in the prefix cache's host tier (--kv-offload-gib).", s.kv_offload_pages);
    w.gauge("kvlm:kv_offload_capacity_pages", "Pages the host tier can hold.", s.kv_offload_capacity);
    w.counter("kvlm:kv_offload_stored_pages_total", "Pages evicted from the KV pool and copied to the host tier.",
              double(s.kv_offload_stored_total));
    w.counter("kvlm:kv_offload_restored_pages_total", "Pages copied back from the host tier for a prefix hit.",
              double(s.kv_offload_restored_total));
    w.counter("kvlm:kv_offload_stored_bytes_total", "Bytes copied to the host tier.",
              double(s.kv_offload_stored_bytes_total));
    w.counter("kvlm:kv_offload_restored_bytes_total", "Bytes copied back from the host tier.",
              double(s.kv_offload_restored_bytes_total));
    w.counter("kvlm:kv_offload_store_seconds_total", "Time the copies to the host tier took on the device.",
              s.kv_offload_store_seconds_total);
    w.counter("kvlm:kv_offload_restore_seconds_total", "Time the copies back from the host tier took on the device.",
              s.kv_offload_restore_seconds_total);
    w.counter("kvlm:kv_offload_evictions_total", "Host tier entries replaced (least recently used first).",
              double(s.kv_offload_evictions_total));
    w.counter("kvlm:kv_offload_hit_tokens_total", "Prompt tokens found in the host tier (restored, not recomputed).",
              double(s.kv_offload_hit_tokens_total));
    w.gauge("kvlm:kv_offload_restore_page_seconds", "Measured time to copy one page back from the host tier (0: not yet).",
            s.kv_offload_restore_page_seconds);
    w.gauge("kvlm:kv_offload_recompute_page_seconds",
            "Measured time to compute one page's tokens again in a prefill-sized step (0: not yet).",
            s.kv_offload_recompute_page_seconds);
    w.gauge("kvlm:kv_offload_host_in_use", "1 while prefix hits take pages from the host tier (restoring pays).",
            s.kv_offload_host_in_use ? 1 : 0);
  }
  if (s.kv_offload_exact_capacity > 0) {
    w.gauge("kvlm:kv_offload_exact_pages", "Exact sink / recent pages held in the host tier.", s.kv_offload_exact_pages);
    w.gauge("kvlm:kv_offload_exact_capacity_pages", "Exact pages the host tier can hold.", s.kv_offload_exact_capacity);
    w.counter("kvlm:kv_offload_exact_stored_pages_total",
              "Exact copies that cached pages gave up, copied to the host tier.", double(s.kv_offload_exact_stored_total));
    w.counter("kvlm:kv_offload_exact_restored_pages_total",
              "Exact copies copied back for a prefix hit whose query reads those pages exact.",
              double(s.kv_offload_exact_restored_total));
    if (s.kv_offload_disk_capacity > 0) {
      w.gauge("kvlm:kv_offload_exact_disk_pages", "Exact pages held in the disk tier.", s.kv_offload_exact_disk_pages);
      w.counter("kvlm:kv_offload_exact_disk_written_pages_total", "Exact pages written to the disk tier.",
                double(s.kv_offload_exact_disk_written_total));
      w.counter("kvlm:kv_offload_exact_disk_read_pages_total", "Exact pages read back from the disk tier.",
                double(s.kv_offload_exact_disk_read_total));
      w.counter("kvlm:kv_offload_exact_disk_damaged_total", "Damaged or foreign exact page files ignored and removed.",
                double(s.kv_offload_exact_disk_damaged_total));
    }
  }
  if (s.kv_offload_disk_capacity > 0) {
    w.gauge("kvlm:kv_offload_disk_pages", "Pages held in the disk tier (--kv-offload-dir).", s.kv_offload_disk_pages);
    w.gauge("kvlm:kv_offload_disk_page_seconds", "Measured time to read one page from the disk tier (0: not yet).",
            s.kv_offload_disk_page_seconds);
    w.gauge("kvlm:kv_offload_disk_in_use",
            "1 while prefix hits read pages from the disk tier (reading and restoring pays against computing them).",
            s.kv_offload_disk_in_use ? 1 : 0);
    w.gauge("kvlm:kv_offload_disk_capacity_pages", "Pages the disk tier can hold.", s.kv_offload_disk_capacity);
    w.counter("kvlm:kv_offload_disk_written_pages_total", "Pages the host tier let go of, written to disk.",
              double(s.kv_offload_disk_written_total));
    w.counter("kvlm:kv_offload_disk_read_pages_total", "Pages read back from disk for a prefix hit.",
              double(s.kv_offload_disk_read_total));
    w.counter("kvlm:kv_offload_disk_written_bytes_total", "Bytes written to the disk tier.",
              double(s.kv_offload_disk_written_total * s.kv_offload_disk_bytes_per_page));
    w.counter("kvlm:kv_offload_disk_read_bytes_total", "Bytes read back from the disk tier.",
              double(s.kv_offload_disk_read_total * s.kv_offload_disk_bytes_per_page));
    w.counter("kvlm:kv_offload_disk_write_seconds_total", "Time the disk tier's writes took.",
              s.kv_offload_disk_write_seconds_total);
    w.counter("kvlm:kv_offload_disk_read_seconds_total", "Time the disk tier's reads (and checks) took.",
              s.kv_offload_disk_read_seconds_total);
    w.counter("kvlm:kv_offload_disk_evictions_total", "Disk tier files replaced (least recently used first).",
              double(s.kv_offload_disk_evictions_total));
    w.counter("kvlm:kv_offload_disk_damaged_total", "Damaged or foreign page files found, ignored and removed.",
              double(s.kv_offload_disk_damaged_total));
    w.gauge("kvlm:num_requests_restoring", "Waiting requests whose prefix is being read from the disk tier.",
            s.num_restoring);
    w.counter("kvlm:kv_offload_disk_restoring_total",
              "Requests set aside while their prefix was read from disk (others were scheduled meanwhile).",
              double(s.kv_offload_disk_restoring_total));
  }
  w.counter("kvlm:requests_total", "Requests accepted by the engine.", double(s.requests_total));
  std::map<std::string, uint64_t> by_reason{{"stop", 0}, {"length", 0}, {"abort", 0}, {"error", 0}};
  for (const auto& [reason, n] : s.requests_finished_total) by_reason[reason] = n;
  w.family("kvlm:request_success_total", "counter", "Requests finished, by finish reason.", [&](const std::string& n) {
    for (const auto& [reason, count] : by_reason)
      w.sample(n, double(count), "finished_reason=\"" + escape_label(reason) + "\"");
  });
  w.counter("kvlm:engine_steps_total", "Scheduler steps run.", double(s.steps_total));
  w.counter("kvlm:grammar_deferred_tokens_total",
            "Structured-output tokens drawn late because their grammar mask was still being computed.",
            double(s.grammar_deferred_tokens_total));
  w.counter("kvlm:grammar_late_masks_total",
            "Grammar masks not ready when the GPU sampled their step: the row's logits came back to the host.",
            double(s.grammar_late_masks_total));
  w.counter("kvlm:spec_decode_num_drafts_total", "Speculative drafts verified (one per sequence and step).",
            double(s.spec_drafts_total));
  w.counter("kvlm:spec_decode_num_draft_tokens_total", "Draft tokens verified.", double(s.spec_draft_tokens_total));
  w.counter("kvlm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted by the target model.",
            double(s.spec_accepted_tokens_total));
  w.counter("kvlm:spec_decode_state_rewinds_total",
            "Hybrid models: drafts not wholly accepted, whose recurrent state was rolled back and accepted tokens "
            "computed again.",
            double(s.spec_state_rewinds_total));
  w.family("kvlm:engine_seconds_total", "counter",
           "Engine thread time by phase: schedule (and batch layout), draft (speculative proposals), forward (the "
           "model, with sampling on the device), sample (on the host).",
           [&](const std::string& n) {
             w.sample(n, s.schedule_seconds_total, "phase=\"schedule\"");
             w.sample(n, s.draft_seconds_total, "phase=\"draft\"");
             w.sample(n, s.forward_seconds_total, "phase=\"forward\"");
             w.sample(n, s.sample_seconds_total, "phase=\"sample\"");
           });
  w.histogram("kvlm:time_to_first_token_seconds", "Time from arrival to the first generated token.", s.time_to_first_token);
  w.histogram("kvlm:inter_token_latency_seconds", "Time between consecutive tokens of a request.", s.inter_token_latency);
  w.histogram("kvlm:e2e_request_latency_seconds", "Time from arrival to the end of a request.", s.e2e_request_latency);
  if (http.resident_bytes) w.gauge("process_resident_memory_bytes", "Resident memory size in bytes.", double(http.resident_bytes));
  if (http.heap_bytes) w.gauge("kvlm:heap_in_use_bytes", "Bytes allocated with malloc and not yet freed.", double(http.heap_bytes));
  w.gauge("kvlm:http_requests_in_flight", "Generation requests the HTTP server is answering.", http.requests_in_flight);
  w.family("kvlm:http_responses_total", "counter", "HTTP responses sent, by status code.", [&](const std::string& n) {
    for (const auto& [status, count] : http.responses_by_status)
      w.sample(n, double(count), "status=\"" + std::to_string(status) + "\"");
  });
  return w.take();
}

void read_process_memory(HttpStats& h) {
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    unsigned long long size = 0, resident = 0;
    if (std::fscanf(f, "%llu %llu", &size, &resident) == 2) h.resident_bytes = resident * uint64_t(::sysconf(_SC_PAGESIZE));
    std::fclose(f);
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  const struct mallinfo2 mi = ::mallinfo2();
  h.heap_bytes = uint64_t(mi.uordblks) + uint64_t(mi.hblkhd);
#endif
}

}  // namespace kvlm::server

#include "server/prometheus.h"

#include <malloc.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>

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

class Writer {
 public:
  explicit Writer(const std::string& model) : labels_("model_name=\"" + escape_label(model) + "\"") {}

  void header(const std::string& name, const char* type, const char* help) {
    out_ += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const std::string& name, double v, const std::string& extra = {}) {
    out_ += name + "{" + labels_ + (extra.empty() ? "" : "," + extra) + "} " + fmt(v) + "\n";
  }
  void gauge(const std::string& name, const char* help, double v) {
    header(name, "gauge", help);
    sample(name, v);
  }
  void counter(const std::string& name, const char* help, double v) {
    header(name, "counter", help);
    sample(name, v);
  }
  void histogram(const std::string& name, const char* help, const Histogram& h) {
    header(name, "histogram", help);
    uint64_t cum = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cum += i < h.counts.size() ? h.counts[i] : 0;
      sample(name + "_bucket", double(cum), "le=\"" + fmt(h.bounds[i]) + "\"");
    }
    sample(name + "_bucket", double(h.count), "le=\"+Inf\"");
    sample(name + "_sum", h.sum);
    sample(name + "_count", double(h.count));
  }
  std::string take() { return std::move(out_); }

 private:
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
  w.counter("kvlm:num_preemptions_total", "Requests preempted (pages released, recomputed later) for lack of KV pages.",
            double(s.preemptions_total));
  w.counter("kvlm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
            double(s.prefix_cache_queries_total));
  w.counter("kvlm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", double(s.prefix_cache_hits_total));
  w.counter("kvlm:requests_total", "Requests accepted by the engine.", double(s.requests_total));
  w.header("kvlm:request_success_total", "counter", "Requests finished, by finish reason.");
  std::map<std::string, uint64_t> by_reason{{"stop", 0}, {"length", 0}, {"abort", 0}, {"error", 0}};
  for (const auto& [reason, n] : s.requests_finished_total) by_reason[reason] = n;
  for (const auto& [reason, n] : by_reason)
    w.sample("kvlm:request_success_total", double(n), "finished_reason=\"" + escape_label(reason) + "\"");
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
  w.header("kvlm:engine_seconds_total", "counter",
           "Engine thread time by phase: schedule (and batch layout), draft (speculative proposals), forward (the "
           "model, with sampling on the device), sample (on the host).");
  w.sample("kvlm:engine_seconds_total", s.schedule_seconds_total, "phase=\"schedule\"");
  w.sample("kvlm:engine_seconds_total", s.draft_seconds_total, "phase=\"draft\"");
  w.sample("kvlm:engine_seconds_total", s.forward_seconds_total, "phase=\"forward\"");
  w.sample("kvlm:engine_seconds_total", s.sample_seconds_total, "phase=\"sample\"");
  w.histogram("kvlm:time_to_first_token_seconds", "Time from arrival to the first generated token.", s.time_to_first_token);
  w.histogram("kvlm:inter_token_latency_seconds", "Time between consecutive tokens of a request.", s.inter_token_latency);
  w.histogram("kvlm:e2e_request_latency_seconds", "Time from arrival to the end of a request.", s.e2e_request_latency);
  if (http.resident_bytes) w.gauge("process_resident_memory_bytes", "Resident memory size in bytes.", double(http.resident_bytes));
  if (http.heap_bytes) w.gauge("kvlm:heap_in_use_bytes", "Bytes allocated with malloc and not yet freed.", double(http.heap_bytes));
  w.gauge("kvlm:http_requests_in_flight", "Generation requests the HTTP server is answering.", http.requests_in_flight);
  w.header("kvlm:http_responses_total", "counter", "HTTP responses sent, by status code.");
  for (const auto& [status, n] : http.responses_by_status)
    w.sample("kvlm:http_responses_total", double(n), "status=\"" + std::to_string(status) + "\"");
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

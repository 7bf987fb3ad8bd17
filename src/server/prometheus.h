// /metrics: the serving engine's EngineStats and the HTTP server's own counters in the
// Prometheus text format (version 0.0.4), with vLLM's metric names under the kvlm: prefix.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "engine/metrics.h"

namespace kvlm::server {

struct HttpStats {
  std::map<int, uint64_t> responses_by_status;  // HTTP responses sent, by status
  int requests_in_flight = 0;                   // generation requests being answered
  uint64_t resident_bytes = 0;                  // the process's RSS (0: unknown)
  uint64_t heap_bytes = 0;                      // malloc'd bytes in use (0: unknown)
};

// The process's resident set and malloc'd bytes in use, for /metrics.
void read_process_memory(HttpStats& h);

std::string format_prometheus(const EngineStats& s, const HttpStats& http, const std::string& model_name);

// A label value with \, " and newline escaped as the text format requires.
std::string escape_label(const std::string& v);

}  // namespace kvlm::server

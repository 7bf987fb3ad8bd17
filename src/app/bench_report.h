// What the `kvlm bench` commands print and write: tables in the style of `vllm bench` (a
// rule, then label / value rows) and their numbers as JSON, with numpy's percentiles.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kvlm::app::bench {

using Clock = std::chrono::steady_clock;

inline double secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// numpy.percentile's default (linear interpolation between closest ranks).
inline double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p / 100.0 * double(v.size() - 1);
  const size_t lo = size_t(std::floor(idx)), hi = size_t(std::ceil(idx));
  return v[lo] + (v[hi] - v[lo]) * (idx - double(lo));
}

inline double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / double(v.size());
}

inline void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) throw Error("cannot write --json '" + path + "'");
  out << j.dump(2) << "\n";
  if (!out) throw Error("cannot write --json '" + path + "'");
}

inline void row(const char* label, const std::string& value) { std::printf("%-40s %s\n", label, value.c_str()); }
inline void rowd(const char* label, double v, int prec = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  row(label, buf);
}
inline void rowi(const char* label, int64_t v) { row(label, std::to_string(v)); }
inline void rule(const char* title, char fill = '-') {
  const std::string t = title;
  const int width = 50;
  const int pad = std::max(0, width - int(t.size()));
  std::printf("%s%s%s\n", std::string(size_t(pad / 2), fill).c_str(), t.c_str(), std::string(size_t(pad - pad / 2), fill).c_str());
}

// Mean, median, p90 and p99 of `ms` (milliseconds) with the count, as --json writes them.
inline nlohmann::json percentile_json(const std::vector<double>& ms) {
  return {{"mean_ms", mean(ms)}, {"median_ms", percentile(ms, 50)}, {"p90_ms", percentile(ms, 90)},
          {"p99_ms", percentile(ms, 99)}, {"count", ms.size()}};
}

}  // namespace kvlm::app::bench

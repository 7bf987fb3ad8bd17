// Small helpers for what the engine reports: byte counts and elapsed times.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace kvlm {

// "1.50 GiB", "12.0 MiB", "512 KiB".
inline std::string human_bytes(uint64_t b) {
  constexpr uint64_t kGiB = 1ull << 30, kMiB = 1ull << 20;
  char buf[64];
  if (b >= kGiB) std::snprintf(buf, sizeof buf, "%.2f GiB", double(b) / double(kGiB));
  else if (b >= kMiB) std::snprintf(buf, sizeof buf, "%.1f MiB", double(b) / double(kMiB));
  else std::snprintf(buf, sizeof buf, "%llu KiB", (unsigned long long)(b / 1024));
  return buf;
}

inline double seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }
inline double seconds_since(std::chrono::steady_clock::time_point t0) { return seconds(std::chrono::steady_clock::now() - t0); }

}  // namespace kvlm

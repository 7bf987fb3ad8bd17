#include "core/log.h"

#include <unistd.h>

#include <cstdio>
#include <mutex>
#include <set>

namespace kvlm::log {

namespace {
Level g_level = Level::Warn;
std::mutex g_mu;
std::set<std::string, std::less<>> g_seen;

void emit(const char* prefix, std::string_view msg) {
  std::lock_guard lock(g_mu);
  std::fprintf(stderr, "%s%.*s\n", prefix, int(msg.size()), msg.data());
}
}  // namespace

void set_level(Level l) { g_level = l; }
Level level() { return g_level; }

void info(std::string_view msg) {
  if (g_level >= Level::Info) emit("kvlm: ", msg);
}

void warn(std::string_view msg) {
  if (g_level >= Level::Warn) emit("kvlm: warning: ", msg);
}

void error(std::string_view msg) { emit("kvlm: error: ", msg); }

void warn_once(std::string_view key, std::string_view msg) {
  {
    std::lock_guard lock(g_mu);
    if (!g_seen.emplace(key).second) return;
  }
  warn(msg);
}

Progress::Progress(std::string label, size_t total, Unit unit)
    : label_(std::move(label)), total_(total), unit_(unit), active_(total > 0 && g_level >= Level::Warn && ::isatty(2)) {}

void Progress::update(size_t done) {
  if (!active_) return;
  const size_t percent = done >= total_ ? 100 : done * 100 / total_;
  if (percent == last_percent_) return;
  last_percent_ = percent;
  std::lock_guard lock(g_mu);
  if (unit_ == Unit::Bytes)
    std::fprintf(stderr, "\rkvlm: %s %.2f / %.2f GB (%zu%%)%s", label_.c_str(), double(done) / 1e9, double(total_) / 1e9,
                 percent, percent == 100 ? "\n" : "");
  else
    std::fprintf(stderr, "\rkvlm: %s %zu / %zu (%zu%%)%s", label_.c_str(), done, total_, percent, percent == 100 ? "\n" : "");
  std::fflush(stderr);
}

Progress::~Progress() {
  if (active_ && last_percent_ != 100 && last_percent_ != size_t(-1)) std::fputs("\n", stderr);
}

}  // namespace kvlm::log

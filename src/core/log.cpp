#include "core/log.h"

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

void warn_once(std::string_view key, std::string_view msg) {
  {
    std::lock_guard lock(g_mu);
    if (!g_seen.emplace(key).second) return;
  }
  warn(msg);
}

}  // namespace kvlm::log

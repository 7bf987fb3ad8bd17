// Diagnostics on stderr. Warnings with a key are printed once per process, so a condition
// that holds for every layer (say, missing KV scales) is reported once, not 32 times.
#pragma once

#include <string>
#include <string_view>

namespace kvlm::log {

enum class Level { Quiet, Warn, Info, Debug };

void set_level(Level level);
Level level();
void info(std::string_view msg);
void warn(std::string_view msg);
// Always printed, whatever the level: an error is never hidden.
void error(std::string_view msg);
void warn_once(std::string_view key, std::string_view msg);

// A one-line progress display on stderr ("label 1.2 / 15.3 GB (8%)"), redrawn in place,
// only when stderr is a terminal and warnings are on. done == total ends the line.
class Progress {
 public:
  enum class Unit { Bytes, Items };  // "1.20 / 16.38 GB" or "120 / 1000"
  Progress(std::string label, size_t total, Unit unit = Unit::Bytes);
  void update(size_t done);
  ~Progress();

 private:
  std::string label_;
  size_t total_, last_percent_ = size_t(-1);
  Unit unit_;
  bool active_;
};

}  // namespace kvlm::log

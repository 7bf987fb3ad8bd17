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
void warn_once(std::string_view key, std::string_view msg);

}  // namespace kvlm::log

#include "core/error.h"

namespace kvlm {

void fail_check(const char* expr, const std::string& msg, const char* file, int line) {
  throw Error("internal error: check `" + std::string(expr) + "` failed at " + file + ":" + std::to_string(line) +
              (msg.empty() ? "" : ": " + msg));
}

}  // namespace kvlm

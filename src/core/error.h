// Errors and invariant checks.
//
// kvlm::Error carries a message written for the person who has to act on it (a CLI user,
// an HTTP client, whoever supplied a model directory). It is thrown for bad input and
// caught at the boundary (CLI main, request handler), never left to terminate the process.
// KVLM_CHECK is for internal invariants: its message names the source location too.
#pragma once

#include <stdexcept>
#include <string>

namespace kvlm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

[[noreturn]] void fail_check(const char* expr, const std::string& msg, const char* file, int line);

}  // namespace kvlm

// Internal invariant: a failure here is a kvlm bug, reported with file:line.
#define KVLM_CHECK(cond, msg)                            \
  do {                                                   \
    if (!(cond)) ::kvlm::fail_check(#cond, (msg), __FILE__, __LINE__); \
  } while (0)

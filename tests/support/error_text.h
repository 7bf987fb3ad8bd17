// The message of the kvlm::Error a call throws ("" when it throws none): tests check that an
// error names what to do, not only that one is thrown.
#pragma once

#include <functional>
#include <string>

#include "core/error.h"

namespace kvlm::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace kvlm::test

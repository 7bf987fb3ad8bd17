// What the request-parsing tests share: a model's serving facts, JSON from text, and the
// ApiError a parse raises.
#pragma once

#include <string>

#include "server/protocol.h"

namespace kvlm::server::testing {

inline ModelInfo info() {
  ModelInfo m;
  m.name = "tiny";
  m.max_model_len = 100;
  m.vocab_size = 1024;
  m.has_tokenizer = true;
  m.has_chat_template = true;
  return m;
}

inline Json J(const std::string& s) { return Json::parse(s); }

// The ApiError a parse raises (status, param), or status 0 when it parses.
struct Outcome {
  int status = 0;
  std::string param, message, code;
};
template <class F>
Outcome outcome(F&& f) {
  try {
    f();
  } catch (const ApiError& e) {
    return {e.status(), e.param(), e.what(), e.code()};
  }
  return {};
}

}  // namespace kvlm::server::testing

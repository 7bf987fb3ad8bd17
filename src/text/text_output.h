// The text a stream of generated tokens shows, as every front end streams it — the server's
// RequestStream, `kvlm generate`, `kvlm chat` and `kvlm eval`'s tasks: incremental
// detokenization (IncrementalDecoder: pieces that add up to the one-shot decode) and stop
// strings (StopMatcher: text that could begin one is held back; the stop string and anything
// after it are never shown).
#pragma once

#include <string>
#include <vector>

#include "text/stop.h"
#include "text/tokenizer/tokenizer.h"

namespace kvlm {

class TextOutput {
 public:
  TextOutput(const Tokenizer& tok, std::vector<std::string> stop, bool skip_special_tokens = true)
      : dec_(tok, skip_special_tokens), stops_(std::move(stop)) {}
  // The next token: the text safe to show now ("" once a stop string has matched).
  std::string push(TokenId t) { return stops_.stopped() ? std::string() : stops_.feed(dec_.push(t)); }
  // The end of the tokens: what the decoder and the matcher still hold (a stop string may
  // still complete in it; nothing after a stop).
  std::string finish() {
    if (stops_.stopped()) return {};
    std::string out = stops_.feed(dec_.flush());
    if (!stops_.stopped()) out += stops_.flush();
    return out;
  }
  bool stopped() const { return stops_.stopped(); }
  const std::string& matched() const { return stops_.matched(); }  // the stop string that matched

 private:
  IncrementalDecoder dec_;
  StopMatcher stops_;
};

}  // namespace kvlm

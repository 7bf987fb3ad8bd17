// Stop strings over streamed text: text is released only when it cannot be the start of a
// stop string, so a stop string is never emitted, not even in part.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kvlm {

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  // Feeds the next decoded piece. Returns the text that is safe to emit now; once a stop
  // string completes, returns the text before it and stopped() becomes true.
  std::string feed(std::string_view piece);
  // End of generation without a stop string: the held-back tail.
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace kvlm

#include "text/stop.h"

#include <algorithm>

#include "text/tokenizer/unicode.h"

namespace kvlm {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  std::erase_if(stops_, [](const std::string& s) { return s.empty(); });
}

std::string StopMatcher::feed(std::string_view piece) {
  if (stopped_) return "";
  held_ += piece;
  // Earliest complete stop string wins.
  size_t first = std::string::npos;
  for (const auto& s : stops_) {
    const size_t p = held_.find(s);
    if (p < first) {
      first = p;
      matched_ = s;
    }
  }
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, first);
    held_.clear();
    return out;
  }
  // Hold back the longest suffix that is a proper prefix of some stop string.
  size_t keep = 0;
  for (const auto& s : stops_)
    for (size_t k = std::min(s.size() - 1, held_.size()); k > keep; --k)
      if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  // Never split a UTF-8 character between the emitted part and the held part.
  size_t cut = held_.size() - keep;
  while (cut > 0 && cut < held_.size() && (static_cast<uint8_t>(held_[cut]) & 0xC0) == 0x80) --cut;
  std::string out = held_.substr(0, cut);
  held_.erase(0, cut);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  out.swap(held_);
  return stopped_ ? std::string() : out;
}

}  // namespace kvlm

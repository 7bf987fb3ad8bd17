// A compiled PCRE2 regular expression (UTF + Unicode properties, JIT when available),
// for the Split pre-tokenizers of tokenizer.json.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kvlm {

class Regex {
 public:
  // Throws kvlm::Error with PCRE2's message and offset when the pattern does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // Byte ranges [begin, end) of the non-overlapping matches in `text`, left to right.
  // Empty matches are skipped (as the Rust regex engines' find_iter yields them but HF's
  // Split ignores them).
  std::vector<std::pair<size_t, size_t>> find_all(std::string_view text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Impl;
  std::string pattern_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm

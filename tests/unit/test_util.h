// Helpers shared by the unit tests.
#pragma once

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "offline/generate.h"

namespace kvlm::test {

// `got` follows `want` token for token until the reference's top two are within `margin` (a
// near tie the other arithmetic may break the other way); log-probabilities agree within `tol`
// up to there.
inline void expect_greedy_until_near_tie(const GenerateResult& got, const GenerateResult& want, double margin, double tol,
                                  const std::string& what) {
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < want.logprobs.size(); ++i) {
    if (got.tokens[i] != want.tokens[i]) {
      const auto& top = want.logprobs[i].top;
      ASSERT_GE(top.size(), 2u);
      EXPECT_LT(top[0].second - top[1].second, margin) << what << " changed token " << i << " at a clear margin";
      return;
    }
    EXPECT_NEAR(got.logprobs[i].logprob, want.logprobs[i].logprob, tol) << what << ", token " << i;
  }
}


// A fresh directory under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("kvlm-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& s) const { return path_ / s; }

 private:
  std::filesystem::path path_;
};

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Expects `fn` to throw kvlm::Error whose message contains `needle`.
#define EXPECT_ERROR_CONTAINS(stmt, needle)                                                        \
  do {                                                                                             \
    try {                                                                                          \
      stmt;                                                                                        \
      ADD_FAILURE() << "expected an error containing: " << (needle);                               \
    } catch (const ::kvlm::Error& e) {                                                             \
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what(); \
    }                                                                                              \
  } while (0)

}  // namespace kvlm::test

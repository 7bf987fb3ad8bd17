#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "engine/sampler.h"
#include "engine/stop.h"

using namespace kvlm;

TEST(Sampler, GreedyAndTies) {
  const std::vector<float> l{0.1f, 2.0f, 2.0f, -1.0f};
  EXPECT_EQ(argmax(l), 1);  // lowest id among ties
  Sampler s(1);
  EXPECT_EQ(s.sample(l, {.temperature = 0.0f}), 1);
  EXPECT_EQ(s.sample(l, {.temperature = 1.0f, .top_k = 1}), 1);
  EXPECT_EQ(s.sample(std::vector<float>{0, 5, 0}, {.temperature = 1.0f, .top_p = 0.01f}), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(float(i)) * 2;
  auto run = [&](uint64_t seed) {
    Sampler s(seed);
    std::vector<TokenId> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.sample(l, {.temperature = 0.9f, .top_k = 20, .top_p = 0.95f}));
    return out;
  };
  EXPECT_EQ(run(42), run(42));
  EXPECT_NE(run(42), run(43));
}

TEST(Sampler, FrequenciesFollowSoftmax) {
  const std::vector<float> l{0.0f, 1.0f, 2.0f};
  Sampler s(7);
  std::map<TokenId, int> n;
  const int N = 60000;
  for (int i = 0; i < N; ++i) ++n[s.sample(l, {.temperature = 1.0f})];
  const double z = 1 + std::exp(1.0) + std::exp(2.0);
  for (int t = 0; t < 3; ++t) EXPECT_NEAR(double(n[t]) / N, std::exp(double(t)) / z, 0.01) << t;
  // Temperature 0.5 sharpens: p ~ exp(2 * logit).
  n.clear();
  for (int i = 0; i < N; ++i) ++n[s.sample(l, {.temperature = 0.5f})];
  const double z2 = 1 + std::exp(2.0) + std::exp(4.0);
  EXPECT_NEAR(double(n[2]) / N, std::exp(4.0) / z2, 0.01);
  // top_k = 2 removes token 0; top_p = 0.6 keeps only token 2 (its mass alone, 0.665, reaches 0.6).
  n.clear();
  for (int i = 0; i < 5000; ++i) ++n[s.sample(l, {.temperature = 1.0f, .top_k = 2})];
  EXPECT_EQ(n[0], 0);
  n.clear();
  for (int i = 0; i < 5000; ++i) ++n[s.sample(l, {.temperature = 1.0f, .top_p = 0.6f})];
  EXPECT_EQ(n[0] + n[1], 0);
}

TEST(Sampler, Logprobs) {
  const std::vector<float> l{1.0f, 3.0f, 2.0f};
  const double lse = std::log(std::exp(1.0) + std::exp(3.0) + std::exp(2.0));
  EXPECT_NEAR(logprob_of(l, 0), 1.0 - lse, 1e-6);
  const auto top = top_logprobs(l, 2);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].first, 1);
  EXPECT_EQ(top[1].first, 2);
  EXPECT_NEAR(top[0].second, 3.0 - lse, 1e-6);
  EXPECT_EQ(top_logprobs(l, 10).size(), 3u);
}

TEST(Sampler, Validation) {
  EXPECT_THROW(validate_sampling({.temperature = -1}), Error);
  EXPECT_THROW(validate_sampling({.temperature = NAN}), Error);
  EXPECT_THROW(validate_sampling({.top_k = -2}), Error);
  EXPECT_THROW(validate_sampling({.top_p = 0}), Error);
  EXPECT_THROW(validate_sampling({.top_p = 1.5f}), Error);
  EXPECT_NO_THROW(validate_sampling({.temperature = 0, .top_k = -1, .top_p = 1}));
}

TEST(Sampler, MinPAndPenalties) {
  Sampler s(3);
  // p = softmax(0, 1, 2, 2.1): min_p 0.5 keeps tokens with p >= 0.5 * p_max -> {3, 2}.
  const std::vector<float> l{0.0f, 1.0f, 2.0f, 2.1f};
  for (int i = 0; i < 2000; ++i) {
    const TokenId t = s.sample(l, {.temperature = 1.0f, .min_p = 0.5f});
    ASSERT_TRUE(t == 2 || t == 3) << t;
  }
  // Repetition penalty divides positive logits and multiplies negative ones of seen tokens.
  std::vector<float> r{2.0f, -2.0f, 1.0f};
  apply_penalties(r, {.repetition_penalty = 2.0f}, std::vector<TokenId>{0}, std::vector<TokenId>{1});
  EXPECT_EQ(r, (std::vector<float>{1.0f, -4.0f, 1.0f}));
  // Presence and frequency penalties count output tokens only.
  std::vector<float> f{1.0f, 1.0f, 1.0f};
  apply_penalties(f, {.presence_penalty = 0.5f, .frequency_penalty = 0.25f}, std::vector<TokenId>{2}, std::vector<TokenId>{0, 0, 1});
  EXPECT_EQ(f, (std::vector<float>{1.0f - 0.5f - 0.5f, 1.0f - 0.5f - 0.25f, 1.0f}));
  // Greedy follows the penalized logits.
  EXPECT_EQ(s.sample(std::vector<float>{3.0f, 2.9f}, {.temperature = 0, .repetition_penalty = 1.5f}, {}, std::vector<TokenId>{0}), 1);
  EXPECT_THROW(validate_sampling({.min_p = 1.5f}), Error);
  EXPECT_THROW(validate_sampling({.repetition_penalty = 0.0f}), Error);
  EXPECT_THROW(validate_sampling({.presence_penalty = 3.0f}), Error);
}

TEST(StopMatcher, NeverEmitsAStopString) {
  StopMatcher m({"</end>", "\n\n"});
  std::string out;
  for (std::string_view p : {"Hello", " wor", "ld</", "e", "nd> more"}) out += m.feed(p);
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "</end>");
  EXPECT_EQ(out, "Hello world");
  StopMatcher n({"xyz"});
  EXPECT_EQ(n.feed("abcx"), "abc");  // "x" may start "xyz": held
  EXPECT_EQ(n.feed("y"), "");
  EXPECT_EQ(n.feed("q"), "xyq");     // not a stop after all
  EXPECT_EQ(n.feed("x"), "");
  EXPECT_EQ(n.flush(), "x");
  EXPECT_FALSE(n.stopped());
  StopMatcher u({"\xC3\xA9!"});  // never splits a multi-byte character
  EXPECT_EQ(u.feed("caf\xC3\xA9"), "caf");
  EXPECT_EQ(u.feed("?"), "\xC3\xA9?");
}

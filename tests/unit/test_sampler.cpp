#include <gtest/gtest.h>

#include <random>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/error.h"
#include "core/philox.h"
#include "sampling/sampler.h"
#include "text/stop.h"

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

// Large vocabularies: masked (-inf) tokens are never drawn, and top-p is exact when its
// nucleus is larger than the sorted head (10,000 equal logits, top_p 0.5: the 5,000 lowest
// ids, ties broken by id), with min-p on the unsorted path too.
TEST(Sampler, LargeVocabulariesMasksAndWideNuclei) {
  std::vector<float> l(20000, 0.0f);
  for (size_t i = 10000; i < l.size(); ++i) l[i] = -std::numeric_limits<float>::infinity();
  Sampler s(5);
  std::set<TokenId> seen;
  for (int i = 0; i < 3000; ++i) {
    const TokenId t = s.sample(l, {.temperature = 1.0f, .top_p = 0.5f});
    ASSERT_LE(t, 5000);  // 5,000 tokens, or 5,001 where the float sum of 5,000 x 1e-4 falls short of 0.5
    seen.insert(t);
  }
  EXPECT_GT(seen.size(), 2000u);  // spread over the nucleus (3,000 draws of 5,000: ~2,250 distinct)
  for (int i = 0; i < 2000; ++i) ASSERT_LT(s.sample(l, {.temperature = 0.7f}), 10000);
  std::vector<float> m(150000, -5.0f);
  m[77] = 0.0f;
  m[140001] = -0.5f;
  for (int i = 0; i < 100; ++i) {
    const TokenId t = s.sample(m, {.temperature = 1.0f, .min_p = 0.5f});  // keeps 77 (1) and 140001 (0.61)
    ASSERT_TRUE(t == 77 || t == 140001) << t;
  }
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

// Philox4x32-10 known-answer vectors (Random123's kat_vectors).
TEST(Philox, KnownAnswers) {
  auto run = [](rng::U32x4 c, uint32_t k0, uint32_t k1) {
    const rng::U32x4 r = rng::philox4x32_10(c, k0, k1);
    return std::vector<uint32_t>(r.v, r.v + 4);
  };
  EXPECT_EQ(run({{0, 0, 0, 0}}, 0, 0), (std::vector<uint32_t>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(run({{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, 0xffffffff, 0xffffffff),
            (std::vector<uint32_t>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(run({{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, 0xa4093822, 0x299f31d0),
            (std::vector<uint32_t>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(Philox, GumbelNoiseIsFiniteAndHasTheRightMean) {
  // Mean of Gumbel(0, 1) is the Euler-Mascheroni constant; extremes stay finite.
  EXPECT_TRUE(std::isfinite(rng::gumbel_noise(0)));
  EXPECT_TRUE(std::isfinite(rng::gumbel_noise(0xffffffffu)));
  EXPECT_GT(rng::gumbel_noise(0xffffffffu), 20.0f);
  EXPECT_LT(rng::gumbel_noise(0), -3.0f);
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) sum += rng::gumbel_noise(rng::random_u32(7, 0, uint32_t(i)));
  EXPECT_NEAR(sum / n, 0.5772156649, 0.01);
}

namespace {

// The distribution sample_gumbel draws from, by brute force over the definition in
// sampler.h (top-k keeps ties, thresholds in value order), in double.
std::vector<double> gumbel_distribution(const std::vector<float>& l, const SamplingParams& p) {
  const GumbelParams g = gumbel_params(p);
  const float m = *std::ranges::max_element(l);
  float lo = -INFINITY;
  if (p.min_p > 0) lo = m + g.min_p_offset;
  auto kept = [&] {
    std::vector<float> k;
    for (float x : l)
      if (x >= lo) k.push_back(x);
    std::ranges::sort(k, std::greater<>());
    return k;
  };
  if (p.top_k > 0 && size_t(p.top_k) < l.size() && kept().size() > size_t(p.top_k)) lo = kept()[size_t(p.top_k) - 1];
  if (p.top_p < 1) {
    const auto k = kept();
    double z = 0;
    for (float x : k) z += std::exp(double(x - m) / p.temperature);
    double acc = 0;
    for (size_t i = 0; i < k.size(); ++i) {
      acc += std::exp(double(k[i] - m) / p.temperature);
      if ((i + 1 == k.size() || k[i + 1] != k[i]) && acc >= p.top_p * z) {
        lo = k[i];
        break;
      }
    }
  }
  std::vector<double> prob(l.size(), 0.0);
  double z = 0;
  for (size_t i = 0; i < l.size(); ++i)
    if (l[i] >= lo) z += prob[i] = std::exp(double(l[i] - m) / p.temperature);
  for (double& x : prob) x /= z;
  return prob;
}

}  // namespace

TEST(GumbelSampler, GreedyAndSingleCandidate) {
  const std::vector<float> l{0.1f, 2.0f, 2.0f, -1.0f, 1.9f};
  EXPECT_EQ(sample_gumbel(l, {.temperature = 0.0f}, 1, 0), 1);
  for (uint64_t c = 0; c < 50; ++c) {
    // min_p = 1 keeps the two tokens tied at the max; top_p tiny keeps the tied top group.
    const TokenId t = sample_gumbel(l, {.temperature = 1.0f, .min_p = 1.0f}, 3, c);
    EXPECT_TRUE(t == 1 || t == 2) << t;
    const TokenId u = sample_gumbel(std::vector<float>{0, 5, 0, 4.9f}, {.temperature = 1.0f, .top_p = 0.01f}, 3, c);
    EXPECT_EQ(u, 1);
    EXPECT_EQ(sample_gumbel(std::vector<float>{0, 5, 1, 4.9f}, {.temperature = 2.0f, .top_k = 1}, 3, c), 1);
  }
  EXPECT_THROW(sample_gumbel(l, {.temperature = 1.0f, .repetition_penalty = 1.2f}, 1, 0), std::exception);
}

// sample_gumbel passes over tokens whose score cannot reach the best even with their bits'
// largest noise, and splits a large row over threads: the token is exactly that of the plain
// scan (every kept token's score, the largest, ties to the lowest id) — on wide and narrow
// logit ranges, coarse values with ties, masked rows, and every threshold kind.
TEST(GumbelSampler, SkippingTokensChangesNothing) {
  std::mt19937 rng(17);
  const std::vector<SamplingParams> cases{{.temperature = 1.0f},       {.temperature = 0.3f},
                                          {.temperature = 2.0f, .top_k = 40}, {.temperature = 0.8f, .top_p = 0.9f},
                                          {.temperature = 1.0f, .min_p = 0.02f}};
  int checked = 0;
  for (const size_t v : {size_t(5), size_t(1000), size_t(40000), size_t(151936)}) {
    for (int r = 0; r < 8; ++r) {
      std::normal_distribution<float> nd(0.0f, r % 2 ? 8.0f : 1.0f);  // wide (a trained model's) and narrow ranges
      std::vector<float> l(v);
      for (float& x : l) x = nd(rng);
      if (r % 4 == 2)
        for (float& x : l) x = std::round(x);  // ties
      if (r % 4 == 3)  // a grammar's mask: most tokens at -inf
        for (size_t i = 0; i < v; ++i)
          if (i % 7 != 3) l[i] = -INFINITY;
      for (const SamplingParams& p : cases) {
        const GumbelParams g = gumbel_params(p);
        // The plain scan over the kept set sample_gumbel computes (its thresholds are tested
        // above); only the scan's shortcut is under test here.
        float lo = -INFINITY;
        const float m = *std::ranges::max_element(l);
        if (p.min_p > 0) lo = m + g.min_p_offset;
        std::vector<float> k;
        for (float x : l)
          if (x >= lo) k.push_back(x);
        std::ranges::sort(k, std::greater<>());
        if (p.top_k > 0 && k.size() > size_t(p.top_k)) lo = k[size_t(p.top_k) - 1];
        if (p.top_p < 1) {
          uint64_t z = 0, acc = 0;
          for (float x : k) z += gumbel_fixed_weight(x, m, g.inv_temperature);
          for (size_t i = 0; i < k.size();) {
            size_t j = i;
            while (j < k.size() && k[j] == k[i]) acc += gumbel_fixed_weight(k[j++], m, g.inv_temperature);
            if (double(acc) >= double(p.top_p) * double(z)) {
              lo = k[i];
              break;
            }
            i = j;
          }
        }
        const uint64_t seed = rng(), counter = rng() % 1000;
        float best = -INFINITY;
        size_t want = v;
        for (size_t i = 0; i < v; ++i) {
          if (!(l[i] >= lo)) continue;
          const float score = l[i] * g.inv_temperature + rng::gumbel_noise(rng::random_u32(seed, counter, uint32_t(i)));
          if (score > best || (score == best && i < want)) {
            best = score;
            want = i;
          }
        }
        ASSERT_EQ(sample_gumbel(l, p, seed, counter), TokenId(want)) << "vocab " << v << " row " << r << " T " << p.temperature;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * 8 * 5);
}

TEST(GumbelSampler, CounterBasedAndReproducible) {
  std::vector<float> l(1000);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(float(i) * 0.37f) * 3;
  const SamplingParams p{.temperature = 1.0f};
  std::vector<TokenId> a, b;
  for (uint64_t c = 0; c < 100; ++c) a.push_back(sample_gumbel(l, p, 42, c));
  for (uint64_t c = 0; c < 100; ++c) b.push_back(sample_gumbel(l, p, 42, c));
  EXPECT_EQ(a, b);
  std::map<TokenId, int> distinct;
  for (TokenId t : a) ++distinct[t];
  EXPECT_GT(distinct.size(), 30u);  // a flat-ish distribution over 1000 tokens
  std::vector<TokenId> other;
  for (uint64_t c = 0; c < 100; ++c) other.push_back(sample_gumbel(l, p, 43, c));
  EXPECT_NE(a, other);
}

// Frequencies over many counters follow the kept set's softmax (chi-square, fixed seeds: the
// test is deterministic), for every filter alone and combined.
TEST(GumbelSampler, FrequenciesFollowTheKeptSoftmax) {
  const std::vector<float> l{1.5f, 0.2f, -0.7f, 2.4f, 0.9f, 0.9f, -2.0f, 1.1f, 0.0f, -0.3f};
  const std::vector<SamplingParams> cases{
      {.temperature = 1.0f},
      {.temperature = 0.6f},
      {.temperature = 1.7f, .top_k = 4},
      {.temperature = 1.0f, .top_k = 5},  // the 5th and 6th are tied at 0.9: both kept
      {.temperature = 1.0f, .top_p = 0.8f},
      {.temperature = 0.8f, .min_p = 0.2f},
      {.temperature = 1.3f, .top_k = 6, .top_p = 0.9f, .min_p = 0.05f},
  };
  const int n = 40000;
  for (const SamplingParams& p : cases) {
    const std::vector<double> prob = gumbel_distribution(l, p);
    std::vector<int> count(l.size(), 0);
    for (int c = 0; c < n; ++c) ++count[size_t(sample_gumbel(l, p, 2024, uint64_t(c)))];
    double chi2 = 0;
    int dof = -1;
    for (size_t i = 0; i < l.size(); ++i) {
      if (prob[i] == 0) {
        EXPECT_EQ(count[i], 0) << "token " << i << " outside the kept set was drawn (T=" << p.temperature
                               << " k=" << p.top_k << " p=" << p.top_p << " min_p=" << p.min_p << ")";
        continue;
      }
      const double e = prob[i] * n;
      chi2 += (count[i] - e) * (count[i] - e) / e;
      ++dof;
    }
    // 99.9th percentile of chi-square with <= 9 degrees of freedom is 27.9.
    EXPECT_LT(chi2, 27.9) << "dof " << dof << " (T=" << p.temperature << " k=" << p.top_k << " p=" << p.top_p
                          << " min_p=" << p.min_p << ")";
  }
}

// Where no ties and no near-boundary tokens make them differ, the kept sets of sample_gumbel
// and the host Sampler are the same: Sampler's frequencies over the same cases agree.
TEST(GumbelSampler, KeepsWhatTheHostSamplerKeepsWithoutTies) {
  const std::vector<float> l{1.5f, 0.2f, -0.7f, 2.4f, 0.95f, 0.9f, -2.0f, 1.1f, 0.0f, -0.3f};
  const std::vector<SamplingParams> cases{{.temperature = 1.0f, .top_k = 3},
                                          {.temperature = 1.0f, .top_p = 0.7f},
                                          {.temperature = 0.9f, .min_p = 0.3f},
                                          {.temperature = 1.2f, .top_k = 5, .top_p = 0.85f}};
  for (const SamplingParams& p : cases) {
    const std::vector<double> prob = gumbel_distribution(l, p);
    std::set<TokenId> host_seen, gumbel_seen;
    Sampler s(5);
    for (int c = 0; c < 4000; ++c) {
      host_seen.insert(s.sample(l, p));
      gumbel_seen.insert(sample_gumbel(l, p, 5, uint64_t(c)));
    }
    EXPECT_EQ(host_seen, gumbel_seen);
    for (TokenId t : gumbel_seen) EXPECT_GT(prob[size_t(t)], 0.0);
  }
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

#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace kvlm {

void validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw Error("--temperature must be a finite number >= 0 (0 = greedy), got " + std::to_string(p.temperature));
  if (p.top_k < -1) throw Error("--top-k must be >= 1, or 0 / -1 to disable it, got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) throw Error("--top-p must be in (0, 1], got " + std::to_string(p.top_p));
}

TokenId argmax(std::span<const float> logits) {
  KVLM_CHECK(!logits.empty(), "empty logits");
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return TokenId(best);
}

namespace {
float log_sum_exp(std::span<const float> x) {
  const float m = *std::ranges::max_element(x);
  double s = 0.0;
  for (float v : x) s += std::exp(double(v) - m);
  return float(m + std::log(s));
}
}  // namespace

float logprob_of(std::span<const float> logits, TokenId token) {
  KVLM_CHECK(token >= 0 && size_t(token) < logits.size(), "token outside logits");
  return logits[size_t(token)] - log_sum_exp(logits);
}

std::vector<std::pair<TokenId, float>> top_logprobs(std::span<const float> logits, int k) {
  const float lse = log_sum_exp(logits);
  std::vector<std::pair<TokenId, float>> all;
  all.reserve(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) all.emplace_back(TokenId(i), logits[i] - lse);
  const size_t kk = std::min(all.size(), size_t(std::max(k, 0)));
  std::partial_sort(all.begin(), all.begin() + ptrdiff_t(kk), all.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  all.resize(kk);
  return all;
}

TokenId Sampler::sample(std::span<const float> logits, const SamplingParams& p) {
  if (p.temperature == 0.0f) return argmax(logits);
  // Candidates sorted by logit, descending (ties: lower id first, for determinism).
  scratch_.clear();
  for (size_t i = 0; i < logits.size(); ++i) scratch_.emplace_back(logits[i], TokenId(i));
  auto by_logit = [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  size_t n = scratch_.size();
  if (p.top_k > 0 && size_t(p.top_k) < n) {
    std::partial_sort(scratch_.begin(), scratch_.begin() + p.top_k, scratch_.end(), by_logit);
    n = size_t(p.top_k);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_logit);
  }
  // Softmax over the kept candidates at this temperature.
  const float m = scratch_[0].first;
  std::vector<double> prob(n);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(double(scratch_[i].first - m) / p.temperature);
  // Top-p: the smallest prefix whose mass reaches top_p.
  if (p.top_p < 1.0f) {
    double acc = 0.0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      acc += prob[i] / sum;
      if (acc >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += prob[i];
  }
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) {
    acc += prob[i];
    if (u < acc) return scratch_[i].second;
  }
  return scratch_[n - 1].second;
}

}  // namespace kvlm

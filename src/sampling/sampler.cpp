#include "sampling/sampler.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/host_threads.h"
#include "core/philox.h"

#ifdef _OPENMP
#include <omp.h>
#else
inline int omp_in_parallel() { return 0; }
#endif

namespace kvlm {

void validate_sampling(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature))
    throw Error("--temperature must be a finite number >= 0 (0 = greedy), got " + std::to_string(p.temperature));
  if (p.top_k < -1) throw Error("--top-k must be >= 1, or 0 / -1 to disable it, got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) throw Error("--top-p must be in (0, 1], got " + std::to_string(p.top_p));
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) throw Error("--min-p must be in [0, 1], got " + std::to_string(p.min_p));
  if (!(p.repetition_penalty > 0.0f) || !std::isfinite(p.repetition_penalty))
    throw Error("--repetition-penalty must be > 0 (1 = off), got " + std::to_string(p.repetition_penalty));
  if (!(p.presence_penalty >= -2.0f && p.presence_penalty <= 2.0f))
    throw Error("--presence-penalty must be in [-2, 2], got " + std::to_string(p.presence_penalty));
  if (!(p.frequency_penalty >= -2.0f && p.frequency_penalty <= 2.0f))
    throw Error("--frequency-penalty must be in [-2, 2], got " + std::to_string(p.frequency_penalty));
}

void apply_penalties(std::span<float> logits, const SamplingParams& p, std::span<const TokenId> prompt,
                     std::span<const TokenId> output) {
  const size_t v = logits.size();
  if (p.repetition_penalty != 1.0f) {
    std::vector<bool> seen(v, false);
    for (auto ids : {prompt, output})
      for (TokenId t : ids)
        if (t >= 0 && size_t(t) < v) seen[size_t(t)] = true;
    for (size_t i = 0; i < v; ++i)
      if (seen[i]) logits[i] = logits[i] > 0 ? logits[i] / p.repetition_penalty : logits[i] * p.repetition_penalty;
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::vector<int> count(v, 0);
    for (TokenId t : output)
      if (t >= 0 && size_t(t) < v) ++count[size_t(t)];
    for (size_t i = 0; i < v; ++i)
      if (count[i] > 0) logits[i] -= p.presence_penalty + p.frequency_penalty * float(count[i]);
  }
}

TokenId argmax(std::span<const float> logits) {
  KVLM_CHECK(!logits.empty(), "empty logits");
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return TokenId(best);
}

float log_sum_exp(std::span<const float> x) {
  const float m = *std::ranges::max_element(x);
  double s = 0.0;
  for (float v : x) s += std::exp(double(v) - m);
  return float(m + std::log(s));
}

float logprob_of(std::span<const float> logits, TokenId token) {
  KVLM_CHECK(token >= 0 && size_t(token) < logits.size(), "token outside logits");
  return logits[size_t(token)] - log_sum_exp(logits);
}

int rank_of(std::span<const float> logits, TokenId token) {
  const float v = logits[size_t(token)];
  int higher = 0;
  for (const float x : logits) higher += x > v;
  return higher + 1;
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

TokenId Sampler::sample(std::span<const float> raw, const SamplingParams& p, std::span<const TokenId> prompt,
                        std::span<const TokenId> output) {
  std::span<const float> logits = raw;
  if (p.has_penalties()) {
    penalized_.assign(raw.begin(), raw.end());
    apply_penalties(penalized_, p, prompt, output);
    logits = penalized_;
  }
  if (p.temperature == 0.0f) return argmax(logits);
  const float inv_t = 1.0f / p.temperature;
  if (!(p.top_k > 0) && !(p.top_p < 1.0f)) {
    // No order needed: the softmax and the draw straight over the row, in id order (what the
    // candidate list below would hold), without building it. Weights in float (exp of a
    // float is half the cost of a double's; the sum stays in double).
    float m = -std::numeric_limits<float>::infinity();
    for (float x : logits) m = std::max(m, x);
    if (m == -std::numeric_limits<float>::infinity()) return argmax(logits);
    prob_.resize(logits.size());
    double sum = 0.0;
    const double min_w = double(p.min_p);  // the most likely token has weight 1
    for (size_t i = 0; i < logits.size(); ++i) {
      const float w = std::exp((logits[i] - m) * inv_t);  // 0 for -inf
      prob_[i] = w >= min_w ? double(w) : 0.0;
      sum += prob_[i];
    }
    if (!(sum > 0.0) || !std::isfinite(sum)) return argmax(logits);  // +inf or NaN logits
    const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
    double acc = 0.0;
    size_t last = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (prob_[i] == 0.0) continue;
      acc += prob_[i];
      last = i;
      if (u < acc) return TokenId(i);
    }
    return TokenId(last);
  }
  // Candidates: the tokens with a finite logit (a grammar's mask or a -100 bias leaves
  // many out). Sorted by logit, descending (ties: lower id first, for determinism), only as
  // far as top-k or top-p need: a full sort of a 152k vocabulary costs ~10 ms a token, the
  // softmax and the draw over it well under one.
  scratch_.clear();
  for (size_t i = 0; i < logits.size(); ++i)
    if (logits[i] > -std::numeric_limits<float>::infinity()) scratch_.emplace_back(logits[i], TokenId(i));
  if (scratch_.empty()) return argmax(logits);
  auto by_logit = [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  size_t n = scratch_.size();
  bool sorted = false;
  if (p.top_k > 0 && size_t(p.top_k) < n) {
    std::partial_sort(scratch_.begin(), scratch_.begin() + p.top_k, scratch_.end(), by_logit);
    n = size_t(p.top_k);
    sorted = true;
  }
  float m = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) m = std::max(m, scratch_[i].first);
  const auto weight = [&](size_t i) { return double(std::exp((scratch_[i].first - m) * inv_t)); };
  if (p.top_p < 1.0f && !sorted) {
    // Top-p needs the most likely tokens in order until their mass reaches top_p: sort a
    // head first and all only when the head does not hold that mass.
    double total = 0.0;
    for (size_t i = 0; i < n; ++i) total += weight(i);
    size_t head = std::min(n, size_t(4096));
    std::partial_sort(scratch_.begin(), scratch_.begin() + ptrdiff_t(head), scratch_.begin() + ptrdiff_t(n), by_logit);
    double acc = 0.0;
    for (size_t i = 0; i < head; ++i) acc += weight(i);
    if (acc < double(p.top_p) * total) std::sort(scratch_.begin(), scratch_.begin() + ptrdiff_t(n), by_logit);
    sorted = true;
  }
  // Softmax over the kept candidates at this temperature (the max has weight 1).
  prob_.resize(n);
  double sum = 0.0;
  for (size_t i = 0; i < n; ++i) sum += prob_[i] = weight(i);
  // Min-p: drop tokens less likely than min_p times the most likely one.
  if (p.min_p > 0.0f) {
    size_t keep = 0;
    sum = 0.0;
    for (size_t i = 0; i < n; ++i)
      if (prob_[i] >= double(p.min_p)) {  // order kept: a sorted list stays sorted
        scratch_[keep] = scratch_[i];
        sum += prob_[keep++] = prob_[i];
      }
    n = keep;
  }
  // Top-p: the smallest prefix of the sorted candidates whose mass reaches top_p.
  if (p.top_p < 1.0f) {
    double acc = 0.0;
    size_t keep = n;
    for (size_t i = 0; i < n; ++i) {
      acc += prob_[i] / sum;
      if (acc >= p.top_p) {
        keep = i + 1;
        break;
      }
    }
    n = keep;
    sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += prob_[i];
  }
  const double u = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) {
    acc += prob_[i];
    if (u < acc) return scratch_[i].second;
  }
  return scratch_[n - 1].second;
}

GumbelParams gumbel_params(const SamplingParams& p) {
  GumbelParams g;
  g.inv_temperature = p.temperature == 0.0f ? 0.0f : 1.0f / p.temperature;
  g.top_k = std::max(p.top_k, 0);
  g.top_p = p.top_p;
  g.min_p_offset = p.min_p > 0.0f ? float(double(p.temperature) * std::log(double(p.min_p)))
                                  : -std::numeric_limits<float>::infinity();
  return g;
}

void apply_token_mask(std::span<float> logits, std::span<const uint64_t> words) {
  KVLM_CHECK(words.size() * 64 >= logits.size(), "a token mask shorter than the vocabulary");
  for (size_t t = 0; t < logits.size(); ++t)
    if (!((words[t / 64] >> (t % 64)) & 1)) logits[t] = -std::numeric_limits<float>::infinity();
}

TokenId sample_gumbel(std::span<const float> logits, const SamplingParams& p, uint64_t seed, uint64_t counter) {
  KVLM_CHECK(!logits.empty(), "empty logits");
  KVLM_CHECK(!p.has_penalties(), "sample_gumbel does not apply penalties");
  if (p.temperature == 0.0f) return argmax(logits);
  const GumbelParams g = gumbel_params(p);
  const size_t v = logits.size();
  float m = -std::numeric_limits<float>::infinity();
  for (float x : logits)
    if (x > m) m = x;
  // The kept set is {i : logits[i] >= lo} (NaN never kept).
  float lo = -std::numeric_limits<float>::infinity();
  if (g.min_p_offset > -std::numeric_limits<float>::infinity()) lo = m + g.min_p_offset;
  auto kept_sorted = [&] {
    std::vector<float> k;
    for (float x : logits)
      if (x >= lo) k.push_back(x);
    std::sort(k.begin(), k.end(), std::greater<>());
    return k;
  };
  if (g.top_k > 0 && size_t(g.top_k) < v) {
    const std::vector<float> k = kept_sorted();
    if (k.size() > size_t(g.top_k)) lo = k[size_t(g.top_k) - 1];
  }
  if (g.top_p < 1.0f) {
    const std::vector<float> k = kept_sorted();
    uint64_t z = 0;
    for (float x : k) z += gumbel_fixed_weight(x, m, g.inv_temperature);
    const double target = double(g.top_p) * double(z);
    // The largest value t with sum of weights over logits >= t reaching the target; tokens
    // tied at t are summed together.
    uint64_t acc = 0;
    for (size_t i = 0; i < k.size();) {
      size_t j = i;
      while (j < k.size() && k[j] == k[i]) acc += gumbel_fixed_weight(k[j++], m, g.inv_temperature);
      if (double(acc) >= target) {
        lo = k[i];
        break;
      }
      i = j;
    }
  }
  // Gumbel-max over the kept tokens. The noise is a non-decreasing function of its 32 random
  // bits, so a token whose score could not reach the best so far even with the largest noise
  // of its bits' top byte is passed over without its two logarithms; the bound carries a
  // margin far above float rounding, so the token drawn is exactly the full scan's (and the
  // GPU kernel's). Masked tokens (-inf) cannot win and cost nothing.
  static const std::array<float, 256> noise_bound = [] {
    std::array<float, 256> b{};
    for (uint32_t t = 0; t < 256; ++t) b[t] = rng::gumbel_noise((t << 24) | 0xFFFFFFu) + 1e-3f;
    return b;
  }();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  auto scan = [&](size_t begin, size_t end, float& best, size_t& idx) {
    for (size_t i = begin; i < end; ++i) {
      const float x = logits[i];
      if (!(x >= lo) || x == kNegInf) continue;
      const uint32_t bits = rng::random_u32(seed, counter, uint32_t(i));
      const float xs = x * g.inv_temperature;
      if (xs + noise_bound[bits >> 24] < best) continue;
      const float score = xs + rng::gumbel_noise(bits);
      if (score > best || (score == best && i < idx)) {
        best = score;
        idx = i;
      }
    }
  };
  // The most likely token first: its score is a bound most others cannot reach.
  const size_t top = size_t(argmax(logits));
  float best = kNegInf;
  size_t idx = v;
  scan(top, top + 1, best, idx);
  constexpr size_t kPiece = size_t(1) << 14;
  const auto pieces = int64_t((v + kPiece - 1) / kPiece);
  std::vector<std::pair<float, size_t>> found(size_t(pieces), {best, idx});
#pragma omp parallel for schedule(static) num_threads(host_threads::team()) if (pieces > 1 && !omp_in_parallel())
  for (int64_t k = 0; k < pieces; ++k) {
    auto& [b, i] = found[size_t(k)];
    scan(size_t(k) * kPiece, std::min(v, size_t(k + 1) * kPiece), b, i);
  }
  for (const auto& [b, i] : found)
    if (b > best || (b == best && i < idx)) {
      best = b;
      idx = i;
    }
  return TokenId(idx < v ? idx : argmax(logits));
}

}  // namespace kvlm

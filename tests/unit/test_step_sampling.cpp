// Sampling inside the serving engine's steps: rows a runner samples on its device beside rows
// whose logits come back to the host, and speculative steps (drafts verified row by row) that
// give exactly the plain outputs and keep the target distribution.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "config/speculative_config.h"
#include "core/error.h"
#include "engine/llm_engine.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "serve_test_util.h"

using namespace kvlm;
using namespace kvlm::testing;

namespace {

// With a runner that samples where the logits are, plain sampled requests draw their tokens
// there (the Gumbel sampler, reproducible from the seed and the token position), while rows
// with logprobs, penalties or prompt logprobs still come back to the host — in the same steps.
TEST(Scheduler, RunnerSideSamplingAndHostRowsShareSteps) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  DeviceSamplingRunner* runner = sample_on_device(*e);
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378, 324, 434, 412, 281, 266, 397};
  const SamplingParams sp{.temperature = 0.9f, .top_k = 40, .top_p = 0.95f};
  // The reference: teacher-forced logits of the sampled continuation, drawn by sample_gumbel.
  auto reference = [&](uint64_t seed, int n) {
    std::vector<TokenId> seq = prompt;
    const size_t vocab = size_t(e->config().vocab_size);
    for (int i = 0; i < n; ++i) {
      const std::vector<float> all = all_logits(*e, seq, 64);
      seq.push_back(sample_gumbel(std::span(all).last(vocab), sp, seed, uint64_t(i)));
    }
    return std::vector<TokenId>(seq.begin() + std::ptrdiff_t(prompt.size()), seq.end());
  };
  const int n = 12;
  // (before the LLMEngine: scoring reallocates the runner's KV pool)
  const std::vector<TokenId> greedy = one_at_a_time(*e, prompt, n);
  const std::vector<TokenId> ref11 = reference(11, n), ref12 = reference(12, n);
  runner->reset_counters();  // the references ran through it too
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 64,
                                   .enable_prefix_caching = true, .num_blocks = 48});
  for (uint64_t seed : {11u, 12u}) {
    auto r = make("s" + std::to_string(seed), prompt, n, out);
    r.sampling = sp;
    r.seed = seed;
    le.add_request(std::move(r));
  }
  auto greedy_lp = make("lp", prompt, n, out);
  greedy_lp.logprobs = 2;
  greedy_lp.prompt_logprobs = 1;
  le.add_request(std::move(greedy_lp));
  auto penalized = make("pen", prompt, n, out);
  penalized.sampling.repetition_penalty = 2.0f;
  le.add_request(std::move(penalized));
  run_to_end(le);

  EXPECT_EQ(out["s11"].tokens, ref11);
  EXPECT_EQ(out["s12"].tokens, ref12);
  EXPECT_NE(out["s11"].tokens, out["s12"].tokens);
  EXPECT_EQ(out["lp"].tokens, greedy);  // greedy, sampled on the host
  EXPECT_EQ(out["lp"].logprobs.size(), size_t(n));
  EXPECT_EQ(out["lp"].prompt_logprobs.size(), prompt.size() - 1);
  EXPECT_EQ(out["pen"].tokens.size(), size_t(n));
  // The penalty changed the greedy continuation (host Sampler with the penalty applied).
  EXPECT_NE(out["pen"].tokens, greedy);
  EXPECT_EQ(runner->device_rows, 2 * n);
  EXPECT_GE(runner->host_rows, 2 * n + int(prompt.size()) - 1);
  EXPECT_GT(runner->mixed_steps, 0);
  EXPECT_EQ(runner->plain_forwards, 0) << "the engine should use forward_sampled with such a runner";
  EXPECT_EQ(le.blocks().num_used(), 0);
  const EngineStats st = le.stats();
  EXPECT_GT(st.forward_seconds_total, 0.0);
  EXPECT_GE(st.sample_seconds_total, 0.0);
  EXPECT_GT(st.schedule_seconds_total, 0.0);
}

// min_tokens under runner-side sampling: the rows before min_tokens go to the runner with a
// mask that holds back EOS and the stop tokens (no host round trip), and the outputs are
// those of host sampling (greedy), or the draws sample_gumbel makes from the masked rows.
TEST(Scheduler, RunnerSideMasksHoldBackStopTokens) {
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378};
  const int n = 8, min_tokens = 3;
  std::map<std::string, Collected> host_out, dev_out;
  int masked_rows = 0;
  for (const bool device : {false, true}) {
    auto e = load(kStories, KVCacheDType::Auto, 8);
    const auto greedy = one_at_a_time(*e, prompt, n);
    DeviceSamplingRunner* runner = device ? sample_on_device(*e) : nullptr;
    auto& out = device ? dev_out : host_out;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 256,
                                     .enable_prefix_caching = true, .num_blocks = 64});
    auto g = make("greedy", prompt, n, out);
    g.stop_token_ids = {greedy[0], greedy[1]};
    g.min_tokens = min_tokens;
    auto sampled = make("sampled", prompt, n, out);
    sampled.sampling.temperature = 1.5f;
    sampled.seed = 21;
    sampled.stop_token_ids = {greedy[0]};
    sampled.min_tokens = n;  // never stops early
    le.add_request(std::move(g));
    le.add_request(std::move(sampled));
    run_to_end(le);
    ASSERT_GE(out["greedy"].tokens.size(), size_t(min_tokens));
    for (int i = 0; i < min_tokens; ++i) {
      EXPECT_NE(out["greedy"].tokens[size_t(i)], greedy[0]) << i;
      EXPECT_NE(out["greedy"].tokens[size_t(i)], greedy[1]) << i;
    }
    ASSERT_EQ(out["sampled"].tokens.size(), size_t(n));
    for (TokenId t : out["sampled"].tokens) EXPECT_NE(t, greedy[0]);
    if (runner) masked_rows = runner->masked_rows;
    EXPECT_EQ(le.blocks().num_used(), 0);
  }
  EXPECT_EQ(dev_out["greedy"].tokens, host_out["greedy"].tokens);
  EXPECT_EQ(masked_rows, min_tokens + n) << "every row before min_tokens, and only those, should carry a mask";
}

namespace {

// A drafter that knows where each prompt's continuation should go (`script`, by the prompt's
// first token) and proposes it, wrong on purpose at draft position 1 on every third call, so
// that verification both accepts and rejects.
class ScriptedProposer final : public DraftProposer {
 public:
  ScriptedProposer(std::map<TokenId, std::vector<TokenId>> script, int k, int vocab)
      : script_(std::move(script)), k_(k), vocab_(vocab) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override {
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = *seqs[i];
      const auto& cont = script_.at(s.tokens[0]);
      const int at = s.num_output();
      for (int j = 0; j < std::min(k_, max_draft[i]) && at + j < int(cont.size()); ++j)
        s.draft.push_back(cont[size_t(at + j)]);
      if (++calls % 3 == 0 && s.draft.size() > 1) s.draft[1] = (s.draft[1] + 1) % vocab_;
    }
  }
  int calls = 0;

 private:
  std::map<TokenId, std::vector<TokenId>> script_;
  int k_, vocab_;
};

}  // namespace

// A multi-token step per sequence: the draft rows run with the sequence's last token, each
// with its logits, and the verification keeps exactly the tokens plain decoding would have
// made — greedy and seeded sampling, host- and runner-side sampling, several sequences at
// once, with chunked prefill, a pool small enough to preempt, and the prefix cache on. The
// cache is the exact fp32 one: a verification step's rows go through GEMMs of another shape
// than one-row decode, and in a quantized cache such a last-bit difference can move a code
// across a rounding boundary, which would make exact token equality a test of luck.
TEST(Scheduler, SpeculativeStepsGiveThePlainOutputs) {
  for (const auto [device_sampling, exact] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
    SCOPED_TRACE(std::string(device_sampling ? "runner-side sampling" : "host sampling") +
                 (exact ? ", int4 with exact sink 2 / recent 6 tokens" : ""));
    auto e = exact ? load(kStories, KVCacheDType::Int4PerTokenHead, 8, 2, 6) : load(kStories, KVCacheDType::Auto, 8);
    if (device_sampling) sample_on_device(*e);
    std::mt19937 rng(3);
    const int vocab = e->config().vocab_size;
    std::vector<std::vector<TokenId>> prompts;
    for (int i = 0; i < 4; ++i) {
      auto p = random_prompt(rng, 9 + 7 * i, vocab);
      p[0] = TokenId(10 + i);  // the script's key
      prompts.push_back(p);
    }
    const SamplingParams sampled{.temperature = 0.8f, .top_k = 50};
    auto run = [&](std::unique_ptr<DraftProposer> proposer, int num_blocks, EngineStats* stats) {
      std::map<std::string, Collected> out;
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 24, .max_model_len = 96,
                                       .enable_prefix_caching = true, .num_blocks = num_blocks});
      if (proposer) le.set_proposer(std::move(proposer));
      for (size_t i = 0; i < prompts.size(); ++i) {
        auto r = make("r" + std::to_string(i), prompts[i], 20, out);
        if (i % 2 == 1) {
          r.sampling = sampled;
          r.seed = 100 + i;
        }
        if (i == 3) r.logprobs = 2;  // host rows in a runner-sampling engine
        le.add_request(std::move(r));
      }
      run_to_end(le);
      EXPECT_EQ(le.blocks().num_used(), 0);
      expect_exact_pages_released(le.blocks());
      if (stats) *stats = le.stats();
      std::vector<Collected> v;
      for (size_t i = 0; i < prompts.size(); ++i) v.push_back(out["r" + std::to_string(i)]);
      return v;
    };
    EngineStats plain_stats, spec_stats;
    const auto plain = run(nullptr, 64, &plain_stats);
    std::map<TokenId, std::vector<TokenId>> script;
    for (size_t i = 0; i < prompts.size(); ++i) script[prompts[i][0]] = plain[i].tokens;
    const auto spec = run(std::make_unique<ScriptedProposer>(script, 4, vocab), 64, &spec_stats);
    // A quantized cache makes the sampled requests (odd) a poor probe: a verification step
    // computes K/V in a batch of rows whose last bits differ from one row's, a code on a
    // rounding boundary flips, and a close draw of the sampler goes the other way (plain
    // int4 does the same without exact tokens). The greedy ones hold the exact bookkeeping
    // (rejected drafts trimmed, windows moved on, preemption) to the plain outputs.
    auto compared = [&](size_t i) { return !exact || i % 2 == 0; };
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (!compared(i)) continue;
      EXPECT_EQ(spec[i].tokens, plain[i].tokens) << "request " << i;
      EXPECT_EQ(spec[i].reason, plain[i].reason) << "request " << i;
      ASSERT_EQ(spec[i].logprobs.size(), plain[i].logprobs.size());
      for (size_t j = 0; j < spec[i].logprobs.size(); ++j)
        EXPECT_NEAR(spec[i].logprobs[j].logprob, plain[i].logprobs[j].logprob, 1e-4);
    }
    EXPECT_GT(spec_stats.spec_accepted_tokens_total, 0u);
    EXPECT_LT(spec_stats.spec_accepted_tokens_total, spec_stats.spec_draft_tokens_total) << "no draft was rejected";
    EXPECT_LT(spec_stats.steps_total, plain_stats.steps_total);
    EXPECT_EQ(spec_stats.generation_tokens_total, plain_stats.generation_tokens_total);
    // A pool that forces preemption: drafts give way first, outputs stay the same.
    const auto tight = run(std::make_unique<ScriptedProposer>(script, 4, vocab), 14, nullptr);
    for (size_t i = 0; i < prompts.size(); ++i)
      if (compared(i)) EXPECT_EQ(tight[i].tokens, plain[i].tokens) << "request " << i;
  }
}

namespace {

// Records how many sequences each propose() call saw, then drafts nothing.
class CountingProposer final : public DraftProposer {
 public:
  explicit CountingProposer(std::vector<size_t>& calls) : calls_(calls) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int>) override { calls_.push_back(seqs.size()); }

 private:
  std::vector<size_t>& calls_;
};

}  // namespace

// disable_by_batch_size (vLLM's key): while more sequences run than the limit, nothing is
// proposed; once the batch shrinks to it, drafting resumes.
TEST(Scheduler, DraftingPausesAboveTheBatchSizeLimit) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  std::mt19937 rng(5);
  const int vocab = e->config().vocab_size;
  for (const int limit : {0, 1, 2}) {
    std::vector<size_t> calls;
    std::map<std::string, Collected> out;
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 4, .max_num_batched_tokens = 64, .max_model_len = 96,
                                     .enable_prefix_caching = true, .num_blocks = 64});
    le.set_proposer(std::make_unique<CountingProposer>(calls), limit);
    for (int i = 0; i < 4; ++i) le.add_request(make("r" + std::to_string(i), random_prompt(rng, 6, vocab), 4 + 6 * i, out));
    run_to_end(le);
    ASSERT_FALSE(calls.empty()) << "limit " << limit;
    const size_t most = *std::ranges::max_element(calls);
    if (limit == 0) EXPECT_EQ(most, 4u) << "no limit: every decoding sequence is offered to the proposer";
    else EXPECT_LE(most, size_t(limit)) << "proposals while more than " << limit << " sequences ran";
  }
  const SpeculativeConfig c =
      parse_speculative_config(R"({"method":"ngram","num_speculative_tokens":3,"disable_by_batch_size":16})");
  EXPECT_EQ(c.disable_by_batch_size, 16);
}

namespace {

// Proposes one fixed token after the first output token (a deterministic drafter).
class FixedDraft final : public DraftProposer {
 public:
  explicit FixedDraft(TokenId t) : t_(t) {}
  void propose(std::span<Sequence* const> seqs, std::span<const int> max_draft) override {
    for (size_t i = 0; i < seqs.size(); ++i)
      if (seqs[i]->num_output() == 1 && max_draft[i] >= 1) seqs[i]->draft = {t_};
  }

 private:
  TokenId t_;
};

// Pearson's chi-square of `counts` (n draws) against probabilities `p`, bins with an expected
// count under 5 pooled; returns {statistic, the p = 1e-4 critical value for its degrees of
// freedom (Wilson-Hilferty)}.
std::pair<double, double> chi_square(const std::map<TokenId, int>& counts, int n, std::span<const double> p) {
  double stat = 0, rest_obs = 0, rest_exp = 0;
  int bins = 0;
  for (size_t t = 0; t < p.size(); ++t) {
    const double expect = p[t] * n;
    const auto it = counts.find(TokenId(t));
    const double obs = it == counts.end() ? 0 : it->second;
    if (expect < 5) {
      rest_obs += obs;
      rest_exp += expect;
      continue;
    }
    stat += (obs - expect) * (obs - expect) / expect;
    ++bins;
  }
  if (rest_exp > 0) {
    stat += (rest_obs - rest_exp) * (rest_obs - rest_exp) / rest_exp;
    ++bins;
  }
  const double df = bins - 1, z = 3.719;  // one-sided 1e-4
  const double crit = df * std::pow(1 - 2 / (9 * df) + z * std::sqrt(2 / (9 * df)), 3);
  return {stat, crit};
}

}  // namespace

// Sampling at temperature 1 with a draft to verify keeps the target's distribution: the second
// output token, drawn by a verification step (a fixed draft token proposed for it, accepted
// when the target's own draw agrees), follows the target's next-token probabilities exactly — a
// chi-square test over 4000 seeds — and the same test rejects a sampler that is off by a
// temperature of 1.25, so it can tell.
TEST(Scheduler, DraftedSamplingKeepsTheTargetDistribution) {
  auto e = load(kStories, KVCacheDType::Auto, 8);
  const std::vector<TokenId> prompt{1, 403, 407, 261, 378, 324, 434, 412, 281, 266};
  const size_t vocab = size_t(e->config().vocab_size);
  const int N = 4000;
  // The most likely first token and, after it, the target's distribution of the second.
  const std::vector<float> first = all_logits(*e, prompt, 64);
  const TokenId t1 = argmax(std::span<const float>(first).last(vocab));
  std::vector<TokenId> ctx = prompt;
  ctx.push_back(t1);
  const std::vector<float> second = all_logits(*e, ctx, 64);
  const auto row = std::span<const float>(second).last(vocab);
  std::vector<double> p(vocab);
  const float mx = *std::ranges::max_element(row);
  double z = 0;
  for (size_t v = 0; v < vocab; ++v) z += p[v] = std::exp(double(row[v] - mx));
  for (double& x : p) x /= z;
  const TokenId draft = TokenId(std::ranges::max_element(p) - p.begin());

  std::map<std::string, Collected> out;
  EngineStats st;
  {
    LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 256, .max_num_batched_tokens = 4096, .max_model_len = 64,
                                     .enable_prefix_caching = true, .num_blocks = 1024});
    le.set_proposer(std::make_unique<FixedDraft>(draft));
    for (int i = 0; i < N; ++i) {
      auto r = make("s" + std::to_string(i), prompt, 3, out);  // the draft for token 2, room for the token after it
      r.sampling.temperature = 1.0f;
      r.seed = uint64_t(1000 + i);
      r.ignore_eos = true;
      le.add_request(std::move(r));
    }
    run_to_end(le);
    st = le.stats();
  }
  std::map<TokenId, int> counts;
  int n = 0;
  for (const auto& [id, c] : out) {
    ASSERT_EQ(c.tokens.size(), 3u) << id;
    if (c.tokens[0] != t1) continue;
    ++counts[c.tokens[1]];
    ++n;
  }
  ASSERT_GT(n, 500) << "too few samples start with the most likely token";
  EXPECT_GT(st.spec_accepted_tokens_total, 0u);
  EXPECT_LT(st.spec_accepted_tokens_total, st.spec_draft_tokens_total);
  const auto [stat, crit] = chi_square(counts, n, p);
  EXPECT_LT(stat, crit) << "drafted samples of the second token do not follow the target's distribution (" << n
                        << " samples)";
  // The test's power: the same number of draws at temperature 1.25 (a sampler off by that much)
  // must fail it.
  std::map<TokenId, int> biased;
  for (int i = 0; i < n; ++i) {
    Sampler s(uint64_t(77 + i));
    ++biased[s.sample(row, SamplingParams{.temperature = 1.25f})];
  }
  const auto [bstat, bcrit] = chi_square(biased, n, p);
  EXPECT_GT(bstat, bcrit) << "the chi-square test cannot tell a temperature-1.25 sampler from the target";
  std::printf("[spec-dist] %d samples: chi2 %.1f (critical %.1f); temperature-1.25 sampler: chi2 %.1f\n", n, stat, crit,
              bstat);
}

// Scoring a prompt (max_tokens 0, prompt logits) through the engine: every row arrives once,
// in order, equal to one unchunked pass, also when the sequence is preempted and recomputed.

}  // namespace

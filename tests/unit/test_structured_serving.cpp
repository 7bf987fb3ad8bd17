// Structured outputs in the serving engine: constrained requests beside unconstrained ones
// (every constrained output matches its grammar; the others are unchanged), and a late grammar
// mask that must not hold up the batch.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <regex>
#include <thread>

#include "engine/llm_engine.h"
#include "text/tokenizer/tokenizer.h"
#include "text/grammar/grammar.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"
#include "serve_test_util.h"

namespace fs = std::filesystem;
using namespace kvlm;
using namespace kvlm::testing;

// Constrained requests (a grammar masks what they draw, sampled at temperature 1) beside
// unconstrained ones in the same batches: every constrained output matches its grammar and
// ends with "stop"; the unconstrained outputs are those of running alone; logit_bias moves
// the greedy choice; a grammar no token can spell fails its request and nothing else.
TEST(StructuredOutputs, ConstrainedBesideUnconstrained) {
  const fs::path tiny = fs::path(KVLM_TEST_DATA) / ".." / "models" / "kvlm-tiny";
  auto e = load(tiny);
  const Tokenizer tok = Tokenizer::load(tiny / "tokenizer.json");
  const int vocab = e->config().vocab_size;
  auto tv = std::make_shared<const grammar::TokenVocab>(tok, vocab);
  const std::string pattern = "[0-9]{2,4}-[a-c]+( ok)?";
  auto regex = std::make_shared<const grammar::CompiledGrammar>(grammar::regex_grammar(pattern), tv);
  // A vocabulary that spells only a..k, and a grammar that needs a z.
  std::vector<std::string> letters(size_t(vocab), "");
  for (int i = 0; i < 11; ++i) letters[size_t(10 + i)] = std::string(1, char('a' + i));
  auto no_z = std::make_shared<const grammar::CompiledGrammar>(grammar::parse_gbnf("root ::= \"z\"\n"),
                                                               std::make_shared<const grammar::TokenVocab>(letters));

  std::mt19937 rng(3);
  std::vector<std::vector<TokenId>> plain_prompts;
  std::vector<std::vector<TokenId>> expected;
  for (int i = 0; i < 3; ++i) {
    plain_prompts.push_back(random_prompt(rng, 10 + i * 7, vocab));
    expected.push_back(one_at_a_time(*e, plain_prompts.back(), 12));
  }
  // The most likely token after a prompt, to bias against (generate() sizes its own pool: it
  // runs before the engine's).
  const std::vector<TokenId> p = tok.encode("12+35=");
  const TokenId top = one_at_a_time(*e, p, 1)[0];
  std::map<std::string, Collected> out;
  LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 256,
                                   .enable_prefix_caching = true, .num_blocks = 256});
  for (int i = 0; i < 3; ++i) le.add_request(make("plain" + std::to_string(i), plain_prompts[size_t(i)], 12, out));
  for (int i = 0; i < 8; ++i) {
    EngineRequest r = make("json" + std::to_string(i), tok.encode("Code number " + std::to_string(i) + ":"), 200, out);
    r.sampling.temperature = 1.0f;
    r.seed = uint64_t(100 + i);
    r.ignore_eos = false;
    r.constraint = std::make_shared<grammar::Constraint>(regex);
    le.add_request(std::move(r));
  }
  EngineRequest biased = make("biased", p, 1, out);
  biased.logit_bias = {{top, -100.0f}, {TokenId(7), 100.0f}};
  le.add_request(std::move(biased));
  EngineRequest stuck = make("stuck", p, 5, out);
  stuck.constraint = std::make_shared<grammar::Constraint>(no_z);
  le.add_request(std::move(stuck));
  run_to_end(le);

  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(out["plain" + std::to_string(i)].tokens, expected[size_t(i)]) << i << " " << out["plain" + std::to_string(i)].error;
  for (int i = 0; i < 8; ++i) {
    const Collected& c = out["json" + std::to_string(i)];
    std::string text;
    for (TokenId t : c.tokens) text += tok.token_bytes(t);
    EXPECT_TRUE(std::regex_match(text, std::regex(pattern))) << "'" << text << "'";
    EXPECT_EQ(c.reason, FinishReason::Stop) << text;
  }
  EXPECT_EQ(out["biased"].tokens, std::vector<TokenId>{7});
  EXPECT_EQ(out["stuck"].reason, FinishReason::Error);
  EXPECT_TRUE(out["stuck"].tokens.empty());
  EXPECT_EQ(le.blocks().num_used(), 0) << "pages leaked";
}

// A constrained request whose grammar mask is late (here held back until the test lets it go)
// sits out steps instead of holding up the batch: the unconstrained requests beside it run to
// their end while it waits, and every output is what it is when masks are instant (the late
// token is drawn from the same logits with the same generator) — also when a small pool
// preempts sequences whose token is waiting (it is drawn again from the recomputed logits).
// With a runner that samples on its device, the masks travel to it and it draws the
// constrained tokens; a late mask's row comes back and is drawn on the host by the same
// Gumbel sampler, so the outputs are again those of instant masks.
TEST(StructuredOutputs, LateMasksDoNotHoldUpTheBatch) {
  for (const bool device : {false, true}) {
    SCOPED_TRACE(device ? "runner-side sampling" : "host sampling");
    const fs::path tiny = fs::path(KVLM_TEST_DATA) / ".." / "models" / "kvlm-tiny";
    auto e = load(tiny, KVCacheDType::Auto, 8);
    DeviceSamplingRunner* runner = device ? sample_on_device(*e) : nullptr;
    const Tokenizer tok = Tokenizer::load(tiny / "tokenizer.json");
    const int vocab = e->config().vocab_size;
    const auto tv = std::make_shared<const grammar::TokenVocab>(tok, vocab);
    std::mt19937 rng(5);
    std::vector<std::vector<TokenId>> plain_prompts;
    for (int i = 0; i < 2; ++i) plain_prompts.push_back(random_prompt(rng, 12 + 5 * i, vocab));
    struct Run {
      std::map<std::string, Collected> out;
      EngineStats stats;
      size_t constrained_tokens_while_held = 0;
      int masked_rows = 0, late_masks = 0;  // runner-side sampling
    };
    const auto run = [&](bool hold, int num_blocks) {
      Run r;
      if (runner) {
        runner->reset_counters();
        runner->patient_masks = !hold;  // instant: the runner gets every mask
      }
      // A grammar of its own, so that no mask is cached from another run.
      auto regex =
          std::make_shared<const grammar::CompiledGrammar>(grammar::regex_grammar("[0-9]{2,3}-[a-c]{1,3}"), tv);
      LLMEngine le(*e, SchedulerConfig{.max_num_seqs = 8, .max_num_batched_tokens = 64, .max_model_len = 64,
                                       .enable_prefix_caching = false, .num_blocks = num_blocks});
      // Released by the test, or after a minute by a watchdog: an engine that waited for the
      // mask fails the checks below instead of hanging.
      std::promise<void> release;
      const std::shared_future<void> gate = release.get_future().share();
      std::once_flag released;
      const auto let_go = [&] { std::call_once(released, [&] { release.set_value(); }); };
      std::mutex watch_mu;
      std::condition_variable watch_cv;
      bool done = false;
      std::thread watchdog([&] {
        std::unique_lock lock(watch_mu);
        if (!watch_cv.wait_for(lock, std::chrono::seconds(60), [&] { return done; })) let_go();
      });
      for (int i = 0; i < 2; ++i)
        le.add_request(make("plain" + std::to_string(i), plain_prompts[size_t(i)], 12, r.out));
      for (int i = 0; i < 3; ++i) {
        EngineRequest q = make("code" + std::to_string(i), tok.encode("Code " + std::to_string(i) + ":"), 40, r.out);
        q.sampling.temperature = 1.0f;
        q.seed = uint64_t(40 + i);
        q.ignore_eos = false;
        q.constraint = std::make_shared<grammar::Constraint>(regex);
        if (hold) q.constraint->hold_prefetch_for_testing(gate);
        le.add_request(std::move(q));
      }
      if (hold) {
        // No constrained request can draw a token: the plain ones still run to their end.
        const auto plain_done = [&] { return r.out["plain0"].finishes + r.out["plain1"].finishes == 2; };
        for (int guard = 0; !plain_done(); ++guard) {
          if (guard == 1000) {
            ADD_FAILURE() << "the plain requests waited for a mask";
            break;
          }
          le.step();
        }
        for (int i = 0; i < 3; ++i) r.constrained_tokens_while_held += r.out["code" + std::to_string(i)].tokens.size();
      }
      let_go();
      {
        std::lock_guard lock(watch_mu);
        done = true;
      }
      watch_cv.notify_one();
      watchdog.join();
      run_to_end(le);
      r.stats = le.stats();
      if (runner) {
        r.masked_rows = runner->masked_rows;
        r.late_masks = runner->late_masks;
      }
      EXPECT_EQ(le.blocks().num_used(), 0) << "pages leaked";
      return r;
    };
    const Run instant = run(false, 64), late = run(true, 64), squeezed = run(true, 8);
    for (const Run* other : {&late, &squeezed}) {
      for (const auto& [id, c] : instant.out) {
        EXPECT_EQ(other->out.at(id).tokens, c.tokens) << id;
        EXPECT_EQ(other->out.at(id).reason, c.reason) << id;
        EXPECT_EQ(other->out.at(id).finishes, 1) << id;
      }
      EXPECT_EQ(other->constrained_tokens_while_held, 0u);
      EXPECT_GE(other->stats.grammar_deferred_tokens_total, 3u);
    }
    EXPECT_GT(squeezed.stats.preemptions_total, 0u);
    for (int i = 0; i < 3; ++i) {
      const Collected& c = instant.out.at("code" + std::to_string(i));
      std::string text;
      for (TokenId t : c.tokens) text += tok.token_bytes(t);
      EXPECT_TRUE(std::regex_match(text, std::regex("[0-9]{2,3}-[a-c]{1,3}"))) << text;
      EXPECT_EQ(c.reason, FinishReason::Stop) << text;
    }
    if (device) {
      EXPECT_GT(instant.masked_rows, 6) << "the constrained rows should go to the runner with their masks";
      EXPECT_EQ(instant.late_masks, 0);
      EXPECT_EQ(instant.stats.grammar_late_masks_total, 0u);
      EXPECT_GE(late.late_masks, 3) << "held masks should reach the runner late";
      EXPECT_EQ(late.stats.grammar_late_masks_total, uint64_t(late.late_masks));
    }
  }
}

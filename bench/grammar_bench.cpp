// Structured outputs' cost on the engine thread: the time to compute a token mask per
// generated token, for real tokenizers' vocabularies.
//
// For each tokenizer: the vocabulary index is built (once per server), then for each grammar
// 50 random generations are walked token by token (each token drawn uniformly from the
// mask: far more varied than a model's output, so the caches are the least useful they can
// be), twice: masks by one walk over the whole vocabulary per state (how kvlm made them
// before), and from per-position masks (accepted tokens + the dependent ones walked). The
// first generation of a grammar pays for its positions (as the first request with a new
// schema does); the other 49 show a server that has seen the schema. Reported: mask time per
// token (first generation, the rest), the share of steps that hit the state cache, the worst
// step, and the memory the grammar's caches hold.
//
// usage: kvlm_bench_grammar TOKENIZER_DIR...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "text/tokenizer/tokenizer.h"
#include "text/grammar/json_schema.h"
#include "text/grammar/matcher.h"
#include "text/grammar/regex.h"

using namespace kvlm;
using Clock = std::chrono::steady_clock;

static double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s TOKENIZER_DIR...\n", argv[0]);
    return 2;
  }
  const auto schema = nlohmann::ordered_json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 24},
      "age": {"type": "integer", "minimum": 0, "maximum": 150},
      "email": {"type": "string", "format": "email"},
      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
      "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                  "required": ["city"]}
    },
    "required": ["name", "age"]
  })");
  const std::vector<std::pair<std::string, grammar::Grammar>> grammars = {
      {"json_schema (5 fields)", grammar::json_schema_grammar(schema)},
      {"json_object", grammar::json_object_grammar()},
      {"regex [0-9]{3}-[a-z]{2,8}", grammar::regex_grammar("[0-9]{3}-[a-z]{2,8}")},
  };
  std::printf("| tokenizer | vocab | index ms | grammar | masks | steps | first generation µs/token | others µs/token | "
              "state-cache hits | worst step ms | cache MiB |\n");
  std::printf("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|\n");
  for (int a = 1; a < argc; ++a) {
    const Tokenizer tok = Tokenizer::load(argv[a]);
    auto t0 = Clock::now();
    auto vocab = std::make_shared<const grammar::TokenVocab>(tok, tok.vocab_size());
    const double index_ms = ms_since(t0);
    for (const auto& [label, g] : grammars)
      for (const bool by_position : {false, true}) {
        auto cg = std::make_shared<const grammar::CompiledGrammar>(g, vocab, by_position);
        std::mt19937 rng(1);
        int steps = 0, first_steps = 0, hits = 0;
        double first_ms = 0, rest_ms = 0, worst = 0;
        for (int walk = 0; walk < 50; ++walk) {
          grammar::Constraint c(cg);
          for (int i = 0; i < 200 && !c.terminated(); ++i) {
            const auto t1 = Clock::now();
            const auto mask = c.allowed();
            const double ms = ms_since(t1);
            (walk ? rest_ms : first_ms) += ms;
            first_steps += walk == 0;
            worst = std::max(worst, ms);
            hits += ms < 0.005;  // a lookup, not a walk
            ++steps;
            std::vector<TokenId> allowed;
            for (TokenId t = 0; t < vocab->size(); ++t)
              if (mask->test(t)) allowed.push_back(t);
            if (allowed.empty()) break;
            c.accept(allowed[rng() % allowed.size()]);
          }
        }
        std::printf("| %s | %d | %.0f | %s | %s | %d | %.0f | %.0f | %.0f%% | %.1f | %.1f |\n", argv[a], vocab->size(), index_ms,
                    label.c_str(), by_position ? "per position" : "whole vocabulary", steps, 1000 * first_ms / first_steps,
                    1000 * rest_ms / std::max(steps - first_steps, 1), 100.0 * hits / steps, worst,
                    double(cg->cached_bytes()) / (1 << 20));
        std::fflush(stdout);
      }
  }
  return 0;
}

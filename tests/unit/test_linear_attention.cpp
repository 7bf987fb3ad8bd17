// Gated DeltaNet's CPU reference (ops/cpu/linear_attention.h) against transformers' own
// functions (tests/golden/gdn/cases.json, written by tools/make_gdn_goldens.py: the chunked and
// recurrent delta rules, the causal conv update, the gated RMSNorm, the gates), and against
// itself: the chunked form equals the recurrent one, and a sequence cut into pieces (the state
// carried between them, as chunked prefill and decode carry it) equals the sequence whole.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "ops/cpu/linear_attention.h"

using namespace kvlm;
namespace cpu = kvlm::ops::cpu;

namespace {

nlohmann::json cases() {
  std::ifstream in(std::string(KVLM_TEST_DATA) + "/golden/gdn/cases.json");
  return nlohmann::json::parse(in);
}

std::vector<float> vec(const nlohmann::json& j) { return j.get<std::vector<float>>(); }

// Largest |a - b| / (atol + rtol |b|); <= 1 passes.
double worst(const std::vector<float>& a, const std::vector<float>& b, double atol = 2e-5, double rtol = 1e-4) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    w = std::max(w, std::abs(double(a[i]) - b[i]) / (atol + rtol * std::abs(double(b[i]))));
  return w;
}

struct Inputs {
  cpu::DeltaRuleShape s;
  int tokens = 0;
  std::vector<float> q, k, v, g, beta, state;
};

Inputs random_inputs(std::mt19937& rng, int tokens, int k_heads, int v_heads, int dk, int dv) {
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  Inputs in{.s = {k_heads, v_heads, dk, dv}, .tokens = tokens};
  auto fill = [&](std::vector<float>& x, size_t n, float scale) {
    x.resize(n);
    for (auto& e : x) e = nd(rng) * scale;
  };
  fill(in.q, size_t(tokens) * k_heads * dk, 1.0f);
  fill(in.k, in.q.size(), 1.0f);
  fill(in.v, size_t(tokens) * v_heads * dv, 1.0f);
  fill(in.state, size_t(v_heads) * dk * dv, 0.3f);
  in.g.resize(size_t(tokens) * v_heads);
  in.beta.resize(in.g.size());
  for (size_t i = 0; i < in.g.size(); ++i) {
    in.g[i] = -2.0f * ud(rng);  // decays exp(g) in (0.14, 1]
    in.beta[i] = ud(rng);
  }
  return in;
}

// Rows [t0, t0 + n) of a [tokens][heads][d] array.
std::vector<float> rows(const std::vector<float>& x, int tokens, int t0, int n) {
  const size_t per = x.size() / size_t(tokens);
  return {x.begin() + std::ptrdiff_t(size_t(t0) * per), x.begin() + std::ptrdiff_t(size_t(t0 + n) * per)};
}

}  // namespace

TEST(DeltaRule, MatchesTransformersChunkedAndRecurrent) {
  const auto j = cases();
  for (const auto& c : j["delta"]) {
    const cpu::DeltaRuleShape s{c["k_heads"], c["v_heads"], c["dk"], c["dv"]};
    const int T = c["tokens"];
    const auto q = vec(c["q"]), k = vec(c["k"]), v = vec(c["v"]);
    // The gates from the projections, as Qwen3NextGatedDeltaNet.forward forms them.
    std::vector<float> g = vec(c["a"]), beta = vec(c["b"]);
    cpu::delta_rule_gates(T, s.v_heads, vec(c["a_log"]), vec(c["dt_bias"]), g, beta);
    EXPECT_LE(worst(g, vec(c["g"]), 1e-6, 1e-6), 1.0) << c["name"];
    EXPECT_LE(worst(beta, vec(c["beta"]), 1e-7, 1e-6), 1.0) << c["name"];
    g = vec(c["g"]);
    beta = vec(c["beta"]);
    const size_t n_out = size_t(T) * size_t(s.v_heads) * size_t(s.dv);
    std::vector<float> state = vec(c["state"]), out(n_out);
    cpu::delta_rule_chunked(s, T, q, k, v, g, beta, state, out);
    EXPECT_LE(worst(out, vec(c["chunked_out"])), 1.0) << c["name"] << " chunked output";
    EXPECT_LE(worst(state, vec(c["chunked_state"])), 1.0) << c["name"] << " chunked state";
    state = vec(c["state"]);
    cpu::delta_rule_recurrent(s, T, q, k, v, g, beta, state, out);
    EXPECT_LE(worst(out, vec(c["recurrent_out"])), 1.0) << c["name"] << " recurrent output";
    EXPECT_LE(worst(state, vec(c["recurrent_state"])), 1.0) << c["name"] << " recurrent state";
  }
}

TEST(DeltaRule, ChunkedEqualsRecurrentAndPiecesEqualTheWhole) {
  std::mt19937 rng(7);
  struct Shape {
    int tokens, k_heads, v_heads, dk, dv, chunk;
  };
  for (const Shape& sh : {Shape{1, 1, 1, 8, 8, 64}, Shape{63, 2, 2, 16, 8, 64}, Shape{64, 1, 2, 8, 16, 64},
                          Shape{65, 2, 6, 8, 8, 64}, Shape{200, 1, 1, 32, 32, 64}, Shape{50, 2, 4, 8, 8, 7}}) {
    Inputs in = random_inputs(rng, sh.tokens, sh.k_heads, sh.v_heads, sh.dk, sh.dv);
    const size_t n_out = in.v.size();
    std::vector<float> s_rec = in.state, o_rec(n_out), s_chk = in.state, o_chk(n_out);
    cpu::delta_rule_recurrent(in.s, in.tokens, in.q, in.k, in.v, in.g, in.beta, s_rec, o_rec);
    cpu::delta_rule_chunked(in.s, in.tokens, in.q, in.k, in.v, in.g, in.beta, s_chk, o_chk, sh.chunk);
    EXPECT_LE(worst(o_chk, o_rec), 1.0) << sh.tokens << " tokens, chunk " << sh.chunk;
    EXPECT_LE(worst(s_chk, s_rec), 1.0) << sh.tokens << " tokens, chunk " << sh.chunk;
    // The same tokens in pieces (a prompt's chunks, then decode steps one token each), the
    // state carried: each piece chunked, or recurrent when it is one token.
    std::vector<float> state = in.state, out;
    for (int t0 = 0, piece = 0; t0 < in.tokens; ++piece) {
      const int n = std::min(in.tokens - t0, piece % 3 == 2 ? 1 : 17 + 29 * piece);
      std::vector<float> o(rows(in.v, in.tokens, t0, n).size());
      auto part = [&](const std::vector<float>& x) { return rows(x, in.tokens, t0, n); };
      if (n == 1)
        cpu::delta_rule_recurrent(in.s, n, part(in.q), part(in.k), part(in.v), part(in.g), part(in.beta), state, o);
      else
        cpu::delta_rule_chunked(in.s, n, part(in.q), part(in.k), part(in.v), part(in.g), part(in.beta), state, o,
                                sh.chunk);
      out.insert(out.end(), o.begin(), o.end());
      t0 += n;
    }
    EXPECT_LE(worst(out, o_rec), 1.0) << sh.tokens << " tokens in pieces";
    EXPECT_LE(worst(state, s_rec), 1.0) << sh.tokens << " tokens in pieces";
  }
}

TEST(DeltaRule, RefusesInconsistentShapes) {
  std::vector<float> x(64), st(64), out(64);
  EXPECT_ANY_THROW(cpu::delta_rule_recurrent({2, 3, 4, 4}, 1, x, x, x, x, x, st, out));  // 3 v heads over 2 k heads
  EXPECT_ANY_THROW(cpu::delta_rule_chunked({1, 1, 8, 8}, 2, x, x, x, x, x, st, out));   // sizes disagree
}

TEST(CausalConv, MatchesTransformersAndCarriesItsState) {
  const auto j = cases();
  for (const auto& c : j["conv"]) {
    const int T = c["tokens"], C = c["channels"], K = c["kernel"];
    const auto x = vec(c["x"]), w = vec(c["w"]);
    std::vector<float> state = vec(c["state"]), out(x.size());
    cpu::causal_conv_silu(T, C, K, x, w, state, out);
    EXPECT_LE(worst(out, vec(c["out"]), 1e-6, 1e-5), 1.0) << T << " tokens";
    EXPECT_LE(worst(state, vec(c["new_state"]), 0, 0), 1.0) << T << " tokens: the state keeps the last inputs";
    // In place, and in pieces of 1 and 2 rows: the same.
    std::vector<float> st2 = vec(c["state"]), y = x;
    for (int t0 = 0; t0 < T;) {
      const int n = std::min(T - t0, 1 + t0 % 2);
      std::span<float> piece(y.data() + size_t(t0) * size_t(C), size_t(n) * size_t(C));
      cpu::causal_conv_silu(n, C, K, piece, w, st2, piece);
      t0 += n;
    }
    EXPECT_EQ(y, out);
    EXPECT_EQ(st2, state);
  }
}

TEST(RmsNormGated, MatchesTransformers) {
  const auto j = cases();
  for (const auto& c : j["norm"]) {
    const auto x = vec(c["x"]), z = vec(c["z"]);
    std::vector<float> out(x.size());
    cpu::rmsnorm_gated(x, z, c["rows"], c["dim"], vec(c["w"]), c["eps"].get<float>(), out);
    EXPECT_LE(worst(out, vec(c["out"]), 1e-6, 1e-5), 1.0);
  }
}

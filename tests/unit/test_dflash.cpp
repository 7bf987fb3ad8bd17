// DFlash drafting on the CPU: the drafter's config and its checks against the target, its
// layers in the KV plan, one drafter step against a float64 reference written from the
// DFlash reference code's equations, and drafted generation equal to plain generation in
// every KV mode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/safetensors.h"
#include "model/cpu/cpu_runner.h"
#include "model/loaded_model.h"
#include "offline/generate.h"
#include "../support/greedy_compare.h"
#include "../support/random_drafter.h"

namespace kvlm {
namespace {

namespace fs = std::filesystem;
const fs::path kTiny = fs::path(KVLM_TEST_DATA) / ".." / "models" / "kvlm-tiny";  // Qwen3, 7 layers, hidden 384
using test::Drafter;
using test::make_drafter;

ModelOptions tiny(KVCacheDType dt, const Drafter* d, int k = 7) {
  ModelOptions o;
  o.model_dir = kTiny;
  o.cache.kv_cache_dtype = dt;
  if (d) o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + d->dir.string() +
                                                  R"(","num_speculative_tokens":)" + std::to_string(k) + "}");
  return o;
}

void expect_refused(const ModelOptions& o, const std::string& needle) {
  try {
    LoadedModel::load(o);
    ADD_FAILURE() << "loaded; expected an error with: " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(DFlash, ConfigAndLayerIdDefaults) {
  nlohmann::json c = {{"architectures", {"DFlashDraftModel"}}, {"hidden_size", 64}, {"intermediate_size", 128},
                      {"num_hidden_layers", 5}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                      {"head_dim", 16}, {"vocab_size", 100}, {"block_size", 16}, {"num_target_layers", 36},
                      {"dflash_config", {{"mask_token_id", 99}}}};
  ModelConfig m = parse_model_config(c, nullptr);
  ASSERT_TRUE(m.dflash.has_value());
  EXPECT_EQ(m.dflash->block_size, 16);
  EXPECT_EQ(m.dflash->mask_token_id, 99);
  // The reference's build_target_layer_ids(36, 5): spread over [1, 33].
  EXPECT_EQ(m.dflash->target_layer_ids, (std::vector<int>{1, 9, 17, 25, 33}));
  for (const auto& l : m.layers) EXPECT_EQ(l.kind, AttentionKind::NonCausal);
  c["num_hidden_layers"] = 1;
  EXPECT_EQ(parse_model_config(c, nullptr).dflash->target_layer_ids, (std::vector<int>{18}));
  c["dflash_config"]["mask_token_id"] = 100;
  EXPECT_THROW(parse_model_config(c, nullptr), Error);
  c["dflash_config"] = {{"mask_token_id", 3}};
  c.erase("num_target_layers");
  EXPECT_THROW(parse_model_config(c, nullptr), Error);
  c["block_size"] = 1;
  EXPECT_THROW(parse_model_config(c, nullptr), Error);
}

TEST(DFlash, DrafterThatDoesNotFitIsRefusedWithTheReason) {
  const Drafter good = make_drafter("good");
  expect_refused(tiny(KVCacheDType::Auto, &good, 8), "exceeds what one block of 8 proposes");
  const Drafter wide = make_drafter("wide", {{"hidden_size", 256}});
  expect_refused(tiny(KVCacheDType::Auto, &wide), "hidden_size 256 differs from the target's 384");
  const Drafter vocab = make_drafter("vocab", {{"vocab_size", 2000}});
  expect_refused(tiny(KVCacheDType::Auto, &vocab), "vocab_size 2000 differs");
  const Drafter ids = make_drafter("ids", {{"dflash_config", {{"mask_token_id", 5}, {"target_layer_ids", {1, 6}}}}});
  expect_refused(tiny(KVCacheDType::Auto, &ids), "holds layer 6");
  const Drafter other = make_drafter("other", {{"num_target_layers", 36}});
  expect_refused(tiny(KVCacheDType::Auto, &other), "trained on a 36-layer target");
  ModelOptions not_drafter = tiny(KVCacheDType::Auto, nullptr);
  not_drafter.speculative =
      parse_speculative_config(R"({"method":"dflash","model":")" + kTiny.string() + R"(","num_speculative_tokens":3})");
  expect_refused(not_drafter, "not a DFlash drafter");
  ModelOptions as_target;
  as_target.model_dir = good.dir;
  expect_refused(as_target, "is a DFlash drafter");
  for (const Drafter* d : {&good, &wide, &vocab, &ids, &other}) fs::remove_all(d->dir);
}

TEST(DFlash, DraftLayersJoinThePlanWithTheTargetsCacheOptions) {
  const Drafter d = make_drafter("plan");
  for (const bool own : {false, true}) {
    ModelOptions o = tiny(KVCacheDType::Fp8PerTokenHead, &d);
    o.cache.skip_layers = parse_skip_layers("0");
    if (own)
      o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + d.dir.string() +
                                               R"(","num_speculative_tokens":4,"kv_cache_dtype":"int8_per_token_head"})");
    const Checkpoint ckpt = Checkpoint::open(kTiny);
    const ModelPlan mp = plan_model(kTiny, ckpt, o.cache, selection_context(Device::Cpu, 0, o.cache), std::nullopt,
                                    &*o.speculative);
    ASSERT_EQ(mp.plan.layers.size(), 8u);
    EXPECT_EQ(mp.plan.layers[0].k.mode, KVQuantMode::None);  // the skip rule on target layer 0
    const KVLayerSpec& dl = mp.plan.layers[7];
    EXPECT_EQ(dl.attn.model, "draft");
    EXPECT_EQ(dl.attn.layer, 0);
    EXPECT_EQ(dl.attn.kind, AttentionKind::NonCausal);
    // Seed 000: the drafter gets the cache config (an index rule names a target layer).
    EXPECT_EQ(dl.k.mode, own ? KVQuantMode::Int8PerTokenHead : KVQuantMode::Fp8PerTokenHead);
    EXPECT_EQ(dl.backend, "cpu");
    EXPECT_GT(mp.plan.bytes_per_token(), 0u);
  }
  fs::remove_all(d.dir);
}

// One drafter step (context pass over a prompt, then one block) against float64 arithmetic
// on the same weights and the features the target captured.
TEST(DFlash, DrafterStepMatchesAFloat64Reference) {
  for (const bool prefix : {false, true}) {
    const Drafter D = make_drafter(prefix ? "ref-prefixed" : "ref", nlohmann::json::object(), prefix);
    ModelOptions o = tiny(KVCacheDType::Auto, &D);
    o.dtype = DType::F32;  // an fp32 KV cache: the reference is exact arithmetic
    auto m = LoadedModel::load(o);
    auto* cpu = dynamic_cast<CpuModelRunner*>(&m->model());
    ASSERT_NE(cpu, nullptr);
    ASSERT_TRUE(cpu->has_drafter());
    const int bs = 16, n = 21, B = D.block;
    cpu->allocate_kv(4, bs);
    const std::vector<BlockId> table{2, 0, 3};
    std::vector<TokenId> prompt(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) prompt[size_t(i)] = TokenId(40 + 37 * i % 1800);
    auto slot = [&](int p) { return SlotId(table[size_t(p / bs)]) * bs + p % bs; };
    std::vector<Position> pos;
    std::vector<SlotId> slots;
    for (int p = 0; p < n; ++p) pos.push_back(p), slots.push_back(slot(p));
    const AttnSeq seq{.q_begin = 0, .q_len = n, .kv_len = n, .block_table = table};
    const std::vector<int32_t> last{n - 1};
    std::vector<float> logits(1911);
    cpu->forward({.tokens = prompt, .positions = pos, .slots = slots, .seqs = {&seq, 1}, .logit_rows = last}, logits);
    const std::vector<float> F(cpu->last_features().begin(), cpu->last_features().end());
    ASSERT_EQ(F.size(), size_t(n) * 3 * 384);
    // The block.
    std::vector<TokenId> bt{prompt.back()};
    for (int j = 1; j < B; ++j) bt.push_back(D.mask);
    std::vector<Position> bpos;
    std::vector<SlotId> bslots;
    for (int j = 0; j < B; ++j) bpos.push_back(n + j), bslots.push_back(slot(n + j));
    const AttnSeq bseq{.q_begin = 0, .q_len = B, .kv_len = n + B, .block_table = table};
    std::vector<int32_t> rows;
    for (int j = 1; j < B; ++j) rows.push_back(j);
    std::vector<float> got(rows.size() * 1911);
    cpu->draft({.tokens = bt, .positions = bpos, .slots = bslots, .seqs = {&bseq, 1}, .logit_rows = rows}, got);

    // --- float64 reference -------------------------------------------------------------
    const int H = 384, nh = 6, kvh = 2, d = 64, I = 512, NF = 3;
    const auto dw = cpu->drafter_weights();
    const float* embed = static_cast<const float*>(dw[dw.size() - 2].data);
    const float* lm_head = static_cast<const float*>(dw[dw.size() - 1].data);
    auto W = [&](const std::string& name) { return D.w.at(name).data(); };
    using Vec = std::vector<double>;
    auto rms = [](Vec x, const float* w, int dim) {
      for (size_t r = 0; r < x.size() / size_t(dim); ++r) {
        double ss = 0;
        for (int i = 0; i < dim; ++i) ss += x[r * dim + i] * x[r * dim + i];
        const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
        for (int i = 0; i < dim; ++i) x[r * dim + i] = x[r * dim + i] * inv * double(w[i]);
      }
      return x;
    };
    auto lin = [](const Vec& x, const float* w, int out, int in) {  // x [rows][in] . w[out][in]^T
      const size_t rows = x.size() / size_t(in);
      Vec y(rows * size_t(out));
      for (size_t r = 0; r < rows; ++r)
        for (int o2 = 0; o2 < out; ++o2) {
          double s = 0;
          for (int i = 0; i < in; ++i) s += x[r * in + i] * double(w[size_t(o2) * in + i]);
          y[r * out + o2] = s;
        }
      return y;
    };
    auto rope = [&](Vec& x, int heads, const std::vector<int>& p) {  // rotate-half, theta 1e5
      for (size_t t = 0; t < p.size(); ++t)
        for (int h = 0; h < heads; ++h) {
          double* v = &x[(t * heads + h) * d];
          for (int i = 0; i < d / 2; ++i) {
            const double f = 1.0 / std::pow(100000.0, 2.0 * i / d), a = p[t] * f;
            const double x0 = v[i], x1 = v[i + d / 2];
            v[i] = x0 * std::cos(a) - x1 * std::sin(a);
            v[i + d / 2] = x1 * std::cos(a) + x0 * std::sin(a);
          }
        }
    };
    const Vec Fd(F.begin(), F.end());
    const Vec c = rms(lin(Fd, W("fc.weight"), H, NF * H), W("hidden_norm.weight"), H);
    std::vector<int> ctx_pos, blk_pos;
    for (int p = 0; p < n; ++p) ctx_pos.push_back(p);
    for (int j = 0; j < B; ++j) blk_pos.push_back(n + j);
    Vec x(size_t(B) * H);
    for (int j = 0; j < B; ++j)
      for (int i = 0; i < H; ++i) x[size_t(j) * H + i] = embed[size_t(bt[size_t(j)]) * H + i];
    const std::string p = "layers.0.";
    Vec kc = rms(lin(c, W(p + "self_attn.k_proj.weight"), kvh * d, H), W(p + "self_attn.k_norm.weight"), d);
    rope(kc, kvh, ctx_pos);
    const Vec vc = lin(c, W(p + "self_attn.v_proj.weight"), kvh * d, H);
    const Vec h = rms(x, W(p + "input_layernorm.weight"), H);
    Vec q = rms(lin(h, W(p + "self_attn.q_proj.weight"), nh * d, H), W(p + "self_attn.q_norm.weight"), d);
    Vec kb = rms(lin(h, W(p + "self_attn.k_proj.weight"), kvh * d, H), W(p + "self_attn.k_norm.weight"), d);
    const Vec vb = lin(h, W(p + "self_attn.v_proj.weight"), kvh * d, H);
    rope(q, nh, blk_pos);
    rope(kb, kvh, blk_pos);
    Vec att(size_t(B) * nh * d, 0.0);
    for (int j = 0; j < B; ++j)
      for (int hh = 0; hh < nh; ++hh) {
        const int g = hh / (nh / kvh);
        std::vector<double> s;
        for (int k = 0; k < n + B; ++k) {  // non-causal: every context key and the whole block
          const double* key = k < n ? &kc[(size_t(k) * kvh + g) * d] : &kb[(size_t(k - n) * kvh + g) * d];
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += q[(size_t(j) * nh + hh) * d + i] * key[i];
          s.push_back(dot / std::sqrt(double(d)));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (int k = 0; k < n + B; ++k) {
          const double* val = k < n ? &vc[(size_t(k) * kvh + g) * d] : &vb[(size_t(k - n) * kvh + g) * d];
          for (int i = 0; i < d; ++i) att[(size_t(j) * nh + hh) * d + i] += s[size_t(k)] / z * val[i];
        }
      }
    const Vec o2 = lin(att, W(p + "self_attn.o_proj.weight"), H, nh * d);
    for (size_t i = 0; i < x.size(); ++i) x[i] += o2[i];
    const Vec h2 = rms(x, W(p + "post_attention_layernorm.weight"), H);
    const Vec gt = lin(h2, W(p + "mlp.gate_proj.weight"), I, H), up = lin(h2, W(p + "mlp.up_proj.weight"), I, H);
    Vec act(gt.size());
    for (size_t i = 0; i < act.size(); ++i) act[i] = gt[i] / (1.0 + std::exp(-gt[i])) * up[i];
    const Vec dn = lin(act, W(p + "mlp.down_proj.weight"), H, I);
    for (size_t i = 0; i < x.size(); ++i) x[i] += dn[i];
    const Vec xf = rms(x, W("norm.weight"), H);
    double worst = 0, scale = 0;
    for (size_t r = 0; r < rows.size(); ++r) {
      const Vec row(xf.begin() + std::ptrdiff_t(size_t(rows[r]) * H), xf.begin() + std::ptrdiff_t(size_t(rows[r] + 1) * H));
      const Vec ref = lin(row, lm_head, 1911, H);
      for (int v = 0; v < 1911; ++v) {
        worst = std::max(worst, std::fabs(ref[size_t(v)] - double(got[r * 1911 + size_t(v)])));
        scale = std::max(scale, std::fabs(ref[size_t(v)]));
      }
    }
    EXPECT_LT(worst, 1e-4 * std::max(1.0, scale)) << "max |engine - float64| " << worst << " of logits up to " << scale;
    fs::remove_all(D.dir);
  }
}

// Drafted greedy generation is plain greedy generation, token for token, in every KV mode
// and with a mixed per-layer plan, the draft layers quantized too (parting only after a near
// tie of the plain run: support/greedy_compare.h says why; at most one configuration may).
TEST(DFlash, GreedyOutputIsThePlainOutputInEveryKVMode) {
  const Drafter D = make_drafter("lossless");
  const std::vector<TokenId> prompt{1, 200, 301, 57, 99, 1000, 1500, 1900, 42, 42, 7};
  int parted = 0;
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Fp8, KVCacheDType::Fp8PerTokenHead,
                                KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    // "mixed": layers 0 and 6 unquantized; for int4, exact sink 2 / recent 6 tokens instead
    // (the drafter's non-causal layers read them too).
    for (const bool mixed : {false, true}) {
      const bool exact = mixed && dt == KVCacheDType::Int4PerTokenHead;
      SCOPED_TRACE(std::string(kv_cache_dtype_name(dt)) + (exact ? " exact sink/recent" : mixed ? " mixed" : ""));
      ModelOptions o = tiny(dt, nullptr);
      if (exact) {
        o.cache.keep_sink = 2;
        o.cache.keep_recent = 6;
      } else if (mixed) {
        o.cache.skip_layers = parse_skip_layers("0,6");
      }
      auto plain = LoadedModel::load(o);
      ModelOptions so = tiny(dt, &D, 5);
      so.cache = o.cache;
      auto spec = LoadedModel::load(so);
      GenerateRequest g;
      g.prompt = prompt;
      g.max_tokens = 24;
      g.sampling.temperature = 0;
      g.ignore_eos = true;
      const GenerateResult b = generate(*spec, g);
      g.logprobs = 2;
      const GenerateResult a = generate(*plain, g);
      parted += test::expect_same_greedy(a, b, std::string(kv_cache_dtype_name(dt)) + (mixed ? " mixed" : ""));
      EXPECT_GT(b.drafts, 0u);
      EXPECT_LE(b.draft_tokens, b.drafts * 5u);
    }
  }
  EXPECT_LE(parted, 1) << "drafted and plain greedy outputs part in more than one of 10 configurations";
  fs::remove_all(D.dir);
}

// A dense drafter over a mixture-of-experts target (the golden Qwen3-MoE, bf16 weights,
// computed in fp32): drafting leaves the greedy output as it is, in a 16-bit and a quantized
// cache; the drafter reads the target's layer outputs through the MoE layers.
TEST(DFlash, DenseDrafterOverAMixtureOfExpertsTarget) {
  const fs::path target = fs::path(KVLM_TEST_DATA) / "golden" / "models" / "qwen3-moe";
  Drafter shape;
  shape.hidden = 64;
  shape.nh = 4;
  shape.kvh = 2;
  shape.d = 16;
  shape.inter = 96;
  shape.ids = {0, 1};
  shape.mask = 3;
  const Drafter D = make_drafter("moe", {{"vocab_size", 256}, {"num_target_layers", 3}}, false, shape);
  const std::vector<TokenId> prompt{1, 206, 206, 114, 177, 120, 195, 176, 186, 43, 27, 99};
  for (const KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::Int8PerTokenHead}) {
    ModelOptions o;
    o.model_dir = target;
    o.cache.kv_cache_dtype = dt;
    o.dtype = DType::F32;
    auto plain = LoadedModel::load(o);
    o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + D.dir.string() +
                                             R"(","num_speculative_tokens":4})");
    auto spec = LoadedModel::load(o);
    GenerateRequest g;
    g.prompt = prompt;
    g.max_tokens = 20;
    g.sampling.temperature = 0;
    g.ignore_eos = true;
    const GenerateResult b = generate(*spec, g);
    g.logprobs = 2;
    const GenerateResult a = generate(*plain, g);
    // fp32 KV: the same tokens; a quantized cache may part where the plain run's top two tie.
    const bool parted = test::expect_same_greedy(a, b, std::string(kv_cache_dtype_name(dt)));
    if (dt == KVCacheDType::Auto) EXPECT_FALSE(parted);
    EXPECT_GT(b.drafts, 0u);
  }
  fs::remove_all(D.dir);
}

}  // namespace
}  // namespace kvlm

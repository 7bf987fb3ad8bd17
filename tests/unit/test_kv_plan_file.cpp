// The KV plan file (--kv-cache-plan): parsing and its errors, the precedence it tops
// (plan file > explicit > checkpoint scheme > model dtype, side by side), per-side rotation
// with seeds, per-layer exact tokens, and the writer that reproduces a resolved plan.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kv/kv_plan.h"
#include "kv/kv_plan_file.h"

using namespace kvlm;

namespace {

// Four layers: sliding(8) / full alternating, 2 KV heads of 32.
std::vector<AttentionLayerDesc> layers4() {
  std::vector<AttentionLayerDesc> v;
  for (int i = 0; i < 4; ++i)
    v.push_back({.layer = i, .kind = i % 2 == 0 ? AttentionKind::Sliding : AttentionKind::Full, .window = i % 2 == 0 ? 8 : 0,
                 .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 32});
  return v;
}

KVPlanFile plan_of(const std::string& layers_json, const std::string& extra = "") {
  return parse_kv_plan_file(R"({"kvlm_kv_plan": 1, )" + extra + R"("layers": )" + layers_json + "}", "p.json");
}

// The message of the kvlm::Error `f` throws ("" when it throws none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const KVStorage kBF16{DType::BF16, KVQuantMode::None};
const KVStorage kFp8Pth{DType::F8E4M3, KVQuantMode::Fp8PerTokenHead};
const KVStorage kInt8{DType::I8, KVQuantMode::Int8PerTokenHead};
const KVStorage kInt4{DType::I4, KVQuantMode::Int4PerTokenHead};
const KVStorage kFp8{DType::F8E4M3, KVQuantMode::Fp8PerTensor};

}  // namespace

TEST(KVPlanFile, ParsesEveryField) {
  const KVPlanFile f = plan_of(R"([
      {"layer": 0, "k": "bfloat16", "v": "int8_per_token_head"},
      {"layer": 3, "k": "int8_per_token_head", "v": "int4_per_token_head", "rotation": {"k": "none", "v": "hadamard"},
       "rotation_seed": 3, "keep_sink": 4, "keep_recent": 16},
      {"layer": 1, "rotation": "hadamard", "k": "auto"},
      {"model": "draft", "layer": 0, "k": "fp8_per_token_head"}])",
                               R"("model": {"architecture": "Qwen3ForCausalLM", "num_layers": 4, "name": "x"}, "calibration": {"kld": 1e-4}, )");
  EXPECT_EQ(f.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(f.num_layers, 4);
  ASSERT_EQ(f.entries.size(), 4u);
  const KVPlanEntry* e = f.find("target", 3);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->k, KVCacheDType::Int8PerTokenHead);
  EXPECT_EQ(e->v, KVCacheDType::Int4PerTokenHead);
  EXPECT_EQ(e->rotate_k, false);
  EXPECT_EQ(e->rotate_v, true);
  EXPECT_EQ(e->rotation_seed, 3u);
  EXPECT_EQ(e->keep_sink, 4);
  EXPECT_EQ(e->keep_recent, 16);
  const KVPlanEntry* one = f.find("target", 1);
  ASSERT_NE(one, nullptr);
  EXPECT_FALSE(one->k.has_value());  // "auto": the same as leaving the side out
  EXPECT_EQ(one->rotate_k, true);
  EXPECT_EQ(one->rotate_v, true);
  EXPECT_NE(f.find("draft", 0), nullptr);
  EXPECT_EQ(f.find("draft", 1), nullptr);
  EXPECT_EQ(f.find("target", 2), nullptr);
  // The writer's JSON reads back to the same entries.
  const KVPlanFile back = parse_kv_plan_file(kv_plan_file_json(f).dump(), "back.json");
  ASSERT_EQ(back.entries.size(), f.entries.size());
  for (size_t i = 0; i < f.entries.size(); ++i) {
    const auto &a = f.entries[i], &b = back.entries[i];
    EXPECT_EQ(a.model, b.model);
    EXPECT_EQ(a.layer, b.layer);
    EXPECT_EQ(a.k, b.k);
    EXPECT_EQ(a.v, b.v);
    EXPECT_EQ(a.rotate_k, b.rotate_k);
    EXPECT_EQ(a.rotate_v, b.rotate_v);
    EXPECT_EQ(a.rotation_seed, b.rotation_seed);
    EXPECT_EQ(a.keep_sink, b.keep_sink);
    EXPECT_EQ(a.keep_recent, b.keep_recent);
  }
  EXPECT_EQ(back.calibration["kld"], 1e-4);
}

TEST(KVPlanFile, MalformedFilesSayWhatIsWrong) {
  const struct {
    std::string text, want;
  } bad[] = {
      {"{", "is not valid JSON"},
      {"[]", "must hold a JSON object"},
      {R"({"layers": []})", "no \"kvlm_kv_plan\""},
      {R"({"kvlm_kv_plan": 2, "layers": []})", "this kvlm reads version 1"},
      {R"({"kvlm_kv_plan": 1})", "no \"layers\" array"},
      {R"({"kvlm_kv_plan": 1, "layers": {}})", "must be an array"},
      {R"({"kvlm_kv_plan": 1, "layers": [], "layer": []})", "unknown key \"layer\""},
      {R"({"kvlm_kv_plan": 1, "layers": [{"k": "fp8"}]})", "layers[0] has no \"layer\""},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": -1}]})", "layers[0] \"layer\" must be in [0"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": "1"}]})", "must be an integer"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "k": "int3"}]})",
       "KV plan file p.json: layers[0] \"k\": invalid dtype 'int3'; valid values are: auto"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "v": 8}]})", "must be a KV cache dtype string"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "rotation": "yes"}]})", "must be \"none\" or \"hadamard\""},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "rotation": {"q": "none"}}]})", "unknown side \"q\""},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "keep_sink": -4}]})", "\"keep_sink\" must be in [0, 65536]"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "keep_sinks": 4}]})", "unknown key \"keep_sinks\""},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1}, {"layer": 1}]})", "layer 1 appears twice"},
      {R"({"kvlm_kv_plan": 1, "layers": [{"layer": 1, "model": ""}]})", "must be a model name"},
  };
  for (const auto& b : bad) {
    const std::string msg = error_of([&] { parse_kv_plan_file(b.text, "p.json"); });
    EXPECT_NE(msg.find(b.want), std::string::npos) << b.text << " -> " << msg;
    EXPECT_NE(msg.find("p.json"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([] { load_kv_plan_file("/nonexistent/plan.json"); }).find("cannot read KV plan file"),
            std::string::npos);
}

// Side by side: a plan entry's side beats the explicit dtype, which beats the checkpoint's
// scheme, which beats the model dtype; a side the entry leaves out falls through; the skip
// rule is below the plan file.
TEST(BuildKVPlan, PlanFileTopsThePrecedenceSideBySide) {
  const auto ls = layers4();
  const CheckpointKVScheme scheme{.origin = "compressed-tensors kv_cache_scheme", .storage = kFp8};
  const ScaleLookup scales = [](const AttentionLayerDesc&) {
    return std::optional(CheckpointScales{{0.5f}, {0.25f}, "k_scale", "v_scale"});
  };
  CacheConfig c;
  c.set_kv_dtypes({KVCacheDType::Int8PerTokenHead, KVCacheDType::Auto});  // K explicit, V the checkpoint's
  c.skip_layers = parse_skip_layers("2");
  c.plan_file = plan_of(R"([{"layer": 0, "k": "bfloat16", "v": "int4_per_token_head"},
                            {"layer": 1, "v": "fp8_per_token_head"},
                            {"layer": 2, "k": "int8_per_token_head"}])");
  const KVPlan p = build_kv_plan(c, ls, DType::BF16, scheme, scales);
  ASSERT_EQ(p.layers.size(), 4u);
  // Layer 0: both sides from the plan.
  EXPECT_EQ(p.layers[0].k, kBF16);
  EXPECT_EQ(p.layers[0].v, kInt4);
  EXPECT_EQ(p.layers[0].dtype_source, DTypeSource::PlanFile);
  EXPECT_EQ(p.layers[0].v_dtype_source, DTypeSource::PlanFile);
  EXPECT_TRUE(p.layers[0].from_plan_file);
  // Layer 1: V from the plan, K explicit.
  EXPECT_EQ(p.layers[1].k, kInt8);
  EXPECT_EQ(p.layers[1].v, kFp8Pth);
  EXPECT_EQ(p.layers[1].dtype_source, DTypeSource::Explicit);
  EXPECT_EQ(p.layers[1].v_dtype_source, DTypeSource::PlanFile);
  // Layer 2: skipped by the rule, but the plan names its K.
  EXPECT_EQ(p.layers[2].k, kInt8);
  EXPECT_EQ(p.layers[2].dtype_source, DTypeSource::PlanFile);
  EXPECT_EQ(p.layers[2].v, kBF16);
  EXPECT_EQ(p.layers[2].v_dtype_source, DTypeSource::SkipRule);
  // Layer 3: not in the plan: K explicit, V from the checkpoint with its calibrated scale.
  EXPECT_FALSE(p.layers[3].from_plan_file);
  EXPECT_EQ(p.layers[3].k, kInt8);
  EXPECT_EQ(p.layers[3].v, kFp8);
  EXPECT_EQ(p.layers[3].v_dtype_source, DTypeSource::CheckpointScheme);
  EXPECT_EQ(p.layers[3].v_scale_for(0), 0.25f);
  EXPECT_EQ(kv_layer_json(p.layers[1])["v_dtype_source"], "plan file");
  EXPECT_EQ(kv_layer_json(p.layers[1])["dtype_source"], "explicit");
  // The bytes are the real ones: layer 0 holds bf16 K (2 x 64 B) and int4 V (2 x (16 + 4) B).
  EXPECT_EQ(p.layers[0].bytes_per_token(), 2u * 64 + 2u * 20);
}

// Rotation per side: the plan's choice, else auto's (the quantized sides of a 4-bit layer);
// the seed reaches the spec; exact tokens per layer.
TEST(BuildKVPlan, PlanFileRotationSeedsAndExactTokens) {
  const auto ls = layers4();
  CacheConfig c;
  c.kv_cache_dtype = KVCacheDType::Int8PerTokenHead;
  c.keep_sink = 4;
  c.plan_file = plan_of(R"([{"layer": 0, "v": "int4_per_token_head"},
                            {"layer": 1, "rotation": {"k": "hadamard"}, "rotation_seed": 9, "keep_sink": 0, "keep_recent": 32},
                            {"layer": 2, "k": "fp8_per_token_head", "v": "int4_per_token_head", "rotation": {"k": "none"}},
                            {"layer": 3, "k": "bfloat16", "v": "bfloat16"}])");
  const KVPlan p = build_kv_plan(c, ls, DType::BF16, std::nullopt, {});
  // Layer 0: K int8, V int4 -> auto rotates both quantized sides.
  EXPECT_TRUE(p.layers[0].rotate_k);
  EXPECT_TRUE(p.layers[0].rotate_v);
  EXPECT_EQ(p.layers[0].rotation_seed, 0u);
  EXPECT_EQ(p.layers[0].keep_sink, 4);  // the flag's
  // Layer 1: int8 on both sides; the plan rotates K only, with seed 9, and keeps its own tokens.
  EXPECT_TRUE(p.layers[1].rotate_k);
  EXPECT_FALSE(p.layers[1].rotate_v);
  EXPECT_EQ(p.layers[1].rotation_seed, 9u);
  EXPECT_EQ(p.layers[1].keep_sink, 0);
  EXPECT_EQ(p.layers[1].keep_recent, 32);
  EXPECT_EQ(kv_rotation_text(p.layers[1]), "hadamard_k");
  // Layer 2: the plan keeps K unrotated; auto still rotates the int4 V.
  EXPECT_FALSE(p.layers[2].rotate_k);
  EXPECT_TRUE(p.layers[2].rotate_v);
  // Layer 3: 16-bit: no rotation, no exact tokens.
  EXPECT_FALSE(p.layers[3].rotates());
  EXPECT_FALSE(p.layers[3].keeps_exact());
  EXPECT_EQ(p.keep_sink(), 4);
  EXPECT_EQ(p.keep_recent(), 32);
}

TEST(BuildKVPlan, PlanFileErrorsNameTheLayer) {
  const auto ls = layers4();
  auto build = [&](const std::string& layers, const std::string& extra = "", int head_dim = 32) {
    CacheConfig c;
    c.kv_cache_dtype = KVCacheDType::Int8PerTokenHead;
    c.plan_file = plan_of(layers, extra);
    auto l = ls;
    for (auto& a : l) a.head_dim = head_dim;
    return error_of([&] { build_kv_plan(c, l, DType::BF16, std::nullopt, {}); });
  };
  EXPECT_NE(build(R"([{"layer": 7}])").find("names layer 7, but the target model has layers 0..3"), std::string::npos);
  EXPECT_NE(build("[]", R"("model": {"num_layers": 30}, )").find("written for a model with 30 layers; this one has 4"),
            std::string::npos);
  EXPECT_NE(build(R"([{"layer": 1, "k": "bfloat16", "rotation": "hadamard"}])")
                .find("p.json: layer 1 asks for a Hadamard rotation of K, which is held in bfloat16"),
            std::string::npos);
  EXPECT_NE(build(R"([{"layer": 1, "rotation": "hadamard"}])", "", 40).find("needs a power-of-two head_dim"),
            std::string::npos);
  EXPECT_NE(build(R"([{"layer": 2, "k": "bfloat16", "v": "bfloat16", "keep_sink": 4}])")
                .find("layer 2 keeps exact sink / recent tokens, but its K and V are held unquantized"),
            std::string::npos);
  // A drafter's entries are left for the drafter's plan; with none, plan_model refuses them.
  EXPECT_EQ(build(R"([{"model": "draft", "layer": 0}])"), "");
}

// kv_plan_file_of writes what reproduces the plan: fed back under default options, every
// layer resolves to the same formats, rotation, seed and exact tokens.
TEST(BuildKVPlan, WrittenPlanReproducesTheResolvedOne) {
  const auto ls = layers4();
  CacheConfig c;
  c.set_kv_dtypes({KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead});
  c.skip_layers = parse_skip_layers("sliding_window");
  c.keep_recent = 8;
  c.plan_file = plan_of(R"([{"layer": 3, "rotation_seed": 5}])");
  const KVPlan want = build_kv_plan(c, ls, DType::BF16, std::nullopt, {});
  CacheConfig d;
  d.plan_file = parse_kv_plan_file(kv_plan_file_json(kv_plan_file_of(want, "Qwen3ForCausalLM", 4)).dump(), "w.json");
  const KVPlan got = build_kv_plan(d, ls, DType::BF16, std::nullopt, {});
  ASSERT_EQ(got.layers.size(), want.layers.size());
  for (size_t i = 0; i < got.layers.size(); ++i) {
    const auto &a = got.layers[i], &b = want.layers[i];
    EXPECT_EQ(a.k, b.k) << i;
    EXPECT_EQ(a.v, b.v) << i;
    EXPECT_EQ(a.rotate_k, b.rotate_k) << i;
    EXPECT_EQ(a.rotate_v, b.rotate_v) << i;
    EXPECT_EQ(a.rotation_seed, b.rotation_seed) << i;
    EXPECT_EQ(a.keep_sink, b.keep_sink) << i;
    EXPECT_EQ(a.keep_recent, b.keep_recent) << i;
    EXPECT_EQ(a.dtype_source, DTypeSource::PlanFile) << i;
  }
  EXPECT_EQ(got.layers[3].rotation_seed, 5u);
  EXPECT_EQ(got.bytes_per_token(), want.bytes_per_token());
  // A float32 side has no dtype name: left out, it follows the model dtype again.
  CacheConfig q;
  q.set_kv_dtypes({KVCacheDType::Auto, KVCacheDType::Int8PerTokenHead});
  const KVPlan f32 = build_kv_plan(q, ls, DType::F32, std::nullopt, {});
  const KVPlanFile w = kv_plan_file_of(f32, "x", 4);
  EXPECT_FALSE(w.entries[0].k.has_value());
  EXPECT_EQ(w.entries[0].v, KVCacheDType::Int8PerTokenHead);
  CacheConfig back;
  back.plan_file = w;
  const KVPlan again = build_kv_plan(back, ls, DType::F32, std::nullopt, {});
  EXPECT_EQ(again.layers[0].k, (KVStorage{DType::F32, KVQuantMode::None}));
  EXPECT_EQ(again.layers[0].dtype_source, DTypeSource::ModelDType);
  EXPECT_EQ(again.bytes_per_token(), f32.bytes_per_token());
}

// The KV plan: precedence (explicit > checkpoint scheme > model dtype), skip rules, scale
// sources, exact bytes per token, and one plan for target and draft layers alike.
#include <gtest/gtest.h>

#include "kv/kv_plan.h"
#include "core/error.h"

using namespace kvlm;

namespace {

std::vector<AttentionLayerDesc> mixed_layers() {
  // Qwen3-like: 4 layers alternating sliding(8) / full, 2 kv heads of 32.
  std::vector<AttentionLayerDesc> v;
  for (int i = 0; i < 4; ++i)
    v.push_back({.layer = i, .kind = i % 2 == 0 ? AttentionKind::Sliding : AttentionKind::Full, .window = i % 2 == 0 ? 8 : 0,
                 .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 32});
  return v;
}

CheckpointKVScheme fp8_scheme() {
  return {.origin = "compressed-tensors kv_cache_scheme", .storage = KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}};
}

CacheConfig with(KVCacheDType d, std::string_view skip = "") {
  CacheConfig c;
  c.kv_cache_dtype = d;
  c.skip_layers = parse_skip_layers(skip);
  return c;
}

}  // namespace

// Table: requested x checkpoint scheme x model dtype -> storage and source.
TEST(ResolveKVDType, Precedence) {
  struct Row {
    KVCacheDType req;
    bool scheme;
    DType model;
    KVStorage want;
    DTypeSource src;
  };
  const KVStorage fp8{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
  const Row rows[] = {
      {KVCacheDType::Auto, false, DType::BF16, {DType::BF16, KVQuantMode::None}, DTypeSource::ModelDType},
      {KVCacheDType::Auto, false, DType::F16, {DType::F16, KVQuantMode::None}, DTypeSource::ModelDType},
      {KVCacheDType::Auto, false, DType::F32, {DType::F32, KVQuantMode::None}, DTypeSource::ModelDType},
      {KVCacheDType::Auto, true, DType::BF16, fp8, DTypeSource::CheckpointScheme},
      // seed 002: an explicit bfloat16 beats a checkpoint that declares fp8.
      {KVCacheDType::BFloat16, true, DType::BF16, {DType::BF16, KVQuantMode::None}, DTypeSource::Explicit},
      {KVCacheDType::Float16, true, DType::BF16, {DType::F16, KVQuantMode::None}, DTypeSource::Explicit},
      {KVCacheDType::Fp8E5M2, true, DType::BF16, {DType::F8E5M2, KVQuantMode::Fp8PerTensor}, DTypeSource::Explicit},
      {KVCacheDType::Int8PerTokenHead, true, DType::BF16, {DType::I8, KVQuantMode::Int8PerTokenHead}, DTypeSource::Explicit},
      {KVCacheDType::Fp8, false, DType::F32, fp8, DTypeSource::Explicit},
  };
  for (const Row& r : rows) {
    const auto res = resolve_kv_dtype(r.req, r.scheme ? std::optional(fp8_scheme()) : std::nullopt, r.model);
    EXPECT_EQ(res.storage, r.want) << kv_cache_dtype_name(r.req);
    EXPECT_EQ(res.source, r.src) << kv_cache_dtype_name(r.req);
    if (r.scheme && r.src == DTypeSource::Explicit) EXPECT_NE(res.note.find("overrides"), std::string::npos);
  }
}

TEST(ResolveKVDType, UnsupportedSchemeNeedsExplicitChoice) {
  CheckpointKVScheme s{.origin = "modelopt kv_cache_quant_algo", .unsupported_reason = "declares NVFP4"};
  try {
    resolve_kv_dtype(KVCacheDType::Auto, s, DType::BF16);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--kv-cache-dtype"), std::string::npos);
  }
  EXPECT_EQ(resolve_kv_dtype(KVCacheDType::BFloat16, s, DType::BF16).storage.storage, DType::BF16);
}

TEST(KVPlan, SkipSlidingWindowLayers) {
  const auto layers = mixed_layers();
  const KVPlan p = build_kv_plan(with(KVCacheDType::Fp8, "sliding_window"), layers, DType::BF16, std::nullopt, {});
  ASSERT_EQ(p.layers.size(), 4u);
  for (const auto& l : p.layers) {
    if (l.attn.kind == AttentionKind::Sliding) {
      EXPECT_EQ(l.k.storage, DType::BF16);
      EXPECT_EQ(l.k.mode, KVQuantMode::None);
      EXPECT_EQ(l.dtype_source, DTypeSource::SkipRule);
      EXPECT_EQ(l.scale_source, ScaleSource::None);
      EXPECT_EQ(l.bytes_per_token(), 2u * 2 * 32 * 2);
    } else {
      EXPECT_EQ(l.k.storage, DType::F8E4M3);
      EXPECT_EQ(l.k.mode, KVQuantMode::Fp8PerTensor);
      EXPECT_EQ(l.dtype_source, DTypeSource::Explicit);
      EXPECT_EQ(l.scale_source, ScaleSource::Default);
      EXPECT_EQ(l.bytes_per_token(), 2u * 2 * 32 * 1);
    }
  }
  EXPECT_EQ(p.bytes_per_token(), 2u * 256 + 2u * 128);
  ASSERT_EQ(p.warnings.size(), 1u);  // one warning for all defaulted layers, not one per layer
  EXPECT_NE(p.warnings[0].find("2 of 4 layers"), std::string::npos);
}

TEST(KVPlan, SkipIndicesAndRangeCheck) {
  const auto layers = mixed_layers();
  const KVPlan p = build_kv_plan(with(KVCacheDType::Int8PerTokenHead, "0,3"), layers, DType::F16, std::nullopt, {});
  EXPECT_EQ(p.layers[0].k.storage, DType::F16);
  EXPECT_EQ(p.layers[1].k.storage, DType::I8);
  EXPECT_EQ(p.layers[1].scale_source, ScaleSource::PerTokenHeadDynamic);
  // int8 codes + one fp32 scale per (token, head) for K and for V.
  EXPECT_EQ(p.layers[1].bytes_per_token(), 2u * 2 * 32 + 2u * 2 * 4);
  EXPECT_EQ(p.layers[3].k.storage, DType::F16);
  try {
    build_kv_plan(with(KVCacheDType::Fp8, "4"), layers, DType::BF16, std::nullopt, {});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("layer 4 but the model has 4 layers"), std::string::npos);
  }
  // Skip rules do not touch an unquantized plan.
  const KVPlan q = build_kv_plan(with(KVCacheDType::Float16, "0,sliding_window"), layers, DType::BF16, std::nullopt, {});
  for (const auto& l : q.layers) EXPECT_EQ(l.dtype_source, DTypeSource::Explicit);
}

TEST(KVPlan, ParseSkipLayers) {
  auto s = parse_skip_layers("0, 5,sliding_window");
  EXPECT_EQ(s.indices, (std::vector<int>{0, 5}));
  EXPECT_TRUE(s.sliding_window);
  EXPECT_TRUE(parse_skip_layers("").empty());
  for (const char* bad : {"-1", "x", "1.5", "sliding", "full_attention", "3a"}) EXPECT_THROW(parse_skip_layers(bad), Error) << bad;
}

TEST(KVPlan, CheckpointScalesAndSchemeFromCheckpoint) {
  const auto layers = mixed_layers();
  const ScaleLookup scales = [](const AttentionLayerDesc& l) -> std::optional<CheckpointScales> {
    if (l.layer == 2) return std::nullopt;
    if (l.layer == 3) return CheckpointScales{{0.5f, 0.25f}, {2.0f, 4.0f}, "k3", "v3"};  // per kv head
    return CheckpointScales{{0.125f}, {0.0625f}, "model.layers.N.self_attn.k_scale", "model.layers.N.self_attn.v_scale"};
  };
  const KVPlan p = build_kv_plan(with(KVCacheDType::Auto), layers, DType::BF16, fp8_scheme(), scales);
  EXPECT_EQ(p.resolution.source, DTypeSource::CheckpointScheme);
  EXPECT_EQ(p.layers[0].scale_source, ScaleSource::CheckpointTensor);
  EXPECT_FLOAT_EQ(p.layers[0].k_scale_for(1), 0.125f);
  EXPECT_EQ(p.layers[2].scale_source, ScaleSource::Default);
  EXPECT_FLOAT_EQ(p.layers[2].k_scale_for(0), 1.0f);
  EXPECT_FLOAT_EQ(p.layers[3].k_scale_for(1), 0.25f);
  EXPECT_FLOAT_EQ(p.layers[3].v_scale_for(0), 2.0f);
  EXPECT_EQ(p.warnings.size(), 1u);
  // The same checkpoint with an explicit bfloat16: no scales used, nothing quantized.
  const KVPlan b = build_kv_plan(with(KVCacheDType::BFloat16), layers, DType::BF16, fp8_scheme(), scales);
  for (const auto& l : b.layers) {
    EXPECT_EQ(l.k.storage, DType::BF16);
    EXPECT_EQ(l.scale_source, ScaleSource::None);
  }
  // Malformed scales are rejected with the tensor's name.
  const ScaleLookup bad = [](const AttentionLayerDesc&) -> std::optional<CheckpointScales> {
    return CheckpointScales{{0.0f}, {1.0f}, "bad.k_scale", "bad.v_scale"};
  };
  EXPECT_THROW(build_kv_plan(with(KVCacheDType::Fp8), layers, DType::BF16, std::nullopt, bad), Error);
  const ScaleLookup wrong_count = [](const AttentionLayerDesc&) -> std::optional<CheckpointScales> {
    return CheckpointScales{{1.0f, 1.0f, 1.0f}, {1.0f}, "k", "v"};
  };
  EXPECT_THROW(build_kv_plan(with(KVCacheDType::Fp8), layers, DType::BF16, std::nullopt, wrong_count), Error);
}

// seed 000: a draft model's non-causal layers get their spec from the same function, with
// the same cache options, and a quantized mode stays quantized.
TEST(KVPlan, DraftLayersShareThePlan) {
  auto layers = mixed_layers();
  for (int i = 0; i < 2; ++i)
    layers.push_back({.model = "dflash", .layer = i, .kind = AttentionKind::NonCausal, .num_q_heads = 4, .num_kv_heads = 2,
                      .head_dim = 32});
  const KVPlan p = build_kv_plan(with(KVCacheDType::Fp8PerTokenHead, "0"), layers, DType::BF16, std::nullopt, {});
  ASSERT_EQ(p.layers.size(), 6u);
  EXPECT_EQ(p.layers[0].k.storage, DType::BF16);  // target layer 0 skipped
  EXPECT_EQ(p.layers[4].attn.model, "dflash");
  EXPECT_EQ(p.layers[4].k.storage, DType::F8E4M3);  // draft layer 0 is not the target's layer 0
  EXPECT_EQ(p.layers[4].k.mode, KVQuantMode::Fp8PerTokenHead);
  EXPECT_EQ(p.layers[5].attn.kind, AttentionKind::NonCausal);
}

// int4 and the rotation: --kv-cache-rotation auto rotates the 4-bit layers only (the skip
// rule's layers are unquantized and never rotate), hadamard every quantized layer, none none;
// a head_dim the packing or the transform cannot take is an error naming the layer, and the
// rotation never silently meets per-tensor scales calibrated on unrotated K/V.
TEST(KVPlan, Int4AndRotation) {
  const auto layers = mixed_layers();
  CacheConfig c = with(KVCacheDType::Int4PerTokenHead, "1");
  KVPlan p = build_kv_plan(c, layers, DType::BF16, std::nullopt, {});
  EXPECT_EQ(p.layers[0].k.storage, DType::I4);
  EXPECT_TRUE(p.layers[0].rotates());
  EXPECT_FALSE(p.layers[1].rotates());  // skipped: bf16
  EXPECT_EQ(p.layers[0].bytes_per_token(), 2u * 2 * 16 + 2u * 2 * 4);  // 32 codes in 16 bytes + a 4-byte slot, K and V
  c.rotation = KVRotation::None;
  p = build_kv_plan(c, layers, DType::BF16, std::nullopt, {});
  EXPECT_FALSE(p.layers[0].rotates());
  // Explicit hadamard reaches the 8-bit formats; auto does not.
  EXPECT_FALSE(build_kv_plan(with(KVCacheDType::Int8PerTokenHead), layers, DType::BF16, std::nullopt, {}).layers[0].rotates());
  c = with(KVCacheDType::Fp8PerTokenHead, "sliding_window");
  c.rotation = KVRotation::Hadamard;
  p = build_kv_plan(c, layers, DType::BF16, std::nullopt, {});
  EXPECT_FALSE(p.layers[0].rotates());  // sliding: skipped, bf16
  EXPECT_TRUE(p.layers[1].rotates());
  // Per-tensor scales from the checkpoint were calibrated unrotated: refused with the rotation.
  c = with(KVCacheDType::Fp8);
  c.rotation = KVRotation::Hadamard;
  const ScaleLookup found = [](const AttentionLayerDesc&) {
    return std::optional<CheckpointScales>(CheckpointScales{{0.5f}, {0.5f}, "k_scale", "v_scale"});
  };
  EXPECT_THROW(build_kv_plan(c, layers, DType::BF16, std::nullopt, found), Error);
  // head_dim 20: int4 needs whole 8-code words; head_dim 40: the transform needs a power of two.
  auto odd = layers;
  for (auto& l : odd) l.head_dim = 20;
  EXPECT_THROW(build_kv_plan(with(KVCacheDType::Int4PerTokenHead), odd, DType::BF16, std::nullopt, {}), Error);
  for (auto& l : odd) l.head_dim = 40;
  p = build_kv_plan(with(KVCacheDType::Int4PerTokenHead), odd, DType::BF16, std::nullopt, {});
  EXPECT_FALSE(p.layers[0].rotates());
  ASSERT_EQ(p.warnings.size(), 1u);
  EXPECT_NE(p.warnings[0].find("not rotated"), std::string::npos);
  c = with(KVCacheDType::Int8PerTokenHead);
  c.rotation = KVRotation::Hadamard;
  EXPECT_THROW(build_kv_plan(c, odd, DType::BF16, std::nullopt, {}), Error);
  EXPECT_EQ(parse_kv_rotation("hadamard"), KVRotation::Hadamard);
  EXPECT_THROW(parse_kv_rotation("walsh"), Error);
}

// K and V apart: the text forms, and each side resolving by the precedence rule on its own.
TEST(KVCacheDTypes, ParsesOneDTypeOrKAndVApart) {
  EXPECT_EQ(parse_kv_cache_dtypes("fp8"), (KVCacheDTypes{KVCacheDType::Fp8, std::nullopt}));
  EXPECT_EQ(parse_kv_cache_dtypes("k=int8_per_token_head,v=int4_per_token_head"),
            (KVCacheDTypes{KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}));
  EXPECT_EQ(parse_kv_cache_dtypes("v=int4_per_token_head,k=bfloat16"),
            (KVCacheDTypes{KVCacheDType::BFloat16, KVCacheDType::Int4PerTokenHead}));
  EXPECT_EQ(parse_kv_cache_dtypes("k=int8_per_token_head"), (KVCacheDTypes{KVCacheDType::Int8PerTokenHead, KVCacheDType::Auto}));
  EXPECT_EQ(parse_kv_cache_dtypes("v=fp8"), (KVCacheDTypes{KVCacheDType::Auto, KVCacheDType::Fp8}));
  for (const char* bad : {"k=", "k=int8", "q=fp8", "k=fp8,k=fp8", "k=fp8,", "=fp8", "k fp8", ""})
    EXPECT_THROW(parse_kv_cache_dtypes(bad), Error) << bad;
  for (const std::string t : {"auto", "fp8", "k=int8_per_token_head,v=auto", "k=bfloat16,v=int4_per_token_head"})
    EXPECT_EQ(kv_cache_dtypes_text(parse_kv_cache_dtypes(t)), t);
  try {
    parse_kv_cache_dtypes("k=fp8,v=int3", "kv_cache_dtype");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid kv_cache_dtype v= 'int3'; valid values are: auto"), std::string::npos) << e.what();
  }
}

TEST(BuildKVPlan, KAndVResolveApart) {
  const auto ls = mixed_layers();
  CacheConfig c;
  c.set_kv_dtypes({KVCacheDType::Int8PerTokenHead, KVCacheDType::Auto});
  // V auto follows the checkpoint's FP8 scheme (and gets its per-tensor scales); K is explicit.
  const ScaleLookup scales = [](const AttentionLayerDesc&) {
    return std::optional(CheckpointScales{{0.5f}, {0.25f}, "k_scale", "v_scale"});
  };
  KVPlan p = build_kv_plan(c, ls, DType::BF16, fp8_scheme(), scales);
  EXPECT_EQ(p.resolution.source, DTypeSource::Explicit);
  EXPECT_EQ(p.v_resolution.source, DTypeSource::CheckpointScheme);
  for (const auto& l : p.layers) {
    EXPECT_EQ(l.k, (KVStorage{DType::I8, KVQuantMode::Int8PerTokenHead}));
    EXPECT_EQ(l.v, (KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}));
    EXPECT_EQ(l.v_scale_for(1), 0.25f);
    EXPECT_EQ(l.bytes_per_token(), size_t(2 * (32 + 4) + 2 * 32));
  }
  EXPECT_EQ(describe_kv_resolution(p), "K int8 int8_per_token_head, V fp8_e4m3 fp8_per_tensor");
  EXPECT_EQ(kv_layer_json(p.layers[0])["v_dtype"], "fp8_e4m3");
  // Without a scheme, V auto is the model dtype; the skip rule keeps both sides at it.
  c = with(KVCacheDType::Auto, "0");
  c.v_cache_dtype = KVCacheDType::Int4PerTokenHead;
  p = build_kv_plan(c, ls, DType::BF16, std::nullopt, {});
  EXPECT_EQ(p.layers[0].k, (KVStorage{DType::BF16, KVQuantMode::None}));
  EXPECT_EQ(p.layers[0].v, (KVStorage{DType::BF16, KVQuantMode::None}));  // layer 0 skipped
  EXPECT_EQ(p.layers[1].k, (KVStorage{DType::BF16, KVQuantMode::None}));
  EXPECT_EQ(p.layers[1].v, (KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead}));
  // auto rotates the quantized sides of a layer with a 4-bit side: V here, K is bf16
  EXPECT_FALSE(p.layers[1].rotate_k);
  EXPECT_TRUE(p.layers[1].rotate_v);
  EXPECT_EQ(kv_layer_json(p.layers[1])["rotation"], "hadamard_v");
  EXPECT_FALSE(kv_layer_json(p.layers[0]).contains("v_dtype"));
  EXPECT_EQ(describe_kv_resolution(p), "K bfloat16, V int4 int4_per_token_head");
}

// Paged KV storage: exact per-layer sizes, quantize-on-write per format.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "attention/cpu_backend.h"
#include "kv/kv_format.h"
#include "core/numeric.h"
#include "kv/kv_cache.h"

using namespace kvlm;

TEST(KVCache, EachLayerSizedForItsOwnSpec) {
  // 3 layers: bf16 (skipped), fp8 per-tensor, int8 per-token-head; 2 kv heads of 64.
  std::vector<AttentionLayerDesc> layers;
  for (int i = 0; i < 3; ++i) layers.push_back({.layer = i, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 64});
  CacheConfig c;
  c.kv_cache_dtype = KVCacheDType::Fp8;
  c.skip_layers = parse_skip_layers("0");
  KVPlan plan = build_kv_plan(c, layers, DType::BF16, std::nullopt, {});
  plan.layers[2].k = plan.layers[2].v = KVStorage{DType::I8, KVQuantMode::Int8PerTokenHead};  // a mixed plan
  KVCache cache(plan, 10, 16);
  EXPECT_EQ(cache.layer(0).bytes(), 10u * 16 * 2 * 2 * 64 * 2);
  EXPECT_EQ(cache.layer(1).bytes(), 10u * 16 * 2 * 2 * 64 * 1);
  EXPECT_EQ(cache.layer(2).bytes(), 10u * 16 * (2 * 2 * 64 * 1 + 2 * 2 * 4));
  EXPECT_TRUE(cache.layer(1).k_scale.empty());
  EXPECT_EQ(cache.bytes(), 10u * 16 * plan.bytes_per_token());
  // K and V apart: K int8 with its fp32 scales, V int4 (half the codes) with its step/zero slots.
  plan.layers[2].v = KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead};
  KVCache split(plan, 10, 16);
  EXPECT_EQ(split.layer(2).k.size(), 10u * 16 * 2 * 64);
  EXPECT_EQ(split.layer(2).v.size(), 10u * 16 * 2 * 32);
  EXPECT_EQ(split.layer(2).k_scale.size(), 10u * 16 * 2);
  EXPECT_EQ(split.layer(2).v_scale.size(), 10u * 16 * 2);
  EXPECT_EQ(plan.layers[2].bytes_per_token(), size_t(2 * (64 + 4) + 2 * (32 + 4)));
  EXPECT_EQ(split.bytes(), 10u * 16 * plan.bytes_per_token());
}

TEST(KVCache, StoreQuantizesPerFormat) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (KVCacheDType dt : {KVCacheDType::BFloat16, KVCacheDType::Float16, KVCacheDType::Fp8E4M3, KVCacheDType::Fp8E5M2,
                          KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    CacheConfig c;
    c.kv_cache_dtype = dt;
    const AttentionLayerDesc desc{.num_q_heads = 2, .num_kv_heads = 2, .head_dim = 16};
    KVPlan plan = build_kv_plan(c, {&desc, 1}, DType::BF16, std::nullopt, {});
    if (plan.layers[0].k.mode == KVQuantMode::Fp8PerTensor) plan.layers[0].k_scale = {0.5f, 0.25f};  // per kv head
    KVCache cache(plan, 4, 8);
    std::vector<float> k(3 * 2 * 16), v(k.size());
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    const std::vector<SlotId> slots{5, 17, 30};  // blocks 0, 2, 3
    CpuAttentionBackend().store_kv(cache.layer(0), {.k = k, .v = v, .slots = slots});
    const LayerKVCache& L = cache.layer(0);
    const KVLayerSpec& s = plan.layers[0];
    for (size_t i = 0; i < slots.size(); ++i) {
      for (int g = 0; g < 2; ++g) {
        const int64_t blk = slots[i] / 8;
        const int off = int(slots[i] % 8);
        const float* src = k.data() + (i * 2 + size_t(g)) * 16;
        float amax = 0, lo = src[0], hi = src[0];
        for (int x = 0; x < 16; ++x) {
          amax = std::max(amax, std::fabs(src[x]));
          lo = std::min(lo, src[x]);
          hi = std::max(hi, src[x]);
        }
        std::vector<float> row(16);
        float scale = s.k_scale_for(g), step = 0, zero = 0;
        if (s.k.mode == KVQuantMode::Int4PerTokenHead) {
          scale = L.k_scale[L.scale_index(blk, g, off)];  // the packed {f16 step, f16 zero} slot
          kvfmt::I4::unpack(scale, step, zero);
          EXPECT_EQ(step, num::f16_to_f32(num::f32_to_f16((hi - lo) / 15)));
          EXPECT_EQ(zero, num::f16_to_f32(num::f32_to_f16(lo)));
        } else if (is_per_token_head(s.k.mode)) {
          scale = L.k_scale[L.scale_index(blk, g, off)];
          const float qmax = s.k.mode == KVQuantMode::Int8PerTokenHead ? 127.0f : 448.0f;
          EXPECT_FLOAT_EQ(scale, amax / qmax);  // absmax / qmax, stored fp32
        }
        kvfmt::dispatch_kv(s.k.storage, s.k.mode, [&](auto fmt) {
          decltype(fmt)::decode_row(L.k.data() + L.row_byte(KVSide::K, blk, g, off), scale, row);
        });
        for (int x = 0; x < 16; ++x) {
          const float e = std::fabs(row[size_t(x)] - src[x]);
          switch (s.k.mode) {
            case KVQuantMode::None:
              EXPECT_LE(e, std::fabs(src[x]) * (s.k.storage == DType::BF16 ? 1.0f / 256 : 1.0f / 2048)) << dtype_name(s.k.storage);
              break;
            case KVQuantMode::Fp8PerTensor:  // relative half-ulp, or half the subnormal step
              EXPECT_LE(e, std::max(std::fabs(src[x]) * (s.k.storage == DType::F8E4M3 ? 1.0f / 16 : 1.0f / 8),
                                    scale * (s.k.storage == DType::F8E4M3 ? std::ldexp(1.0f, -10) : std::ldexp(1.0f, -17))));
              break;
            case KVQuantMode::Fp8PerTokenHead:
              EXPECT_LE(e, std::max(std::fabs(src[x]) / 16, scale * std::ldexp(1.0f, -10)));
              break;
            case KVQuantMode::Int8PerTokenHead:
              EXPECT_LE(e, scale * 0.5f + 1e-6f);
              break;
            case KVQuantMode::Int4PerTokenHead:  // half a step (f16 step and zero: a little more at the ends)
              EXPECT_LE(e, step * 0.5f + std::fabs(lo) / 1024 + 1e-6f);
              break;
          }
        }
      }
    }
  }
}

// The int4 page layout, byte for byte (kv_format.h: kvfmt::I4): 8 codes per 32-bit word,
// byte k = element k (low nibble) | element k + 4 (high nibble), offset-binary codes, and the
// {f16 step, f16 zero} slot. Values 0..15 (min 0, max 15: step 1, zero 0) are their own codes.
TEST(KVCache, Int4PageLayout) {
  CacheConfig c;
  c.kv_cache_dtype = KVCacheDType::Int4PerTokenHead;
  const AttentionLayerDesc desc{.num_q_heads = 1, .num_kv_heads = 1, .head_dim = 16};
  const KVPlan plan = build_kv_plan(c, {&desc, 1}, DType::BF16, std::nullopt, {});
  EXPECT_EQ(plan.layers[0].bytes_per_token(), 2u * (8 + 4));  // K and V: 16 codes in 8 bytes + the slot
  KVCache cache(plan, 1, 2);
  std::vector<float> k(16), v(16, 0.0f);
  for (int i = 0; i < 16; ++i) k[size_t(i)] = float(i);
  const std::vector<SlotId> slots{1};
  CpuAttentionBackend().store_kv(cache.layer(0), {.k = k, .v = v, .slots = slots});
  const LayerKVCache& L = cache.layer(0);
  const std::vector<uint8_t> row(L.k.begin() + 8, L.k.begin() + 16);
  EXPECT_EQ(row, (std::vector<uint8_t>{0x40, 0x51, 0x62, 0x73, 0xc8, 0xd9, 0xea, 0xfb}));
  uint32_t slot;
  std::memcpy(&slot, &L.k_scale[1], 4);
  EXPECT_EQ(slot, uint32_t(num::f32_to_f16(1.0f)));  // step 1 (low half), zero 0 (high half)
  // An all-zero row: the smallest step (2^-14), zero 0, codes 0.
  std::memcpy(&slot, &L.v_scale[1], 4);
  EXPECT_EQ(slot, uint32_t(num::f32_to_f16(0x1p-14f)));
}

// Rows the GPU encoder (ops/cuda/kv_codec.cuh: I4Encoder) must encode to the same bytes:
// NaN values are skipped by min / max and get code 0, an all-infinite row gets the smallest
// step and the largest zero point, a zero point of -0 is stored as +0.
TEST(KVCache, Int4EdgeRows) {
  using F = kvfmt::Format<kvfmt::I4, kvfmt::ScalePolicy::PerTokenHead>;
  std::vector<uint8_t> row(8, 0xff);
  float step, zero;
  std::vector<float> x(16, 1.0f);
  x[3] = std::nanf("");
  x[5] = 16.0f;
  kvfmt::I4::unpack(F::encode_row(x, row.data(), 1.0f), step, zero);
  EXPECT_EQ(step, 1.0f);
  EXPECT_EQ(zero, 1.0f);
  EXPECT_EQ(kvfmt::I4::code(row.data(), 3), 0);
  EXPECT_EQ(kvfmt::I4::code(row.data(), 5), 15);
  std::fill(x.begin(), x.end(), INFINITY);
  uint32_t slot;
  const float packed = F::encode_row(x, row.data(), 1.0f);
  std::memcpy(&slot, &packed, 4);
  EXPECT_EQ(slot, uint32_t(num::f32_to_f16(0x1p-14f)) | uint32_t(num::f32_to_f16(65504.0f)) << 16);
  std::fill(x.begin(), x.end(), 0.0f);
  x[7] = -0.0f;
  const float z = F::encode_row(x, row.data(), 1.0f);
  std::memcpy(&slot, &z, 4);
  EXPECT_EQ(slot >> 16, 0u) << "a -0 zero point is stored as +0";
}


// The KV format table (kv/kv_formats.h) and what is derived from it: the backends' whitelists,
// the dispatch and its error, row sizes; and the attention mask rules (kv/attention_mask.h).
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "attention/cpu_backend.h"
#include "attention/cuda_caps.h"
#include "core/error.h"
#include "kv/attention_mask.h"
#include "kv/kv_format.h"
#include "kv/kv_formats.h"

using namespace kvlm;

TEST(KVFormats, EveryUserDTypeStoresInATableFormat) {
  for (const KVCacheDType d : all_kv_cache_dtypes()) {
    const auto kv = kv_storage_of(d);
    if (!kv) continue;  // auto: resolved by the plan
    const KVFormat* f = find_kv_format(*kv);
    ASSERT_NE(f, nullptr) << kv_cache_dtype_name(d);
    EXPECT_TRUE(f->cuda) << kv_cache_dtype_name(d) << ": a --kv-cache-dtype value the CUDA kernels cannot hold";
  }
}

TEST(KVFormats, BackendWhitelistsAreTheTable) {
  std::vector<KVStorage> all, cuda;
  for (const KVFormat& f : kKVFormats) {
    all.push_back(f.kv);
    if (f.cuda) cuda.push_back(f.kv);
  }
  EXPECT_EQ(CpuAttentionBackend::capabilities().kv_formats, all);
  EXPECT_EQ(make_cuda_attention_capabilities("90a", false).kv_formats, cuda);
  // The software FP8 tier lists exactly the FP8-coded formats.
  const BackendCapabilities sm80 = make_cuda_attention_capabilities("80", false);
  ASSERT_FALSE(sm80.compute_tiers.empty());
  std::vector<KVStorage> fp8;
  for (const KVStorage& kv : cuda)
    if (kv.storage == DType::F8E4M3 || kv.storage == DType::F8E5M2) fp8.push_back(kv);
  EXPECT_EQ(sm80.compute_tiers.front().software_fp8, fp8);
  EXPECT_EQ(fp8.size(), 3u);
}

TEST(KVFormats, DispatchReachesEveryRowAndNamesTheSetOtherwise) {
  for (const KVFormat& f : kKVFormats) {
    const KVStorage got = kvfmt::dispatch_kv(f.kv.storage, f.kv.mode, [](auto fmt) { return decltype(fmt)::kKV; });
    EXPECT_EQ(got, f.kv) << dtype_name(f.kv.storage);
  }
  EXPECT_EQ(describe_kv_formats(KVFormatSet::All),
            "float32/float16/bfloat16 with none, fp8_e4m3/fp8_e5m2 with fp8_per_tensor, fp8_e4m3 with "
            "fp8_per_token_head, int8 with int8_per_token_head, int4 with int4_per_token_head");
  EXPECT_EQ(describe_kv_formats(KVFormatSet::Cuda).rfind("float16/bfloat16 with none, ", 0), 0u);
  for (const KVStorage bad : {KVStorage{DType::F8E5M2, KVQuantMode::Fp8PerTokenHead}, KVStorage{DType::F32, KVQuantMode::Fp8PerTensor},
                              KVStorage{DType::I4, KVQuantMode::Int8PerTokenHead}, KVStorage{DType::I32, KVQuantMode::None}}) {
    EXPECT_EQ(find_kv_format(bad), nullptr);
    try {
      kvfmt::dispatch_kv(bad.storage, bad.mode, [](auto) {});
      ADD_FAILURE() << "dispatched " << dtype_name(bad.storage) << " with " << kv_quant_mode_name(bad.mode);
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("unsupported KV format: storage " + std::string(dtype_name(bad.storage)) + " with quant mode " +
                       std::string(kv_quant_mode_name(bad.mode))), std::string::npos) << m;
      EXPECT_NE(m.find("supported: " + describe_kv_formats(KVFormatSet::All)), std::string::npos) << m;
    }
  }
}

TEST(KVFormats, RowBytes) {
  const int d = 128;
  EXPECT_EQ(kv_row_code_bytes({DType::F32, KVQuantMode::None}, d), 512u);
  EXPECT_EQ(kv_row_code_bytes({DType::BF16, KVQuantMode::None}, d), 256u);
  EXPECT_EQ(kv_row_code_bytes({DType::F8E5M2, KVQuantMode::Fp8PerTensor}, d), 128u);
  EXPECT_EQ(kv_row_code_bytes({DType::I8, KVQuantMode::Int8PerTokenHead}, d), 128u);
  EXPECT_EQ(kv_row_code_bytes({DType::I4, KVQuantMode::Int4PerTokenHead}, d), 64u);
  for (const KVFormat& f : kKVFormats)
    EXPECT_EQ(kv_row_scale_bytes(f.kv), is_per_token_head(f.kv.mode) ? 4u : 0u) << dtype_name(f.kv.storage);
}

// The range rules against their definition, key by key.
TEST(AttentionMask, RangesMatchTheKeyByKeyRule) {
  for (const AttentionKind kind : {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal})
    for (int kv_len = 1; kv_len <= 12; ++kv_len)
      for (int pos = 0; pos < kv_len; ++pos)
        for (int window : {1, 3, 5})
          for (int sink : {0, 2})
            for (int recent : {0, 1, 4}) {
              const KeyRange vis = visible_keys(kind, window, pos, kv_len);
              const int anchor = exact_anchor(kind, pos, kv_len);
              EXPECT_EQ(anchor, kind == AttentionKind::NonCausal ? kv_len - 1 : pos);
              const KeyRange quant = quantized_keys(vis, anchor, sink, recent);
              const ExactKeys ex = exact_keys(vis, anchor, sink, recent);
              EXPECT_LE(ex.sinks.lo, ex.sinks.hi);
              EXPECT_LE(ex.sinks.hi, ex.recent.lo);
              for (int key = 0; key < kv_len; ++key) {
                const bool visible = kind == AttentionKind::NonCausal ? true
                                     : kind == AttentionKind::Full    ? key <= pos
                                                                      : key <= pos && pos - key < window;
                EXPECT_EQ(key >= vis.lo && key < vis.hi, visible) << key;
                const bool exact = key < sink || anchor - key < recent;
                EXPECT_EQ(kv_key_exact(key, anchor, sink, recent), exact);
                EXPECT_EQ(key >= quant.lo && key < quant.hi, visible && !exact)
                    << "kind " << int(kind) << " pos " << pos << " key " << key << " sink " << sink << " recent " << recent;
                const bool in_sinks = key >= ex.sinks.lo && key < ex.sinks.hi;
                const bool in_recent = key >= ex.recent.lo && key < ex.recent.hi;
                EXPECT_EQ(in_sinks || in_recent, visible && exact) << "pos " << pos << " key " << key;
                EXPECT_EQ(in_sinks, visible && key < sink) << "pos " << pos << " key " << key;
              }
            }
}

// The CUDA tiled prefill kernels take the union of a CTA's rows' ranges as [lo(first row),
// hi(last row)) for each pass: every bound grows with the position.
TEST(AttentionMask, RangeBoundsGrowWithThePosition) {
  for (const AttentionKind kind : {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal})
    for (int kv_len = 1; kv_len <= 12; ++kv_len)
      for (int window : {1, 3, 5})
        for (int sink : {0, 2})
          for (int recent : {0, 1, 4}) {
            KeyRange pv{-1000, -1000}, pq{-1000, -1000};
            ExactKeys pe{{-1000, -1000}, {-1000, -1000}};
            for (int pos = 0; pos < kv_len; ++pos) {
              const KeyRange v = visible_keys(kind, window, pos, kv_len);
              const int anchor = exact_anchor(kind, pos, kv_len);
              const KeyRange q = quantized_keys(v, anchor, sink, recent);
              const ExactKeys e = exact_keys(v, anchor, sink, recent);
              for (auto [now, before] : {std::pair{v, pv}, std::pair{q, pq}, std::pair{e.sinks, pe.sinks},
                                         std::pair{e.recent, pe.recent}}) {
                EXPECT_GE(now.lo, before.lo) << "kind " << int(kind) << " pos " << pos;
                EXPECT_GE(now.hi, before.hi) << "kind " << int(kind) << " pos " << pos;
              }
              pv = v;
              pq = q;
              pe = e;
            }
          }
}

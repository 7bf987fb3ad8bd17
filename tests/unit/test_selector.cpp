// Backend selection, table-driven, with a fake second backend whose whitelist is narrower
// than the CPU backend's (as a FlashAttention-like GPU kernel's would be).
#include <gtest/gtest.h>

#include "attention/cpu_backend.h"
#include "attention/registry.h"
#include "attention/selector.h"
#include "core/error.h"

using namespace kvlm;

namespace {

BackendCapabilities fake_fast() {
  return {.name = "fake_fast",
          .device = Device::Cpu,
          .kv_formats = {{DType::BF16, KVQuantMode::None}, {DType::F16, KVQuantMode::None}, {DType::F8E4M3, KVQuantMode::Fp8PerTensor}},
          .head_sizes = {64, 128, 256},
          .causal = true,
          .sliding_window = true,
          .non_causal = false,
          .priority = 100};
}

BackendCapabilities fake_gpu() {
  return {.name = "fake_gpu",
          .device = Device::Cuda,
          .kv_formats = {{DType::BF16, KVQuantMode::None}},
          .head_sizes = {128},
          .min_compute_capability = 90,
          .priority = 50};
}

KVLayerSpec spec(DType storage, KVQuantMode q, AttentionKind kind, int head_dim) {
  KVLayerSpec s;
  s.attn = {.layer = 3, .kind = kind, .window = kind == AttentionKind::Sliding ? 128 : 0, .num_q_heads = 8, .num_kv_heads = 2,
            .head_dim = head_dim};
  s.storage = storage;
  s.quant = q;
  return s;
}

}  // namespace

TEST(Selector, PicksHighestPriorityThatFits) {
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(), fake_fast(), fake_gpu()};
  const SelectionContext cpu{.device = Device::Cpu};
  struct Row {
    DType storage;
    KVQuantMode q;
    AttentionKind kind;
    int hd;
    const char* want;
  };
  const Row rows[] = {
      {DType::BF16, KVQuantMode::None, AttentionKind::Full, 128, "fake_fast"},
      {DType::F16, KVQuantMode::None, AttentionKind::Sliding, 64, "fake_fast"},
      {DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128, "fake_fast"},
      // seed 004: e5m2 is not on the fast backend's whitelist, so it must not be chosen.
      {DType::F8E5M2, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128, "cpu"},
      {DType::F8E4M3, KVQuantMode::Fp8PerTokenHead, AttentionKind::Full, 128, "cpu"},
      {DType::I8, KVQuantMode::Int8PerTokenHead, AttentionKind::Sliding, 128, "cpu"},
      // seed 000: non-causal over a quantized cache has a backend.
      {DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::NonCausal, 128, "cpu"},
      {DType::BF16, KVQuantMode::None, AttentionKind::NonCausal, 128, "cpu"},
      {DType::BF16, KVQuantMode::None, AttentionKind::Full, 96, "cpu"},
      {DType::F32, KVQuantMode::None, AttentionKind::Full, 128, "cpu"},
  };
  for (const Row& r : rows) {
    const auto s = spec(r.storage, r.q, r.kind, r.hd);
    EXPECT_EQ(select_backend(s, backends, cpu).name, r.want) << describe_layer(s);
  }
}

TEST(Selector, ReasonsAreSpecific) {
  const auto e5m2 = spec(DType::F8E5M2, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128);
  EXPECT_NE(rejection_reason(fake_fast(), e5m2, {})->find("fp8_e5m2"), std::string::npos);
  const auto nc = spec(DType::BF16, KVQuantMode::None, AttentionKind::NonCausal, 128);
  EXPECT_NE(rejection_reason(fake_fast(), nc, {})->find("non-causal"), std::string::npos);
  const auto hd = spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 80);
  EXPECT_NE(rejection_reason(fake_fast(), hd, {})->find("head_dim 80"), std::string::npos);
  const auto ok = spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 128);
  EXPECT_NE(rejection_reason(fake_gpu(), ok, {.device = Device::Cuda, .compute_capability = 80})->find("compute capability 90"),
            std::string::npos);
  EXPECT_FALSE(rejection_reason(fake_gpu(), ok, {.device = Device::Cuda, .compute_capability = 90}).has_value());
  EXPECT_NE(rejection_reason(fake_gpu(), ok, {.device = Device::Cpu})->find("runs on cuda"), std::string::npos);
  EXPECT_NE(rejection_reason(CpuAttentionBackend::capabilities(), spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 7), {})
                ->find("head_dim 7"),
            std::string::npos);
}

TEST(Selector, ForcedBackend) {
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(), fake_fast()};
  const auto bf16 = spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 128);
  EXPECT_EQ(select_backend(bf16, backends, {.forced = "cpu"}).name, "cpu");
  const auto e5m2 = spec(DType::F8E5M2, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128);
  try {
    select_backend(e5m2, backends, {.forced = "fake_fast"});
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--attention-backend fake_fast cannot run layer 3"), std::string::npos) << m;
    EXPECT_NE(m.find("fp8_e5m2"), std::string::npos) << m;
  }
  try {
    select_backend(bf16, backends, {.forced = "flashinfer"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("available backends: cpu, fake_fast"), std::string::npos);
  }
}

TEST(Selector, NoBackendListsEveryReason) {
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(), fake_fast(), fake_gpu()};
  const auto s = spec(DType::F8E5M2, KVQuantMode::Fp8PerTensor, AttentionKind::NonCausal, 128);
  try {
    select_backend(s, backends, {.device = Device::Cuda, .compute_capability = 90});
    FAIL();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("no attention backend can run layer 3"), std::string::npos) << m;
    EXPECT_NE(m.find("cpu: runs on cpu, not cuda"), std::string::npos) << m;
    EXPECT_NE(m.find("fake_fast: runs on cpu"), std::string::npos) << m;
    EXPECT_NE(m.find("fake_gpu: does not handle KV fp8_e5m2"), std::string::npos) << m;
  }
}

TEST(Selector, AssignBackendsFillsEveryLayerAndRegistryResolves) {
  KVPlan plan;
  plan.layers = {spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 128),
                 spec(DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::NonCausal, 64)};
  assign_backends(plan, builtin_backend_caps(), {});
  for (const auto& l : plan.layers) {
    EXPECT_EQ(l.backend, "cpu");
    EXPECT_EQ(backend_by_name(l.backend).caps().name, "cpu");
  }
  EXPECT_THROW(backend_by_name("nope"), Error);
}

// Backend selection, table-driven, with a fake second backend whose whitelist is narrower
// than the CPU backend's (as a FlashAttention-like GPU kernel's would be).
#include <gtest/gtest.h>

#include <algorithm>

#include "attention/cpu_backend.h"
#include "attention/cuda_caps.h"
#include "kv/kv_formats.h"
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
  s.k = s.v = KVStorage{storage, q};
  return s;
}

}  // namespace

// K and V in different formats: the CPU reference reads any two of its formats, CUDA the pairs
// of kv/kv_formats.h's list (and says which where a layer asks for another), a backend that
// holds one format per layer says so, and each side is checked against the whitelist.
TEST(Selector, SeparateKAndVFormats) {
  KVLayerSpec l = spec(DType::I8, KVQuantMode::Int8PerTokenHead, AttentionKind::Full, 128);
  l.v = KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead};
  EXPECT_FALSE(rejection_reason(CpuAttentionBackend::capabilities(), l, {}).has_value());
  const BackendCapabilities cuda = make_cuda_attention_capabilities("90a", false);
  const SelectionContext gpu{.device = Device::Cuda, .compute_capability = 90};
  // Every pair of the list, both ways round, and nothing else.
  const std::vector<KVStorage> listed(std::begin(kCudaSplitFormats), std::end(kCudaSplitFormats));
  for (const KVStorage& k : kv_formats_of(KVFormatSet::Cuda))
    for (const KVStorage& v : kv_formats_of(KVFormatSet::Cuda)) {
      l.k = k;
      l.v = v;
      const bool held = k == v || (std::ranges::find(listed, k) != listed.end() && std::ranges::find(listed, v) != listed.end());
      EXPECT_EQ(rejection_reason(cuda, l, gpu).has_value(), !held) << kv_format_name(k) << " " << kv_format_name(v);
      EXPECT_FALSE(rejection_reason(CpuAttentionBackend::capabilities(), l, {}).has_value());
    }
  l.k = KVStorage{DType::I8, KVQuantMode::Int8PerTokenHead};
  l.v = KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
  const auto why = rejection_reason(cuda, l, gpu);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("does not read K int8/int8_per_token_head, V fp8_e4m3/fp8_per_tensor (K and V apart it reads any two "
                      "of bfloat16/none, fp8_e4m3/fp8_per_token_head, int8/int8_per_token_head, int4/int4_per_token_head)"),
            std::string::npos) << *why;
  BackendCapabilities one_format = cuda;
  one_format.kv_pairs.reset();
  l.v = KVStorage{DType::I4, KVQuantMode::Int4PerTokenHead};
  const auto why1 = rejection_reason(one_format, l, gpu);
  ASSERT_TRUE(why1.has_value());
  EXPECT_NE(why1->find("holds K and V in one format only (this layer: K int8/int8_per_token_head, V int4/int4_per_token_head)"),
            std::string::npos) << *why1;
  EXPECT_NE(why1->find("give K and V one --kv-cache-dtype, or run on the CPU backend"), std::string::npos) << *why1;
  l.v = KVStorage{DType::F8E5M2, KVQuantMode::Fp8PerTokenHead};  // no such format
  EXPECT_NE(rejection_reason(CpuAttentionBackend::capabilities(), l, {})->find("does not handle V fp8_e5m2"),
            std::string::npos);
  EXPECT_NE(describe_layer(spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 64)).find("KV bfloat16/none"),
            std::string::npos);
}

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
  EXPECT_NE(rejection_reason(fake_gpu(), ok, {.device = Device::Cuda, .compute_capability = 80})
                ->find("needs compute capability 9.0 or higher, device has 8.0"),
            std::string::npos);
  EXPECT_FALSE(rejection_reason(fake_gpu(), ok, {.device = Device::Cuda, .compute_capability = 90}).has_value());
  EXPECT_NE(rejection_reason(fake_gpu(), ok, {.device = Device::Cpu})->find("runs on cuda"), std::string::npos);
  EXPECT_NE(rejection_reason(CpuAttentionBackend::capabilities(), spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 7), {})
                ->find("head_dim 7"),
            std::string::npos);
}

// A layer with learned attention sinks (GPT-OSS) goes only to a backend that declares them:
// a kernel that would drop them silently never gets the layer.
TEST(Selector, AttentionSinksAreACapability) {
  auto sunk = spec(DType::BF16, KVQuantMode::None, AttentionKind::Sliding, 128);
  sunk.attn.sinks = true;
  const auto why = rejection_reason(fake_fast(), sunk, {});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("attention sinks"), std::string::npos) << *why;
  EXPECT_FALSE(rejection_reason(CpuAttentionBackend::capabilities(), sunk, {}).has_value());
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(), fake_fast()};
  EXPECT_EQ(select_backend(sunk, backends, {}).name, "cpu");
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

// The CUDA backend's declaration for a given build (make_cuda_attention_capabilities: pure,
// so every architecture list is checked here without a GPU or nvcc).
namespace {

const KVStorage kE4M3{DType::F8E4M3, KVQuantMode::Fp8PerTensor};
const KVStorage kE5M2{DType::F8E5M2, KVQuantMode::Fp8PerTensor};
const KVStorage kE4M3Tok{DType::F8E4M3, KVQuantMode::Fp8PerTokenHead};

struct TierWant {
  int min_cc, max_cc;
  const char* code;
  bool software_fp8;
  bool pdl;
};

void expect_tiers(const BackendCapabilities& c, const std::vector<TierWant>& want) {
  ASSERT_EQ(c.compute_tiers.size(), want.size()) << c.description;
  for (size_t i = 0; i < want.size(); ++i) {
    const ComputeTier& t = c.compute_tiers[i];
    SCOPED_TRACE("tier " + std::to_string(i) + ": " + describe_compute_tiers(c));
    EXPECT_EQ(t.min_cc, want[i].min_cc);
    EXPECT_EQ(t.max_cc, want[i].max_cc);
    EXPECT_EQ(t.code, want[i].code);
    if (want[i].software_fp8) {
      EXPECT_EQ(t.software_fp8, (std::vector<KVStorage>{kE4M3, kE5M2, kE4M3Tok}));
      EXPECT_FALSE(t.software_fp8_why.empty());
    } else {
      EXPECT_TRUE(t.software_fp8.empty());
    }
    EXPECT_EQ(t.note.empty(), want[i].pdl);
  }
  EXPECT_EQ(c.min_compute_capability, want.front().min_cc);
}

}  // namespace

TEST(CudaCaps, DefaultArchitectures) {
  // The default build (CMakeLists.txt): sm_80 (8.0-8.8: FP8 in software), sm_89 (FP8
  // instructions), sm_90a (9.0, PDL); newer GPUs JIT the compute_89 PTX.
  const auto c = make_cuda_attention_capabilities("80,89,90a", false);
  expect_tiers(c, {{80, 88, "sm_80", true, false},
                   {89, 89, "sm_89", false, false},
                   {90, 90, "sm_90a", false, true},
                   {91, 0, "compute_89 PTX, JIT-compiled by the driver", false, false}});
  EXPECT_EQ(make_cuda_attention_capabilities("80;89;90a", false).compute_tiers.size(), 4u);  // CMake's separator too
  // Every GPU gets the same formats, head sizes and masks.
  EXPECT_EQ(c.kv_formats.size(), 7u);
  EXPECT_EQ(c.head_sizes, (std::vector<int>{8, 16, 32, 64, 128, 256}));
  EXPECT_TRUE(c.causal && c.sliding_window && c.non_causal);
  EXPECT_GT(c.priority, CpuAttentionBackend::capabilities().priority);
  EXPECT_NE(c.description.find("8.0-8.8: sm_80 (FP8 converted in software"), std::string::npos) << c.description;
  EXPECT_EQ(find_compute_tier(c, 86)->code, "sm_80");  // 8.6 / 8.7 run the sm_80 code
  EXPECT_EQ(find_compute_tier(c, 120)->code, "compute_89 PTX, JIT-compiled by the driver");
  EXPECT_EQ(find_compute_tier(c, 75), nullptr);
}

TEST(CudaCaps, OtherArchitectureLists) {
  // scripts/gpu-check's build: Hopper only; its arch-specific code runs nowhere else.
  expect_tiers(make_cuda_attention_capabilities("90a", false), {{90, 90, "sm_90a", false, true}});
  // Without sm_89, Ada runs the sm_80 code (software FP8); plain PTX covers every later GPU.
  expect_tiers(make_cuda_attention_capabilities("80", false),
               {{80, 89, "sm_80", true, false}, {90, 0, "compute_80 PTX, JIT-compiled by the driver", true, false}});
  expect_tiers(make_cuda_attention_capabilities("80-real;90a", false),
               {{80, 89, "sm_80", true, false}, {90, 90, "sm_90a", false, true}});
  expect_tiers(make_cuda_attention_capabilities("89-virtual", false),
               {{89, 0, "compute_89 PTX, JIT-compiled by the driver", false, false}});
  expect_tiers(make_cuda_attention_capabilities("86", false),
               {{86, 89, "sm_86", true, false}, {90, 0, "compute_86 PTX, JIT-compiled by the driver", true, false}});
  // Not resolvable at build time: the GPU's own architecture decides, from 8.0 up.
  const auto native = make_cuda_attention_capabilities("native", false);
  ASSERT_EQ(native.compute_tiers.size(), 3u) << native.description;
  EXPECT_EQ(native.min_compute_capability, 80);
  EXPECT_FALSE(find_compute_tier(native, 86)->software_fp8.empty());
  EXPECT_TRUE(find_compute_tier(native, 89)->software_fp8.empty());
  EXPECT_TRUE(find_compute_tier(native, 90)->note.empty());
  EXPECT_EQ(native.compute_tiers.back().max_cc, 0);
}

TEST(CudaCaps, ForcedSoftwareFp8) {
  // KVLM_FORCE_SOFTWARE_FP8: the test build of sm_80's FP8 path on newer GPUs.
  const auto c = make_cuda_attention_capabilities("90a", true);
  expect_tiers(c, {{90, 90, "sm_90a", true, true}});
  EXPECT_NE(c.compute_tiers[0].software_fp8_why.find("KVLM_FORCE_SOFTWARE_FP8"), std::string::npos);
}

TEST(CudaCaps, SelectorReasonsAndNotes) {
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(),
                                                  make_cuda_attention_capabilities("80;89;90a", false)};
  const auto fp8 = spec(DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128);
  const auto e5m2 = spec(DType::F8E5M2, KVQuantMode::Fp8PerTensor, AttentionKind::Sliding, 64);
  const auto bf16 = spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 128);
  // Every format runs from 8.0 up; on sm_80 code the FP8 ones say they convert in software.
  for (int cc : {80, 86, 87, 89, 90, 100, 120}) {
    const SelectionContext ctx{.device = Device::Cuda, .compute_capability = cc};
    for (const auto* l : {&fp8, &e5m2, &bf16}) EXPECT_EQ(select_backend(*l, backends, ctx).name, "cuda") << cc;
    const auto note = selection_note(backends[1], fp8, ctx);
    EXPECT_EQ(note.has_value(), cc < 89) << cc;
    EXPECT_FALSE(selection_note(backends[1], bf16, ctx).has_value());
  }
  const SelectionContext a100{.device = Device::Cuda, .compute_capability = 80};
  const auto note = selection_note(backends[1], fp8, a100);
  ASSERT_TRUE(note.has_value());
  EXPECT_NE(note->find("converts FP8 in software for KV fp8_e4m3/fp8_per_tensor on compute capability 8.0 (sm_80 code"),
            std::string::npos)
      << *note;
  // Below 8.0: refused with the minimum.
  try {
    select_backend(fp8, backends, {.device = Device::Cuda, .compute_capability = 75});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda: needs compute capability 8.0 or higher, device has 7.5"), std::string::npos)
        << e.what();
  }
  // An sm_90a-only build on an A100 or a Blackwell GPU: refused, saying what the build covers.
  const auto hopper_only = make_cuda_attention_capabilities("90a", false);
  EXPECT_NE(rejection_reason(hopper_only, bf16, a100)->find("needs compute capability 9.0"), std::string::npos);
  const auto why = rejection_reason(hopper_only, bf16, {.device = Device::Cuda, .compute_capability = 100});
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("has no device code for compute capability 10.0 in this build (it covers 9.0: sm_90a)"),
            std::string::npos)
      << *why;
  EXPECT_NE(why->find("CMAKE_CUDA_ARCHITECTURES"), std::string::npos);
}

// Exact sink / recent tokens are a declared capability: a backend without it is refused a
// keeping layer with that reason; cpu and cuda both have it.
TEST(CudaCaps, ExactTokensAreACapability) {
  auto l = spec(DType::I4, KVQuantMode::Int4PerTokenHead, AttentionKind::Full, 128);
  l.keep_sink = 4;
  l.keep_recent = 64;
  const SelectionContext h100{.device = Device::Cuda, .compute_capability = 90};
  const std::vector<BackendCapabilities> cuda{make_cuda_attention_capabilities("90a", false)};
  const std::vector<BackendCapabilities> cpu{CpuAttentionBackend::capabilities()};
  EXPECT_EQ(select_backend(l, cuda, h100).name, "cuda");
  EXPECT_EQ(select_backend(l, cpu, {.device = Device::Cpu}).name, "cpu");
  std::vector<BackendCapabilities> without = cpu;
  without[0].name = "plain";
  without[0].exact_tokens = false;
  try {
    select_backend(l, without, {.device = Device::Cpu});
    FAIL() << "a backend without exact_tokens took a layer with exact tokens";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("plain: cannot read exact sink / recent tokens"), std::string::npos) << e.what();
  }
}

TEST(CudaCaps, AssignBackendsRecordsEachNoteOnce) {
  const std::vector<BackendCapabilities> backends{CpuAttentionBackend::capabilities(),
                                                  make_cuda_attention_capabilities("80;89;90a", false)};
  KVPlan plan;
  plan.layers = {spec(DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::Full, 128),
                 spec(DType::F8E4M3, KVQuantMode::Fp8PerTensor, AttentionKind::Sliding, 128),
                 spec(DType::F8E4M3, KVQuantMode::Fp8PerTokenHead, AttentionKind::Full, 128),
                 spec(DType::BF16, KVQuantMode::None, AttentionKind::Full, 128)};
  assign_backends(plan, backends, {.device = Device::Cuda, .compute_capability = 86});
  for (const auto& l : plan.layers) EXPECT_EQ(l.backend, "cuda");
  ASSERT_EQ(plan.warnings.size(), 2u);  // one per FP8 format, none for bf16
  EXPECT_NE(plan.warnings[0].find("fp8_e4m3/fp8_per_tensor"), std::string::npos) << plan.warnings[0];
  EXPECT_NE(plan.warnings[1].find("fp8_e4m3/fp8_per_token_head"), std::string::npos) << plan.warnings[1];
  KVPlan hopper = plan;
  hopper.warnings.clear();
  assign_backends(hopper, backends, {.device = Device::Cuda, .compute_capability = 90});
  EXPECT_TRUE(hopper.warnings.empty());
}

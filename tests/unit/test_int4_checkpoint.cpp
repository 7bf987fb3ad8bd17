// AWQ, GPTQ and compressed-tensors checkpoints (io/int4_checkpoint.h) against their twins:
// tests/data/int4 holds the golden Llama quantized by tools/make_int4_checkpoints.py as AutoAWQ
// (GEMM), GPTQ (checkpoint_format gptq with desc_act, and gptq_v2) and llm-compressor's
// pack-quantized W4A16 (symmetric groups; zero points with actorder group; per channel) lay
// their tensors out, each beside a twin of exactly the weights it encodes. Reading a layout
// right gives the twin's weights bit for bit, so the same tokens and the same
// log-probabilities, to the last bit.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <optional>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/error.h"
#include "core/numeric.h"
#include "io/checkpoint.h"
#include "io/int4_checkpoint.h"
#include "model/loaded_model.h"
#include "model/weights.h"
#include "io/ggml_dequant.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "offline/generate.h"
#include "test_util.h"

namespace kvlm {
namespace {

const std::filesystem::path kData = std::filesystem::path(KVLM_TEST_DATA) / "data" / "int4";

// Greedy tokens of the golden prompt. On the CPU the reference path by default: dequantized at
// load, fp32 (`fast` keeps 4-bit modules as Q4_1 blocks; `dtype` then picks fp32 or int8
// activations). On CUDA bf16 (or `dtype`), grouped codes unless `dequantize`.
GenerateResult greedy(const std::filesystem::path& dir, Device device = Device::Cpu, bool dequantize = false,
                      bool fast = false, std::optional<DType> dtype = std::nullopt, size_t* weight_bytes = nullptr) {
  ModelOptions o;
  o.model_dir = dir;
  o.device = device;
  o.dequantize_weights = dequantize || (device == Device::Cpu && !fast);
  o.dtype = dtype ? dtype : device == Device::Cuda ? std::optional(DType::BF16) : std::nullopt;
  auto m = LoadedModel::load(o);
  if (weight_bytes) *weight_bytes = m->model().weight_bytes();
  GenerateRequest g;
  g.prompt = {1, 5, 9, 14, 3, 22, 7, 31, 12, 8, 19, 25, 40, 77, 120};
  g.max_tokens = 16;
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  g.logprobs = 2;
  return generate(*m, g);
}

// A tensor's values as float32 (the twins are float32 or bfloat16).
std::vector<float> values(const TensorView& v) {
  std::vector<float> out(size_t(v.info->numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (v.info->dtype == DType::BF16) {
      uint16_t h;
      std::memcpy(&h, v.bytes.data() + 2 * i, 2);
      out[i] = num::bf16_to_f32(h);
    } else {
      std::memcpy(&out[i], v.bytes.data() + 4 * i, 4);
    }
  }
  return out;
}

TEST(Int4Checkpoint, EveryLayoutEqualsItsTwin) {
  for (const std::string v : {"awq", "gptq", "gptq_v2", "ct_w4a16", "ct_asym_actorder", "ct_channel"}) {
    SCOPED_TRACE(v);
    // The modules' weights, as the checkpoint shows them, are the twin's exactly.
    const Checkpoint q = Checkpoint::open(kData / v), t = Checkpoint::open(kData / (v + "_twin"));
    ASSERT_TRUE(q.int4_scheme());
    EXPECT_EQ(q.int4_modules(), 21u);  // 3 layers x 7 projections
    const std::string packed = int4_tensor_names(q.int4_scheme()->kind).packed;
    EXPECT_EQ(q.find("model.layers.0.self_attn.q_proj." + packed), nullptr);  // hidden behind the .weight
    EXPECT_EQ(q.find("model.layers.0.self_attn.q_proj.weight_shape"), nullptr);
    for (const std::string name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                   "model.layers.2.mlp.down_proj.weight", "model.layers.2.mlp.gate_proj.weight"}) {
      const TensorView a = q.view(name), b = t.view(name);
      ASSERT_EQ(a.info->shape, b.info->shape) << name;
      const std::vector<float> x = values(a), y = values(b);
      size_t differ = 0;
      for (size_t i = 0; i < x.size(); ++i) differ += x[i] != y[i];
      EXPECT_EQ(differ, 0u) << name << " differs from the twin's";
      q.release(name);
    }
    const GenerateResult got = greedy(kData / v), want = greedy(kData / (v + "_twin"));
    EXPECT_EQ(got.tokens, want.tokens);
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << i;
  }
}

// On the CPU the modules whose groups fit (consecutive, a multiple of 32) stay 4-bit as Q4_1
// blocks (d = s, m = -z s rounded to fp16) for the block kernels: a fraction of the float32
// twin's memory; with fp32 activations (--dtype float32) they follow the twin until a near tie
// within 0.05 (the conversion's cost: m's fp16 rounding); with the default int8 activations
// (the same kernels as GGUF's, whose rounding of this hidden size of 64 moves logits by up to
// ~0.1) until a top-2 margin of 0.1, within the GGUF test's bound of 1.0.
TEST(Int4Checkpoint, CpuKeepsModulesAsQ4_1Blocks) {
  for (const std::string v : {"awq", "gptq", "gptq_v2", "ct_w4a16", "ct_asym_actorder", "ct_channel"}) {
    SCOPED_TRACE(v);
    size_t kept_bytes = 0, twin_bytes = 0;
    const GenerateResult want = greedy(kData / (v + "_twin"), Device::Cpu, false, false, std::nullopt, &twin_bytes);
    const GenerateResult exact = greedy(kData / v, Device::Cpu, false, true, DType::F32, &kept_bytes);
    const GenerateResult fast = greedy(kData / v, Device::Cpu, false, true);
    if (v == "gptq" || v == "ct_asym_actorder") {  // shuffled groups: dequantized, so exact
      EXPECT_EQ(kept_bytes, twin_bytes);
      EXPECT_EQ(exact.tokens, want.tokens);
      continue;
    }
    // 3 layers x 7 projections of 4-bit blocks (5 bits a weight) in place of float32
    EXPECT_LT(kept_bytes, twin_bytes / 2) << kept_bytes << " of " << twin_bytes;
    test::expect_greedy_until_near_tie(exact, want, 0.1, 0.05, v + " as Q4_1, fp32 activations");
    test::expect_greedy_until_near_tie(fast, want, 0.1, 1.0, v + " as Q4_1, int8 activations");
  }
}

// GPT-OSS's MXFP4 experts (tools/make_mxfp4_checkpoint.py on the golden GPT-OSS, laid out as
// gpt-oss-20b is released) appear one expert at a time (MoeConfig::per_expert_tensors): every
// expert's gate, up and down weight and bias as kvlm reads it equals its slice of the twin's
// fused [E][in][out] tensors (gate and up alternating), its blocks are ggml MXFP4 rows of the
// same values, and the dequantized path gives the twin's tokens and log-probabilities.
TEST(Int4Checkpoint, Mxfp4ExpertsEqualTheirTwin) {
  const Checkpoint q = Checkpoint::open(kData / "mxfp4"), t = Checkpoint::open(kData / "mxfp4_twin");
  ASSERT_TRUE(q.int4_scheme());
  EXPECT_EQ(q.int4_scheme()->kind, Int4Scheme::Kind::Mxfp4);
  EXPECT_EQ(q.int4_modules(), 8u);  // 4 layers x gate_up, down
  EXPECT_TRUE(q.model_config(kData / "mxfp4").moe->per_expert_tensors);
  EXPECT_FALSE(t.model_config(kData / "mxfp4_twin").moe->per_expert_tensors);
  for (const char* gone : {"model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.gate_up_proj_scales",
                           "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias"})
    EXPECT_EQ(q.find(gone), nullptr) << gone;
  EXPECT_NE(q.describe("model.layers.1.mlp.experts.2.up_proj.weight")
                .find("expert 2's odd rows of MXFP4 'model.layers.1.mlp.experts.gate_up_proj_blocks'"),
            std::string::npos);
  const TensorView tgu = t.view("model.layers.0.mlp.experts.gate_up_proj");  // [E][H][2I]
  const int64_t E = tgu.info->shape[0], H = tgu.info->shape[1], I = tgu.info->shape[2] / 2;
  for (const int layer : {0, 3}) {
    const std::string x = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    const std::vector<float> gu = values(t.view(x + "gate_up_proj")), dn = values(t.view(x + "down_proj"));
    const std::vector<float> gub = values(t.view(x + "gate_up_proj_bias")), dnb = values(t.view(x + "down_proj_bias"));
    size_t differ = 0, nonzero = 0, block_differ = 0;
    for (int64_t e = 0; e < E; ++e) {
      const std::string n = x + std::to_string(e) + ".";
      for (const int parity : {0, 1}) {
        const std::string name = n + (parity ? "up_proj" : "gate_proj");
        const TensorView w = q.view(name + ".weight");
        ASSERT_EQ(w.info->shape, (std::vector<int64_t>{I, H}));
        const std::vector<float> got = values(w), bias = values(q.view(name + ".bias"));
        for (int64_t i = 0; i < I; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            const float want = gu[size_t((e * H + h) * 2 * I + 2 * i + parity)];
            differ += got[size_t(i * H + h)] != want, nonzero += want != 0;
          }
          differ += bias[size_t(i)] != gub[size_t(e * 2 * I + 2 * i + parity)];
        }
        // the blocks hold the same values
        const auto b = q.blocks(name + ".weight");
        ASSERT_TRUE(b);
        EXPECT_EQ(b->type, uint32_t(GGMLType::MXFP4));
        std::vector<uint8_t> rows(size_t(b->rows) * b->row_bytes);
        copy_block_rows(*b, rows.data());
        std::vector<float> deq(static_cast<size_t>(H));
        for (int64_t i = 0; i < I; ++i) {
          dequantize_ggml(b->type, {rows.data() + size_t(i) * b->row_bytes, b->row_bytes}, deq);
          for (int64_t h = 0; h < H; ++h) block_differ += deq[size_t(h)] != got[size_t(i * H + h)];
        }
        q.release(name + ".weight");
      }
      const std::vector<float> got = values(q.view(n + "down_proj.weight")), bias = values(q.view(n + "down_proj.bias"));
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < I; ++i) differ += got[size_t(h * I + i)] != dn[size_t((e * I + i) * H + h)];
        differ += bias[size_t(h)] != dnb[size_t(e * H + h)];
      }
    }
    EXPECT_EQ(differ, 0u) << "layer " << layer << " differs from the twin's";
    EXPECT_EQ(block_differ, 0u) << "layer " << layer << "'s blocks";
    EXPECT_GT(nonzero, size_t(E * H * 2 * I) / 2);
  }
  const GenerateResult got = greedy(kData / "mxfp4"), want = greedy(kData / "mxfp4_twin");
  EXPECT_EQ(got.tokens, want.tokens);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << i;
}

// On the CPU the MXFP4 experts stay quantized (ggml MXFP4 blocks held as Q8_0: the same weights
// exactly), so with fp32 activations the tokens follow the twin until a near tie and the
// weights take a fraction of its memory; with int8 activations within the GGUF tests' bound.
TEST(Int4Checkpoint, CpuKeepsMxfp4Experts) {
  size_t kept_bytes = 0, twin_bytes = 0;
  const GenerateResult want = greedy(kData / "mxfp4_twin", Device::Cpu, false, false, std::nullopt, &twin_bytes);
  const GenerateResult exact = greedy(kData / "mxfp4", Device::Cpu, false, true, DType::F32, &kept_bytes);
  EXPECT_LT(kept_bytes, twin_bytes * 3 / 4) << kept_bytes << " of " << twin_bytes;
  test::expect_greedy_until_near_tie(exact, want, 0.1, 0.05, "MXFP4 experts kept, fp32 activations");
  test::expect_greedy_until_near_tie(greedy(kData / "mxfp4", Device::Cpu, false, true), want, 0.1, 1.0,
                                     "MXFP4 experts kept, int8 activations");
}

// Where a module's groups fit the 4-bit kernels (consecutive groups, a multiple of 32 wide),
// the checkpoint hands it over as grouped rows of the zero-point layout (codes q, s and z): in
// fp32, s (q - z) is the module's weight exactly. desc_act's shuffled groups do not come as rows
// (MXFP4's experts come as MXFP4 blocks: Mxfp4ExpertsEqualTheirTwin).
TEST(Int4Checkpoint, GroupedRowsAreTheWeights) {
  for (const std::string v : {"awq", "gptq", "gptq_v2", "ct_w4a16", "ct_asym_actorder", "ct_channel"}) {
    SCOPED_TRACE(v);
    const Checkpoint q = Checkpoint::open(kData / v);
    const std::string name = "model.layers.1.mlp.down_proj.weight";
    const auto b = q.blocks(name);
    if (v == "gptq" || v == "ct_asym_actorder") {
      EXPECT_FALSE(b) << "shuffled groups as grouped rows";
      continue;
    }
    ASSERT_TRUE(b);
    ASSERT_TRUE(is_grouped_rows_type(b->type));
    const auto layout = grouped_layout_of_ggml(b->type);
    ASSERT_TRUE(layout);
    EXPECT_EQ(layout->bits, 4);
    EXPECT_TRUE(layout->zero_point);
    EXPECT_EQ(layout->group, v == "ct_channel" ? int(b->cols) : 32);
    EXPECT_EQ(block_type_name(b->type), "4-bit g" + std::to_string(layout->group));
    std::vector<uint8_t> rows(size_t(b->rows) * b->row_bytes);
    copy_block_rows(*b, rows.data());
    const std::vector<float> want = values(q.view(name));
    std::vector<uint8_t> codes(grouped_code_bytes(*layout, b->cols));
    std::vector<float> sc(size_t(grouped_groups(*layout, b->cols))), off(sc.size());
    size_t differ = 0;
    for (int64_t r = 0; r < b->rows; ++r) {
      ggml_row_to_grouped(b->type, rows.data() + size_t(r) * b->row_bytes, b->cols, codes.data(), sc.data(), off.data());
      for (int64_t c = 0; c < b->cols; ++c) {
        const int code = grouped_code(4, codes.data(), c);
        const size_t g = size_t(c / layout->group);
        differ += sc[g] * (float(code) - off[g]) != want[size_t(r * b->cols + c)];  // s (q - z)
      }
    }
    EXPECT_EQ(differ, 0u);
  }
}

// On CUDA every layout runs: desc_act's dequantized to bf16 (exact, rounding as the twin does),
// so its tokens and log-probabilities are the twin's to the last bit; the others kept as
// grouped codes: 4-bit codes of the zero-point layout (a quarter of the twin's bytes), decoded
// as s (q - z) with z subtracted exactly, their fp16 scales rounded to bf16 once per group where
// the twin rounds each weight; MXFP4's experts as their exact values (io/grouped_codes.h). Those
// follow the twin until a near tie: the prompt's 15 rows through the tensor-core GEMV, the decode
// steps (one row) through gemv_int_dp4a, whose activations are quantized to int8 per 32 columns
// as the CPU's block kernels quantize them, so they are held as the CPU's int8 path is (log-
// probabilities within 1.0) and a changed token must be a near tie of 0.25 (0.14 measured on
// these models; the exact decode's 0.1 and 0.05 held before int8 activations, and CudaIntWeights
// holds the kernel to its bound). With --dequantize-weights all are exact.
TEST(Int4Checkpoint, CudaRunsEveryLayout) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  for (const std::string v : {"awq", "gptq", "gptq_v2", "ct_w4a16", "ct_asym_actorder", "ct_channel", "mxfp4"}) {
    SCOPED_TRACE(v);
    const GenerateResult want = greedy(kData / (v + "_twin"), Device::Cuda);
    const bool codes = v != "gptq" && v != "ct_asym_actorder";
    for (const bool dequantize : {false, true}) {
      const GenerateResult got = greedy(kData / v, Device::Cuda, dequantize);
      if (codes && !dequantize) {
        test::expect_greedy_until_near_tie(got, want, 0.25, 1.0, v + " as grouped codes");
        continue;
      }
      EXPECT_EQ(got.tokens, want.tokens);
      ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
      for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << i;
    }
  }
}

// A mixture of experts whose experts are 4-bit: the golden Qwen3-MoE (7 experts of width 32,
// top 3, a dense first layer) quantized as AutoAWQ lays it out (groups of 32, zero points, fp16
// scales; `tools/make_int4_checkpoints.py tests/golden/models/qwen3-moe OUT`, its awq and
// awq_twin), the router left unquantized as the quantizers leave it. The reference path equals the twin bit for bit; the experts kept 4-bit — Q4_1 blocks on
// the CPU, grouped codes through the CUDA MoE kernels' integer GEMV (the prompt's 15 rows and
// each decode step) — follow the twin until a near tie, in a fraction of its memory. On CUDA in
// float16 (AWQ checkpoints' own dtype) the kept parameters are the fp16 scales exactly and the
// per-weight decode rounds s (q - z) as the twin's fp16 copy does; in bfloat16 each group's scale
// is rounded to bf16 (up to 2^-9 of it), which a dense model hardly notices but a router
// amplifies where two experts' logits are near (a changed choice moves later tokens' log-
// probabilities by up to a few tenths: 0.2 measured). The decode steps' dense layers run
// gemv_int_dp4a (int8 activations, as the dense test above says): held within 1.0 and a near tie
// of 0.25, as the CPU's int8 path, which a misread layout is far beyond. (Before,
// the CPU stopped on an internal error and CUDA read the codes as bf16.)
TEST(Int4Checkpoint, MoeExpertsStayFourBit) {
  const std::string v = "qwen3_moe_awq";
  size_t kept_bytes = 0, twin_bytes = 0;
  const GenerateResult want = greedy(kData / (v + "_twin"), Device::Cpu, false, false, std::nullopt, &twin_bytes);
  const GenerateResult ref = greedy(kData / v);
  EXPECT_EQ(ref.tokens, want.tokens);
  ASSERT_EQ(ref.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < ref.logprobs.size(); ++i) EXPECT_EQ(ref.logprobs[i].logprob, want.logprobs[i].logprob) << i;
  const GenerateResult exact = greedy(kData / v, Device::Cpu, false, true, DType::F32, &kept_bytes);
  EXPECT_LT(kept_bytes, twin_bytes / 2) << kept_bytes << " of " << twin_bytes;
  test::expect_greedy_until_near_tie(exact, want, 0.1, 0.05, "Q4_1, fp32 activations");
  test::expect_greedy_until_near_tie(greedy(kData / v, Device::Cpu, false, true), want, 0.1, 1.0,
                                     "Q4_1, int8 activations");
  if (cuda_devices().empty()) return;
  for (const DType dt : {DType::F16, DType::BF16}) {
    SCOPED_TRACE(dtype_name(dt));
    size_t gpu_kept = 0, gpu_twin = 0;
    const GenerateResult gwant = greedy(kData / (v + "_twin"), Device::Cuda, false, false, dt, &gpu_twin);
    test::expect_greedy_until_near_tie(greedy(kData / v, Device::Cuda, false, false, dt, &gpu_kept), gwant, 0.25, 1.0,
                                       "grouped codes on CUDA");
    EXPECT_LT(gpu_kept, gpu_twin / 2) << gpu_kept << " of " << gpu_twin;
    EXPECT_EQ(greedy(kData / v, Device::Cuda, true, false, dt).tokens, gwant.tokens);
  }
}

// A module whose tensors do not fit together is refused naming the tensor and what it should be.
TEST(Int4Checkpoint, RefusesMismatchedModules) {
  const Int4Scheme awq{.kind = Int4Scheme::Kind::Awq, .group = 32};
  const Int4Scheme gptq{.kind = Int4Scheme::Kind::Gptq, .group = 32, .zeros_minus_one = true};
  auto info = [](const char* name, DType d, std::vector<int64_t> shape) {
    return TensorInfo{.name = name, .dtype = d, .shape = std::move(shape)};
  };
  auto error = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // AWQ [in][out / 8] for a 64 x 128 (out x in) weight
  const TensorInfo qw = info("m.qweight", DType::I32, {128, 8}), qz = info("m.qzeros", DType::I32, {4, 8}),
                   sc = info("m.scales", DType::F16, {4, 64});
  const Int4Module ok = check_int4_module(awq, "m", &qw, &qz, &sc, nullptr);
  EXPECT_EQ(ok.rows, 64);
  EXPECT_EQ(ok.cols, 128);
  EXPECT_NE(error([&] { check_int4_module(awq, "m", &qw, nullptr, &sc, nullptr); }).find("no 'm.qzeros'"),
            std::string::npos);
  const TensorInfo sc_bad = info("m.scales", DType::F16, {4, 32});
  EXPECT_NE(error([&] { check_int4_module(awq, "m", &qw, &qz, &sc_bad, nullptr); }).find("'m.scales' has shape [4, 32]"),
            std::string::npos);
  const TensorInfo sc_int = info("m.scales", DType::I32, {4, 64});
  EXPECT_NE(error([&] { check_int4_module(awq, "m", &qw, &qz, &sc_int, nullptr); }).find("dtype int32"),
            std::string::npos);
  const TensorInfo qw_f = info("m.qweight", DType::F16, {128, 8});
  EXPECT_NE(error([&] { check_int4_module(awq, "m", &qw_f, &qz, &sc, nullptr); }).find("2-D int32"), std::string::npos);
  const TensorInfo gi = info("m.g_idx", DType::I32, {128});
  EXPECT_NE(error([&] { check_int4_module(awq, "m", &qw, &qz, &sc, &gi); }).find("AWQ checkpoints have no g_idx"),
            std::string::npos);
  // GPTQ [in / 8][out]: 100 input columns are not whole groups of 32... nor whole words of 8
  const TensorInfo gq = info("m.qweight", DType::I32, {13, 64});
  EXPECT_NE(error([&] { check_int4_module(gptq, "m", &gq, &qz, &sc, nullptr); }).find("not whole groups of 32"),
            std::string::npos);
  const TensorInfo gi_bad = info("m.g_idx", DType::I32, {100});
  const TensorInfo gq_ok = info("m.qweight", DType::I32, {16, 64});
  EXPECT_NE(error([&] { check_int4_module(gptq, "m", &gq_ok, &qz, &sc, &gi_bad); }).find("'m.g_idx' has shape [100]"),
            std::string::npos);
  // compressed-tensors [out][ceil(in / 8)], the shape from weight_shape: a 64 x 96 weight
  const Int4Scheme ct{.kind = Int4Scheme::Kind::CompressedTensors, .group = 32, .symmetric = true};
  const int64_t dims[2] = {64, 96};
  const TensorInfo shp = info("m.weight_shape", DType::I64, {2});
  const TensorView shape{&shp, {reinterpret_cast<const uint8_t*>(dims), sizeof dims}};
  const TensorInfo cq = info("m.weight_packed", DType::I32, {64, 12}), cs = info("m.weight_scale", DType::BF16, {64, 3});
  const Int4Module cok = check_int4_module(ct, "m", &cq, nullptr, &cs, nullptr, &shape);
  EXPECT_EQ(cok.rows, 64);
  EXPECT_EQ(cok.cols, 96);
  EXPECT_NE(error([&] { check_int4_module(ct, "m", &cq, nullptr, &cs, nullptr, nullptr); }).find("no 'm.weight_shape'"),
            std::string::npos);
  const TensorInfo cq_bad = info("m.weight_packed", DType::I32, {64, 13});
  EXPECT_NE(error([&] { check_int4_module(ct, "m", &cq_bad, nullptr, &cs, nullptr, &shape); }).find("expected [64, 12]"),
            std::string::npos);
  const Int4Scheme ct_asym{.kind = Int4Scheme::Kind::CompressedTensors, .group = 32};
  EXPECT_NE(error([&] { check_int4_module(ct_asym, "m", &cq, nullptr, &cs, nullptr, &shape); })
                .find("has no 'm.weight_zero_point'"),
            std::string::npos);
  const TensorInfo cz_bad = info("m.weight_zero_point", DType::I32, {3, 8});  // [groups][out / 8]: transposed
  EXPECT_NE(error([&] { check_int4_module(ct_asym, "m", &cq, &cz_bad, &cs, nullptr, &shape); })
                .find("'m.weight_zero_point' has shape [3, 8]"),
            std::string::npos);
  // MXFP4: blocks [E][out][in / 32][16] and scales [E][out][in / 32], uint8
  const Int4Scheme mx{.kind = Int4Scheme::Kind::Mxfp4, .group = 32};
  const TensorInfo mb = info("t_blocks", DType::U8, {2, 64, 3, 16}), ms = info("t_scales", DType::U8, {2, 64, 3});
  const Int4Module mok = check_int4_module(mx, "t", &mb, nullptr, &ms, nullptr);
  EXPECT_EQ(mok.experts, 2);
  EXPECT_EQ(mok.rows, 64);
  EXPECT_EQ(mok.cols, 96);
  const TensorInfo mb_bad = info("t_blocks", DType::U8, {2, 64, 3, 8});
  EXPECT_NE(error([&] { check_int4_module(mx, "t", &mb_bad, nullptr, &ms, nullptr); }).find("uint8 [experts][rows]"),
            std::string::npos);
  EXPECT_NE(error([&] { check_int4_module(mx, "t", &mb, nullptr, nullptr, nullptr); }).find("no 't_scales'"),
            std::string::npos);
  const TensorInfo ms_bad = info("t_scales", DType::U8, {2, 3, 64});
  EXPECT_NE(error([&] { check_int4_module(mx, "t", &mb, nullptr, &ms_bad, nullptr); }).find("expected uint8 [2, 64, 3]"),
            std::string::npos);
  const int64_t huge[2] = {64, -96};
  const TensorView bad_shape{&shp, {reinterpret_cast<const uint8_t*>(huge), sizeof huge}};
  EXPECT_NE(error([&] { check_int4_module(ct, "m", &cq, nullptr, &cs, nullptr, &bad_shape); })
                .find("not the shape of a weight"),
            std::string::npos);
}

// Tensors packed one way under a config that declares another are refused, not misread.
TEST(Int4Checkpoint, RefusesTensorsTheConfigDoesNotDescribe) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvlm-int4-mix-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(kData / "ct_w4a16" / "model.safetensors", dir / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(kData / "awq" / "config.json", dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  try {
    Checkpoint::open(dir);
    ADD_FAILURE() << "compressed-tensors tensors opened as AWQ";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is packed as compressed-tensors lays it out, but config.json declares AWQ"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::remove_all(dir);
}

// A config that declares AWQ over a checkpoint without packed tensors is a dense checkpoint
// (the packed tensors decide, as for a GGUF file's blocks): it loads as its dense weights.
TEST(Int4Checkpoint, ADenseCheckpointIsDenseWhateverItsConfig) {
  const auto dir = std::filesystem::temp_directory_path() / ("kvlm-int4-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(kData / "awq_twin" / "model.safetensors", dir / "model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(kData / "awq" / "config.json"));
  std::ofstream(dir / "config.json") << cfg.dump();
  const Checkpoint c = Checkpoint::open(dir);
  EXPECT_FALSE(c.int4_scheme());
  EXPECT_NE(c.find("model.layers.0.self_attn.q_proj.weight"), nullptr);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kvlm

// AWQ and GPTQ checkpoints (io/int4_checkpoint.h) against their float32 twins: tests/data/int4
// holds the golden Llama quantized by tools/make_int4_checkpoints.py as AutoAWQ (GEMM) and
// GPTQ (checkpoint_format gptq with desc_act, and gptq_v2) lay their tensors out, each beside a
// twin of exactly the weights it encodes. Reading a layout right gives the twin's weights bit
// for bit, so the same tokens and the same log-probabilities, to the last bit.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/int4_checkpoint.h"
#include "model/loaded_model.h"
#include "offline/generate.h"

namespace kvlm {
namespace {

const std::filesystem::path kData = std::filesystem::path(KVLM_TEST_DATA) / "data" / "int4";

GenerateResult greedy(const std::filesystem::path& dir) {
  ModelOptions o;
  o.model_dir = dir;
  auto m = LoadedModel::load(o);
  GenerateRequest g;
  g.prompt = {1, 5, 9, 14, 3, 22, 7, 31, 12, 8, 19, 25, 40, 77, 120};
  g.max_tokens = 16;
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  g.logprobs = 2;
  return generate(*m, g);
}

TEST(Int4Checkpoint, EveryLayoutEqualsItsTwin) {
  for (const std::string v : {"awq", "gptq", "gptq_v2"}) {
    SCOPED_TRACE(v);
    // The modules' weights, as the checkpoint shows them, are the twin's exactly.
    const Checkpoint q = Checkpoint::open(kData / v), t = Checkpoint::open(kData / (v + "_twin"));
    ASSERT_TRUE(q.int4_scheme());
    EXPECT_EQ(q.int4_modules(), 21u);  // 3 layers x 7 projections
    EXPECT_EQ(q.find("model.layers.0.self_attn.q_proj.qweight"), nullptr);  // hidden behind the .weight
    for (const std::string name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                   "model.layers.2.mlp.down_proj.weight", "model.layers.2.mlp.gate_proj.weight"}) {
      const TensorView a = q.view(name), b = t.view(name);
      ASSERT_EQ(a.info->shape, b.info->shape) << name;
      ASSERT_EQ(a.bytes.size(), b.bytes.size()) << name;
      EXPECT_EQ(std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()), 0) << name << " differs from the twin's";
      q.release(name);
    }
    const GenerateResult got = greedy(kData / v), want = greedy(kData / (v + "_twin"));
    EXPECT_EQ(got.tokens, want.tokens);
    ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
    for (size_t i = 0; i < got.logprobs.size(); ++i) EXPECT_EQ(got.logprobs[i].logprob, want.logprobs[i].logprob) << i;
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

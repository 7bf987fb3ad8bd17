// FP8 weight schemes (config/weight_quant.h) and how a piece's fp32 values are formed
// (model/weights.h piece_to_f32, fp8_round_trip_rows). The checkpoints themselves are tested
// end to end by the golden FP8 models (tests/golden: transformers on the dequantized weights)
// and their corrupt variants by the CLI tests.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>

#include "config/weight_quant.h"
#include "core/error.h"
#include "core/numeric.h"
#include "model/weights.h"

using namespace kvlm;
using nlohmann::json;

namespace {

json ct(json weights, json acts = {{"num_bits", 8}, {"type", "float"}, {"strategy", "token"}, {"dynamic", true}}) {
  return {{"quantization_config",
           {{"quant_method", "compressed-tensors"},
            {"format", "float-quantized"},
            {"config_groups", {{"group_0", {{"targets", {"Linear"}}, {"weights", weights}, {"input_activations", acts}}}}},
            {"ignore", {"lm_head"}}}}};
}
json fp8w(std::string strategy) {
  return {{"num_bits", 8}, {"type", "float"}, {"strategy", strategy}, {"symmetric", true}, {"dynamic", false}};
}

std::string error_of(const json& cfg) {
  try {
    parse_weight_quant(cfg);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(WeightQuant, CompressedTensorsSchemes) {
  auto q = parse_weight_quant(ct(fp8w("channel")));
  ASSERT_TRUE(q);
  EXPECT_EQ(q->scaling, Fp8Scaling::Channel);
  EXPECT_EQ(q->activations, Fp8Activations::DynamicToken);
  EXPECT_EQ(q->scale_name, "weight_scale");
  EXPECT_EQ(q->ignore, std::vector<std::string>{"lm_head"});
  EXPECT_FALSE(q->on_the_fly);
  EXPECT_EQ(q->describe(), "FP8 E4M3 weights, per-channel scales, dynamic per-token activations (compressed-tensors)");

  q = parse_weight_quant(ct(fp8w("tensor"), {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false}}));
  EXPECT_EQ(q->scaling, Fp8Scaling::Tensor);
  EXPECT_EQ(q->activations, Fp8Activations::StaticTensor);
  q = parse_weight_quant(ct(fp8w("channel"), nullptr));  // weight-only
  EXPECT_EQ(q->activations, Fp8Activations::None);
  json block = fp8w("block");
  block["block_structure"] = {128, 64};
  q = parse_weight_quant(
      ct(block, {{"num_bits", 8}, {"type", "float"}, {"strategy", "group"}, {"group_size", 128}, {"dynamic", true}}));
  EXPECT_EQ(q->scaling, Fp8Scaling::Block);
  EXPECT_EQ(q->block_rows, 128);
  EXPECT_EQ(q->block_cols, 64);
  EXPECT_EQ(q->activations, Fp8Activations::DynamicBlock);

  // A KV-cache-only config declares no weight scheme.
  EXPECT_FALSE(parse_weight_quant(json{{"quantization_config", {{"quant_method", "compressed-tensors"},
                                                                {"kv_cache_scheme", {{"num_bits", 8}}}}}}));
  EXPECT_FALSE(parse_weight_quant(json{{"model_type", "llama"}}));
}

TEST(WeightQuant, CompressedTensorsRefusals) {
  json int4 = fp8w("group");
  int4["num_bits"] = 4;
  int4["type"] = "int";
  EXPECT_NE(error_of(ct(int4)).find("num_bits 4 type 'int' weights are not supported"), std::string::npos);
  EXPECT_NE(error_of(ct(fp8w("group"))).find("strategy 'group' is not supported"), std::string::npos);
  json asym = fp8w("channel");
  asym["symmetric"] = false;
  EXPECT_NE(error_of(ct(asym)).find("asymmetric"), std::string::npos);
  EXPECT_NE(error_of(ct(fp8w("block"))).find("needs 'block_structure'"), std::string::npos);
  json int8_acts = {{"num_bits", 8}, {"type", "int"}, {"strategy", "token"}, {"dynamic", true}};
  EXPECT_NE(error_of(ct(fp8w("channel"), int8_acts)).find("activations are not supported"), std::string::npos);
  json static_token = {{"num_bits", 8}, {"type", "float"}, {"strategy", "token"}, {"dynamic", false}};
  EXPECT_NE(error_of(ct(fp8w("channel"), static_token)).find("strategy 'token' static is not supported"), std::string::npos);
  json packed = ct(fp8w("channel"));
  packed["quantization_config"]["format"] = "pack-quantized";
  EXPECT_NE(error_of(packed).find("num_bits 8 type 'float' is not supported; kvlm runs compressed-tensors "
                                  "pack-quantized 4-bit"),
            std::string::npos);
  json two = ct(fp8w("channel"));
  two["quantization_config"]["config_groups"]["group_1"] = {{"targets", {"Linear"}}, {"weights", fp8w("tensor")}};
  EXPECT_NE(error_of(two).find("different schemes"), std::string::npos);
  json out_acts = ct(fp8w("channel"));
  out_acts["quantization_config"]["config_groups"]["group_0"]["output_activations"] = {{"num_bits", 8}};
  EXPECT_NE(error_of(out_acts).find("output activation"), std::string::npos);
}

TEST(WeightQuant, ModelOptAndFp8AndOthers) {
  auto q = parse_weight_quant(json{{"quantization_config", {{"quant_method", "modelopt"},
                                                            {"quantization", {{"quant_algo", "FP8"},
                                                                              {"kv_cache_quant_algo", "FP8"},
                                                                              {"exclude_modules", {"lm_head"}}}}}}});
  ASSERT_TRUE(q);
  EXPECT_EQ(q->scaling, Fp8Scaling::Tensor);
  EXPECT_EQ(q->activations, Fp8Activations::StaticTensor);
  EXPECT_EQ(q->ignore, std::vector<std::string>{"lm_head"});
  q = parse_weight_quant(json{{"quantization_config", {{"quant_method", "modelopt"}, {"quant_algo", "FP8_PER_CHANNEL_PER_TOKEN"}}}});
  EXPECT_EQ(q->scaling, Fp8Scaling::Channel);
  EXPECT_FALSE(parse_weight_quant(json{{"quantization_config", {{"quant_method", "modelopt"}, {"kv_cache_quant_algo", "FP8"}}}}));
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"}}}})
                .find("quant_algo 'NVFP4' is not supported"),
            std::string::npos);

  q = parse_weight_quant(json{{"quantization_config", {{"quant_method", "fp8"},
                                                       {"fmt", "e4m3"},
                                                       {"activation_scheme", "dynamic"},
                                                       {"weight_block_size", {128, 128}}}}});
  EXPECT_EQ(q->scaling, Fp8Scaling::Block);
  EXPECT_EQ(q->scale_name, "weight_scale_inv");
  EXPECT_EQ(q->activations, Fp8Activations::DynamicBlock);
  q = parse_weight_quant(json{{"quantization_config", {{"quant_method", "fp8"}, {"activation_scheme", "static"}}}});
  EXPECT_EQ(q->scaling, Fp8Scaling::Tensor);
  EXPECT_EQ(q->scale_name, "weight_scale");
  EXPECT_EQ(q->activations, Fp8Activations::StaticTensor);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "fp8"}, {"fmt", "e5m2"}}}}).find("fmt 'e5m2'"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "fp8"}, {"weight_block_size", {128}}}}})
                .find("two positive integers"),
            std::string::npos);
  // 4-bit AWQ / GPTQ are the checkpoint's to read (io/int4_checkpoint.h): no FP8 scheme, and
  // what kvlm cannot run is refused here, before any tensor is read.
  EXPECT_FALSE(parse_weight_quant(json{{"quantization_config", {{"quant_method", "awq"}, {"bits", 4}}}}));
  EXPECT_FALSE(parse_weight_quant(json{{"quantization_config", {{"quant_method", "gptq"}, {"bits", 4}}}}));
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "awq"}, {"bits", 8}}}}).find("8-bit AWQ"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "gptq"}, {"bits", 3}}}}).find("3-bit GPTQ"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "awq"}, {"version", "gemv"}}}})
                .find("AWQ version 'gemv'"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "awq"}, {"zero_point", false}}}})
                .find("without zero points"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "gptq"}, {"checkpoint_format", "marlin"}}}})
                .find("checkpoint_format 'marlin'"),
            std::string::npos);
  EXPECT_NE(error_of(json{{"quantization_config", {{"quant_method", "gptq"}, {"group_size", 12}}}})
                .find("group_size 12"),
            std::string::npos);
  const auto s = parse_int4_scheme(json{{"quantization_config", {{"quant_method", "gptq"}, {"group_size", -1}}}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->group, 0);
  EXPECT_TRUE(s->zeros_minus_one);
  EXPECT_EQ(s->describe(), "GPTQ 4-bit, one scale per output row");
}

// compressed-tensors pack-quantized W4A16 (llm-compressor): the checkpoint reads it
// (io/int4_checkpoint.h), so no FP8 scheme; its scheme, and what kvlm cannot run, come from
// parse_int4_scheme.
TEST(WeightQuant, CompressedTensorsW4A16) {
  auto w4 = [](json extra) {
    json w = {{"num_bits", 4}, {"type", "int"}, {"symmetric", true}, {"strategy", "group"}, {"group_size", 128},
              {"dynamic", false}, {"actorder", nullptr}};
    if (extra.is_object()) w.update(extra);
    json c = ct(w, nullptr);
    c["quantization_config"]["format"] = "pack-quantized";
    return c;
  };
  EXPECT_FALSE(parse_weight_quant(w4({})));
  auto s = parse_int4_scheme(w4({}));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->kind, Int4Scheme::Kind::CompressedTensors);
  EXPECT_EQ(s->group, 128);
  EXPECT_TRUE(s->symmetric);
  EXPECT_EQ(s->describe(), "compressed-tensors W4A16, groups of 128, symmetric");
  s = parse_int4_scheme(w4({{"strategy", "channel"}, {"symmetric", false}, {"group_size", nullptr}}));
  ASSERT_TRUE(s);
  EXPECT_EQ(s->group, 0);
  EXPECT_EQ(s->describe(), "compressed-tensors W4A16, one scale per output row, zero points");
  // The format may be given per group ("mixed-precision" at the top).
  json per_group = w4({});
  per_group["quantization_config"]["format"] = "mixed-precision";
  per_group["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized";
  EXPECT_TRUE(parse_int4_scheme(per_group));
  // An FP8 compressed-tensors checkpoint is not a 4-bit one.
  EXPECT_FALSE(parse_int4_scheme(ct(fp8w("channel"))));
  auto int4_error = [](const json& c) {
    try {
      parse_int4_scheme(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(int4_error(w4({{"num_bits", 8}})).find("num_bits 8 type 'int' is not supported"), std::string::npos);
  EXPECT_NE(error_of(w4({{"num_bits", 8}})).find("num_bits 8 type 'int' is not supported"), std::string::npos);
  EXPECT_NE(int4_error(w4({{"strategy", "tensor"}})).find("strategy 'tensor' is not supported"), std::string::npos);
  EXPECT_NE(int4_error(w4({{"group_size", 0}})).find("positive group_size"), std::string::npos);
  EXPECT_NE(int4_error(w4({{"dynamic", true}})).find("dynamic weight scales"), std::string::npos);
  json w4a8 = w4({});
  w4a8["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
      {"num_bits", 8}, {"type", "int"}, {"strategy", "token"}, {"dynamic", true}};
  EXPECT_NE(int4_error(w4a8).find("W4A8"), std::string::npos);
  json two = w4({});
  two["quantization_config"]["config_groups"]["group_1"] = two["quantization_config"]["config_groups"]["group_0"];
  two["quantization_config"]["config_groups"]["group_1"]["weights"]["group_size"] = 32;
  EXPECT_NE(int4_error(two).find("different weight schemes ('group_1' differs from 'group_0')"), std::string::npos);
  json mixed = w4({});
  mixed["quantization_config"]["config_groups"]["group_1"] = {{"weights", fp8w("channel")}, {"format", "float-quantized"}};
  EXPECT_NE(int4_error(mixed).find("different formats"), std::string::npos);
}

TEST(WeightQuant, QuantizationFlag) {
  EXPECT_FALSE(resolve_weight_quant(std::nullopt, ""));
  auto q = resolve_weight_quant(std::nullopt, "fp8");
  ASSERT_TRUE(q);
  EXPECT_TRUE(q->on_the_fly);
  EXPECT_EQ(q->scaling, Fp8Scaling::Channel);
  EXPECT_EQ(q->origin, "--quantization fp8");
  // An FP8 checkpoint keeps its own scheme.
  const auto ckpt = parse_weight_quant(ct(fp8w("tensor")));
  q = resolve_weight_quant(ckpt, "fp8");
  EXPECT_FALSE(q->on_the_fly);
  EXPECT_EQ(q->scaling, Fp8Scaling::Tensor);
  try {
    resolve_weight_quant(std::nullopt, "int8");
    FAIL() << "int8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("invalid --quantization 'int8'; valid values: fp8"), std::string::npos);
  }
}

namespace {

// A TensorView over `bytes` as `dtype` with `shape`.
struct View {
  TensorInfo info;
  std::vector<uint8_t> bytes;
  View(DType dtype, std::vector<int64_t> shape, std::vector<uint8_t> b) : bytes(std::move(b)) {
    info.name = "t";
    info.dtype = dtype;
    info.shape = std::move(shape);
    info.end = bytes.size();
  }
  TensorView view() const { return {&info, bytes}; }
};
std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

}  // namespace

// Every scaling against the definition, on a weight of 5 x 7 with 2 x 3 blocks (partial
// blocks at the bottom and right edges).
TEST(WeightQuant, DequantizesEveryScaling) {
  const int rows = 5, cols = 7;
  std::mt19937 rng(7);
  std::vector<uint8_t> codes(rows * cols);
  for (auto& c : codes) {
    do c = uint8_t(rng());
    while ((c & 0x7f) == 0x7f);  // not NaN
  }
  const View w(DType::F8E4M3, {rows, cols}, codes);
  std::vector<float> out(rows * cols);

  const View ts(DType::F32, {}, f32_bytes({0.25f}));
  piece_to_f32(w.view(), PieceQuant{.scale = ts.view(), .scaling = Fp8Scaling::Tensor}, out);
  for (int i = 0; i < rows * cols; ++i) ASSERT_EQ(out[i], num::e4m3_to_f32(codes[i]) * 0.25f) << i;

  std::vector<float> ch{0.5f, 1.5f, 3e-3f, 7.0f, 0.0f};
  const View cs(DType::F32, {rows, 1}, f32_bytes(ch));
  piece_to_f32(w.view(), PieceQuant{.scale = cs.view(), .scaling = Fp8Scaling::Channel}, out);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) ASSERT_EQ(out[r * cols + c], num::e4m3_to_f32(codes[r * cols + c]) * ch[r]);

  // Blocks of 2 rows x 3 columns: scale grid [3][3].
  std::vector<float> bs(9);
  for (int i = 0; i < 9; ++i) bs[i] = 0.1f * float(i + 1);
  const View bv(DType::F32, {3, 3}, f32_bytes(bs));
  piece_to_f32(w.view(), PieceQuant{.scale = bv.view(), .scaling = Fp8Scaling::Block, .block_rows = 2, .block_cols = 3},
               out);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      ASSERT_EQ(out[r * cols + c], num::e4m3_to_f32(codes[r * cols + c]) * bs[(r / 2) * 3 + c / 3]) << r << "," << c;

  // bf16 scales are widened exactly.
  std::vector<uint8_t> b16(2 * rows);
  for (int r = 0; r < rows; ++r) {
    const uint16_t h = num::f32_to_bf16(ch[r]);
    std::memcpy(b16.data() + 2 * r, &h, 2);
  }
  const View cb(DType::BF16, {rows, 1}, b16);
  piece_to_f32(w.view(), PieceQuant{.scale = cb.view(), .scaling = Fp8Scaling::Channel}, out);
  for (int r = 0; r < rows; ++r)
    EXPECT_EQ(out[r * cols], num::e4m3_to_f32(codes[r * cols]) * num::bf16_to_f32(num::f32_to_bf16(ch[r])));
}

// --quantization fp8: per row, absmax / 448; every value becomes an E4M3 code times its row's
// scale, the row's largest magnitude exactly, and a zero row stays zero.
TEST(WeightQuant, RoundTripPerRow) {
  std::vector<float> w{1.0f, -3.0f, 0.1f, 2.9f, 0.0f, 0.0f, 0.0f, 0.0f, 1e-3f, -2e-3f, 5e-4f, 7e-3f};
  const std::vector<float> orig = w;
  const auto scales = fp8_round_trip_rows(w, 3, 4);
  ASSERT_EQ(scales.size(), 3u);
  EXPECT_FLOAT_EQ(scales[0], 3.0f / 448.0f);
  EXPECT_EQ(scales[1], 1.0f);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 4; ++c) {
      const float x = orig[r * 4 + c], s = scales[r];
      EXPECT_EQ(w[r * 4 + c], num::e4m3_to_f32(num::f32_to_e4m3(x / s)) * s);
      EXPECT_LE(std::fabs(w[r * 4 + c] - x), std::fabs(x) / 16 + s * 1e-2f);  // 3 mantissa bits
    }
  EXPECT_FLOAT_EQ(w[1], -3.0f);
  EXPECT_EQ(w[4], 0.0f);
  // The same through piece_to_f32 on a bf16 tensor.
  std::vector<uint8_t> b(2 * 4);
  for (int c = 0; c < 4; ++c) {
    const uint16_t h = num::f32_to_bf16(orig[c]);
    std::memcpy(b.data() + 2 * c, &h, 2);
  }
  const View v(DType::BF16, {1, 4}, b);
  std::vector<float> out(4);
  piece_to_f32(v.view(), PieceQuant{.quantize = true}, out);
  std::vector<float> ref{num::bf16_to_f32(b[0] | b[1] << 8), 0, 0, 0};
  for (int c = 0; c < 4; ++c) {
    uint16_t h;
    std::memcpy(&h, b.data() + 2 * c, 2);
    ref[c] = num::bf16_to_f32(h);
  }
  fp8_round_trip_rows(ref, 1, 4);
  EXPECT_EQ(out, ref);
}

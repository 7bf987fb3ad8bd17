// safetensors parsing and checkpoints: round trips, and a clear error (never a crash) for
// every kind of damage: truncation, bad JSON, bad offsets, overlaps, unknown dtypes, broken
// shard indexes, missing tensors, shape mismatches.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/numeric.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace kvlm;
using kvlm::test::TempDir;

namespace {

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = num::f32_to_bf16(v[i]);
    std::memcpy(b.data() + 2 * i, &h, 2);
  }
  return b;
}

// A raw file: 8-byte length + header text + data bytes.
std::string raw_file(const std::string& header, size_t data_bytes) {
  std::string s(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char((n >> (8 * i)) & 0xff);
  return s + header + std::string(data_bytes, '\x01');
}

std::string parse_error(const std::string& file) {
  TempDir d;
  test::write_file(d / "x.safetensors", file);
  try {
    SafetensorsFile f(d / "x.safetensors");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, WriteReadRoundTrip) {
  TempDir d;
  const std::vector<float> a{1.0f, -2.5f, 3.25f, 0.0f, 1e-3f, 7.0f};
  const auto ab = f32_bytes(a);
  const auto bb = bf16_bytes({0.5f, -1.0f});
  const TensorToWrite ts[] = {{"a", DType::F32, {2, 3}, ab}, {"b.weight", DType::BF16, {2}, bb}};
  write_safetensors(d / "m.safetensors", ts);
  SafetensorsFile f(d / "m.safetensors");
  EXPECT_EQ(f.header().metadata.at("format"), "pt");
  EXPECT_EQ(f.header().data_start % 8, 0u);
  const TensorInfo* t = f.find("a");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 3}));
  std::vector<float> out(6);
  convert_to_f32(t->dtype, f.view(*t).bytes, out);
  EXPECT_EQ(out, a);
  const TensorInfo* b = f.find("b.weight");
  std::vector<float> bo(2);
  convert_to_f32(b->dtype, f.view(*b).bytes, bo);
  EXPECT_EQ(bo, (std::vector<float>{0.5f, -1.0f}));
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(Safetensors, RejectsDamagedFiles) {
  const std::string good_tensor = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  EXPECT_NE(parse_error("").find("shorter than the 8-byte"), std::string::npos);
  EXPECT_NE(parse_error("abc").find("shorter than the 8-byte"), std::string::npos);
  EXPECT_EQ(parse_error(raw_file("{" + good_tensor + "}", 8)), "");  // the well-formed file parses
  // Header length pointing past the end of the file.
  std::string s = raw_file("{" + good_tensor + "}", 8);
  s[0] = char(0xff);
  s[1] = char(0x7f);
  EXPECT_NE(parse_error(s).find("runs past the end"), std::string::npos);
  s = raw_file("{}", 0);
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(0xff);
  EXPECT_NE(parse_error(s).find("out of range"), std::string::npos);
  EXPECT_NE(parse_error(raw_file("{\"t\": [", 8)).find("not valid JSON"), std::string::npos);
  EXPECT_NE(parse_error(raw_file("[1,2]", 8)).find("not a JSON object"), std::string::npos);
  // Truncated data section.
  EXPECT_NE(parse_error(raw_file("{" + good_tensor + "}", 4)).find("truncated"), std::string::npos);
  // Byte count disagreeing with the shape.
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8)).find("need"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"Q4K","shape":[2],"data_offsets":[0,8]}})", 8)).find("unsupported dtype 'Q4K'"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)).find("non-negative"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)).find("outside"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[2]}})", 8)).find("data_offsets"), std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})", 8))
                .find("impossibly large"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(
                            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                            12))
                .find("overlap"),
            std::string::npos);
  EXPECT_NE(parse_error(raw_file(R"({"__metadata__":{"format":1}})", 0)).find("__metadata__"), std::string::npos);
}

TEST(Safetensors, TruncatedRealFile) {
  TempDir d;
  const auto ab = f32_bytes(std::vector<float>(100, 1.0f));
  const TensorToWrite ts[] = {{"w", DType::F32, {10, 10}, ab}};
  write_safetensors(d / "m.safetensors", ts);
  const std::string full = test::read_file(d / "m.safetensors");
  for (size_t cut : {size_t(0), size_t(4), size_t(8), size_t(20), full.size() / 2, full.size() - 1}) {
    test::write_file(d / "cut.safetensors", full.substr(0, cut));
    EXPECT_THROW(SafetensorsFile(d / "cut.safetensors"), Error) << "cut at " << cut;
  }
}

TEST(Checkpoint, ShardedIndex) {
  TempDir d;
  const auto a = f32_bytes({1, 2, 3, 4});
  const auto b = bf16_bytes({5, 6});
  const TensorToWrite s1[] = {{"a", DType::F32, {2, 2}, a}};
  const TensorToWrite s2[] = {{"b", DType::BF16, {2}, b}};
  write_safetensors(d / "model-00001-of-00002.safetensors", s1);
  write_safetensors(d / "model-00002-of-00002.safetensors", s2);
  nlohmann::json idx{{"metadata", {{"total_size", 20}}},
                     {"weight_map", {{"a", "model-00001-of-00002.safetensors"}, {"b", "model-00002-of-00002.safetensors"}}}};
  test::write_file(d / "model.safetensors.index.json", idx.dump());
  const Checkpoint c = Checkpoint::open(d.path());
  EXPECT_EQ(c.num_files(), 2u);
  EXPECT_EQ(c.load_f32("b", std::vector<int64_t>{2}), (std::vector<float>{5, 6}));
  EXPECT_ERROR_CONTAINS(c.load_f32("a", std::vector<int64_t>{4}), "tensor 'a' has shape [2, 2] but config.json implies [4]");
  EXPECT_ERROR_CONTAINS(c.view("zzz"), "missing tensor 'zzz'");

  idx["weight_map"]["c"] = "model-00003-of-00002.safetensors";
  test::write_file(d / "model.safetensors.index.json", idx.dump());
  EXPECT_ERROR_CONTAINS(Checkpoint::open(d.path()), "lists shard 'model-00003-of-00002.safetensors'");
  idx["weight_map"]["c"] = "model-00001-of-00002.safetensors";
  test::write_file(d / "model.safetensors.index.json", idx.dump());
  EXPECT_ERROR_CONTAINS(Checkpoint::open(d.path()), "does not hold it");
  idx["weight_map"]["c"] = "../../etc/passwd";
  test::write_file(d / "model.safetensors.index.json", idx.dump());
  EXPECT_ERROR_CONTAINS(Checkpoint::open(d.path()), "outside the model directory");
  test::write_file(d / "model.safetensors.index.json", "{\"weight_map\": ");
  EXPECT_ERROR_CONTAINS(Checkpoint::open(d.path()), "not valid JSON");
}

TEST(Checkpoint, NoWeightsAndBadDtype) {
  TempDir d;
  EXPECT_ERROR_CONTAINS(Checkpoint::open(d.path()), "neither model.safetensors");
  const std::vector<uint8_t> q(4, 1);
  const TensorToWrite ts[] = {{"w", DType::I8, {4}, q}};
  write_safetensors(d / "model.safetensors", ts);
  const Checkpoint c = Checkpoint::open(d.path());
  EXPECT_ERROR_CONTAINS(c.load_f32("w", std::vector<int64_t>{4}), "quantized weights are not supported");
}

TEST(Checkpoint, KVScaleNames) {
  const AttentionLayerDesc layer{.layer = 1, .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 8};
  const auto s1 = f32_bytes({0.5f});
  const auto s2 = f32_bytes({0.25f, 0.125f});
  struct Case {
    std::vector<std::string> names;
    std::string expect_k;
  };
  const Case cases[] = {
      {{"model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"}, "model.layers.1.self_attn.k_scale"},
      {{"model.layers.1.self_attn.attn.k_scale", "model.layers.1.self_attn.attn.v_scale"}, "model.layers.1.self_attn.attn.k_scale"},
      {{"model.layers.1.self_attn.k_proj.k_scale", "model.layers.1.self_attn.v_proj.v_scale"},
       "model.layers.1.self_attn.k_proj.k_scale"},
      {{"model.layers.1.self_attn.k_proj.output_scale", "model.layers.1.self_attn.v_proj.output_scale"},
       "model.layers.1.self_attn.k_proj.output_scale"},
      {{"model.layers.1.self_attn.kv_scale"}, "model.layers.1.self_attn.kv_scale"},
  };
  for (const Case& c : cases) {
    TempDir d;
    std::vector<TensorToWrite> ts;
    for (const auto& n : c.names) ts.push_back({n, DType::F32, {}, s1});
    write_safetensors(d / "model.safetensors", ts);
    const auto found = find_kv_scales(Checkpoint::open(d.path()), layer);
    ASSERT_TRUE(found.has_value()) << c.expect_k;
    EXPECT_EQ(found->k_name, c.expect_k);
    EXPECT_EQ(found->k, std::vector<float>{0.5f});
    EXPECT_EQ(found->v, std::vector<float>{0.5f});
  }
  TempDir d;
  const TensorToWrite per_head[] = {{"model.layers.1.self_attn.k_scale", DType::F32, {2}, s2},
                                    {"model.layers.1.self_attn.v_scale", DType::F32, {1}, s1}};
  write_safetensors(d / "model.safetensors", per_head);
  const auto found = find_kv_scales(Checkpoint::open(d.path()), layer);
  EXPECT_EQ(found->k, (std::vector<float>{0.25f, 0.125f}));
  EXPECT_FALSE(find_kv_scales(Checkpoint::open(d.path()), {.layer = 0, .num_kv_heads = 2}).has_value());
  TempDir e;
  const TensorToWrite lonely[] = {{"model.layers.1.self_attn.k_scale", DType::F32, {}, s1}};
  write_safetensors(e / "model.safetensors", lonely);
  EXPECT_ERROR_CONTAINS(find_kv_scales(Checkpoint::open(e.path()), layer), "not its partner");
}

// GGUF reading (io/gguf.h, io/ggml_dequant.h): files written here byte by byte — metadata of
// every value type, nested arrays, tensors of several block types with alignment padding —
// parsed back; every damage a file can have (each truncation, bad magic and versions, counts
// past the end, misaligned or overlapping tensors, unknown types) gives an error, never a
// crash; and a file written by llama.cpp's `gguf` Python package (tools/make_gguf_goldens.py)
// read as its GGUFReader reads it, every block type dequantized bit for bit as
// gguf.quants.dequantize does.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"
#include "core/device.h"
#include "io/ggml_dequant.h"
#include "io/grouped_codes.h"
#include "io/gguf.h"
#include "io/checkpoint.h"
#include "io/gguf_model.h"
#include "model/loaded_model.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "io/safetensors.h"
#include "model/rope.h"
#include "../support/error_text.h"
#include "../support/ggml_blocks.h"
#include "../support/gguf_writer.h"
#include "test_util.h"

namespace kvlm {
namespace {

using test::GGUFWriter;
using Writer = GGUFWriter;

// A valid file: metadata of every type, then a Q8_0 [2][64] matrix (2 blocks of 34 bytes a
// row) and an F32 vector of 3, alignment 64.
std::vector<uint8_t> sample() {
  Writer w;
  w.b = {'G', 'G', 'U', 'F'};
  w.pod<uint32_t>(3).pod<uint64_t>(2).pod<uint64_t>(13);
  w.key("general.architecture", GGUFType::String).str("llama");
  w.key("general.alignment", GGUFType::Uint32).pod<uint32_t>(64);
  w.key("llama.block_count", GGUFType::Uint32).pod<uint32_t>(30);
  w.key("llama.rope.freq_base", GGUFType::Float32).pod<float>(100000.0f);
  w.key("a.i8", GGUFType::Int8).pod<int8_t>(-5);
  w.key("a.u16", GGUFType::Uint16).pod<uint16_t>(65000);
  w.key("a.i64", GGUFType::Int64).pod<int64_t>(-1234567890123);
  w.key("a.f64", GGUFType::Float64).pod<double>(0.125);
  w.key("a.bool", GGUFType::Bool).pod<uint8_t>(1);
  w.key("tokenizer.ggml.tokens", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::String)).pod<uint64_t>(3);
  w.str("<s>").str("hello").str("");
  w.key("tokenizer.ggml.scores", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::Float32)).pod<uint64_t>(3);
  w.pod<float>(0.0f).pod<float>(-1.5f).pod<float>(2.0f);
  w.key("tokenizer.ggml.token_type", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::Int32)).pod<uint64_t>(3);
  w.pod<int32_t>(3).pod<int32_t>(1).pod<int32_t>(6);
  // An array of arrays (kept as a count only).
  w.key("a.nested", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::Array)).pod<uint64_t>(2);
  w.pod<uint32_t>(uint32_t(GGUFType::Uint8)).pod<uint64_t>(2).pod<uint8_t>(1).pod<uint8_t>(2);
  w.pod<uint32_t>(uint32_t(GGUFType::String)).pod<uint64_t>(1).str("x");
  w.tensor("blk.0.attn_q.weight", {64, 2}, GGMLType::Q8_0, 0);
  w.tensor("output_norm.weight", {3}, GGMLType::F32, 192);  // Q8_0 [2][64] is 4 x 34 bytes, aligned up to 192
  w.pad_to(64);
  const size_t data = w.b.size();
  for (int i = 0; i < 136; ++i) w.b.push_back(uint8_t(i));
  w.b.resize(data + 192, 0);
  w.pod<float>(1.0f).pod<float>(2.0f).pod<float>(3.0f);
  return w.b;
}

GGUFHeader parse(const std::vector<uint8_t>& b) { return parse_gguf(b, "test.gguf"); }

void expect_error(const std::vector<uint8_t>& b, const std::string& needle) {
  try {
    parse(b);
    ADD_FAILURE() << "accepted a damaged file (wanted: " << needle << ")";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GGUF, ParsesMetadataAndTensors) {
  const auto b = sample();
  const GGUFHeader h = parse(b);
  EXPECT_EQ(h.version, 3u);
  EXPECT_EQ(h.alignment, 64u);
  EXPECT_EQ(h.data_start % 64, 0u);
  ASSERT_EQ(h.metadata.size(), 13u);
  EXPECT_EQ(h.get_string("general.architecture"), "llama");
  EXPECT_EQ(h.get_int("llama.block_count"), 30);
  EXPECT_EQ(h.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(h.get_float("llama.block_count"), 30.0);  // integers widen to floats
  EXPECT_EQ(h.get_int("a.i8"), -5);
  EXPECT_EQ(h.get_int("a.u16"), 65000);
  EXPECT_EQ(h.get_int("a.i64"), -1234567890123);
  EXPECT_EQ(h.get_float("a.f64"), 0.125);
  EXPECT_EQ(h.get_bool("a.bool"), true);
  EXPECT_EQ(h.get_strings("tokenizer.ggml.tokens"), (std::vector<std::string>{"<s>", "hello", ""}));
  EXPECT_EQ(h.get_numbers("tokenizer.ggml.scores"), (std::vector<double>{0.0, -1.5, 2.0}));
  EXPECT_EQ(h.get_numbers("tokenizer.ggml.token_type"), (std::vector<double>{3, 1, 6}));
  const GGUFValue* nested = h.find("a.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->elem, GGUFType::Array);
  EXPECT_EQ(nested->count, 2u);
  EXPECT_FALSE(h.get_int("absent").has_value());
  EXPECT_THROW(h.get_int("general.architecture"), Error);  // a string asked for as an integer
  EXPECT_THROW(h.get_strings("tokenizer.ggml.scores"), Error);

  ASSERT_EQ(h.tensors.size(), 2u);
  const GGUFTensorInfo* q = h.find_tensor("blk.0.attn_q.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(ggml_type_name(q->type), "Q8_0");
  EXPECT_EQ(q->shape, (std::vector<int64_t>{2, 64}));  // [rows][cols]: ne reversed
  EXPECT_EQ(q->bytes, 136u);
  EXPECT_EQ(q->numel(), 128);
  const GGUFTensorInfo* n = h.find_tensor("output_norm.weight");
  ASSERT_NE(n, nullptr);
  EXPECT_EQ(n->bytes, 12u);
  float v[3];
  std::memcpy(v, b.data() + h.data_start + n->offset, sizeof v);
  EXPECT_EQ(v[2], 3.0f);
}

TEST(GGUF, MappedFileGivesTheTensorBytes) {
  const auto b = sample();
  const auto path = std::filesystem::temp_directory_path() / ("kvlm-test-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
  {
    GGUFFile f(path);
    const GGUFTensorInfo* q = f.header().find_tensor("blk.0.attn_q.weight");
    ASSERT_NE(q, nullptr);
    const auto d = f.data(*q);
    ASSERT_EQ(d.size(), 136u);
    EXPECT_EQ(d[135], 135);
  }
  std::filesystem::remove(path);
  EXPECT_THROW(GGUFFile(std::filesystem::temp_directory_path() / "kvlm-no-such-file.gguf"), Error);
}

TEST(GGUF, EveryTruncationIsAnError) {
  const auto b = sample();
  for (size_t n = 0; n < b.size(); ++n) {
    const std::vector<uint8_t> cut(b.begin(), b.begin() + std::ptrdiff_t(n));
    EXPECT_THROW(parse(cut), Error) << "accepted the first " << n << " of " << b.size() << " bytes";
  }
}

TEST(GGUF, DamagedFilesAreClearErrors) {
  const auto good = sample();
  auto with = [&](size_t at, std::vector<uint8_t> bytes) {
    auto b = good;
    std::copy(bytes.begin(), bytes.end(), b.begin() + std::ptrdiff_t(at));
    return b;
  };
  expect_error(with(0, {'G', 'G', 'M', 'L'}), "no GGUF magic");
  expect_error(with(4, {1, 0, 0, 0}), "version 1");
  expect_error(with(4, {0, 0, 0, 3}), "big-endian");
  expect_error(with(4, {7, 0, 0, 0}), "unknown version 7");
  expect_error(with(8, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0}), "tensor count");
  expect_error(with(16, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0}), "metadata count");

  // Surgical damage at the fields' own offsets, found by searching the sample.
  auto find = [&](const std::string& s) {
    auto it = std::search(good.begin(), good.end(), s.begin(), s.end());
    EXPECT_NE(it, good.end()) << s;
    return size_t(it - good.begin());
  };
  const size_t arch = find("general.architecture") + 20;  // its value type follows the key
  expect_error(with(arch, {42, 0, 0, 0}), "unknown value type 42");
  const size_t align = find("general.alignment") + 17 + 4;
  expect_error(with(align, {48, 0, 0, 0}), "power of two");
  const size_t boolv = find("a.bool") + 6 + 4;
  expect_error(with(boolv, {2}), "a bool of value 2");
  // A key renamed to an earlier one of the same length: a duplicate.
  expect_error(with(find("a.f64"), {'a', '.', 'i', '6', '4'}), "metadata key 'a.i64' given twice");
  const size_t q = find("blk.0.attn_q.weight") + 19;  // n_dims, ne[0], ne[1], type, offset
  expect_error(with(q, {5, 0, 0, 0}), "5 dimensions");
  expect_error(with(q + 4, {48, 0, 0, 0, 0, 0, 0, 0}), "not a multiple of its block of 32");
  expect_error(with(q + 4, {0, 0, 0, 0, 0, 0, 0, 0}), "dimension of 0");
  expect_error(with(q + 20, {23, 0, 0, 0}), "ggml type 23, which kvlm cannot read");
  expect_error(with(q + 24, {32, 0, 0, 0, 0, 0, 0, 0}), "not a multiple of the alignment 64");
  expect_error(with(q + 24, {0, 0, 0, 0, 1, 0, 0, 0}), "runs past the end of the file");
  const size_t norm = find("output_norm.weight") + 18 + 4 + 8 + 4;
  expect_error(with(norm, {64, 0, 0, 0, 0, 0, 0, 0}), "overlap");
  expect_error(with(norm, {0, 1, 0, 0, 0, 0, 0, 0}), "runs past the end of the file");
  // A string length past the end.
  expect_error(with(find("llama") - 8, {0xff, 0xff, 0xff, 0x0f, 0, 0, 0, 0}), "truncated");
}

const std::filesystem::path kGolden = std::filesystem::path(KVLM_TEST_DATA) / "data" / "gguf";

TEST(GGUF, ReadsWhatTheGgufPackageWrote) {
  const GGUFFile f(kGolden / "blocks.gguf");
  const GGUFHeader& h = f.header();
  std::ifstream in(kGolden / "blocks.json");
  const nlohmann::json want = nlohmann::json::parse(in);
  size_t keys = 0;
  for (const auto& [key, w] : want["metadata"].items()) {
    SCOPED_TRACE(key);
    const GGUFValue* v = h.find(key);
    ASSERT_NE(v, nullptr);
    ++keys;
    const std::string type = w["type"];
    EXPECT_EQ(gguf_type_name(v->type), type);
    const auto& val = w["value"];
    if (type == "string") {
      EXPECT_EQ(v->s, val.get<std::string>());
    } else if (type == "array") {
      EXPECT_EQ(gguf_type_name(v->elem), w["elem"].get<std::string>());
      if (v->elem == GGUFType::String) {
        EXPECT_EQ(h.get_strings(key), val.get<std::vector<std::string>>());
      } else {
        const auto got = h.get_numbers(key);
        ASSERT_TRUE(got.has_value());
        ASSERT_EQ(got->size(), val.size());
        for (size_t i = 0; i < val.size(); ++i) EXPECT_EQ((*got)[i], val[i].get<double>());
      }
    } else if (type == "bool") {
      EXPECT_EQ(h.get_bool(key), val.get<bool>());
    } else if (type == "float32" || type == "float64") {
      EXPECT_EQ(h.get_float(key), val.get<double>());
    } else if (val.is_number_unsigned()) {
      EXPECT_EQ(v->u, val.get<uint64_t>());
    } else {
      EXPECT_EQ(h.get_int(key), val.get<int64_t>());
    }
  }
  EXPECT_EQ(keys, h.metadata.size());  // every key, none extra (the tool leaves out the reader's GGUF.* fields)
  EXPECT_EQ(want["tensors"].size(), h.tensors.size());
  for (const auto& [name, w] : want["tensors"].items()) {
    SCOPED_TRACE(name);
    const GGUFTensorInfo* t = h.find_tensor(name);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(ggml_type_name(t->type), w["type"].get<std::string>());
    EXPECT_EQ(t->ne, w["ne"].get<std::vector<int64_t>>());
    EXPECT_EQ(h.data_start + t->offset, w["offset"].get<uint64_t>());
  }
}

TEST(GGUF, DequantizesEveryBlockTypeBitForBit) {
  const GGUFFile f(kGolden / "blocks.gguf");
  int types = 0;
  for (const GGUFTensorInfo& t : f.header().tensors) {
    if (t.name.ends_with(".ref")) continue;
    SCOPED_TRACE(t.name);
    const GGUFTensorInfo* ref = f.header().find_tensor(t.name + ".ref");
    ASSERT_NE(ref, nullptr);
    ASSERT_EQ(ref->numel(), t.numel());
    std::vector<float> got(size_t(t.numel())), want(size_t(t.numel()));
    dequantize_ggml(t.type, f.data(t), got);
    std::memcpy(want.data(), f.data(*ref).data(), want.size() * sizeof(float));
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << ggml_type_name(t.type) << ": first values " << got[0] << " vs " << want[0];
    ++types;
  }
  EXPECT_EQ(types, 13);  // F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K
  std::vector<float> out(32);
  std::vector<uint8_t> bytes(33);
  EXPECT_THROW(dequantize_ggml(uint32_t(GGMLType::Q8_0), bytes, out), Error);  // 34 bytes per block
  EXPECT_THROW(dequantize_ggml(23, bytes, out), Error);                      // an IQ type
}

// A model file: metadata written by `meta` (counted), then F32 tensors (name, ne, values).
struct F32Tensor {
  std::string name;
  std::vector<uint64_t> ne;
  std::vector<float> values;
  // A quantized tensor instead: its blocks (values unused).
  GGMLType type = GGMLType::F32;
  std::vector<uint8_t> raw;
  size_t bytes() const { return raw.empty() ? values.size() * 4 : raw.size(); }
};
std::vector<uint8_t> model_file(uint64_t n_kv, const std::function<void(Writer&)>& meta, const std::vector<F32Tensor>& ts) {
  Writer w;
  w.b = {'G', 'G', 'U', 'F'};
  w.pod<uint32_t>(3).pod<uint64_t>(ts.size()).pod<uint64_t>(n_kv);
  meta(w);
  uint64_t off = 0;
  for (const auto& t : ts) {
    w.tensor(t.name, t.ne, t.raw.empty() ? GGMLType::F32 : t.type, off);
    off += (t.bytes() + 31) / 32 * 32;
  }
  w.pad_to(32);
  for (const auto& t : ts) {
    for (float v : t.values) w.pod<float>(v);
    w.b.insert(w.b.end(), t.raw.begin(), t.raw.end());
    w.pad_to(32);
  }
  return w.b;
}

// A two-layer Llama's metadata (12 keys): its shape, a vocabulary t0, t1, ..., BOS 1 and EOS 2.
struct LlamaDims {
  int hidden, heads, kv_heads, ffn, vocab, context;
  float rope_theta;
};
void llama_metadata(Writer& w, const LlamaDims& d) {
  w.key("general.architecture", GGUFType::String).str("llama");
  w.key("llama.block_count", GGUFType::Uint32).pod<uint32_t>(2);
  w.key("llama.context_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.context));
  w.key("llama.embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.hidden));
  w.key("llama.feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.ffn));
  w.key("llama.attention.head_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.heads));
  w.key("llama.attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.kv_heads));
  w.key("llama.attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(1e-5f);
  w.key("llama.rope.freq_base", GGUFType::Float32).pod<float>(d.rope_theta);
  w.key("tokenizer.ggml.tokens", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::String)).pod<uint64_t>(uint64_t(d.vocab));
  for (int i = 0; i < d.vocab; ++i) w.str("t" + std::to_string(i));
  w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(1);
  w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(2);
}

// What convert_hf_to_gguf.py does to a Llama q/k matrix: within each head, row a * hd/2 + i
// (a in {0, 1}) goes to row 2 i + a.
std::vector<float> permute_like_llama_cpp(const std::vector<float>& hf, int heads, int rows, int cols) {
  std::vector<float> g(hf.size());
  const int hd = rows / heads;
  for (int h = 0; h < heads; ++h)
    for (int a = 0; a < 2; ++a)
      for (int i = 0; i < hd / 2; ++i)
        for (int c = 0; c < cols; ++c) g[size_t((h * hd + 2 * i + a) * cols + c)] = hf[size_t((h * hd + a * hd / 2 + i) * cols + c)];
  return g;
}

std::vector<float> iota_values(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(i) * scale;
  return v;
}

// A two-layer Llama (hidden 8, 2 query heads and 1 KV head of 4, MLP 16, 5 tokens): its
// config.json as parse_model_config reads it, its tensors under Hugging Face names, q and k
// back in rotate-half order.
TEST(GGUFModel, LlamaBecomesAHuggingFaceModel) {
  const int hidden = 8, heads = 2, kvh = 1, hd = 4, ffn = 16, vocab = 5;
  const auto q_hf = iota_values(size_t(heads * hd * hidden), 1.0f), k_hf = iota_values(size_t(kvh * hd * hidden), 0.5f);
  std::vector<F32Tensor> ts{{"token_embd.weight", {uint64_t(hidden), uint64_t(vocab)}, iota_values(size_t(hidden * vocab), 0.01f)},
                            {"output_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)}};
  for (int l = 0; l < 2; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    ts.push_back({b + "attn_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)});
    ts.push_back({b + "attn_q.weight", {uint64_t(hidden), uint64_t(heads * hd)}, permute_like_llama_cpp(q_hf, heads, heads * hd, hidden)});
    ts.push_back({b + "attn_k.weight", {uint64_t(hidden), uint64_t(kvh * hd)}, permute_like_llama_cpp(k_hf, kvh, kvh * hd, hidden)});
    ts.push_back({b + "attn_v.weight", {uint64_t(hidden), uint64_t(kvh * hd)}, iota_values(size_t(kvh * hd * hidden), 1.0f)});
    ts.push_back({b + "attn_output.weight", {uint64_t(heads * hd), uint64_t(hidden)}, iota_values(size_t(hidden * heads * hd), 1.0f)});
    ts.push_back({b + "ffn_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)});
    ts.push_back({b + "ffn_gate.weight", {uint64_t(hidden), uint64_t(ffn)}, iota_values(size_t(ffn * hidden), 1.0f)});
    ts.push_back({b + "ffn_up.weight", {uint64_t(hidden), uint64_t(ffn)}, iota_values(size_t(ffn * hidden), 1.0f)});
    ts.push_back({b + "ffn_down.weight", {uint64_t(ffn), uint64_t(hidden)}, iota_values(size_t(ffn * hidden), 1.0f)});
  }
  auto meta = [&](Writer& w) { llama_metadata(w, {hidden, heads, kvh, ffn, vocab, 2048, 100000.0f}); };
  const auto bytes = model_file(12, meta, ts);
  const auto path = std::filesystem::temp_directory_path() / ("kvlm-llama-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  {
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "llama.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_EQ(arch_name(c.arch), "LlamaForCausalLM");
    EXPECT_EQ(c.num_layers, 2);
    EXPECT_EQ(c.hidden_size, hidden);
    EXPECT_EQ(c.num_heads, heads);
    EXPECT_EQ(c.num_kv_heads, kvh);
    EXPECT_EQ(c.head_dim, hd);
    EXPECT_EQ(c.intermediate_size, ffn);
    EXPECT_EQ(c.vocab_size, vocab);
    EXPECT_EQ(c.max_position_embeddings, 2048);
    EXPECT_DOUBLE_EQ(c.rope.theta, 100000.0);
    EXPECT_NEAR(c.rms_norm_eps, 1e-5, 1e-12);
    EXPECT_TRUE(c.tie_word_embeddings);  // no output.weight
    EXPECT_EQ(c.bos_token_id, 1);
    EXPECT_EQ(c.eos_token_ids, (std::vector<TokenId>{2}));
    EXPECT_EQ(m.tensors.size(), 2u + 2u * 9u);
    ASSERT_TRUE(m.tensors.count("model.layers.1.self_attn.q_proj.weight"));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.1.self_attn.q_proj.weight")), q_hf);
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.0.self_attn.k_proj.weight")), k_hf);
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.0.mlp.down_proj.weight")), iota_values(size_t(ffn * hidden), 1.0f));
  }
  // An architecture kvlm does not run, and a tensor no llama has.
  auto other = bytes;
  const std::string llama = "llama";
  const auto at = std::search(other.begin(), other.end(), llama.begin(), llama.end());
  std::copy_n("bloom", 5, at);
  try {
    map_gguf_model(parse_gguf(other, "x.gguf"), "x.gguf");
    ADD_FAILURE() << "accepted a bloom model";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GGUF architecture 'bloom' is not supported"), std::string::npos) << e.what();
  }
  // Llama 3.1-style scaling: llama.cpp's converter stores the llama3 rope scaling as per-frequency
  // divisors (rope_freqs.weight); they reach the config and give the llama3 frequencies.
  {
    RopeConfig l3{.type = RopeType::Llama3, .theta = 100000.0, .factor = 8.0, .low_freq_factor = 1.0,
                  .high_freq_factor = 4.0, .original_max_position = 64};
    const auto plain = rope_inv_freq(RopeConfig{.theta = 100000.0}, hd), scaled = rope_inv_freq(l3, hd);
    std::vector<float> factors;
    for (size_t i = 0; i < plain.size(); ++i) factors.push_back(plain[i] / scaled[i]);
    auto with = ts;
    with.push_back({"rope_freqs.weight", {uint64_t(hd / 2)}, factors});
    const auto rpath = std::filesystem::temp_directory_path() / ("kvlm-llama31-" + std::to_string(::getpid()) + ".gguf");
    const auto rb = model_file(12, meta, with);
    std::ofstream(rpath, std::ios::binary).write(reinterpret_cast<const char*>(rb.data()), std::streamsize(rb.size()));
    const Checkpoint ck = Checkpoint::open(rpath);
    const ModelConfig c = ck.model_config(rpath);
    ASSERT_EQ(c.rope.freq_factors.size(), size_t(hd / 2));
    const auto got = rope_inv_freq(c.rope, hd);
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], scaled[i], 1e-6 * scaled[i]) << i;
    std::filesystem::remove(rpath);
    with.back().values.pop_back();  // a tensor of the wrong length
    with.back().ne = {uint64_t(hd / 2 - 1)};
    EXPECT_THROW(map_gguf_model(parse_gguf(model_file(12, meta, with), "z.gguf"), "z.gguf"), Error);
  }
  // A tensor whose shape disagrees with the metadata: the error names both tensor names.
  {
    auto bad = ts;
    for (auto& t : bad)
      if (t.name == "blk.1.ffn_up.weight") t.ne = {uint64_t(hidden), uint64_t(ffn / 2)}, t.values.resize(t.values.size() / 2);
    const auto bpath = std::filesystem::temp_directory_path() / ("kvlm-llama-bad-" + std::to_string(::getpid()) + ".gguf");
    const auto bb = model_file(12, meta, bad);
    std::ofstream(bpath, std::ios::binary).write(reinterpret_cast<const char*>(bb.data()), std::streamsize(bb.size()));
    ModelOptions o;
    o.model_dir = bpath;
    try {
      LoadedModel::load(o);
      ADD_FAILURE() << "loaded a tensor of the wrong shape";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tensor 'model.layers.1.mlp.up_proj.weight' (GGUF tensor 'blk.1.ffn_up.weight') "
                                           "has shape [8, 8] but the GGUF metadata implies [16, 8]"),
                std::string::npos)
          << e.what();
    }
    std::filesystem::remove(bpath);
  }
  ts.push_back({"blk.0.mystery.weight", {8}, std::vector<float>(8, 0.0f)});
  try {
    map_gguf_model(parse_gguf(model_file(12, meta, ts), "y.gguf"), "y.gguf");
    ADD_FAILURE() << "accepted an unknown tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'blk.0.mystery.weight' has no place"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

// Gemma 3: sliding layers every 6th global, the norms' stored 1 + w back to w, q/k untouched.
TEST(GGUFModel, Gemma3NormsAndSlidingLayers) {
  const int hidden = 8, ffn = 16, vocab = 4, layers = 7;
  std::vector<F32Tensor> ts{{"token_embd.weight", {8, uint64_t(vocab)}, iota_values(32, 0.1f)},
                            {"output_norm.weight", {8}, std::vector<float>(8, 1.25f)}};
  for (int l = 0; l < layers; ++l) {
    const std::string b = "blk." + std::to_string(l) + ".";
    for (const char* n : {"attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"})
      ts.push_back({b + n + ".weight", {8}, std::vector<float>(8, 1.5f)});
    for (const char* n : {"attn_q_norm", "attn_k_norm"}) ts.push_back({b + n + ".weight", {4}, std::vector<float>(4, 0.75f)});
    ts.push_back({b + "attn_q.weight", {8, 8}, iota_values(64, 1.0f)});
    ts.push_back({b + "attn_k.weight", {8, 4}, iota_values(32, 1.0f)});
    ts.push_back({b + "attn_v.weight", {8, 4}, iota_values(32, 1.0f)});
    ts.push_back({b + "attn_output.weight", {8, 8}, iota_values(64, 1.0f)});
    for (const char* n : {"ffn_gate", "ffn_up"}) ts.push_back({b + n + ".weight", {8, uint64_t(ffn)}, iota_values(128, 1.0f)});
    ts.push_back({b + "ffn_down.weight", {uint64_t(ffn), 8}, iota_values(128, 1.0f)});
  }
  auto meta = [&](Writer& w) {
    w.key("general.architecture", GGUFType::String).str("gemma3");
    w.key("gemma3.block_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(layers));
    w.key("gemma3.context_length", GGUFType::Uint32).pod<uint32_t>(32768);
    w.key("gemma3.embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(hidden));
    w.key("gemma3.feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(ffn));
    w.key("gemma3.attention.head_count", GGUFType::Uint32).pod<uint32_t>(2);
    w.key("gemma3.attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(1);
    w.key("gemma3.attention.key_length", GGUFType::Uint32).pod<uint32_t>(4);
    w.key("gemma3.attention.value_length", GGUFType::Uint32).pod<uint32_t>(4);
    w.key("gemma3.attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(1e-6f);
    w.key("gemma3.rope.freq_base", GGUFType::Float32).pod<float>(1000000.0f);
    w.key("gemma3.attention.sliding_window", GGUFType::Uint32).pod<uint32_t>(512);
    w.key("tokenizer.ggml.tokens", GGUFType::Array).pod<uint32_t>(uint32_t(GGUFType::String)).pod<uint64_t>(uint64_t(vocab));
    for (int i = 0; i < vocab; ++i) w.str("t" + std::to_string(i));
  };
  const auto bytes = model_file(13, meta, ts);
  const auto path = std::filesystem::temp_directory_path() / ("kvlm-gemma-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  {
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "gemma.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_EQ(arch_name(c.arch), "Gemma3ForCausalLM");
    EXPECT_EQ(c.hidden_act, GluActivation::GeluTanh);
    ASSERT_EQ(c.layers.size(), size_t(layers));
    for (int l = 0; l < layers; ++l) {
      EXPECT_EQ(c.layers[size_t(l)].kind, (l + 1) % 6 == 0 ? AttentionKind::Full : AttentionKind::Sliding) << l;
      if (c.layers[size_t(l)].kind == AttentionKind::Sliding) EXPECT_EQ(c.layers[size_t(l)].window, 512);
    }
    ASSERT_TRUE(c.rope_local.has_value());
    EXPECT_DOUBLE_EQ(c.rope_local->theta, 10000.0);
    EXPECT_DOUBLE_EQ(c.rope.theta, 1000000.0);
    EXPECT_EQ(c.query_pre_attn_scalar, 4.0);
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.3.pre_feedforward_layernorm.weight")), std::vector<float>(8, 0.5f));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.0.self_attn.k_norm.weight")), std::vector<float>(4, -0.25f));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.norm.weight")), std::vector<float>(8, 0.25f));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.0.self_attn.q_proj.weight")), iota_values(64, 1.0f));
  }
  std::filesystem::remove(path);
}

TEST(GGUFModel, UnpermuteInvertsLlamaCppsPermutation) {
  for (const int heads : {1, 2, 3}) {
    const int hd = 6, cols = 5, rows = heads * hd;
    const auto hf = iota_values(size_t(rows * cols), 1.0f);
    auto g = permute_like_llama_cpp(hf, heads, rows, cols);
    EXPECT_NE(g, hf);
    unpermute_llama_heads(g, heads, rows, cols);
    EXPECT_EQ(g, hf) << heads << " heads";
  }
  std::vector<float> odd(15);
  EXPECT_THROW(unpermute_llama_heads(odd, 1, 3, 5), Error);  // a head of 3 rows has no halves
}

// Qwen2 (q/k/v biases) and Qwen3 (q/k norms): no q/k permutation to undo (llama.cpp's converter
// permutes Llama only), the right config, and the whole model runs from the file.
TEST(GGUFModel, Qwen2AndQwen3LoadAndRun) {
  for (const std::string arch : {"qwen2", "qwen3"}) {
    SCOPED_TRACE(arch);
    const int hidden = 8, heads = 2, kvh = 1, hd = 4, ffn = 16, vocab = 6;
    std::vector<F32Tensor> ts{{"token_embd.weight", {uint64_t(hidden), uint64_t(vocab)}, iota_values(size_t(hidden * vocab), 0.01f)},
                              {"output_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)}};
    for (int l = 0; l < 2; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      ts.push_back({b + "attn_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)});
      ts.push_back({b + "attn_q.weight", {uint64_t(hidden), uint64_t(heads * hd)}, iota_values(size_t(heads * hd * hidden), 0.01f)});
      ts.push_back({b + "attn_k.weight", {uint64_t(hidden), uint64_t(kvh * hd)}, iota_values(size_t(kvh * hd * hidden), 0.02f)});
      ts.push_back({b + "attn_v.weight", {uint64_t(hidden), uint64_t(kvh * hd)}, iota_values(size_t(kvh * hd * hidden), 0.01f)});
      if (arch == "qwen2") {
        ts.push_back({b + "attn_q.bias", {uint64_t(heads * hd)}, iota_values(size_t(heads * hd), 0.1f)});
        ts.push_back({b + "attn_k.bias", {uint64_t(kvh * hd)}, iota_values(size_t(kvh * hd), 0.1f)});
        ts.push_back({b + "attn_v.bias", {uint64_t(kvh * hd)}, iota_values(size_t(kvh * hd), 0.1f)});
      } else {
        ts.push_back({b + "attn_q_norm.weight", {uint64_t(hd)}, std::vector<float>(size_t(hd), 1.0f)});
        ts.push_back({b + "attn_k_norm.weight", {uint64_t(hd)}, std::vector<float>(size_t(hd), 1.0f)});
      }
      ts.push_back({b + "attn_output.weight", {uint64_t(heads * hd), uint64_t(hidden)}, iota_values(size_t(hidden * heads * hd), 0.01f)});
      ts.push_back({b + "ffn_norm.weight", {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)});
      ts.push_back({b + "ffn_gate.weight", {uint64_t(hidden), uint64_t(ffn)}, iota_values(size_t(ffn * hidden), 0.01f)});
      ts.push_back({b + "ffn_up.weight", {uint64_t(hidden), uint64_t(ffn)}, iota_values(size_t(ffn * hidden), 0.01f)});
      ts.push_back({b + "ffn_down.weight", {uint64_t(ffn), uint64_t(hidden)}, iota_values(size_t(ffn * hidden), 0.01f)});
    }
    auto meta = [&](Writer& w) {
      w.key("general.architecture", GGUFType::String).str(arch);
      w.key(arch + ".block_count", GGUFType::Uint32).pod<uint32_t>(2);
      w.key(arch + ".context_length", GGUFType::Uint32).pod<uint32_t>(256);
      w.key(arch + ".embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(hidden));
      w.key(arch + ".feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(ffn));
      w.key(arch + ".attention.head_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(heads));
      w.key(arch + ".attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(uint32_t(kvh));
      w.key(arch + ".attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(1e-6f);
      w.key(arch + ".rope.freq_base", GGUFType::Float32).pod<float>(1000000.0f);
      w.strings("tokenizer.ggml.tokens", {"a", "b", "c", "ab", "<|endoftext|>", "<|im_end|>"});
      w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(5);
    };
    const auto bytes = model_file(11, meta, ts);
    const auto path = std::filesystem::temp_directory_path() / ("kvlm-" + arch + "-" + std::to_string(::getpid()) + ".gguf");
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    {
      const GGUFFile f(path);
      const GGUFModel m = map_gguf_model(f.header(), "q.gguf");
      const ModelConfig c = parse_model_config(m.config, nullptr);
      EXPECT_EQ(arch_name(c.arch), arch == "qwen2" ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM");
      EXPECT_EQ(c.qkv_bias, arch == "qwen2");
      EXPECT_EQ(c.qk_norm, arch == "qwen3");
      EXPECT_EQ(c.eos_token_ids, (std::vector<TokenId>{5}));
      EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.1.self_attn.q_proj.weight")),
                iota_values(size_t(heads * hd * hidden), 0.01f));  // as stored: not permuted
      if (arch == "qwen2")
        EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.0.self_attn.k_proj.bias")), iota_values(size_t(kvh * hd), 0.1f));
    }
    ModelOptions o;
    o.model_dir = path;
    auto model = LoadedModel::load(o);
    GenerateRequest g;
    g.prompt = {0, 1, 2};
    g.max_tokens = 3;
    g.ignore_eos = true;
    g.sampling.temperature = 0;
    EXPECT_EQ(generate(*model, g).tokens.size(), 3u);
    std::filesystem::remove(path);
  }
}

// A model file or directory loaded with these options.
std::unique_ptr<LoadedModel> load_model(const std::filesystem::path& p, std::optional<DType> dtype,
                                        Device device = Device::Cpu, bool dequantize = false) {
  ModelOptions o;
  o.model_dir = p;
  o.dtype = dtype;
  o.device = device;
  o.dequantize_weights = dequantize;
  return LoadedModel::load(o);
}

// A Llama whose matrices are every block type (mixed inside the fused q/k/v and gate/up, as
// Q4_K_M files mix them; a tied Q8_0 embedding), written to a temporary file.
struct BlockLlama {
  static constexpr int hidden = 256, heads = 4, kvh = 2, hd = 64, ffn = 512, vocab = 40;
  std::filesystem::path path;
  size_t block_bytes = 0;     // the file's blocks
  size_t grouped_bytes = 0;   // the same matrices as grouped codes (io/grouped_codes.h)
  BlockLlama() {
    std::mt19937 rng(7);
    std::vector<F32Tensor> ts;
    auto blocks = [&](const std::string& name, uint64_t cols, uint64_t rows, GGMLType type) {
      ts.push_back(F32Tensor{name, {cols, rows}, {}, type, test::random_ggml_blocks(type, int64_t(cols * rows), rng)});
      block_bytes += ts.back().raw.size();
      const GroupedLayout l = *grouped_layout_of_ggml(uint32_t(type));
      grouped_bytes += size_t(rows) * (grouped_code_bytes(l, int64_t(cols)) + size_t(cols) / size_t(l.group) * 4);
    };
    auto norm = [&](const std::string& name) {
      ts.push_back({name, {uint64_t(hidden)}, std::vector<float>(size_t(hidden), 1.0f)});
    };
    blocks("token_embd.weight", hidden, vocab, GGMLType::Q8_0);
    norm("output_norm.weight");
    const GGMLType types[2][7] = {
        {GGMLType::Q4_K, GGMLType::Q5_K, GGMLType::Q6_K, GGMLType::Q8_0, GGMLType::Q4_0, GGMLType::Q5_1, GGMLType::Q2_K},
        {GGMLType::Q3_K, GGMLType::Q4_1, GGMLType::Q5_0, GGMLType::Q6_K, GGMLType::Q4_K, GGMLType::Q4_K, GGMLType::Q6_K}};
    for (int l = 0; l < 2; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      const GGMLType* t = types[l];
      norm(b + "attn_norm.weight");
      blocks(b + "attn_q.weight", hidden, heads * hd, t[0]);
      blocks(b + "attn_k.weight", hidden, kvh * hd, t[1]);
      blocks(b + "attn_v.weight", hidden, kvh * hd, t[2]);
      blocks(b + "attn_output.weight", heads * hd, hidden, t[3]);
      norm(b + "ffn_norm.weight");
      blocks(b + "ffn_gate.weight", hidden, ffn, t[4]);
      blocks(b + "ffn_up.weight", hidden, ffn, t[5]);
      blocks(b + "ffn_down.weight", ffn, hidden, t[6]);
    }
    auto meta = [&](Writer& w) { llama_metadata(w, {hidden, heads, kvh, ffn, vocab, 512, 10000.0f}); };
    const auto bytes = model_file(12, meta, ts);
    path = std::filesystem::temp_directory_path() / ("kvlm-blocks-" + std::to_string(::getpid()) + ".gguf");
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  ~BlockLlama() { std::filesystem::remove(path); }
  std::unique_ptr<LoadedModel> load(bool dequantize, std::optional<DType> dtype, Device device = Device::Cpu) const {
    return load_model(path, dtype, device, dequantize);
  }
  // Greedy tokens with the top-2 log-probabilities; `rows` prompt tokens (12: the CPU's batched
  // kernels; on a GPU 12 the grouped-code GEMV, 40 gemm_int, 80 the dequantize-and-GEMM path).
  static GenerateResult greedy(LoadedModel& m, int rows = 12) {
    GenerateRequest g;
    const TokenId ids[] = {1, 5, 9, 14, 3, 22, 7, 31, 12, 8, 19, 25};
    for (int i = 0; i < rows; ++i) g.prompt.push_back(i < 12 ? ids[i] : TokenId((i * 7 + 3) % vocab));
    g.max_tokens = 12;
    g.ignore_eos = true;
    g.sampling.temperature = 0;
    g.logprobs = 2;
    return generate(m, g);
  }
};

// The CPU keeps the blocks, and what it computes equals the dequantize-at-load path: exactly
// enough for greedy tokens with --dtype float32 (fp32 products of the same values), within int8
// activation rounding otherwise.
TEST(GGUFModel, QuantizedBlocksStayResidentAndMatchTheDequantizedPath) {
  const BlockLlama f;
  constexpr int hidden = BlockLlama::hidden, heads = BlockLlama::heads, kvh = BlockLlama::kvh, hd = BlockLlama::hd,
                ffn = BlockLlama::ffn, vocab = BlockLlama::vocab;
  const auto dequantized = f.load(true, DType::F32), exact = f.load(false, DType::F32), fast = f.load(false, std::nullopt);
  const size_t norms = size_t(5 * hidden + hd / 2) * sizeof(float);  // and RoPE's inverse frequencies
  EXPECT_EQ(dequantized->model().weight_bytes(), size_t(2 * (hidden * (heads + 2 * kvh) * hd + hd * heads * hidden +
                                                             3 * hidden * ffn) + vocab * hidden) * sizeof(float) + norms);
  EXPECT_EQ(exact->model().weight_bytes(), f.block_bytes + norms);  // the file's blocks, not 4-8x them
  const auto want = BlockLlama::greedy(*dequantized), got = BlockLlama::greedy(*exact),
             approx = BlockLlama::greedy(*fast);
  EXPECT_EQ(got.tokens, want.tokens);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < want.logprobs.size(); ++i) EXPECT_NEAR(got.logprobs[i].logprob, want.logprobs[i].logprob, 1e-4) << i;
  // Int8 activations: the same tokens while the reference's top two are well apart.
  test::expect_greedy_until_near_tie(approx, want, 0.05, 1.0, "int8 activations");
}

// On a GPU the same matrices stay quantized as grouped codes (4-bit and 8-bit parts inside the
// fused projections, the tied Q8_0 embedding and LM head), and what it computes follows the
// dequantize-at-load path on the same GPU: decode and 12-row prompts through the grouped-code
// GEMV, 40 rows through gemm_int, 80 through the dequantize-and-GEMM path.
TEST(GGUFModel, CudaKeepsBlocksAsGroupedCodes) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const BlockLlama f;
  const auto dequantized = f.load(true, DType::BF16, Device::Cuda), kept = f.load(false, DType::BF16, Device::Cuda);
  const size_t norms = size_t(5 * BlockLlama::hidden) * sizeof(float);
  EXPECT_EQ(kept->model().weight_bytes(), f.grouped_bytes + norms);
  for (int rows : {12, 40, 80}) {
    const auto want = BlockLlama::greedy(*dequantized, rows), got = BlockLlama::greedy(*kept, rows);
    // Both round each weight to bf16 once; the kept codes' scales are rounded to bf16 first.
    test::expect_greedy_until_near_tie(got, want, 0.1, 0.05, "grouped codes, " + std::to_string(rows) + "-token prompt");
  }
}


// Qwen3-MoE as llama.cpp's convert_hf_to_gguf.py writes it (arch qwen3moe): every expert's
// gate, up and down projections stacked into one [experts][rows][cols] tensor per layer, the
// router as ffn_gate_inp, and the dense layer of mlp_only_layers as a plain MLP. Metadata keys
// are the converter's; `norm` adds expert_weights_norm.
struct Qwen3MoeDims {
  int layers, hidden, heads, kv_heads, head_dim, ffn, experts, top_k, expert_ffn, vocab;
};
void qwen3moe_metadata(Writer& w, const Qwen3MoeDims& d, std::optional<bool> norm) {
  const std::string a = "qwen3moe.";
  w.key("general.architecture", GGUFType::String).str("qwen3moe");
  w.key(a + "block_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.layers));
  w.key(a + "context_length", GGUFType::Uint32).pod<uint32_t>(512);
  w.key(a + "embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.hidden));
  w.key(a + "feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.ffn));
  w.key(a + "attention.head_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.heads));
  w.key(a + "attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.kv_heads));
  w.key(a + "attention.key_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.head_dim));
  w.key(a + "attention.value_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.head_dim));
  w.key(a + "attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(1e-6f);
  w.key(a + "rope.freq_base", GGUFType::Float32).pod<float>(1000000.0f);
  w.key(a + "expert_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.experts));
  w.key(a + "expert_used_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.top_k));
  w.key(a + "expert_feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.expert_ffn));
  if (norm) w.key(a + "expert_weights_norm", GGUFType::Bool).pod<uint8_t>(*norm ? 1 : 0);
  std::vector<std::string> tokens;
  for (int i = 0; i < d.vocab; ++i) tokens.push_back("t" + std::to_string(i));
  w.strings("tokenizer.ggml.tokens", tokens);
  w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(1);
  w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(2);
}
constexpr uint64_t kQwen3MoeKeys = 18;  // with expert_weights_norm

std::filesystem::path write_temp(const std::vector<uint8_t>& bytes, const std::string& stem) {
  const auto path = std::filesystem::temp_directory_path() / ("kvlm-" + stem + "-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

// The golden tiny Qwen3-MoE (tests/golden/models/qwen3-moe: 7 experts, top 3, a dense first
// layer, norm_topk_prob false) converted to a qwen3moe GGUF of float32 tensors: kvlm reads
// the stacked experts, the router and the dense layer back as the Hugging Face model, so its
// logits equal those it computes from the safetensors bit for bit, and its greedy tokens are
// transformers' (tests/golden/expected/qwen3-moe.json).
TEST(GGUFModel, Qwen3MoeIsTheHuggingFaceModel) {
  const std::filesystem::path golden = std::filesystem::path(KVLM_TEST_DATA) / "golden";
  const auto dir = golden / "models" / "qwen3-moe";
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  const Qwen3MoeDims d{cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["num_experts"],
                       cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["vocab_size"]};
  ASSERT_EQ(cfg["mlp_only_layers"], nlohmann::json::array({0}));
  ASSERT_FALSE(cfg["norm_topk_prob"].get<bool>());
  SafetensorsFile st(dir / "model.safetensors");
  auto values = [&](const std::string& name) {
    const TensorInfo* t = st.find(name);
    if (!t) throw Error("golden qwen3-moe has no " + name);
    std::vector<float> v(size_t(t->numel()));
    convert_to_f32(t->dtype, st.view(*t).bytes, v);
    return v;
  };
  auto ne = [](const std::vector<int64_t>& shape) {  // ggml's order: innermost first
    return std::vector<uint64_t>(shape.rbegin(), shape.rend());
  };
  std::vector<F32Tensor> ts;
  auto plain = [&](const std::string& gg, const std::string& hf) {
    ts.push_back({gg, ne(st.find(hf)->shape), values(hf)});
  };
  plain("token_embd.weight", "model.embed_tokens.weight");
  plain("output_norm.weight", "model.norm.weight");
  plain("output.weight", "lm_head.weight");
  for (int l = 0; l < d.layers; ++l) {
    const std::string g = "blk." + std::to_string(l) + ".", f = "model.layers." + std::to_string(l) + ".";
    for (const auto& [gg, hf] : {std::pair{"attn_norm.weight", "input_layernorm.weight"},
                                 std::pair{"attn_q.weight", "self_attn.q_proj.weight"},
                                 std::pair{"attn_k.weight", "self_attn.k_proj.weight"},
                                 std::pair{"attn_v.weight", "self_attn.v_proj.weight"},
                                 std::pair{"attn_output.weight", "self_attn.o_proj.weight"},
                                 std::pair{"attn_q_norm.weight", "self_attn.q_norm.weight"},
                                 std::pair{"attn_k_norm.weight", "self_attn.k_norm.weight"},
                                 std::pair{"ffn_norm.weight", "post_attention_layernorm.weight"}})
      plain(g + gg, f + hf);
    if (l == 0) {
      plain(g + "ffn_gate.weight", f + "mlp.gate_proj.weight");
      plain(g + "ffn_up.weight", f + "mlp.up_proj.weight");
      plain(g + "ffn_down.weight", f + "mlp.down_proj.weight");
      continue;
    }
    plain(g + "ffn_gate_inp.weight", f + "mlp.gate.weight");
    for (const auto& [gg, hf] : {std::pair{"ffn_gate_exps.weight", "gate_proj.weight"},
                                 std::pair{"ffn_up_exps.weight", "up_proj.weight"},
                                 std::pair{"ffn_down_exps.weight", "down_proj.weight"}}) {
      F32Tensor t{g + gg, {}, {}};
      for (int e = 0; e < d.experts; ++e) {
        const std::string name = f + "mlp.experts." + std::to_string(e) + "." + hf;
        if (e == 0) t.ne = ne(st.find(name)->shape);
        const auto v = values(name);
        t.values.insert(t.values.end(), v.begin(), v.end());
      }
      t.ne.push_back(uint64_t(d.experts));
      ts.push_back(std::move(t));
    }
  }
  const auto path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, false); }, ts),
                               "qwen3moe");
  {
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "q.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_EQ(arch_name(c.arch), "Qwen3MoeForCausalLM");
    ASSERT_TRUE(c.moe);
    EXPECT_EQ(c.moe->num_experts, d.experts);
    EXPECT_EQ(c.moe->top_k, d.top_k);
    EXPECT_EQ(c.moe->expert_size, d.expert_ffn);
    EXPECT_FALSE(c.moe->norm_topk);
    EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, true}));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.2.mlp.experts.5.down_proj.weight")),
              values("model.layers.2.mlp.experts.5.down_proj.weight"));
  }
  auto load = [](const std::filesystem::path& p) { return load_model(p, DType::F32); };
  const nlohmann::json want = nlohmann::json::parse(std::ifstream(golden / "expected" / "qwen3-moe.json"));
  std::vector<TokenId> all = want["prompt_ids"].get<std::vector<TokenId>>();
  const auto greedy = want["greedy_ids"].get<std::vector<TokenId>>();
  all.insert(all.end(), greedy.begin(), greedy.end());
  const auto from_gguf = load(path), from_hf = load(dir);
  EXPECT_EQ(all_logits(*from_gguf, all, 7), all_logits(*from_hf, all, 7));
  GenerateRequest g;
  g.prompt = want["prompt_ids"].get<std::vector<TokenId>>();
  g.max_tokens = int(greedy.size());
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  EXPECT_EQ(generate(*from_gguf, g).tokens, greedy);
  std::filesystem::remove(path);
}

// Without expert_weights_norm a qwen3moe file renormalizes the top-k weights, as llama.cpp
// does (and Qwen3-30B-A3B's norm_topk_prob); mismatched expert tensors are refused by name.
TEST(GGUFModel, Qwen3MoeMetadataAndDamage) {
  const Qwen3MoeDims d{1, 32, 2, 1, 16, 64, 3, 2, 32, 4};
  auto tensors = [&](uint64_t experts) {
    std::vector<F32Tensor> ts{{"token_embd.weight", {32, 4}, iota_values(128, 0.01f)},
                              {"output_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_q.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_k.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_v.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_output.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_q_norm.weight", {16}, std::vector<float>(16, 1.0f)},
                              {"blk.0.attn_k_norm.weight", {16}, std::vector<float>(16, 1.0f)},
                              {"blk.0.ffn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.ffn_gate_inp.weight", {32, 3}, iota_values(96, 1e-2f)},
                              {"blk.0.ffn_gate_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)},
                              {"blk.0.ffn_up_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)},
                              {"blk.0.ffn_down_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)}};
    return ts;
  };
  {
    const auto path = write_temp(model_file(kQwen3MoeKeys - 1, [&](Writer& w) { qwen3moe_metadata(w, d, std::nullopt); },
                                            tensors(3)),
                                 "qwen3moe-norm");
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "q.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_TRUE(c.moe->norm_topk);
    EXPECT_EQ(c.moe_layers, std::vector<bool>{true});
    EXPECT_EQ(m.tensors.at("model.layers.0.mlp.experts.2.up_proj.weight").expert, 2);
    std::filesystem::remove(path);
  }
  const auto path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, true); }, tensors(4)),
                               "qwen3moe-bad");
  const GGUFFile f(path);
  EXPECT_NE(test::error_of([&] { map_gguf_model(f.header(), "q.gguf"); })
                .find("blk.0.ffn_gate_exps.weight is not [3 experts][rows][cols]"),
            std::string::npos);
  std::filesystem::remove(path);
}

// GPT-OSS as llama.cpp's convert_hf_to_gguf.py writes it (arch gpt-oss): each layer's fused
// MXFP4 gate_up_proj split into ffn_gate_exps (the even rows) and ffn_up_exps (the odd ones),
// down_proj as ffn_down_exps, every block re-packed from the checkpoint's nibble order (values
// 2k and 2k + 1 in byte k) to ggml's (values j and j + 16 in byte j) behind its E8M0 byte,
// the biases split the same way, the router as ffn_gate_inp, the sinks as attn_sinks. Metadata
// keys are the converter's.
struct GptOssDims {
  int layers, hidden, heads, kv_heads, head_dim, experts, top_k, expert_ffn, vocab, window;
};
void gptoss_metadata(Writer& w, const GptOssDims& d, bool harmony = false) {
  const std::string a = "gpt-oss.";
  w.key("general.architecture", GGUFType::String).str("gpt-oss");
  w.key(a + "block_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.layers));
  w.key(a + "context_length", GGUFType::Uint32).pod<uint32_t>(128);
  w.key(a + "embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.hidden));
  w.key(a + "feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.expert_ffn));
  w.key(a + "attention.head_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.heads));
  w.key(a + "attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.kv_heads));
  w.key(a + "attention.key_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.head_dim));
  w.key(a + "attention.value_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.head_dim));
  w.key(a + "attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(1e-5f);
  w.key(a + "rope.freq_base", GGUFType::Float32).pod<float>(150000.0f);
  w.key(a + "expert_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.experts));
  w.key(a + "expert_used_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.top_k));
  w.key(a + "expert_feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.expert_ffn));
  w.key(a + "attention.sliding_window", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.window));
  w.key(a + "rope.scaling.type", GGUFType::String).str("yarn");
  w.key(a + "rope.scaling.factor", GGUFType::Float32).pod<float>(4.0f);
  w.key(a + "rope.scaling.original_context_length", GGUFType::Uint32).pod<uint32_t>(32);
  std::vector<std::string> tokens;
  for (int i = 0; i < d.vocab; ++i) tokens.push_back("t" + std::to_string(i));
  if (harmony) tokens = {"t0", "<|end|>", "<|return|>", "<|call|>"};  // a file naming <|end|> its eos
  w.strings("tokenizer.ggml.tokens", tokens);
  w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(harmony ? 0 : 1);
  w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(harmony ? 1 : 2);
}
constexpr uint64_t kGptOssKeys = 21;

// Rows `rows` (every other one from `first` when `step` is 2) of expert tensors in the
// checkpoint's MXFP4 layout (blocks [E][R][C/32][16], scales [E][R][C/32]) as ggml MXFP4
// blocks, experts outermost.
std::vector<uint8_t> ggml_mxfp4(std::span<const uint8_t> blocks, std::span<const uint8_t> scales, int64_t experts,
                                int64_t rows, int64_t nb, int first, int step) {
  std::vector<uint8_t> out;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = first; r < rows; r += step)
      for (int64_t b = 0; b < nb; ++b) {
        const size_t at = size_t((e * rows + r) * nb + b);
        out.push_back(scales[at]);
        const uint8_t* q = blocks.data() + at * 16;
        auto code = [&](int i) { return uint8_t((q[i / 2] >> (4 * (i % 2))) & 0xF); };
        for (int j = 0; j < 16; ++j) out.push_back(uint8_t(code(j) | (code(j + 16) << 4)));
      }
  return out;
}

// The golden tiny GPT-OSS with MXFP4 experts (tests/data/int4/mxfp4, whose experts equal their
// bf16 twin's: Int4Checkpoint.Mxfp4ExpertsEqualTheirTwin) converted as above, beside a copy of
// the safetensors model with llama.cpp's fixed swiglu_limit of 7 (the checkpoint's is 1.5).
struct GptOssPair {
  std::filesystem::path src = std::filesystem::path(KVLM_TEST_DATA) / "data" / "int4" / "mxfp4";
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(src / "config.json"));
  GptOssDims d{cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
               cfg["head_dim"], cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
               cfg["vocab_size"], cfg["sliding_window"]};
  std::filesystem::path gguf, hf;

  GptOssPair() {
    SafetensorsFile st(src / "model.safetensors");
    auto values = [&](const std::string& name) {
      const TensorInfo* t = st.find(name);
      if (!t) throw Error("mxfp4 gpt-oss has no " + name);
      std::vector<float> v(size_t(t->numel()));
      convert_to_f32(t->dtype, st.view(*t).bytes, v);
      return v;
    };
    auto bytes = [&](const std::string& name) { return st.view(*st.find(name)).bytes; };
    auto ne = [](const std::vector<int64_t>& shape) { return std::vector<uint64_t>(shape.rbegin(), shape.rend()); };
    std::vector<F32Tensor> ts;
    auto plain = [&](const std::string& gg, const std::string& hf) { ts.push_back({gg, ne(st.find(hf)->shape), values(hf)}); };
    plain("token_embd.weight", "model.embed_tokens.weight");
    plain("output_norm.weight", "model.norm.weight");
    plain("output.weight", "lm_head.weight");
    const int64_t E = d.experts, I = d.expert_ffn, H = d.hidden;
    for (int l = 0; l < d.layers; ++l) {
      const std::string g = "blk." + std::to_string(l) + ".", f = "model.layers." + std::to_string(l) + ".";
      for (const auto& [gg, hf] : {std::pair{"attn_norm.weight", "input_layernorm.weight"},
                                   std::pair{"post_attention_norm.weight", "post_attention_layernorm.weight"},
                                   std::pair{"attn_q.weight", "self_attn.q_proj.weight"}, std::pair{"attn_q.bias", "self_attn.q_proj.bias"},
                                   std::pair{"attn_k.weight", "self_attn.k_proj.weight"}, std::pair{"attn_k.bias", "self_attn.k_proj.bias"},
                                   std::pair{"attn_v.weight", "self_attn.v_proj.weight"}, std::pair{"attn_v.bias", "self_attn.v_proj.bias"},
                                   std::pair{"attn_output.weight", "self_attn.o_proj.weight"},
                                   std::pair{"attn_output.bias", "self_attn.o_proj.bias"},
                                   std::pair{"attn_sinks.weight", "self_attn.sinks"},
                                   std::pair{"ffn_gate_inp.weight", "mlp.router.weight"},
                                   std::pair{"ffn_gate_inp.bias", "mlp.router.bias"}})
        plain(g + gg, f + hf);
      const std::string x = f + "mlp.experts.";
      const auto gu_b = bytes(x + "gate_up_proj_blocks"), gu_s = bytes(x + "gate_up_proj_scales");
      const auto dn_b = bytes(x + "down_proj_blocks"), dn_s = bytes(x + "down_proj_scales");
      auto mx = [](const std::string& name, std::vector<uint64_t> shape, std::vector<uint8_t> raw) {
        return F32Tensor{name, std::move(shape), {}, GGMLType::MXFP4, std::move(raw)};
      };
      const auto u = [](int64_t v) { return uint64_t(v); };
      ts.push_back(mx(g + "ffn_gate_exps.weight", {u(H), u(I), u(E)}, ggml_mxfp4(gu_b, gu_s, E, 2 * I, H / 32, 0, 2)));
      ts.push_back(mx(g + "ffn_up_exps.weight", {u(H), u(I), u(E)}, ggml_mxfp4(gu_b, gu_s, E, 2 * I, H / 32, 1, 2)));
      ts.push_back(mx(g + "ffn_down_exps.weight", {u(I), u(H), u(E)}, ggml_mxfp4(dn_b, dn_s, E, H, I / 32, 0, 1)));
      const auto gu_bias = values(x + "gate_up_proj_bias");  // [E][2I], gate and up alternating
      std::vector<float> gate_bias, up_bias;
      for (size_t i = 0; i < gu_bias.size(); ++i) (i % 2 ? up_bias : gate_bias).push_back(gu_bias[i]);
      ts.push_back({g + "ffn_gate_exps.bias", {u(I), u(E)}, gate_bias});
      ts.push_back({g + "ffn_up_exps.bias", {u(I), u(E)}, up_bias});
      ts.push_back({g + "ffn_down_exps.bias", {u(H), u(E)}, values(x + "down_proj_bias")});
    }
    gguf = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d); }, ts), "gpt-oss");
    hf = std::filesystem::temp_directory_path() / ("kvlm-gpt-oss-hf-" + std::to_string(::getpid()));
    std::filesystem::create_directories(hf);
    nlohmann::json c7 = cfg;
    c7["swiglu_limit"] = 7.0;
    std::ofstream(hf / "config.json") << c7.dump();
    std::filesystem::copy_file(src / "model.safetensors", hf / "model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
  }
  ~GptOssPair() {
    std::filesystem::remove(gguf);
    std::filesystem::remove_all(hf);
  }
  std::vector<TokenId> prompt() const {  // past the 8-token window
    std::vector<TokenId> p;
    for (int i = 0; i < 40; ++i) p.push_back(TokenId((i * 37 + 11) % d.vocab));
    return p;
  }
  static GenerateResult greedy(LoadedModel& m, const std::vector<TokenId>& prompt) {
    GenerateRequest gr;
    gr.prompt = prompt;
    gr.max_tokens = 12;
    gr.ignore_eos = true;
    gr.sampling.temperature = 0;
    gr.logprobs = 2;
    return generate(m, gr);
  }
};

// kvlm reads the GGUF file back as the Hugging Face model — the MXFP4 blocks to the same
// weights, each expert's slice to its place in the fused layout, YaRN, the sinks and the
// sliding window from the metadata — so, dequantized at load, its logits equal those it
// computes from the safetensors bit for bit. Kept (as the MXFP4 blocks themselves), the
// fp32 path sums in another order (logits within 1e-4 of their range) and the int8
// activations follow the greedy tokens up to a near tie.
TEST(GGUFModel, GptOssIsTheHuggingFaceModel) {
  const GptOssPair pair;
  const auto& d = pair.d;
  const int64_t I = d.expert_ffn, H = d.hidden;
  ASSERT_EQ(pair.cfg["rope_scaling"]["factor"], 4.0);
  ASSERT_EQ(pair.cfg["rope_scaling"]["original_max_position_embeddings"], 32);
  {
    const GGUFFile f(pair.gguf);
    const GGUFModel m = map_gguf_model(f.header(), "g.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    const ModelConfig want = parse_model_config(nlohmann::json::parse(std::ifstream(pair.hf / "config.json")), nullptr);
    EXPECT_EQ(arch_name(c.arch), "GptOssForCausalLM");
    ASSERT_TRUE(c.moe);
    EXPECT_TRUE(c.moe->per_expert_tensors);
    EXPECT_FALSE(want.moe->per_expert_tensors);
    EXPECT_EQ(c.moe->num_experts, d.experts);
    EXPECT_EQ(c.moe->top_k, d.top_k);
    EXPECT_EQ(c.moe->expert_size, d.expert_ffn);
    EXPECT_TRUE(c.moe->router_bias && c.moe->expert_bias && c.attention_sinks);
    EXPECT_EQ(c.moe->swiglu_limit, 7.0f);
    ASSERT_EQ(c.layers.size(), want.layers.size());
    for (size_t i = 0; i < c.layers.size(); ++i) {
      EXPECT_EQ(c.layers[i].kind, want.layers[i].kind) << i;
      EXPECT_EQ(c.layers[i].window, want.layers[i].window) << i;
    }
    EXPECT_EQ(c.layers[0].kind, AttentionKind::Sliding);
    EXPECT_EQ(c.rope.type, want.rope.type);
    EXPECT_EQ(rope_inv_freq(c.rope, c.head_dim), rope_inv_freq(want.rope, want.head_dim));
    EXPECT_EQ(c.rope.attention_factor, want.rope.attention_factor);
    // An expert's MXFP4 rows dequantize to the checkpoint's: expert 3's down_proj [H][I] and
    // up_proj [I][H] (the odd rows of the checkpoint's gate_up_proj).
    const Checkpoint q = Checkpoint::open(pair.src);
    for (const auto& [name, rows, cols] : {std::tuple{"model.layers.1.mlp.experts.3.down_proj.weight", H, I},
                                           std::tuple{"model.layers.0.mlp.experts.2.up_proj.weight", I, H}}) {
      const TensorView dv = q.view(name);
      const auto* all = reinterpret_cast<const float*>(dv.bytes.data());
      const std::vector<float> got = load_gguf_tensor(f, m.tensors.at(name));
      ASSERT_EQ(got.size(), size_t(rows * cols));
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], all[i]) << name << " " << i;
    }
  }
  const auto prompt = pair.prompt();
  const auto dequantized = load_model(pair.gguf, DType::F32, Device::Cpu, true);
  const auto from_hf = load_model(pair.hf, DType::F32, Device::Cpu, true);
  const std::vector<float> want = all_logits(*from_hf, prompt, 7);
  EXPECT_EQ(all_logits(*dequantized, prompt, 7), want);
  const GenerateResult want_greedy = GptOssPair::greedy(*from_hf, prompt);
  EXPECT_EQ(GptOssPair::greedy(*dequantized, prompt).tokens, want_greedy.tokens);
  // Kept: the experts as MXFP4 blocks, 17 bytes per 32 weights where float32 takes 128.
  const auto kept = load_model(pair.gguf, DType::F32, Device::Cpu);
  const size_t expert_weights = size_t(d.layers) * size_t(d.experts) * size_t(3 * I * H);
  EXPECT_EQ(dequantized->model().weight_bytes() - kept->model().weight_bytes(), expert_weights * 4 - expert_weights / 32 * 17);
  const std::vector<float> got = all_logits(*kept, prompt, 7);
  ASSERT_EQ(got.size(), want.size());
  float range = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    range = std::max(range, std::fabs(want[i]));
    worst = std::max(worst, std::fabs(got[i] - want[i]));
  }
  EXPECT_LT(worst, 1e-4f * range) << "kept MXFP4 experts (fp32 path) against the safetensors";
  // The safetensors' experts kept are the same blocks in the same places: the same logits.
  EXPECT_EQ(all_logits(*load_model(pair.hf, DType::F32, Device::Cpu), prompt, 7), got);
  EXPECT_EQ(GptOssPair::greedy(*kept, prompt).tokens, want_greedy.tokens);
  const auto int8 = load_model(pair.gguf, std::nullopt, Device::Cpu);
  test::expect_greedy_until_near_tie(GptOssPair::greedy(*int8, prompt), want_greedy, 0.05, 0.5, "int8 activations");
}

// On a GPU too: the per-expert tensors (dequantized to bf16 as the safetensors' MXFP4 experts
// are) hold the same bf16 weights as the fused layout, so the same kernels give the same logits.
TEST(GGUFModel, CudaGptOssIsTheHuggingFaceModel) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const GptOssPair pair;
  const auto prompt = pair.prompt();
  const auto dequantized = load_model(pair.gguf, DType::BF16, Device::Cuda, true);
  const auto from_hf = load_model(pair.hf, DType::BF16, Device::Cuda, true);
  EXPECT_EQ(dequantized->model().weight_bytes(), from_hf->model().weight_bytes());
  EXPECT_EQ(all_logits(*dequantized, prompt, 7), all_logits(*from_hf, prompt, 7));
  const GenerateResult want = GptOssPair::greedy(*from_hf, prompt);
  EXPECT_EQ(GptOssPair::greedy(*dequantized, prompt).tokens, want.tokens);
  // Kept: the experts as 4-bit E2M1 codes (half a byte per weight and a 4-byte word per 32)
  // where bf16 takes two bytes, read by the MoE kernels' integer GEMV; the same weights, other
  // kernels.
  const auto kept = load_model(pair.gguf, DType::BF16, Device::Cuda);
  const auto& d = pair.d;
  const size_t expert_weights = size_t(d.layers) * size_t(d.experts) * size_t(3 * d.expert_ffn * d.hidden);
  EXPECT_EQ(dequantized->model().weight_bytes() - kept->model().weight_bytes(), expert_weights * 2 - expert_weights / 32 * 20);
  test::expect_greedy_until_near_tie(GptOssPair::greedy(*kept, prompt), want, 0.1, 0.05, "MXFP4 as E2M1 codes");
  // The safetensors' experts kept are the same codes in the same places: the same logits.
  EXPECT_EQ(all_logits(*load_model(pair.hf, DType::BF16, Device::Cuda), prompt, 7), all_logits(*kept, prompt, 7));
}

// A gpt-oss file's expert tensors must hold expert_count experts, with their biases; gate and
// up fused into one tensor (the converter's --fuse-gate-up-exps) are refused saying so.
TEST(GGUFModel, GptOssDamageIsNamed) {
  const GptOssDims d{1, 32, 2, 1, 16, 3, 2, 32, 4, 8};
  auto tensors = [&](uint64_t experts, bool biases, bool fused) {
    std::vector<F32Tensor> ts{{"token_embd.weight", {32, 4}, iota_values(128, 0.01f)},
                              {"output_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.post_attention_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_q.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_k.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_v.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_output.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_sinks.weight", {2}, std::vector<float>(2, 0.5f)},
                              {"blk.0.ffn_gate_inp.weight", {32, 3}, iota_values(96, 1e-2f)},
                              {"blk.0.ffn_gate_inp.bias", {3}, std::vector<float>(3, 0.0f)}};
    const std::vector<std::string> parts = fused ? std::vector<std::string>{"ffn_gate_up_exps", "ffn_down_exps"}
                                                 : std::vector<std::string>{"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (const std::string& p : parts) {
      const uint64_t rows = p == "ffn_gate_up_exps" ? 64 : 32;
      ts.push_back({"blk.0." + p + ".weight", {32, rows, experts}, iota_values(size_t(32 * rows * experts), 1e-4f)});
      if (biases) ts.push_back({"blk.0." + p + ".bias", {rows, experts}, iota_values(size_t(rows * experts), 1e-3f)});
    }
    return ts;
  };
  auto error = [&](uint64_t experts, bool biases, bool fused) {
    const auto path = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d); }, tensors(experts, biases, fused)),
                                 "gpt-oss-bad");
    const GGUFFile f(path);
    std::string e = test::error_of([&] { map_gguf_model(f.header(), "g.gguf"); });
    std::filesystem::remove(path);
    return e;
  };
  EXPECT_EQ(error(3, true, false), "");
  {  // harmony's replies end at <|return|> or <|call|>, never at <|end|>
    const auto path = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d, true); }, tensors(3, true, false)),
                                 "gpt-oss-eos");
    const GGUFFile f(path);
    EXPECT_EQ(map_gguf_model(f.header(), "g.gguf").config["eos_token_id"], nlohmann::json::array({2, 3}));
    std::filesystem::remove(path);
  }
  EXPECT_NE(error(4, true, false).find("blk.0.ffn_gate_exps.weight is not [3 experts][rows][cols]"), std::string::npos);
  EXPECT_NE(error(3, false, false).find("has no blk.0.ffn_gate_exps.bias"), std::string::npos);
  EXPECT_NE(error(3, true, true).find("--fuse-gate-up-exps"), std::string::npos);
}

// A Qwen3-MoE whose experts come in the blocks Q4_K_M files use (Q4_K gate/up and Q6_K down in
// one layer; Q4_0 and Q8_0 in the other) and Q8_0 attention: each expert's slice of the
// stacked tensors stays in its blocks, and what kvlm computes from them equals the
// dequantize-at-load path (CPU), or follows it on a GPU (grouped codes).
struct BlockQwen3Moe {
  static constexpr Qwen3MoeDims d{2, 256, 4, 2, 64, 512, 5, 2, 256, 40};
  std::filesystem::path path;
  size_t block_bytes = 0;     // the file's blocks
  size_t grouped_bytes = 0;   // the same matrices as grouped codes (io/grouped_codes.h)
  BlockQwen3Moe() {
    std::mt19937 rng(11);
    std::vector<F32Tensor> ts;
    auto blocks = [&](const std::string& name, std::vector<uint64_t> ne, GGMLType type) {
      int64_t n = 1;
      for (uint64_t x : ne) n *= int64_t(x);
      const int64_t cols = int64_t(ne[0]);
      ts.push_back(F32Tensor{name, std::move(ne), {}, type, test::random_ggml_blocks(type, n, rng)});
      block_bytes += ts.back().raw.size();
      const GroupedLayout l = *grouped_layout_of_ggml(uint32_t(type));
      grouped_bytes += size_t(n / cols) * (grouped_code_bytes(l, cols) + size_t(cols / l.group) * 4);
    };
    auto norm = [&](const std::string& name, int n) {
      ts.push_back({name, {uint64_t(n)}, std::vector<float>(size_t(n), 1.0f)});
    };
    const uint64_t H = d.hidden, E = d.experts, I = d.expert_ffn, hd = d.head_dim;
    blocks("token_embd.weight", {H, uint64_t(d.vocab)}, GGMLType::Q8_0);
    norm("output_norm.weight", d.hidden);
    const GGMLType experts[2][3] = {{GGMLType::Q4_K, GGMLType::Q4_K, GGMLType::Q6_K},
                                    {GGMLType::Q4_0, GGMLType::Q4_0, GGMLType::Q8_0}};
    for (int l = 0; l < d.layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      norm(b + "attn_norm.weight", d.hidden);
      blocks(b + "attn_q.weight", {H, d.heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_k.weight", {H, d.kv_heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_v.weight", {H, d.kv_heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_output.weight", {d.heads * hd, H}, GGMLType::Q8_0);
      norm(b + "attn_q_norm.weight", d.head_dim);
      norm(b + "attn_k_norm.weight", d.head_dim);
      norm(b + "ffn_norm.weight", d.hidden);
      // The router as llama.cpp keeps it: float32, a wide spread so that routing differs by token.
      std::normal_distribution<float> n01(0.0f, 1.0f);
      std::vector<float> router(size_t(E * H));
      for (float& x : router) x = n01(rng) * 0.2f;
      ts.push_back({b + "ffn_gate_inp.weight", {H, E}, router});
      blocks(b + "ffn_gate_exps.weight", {H, I, E}, experts[l][0]);
      blocks(b + "ffn_up_exps.weight", {H, I, E}, experts[l][1]);
      blocks(b + "ffn_down_exps.weight", {I, H, E}, experts[l][2]);
    }
    path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, true); }, ts), "qwen3moe-blocks");
  }
  ~BlockQwen3Moe() { std::filesystem::remove(path); }
  std::unique_ptr<LoadedModel> load(bool dequantize, std::optional<DType> dtype, Device device = Device::Cpu) const {
    return load_model(path, dtype, device, dequantize);
  }
};

TEST(GGUFModel, Qwen3MoeExpertsStayInTheirBlocks) {
  const BlockQwen3Moe f;
  const auto& d = BlockQwen3Moe::d;
  const auto dequantized = f.load(true, DType::F32), exact = f.load(false, DType::F32), fast = f.load(false, std::nullopt);
  // Kept: the file's blocks, plus the float32 routers, norms and RoPE's inverse frequencies.
  const size_t rest = size_t(d.layers * (d.experts * d.hidden + 2 * d.hidden + 2 * d.head_dim) + d.hidden + d.head_dim / 2) *
                      sizeof(float);
  EXPECT_EQ(exact->model().weight_bytes(), f.block_bytes + rest);
  EXPECT_GT(dequantized->model().weight_bytes(), 3 * exact->model().weight_bytes());
  const auto want = BlockLlama::greedy(*dequantized), got = BlockLlama::greedy(*exact), approx = BlockLlama::greedy(*fast);
  EXPECT_EQ(got.tokens, want.tokens);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < want.logprobs.size(); ++i) EXPECT_NEAR(got.logprobs[i].logprob, want.logprobs[i].logprob, 1e-4) << i;
  test::expect_greedy_until_near_tie(approx, want, 0.05, 1.0, "int8 activations");
}

// On a GPU the experts' blocks become grouped codes (4-bit from Q4_K / Q4_0, 8-bit from Q6_K
// / Q8_0) for the MoE kernels' integer GEMV, and at 80 rows the dequantized runs.
TEST(GGUFModel, CudaKeepsQwen3MoeExpertsAsGroupedCodes) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const BlockQwen3Moe f;
  const auto dequantized = f.load(true, DType::BF16, Device::Cuda), kept = f.load(false, DType::BF16, Device::Cuda);
  // The codes, plus the bf16 routers and the fp32 norms.
  const auto& d = BlockQwen3Moe::d;
  EXPECT_EQ(kept->model().weight_bytes(),
            f.grouped_bytes + size_t(d.layers * d.experts * d.hidden) * 2 +
                size_t(d.layers * (2 * d.hidden + 2 * d.head_dim) + d.hidden) * sizeof(float));
  EXPECT_LT(kept->model().weight_bytes() * 2, dequantized->model().weight_bytes());
  for (int rows : {1, 12, 40, 80}) {
    const auto want = BlockLlama::greedy(*dequantized, rows), got = BlockLlama::greedy(*kept, rows);
    test::expect_greedy_until_near_tie(got, want, 0.1, 0.05, "grouped codes, " + std::to_string(rows) + "-token prompt");
  }
}

}  // namespace
}  // namespace kvlm

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
#include "../support/gguf_model_file.h"
#include "../support/gguf_writer.h"
#include "test_util.h"

namespace kvlm {
namespace {

using test::F32Tensor;
using test::GGUFWriter;
using test::iota_values;
using test::load_model;
using test::model_file;
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
  static GenerateResult greedy(LoadedModel& m, int rows = 12) { return test::block_model_greedy(m, rows, vocab); }
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
  test::expect_kept_blocks_follow(BlockLlama::greedy(*dequantized), BlockLlama::greedy(*exact), BlockLlama::greedy(*fast));
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

}  // namespace
}  // namespace kvlm

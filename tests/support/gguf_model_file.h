// GGUF model files built in tests: a file of named tensors (float32 values, or blocks of any
// ggml type) after metadata a test writes, written to a temporary path, loaded as a model, and
// run greedily with the top-2 log-probabilities (tests/unit/test_gguf*.cpp).
#pragma once

#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "io/gguf.h"
#include "model/loaded_model.h"
#include "offline/generate.h"
#include "gguf_writer.h"
#include "../unit/test_util.h"

namespace kvlm::test {

// A tensor of a model file: float32 values, or a quantized tensor's blocks (`raw`, of `type`).
struct F32Tensor {
  std::string name;
  std::vector<uint64_t> ne;
  std::vector<float> values;
  GGMLType type = GGMLType::F32;
  std::vector<uint8_t> raw;
  size_t bytes() const { return raw.empty() ? values.size() * 4 : raw.size(); }
};

// A model file: `n_kv` metadata keys written by `meta`, then the tensors (32-byte aligned).
inline std::vector<uint8_t> model_file(uint64_t n_kv, const std::function<void(GGUFWriter&)>& meta,
                                       const std::vector<F32Tensor>& ts) {
  GGUFWriter w;
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

// `bytes` as a file in the temporary directory, named after `stem` and this process.
inline std::filesystem::path write_temp(const std::vector<uint8_t>& bytes, const std::string& stem) {
  const auto path = std::filesystem::temp_directory_path() / ("kvlm-" + stem + "-" + std::to_string(::getpid()) + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

// 0, scale, 2 scale, ... (n values).
inline std::vector<float> iota_values(size_t n, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float(i) * scale;
  return v;
}

// A model file or directory loaded with these options.
inline std::unique_ptr<LoadedModel> load_model(const std::filesystem::path& p, std::optional<DType> dtype,
                                               Device device = Device::Cpu, bool dequantize = false) {
  ModelOptions o;
  o.model_dir = p;
  o.dtype = dtype;
  o.device = device;
  o.dequantize_weights = dequantize;
  return LoadedModel::load(o);
}

// 12 greedy tokens with the top-2 log-probabilities after `rows` prompt tokens (of a vocabulary
// of at least `vocab`): 12 fixed ones, then a pattern (on a GPU, 12 rows take the grouped-code
// GEMV, 40 gemm_int, 80 the dequantize-and-GEMM path; on the CPU 12 the batched kernels).
inline GenerateResult block_model_greedy(LoadedModel& m, int rows, int vocab) {
  GenerateRequest g;
  const TokenId ids[] = {1, 5, 9, 14, 3, 22, 7, 31, 12, 8, 19, 25};
  for (int i = 0; i < rows; ++i) g.prompt.push_back(i < 12 ? ids[i] : TokenId((i * 7 + 3) % vocab));
  g.max_tokens = 12;
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  g.logprobs = 2;
  return generate(m, g);
}

// Blocks kept on the CPU against the dequantize-at-load path (`want`): with fp32 activations
// (`exact`: the same values, another summation order) the same tokens and log-probabilities
// within 1e-4; with int8 activations (`approx`) the same tokens while the reference's top two
// are well apart.
inline void expect_kept_blocks_follow(const GenerateResult& want, const GenerateResult& exact,
                                      const GenerateResult& approx) {
  EXPECT_EQ(exact.tokens, want.tokens);
  ASSERT_EQ(exact.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < want.logprobs.size(); ++i) EXPECT_NEAR(exact.logprobs[i].logprob, want.logprobs[i].logprob, 1e-4) << i;
  expect_greedy_until_near_tie(approx, want, 0.05, 1.0, "int8 activations");
}

}  // namespace kvlm::test

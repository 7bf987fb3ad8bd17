// Random ggml quantization blocks for tests: random codes, and scales that are finite halves
// sized so that the values come out around 0.01-0.1 (weights of a model that runs sensibly).
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/gguf.h"

namespace kvlm::test {

// Blocks of `type` (Q4_0 .. Q6_K, MXFP4) holding `n` values (a multiple of the type's block).
inline std::vector<uint8_t> random_ggml_blocks(GGMLType type, int64_t n, std::mt19937& rng) {
  const auto tr = ggml_type_traits(uint32_t(type));
  KVLM_CHECK(tr && tr->block > 1 && n % tr->block == 0, "random_ggml_blocks: a block type and whole blocks");
  std::vector<uint8_t> out(size_t(n / tr->block * tr->block_bytes));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : out) b = uint8_t(byte(rng));
  // Where the type's fp16 scales sit in a block, and how large d (and dmin) should be for values
  // of about 0.05: the codes' range times the sub-block scales' range sets it.
  struct Scales {
    int d, dmin;  // byte offsets; dmin -1: none
    float size;
  };
  Scales s{};
  switch (type) {
    case GGMLType::Q4_0: s = {0, -1, 6e-3f}; break;
    case GGMLType::Q4_1: s = {0, 2, 6e-3f}; break;
    case GGMLType::Q5_0: s = {0, -1, 3e-3f}; break;
    case GGMLType::Q5_1: s = {0, 2, 3e-3f}; break;
    case GGMLType::Q8_0: s = {0, -1, 4e-4f}; break;
    case GGMLType::Q2_K: s = {80, 82, 1.5e-3f}; break;
    case GGMLType::Q3_K: s = {108, -1, 4e-4f}; break;
    case GGMLType::Q4_K: s = {0, 2, 1e-4f}; break;
    case GGMLType::Q5_K: s = {0, 2, 5e-5f}; break;
    case GGMLType::Q6_K: s = {208, -1, 1.5e-5f}; break;
    case GGMLType::MXFP4: {  // an E8M0 exponent per block: scales 2^-10 .. 2^-4 (values up to ~0.4)
      std::uniform_int_distribution<int> e(117, 123);
      for (size_t b = 0; b < out.size(); b += size_t(tr->block_bytes)) out[b] = uint8_t(e(rng));
      return out;
    }
    default: KVLM_CHECK(false, "random_ggml_blocks: not a block type");
  }
  std::uniform_real_distribution<float> factor(0.5f, 1.5f);
  auto put = [&](uint8_t* p, float v) {
    const uint16_t h = num::f32_to_f16(v);
    std::memcpy(p, &h, 2);
  };
  for (size_t b = 0; b < out.size(); b += size_t(tr->block_bytes)) {
    put(out.data() + b + s.d, s.size * factor(rng));
    // The minimum is subtracted (K types) or added (Q4_1 / Q5_1): either way centred values.
    if (s.dmin >= 0) put(out.data() + b + s.dmin, (type == GGMLType::Q4_1 || type == GGMLType::Q5_1 ? -8.0f : 1.0f) *
                                                       s.size * factor(rng));
  }
  return out;
}

}  // namespace kvlm::test

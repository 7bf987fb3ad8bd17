// KV page formats: how one row (one token, one kv head, head_dim values) is encoded on
// write and decoded on read, for every (storage dtype, quant mode) pair kvlm supports.
//
// dispatch_kv(storage, mode, f) calls f with the format type of that pair; a pair outside
// the supported set is a clear runtime error naming the set — never a pass-through
// (seed 003). Quantization follows the field's convention: code = convert(x / scale),
// x ~= code * scale; per-token-head scale = max(absmax / qmax, 1e-6), stored fp32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include "core/dtype.h"
#include "core/error.h"
#include "core/numeric.h"

namespace kvlm::kvfmt {

inline constexpr float kMinScale = 1e-6f;

// Element codecs. Each has decode(p, i) -> float and encode(p, i, x).
struct F32 {
  static constexpr DType kStorage = DType::F32;
  static float decode(const uint8_t* p, size_t i) {
    float x;
    std::memcpy(&x, p + 4 * i, 4);
    return x;
  }
  static void encode(uint8_t* p, size_t i, float x) { std::memcpy(p + 4 * i, &x, 4); }
};
template <DType S, float (*Dec)(uint16_t), uint16_t (*Enc)(float)>
struct Half {
  static constexpr DType kStorage = S;
  static float decode(const uint8_t* p, size_t i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    return Dec(h);
  }
  static void encode(uint8_t* p, size_t i, float x) {
    const uint16_t h = Enc(x);
    std::memcpy(p + 2 * i, &h, 2);
  }
};
using F16 = Half<DType::F16, num::f16_to_f32, num::f32_to_f16>;
using BF16 = Half<DType::BF16, num::bf16_to_f32, num::f32_to_bf16>;
struct E4M3 {
  static constexpr DType kStorage = DType::F8E4M3;
  static constexpr float kMax = num::kE4M3Max;
  static float decode(const uint8_t* p, size_t i) { return num::e4m3_to_f32(p[i]); }
  static void encode(uint8_t* p, size_t i, float x) { p[i] = num::f32_to_e4m3(x); }
};
struct E5M2 {
  static constexpr DType kStorage = DType::F8E5M2;
  static constexpr float kMax = num::kE5M2Max;
  static float decode(const uint8_t* p, size_t i) { return num::e5m2_to_f32(p[i]); }
  static void encode(uint8_t* p, size_t i, float x) { p[i] = num::f32_to_e5m2(x); }
};
struct I8 {
  static constexpr DType kStorage = DType::I8;
  static constexpr float kMax = num::kInt8Max;
  static float decode(const uint8_t* p, size_t i) { return float(int8_t(p[i])); }
  static void encode(uint8_t* p, size_t i, float x) {
    // Round half to even (the default FP environment), saturate symmetrically to +-127.
    const float r = std::nearbyint(std::clamp(x, -kMax, kMax));
    p[i] = uint8_t(int8_t(r));
  }
};

// A format = element codec + scale policy.
enum class ScalePolicy { None, PerTensor, PerTokenHead };

template <class Codec, ScalePolicy P>
struct Format {
  using codec = Codec;
  static constexpr ScalePolicy policy = P;

  // Encodes `x` (head_dim values) into `dst`. `tensor_scale` is used by PerTensor;
  // PerTokenHead computes the row's scale and returns it (else returns 1).
  static float encode_row(std::span<const float> x, uint8_t* dst, float tensor_scale) {
    if constexpr (P == ScalePolicy::None) {
      for (size_t i = 0; i < x.size(); ++i) Codec::encode(dst, i, x[i]);
      return 1.0f;
    } else if constexpr (P == ScalePolicy::PerTensor) {
      for (size_t i = 0; i < x.size(); ++i) Codec::encode(dst, i, x[i] / tensor_scale);
      return tensor_scale;
    } else {
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const float scale = std::max(amax / Codec::kMax, kMinScale);
      for (size_t i = 0; i < x.size(); ++i) Codec::encode(dst, i, x[i] / scale);
      return scale;
    }
  }
  // Decodes a row; `scale` is the tensor scale (PerTensor), the row's stored scale
  // (PerTokenHead), or ignored (None).
  static void decode_row(const uint8_t* src, float scale, std::span<float> out) {
    if constexpr (P == ScalePolicy::None) {
      for (size_t i = 0; i < out.size(); ++i) out[i] = Codec::decode(src, i);
    } else {
      for (size_t i = 0; i < out.size(); ++i) out[i] = Codec::decode(src, i) * scale;
    }
  }
};

// The supported (storage, mode) set, in one place.
template <class F>
decltype(auto) dispatch_kv(DType storage, KVQuantMode mode, F&& f) {
  switch (mode) {
    case KVQuantMode::None:
      if (storage == DType::F32) return f(Format<F32, ScalePolicy::None>{});
      if (storage == DType::F16) return f(Format<F16, ScalePolicy::None>{});
      if (storage == DType::BF16) return f(Format<BF16, ScalePolicy::None>{});
      break;
    case KVQuantMode::Fp8PerTensor:
      if (storage == DType::F8E4M3) return f(Format<E4M3, ScalePolicy::PerTensor>{});
      if (storage == DType::F8E5M2) return f(Format<E5M2, ScalePolicy::PerTensor>{});
      break;
    case KVQuantMode::Fp8PerTokenHead:
      if (storage == DType::F8E4M3) return f(Format<E4M3, ScalePolicy::PerTokenHead>{});
      break;
    case KVQuantMode::Int8PerTokenHead:
      if (storage == DType::I8) return f(Format<I8, ScalePolicy::PerTokenHead>{});
      break;
  }
  throw Error("unsupported KV format: storage " + std::string(dtype_name(storage)) + " with quant mode " +
              std::string(kv_quant_mode_name(mode)) +
              "; supported: float32/float16/bfloat16 with none, fp8_e4m3/fp8_e5m2 with fp8_per_tensor, fp8_e4m3 with "
              "fp8_per_token_head, int8 with int8_per_token_head");
}

}  // namespace kvlm::kvfmt

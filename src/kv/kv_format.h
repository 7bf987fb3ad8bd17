// KV page formats: how one row (one token, one kv head, head_dim values) is encoded on
// write and decoded on read, for every (storage dtype, quant mode) pair kvlm supports.
//
// dispatch_kv(storage, mode, f) calls f with the format type of that pair; the pairs are the
// table's (kv/kv_formats.h), and one outside it is a clear runtime error naming the set —
// never a pass-through (seed 003). Quantization follows the field's convention: code = convert(x / scale),
// x ~= code * scale; per-token-head scale = max(absmax / qmax, 1e-6), stored fp32.
//
// Codes are addressed by element index within a row: element i of a row of 1-, 2- or 4-byte
// codes sits at byte i * size; 4-bit codes (I4) pack 8 elements per 32-bit word, see I4.
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
#include "kv/kv_formats.h"

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
  static constexpr KVQuantMode kTokenHeadMode = KVQuantMode::Fp8PerTokenHead;
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
  static constexpr KVQuantMode kTokenHeadMode = KVQuantMode::Int8PerTokenHead;
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

// The quant mode of a codec under a scale policy (the per-token-head codecs name theirs).
template <class Codec, ScalePolicy P>
constexpr KVQuantMode quant_mode_of() {
  if constexpr (P == ScalePolicy::None)
    return KVQuantMode::None;
  else if constexpr (P == ScalePolicy::PerTensor)
    return KVQuantMode::Fp8PerTensor;
  else
    return Codec::kTokenHeadMode;
}

template <class Codec, ScalePolicy P>
struct Format {
  using codec = Codec;
  static constexpr ScalePolicy policy = P;
  static constexpr KVStorage kKV{Codec::kStorage, quant_mode_of<Codec, P>()};

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

// INT4 with a scale and a zero point per (token, kv head): the row's [min, max] is cut into 15
// steps, s = max((max - min) / 15, 2^-14) and z = min, both rounded to f16 and packed into the
// row's 32-bit scale slot (s in the low half, z in the high half: the slot is as large as the
// other per-token-head modes' fp32 scale, so a row costs head_dim / 2 + 4 bytes). Codes are
// c = clamp(rint((x - z) / s), 0, 15) with the rounded s and z, read back as c * s + z.
// Measured on real models (docs/results/accuracy.md): with the Hadamard rotation, the zero
// point lowers the KLD of int4 K/V by 17-35% against symmetric -7..7 codes, at no byte cost.
//
// Packing: 8 codes per 32-bit little-endian word; byte k (k < 4) holds element k in its low
// nibble and element k + 4 in its high nibble. That order lets a GPU expand a word into four
// pairs of consecutive elements with one mask, one shift-and-mask and four byte permutes
// (ops/cuda/kv_codec.cuh). Rows are whole words: head_dim % 8 == 0.
struct I4 {
  static constexpr DType kStorage = DType::I4;
  static constexpr float kLevels = 15.0f;
  static constexpr float kMinStep = 6.103515625e-05f;  // 2^-14, the smallest normal f16
  static constexpr float kMaxF16 = 65504.0f;
  static size_t byte_of(size_t i) { return (i / 8) * 4 + (i % 4); }
  static int shift_of(size_t i) { return (i % 8) >= 4 ? 4 : 0; }
  static int code(const uint8_t* p, size_t i) { return (p[byte_of(i)] >> shift_of(i)) & 0xf; }
  static void set_code(uint8_t* p, size_t i, int c) {
    uint8_t& b = p[byte_of(i)];
    b = uint8_t((b & ~(0xf << shift_of(i))) | (c << shift_of(i)));
  }
  // The scale slot: f16 step in the low half, f16 zero point in the high half.
  static float pack(uint16_t step, uint16_t zero) {
    const uint32_t w = uint32_t(step) | uint32_t(zero) << 16;
    float f;
    std::memcpy(&f, &w, 4);
    return f;
  }
  static void unpack(float slot, float& step, float& zero) {
    uint32_t w;
    std::memcpy(&w, &slot, 4);
    step = num::f16_to_f32(uint16_t(w & 0xffff));
    zero = num::f16_to_f32(uint16_t(w >> 16));
  }
};

template <>
struct Format<I4, ScalePolicy::PerTokenHead> {
  using codec = I4;
  static constexpr ScalePolicy policy = ScalePolicy::PerTokenHead;
  static constexpr KVStorage kKV{DType::I4, KVQuantMode::Int4PerTokenHead};
  // Returns the packed (step, zero) slot.
  // The operations and their order are the GPU encoder's (ops/cuda/kv_codec.cuh: I4Encoder):
  // fmin / fmax skip NaN (a NaN value gets code 0, an all-infinite row the smallest step), and
  // a zero point of -0 is stored as +0, so both sides write the same bytes for any input.
  static float encode_row(std::span<const float> x, uint8_t* dst, float /*tensor_scale*/) {
    float lo = INFINITY, hi = -INFINITY;
    for (float v : x) {
      lo = std::fmin(lo, v);
      hi = std::fmax(hi, v);
    }
    // (Both stay finite in f16: K/V beyond +-65504 saturate their codes instead.)
    const uint16_t s16 = num::f32_to_f16(std::fmin(std::fmax((hi - lo) / I4::kLevels, I4::kMinStep), I4::kMaxF16));
    uint16_t z16 = num::f32_to_f16(std::fmin(std::fmax(lo, -I4::kMaxF16), I4::kMaxF16));
    if (z16 == 0x8000) z16 = 0;
    const float s = num::f16_to_f32(s16), z = num::f16_to_f32(z16);
    for (size_t i = 0; i < x.size(); ++i)
      I4::set_code(dst, i, int(std::nearbyint(std::fmin(std::fmax((x[i] - z) / s, 0.0f), I4::kLevels))));
    return I4::pack(s16, z16);
  }
  static void decode_row(const uint8_t* src, float slot, std::span<float> out) {
    float s, z;
    I4::unpack(slot, s, z);
    for (size_t i = 0; i < out.size(); ++i) out[i] = float(I4::code(src, i)) * s + z;
  }
};

// The CPU codecs: every format of the table (kv/kv_formats.h), checked here at compile time.
using CpuCodecs = KVCodecList<Format<F32, ScalePolicy::None>, Format<F16, ScalePolicy::None>,
                              Format<BF16, ScalePolicy::None>, Format<E4M3, ScalePolicy::PerTensor>,
                              Format<E5M2, ScalePolicy::PerTensor>, Format<E4M3, ScalePolicy::PerTokenHead>,
                              Format<I8, ScalePolicy::PerTokenHead>, Format<I4, ScalePolicy::PerTokenHead>>;
static_assert(check_codecs(CpuCodecs{}, KVFormatSet::All), "a row of kKVFormats without a CPU codec, or a codec outside it");

// Calls f(Format{}) with the format of (storage, mode); a pair outside the table is a
// kvlm::Error naming the supported set — never a pass-through (seed 003).
template <class F>
decltype(auto) dispatch_kv(DType storage, KVQuantMode mode, F&& f) {
  return dispatch_kv_codec(CpuCodecs{}, KVStorage{storage, mode}, KVFormatSet::All, "KV pages", f);
}

}  // namespace kvlm::kvfmt

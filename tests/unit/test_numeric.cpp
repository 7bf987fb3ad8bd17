// Number formats: FP8 E4M3/E5M2 encoders checked against an independent oracle (nearest
// representable value by search, ties to the even code, saturation), every code decoded,
// bfloat16/float16 against the compiler's own conversions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/numeric.h"

using namespace kvlm::num;

namespace {

struct Fp8Spec {
  const char* name;
  uint8_t (*encode)(float);
  float (*decode)(uint8_t);
  float max;
  bool e4m3;
};

const Fp8Spec kE4M3{"e4m3", f32_to_e4m3, e4m3_to_f32, 448.0f, true};
const Fp8Spec kE5M2{"e5m2", f32_to_e5m2, e5m2_to_f32, 57344.0f, false};

// Oracle: the finite non-negative codes sorted by value; round x to the nearest, ties to
// the code with an even mantissa LSB (the even code), saturate beyond max, keep the sign.
uint8_t oracle(const Fp8Spec& s, float x) {
  if (std::isnan(x)) return 0;  // NaN handled separately
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const double a = std::fabs(double(x));
  if (a >= double(s.max)) return uint8_t(sign | s.encode(s.max));  // saturation (and inf)
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c < 0x80; ++c) {
    const float v = s.decode(uint8_t(c));
    if (!std::isfinite(v)) continue;
    const double err = std::fabs(double(v) - a);
    if (err < best_err || (err == best_err && (c & 1) == 0)) {
      best_err = err;
      best = uint8_t(c);
    }
  }
  return uint8_t(sign | best);
}

}  // namespace

TEST(Fp8, E4M3DecodesEveryCode) {
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
  EXPECT_TRUE(std::signbit(e4m3_to_f32(0x80)));
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));   // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));   // smallest normal
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xFE), -448.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xFF)));
  int nans = 0;
  float prev = -1.0f;
  for (int c = 0; c < 256; ++c) {
    const float v = e4m3_to_f32(uint8_t(c));
    if (std::isnan(v)) {
      ++nans;
      continue;
    }
    EXPECT_FALSE(std::isinf(v)) << c;  // E4M3 "fn" has no infinities
    // Every finite code round-trips exactly, including -0.
    EXPECT_EQ(f32_to_e4m3(v), uint8_t(c)) << "code " << c;
    if (c < 0x7F) {
      EXPECT_GT(v, prev) << "codes 0..0x7E must be increasing";
      prev = v;
    }
  }
  EXPECT_EQ(nans, 2);
}

TEST(Fp8, E5M2DecodesEveryCode) {
  EXPECT_EQ(e5m2_to_f32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e5m2_to_f32(0x04), std::ldexp(1.0f, -14));
  EXPECT_EQ(e5m2_to_f32(0x3C), 1.0f);
  EXPECT_EQ(e5m2_to_f32(0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(e5m2_to_f32(0x7C)));
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const float v = e5m2_to_f32(uint8_t(c));
    if (std::isnan(v)) {
      ++nans;
      continue;
    }
    if (std::isinf(v)) {
      // Saturating conversion never produces infinity: it maps to the largest finite code.
      EXPECT_EQ(f32_to_e5m2(v), uint8_t((c & 0x80) | 0x7B));
      continue;
    }
    EXPECT_EQ(f32_to_e5m2(v), uint8_t(c)) << "code " << c;
  }
  EXPECT_EQ(nans, 6);
}

TEST(Fp8, SaturatesAndHandlesSpecials) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // E4M3: 448 is the largest finite value; 464 is its midpoint with the (absent) next
  // value and rounds to even = 448; anything larger saturates to 448.
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(464.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(464.0f, inf)), 0x7E);
  EXPECT_EQ(f32_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(inf), 0x7E);
  EXPECT_EQ(f32_to_e4m3(-inf), 0xFE);
  EXPECT_EQ(f32_to_e4m3(nan), 0x7F);
  EXPECT_EQ(f32_to_e4m3(-nan), 0x7F);  // CUDA drops the NaN's sign
  // Underflow: half the smallest subnormal (2^-10) rounds to even = 0; just above, to 1.
  EXPECT_EQ(f32_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(f32_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(f32_to_e4m3(-std::ldexp(1.0f, -12)), 0x80);
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
  // Ties to even among subnormals: 1.5 * 2^-9 -> 2 * 2^-9 (code 2), 2.5 * 2^-9 -> code 2.
  EXPECT_EQ(f32_to_e4m3(1.5f * std::ldexp(1.0f, -9)), 0x02);
  EXPECT_EQ(f32_to_e4m3(2.5f * std::ldexp(1.0f, -9)), 0x02);
  // Ties to even among normals: 1 + 1/16 lies between 1 (0x38) and 1.125 (0x39).
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.1875f), 0x3A);
  // Rounding up across a binade: 15.5 (between 15 and 16) -> 16.
  EXPECT_EQ(e4m3_to_f32(f32_to_e4m3(15.5f)), 16.0f);

  // E5M2: 57344 max; 61440 is the midpoint towards infinity and saturates.
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7B);
  EXPECT_EQ(f32_to_e5m2(std::nextafter(61440.0f, 0.0f)), 0x7B);
  EXPECT_EQ(f32_to_e5m2(61440.0f), 0x7B);
  EXPECT_EQ(f32_to_e5m2(inf), 0x7B);
  EXPECT_EQ(f32_to_e5m2(-inf), 0xFB);
  // NaN: 0x7F whatever the sign and payload, as CUDA's conversion returns (sm_90 and host).
  EXPECT_EQ(f32_to_e5m2(nan), 0x7F);
  EXPECT_EQ(f32_to_e5m2(-nan), 0x7F);
  EXPECT_EQ(f32_to_e5m2(f32_from_bits(0x7f800001u)), 0x7F);
  EXPECT_EQ(f32_to_e4m3(f32_from_bits(0xffa00000u)), 0x7F);
  EXPECT_EQ(f32_to_e5m2(std::ldexp(1.0f, -17)), 0x00);
  EXPECT_EQ(f32_to_e5m2(std::nextafter(std::ldexp(1.0f, -17), 1.0f)), 0x01);
}

// Every midpoint between adjacent codes, and one float on each side of it.
TEST(Fp8, MidpointsMatchOracle) {
  for (const Fp8Spec* s : {&kE4M3, &kE5M2}) {
    std::vector<float> vals;
    for (int c = 0; c < 0x80; ++c)
      if (std::isfinite(s->decode(uint8_t(c)))) vals.push_back(s->decode(uint8_t(c)));
    for (size_t i = 0; i + 1 < vals.size(); ++i) {
      const float mid = float((double(vals[i]) + double(vals[i + 1])) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), vals[i]}) {
        ASSERT_EQ(s->encode(x), oracle(*s, x)) << s->name << " x=" << x;
        ASSERT_EQ(s->encode(-x), oracle(*s, -x)) << s->name << " x=" << -x;
      }
    }
  }
}

// A stride through all 2^32 bit patterns plus random values: encoder == oracle. (The GPU
// test compares all 2^32 inputs against the hardware conversion.)
TEST(Fp8, StrideOverAllFloatsMatchesOracle) {
  for (const Fp8Spec* s : {&kE4M3, &kE5M2}) {
    int checked = 0;
    for (uint64_t b = 0; b < (uint64_t(1) << 32); b += 65521) {  // prime stride: ~65k samples
      const float x = f32_from_bits(uint32_t(b));
      if (std::isnan(x)) continue;
      ASSERT_EQ(s->encode(x), oracle(*s, x)) << s->name << " bits=" << std::hex << b;
      ++checked;
    }
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> mag(-20.0f, 18.0f);
    for (int i = 0; i < 20000; ++i) {
      const float x = std::ldexp(1.0f + float(rng() % 1000000) / 1e6f, int(mag(rng))) * (rng() & 1 ? -1.0f : 1.0f);
      ASSERT_EQ(s->encode(x), oracle(*s, x)) << s->name << " x=" << x;
    }
    EXPECT_GT(checked, 60000);
  }
}

TEST(BFloat16, RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F808000)), 0x3F80);  // tie, even stays
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F818000)), 0x3F82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3F808001)), 0x3F81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::infinity()))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = bf16_to_f32(uint16_t(h));
    if (!std::isnan(v)) ASSERT_EQ(f32_to_bf16(v), h);
  }
}

#if defined(__FLT16_MAX__)
TEST(Float16, MatchesCompilerConversion) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    _Float16 ref;
    const uint16_t hh = uint16_t(h);
    std::memcpy(&ref, &hh, 2);
    const float v = f16_to_f32(hh);
    if (std::isnan(float(ref))) {
      ASSERT_TRUE(std::isnan(v));
      continue;
    }
    ASSERT_EQ(v, float(ref)) << std::hex << h;
    ASSERT_EQ(f32_to_f16(v), hh) << std::hex << h;
  }
  std::mt19937 rng(3);
  for (int i = 0; i < 1000000; ++i) {
    const float x = f32_from_bits(uint32_t(rng()));
    if (std::isnan(x)) continue;
    const _Float16 ref = static_cast<_Float16>(x);
    uint16_t rb;
    std::memcpy(&rb, &ref, 2);
    ASSERT_EQ(f32_to_f16(x), rb) << x;
  }
}
#endif

// What the CUDA op tests share: values representable in an activation dtype (bfloat16,
// float16), their 16-bit codes, the tolerance of one 16-bit rounding, and an element-wise
// comparison.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/numeric.h"

namespace kvlm::test::act {

// Rounds to the activation dtype and returns (rounded float, 16-bit code).
inline float act_round(DType act, float x) {
  return act == DType::BF16 ? num::bf16_to_f32(num::f32_to_bf16(x)) : num::f16_to_f32(num::f32_to_f16(x));
}
inline uint16_t act_code(DType act, float x) { return act == DType::BF16 ? num::f32_to_bf16(x) : num::f32_to_f16(x); }
inline float act_value(DType act, uint16_t c) { return act == DType::BF16 ? num::bf16_to_f32(c) : num::f16_to_f32(c); }
inline double act_rel_tol(DType act) { return act == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -10); }

inline std::vector<float> random_act(DType act, size_t n, std::mt19937& rng, float stddev = 1.0f) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = act_round(act, nd(rng));
  return v;
}
inline std::vector<uint16_t> codes(DType act, const std::vector<float>& v) {
  std::vector<uint16_t> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = act_code(act, v[i]);
  return c;
}

// max |got - ref| over elements, and how many exceed rel * |ref| + abs.
struct Cmp {
  double max_err = 0;
  size_t bad = 0;
};
inline Cmp compare(const std::vector<float>& got, const std::vector<float>& ref, double rel, double abs) {
  Cmp c;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double e = std::isnan(got[i]) ? 1e30 : std::fabs(double(got[i]) - double(ref[i]));
    c.max_err = std::max(c.max_err, e);
    c.bad += e > rel * std::fabs(double(ref[i])) + abs;
  }
  return c;
}

inline constexpr DType kActs[] = {DType::BF16, DType::F16};

}  // namespace kvlm::test::act

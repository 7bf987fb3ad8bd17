#include "model/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/error.h"

namespace kvlm {

std::vector<float> rope_inv_freq(const RopeConfig& r, int head_dim) {
  if (r.rotary_dim > 0) head_dim = r.rotary_dim;  // partial rotary: the frequencies of the rotated dimensions
  std::vector<float> inv(size_t(head_dim / 2));
  for (size_t i = 0; i < inv.size(); ++i) {
    const float exponent = float(2 * i) / float(head_dim);  // fp32, as transformers does
    inv[i] = float(1.0 / std::pow(r.theta, double(exponent)));
  }
  switch (r.type) {
    case RopeType::Default: break;
    case RopeType::Linear:
      for (float& f : inv) f = float(f / r.factor);
      break;
    case RopeType::Llama3: {
      // Long wavelengths are divided by `factor`, short ones kept, the band between
      // interpolated smoothly (Llama 3.1's scheme).
      const double old_len = r.original_max_position;
      const double low_wavelen = old_len / r.low_freq_factor;
      const double high_wavelen = old_len / r.high_freq_factor;
      for (float& f : inv) {
        const double wavelen = 2.0 * std::numbers::pi / double(f);
        if (wavelen < high_wavelen) continue;
        if (wavelen > low_wavelen) {
          f = float(f / r.factor);
          continue;
        }
        const double smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        f = float((1.0 - smooth) * f / r.factor + smooth * f);
      }
      break;
    }
    case RopeType::Yarn: {
      // YaRN (transformers' _compute_yarn_parameters): dimensions that turn fewer than
      // beta_slow times over the original length are interpolated (divided by factor), those
      // that turn more than beta_fast times kept, with a linear ramp between; in fp32 as there.
      // The attention_factor on cos/sin is not here: rope_score_scale folds it into the scores.
      const int dim = head_dim;
      auto correction_dim = [&](double rotations) {
        return double(dim) * std::log(double(r.original_max_position) / (rotations * 2.0 * std::numbers::pi)) /
               (2.0 * std::log(r.theta));
      };
      double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
      if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, double(dim - 1));
      if (low == high) high += 0.001;  // no zero-width ramp
      for (size_t i = 0; i < inv.size(); ++i) {
        const float exponent = float(2 * i) / float(dim);
        const float pos = float(std::pow(r.theta, double(exponent)));
        const float extrapolated = 1.0f / pos, interpolated = 1.0f / (float(r.factor) * pos);
        const float ramp = std::clamp((float(i) - float(low)) / float(high - low), 0.0f, 1.0f);
        const float keep = 1.0f - ramp;  // share of the extrapolated (unscaled) frequency
        inv[i] = interpolated * (1.0f - keep) + extrapolated * keep;
      }
      break;
    }
  }
  if (!r.freq_factors.empty()) {
    KVLM_CHECK(r.freq_factors.size() == inv.size(), "rope_freq_factors has the wrong length");
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = float(double(inv[i]) / r.freq_factors[i]);
  }
  return inv;
}

}  // namespace kvlm

namespace kvlm {

float rope_score_scale(const RopeConfig& r) {
  return r.type == RopeType::Yarn ? float(r.attention_factor * r.attention_factor) : 1.0f;
}

}  // namespace kvlm

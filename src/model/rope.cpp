#include "model/rope.h"

#include <cmath>
#include <numbers>

#include "core/error.h"

namespace kvlm {

std::vector<float> rope_inv_freq(const RopeConfig& r, int head_dim) {
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
  }
  if (!r.freq_factors.empty()) {
    KVLM_CHECK(r.freq_factors.size() == inv.size(), "rope_freq_factors has the wrong length");
    for (size_t i = 0; i < inv.size(); ++i) inv[i] = float(double(inv[i]) / r.freq_factors[i]);
  }
  return inv;
}

}  // namespace kvlm

#include "engine/metrics.h"

#include <algorithm>

namespace kvlm {

void Histogram::observe(double v) {
  const size_t i = size_t(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin());
  ++counts[i];
  sum += v;
  ++count;
}

}  // namespace kvlm

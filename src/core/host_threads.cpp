#include "core/host_threads.h"

#include <algorithm>
#include <atomic>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvlm::host_threads {

namespace {
std::atomic<int> reserved{0};
}

int team() {
#if defined(_OPENMP)
  const int max = omp_get_max_threads();
#else
  const int max = 1;
#endif
  return std::clamp(max - reserved.load(std::memory_order_relaxed), 1, kMaxTeam);
}

Reservation::Reservation(int cores) : cores_(std::max(0, cores)) { reserved += cores_; }
Reservation::~Reservation() { reserved -= cores_; }

}  // namespace kvlm::host_threads

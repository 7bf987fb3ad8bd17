// Launch decisions that depend on the GPU (SM count, occupancy, shared-memory opt-ins, which
// CUDA records per device, PDL and wgmma availability) are computed once per device, not once
// per process: a process that drives several GPUs asks each. "The device" is always the
// current one, which the CUDA model runner sets to its own device index on every entry.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <string>

#include "core/error.h"

namespace kvlm::cuda {

inline constexpr int kMaxDevices = 64;

inline int current_device() {
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess) {
    cudaGetLastError();
    d = 0;
  }
  return d;
}

// A value computed on first use on each device (compute() runs with that device current; if
// it throws, the next use tries again).
template <class T>
class PerDevice {
 public:
  template <class F>
  const T& get(F&& compute) {
    const int d = current_device();
    if (d < 0 || d >= kMaxDevices)
      throw Error("CUDA device " + std::to_string(d) + " is beyond the " + std::to_string(kMaxDevices) +
                  " devices kvlm handles");
    std::call_once(once_[size_t(d)], [&] { values_[size_t(d)] = compute(); });
    return values_[size_t(d)];
  }

 private:
  std::array<std::once_flag, kMaxDevices> once_;
  std::array<T, kMaxDevices> values_{};
};

// The current device's compute capability as major * 10 + minor (0 if CUDA cannot say).
inline int compute_capability() {
  static PerDevice<int> cc;
  return cc.get([] {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, current_device()) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, current_device()) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return 10 * major + minor;
  });
}

// The current device's streaming multiprocessors (132 if CUDA cannot say).
inline int sm_count() {
  static PerDevice<int> n;
  return n.get([] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, current_device()) != cudaSuccess) {
      cudaGetLastError();
      return 132;
    }
    return v;
  });
}

}  // namespace kvlm::cuda

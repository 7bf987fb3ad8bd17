// Small helpers shared by the GPU tests: device detection, RAII device buffers, data paths.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

namespace kvlm::test {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

// The current GPU's compute capability as major * 10 + minor (0 without one).
inline int compute_capability() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return major * 10 + minor;
}

// KVLM_CUDA_TEST_REDUCED=1 (under compute-sanitizer): fewer cases.
inline bool reduced() {
  const char* e = std::getenv("KVLM_CUDA_TEST_REDUCED");
  return e && *e && *e != '0';
}

// The repository root: KVLM_REPO in the environment (the GPU machine runs binaries built
// elsewhere), else the source directory this test was built from.
inline std::filesystem::path repo_root() {
  if (const char* e = std::getenv("KVLM_REPO"); e && *e) return e;
  return KVLM_SOURCE_DIR;
}

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (count) EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
  }
  explicit Dev(const std::vector<T>& h) : Dev(h.size()) { upload(h); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void upload(const std::vector<T>& h) {
    if (n) EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  void poison() {
    if (n) EXPECT_EQ(cudaMemset(p, 0xff, n * sizeof(T)), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    if (n) EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

}  // namespace kvlm::test

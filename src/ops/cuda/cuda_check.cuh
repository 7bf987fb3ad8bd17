// Error checking for CUDA runtime and cuBLASLt calls: every failure becomes a kvlm::Error
// with the CUDA error string and the call site. For .cu and .cpp files that already include
// the CUDA runtime (.cuh: like kv_codec.cuh, never included from a .h header).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"

namespace kvlm::cuda {

[[noreturn]] inline void throw_cuda_error(const std::string& what, const char* msg, const char* file, int line) {
  std::string f = file;
  if (auto p = f.rfind("src/"); p != std::string::npos) f = f.substr(p);
  throw Error("CUDA error in " + what + " (" + f + ":" + std::to_string(line) + "): " + msg);
}

inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(what, cudaGetErrorString(err), file, line);
}

inline void check_cublas(cublasStatus_t st, const char* what, const char* file, int line) {
  if (st != CUBLAS_STATUS_SUCCESS) throw_cuda_error(what, cublasLtGetStatusString(st), file, line);
}

}  // namespace kvlm::cuda

// KVLM_CUDA_CHECK(cudaMemcpyAsync(...)): throws kvlm::Error naming the call and file:line
// (variadic: a call may hold template arguments with commas).
#define KVLM_CUDA_CHECK(...) ::kvlm::cuda::check_cuda((__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__)
#define KVLM_CUBLAS_CHECK(call) ::kvlm::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, faults at the next sync.
#define KVLM_CUDA_CHECK_LAUNCH(name) ::kvlm::cuda::check_cuda(cudaGetLastError(), name " launch", __FILE__, __LINE__)

// What the kernel labs (moe_lab, gdn_lab, decode_bench) share: a CUDA call checked (the lab
// stopped, or an Error thrown), and the median time of a captured graph.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"

namespace kvlm::lab {

// A CUDA call checked, its failure thrown as an Error (decode_bench reports it and exits 1).
inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

#define CHECK(x)                                                                                     \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                 \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Median ms of `enqueue` captured as one CUDA graph, as the runner's decode steps run (no launch
// gaps): `runs` timed launches after 3 warm-ups, each after `flush` is written (the call's
// weights out of L2, as in a real step).
template <class F>
double graph_ms(F&& enqueue, void* flush, size_t flush_bytes, int runs) {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  enqueue(st);
  CHECK(cudaStreamEndCapture(st, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < runs + 3; ++i) {
    CHECK(cudaMemsetAsync(flush, i, flush_bytes, st));
    CHECK(cudaEventRecord(a, st));
    CHECK(cudaGraphLaunch(exec, st));
    CHECK(cudaEventRecord(b, st));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (i >= 3) ms.push_back(t);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(st));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace kvlm::lab

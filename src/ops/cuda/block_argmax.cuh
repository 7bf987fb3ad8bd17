// Argmax across a thread block, shared by the greedy kernel (model_ops.cu) and the sampling
// kernel (sampling.cu). Ties go to the lowest index, as the host's argmax.
#pragma once

namespace kvlm::cuda {

// (v2, i2) beats (v1, i1): larger value, or the same value at a lower index.
__device__ __forceinline__ bool argmax_better(float v2, int i2, float v1, int i1) {
  return v2 > v1 || (v2 == v1 && i2 < i1);
}

// Each thread brings its best (value, index); every thread gets the block's index. All
// kThreads threads must call it; it synchronizes the block.
template <int kThreads>
__device__ int block_argmax(float best, int idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, best, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, idx, o);
    if (argmax_better(v2, i2, best, idx)) {
      best = v2;
      idx = i2;
    }
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  if (threadIdx.x % 32 == 0) {
    sv[threadIdx.x / 32] = best;
    si[threadIdx.x / 32] = idx;
  }
  __syncthreads();
  best = sv[0];
  idx = si[0];
  for (int w = 1; w < kThreads / 32; ++w)
    if (argmax_better(sv[w], si[w], best, idx)) {
      best = sv[w];
      idx = si[w];
    }
  __syncthreads();
  return idx;
}

}  // namespace kvlm::cuda

// Device helpers the row and element-wise kernels share: warp-wide reductions, and the grid of a
// grid-stride loop.
#pragma once

#include <algorithm>
#include <cstddef>

namespace kvlm::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Blocks of `threads` for a grid-stride loop over n elements, capped (the loop covers the rest).
inline unsigned grid_for(size_t n, int threads) {
  return unsigned(std::min<size_t>((n + size_t(threads) - 1) / size_t(threads), 65535u * 8u));
}

}  // namespace kvlm::cuda

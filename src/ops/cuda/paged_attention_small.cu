// Paged attention for head sizes 8, 16 and 32 (small models such as the golden checkpoints
// and stories260K): the CUDA-core kernel of paged_attention_rows.cuh, instantiated in its
// own translation unit so it compiles in parallel with paged_attention.cu.
#include "ops/cuda/paged_attention_rows.cuh"

namespace kvlm::cuda {

void launch_rows_small_heads(const RowsArgs& a, cudaStream_t st) {
  dispatch_cuda_kv_pair(k_format_of(a.p), v_format_of(a.p), "CUDA paged attention", [&](auto fmt) {
    using Fmt = decltype(fmt);
    switch (a.p.head_dim) {
      case 8: launch_rows<Fmt, 8>(a, st); break;
      case 16: launch_rows<Fmt, 16>(a, st); break;
      case 32: launch_rows<Fmt, 32>(a, st); break;
      default:
        throw Error("CUDA paged attention: internal error: head size " + std::to_string(a.p.head_dim) +
                    " routed to the small-head kernels");
    }
  });
}

}  // namespace kvlm::cuda

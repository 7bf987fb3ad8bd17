// Primitives of a warp-specialised pipeline (producer warps fill shared-memory stages,
// consumer warps compute on them), as the tiled prefill kernel's Hopper variant uses them:
// mbarriers (sm_80+; the parity wait loop is sm_90's try_wait), named barriers, and
// setmaxnreg (sm_90a) to move registers from the producer to the consumer warpgroups.
// PTX ISA: "Parallel Synchronization and Communication Instructions: mbarrier", "bar",
// "setmaxnreg".
//
// An mbarrier completes a phase when its pending count (set at init) has arrived; waiters
// name the phase by its parity (0, 1, 0, ...). Stage s of a ring of S stages, used for the
// n-th time (n = j / S for tile j), is in phase n: its "full" barrier is waited with parity
// n & 1, and the producer waits for the consumers' "empty" barrier of the previous use
// (parity (n - 1) & 1) before overwriting it.
#pragma once

#include <cstdint>

namespace kvlm::cuda::pipe {

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// One arrival (release: this thread's earlier shared-memory writes are visible to a thread
// whose wait observes the phase completing).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(bar)) : "memory");
}
// One arrival once every cp.async this thread issued before has landed (noinc: the arrival
// counts against the pending count set at init).
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Registers per thread of the executing warpgroup (every warp of it executes this).
template <int R>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

}  // namespace kvlm::cuda::pipe

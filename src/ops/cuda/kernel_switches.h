// Switches for kernel variants that exist for measurement and as escape hatches, set by the
// caller (the lab and benchmarks' flags, tests) instead of read from the environment deep in
// the kernels. Process-wide; set them before the kernels run (they are read at launch time).
#pragma once

namespace kvlm::cuda {

struct KernelSwitches {
  // Programmatic dependent launch where the GPU and the loaded code allow it (pdl.cuh); off:
  // every kernel waits for its predecessor to finish.
  bool pdl = true;
  // The warp-specialised wgmma prefill kernel where sm_90a code runs; off: the mma.sync
  // tiled kernel (what sm_80 / sm_89 and head 256 run).
  bool wgmma = true;
};

void set_kernel_switches(const KernelSwitches& s);
KernelSwitches kernel_switches();

}  // namespace kvlm::cuda

#include "ops/cuda/kernel_switches.h"

#include <atomic>

namespace kvlm::cuda {

namespace {
std::atomic<bool> g_pdl{true}, g_wgmma{true}, g_fp8_tc_carveout{true}, g_fp8_gemm{true};
std::atomic<KernelSwitches::Fp8Weights> g_fp8{KernelSwitches::Fp8Weights::Auto};
std::atomic<int> g_fp8_tc_tiles{0}, g_fp8_tc_splits{0}, g_fp8_fma_max_m{1};
}  // namespace

void set_kernel_switches(const KernelSwitches& s) {
  g_pdl.store(s.pdl);
  g_wgmma.store(s.wgmma);
  g_fp8.store(s.fp8_weights);
  g_fp8_tc_tiles.store(s.fp8_tc_tiles);
  g_fp8_tc_splits.store(s.fp8_tc_splits);
  g_fp8_tc_carveout.store(s.fp8_tc_carveout);
  g_fp8_fma_max_m.store(s.fp8_fma_max_m);
  g_fp8_gemm.store(s.fp8_gemm);
}

KernelSwitches kernel_switches() {
  return {.pdl = g_pdl.load(),
          .wgmma = g_wgmma.load(),
          .fp8_weights = g_fp8.load(),
          .fp8_tc_tiles = g_fp8_tc_tiles.load(),
          .fp8_tc_splits = g_fp8_tc_splits.load(),
          .fp8_tc_carveout = g_fp8_tc_carveout.load(),
          .fp8_fma_max_m = g_fp8_fma_max_m.load(),
          .fp8_gemm = g_fp8_gemm.load()};
}

}  // namespace kvlm::cuda

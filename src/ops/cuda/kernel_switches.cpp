#include "ops/cuda/kernel_switches.h"

#include <atomic>

namespace kvlm::cuda {

namespace {
std::atomic<bool> g_pdl{true}, g_wgmma{true};
std::atomic<KernelSwitches::Fp8Weights> g_fp8{KernelSwitches::Fp8Weights::Auto};
}  // namespace

void set_kernel_switches(const KernelSwitches& s) {
  g_pdl.store(s.pdl);
  g_wgmma.store(s.wgmma);
  g_fp8.store(s.fp8_weights);
}

KernelSwitches kernel_switches() { return {.pdl = g_pdl.load(), .wgmma = g_wgmma.load(), .fp8_weights = g_fp8.load()}; }

}  // namespace kvlm::cuda

#include "ops/cuda/kernel_switches.h"

#include <atomic>

namespace kvlm::cuda {

namespace {
std::atomic<bool> g_pdl{true}, g_wgmma{true};
}  // namespace

void set_kernel_switches(const KernelSwitches& s) {
  g_pdl.store(s.pdl);
  g_wgmma.store(s.wgmma);
}

KernelSwitches kernel_switches() { return {.pdl = g_pdl.load(), .wgmma = g_wgmma.load()}; }

}  // namespace kvlm::cuda

#include "ops/cuda/kernel_switches.h"

#include <mutex>

namespace kvlm::cuda {

namespace {
// One copy of the whole struct (a field per atomic once let a new switch go unstored).
std::mutex g_mu;
KernelSwitches g_switches;
}  // namespace

void set_kernel_switches(const KernelSwitches& s) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_switches = s;
}

KernelSwitches kernel_switches() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_switches;
}

}  // namespace kvlm::cuda

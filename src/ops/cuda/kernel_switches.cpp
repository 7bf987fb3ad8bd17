#include "ops/cuda/kernel_switches.h"

#include <atomic>
#include <deque>
#include <mutex>

namespace kvlm::cuda {

namespace {
// Every value ever set, kept (sets are rare: flags, tests, the lab), and a pointer to the
// current one: a read is one atomic load and a copy of the whole struct, on every launch path,
// without a lock; a set publishes a complete struct, so no switch can be left out of the store
// (one atomic per field once let a new switch go unstored).
struct Store {
  std::mutex mu;  // serialises sets
  std::deque<KernelSwitches> all{KernelSwitches{}};
  std::atomic<const KernelSwitches*> now{&all.front()};
};
Store& store() {
  static Store s;
  return s;
}
}  // namespace

void set_kernel_switches(const KernelSwitches& s) {
  Store& st = store();
  std::lock_guard<std::mutex> lock(st.mu);
  st.all.push_back(s);  // a deque's push_back leaves earlier elements where they are
  st.now.store(&st.all.back(), std::memory_order_release);
}

KernelSwitches kernel_switches() { return *store().now.load(std::memory_order_acquire); }

}  // namespace kvlm::cuda

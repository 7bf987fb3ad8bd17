#include "model/communicator.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

class HostGroup::Rank final : public Communicator {
 public:
  Rank(HostGroup& g, int r) : g_(g), r_(r) {}
  int rank() const override { return r_; }
  int world_size() const override { return g_.world_; }
  void all_reduce_sum(void* data, DType type, size_t count, void*) override {
    KVLM_CHECK(type == DType::F32, "the host communicator reduces fp32 only");
    const int n = g_.world_;
    g_.posted_[size_t(r_)] = static_cast<float*>(data);
    g_.barrier();  // every buffer posted
    const size_t b = count * size_t(r_) / size_t(n), e = count * size_t(r_ + 1) / size_t(n);
    sum_.assign(e - b, 0.0f);
    for (int k = 0; k < n; ++k) {
      const float* src = g_.posted_[size_t(k)];
      for (size_t i = b; i < e; ++i) sum_[i - b] += src[i];
    }
    g_.barrier();  // every slice summed (nobody overwrites an input another rank still reads)
    for (int k = 0; k < n; ++k) std::copy(sum_.begin(), sum_.end(), g_.posted_[size_t(k)] + b);
    g_.barrier();  // every slice written back
  }
  void abort() override { g_.abort(); }

 private:
  HostGroup& g_;
  int r_;
  std::vector<float> sum_;
};

HostGroup::HostGroup(int world) : world_(world), posted_(size_t(world), nullptr) {
  KVLM_CHECK(world >= 1, "a host group needs a rank");
  for (int r = 0; r < world; ++r) ranks_.push_back(std::make_unique<Rank>(*this, r));
}

HostGroup::~HostGroup() = default;

Communicator& HostGroup::rank(int r) {
  KVLM_CHECK(r >= 0 && r < world_, "rank outside the host group");
  return *ranks_[size_t(r)];
}

void HostGroup::barrier() {
  std::unique_lock lock(mu_);
  if (aborted_) throw Error("tensor-parallel group aborted: another rank failed");
  const uint64_t gen = generation_;
  if (++arrived_ == world_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  cv_.wait(lock, [&] { return generation_ != gen || aborted_; });
  if (generation_ == gen) throw Error("tensor-parallel group aborted: another rank failed");
}

void HostGroup::abort() {
  std::lock_guard lock(mu_);
  aborted_ = true;
  cv_.notify_all();
}

}  // namespace kvlm

// NCCL communicators for tensor parallelism on GPUs (model/communicator.h): all-reduces of
// the ops' activations on each rank's stream, so they order with the kernels and are
// captured into CUDA graphs like them. No NCCL or CUDA header here.
#pragma once

#include <memory>
#include <vector>

#include "model/communicator.h"

namespace kvlm {

// Whether this kvlm was built with NCCL (KVLM_WITH_NCCL).
bool built_with_nccl();

class NcclGroup final : public CommGroup {
 public:
  // One process drives every rank: rank r on CUDA device devices[r]. Throws kvlm::Error.
  explicit NcclGroup(const std::vector<int>& devices);
  ~NcclGroup() override;
  int world() const override;
  Communicator& local(int i) override;
  int num_local() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm

// NCCL communicators for tensor parallelism on GPUs (model/communicator.h): all-reduces of
// the ops' activations on each rank's stream, so they order with the kernels and are
// captured into CUDA graphs like them. No NCCL or CUDA header here.
#pragma once

#include <cstdint>
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
  // Several processes (model/distributed.h): this process's ranks first_rank, first_rank + 1,
  // ... of `world`, on `devices`, joined by NCCL's unique id (unique_id() on node 0, handed to
  // the others), which NCCL uses to connect the GPUs itself.
  NcclGroup(const std::vector<int>& devices, int world, int first_rank, const std::vector<uint8_t>& id);
  static std::vector<uint8_t> unique_id();
  ~NcclGroup() override;
  int world() const override;
  Communicator& local(int i) override;
  int num_local() const override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm

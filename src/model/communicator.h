// The seam for running one model across several processes or GPUs (tensor parallelism):
// the ops call all_reduce_sum after every projection whose input dimension is split across
// ranks (model/ops.h), and the model definitions say how each weight would be split
// (model/weights.h: Shard). Today every runner holds the single-process communicator; an
// NCCL one plugs in here without touching the model definitions.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace kvlm {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Sums `count` elements of `type` at `data` over every rank, in place. `stream` is the
  // device stream the data is ordered on (a cudaStream_t; null for host memory).
  virtual void all_reduce_sum(void* data, DType type, size_t count, void* stream) = 0;
};

// One rank: the sum over ranks is the data itself.
class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void all_reduce_sum(void*, DType, size_t, void*) override {}
};

}  // namespace kvlm

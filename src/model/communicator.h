// The seam for running one model across several processes or GPUs (tensor parallelism,
// model/tensor_parallel.h): the ops call all_reduce_sum after every projection whose input
// dimension is split across ranks (model/ops.h), and the model definitions say how each
// weight is split (model/weights.h: Shard). A runner of one rank holds one rank's
// communicator: the single-process one (one rank), HostGroup's (ranks that are threads of one
// process, on the host: the CPU runner's tensor parallelism, for tests), or NCCL's
// (model/cuda/nccl_communicator.h: GPUs).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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
  // Makes every collective of this rank that is waiting, or called later, fail with an
  // error instead of waiting for a peer that will not come (a rank failed). The group is
  // unusable afterwards.
  virtual void abort() {}
};

// One rank: the sum over ranks is the data itself.
class SingleProcessCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  void all_reduce_sum(void*, DType, size_t, void*) override {}
};

// The communicators of the ranks this process drives (one per rank), owned together.
class CommGroup {
 public:
  virtual ~CommGroup() = default;
  virtual int world() const = 0;
  // This process's `i`-th rank's communicator.
  virtual Communicator& local(int i) = 0;
  virtual int num_local() const = 0;
};

// `world` ranks that are threads of one process, reducing fp32 host memory: every rank posts
// its buffer, sums a 1/world slice over all of them in rank order, and writes the slice back
// to every buffer, so that every rank ends with the same bits.
class HostGroup final : public CommGroup {
 public:
  explicit HostGroup(int world);
  ~HostGroup() override;
  Communicator& rank(int r);
  int world() const override { return world_; }
  Communicator& local(int i) override { return rank(i); }
  int num_local() const override { return world_; }

 private:
  class Rank;
  friend class Rank;
  // Waits until every rank has arrived; throws kvlm::Error once the group is aborted.
  void barrier();
  void abort();
  int world_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::vector<float*> posted_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace kvlm

// Tensor parallelism in one process: one model run as `world` ranks (model/tensor_parallel.h),
// each rank's runner (CPU or CUDA, holding its slice of the weights and of the KV pool, and
// its rank's communicator) driven by a thread of its own, rank 0 on the caller's thread.
//
// Every call runs on every rank at once and returns when all are done: the same batch, so the
// ranks issue the same collectives in the same order. Rank 0 forms the logits and samples
// (its forward / forward_sampled); the others run forward_follower. The KV pool has the same
// pages on every rank (one block id addresses a position on all of them), so the engine
// schedules once, as for one device.
//
// A rank that throws aborts the group's communicators (a peer waiting in a collective for it
// fails instead of hanging), and the runner refuses every later call with the first error:
// the ranks' pools may differ from then on.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/host_threads.h"
#include "model/communicator.h"
#include "model/distributed.h"
#include "model/model_runner.h"

namespace kvlm {

class TensorParallelRunner final : public ModelRunner {
 public:
  using Make = std::function<std::unique_ptr<ModelRunner>(int rank)>;
  // Builds rank r's runner with make(r) on rank r's thread — all ranks at once when
  // `parallel_load`, else one after another — with `comms[r]` its communicator (which the
  // runner aborts when a rank fails; they must outlive it). Throws the first rank's error.
  // `first_rank`: the global rank of this process's first rank (model/distributed.h: another
  // node's ranks are all followers, and its runner takes forward_follower only).
  TensorParallelRunner(std::vector<Communicator*> comms, const Make& make, bool parallel_load = true,
                       int first_rank = 0);
  ~TensorParallelRunner() override;

  int world_size() const { return int(ranks_.size()); }
  ModelRunner& rank(int r) { return *ranks_[size_t(r)]; }
  const ModelRunner& rank(int r) const { return *ranks_[size_t(r)]; }
  Communicator& comm(int r) { return *comms_[size_t(r)]; }
  // Runs f(r, rank r's runner) on every rank's thread at once and waits (benchmarks: settings
  // per rank, collectives timed alone).
  void each_rank(const std::function<void(int, ModelRunner&)>& f);
  // Node 0 of several processes: every call is first sent to the other nodes (which must
  // outlive the runner's use).
  void set_remote(DistCommands* remote) { remote_ = remote; }

  const ModelConfig& config() const override { return ranks_[0]->config(); }
  Device device() const override { return ranks_[0]->device(); }
  size_t num_parameters() const override;  // over all ranks (replicated weights counted once per rank)
  size_t weight_bytes() const override;    // over all ranks

  void allocate_kv(int num_blocks, int block_size, int num_exact_pages = 0) override;
  int kv_num_blocks() const override { return ranks_[0]->kv_num_blocks(); }
  size_t kv_bytes() const override;  // over all ranks
  void forward(const ForwardBatch& batch, std::span<float> logits) override;
  void set_pooling(bool on) override {  // rank 0 forms the output
    ModelRunner::set_pooling(on);
    ranks_[0]->set_pooling(on);
  }
  bool samples_on_device() const override { return ranks_[0]->samples_on_device(); }
  void forward_sampled(const ForwardBatch& batch, std::span<const RowSampling> rows, std::span<TokenId> tokens,
                       std::span<float> host_logits, const RowMaskFn& mask) override;
  void copy_blocks(std::span<const PageCopy> copies) override;
  // The prefix cache's tiers (engine/host_kv_tier.h): a page in host memory is every rank's part
  // of it, rank after rank, each copied by its rank at once. One process only (several nodes:
  // kv_page_bytes is 0, and --kv-offload-gib is refused).
  size_t kv_page_bytes(int block_size, PageKind kind = PageKind::Pages) const override;
  HostBytes allocate_host(size_t bytes) override { return ranks_[0]->allocate_host(bytes); }
  void save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out,
                  PageKind kind = PageKind::Pages) override;
  void load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in,
                  PageKind kind = PageKind::Pages) override;
  void wait_pages() override;
  std::function<void()> page_fence() override;
  PageCopyTimes page_copy_times() override;  // the slowest rank's (they copy at once)
  double measure_host_to_device_bandwidth() override;  // the ranks' together
  // Hybrid models: every rank holds its key heads' states in the same slots.
  void allocate_states(int slots) override;
  void copy_states(std::span<const StateCopy> copies) override;
  // Another node's ranks: every local rank follows.
  void forward_follower(const ForwardBatch& batch) override;
  std::string broken() const override;

 private:
  // Runs first(rank 0's runner) on this thread and rest(rank r's runner) on every other
  // rank's thread, and waits for all of them.
  void run(const std::function<void(ModelRunner&)>& first, const std::function<void(ModelRunner&)>& rest);
  void worker(int r);
  // Sends a call to the other nodes (node 0 of several); a failure fails the group.
  void remote(const std::function<void()>& send);
  void fail(std::exception_ptr e);
  size_t page_offset(const ModelRunner& m, PageKind kind) const;  // page_offsets_ of rank m
  void check_page_copies(PageKind kind) const;  // the ranks can copy pages of that kind out
  const std::vector<size_t>& offsets(PageKind kind) const {
    return kind == PageKind::Pages ? page_offsets_ : exact_offsets_;
  }

  std::vector<Communicator*> comms_;
  std::vector<std::unique_ptr<ModelRunner>> ranks_;
  bool leader_ = true;             // local rank 0 is global rank 0
  DistCommands* remote_ = nullptr;  // the other nodes, when this is node 0 of several
  // Where each rank's part of a page (of an exact page) starts in the tiers' copy of it, and
  // the page's end (allocate_kv; all 0 when the ranks cannot copy pages out).
  std::vector<size_t> page_offsets_, exact_offsets_;
  std::vector<std::thread> threads_;  // ranks 1..world-1
  // Cores the ranks' threads keep busy during a step (a follower spins in its stream wait, the
  // communicator runs its own threads): host-side loops leave them alone (core/host_threads.h).
  host_threads::Reservation busy_cores_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  const std::function<void(ModelRunner&)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;  // the first rank failure; every later call rethrows it
};

}  // namespace kvlm

#include "model/cuda/nccl_communicator.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"
#include "core/log.h"

#ifdef KVLM_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace kvlm {

#ifdef KVLM_WITH_NCCL

bool built_with_nccl() { return true; }

namespace {

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess && r != ncclInProgress)
    throw Error(std::string("NCCL ") + what + " failed: " + ncclGetErrorString(r) +
                (r == ncclSystemError || r == ncclRemoteError ? " (a peer or the interconnect failed; NCCL_DEBUG=WARN says more)" : ""));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F16: return ncclFloat16;
    case DType::BF16: return ncclBfloat16;
    default: throw Error("NCCL all-reduce of " + std::string(dtype_name(t)) + " values");
  }
}

// NVLink multicast (NVLS) stays off unless the user sets it: on shared GPU hosts it can take
// the GPUs out of service, and the all-reduces here are small.
void nvls_off() {
  if (!std::getenv("NCCL_NVLS_ENABLE")) setenv("NCCL_NVLS_ENABLE", "0", 0);
}

class NcclRank final : public Communicator {
 public:
  NcclRank(ncclComm_t comm, int rank, int world, int device) : comm_(comm), rank_(rank), world_(world), device_(device) {}
  ~NcclRank() override {
    if (comm_ && !aborted_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void all_reduce_sum(void* data, DType type, size_t count, void* stream) override {
    if (aborted_) throw Error("tensor-parallel group aborted: another rank failed");
    nccl_check(ncclAllReduce(data, data, count, nccl_type(type), ncclSum, comm_, static_cast<cudaStream_t>(stream)),
               "all-reduce");
  }
  void abort() override {
    if (aborted_.exchange(true)) return;
    int prev = 0;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
    ncclCommAbort(comm_);  // kernels waiting for a peer return; the communicator is gone
    cudaSetDevice(prev);
  }

 private:
  ncclComm_t comm_;
  int rank_, world_, device_;
  std::atomic<bool> aborted_{false};
};

}  // namespace

struct NcclGroup::Impl {
  std::vector<std::unique_ptr<NcclRank>> ranks;
  int world = 0;
};

NcclGroup::NcclGroup(const std::vector<int>& devices) : impl_(std::make_unique<Impl>()) {
  nvls_off();
  const int n = int(devices.size());
  std::vector<ncclComm_t> comms(size_t(n), nullptr);
  nccl_check(ncclCommInitAll(comms.data(), n, devices.data()), "initialisation (ncclCommInitAll)");
  impl_->world = n;
  for (int r = 0; r < n; ++r) impl_->ranks.push_back(std::make_unique<NcclRank>(comms[size_t(r)], r, n, devices[size_t(r)]));
  int version = 0;
  ncclGetVersion(&version);
  log::info("NCCL " + std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
            std::to_string(version % 100) + ": " + std::to_string(n) + " ranks in this process");
}

NcclGroup::NcclGroup(const std::vector<int>& devices, int world, int first_rank, const std::vector<uint8_t>& id)
    : impl_(std::make_unique<Impl>()) {
  nvls_off();
  ncclUniqueId uid;
  if (id.size() != sizeof uid) throw Error("the NCCL unique id from node 0 has the wrong size (another NCCL version?)");
  std::memcpy(&uid, id.data(), sizeof uid);
  const int n = int(devices.size());
  std::vector<ncclComm_t> comms(size_t(n), nullptr);
  int prev = 0;
  cudaGetDevice(&prev);
  nccl_check(ncclGroupStart(), "group start");
  for (int i = 0; i < n; ++i) {
    cudaSetDevice(devices[size_t(i)]);
    nccl_check(ncclCommInitRank(&comms[size_t(i)], world, uid, first_rank + i), "initialisation (ncclCommInitRank)");
  }
  nccl_check(ncclGroupEnd(), "initialisation (ncclCommInitRank)");
  cudaSetDevice(prev);
  impl_->world = world;
  for (int i = 0; i < n; ++i)
    impl_->ranks.push_back(std::make_unique<NcclRank>(comms[size_t(i)], first_rank + i, world, devices[size_t(i)]));
}

std::vector<uint8_t> NcclGroup::unique_id() {
  nvls_off();
  ncclUniqueId uid;
  nccl_check(ncclGetUniqueId(&uid), "ncclGetUniqueId");
  const auto* p = reinterpret_cast<const uint8_t*>(&uid);
  return std::vector<uint8_t>(p, p + sizeof uid);
}

#else

bool built_with_nccl() { return false; }

struct NcclGroup::Impl {
  int world = 0;
};

namespace {
[[noreturn]] void no_nccl() {
  throw Error("tensor parallelism on GPUs needs NCCL, and this kvlm was built without it (nccl.h was not found next to "
              "the CUDA toolkit when it was configured); install NCCL and rebuild, or use --tensor-parallel-size 1");
}
}  // namespace

NcclGroup::NcclGroup(const std::vector<int>&) { no_nccl(); }
NcclGroup::NcclGroup(const std::vector<int>&, int, int, const std::vector<uint8_t>&) { no_nccl(); }
std::vector<uint8_t> NcclGroup::unique_id() { no_nccl(); }

#endif

NcclGroup::~NcclGroup() = default;
int NcclGroup::world() const { return impl_ ? impl_->world : 0; }
int NcclGroup::num_local() const {
#ifdef KVLM_WITH_NCCL
  return int(impl_->ranks.size());
#else
  return 0;
#endif
}
Communicator& NcclGroup::local(int i) {
#ifdef KVLM_WITH_NCCL
  return *impl_->ranks.at(size_t(i));
#else
  (void)i;
  throw Error("no NCCL in this build");
#endif
}

}  // namespace kvlm

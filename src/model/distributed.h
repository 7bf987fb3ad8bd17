// Tensor parallelism across processes (and hosts): `--nnodes N --node-rank R
// --distributed-init tcp://HOST:PORT`, or torchrun's MASTER_ADDR / MASTER_PORT / RANK /
// WORLD_SIZE / LOCAL_RANK.
//
// Each process (a "node") drives tensor_parallel_size / nnodes consecutive ranks on its GPUs.
// Node 0 is the leader: it listens on HOST:PORT, waits for every other node to connect and
// say who it is (its node rank and a fingerprint of the model and options, which must match),
// and hands out what the ranks need to form one communicator — NCCL's unique id (NCCL then
// connects the GPUs itself), or, for CPU ranks, nothing: the sums travel over these sockets.
// The leader runs the engine (and the HTTP server); every call of its TensorParallelRunner is
// sent to the other nodes as a command (allocate the pool, run a batch, copy pages, stop),
// which they run on their ranks as followers: one schedule, decided once.
//
// Failure: a node that does not arrive within --distributed-timeout is named in the leader's
// error; a follower that fails reports its error and the leader aborts its communicators (a
// step waiting for that node fails instead of hanging); a follower whose leader goes away
// exits with an error. The control connection carries small messages only (a step's token
// ids, positions, slots and block tables).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "model/communicator.h"
#include "model/model_runner.h"

namespace kvlm {

struct DistConfig {
  int nnodes = 1;
  int node_rank = 0;
  std::string host;  // the leader's address (node 0 binds it)
  int port = 0;
  double timeout_s = 600;  // for every node to arrive
  bool enabled() const { return nnodes > 1; }
};

// --distributed-init (tcp://HOST:PORT) and the torchrun variables (MASTER_ADDR, MASTER_PORT,
// RANK, WORLD_SIZE) into a DistConfig; flags win over variables. Throws kvlm::Error for a
// malformed address, a node rank outside [0, nnodes), or several nodes without an address.
DistConfig resolve_dist_config(int nnodes, int node_rank, const std::string& init, double timeout_s);

// One framed message on a control connection.
struct DistMessage {
  uint32_t type = 0;
  std::vector<uint8_t> payload;
};

// A connected TCP socket with framed messages.
class DistSocket {
 public:
  explicit DistSocket(int fd = -1) : fd_(fd) {}
  ~DistSocket();
  DistSocket(DistSocket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  DistSocket& operator=(DistSocket&&) = delete;
  int fd() const { return fd_; }
  // Throw kvlm::Error naming `peer` when the connection breaks.
  void send(uint32_t type, const void* data, size_t bytes, const std::string& peer);
  DistMessage recv(const std::string& peer);
  void shutdown();  // wakes a thread blocked in recv

 private:
  int fd_;
};

// The leader's side once every node is in: a socket per other node (index = node rank - 1).
struct DistLeader {
  std::vector<DistSocket> nodes;
};

// The leader's bootstrap: listens on cfg.host:cfg.port, accepts nnodes - 1 nodes within the
// timeout (naming the missing node ranks otherwise), checks each one's fingerprint against
// `fingerprint` and sends it `welcome` (e.g. NCCL's unique id). Throws kvlm::Error.
DistLeader dist_accept(const DistConfig& cfg, const std::string& fingerprint, const std::vector<uint8_t>& welcome);

// A follower's bootstrap: connects to the leader (retrying until the timeout), says who it is
// and returns the leader's welcome payload with the connection. Throws kvlm::Error with the
// leader's reason when it refuses.
DistSocket dist_connect(const DistConfig& cfg, const std::string& fingerprint, std::vector<uint8_t>& welcome);

// Sums fp32 host buffers over the processes' ranks (one CPU rank per process): the followers
// send theirs to the leader, which adds them in rank order (the same bits as HostGroup) and
// sends the sum back, on the control connections.
class TcpGroup final : public CommGroup {
 public:
  TcpGroup(DistLeader* leader, DistSocket* follower, int rank, int world);
  ~TcpGroup() override;
  int world() const override;
  Communicator& local(int i) override;
  int num_local() const override { return 1; }

 private:
  class Rank;
  std::unique_ptr<Rank> rank_;
};

// The leader's end of the command channel (TensorParallelRunner sends every call here first).
class DistCommands {
 public:
  // `watch`: a thread reports a node's failure (its error message or a closed connection)
  // while the ranks run, aborting `abort` (the collectives then fail instead of waiting for
  // the node); off when the sums travel on these connections (TcpGroup).
  DistCommands(DistLeader& leader, std::vector<Communicator*> abort, bool watch);
  ~DistCommands();
  void allocate_kv(int num_blocks, int block_size, int num_exact_pages);
  void forward(const ForwardBatch& batch);
  void copy_blocks(std::span<const PageCopy> copies);
  void allocate_states(int slots);
  void copy_states(std::span<const StateCopy> copies);
  void stop();
  // Throws the first node failure seen (the leader's step then fails with it).
  void check() const;

 private:
  void broadcast(uint32_t type, const std::vector<uint8_t>& payload);
  void watch_loop();
  DistLeader& leader_;
  std::vector<Communicator*> abort_;
  std::thread watcher_;
  int wake_[2] = {-1, -1};
  mutable std::mutex mu_;
  std::string failure_;
  bool stopped_ = false;
};

// A follower node's life: runs the commands that arrive on `leader` on `ranks` (each a
// follower) until Stop. Returns 0 after Stop; throws kvlm::Error when the leader goes away or
// a rank fails (after telling the leader).
int dist_follow(DistSocket& leader, ModelRunner& ranks, const std::vector<Communicator*>& abort);

// The serialized form of a batch (tests).
std::vector<uint8_t> encode_batch(const ForwardBatch& b);
struct OwnedBatch {
  std::vector<TokenId> tokens;
  std::vector<Position> positions;
  std::vector<SlotId> slots, exact_slots;
  std::vector<std::vector<BlockId>> tables, exact_tables;
  std::vector<AttnSeq> seqs;
  std::vector<int32_t> logit_rows;
  ForwardBatch view() const;
};
OwnedBatch decode_batch(std::span<const uint8_t> bytes);

}  // namespace kvlm

#include "model/distributed.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/log.h"

namespace kvlm {

namespace {

enum MsgType : uint32_t {
  kHello = 1,      // follower -> leader: node rank, fingerprint
  kWelcome = 2,    // leader -> follower: the payload the ranks need
  kRefuse = 3,     // leader -> follower: why not
  kAllocate = 10,  // leader -> followers: the runner calls
  kForward = 11,
  kCopyBlocks = 12,
  kStop = 13,
  kAllocateStates = 14,
  kCopyStates = 15,
  kFailed = 20,    // follower -> leader: its error
  kSum = 30,       // TcpGroup's buffers, both ways
};

constexpr uint32_t kMagic = 0x6b766c6d;  // "kvlm"
constexpr uint64_t kMaxPayload = uint64_t(1) << 34;

using Clock = std::chrono::steady_clock;

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

// Appends / reads plain values and arrays (little-endian hosts only, as every GPU host is).
struct Writer {
  std::vector<uint8_t> out;
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out.insert(out.end(), p, p + sizeof(T));
  }
  template <class T>
  void put_span(std::span<const T> s) {
    put<uint64_t>(s.size());
    if (s.empty()) return;
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    out.insert(out.end(), p, p + s.size_bytes());
  }
};

struct Reader {
  std::span<const uint8_t> in;
  size_t at = 0;
  template <class T>
  T get() {
    if (at + sizeof(T) > in.size()) throw Error("a malformed tensor-parallel command (truncated)");
    T v;
    std::memcpy(&v, in.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> get_vec() {
    const uint64_t n = get<uint64_t>();
    if (n > (in.size() - at) / sizeof(T)) throw Error("a malformed tensor-parallel command (array length)");
    std::vector<T> v(static_cast<size_t>(n));
    if (n > 0) std::memcpy(v.data(), in.data() + at, size_t(n) * sizeof(T));
    at += size_t(n) * sizeof(T);
    return v;
  }
};

int parse_int(std::string_view s, const std::string& what) {
  int v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) throw Error(what + " '" + std::string(s) + "' is not a number");
  return v;
}

void set_nodelay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Waits for `fd` to be readable until `deadline`; false on timeout.
bool wait_readable(int fd, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, int(std::min<long long>(left, 1000)));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) throw Error(sys_error("poll"));
  }
}

addrinfo* resolve(const DistConfig& cfg, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(cfg.port);
  if (const int e = getaddrinfo(cfg.host.c_str(), port.c_str(), &hints, &res); e != 0)
    throw Error("--distributed-init: cannot resolve '" + cfg.host + "': " + gai_strerror(e));
  return res;
}

std::string where(const DistConfig& cfg) { return "tcp://" + cfg.host + ":" + std::to_string(cfg.port); }

}  // namespace

DistConfig resolve_dist_config(int nnodes, int node_rank, const std::string& init, double timeout_s) {
  DistConfig c;
  auto env = [](const char* n) -> std::string {
    const char* v = std::getenv(n);
    return v ? v : "";
  };
  // torchrun's variables where the flags are not given (a process per node).
  c.nnodes = nnodes > 0 ? nnodes : (env("WORLD_SIZE").empty() ? 1 : parse_int(env("WORLD_SIZE"), "WORLD_SIZE"));
  c.node_rank = node_rank >= 0 ? node_rank : (env("RANK").empty() ? 0 : parse_int(env("RANK"), "RANK"));
  c.timeout_s = timeout_s;
  if (c.nnodes < 1) throw Error("--nnodes must be at least 1, got " + std::to_string(c.nnodes));
  if (c.node_rank < 0 || c.node_rank >= c.nnodes)
    throw Error("--node-rank " + std::to_string(c.node_rank) + " is outside 0.." + std::to_string(c.nnodes - 1) +
                " (--nnodes " + std::to_string(c.nnodes) + ")");
  if (!(timeout_s > 0)) throw Error("--distributed-timeout must be positive");
  std::string addr = init;
  if (addr.empty() && !env("MASTER_ADDR").empty()) addr = "tcp://" + env("MASTER_ADDR") + ":" + env("MASTER_PORT");
  if (c.nnodes == 1) return c;
  if (addr.empty())
    throw Error("--nnodes " + std::to_string(c.nnodes) + " needs the leader's address: --distributed-init tcp://HOST:PORT "
                "(node 0 listens there), or MASTER_ADDR and MASTER_PORT");
  if (!addr.starts_with("tcp://"))
    throw Error("--distributed-init '" + addr + "' is not tcp://HOST:PORT");
  const std::string hp = addr.substr(6);
  const auto colon = hp.rfind(':');
  if (colon == std::string::npos || colon == 0)
    throw Error("--distributed-init '" + addr + "' is not tcp://HOST:PORT");
  c.host = hp.substr(0, colon);
  if (c.host.size() > 2 && c.host.front() == '[' && c.host.back() == ']') c.host = c.host.substr(1, c.host.size() - 2);
  c.port = parse_int(hp.substr(colon + 1), "--distributed-init port");
  if (c.port < 1 || c.port > 65535) throw Error("--distributed-init port " + std::to_string(c.port) + " is not 1..65535");
  return c;
}

// ---- sockets --------------------------------------------------------------------------------

DistSocket::~DistSocket() {
  if (fd_ >= 0) ::close(fd_);
}

void DistSocket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void DistSocket::send(uint32_t type, const void* data, size_t bytes, const std::string& peer) {
  uint8_t head[12];
  std::memcpy(head, &type, 4);
  const uint64_t n = bytes;
  std::memcpy(head + 4, &n, 8);
  auto all = [&](const uint8_t* p, size_t len) {
    while (len > 0) {
      const ssize_t w = ::send(fd_, p, len, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw Error("the connection to " + peer + " broke (" + std::strerror(errno) + ")");
      p += w;
      len -= size_t(w);
    }
  };
  all(head, sizeof head);
  if (bytes > 0) all(static_cast<const uint8_t*>(data), bytes);
}

DistMessage DistSocket::recv(const std::string& peer) {
  auto all = [&](uint8_t* p, size_t len) {
    while (len > 0) {
      const ssize_t r = ::recv(fd_, p, len, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r == 0) throw Error(peer + " closed the connection");
      if (r < 0) throw Error("the connection to " + peer + " broke (" + std::strerror(errno) + ")");
      p += r;
      len -= size_t(r);
    }
  };
  uint8_t head[12];
  all(head, sizeof head);
  DistMessage m;
  uint64_t n = 0;
  std::memcpy(&m.type, head, 4);
  std::memcpy(&n, head + 4, 8);
  if (n > kMaxPayload) throw Error("a malformed message from " + peer + " (" + std::to_string(n) + " bytes)");
  m.payload.resize(size_t(n));
  all(m.payload.data(), m.payload.size());
  return m;
}

// ---- bootstrap ------------------------------------------------------------------------------

DistLeader dist_accept(const DistConfig& cfg, const std::string& fingerprint, const std::vector<uint8_t>& welcome) {
  addrinfo* res = resolve(cfg, true);
  int lfd = -1;
  std::string err;
  for (addrinfo* a = res; a && lfd < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 64) == 0) lfd = fd;
    else {
      err = std::strerror(errno);
      ::close(fd);
    }
  }
  freeaddrinfo(res);
  if (lfd < 0)
    throw Error("node 0 cannot listen on " + where(cfg) + " (" + err + "); give an address of this host and a free "
                "port with --distributed-init");
  DistSocket listener(lfd);
  log::info("tensor parallelism: node 0 waiting on " + where(cfg) + " for " + std::to_string(cfg.nnodes - 1) +
            " other node(s)");
  DistLeader out;
  std::vector<std::unique_ptr<DistSocket>> by_rank(size_t(cfg.nnodes));
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.timeout_s));
  int arrived = 0;
  while (arrived < cfg.nnodes - 1) {
    if (!wait_readable(lfd, deadline)) {
      std::string missing;
      for (int r = 1; r < cfg.nnodes; ++r)
        if (!by_rank[size_t(r)]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      throw Error("node(s) " + missing + " did not connect to " + where(cfg) + " within " +
                  std::to_string(int(cfg.timeout_s)) + " s (--distributed-timeout); start them with --nnodes " +
                  std::to_string(cfg.nnodes) + " --node-rank R and the same --distributed-init");
    }
    const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    set_nodelay(fd);
    auto s = std::make_unique<DistSocket>(fd);
    DistMessage m;
    try {
      if (!wait_readable(fd, Clock::now() + std::chrono::seconds(10))) continue;  // a stray connection
      m = s->recv("a connecting node");
    } catch (const Error&) {
      continue;
    }
    Reader r{m.payload};
    auto refuse = [&](const std::string& why) {
      try {
        s->send(kRefuse, why.data(), why.size(), "a connecting node");
      } catch (const Error&) {
      }
    };
    if (m.type != kHello || m.payload.size() < 12) {
      refuse("not a kvlm node");
      continue;
    }
    const uint32_t magic = r.get<uint32_t>();
    const int rank = r.get<int32_t>(), nnodes = r.get<int32_t>();
    const std::string fp(m.payload.begin() + 12, m.payload.end());
    if (magic != kMagic) {
      refuse("not a kvlm node");
      continue;
    }
    if (nnodes != cfg.nnodes || rank < 1 || rank >= cfg.nnodes) {
      refuse("node 0 runs --nnodes " + std::to_string(cfg.nnodes) + "; this node says --nnodes " + std::to_string(nnodes) +
             " --node-rank " + std::to_string(rank));
      continue;
    }
    if (by_rank[size_t(rank)]) {
      refuse("node rank " + std::to_string(rank) + " is already connected");
      continue;
    }
    if (fp != fingerprint) {
      refuse("this node's model or options differ from node 0's: node 0 runs " + fingerprint + "; this node " + fp);
      throw Error("node " + std::to_string(rank) + " runs other options: " + fp + "; node 0 runs " + fingerprint);
    }
    by_rank[size_t(rank)] = std::move(s);
    ++arrived;
  }
  for (int r = 1; r < cfg.nnodes; ++r) {
    by_rank[size_t(r)]->send(kWelcome, welcome.data(), welcome.size(), "node " + std::to_string(r));
    out.nodes.push_back(std::move(*by_rank[size_t(r)]));
  }
  return out;
}

DistSocket dist_connect(const DistConfig& cfg, const std::string& fingerprint, std::vector<uint8_t>& welcome) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(cfg.timeout_s));
  std::string last = "no attempt";
  for (;;) {
    addrinfo* res = resolve(cfg, false);
    int fd = -1;
    for (addrinfo* a = res; a && fd < 0; a = a->ai_next) {
      fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
        last = std::strerror(errno);
        ::close(fd);
        fd = -1;
      }
    }
    freeaddrinfo(res);
    if (fd >= 0) {
      set_nodelay(fd);
      DistSocket s(fd);
      Writer w;
      w.put<uint32_t>(kMagic);
      w.put<int32_t>(cfg.node_rank);
      w.put<int32_t>(cfg.nnodes);
      w.out.insert(w.out.end(), fingerprint.begin(), fingerprint.end());
      s.send(kHello, w.out.data(), w.out.size(), "node 0");
      DistMessage m = s.recv("node 0 (" + where(cfg) + ")");
      if (m.type == kRefuse) throw Error("node 0 refused this node: " + std::string(m.payload.begin(), m.payload.end()));
      if (m.type != kWelcome) throw Error("node 0 at " + where(cfg) + " sent an unexpected message");
      welcome = std::move(m.payload);
      return s;
    }
    if (Clock::now() >= deadline)
      throw Error("node " + std::to_string(cfg.node_rank) + " could not reach node 0 at " + where(cfg) + " within " +
                  std::to_string(int(cfg.timeout_s)) + " s (last error: " + last + "); is node 0 started, and the "
                  "address one this host can reach?");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// ---- CPU sums over the sockets --------------------------------------------------------------

class TcpGroup::Rank final : public Communicator {
 public:
  Rank(DistLeader* leader, DistSocket* follower, int rank, int world)
      : leader_(leader), follower_(follower), rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  void all_reduce_sum(void* data, DType type, size_t count, void*) override {
    KVLM_CHECK(type == DType::F32, "the TCP communicator reduces fp32 only");
    if (aborted_) throw Error("tensor-parallel group aborted: another rank failed");
    float* x = static_cast<float*>(data);
    const size_t bytes = count * sizeof(float);
    if (leader_) {
      std::vector<float> sum(x, x + count);
      for (size_t k = 0; k < leader_->nodes.size(); ++k) {
        const std::string peer = "node " + std::to_string(k + 1);
        const DistMessage m = leader_->nodes[k].recv(peer);
        if (m.type == kFailed) throw Error(peer + " failed: " + std::string(m.payload.begin(), m.payload.end()));
        if (m.type != kSum || m.payload.size() != bytes) throw Error(peer + " sent a sum of another size");
        const float* y = reinterpret_cast<const float*>(m.payload.data());
        for (size_t i = 0; i < count; ++i) sum[i] += y[i];
      }
      for (size_t k = 0; k < leader_->nodes.size(); ++k)
        leader_->nodes[k].send(kSum, sum.data(), bytes, "node " + std::to_string(k + 1));
      std::copy(sum.begin(), sum.end(), x);
    } else {
      follower_->send(kSum, x, bytes, "node 0");
      const DistMessage m = follower_->recv("node 0");
      if (m.type != kSum || m.payload.size() != bytes) throw Error("node 0 sent a sum of another size");
      std::memcpy(x, m.payload.data(), bytes);
    }
  }
  void abort() override { aborted_ = true; }

 private:
  DistLeader* leader_;
  DistSocket* follower_;
  int rank_, world_;
  std::atomic<bool> aborted_{false};
};

TcpGroup::TcpGroup(DistLeader* leader, DistSocket* follower, int rank, int world)
    : rank_(std::make_unique<Rank>(leader, follower, rank, world)) {}
TcpGroup::~TcpGroup() = default;
int TcpGroup::world() const { return rank_->world_size(); }
Communicator& TcpGroup::local(int) { return *rank_; }

// ---- commands -------------------------------------------------------------------------------

std::vector<uint8_t> encode_batch(const ForwardBatch& b) {
  Writer w;
  w.put_span(b.tokens);
  w.put_span(b.positions);
  w.put_span(b.slots);
  w.put_span(b.exact_slots);
  w.put_span(b.logit_rows);
  w.put<uint64_t>(b.seqs.size());
  for (const AttnSeq& s : b.seqs) {
    w.put<int32_t>(s.q_begin);
    w.put<int32_t>(s.q_len);
    w.put<int32_t>(s.kv_len);
    w.put_span(s.block_table);
    w.put_span(s.exact_table);
  }
  return std::move(w.out);
}

OwnedBatch decode_batch(std::span<const uint8_t> bytes) {
  Reader r{bytes};
  OwnedBatch b;
  b.tokens = r.get_vec<TokenId>();
  b.positions = r.get_vec<Position>();
  b.slots = r.get_vec<SlotId>();
  b.exact_slots = r.get_vec<SlotId>();
  b.logit_rows = r.get_vec<int32_t>();
  const uint64_t n = r.get<uint64_t>();
  if (n > bytes.size()) throw Error("a malformed tensor-parallel command (sequence count)");
  for (uint64_t i = 0; i < n; ++i) {
    AttnSeq s;
    s.q_begin = r.get<int32_t>();
    s.q_len = r.get<int32_t>();
    s.kv_len = r.get<int32_t>();
    b.tables.push_back(r.get_vec<BlockId>());
    b.exact_tables.push_back(r.get_vec<BlockId>());
    b.seqs.push_back(s);
  }
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    b.seqs[i].block_table = b.tables[i];
    b.seqs[i].exact_table = b.exact_tables[i];
  }
  if (r.at != bytes.size()) throw Error("a malformed tensor-parallel command (trailing bytes)");
  return b;
}

ForwardBatch OwnedBatch::view() const {
  return ForwardBatch{.tokens = tokens, .positions = positions, .slots = slots, .exact_slots = exact_slots,
                      .seqs = seqs, .logit_rows = logit_rows};
}

DistCommands::DistCommands(DistLeader& leader, std::vector<Communicator*> abort, bool watch)
    : leader_(leader), abort_(std::move(abort)) {
  if (!watch) return;
  if (::pipe2(wake_, O_CLOEXEC) != 0) throw Error(sys_error("pipe"));
  watcher_ = std::thread([this] { watch_loop(); });
}

DistCommands::~DistCommands() {
  try {
    stop();
  } catch (const Error&) {
  }
  if (watcher_.joinable()) {
    const char c = 0;
    [[maybe_unused]] const ssize_t w = ::write(wake_[1], &c, 1);
    watcher_.join();
  }
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

// A follower speaks only to report its failure, or closes its connection by dying: either
// aborts the leader's communicators so that a step waiting on that node fails.
void DistCommands::watch_loop() {
  std::vector<pollfd> fds;
  fds.push_back({wake_[0], POLLIN, 0});
  for (const DistSocket& s : leader_.nodes) fds.push_back({s.fd(), POLLIN, 0});
  for (;;) {
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[0].revents) return;
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      std::string why;
      try {
        const DistMessage m = leader_.nodes[i - 1].recv("node " + std::to_string(i));
        why = m.type == kFailed ? std::string(m.payload.begin(), m.payload.end()) : "it sent an unexpected message";
      } catch (const Error& e) {
        why = e.what();
      }
      {
        std::lock_guard lock(mu_);
        if (stopped_) return;
        if (failure_.empty()) failure_ = "tensor-parallel node " + std::to_string(i) + " failed: " + why;
      }
      log::error(failure_);
      for (Communicator* c : abort_) c->abort();
      return;
    }
  }
}

void DistCommands::check() const {
  std::lock_guard lock(mu_);
  if (!failure_.empty()) throw Error(failure_);
}

void DistCommands::broadcast(uint32_t type, const std::vector<uint8_t>& payload) {
  check();
  for (size_t k = 0; k < leader_.nodes.size(); ++k)
    leader_.nodes[k].send(type, payload.data(), payload.size(), "tensor-parallel node " + std::to_string(k + 1));
}

void DistCommands::allocate_kv(int num_blocks, int block_size, int num_exact_pages) {
  Writer w;
  w.put<int32_t>(num_blocks);
  w.put<int32_t>(block_size);
  w.put<int32_t>(num_exact_pages);
  broadcast(kAllocate, w.out);
}

void DistCommands::forward(const ForwardBatch& batch) { broadcast(kForward, encode_batch(batch)); }

void DistCommands::copy_blocks(std::span<const PageCopy> copies) {
  Writer w;
  w.put_span(copies);
  broadcast(kCopyBlocks, w.out);
}

void DistCommands::allocate_states(int slots) {
  Writer w;
  w.put<int32_t>(slots);
  broadcast(kAllocateStates, w.out);
}

void DistCommands::copy_states(std::span<const StateCopy> copies) {
  Writer w;
  w.put_span(copies);
  broadcast(kCopyStates, w.out);
}

void DistCommands::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  for (size_t k = 0; k < leader_.nodes.size(); ++k) {
    try {
      leader_.nodes[k].send(kStop, nullptr, 0, "node " + std::to_string(k + 1));
    } catch (const Error&) {
    }
  }
}

int dist_follow(DistSocket& leader, ModelRunner& ranks, const std::vector<Communicator*>& abort) {
  for (;;) {
    DistMessage m;
    try {
      m = leader.recv("node 0 (the leader)");
    } catch (const Error& e) {
      // Between commands no collective is in flight, so there is nothing to abort (and
      // ncclCommAbort may wait for the peer that is gone): the caller exits.
      throw Error(std::string(e.what()) + " before telling this node to stop: it failed or was killed");
    }
    try {
      Reader r{m.payload};
      switch (m.type) {
        case kStop:
          return 0;
        case kAllocate: {
          const int nb = r.get<int32_t>(), bs = r.get<int32_t>(), ne = r.get<int32_t>();
          ranks.allocate_kv(nb, bs, ne);
          break;
        }
        case kForward: {
          const OwnedBatch b = decode_batch(m.payload);
          ranks.forward_follower(b.view());
          break;
        }
        case kCopyBlocks: {
          const std::vector<PageCopy> c = r.get_vec<PageCopy>();
          ranks.copy_blocks(c);
          break;
        }
        case kAllocateStates:
          ranks.allocate_states(r.get<int32_t>());
          break;
        case kCopyStates: {
          const std::vector<StateCopy> c = r.get_vec<StateCopy>();
          ranks.copy_states(c);
          break;
        }
        default:
          throw Error("an unknown command (" + std::to_string(m.type) + ") from node 0: is it the same kvlm build?");
      }
    } catch (const std::exception& e) {
      const std::string why = e.what();
      try {
        leader.send(kFailed, why.data(), why.size(), "node 0");
      } catch (const Error&) {
      }
      for (Communicator* c : abort) c->abort();
      throw;
    }
  }
}

}  // namespace kvlm

#include "server/connections.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <system_error>

namespace kvlm::server {

GrowingPool::GrowingPool(size_t max_threads) : max_(std::max<size_t>(max_threads, 1)) {}

GrowingPool::~GrowingPool() { shutdown(); }

void GrowingPool::enqueue(std::function<void()> fn) {
  std::lock_guard lock(mu_);
  jobs_.push_back(std::move(fn));
  if (idle_ < jobs_.size() && threads_.size() < max_ && !stopping_) {
    try {
      threads_.emplace_back([this] { work(); });
    } catch (const std::system_error&) {
      // No more threads: the job waits for a busy one.
    }
  }
  cv_.notify_one();
}

void GrowingPool::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) t.join();
}

void GrowingPool::work() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> fn = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    try {
      fn();
    } catch (...) {
      // httplib handles its own errors; nothing may escape a pool thread.
    }
    lock.lock();
  }
}

namespace {

bool matches(const sockaddr_storage& sa, socklen_t len, const std::string& host, int port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&sa), len, h, sizeof h, s, sizeof s, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  return host == h && port == std::atoi(s);
}

// Calls f(fd, self, peer) for every connected socket among the process's descriptors until
// it returns true.
template <class F>
void for_each_connected_socket(F&& f) {
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return;
  while (dirent* e = ::readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd < 0) continue;
    sockaddr_storage self{}, peer{};
    socklen_t slen = sizeof self, plen = sizeof peer;
    if (::getsockname(int(fd), reinterpret_cast<sockaddr*>(&self), &slen) != 0) continue;
    if (::getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &plen) != 0) continue;  // a listener has no peer
    if (f(int(fd), self, slen, peer, plen)) break;
  }
  ::closedir(d);
}

}  // namespace

ConnectionProbe::ConnectionProbe(const httplib::Request& req)
    : remote_(req.remote_addr), local_(req.local_addr), rport_(req.remote_port), lport_(req.local_port) {}

bool ConnectionProbe::client_gone() {
  if (fd_ == kUnknown) fd_ = find();
  if (fd_ < 0) return false;
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n > 0) return false;  // more data (a pipelined request): still there
  if (n == 0) return true;  // orderly close
  return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
}

int ConnectionProbe::find() const {
  int found = -1;
  for_each_connected_socket([&](int fd, const sockaddr_storage& self, socklen_t slen, const sockaddr_storage& peer,
                                socklen_t plen) {
    if (!matches(peer, plen, remote_, rport_) || !matches(self, slen, local_, lport_)) return false;
    found = fd;
    return true;
  });
  return found;
}

void shutdown_connections(int port) {
  std::vector<int> fds;
  for_each_connected_socket([&](int fd, const sockaddr_storage& self, socklen_t, const sockaddr_storage&, socklen_t) {
    int local_port = -1;
    if (self.ss_family == AF_INET) local_port = ntohs(reinterpret_cast<const sockaddr_in*>(&self)->sin_port);
    else if (self.ss_family == AF_INET6) local_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&self)->sin6_port);
    if (local_port == port) fds.push_back(fd);
    return false;
  });
  for (int fd : fds) ::shutdown(fd, SHUT_RDWR);
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

}  // namespace kvlm::server

// The connection layer under the HTTP routes: the listening socket, the connection-thread
// pool, and the two ways the server finds a client's socket that httplib does not hand out
// (a client that went away while its request computes; the open connections at shutdown).
// Linux-specific: sockets are found among /proc/self/fd by their addresses.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <httplib.h>

namespace kvlm::server {

// httplib keeps the listening socket protected; the backlog it listens with (5) is far too
// short for hundreds of clients connecting at once, and Linux lets listen() be called again.
class Listener : public httplib::Server {
 public:
  int listen_fd() const { return int(svr_sock_); }
};

// A connection-thread pool that grows with demand up to a limit (httplib's own pool has a
// fixed size chosen at compile time). Threads stay until shutdown.
class GrowingPool : public httplib::TaskQueue {
 public:
  explicit GrowingPool(size_t max_threads);
  ~GrowingPool() override;
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;

 private:
  void work();

  const size_t max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

// Tells whether the client of a request that is still being computed has closed its
// connection. httplib 0.11 gives handlers no socket, so the socket is found by its
// addresses among the process's descriptors, once, when a request has waited a while.
class ConnectionProbe {
 public:
  explicit ConnectionProbe(const httplib::Request& req);
  bool client_gone();

 private:
  int find() const;

  static constexpr int kUnknown = -2;
  std::string remote_, local_;
  int rport_, lport_;
  int fd_ = kUnknown;
};

// Shuts down (not closes: their threads close them) the connections accepted on `port`, so
// idle keep-alive connections end now instead of after their keep-alive timeout.
void shutdown_connections(int port);

// Compares without an early exit, so the time taken says nothing about where a guessed API
// key first differs.
bool constant_time_equal(const std::string& a, const std::string& b);

}  // namespace kvlm::server

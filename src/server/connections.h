// The connection layer under the HTTP routes. httplib 0.11 gives every accepted connection a
// thread for its whole life, reads each request with only a per-recv timeout, and builds a
// new read buffer for every request of a keep-alive connection (so pipelined requests are
// lost). Here httplib keeps its accept loop and its request parser (Server::process_request),
// and this layer owns the connections in between:
//
//   accept thread --adopt()--> poller (one epoll thread, no per-connection thread)
//     a connection waits here, holding no thread, until its request's headers have arrived
//     (seen with MSG_PEEK: nothing is consumed), then goes to a worker; one whose headers do
//     not finish within header_timeout of its first byte gets 408 and is closed (slowloris),
//     one idle longer than keep_alive_timeout is closed, one over max_open gets 503.
//     Before a worker takes it, the header block's framing is checked strictly (parse_framing:
//     a malformed or ambiguous Content-Length or Transfer-Encoding, a header line without a
//     colon, a folded line or a control byte gets 400 and the connection closes: a proxy in
//     front may frame the bytes otherwise, and the difference smuggles requests). A body of
//     up to poll_body_bytes also arrives here, holding no thread (within read_timeout of the
//     headers, else 408): a client trickling its body cannot take a worker.
//   worker (GrowingPool, at most max_busy threads) --> process_request() per request, on a
//     stream whose buffer lives as long as the connection, so pipelined requests are answered
//     in order. A larger body is read on the worker, within read_timeout and at min_body_rate
//     after a short grace (else 408); such requests may hold at most half of the workers, the
//     rest being kept for requests that arrived whole. With more than max_busy requests in
//     progress the next one gets 503 with Retry-After. After a response an empty buffer hands
//     the connection back to the poller.
//
// Linux-specific (epoll; sockets found among /proc/self/fd by their addresses as a fallback).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <httplib.h>

namespace kvlm::server {

class ConnectionManager;

// httplib's Server with its connections handed to a ConnectionManager. httplib keeps the
// listening socket protected; the backlog it listens with (5) is far too short for hundreds
// of clients connecting at once, and Linux lets listen() be called again.
class Listener : public httplib::Server {
 public:
  int listen_fd() const { return int(svr_sock_); }
  void set_manager(ConnectionManager* m) { mgr_ = m; }
  // One request of a connection: reads it from `strm`, routes it, writes the response.
  // False when the connection cannot go on.
  bool serve_request(httplib::Stream& strm, bool close_connection, bool& connection_closed) {
    return process_request(strm, close_connection, connection_closed, nullptr);
  }

 private:
  // Called (through the accept loop's task queue, inline) for every accepted socket.
  bool process_and_close_socket(socket_t sock) override;
  ConnectionManager* mgr_ = nullptr;
};

// httplib's accept loop hands each accepted socket to its task queue; this one runs the task
// at once on the accept thread (the task only adopts the socket: see Listener).
class InlineQueue : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

// A thread pool that grows with demand up to a limit (httplib's own pool has a fixed size
// chosen at compile time). Threads stay until shutdown.
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

struct ConnectionLimits {
  int max_busy = 1024;           // requests in progress at once (one worker thread each)
  int max_open = 0;              // open connections; 0: from the process's descriptor limit
  double header_timeout_s = 10;  // a request's headers, from its first byte
  double read_timeout_s = 30;    // a request's body, from the end of its headers; and any one read
  double write_timeout_s = 30;   // any one write
  double keep_alive_timeout_s = 30;  // an idle connection
  size_t keep_alive_max_count = 1000;  // requests on one connection
  size_t max_header_bytes = 64 << 10;  // request line and headers; more gets 431
  // Requests up to this many bytes, headers and body, arrive whole in the poller (see above):
  // well under a fresh socket's receive window, since the poller only peeks (bytes it does
  // not consume must all fit, or the client stops sending).
  size_t poll_body_bytes = 32 << 10;
  double min_body_rate = 16 << 10;     // bytes/s a body read on a worker must keep up, on average,
  double body_grace_s = 2;             // after this long
  // A request that arrives whole while every worker is busy waits this long for one (first
  // come, first served) before it gets 503: a client that reconnects the moment its last
  // answer arrived must not be refused by the worker that has not yet let go of it.
  double queue_wait_s = 0.5;
};

// The framing of a request, read off its header block (up to and including the blank line).
struct RequestFraming {
  std::string error;  // non-empty: why the request is refused (400, connection closed)
  size_t header_bytes = 0;
  bool chunked = false;
  bool expect_continue = false;  // Expect: 100-continue (the client waits for our go-ahead)
  uint64_t content_length = 0;   // when not chunked
};
RequestFraming parse_framing(std::string_view head);

// What a connection-level refusal (408, 431, 503) carries as its JSON body: (status, message,
// code). Called once per refusal.
using ErrorBody = std::function<std::string(int, const std::string&, const std::string&)>;

class ConnectionManager {
 public:
  ConnectionManager(Listener& svr, ConnectionLimits lim, ErrorBody body);
  ~ConnectionManager();  // stop()
  ConnectionManager(const ConnectionManager&) = delete;
  ConnectionManager& operator=(const ConnectionManager&) = delete;

  void start();  // the poller thread
  // An accepted socket (the accept thread): the manager owns it from here on.
  void adopt(int fd);
  // Closes the connections that wait, shuts down (their workers close them) those being
  // served, and waits for the workers.
  void stop();

  int open_connections() const;
  int busy_connections() const;
  const ConnectionLimits& limits() const { return lim_; }

  // For the code that runs on a worker, about the request that worker is serving:
  // its headers are read (the body's deadline starts now);
  static void headers_done();
  // its connection's socket (-1 off a worker);
  static int current_fd();
  // whether a read failed because a deadline passed (the answer is then 408);
  static bool current_timed_out();
  // when the worker began reading it (its headers had arrived);
  static std::chrono::steady_clock::time_point current_started();
  // the connection closes after this response (a body left unread or half read would
  // otherwise be parsed as the next request; httplib 0.11 keeps the connection whatever
  // the response's Connection header says).
  static void close_after_response();

 private:
  enum class State { Waiting, Queued, Closing };
  struct Conn {
    State state = State::Waiting;
    std::chrono::steady_clock::time_point since;        // waiting / queued / closing since
    std::chrono::steady_clock::time_point first_byte{};  // of a request not yet complete
    bool has_first_byte = false;
    size_t body_needed = 0;  // headers checked; waiting until this many bytes are in the socket
    std::chrono::steady_clock::time_point headers_at{};
    bool partial = false;  // queued before its body had all arrived
  };
  void poll_loop();
  void on_readable(int fd, Conn& c, bool hangup);  // under mu_
  void sweep(std::chrono::steady_clock::time_point now);  // under mu_
  // Under mu_: to a worker, or queued for one (a 503 once queue_wait_s has passed).
  // `partial`: its body has not all arrived.
  void dispatch(int fd, bool partial);
  bool has_room(bool partial) const;  // under mu_: a worker may take such a request now
  void admit_queued();                // under mu_: queued requests to the workers freed
  // Under mu_: the 503 of a request that waited in vain (or could not wait at all).
  void refuse_busy(int fd);
  // Answers with a short error, then lets the client read it: half-closes and drains until
  // the client closes or 2 s pass (closing with unread input would reset the connection
  // and could lose the answer). Under mu_.
  void refuse(int fd, int status, const std::string& message, const std::string& code, bool retry_after);
  void close_now(int fd);  // under mu_: a connection the poller holds
  void serve(int fd, bool partial);  // a worker
  void hand_back(int fd);  // a worker, after a response: the connection waits again

  Listener& svr_;
  ConnectionLimits lim_;
  ErrorBody body_;
  int epfd_ = -1, wake_fd_ = -1;
  std::thread poller_;
  GrowingPool workers_;
  mutable std::mutex mu_;
  std::unordered_map<int, Conn> conns_;  // held by the poller (waiting or closing)
  std::unordered_set<int> busy_;         // being served by a worker
  std::deque<int> queued_;               // waiting for a worker, oldest first
  int partial_busy_ = 0;                 // of them, dispatched before their body had arrived
  int open_ = 0;
  bool stopping_ = false;
  bool started_ = false;
};

// Tells whether the client of a request that is still being computed has closed its
// connection. Constructed on the worker that serves the request, it knows the socket; a
// caller elsewhere finds it by its addresses among the process's descriptors.
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

// Raises the soft limit on open descriptors to the hard limit (each connection is one) and
// returns the new soft limit.
long raise_descriptor_limit();

// Compares without an early exit, so the time taken says nothing about where a guessed API
// key first differs.
bool constant_time_equal(const std::string& a, const std::string& b);

}  // namespace kvlm::server

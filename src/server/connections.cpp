#include "server/connections.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <malloc.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <system_error>
#include <vector>

namespace kvlm::server {

using Clock = std::chrono::steady_clock;

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

int ms_until(Clock::time_point t) {
  const auto d = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
  return d <= 0 ? 0 : int(std::min<int64_t>(d, INT32_MAX));
}

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::microseconds(int64_t(seconds * 1e6));
}

bool numeric_name(const sockaddr_storage& sa, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&sa), len, h, sizeof h, s, sizeof s, NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h;
  port = std::atoi(s);
  return true;
}

// A connection's byte stream for httplib's request parser. Unlike httplib's SocketStream (one
// per request), it lives as long as the worker serves the connection, so bytes read ahead
// (a pipelined request) stay for the next request; and its reads end at a deadline, not just
// after a silence of read_timeout (one byte a second would never trip that).
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(int fd, const ConnectionLimits& lim) : fd_(fd), lim_(lim) {}

  void begin_request(Clock::time_point deadline) {
    deadline_ = deadline;
    in_body_ = false;
    timed_out_ = false;
    close_ = false;
    started_ = Clock::now();
  }
  // The headers are read: the body gets read_timeout from now, and must keep up
  // min_body_rate after body_grace_s.
  void body_phase() {
    deadline_ = after(lim_.read_timeout_s);
    body_start_ = Clock::now();
    body_bytes_ = 0;
    in_body_ = true;
  }
  bool buffered() const { return off_ < len_; }
  bool timed_out() const { return timed_out_; }
  void close_after() { close_ = true; }
  bool closing() const { return close_; }
  Clock::time_point started() const { return started_; }

  bool is_readable() const override {
    if (buffered()) return true;
    const int per_read = int(lim_.read_timeout_s * 1000);
    int left = ms_until(deadline_);
    if (in_body_ && lim_.min_body_rate > 0) {
      // What has arrived buys time at the minimum rate: a trickle runs out of it.
      const auto owed = body_start_ + std::chrono::microseconds(int64_t(
                                          (lim_.body_grace_s + double(body_bytes_) / lim_.min_body_rate) * 1e6));
      left = std::min(left, ms_until(owed));
    }
    pollfd p{fd_, POLLIN, 0};
    int n;
    do n = ::poll(&p, 1, std::min(per_read, left));
    while (n < 0 && errno == EINTR);
    if (n == 0) timed_out_ = true;
    return n > 0;
  }
  bool is_writable() const override {
    pollfd p{fd_, POLLOUT, 0};
    int n;
    do n = ::poll(&p, 1, int(lim_.write_timeout_s * 1000));
    while (n < 0 && errno == EINTR);
    return n > 0;
  }
  // A pipelined request read ahead: reads until the buffer holds its whole header block (or
  // it passes max_header_bytes, the deadline passes or the client closes) and returns the
  // buffered bytes, for parse_framing. The parser then reads them from the buffer.
  std::string_view buffer_headers() {
    for (;;) {
      const std::string_view have(buf_.data() + off_, len_ - off_);
      if (have.find("\r\n\r\n") != std::string_view::npos || have.size() > lim_.max_header_bytes) return have;
      if (off_ > 0) {  // compact, then make room
        std::memmove(buf_.data(), buf_.data() + off_, len_ - off_);
        len_ -= off_;
        off_ = 0;
      }
      if (buf_.size() - len_ < 4096) buf_.resize(std::min(buf_.size() * 2, lim_.max_header_bytes + 8192));
      if (len_ == buf_.size() || !is_readable()) return {buf_.data(), len_};
      ssize_t n;
      do n = ::recv(fd_, buf_.data() + len_, buf_.size() - len_, 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return {buf_.data(), len_};
      len_ += size_t(n);
    }
  }

  ssize_t read(char* ptr, size_t size) override {
    if (!buffered()) {
      if (!is_readable()) return -1;
      if (buf_.size() > kReadBuffer) buf_.resize(kReadBuffer);  // (grown for a header block)
      ssize_t n;
      do n = ::recv(fd_, buf_.data(), buf_.size(), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      len_ = size_t(n);
    }
    const size_t k = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_.data() + off_, k);
    off_ += k;
    body_bytes_ += k;
    return ssize_t(k);
  }
  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    ssize_t n;
    do n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage sa{};
    socklen_t len = sizeof sa;
    if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&sa), &len) == 0) numeric_name(sa, len, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage sa{};
    socklen_t len = sizeof sa;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) == 0) numeric_name(sa, len, ip, port);
  }
  socket_t socket() const override { return fd_; }

 private:
  static constexpr size_t kReadBuffer = 16384;
  const int fd_;
  const ConnectionLimits& lim_;
  std::vector<char> buf_ = std::vector<char>(kReadBuffer);
  size_t off_ = 0, len_ = 0;
  Clock::time_point deadline_{}, started_{}, body_start_{};
  size_t body_bytes_ = 0;  // read since body_phase()
  bool in_body_ = false;
  mutable bool timed_out_ = false;
  bool close_ = false;
};

thread_local ConnStream* t_stream = nullptr;

const char* reason_phrase(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

}  // namespace

namespace {

bool ieq(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i]))) return false;
  return true;
}

std::string_view trim_ows(std::string_view v) {
  while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
  while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
  return v;
}

// RFC 9110's tchar: what a header name is made of.
bool token_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

// A connection-level error answer, complete, that closes the connection.
std::string error_response(const ErrorBody& body_of, int status, const std::string& message, const std::string& code,
                           bool retry_after) {
  const std::string body = body_of ? body_of(status, message, code) : "{}";
  std::string head = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
                     "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
                     "\r\nConnection: close\r\n";
  if (retry_after) head += "Retry-After: 1\r\n";
  return head + "\r\n" + body;
}

// Hands freed memory back to the system once enough of it has piled up (glibc keeps what a
// spike allocated; a large grammar or body would otherwise stay resident for good). At most
// once a second, from the worker that finished a request.
void trim_free_memory() {
  static std::atomic<int64_t> last{0};
  const int64_t now = Clock::now().time_since_epoch() / std::chrono::milliseconds(1);
  int64_t prev = last.load(std::memory_order_relaxed);
  if (now - prev < 1000 || !last.compare_exchange_strong(prev, now)) return;
  const struct mallinfo2 mi = ::mallinfo2();
  if (mi.fordblks >= (size_t(64) << 20)) ::malloc_trim(0);
}

}  // namespace

RequestFraming parse_framing(std::string_view head) {
  RequestFraming f;
  const size_t end = head.find("\r\n\r\n");
  if (end == std::string_view::npos) {
    f.error = "the request's header block does not end with an empty line (CRLF CRLF)";
    return f;
  }
  f.header_bytes = end + 4;
  const std::string_view block = head.substr(0, end + 2);  // every line with its CRLF
  int cl_count = 0, te_count = 0;
  std::string_view cl, te;
  size_t pos = 0;
  for (int line_no = 0; pos < block.size(); ++line_no) {
    const size_t eol = block.find("\r\n", pos);
    const std::string_view line = block.substr(pos, eol - pos);
    pos = eol + 2;
    for (char c : line) {
      const auto u = static_cast<unsigned char>(c);
      if (u == 0 || u == '\r' || u == '\n' || (u < 0x20 && u != '\t') || u == 0x7F) {
        f.error = "the request's headers hold a control character (NUL, a bare CR or LF, ...)";
        return f;
      }
    }
    if (line_no == 0) continue;  // the request line: httplib parses it
    if (line.empty() || line.front() == ' ' || line.front() == '\t') {
      f.error = "folded header lines (a line starting with a space or tab) are not accepted";
      return f;
    }
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) {
      f.error = "a header line without a colon";
      return f;
    }
    const std::string_view name = line.substr(0, colon);
    if (name.empty() || !std::all_of(name.begin(), name.end(), token_char)) {
      f.error = "a malformed header name (no spaces are allowed before the colon)";
      return f;
    }
    const std::string_view value = trim_ows(line.substr(colon + 1));
    if (ieq(name, "Content-Length")) {
      if (value.empty() || value.size() > 18 || !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; })) {
        f.error = "Content-Length must be a decimal number of bytes (digits only)";
        return f;
      }
      if (cl_count++ && value != cl) {
        f.error = "two Content-Length headers that disagree";
        return f;
      }
      cl = value;
    } else if (ieq(name, "Transfer-Encoding")) {
      ++te_count;
      te = value;
    } else if (ieq(name, "Expect") && ieq(value, "100-continue")) {
      f.expect_continue = true;
    } else if (ieq(name, "Range") && value.size() > 64) {
      // httplib parses a Range header with std::regex before any handler runs (~3 MB for an
      // 8 KB list of ranges); the server serves no byte ranges, and a short header is ignored
      // (http_server.cpp's pre-routing handler clears the ranges httplib parsed from it).
      f.error = "this server serves no byte ranges: send no Range header";
      return f;
    }
  }
  if (te_count) {
    if (cl_count) {
      f.error = "both Content-Length and Transfer-Encoding: send one of them";
      return f;
    }
    if (te_count > 1 || !ieq(te, "chunked")) {
      f.error = "unsupported Transfer-Encoding '" + std::string(te.substr(0, 40)) + "' (only chunked is accepted)";
      return f;
    }
    f.chunked = true;
  } else if (cl_count) {
    f.content_length = std::strtoull(std::string(cl).c_str(), nullptr, 10);
  }
  return f;
}

bool Listener::process_and_close_socket(socket_t sock) {
  if (mgr_) {
    mgr_->adopt(int(sock));
  } else {
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
  }
  return true;
}

ConnectionManager::ConnectionManager(Listener& svr, ConnectionLimits lim, ErrorBody body)
    : svr_(svr), lim_(lim), body_(std::move(body)), workers_(size_t(std::max(lim.max_busy, 1))) {
  if (lim_.max_open <= 0) {
    rlimit rl{};
    const long soft = ::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY ? long(rl.rlim_cur) : 1024;
    // Descriptors left for everything else: model files, the engine, logs.
    lim_.max_open = int(std::clamp<long>(soft - 256, 64, 1 << 20));
  }
  svr_.set_manager(this);
}

ConnectionManager::~ConnectionManager() {
  stop();
  if (epfd_ >= 0) ::close(epfd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ConnectionManager::start() {
  std::lock_guard lock(mu_);
  if (started_) return;
  epfd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epfd_ < 0 || wake_fd_ < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1/eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epfd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  started_ = true;
  stopping_ = false;
  poller_ = std::thread([this] { poll_loop(); });
}

int ConnectionManager::open_connections() const {
  std::lock_guard lock(mu_);
  return open_;
}

int ConnectionManager::busy_connections() const {
  std::lock_guard lock(mu_);
  return int(busy_.size());
}

void ConnectionManager::adopt(int fd) {
  std::lock_guard lock(mu_);
  if (stopping_ || !started_) {
    ::close(fd);
    return;
  }
  ++open_;
  Conn& c = conns_[fd];
  c = Conn{State::Waiting, Clock::now(), {}, false};
  if (open_ > lim_.max_open) {
    refuse(fd, 503, "the server has too many open connections (" + std::to_string(lim_.max_open) + "); retry later",
           "too_many_connections", true);
    return;
  }
  // Edge-triggered: the bytes are only peeked, never consumed, so a level-triggered wait
  // would wake at once again; an edge comes with each new arrival.
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) close_now(fd);
}

void ConnectionManager::close_now(int fd) {
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  if (const auto it = conns_.find(fd); it != conns_.end() && it->second.state == State::Queued) std::erase(queued_, fd);
  conns_.erase(fd);
  ::close(fd);
  --open_;
}

void ConnectionManager::refuse(int fd, int status, const std::string& message, const std::string& code, bool retry_after) {
  const std::string msg = error_response(body_, status, message, code, retry_after);
  // A fresh socket's send buffer holds this at once; what does not fit is not waited for.
  [[maybe_unused]] const ssize_t n = ::send(fd, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  auto it = conns_.find(fd);
  if (it == conns_.end()) it = conns_.emplace(fd, Conn{}).first;
  if (it->second.state == State::Queued) std::erase(queued_, fd);
  it->second.state = State::Closing;
  it->second.since = Clock::now();
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  ev.data.fd = fd;
  if (::epoll_ctl(epfd_, EPOLL_CTL_MOD, fd, &ev) != 0 && ::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) close_now(fd);
  else on_readable(fd, it->second, false);  // input already here: drain it now
}

void ConnectionManager::on_readable(int fd, Conn& c, bool hangup) {
  if (c.state == State::Queued) {  // the request is all here; more bytes wait for the worker
    if (hangup) close_now(fd);
    return;
  }
  if (c.state == State::Closing) {
    char sink[4096];
    for (;;) {
      const ssize_t n = ::recv(fd, sink, sizeof sink, MSG_DONTWAIT);
      if (n > 0) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n < 0 && errno == EINTR) continue;
      close_now(fd);  // the client closed (or the connection broke)
      return;
    }
  }
  if (c.body_needed) {  // the headers are checked: is the body all here?
    int avail = 0;
    if (::ioctl(fd, FIONREAD, &avail) == 0 && size_t(avail) >= c.body_needed) {
      dispatch(fd, false);
    } else if (hangup) {
      close_now(fd);
    }
    return;
  }
  // Waiting: has the request's header block arrived? Peeked, so the worker's parser reads
  // it all from the start.
  thread_local std::string peek;
  peek.resize(lim_.max_header_bytes + 1);
  ssize_t n;
  do n = ::recv(fd, peek.data(), peek.size(), MSG_PEEK | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    close_now(fd);  // closed by the client while idle
    return;
  }
  if (n < 0) {
    if (hangup) close_now(fd);
    return;
  }
  if (!c.has_first_byte) {
    c.has_first_byte = true;
    c.first_byte = Clock::now();
  }
  const std::string_view got(peek.data(), size_t(n));
  if (const size_t end = got.find("\r\n\r\n"); end != std::string_view::npos) {
    const RequestFraming f = parse_framing(got.substr(0, end + 4));
    if (!f.error.empty()) {
      refuse(fd, 400, "malformed HTTP request: " + f.error, "", false);
      return;
    }
    // A client that sent Expect: 100-continue waits for httplib's go-ahead, sent on a worker.
    if (f.chunked || f.content_length == 0 || f.expect_continue ||
        f.header_bytes + f.content_length > lim_.poll_body_bytes) {
      dispatch(fd, f.chunked || f.content_length > 0);
      return;
    }
    c.body_needed = f.header_bytes + size_t(f.content_length);
    c.headers_at = Clock::now();
    on_readable(fd, c, hangup);  // the body may be here already
  } else if (size_t(n) > lim_.max_header_bytes) {
    refuse(fd, 431, "the request line and headers are larger than " + std::to_string(lim_.max_header_bytes) + " bytes",
           "", false);
  } else if (hangup) {
    close_now(fd);  // half a request, and the client has stopped sending
  }
}

bool ConnectionManager::has_room(bool partial) const {
  // Requests whose bodies are still coming may hold half of the workers: the rest stay for
  // requests that arrived whole.
  return int(busy_.size()) < lim_.max_busy && (!partial || 2 * (partial_busy_ + 1) <= std::max(lim_.max_busy, 2));
}

void ConnectionManager::dispatch(int fd, bool partial) {
  Conn& c = conns_[fd];
  if (!has_room(partial)) {
    if (c.state != State::Queued) {
      if (lim_.queue_wait_s <= 0) {
        refuse_busy(fd);
        return;
      }
      c.state = State::Queued;
      c.since = Clock::now();
      c.partial = partial;
      queued_.push_back(fd);
    }
    return;
  }
  if (c.state == State::Queued) std::erase(queued_, fd);
  ::epoll_ctl(epfd_, EPOLL_CTL_DEL, fd, nullptr);
  conns_.erase(fd);
  busy_.insert(fd);
  if (partial) ++partial_busy_;
  workers_.enqueue([this, fd, partial] { serve(fd, partial); });
}

void ConnectionManager::admit_queued() {
  // Oldest first; a large body that may not start yet lets a whole request behind it go.
  for (size_t i = 0; i < queued_.size() && int(busy_.size()) < lim_.max_busy;) {
    const int fd = queued_[i];
    const bool partial = conns_[fd].partial;
    if (has_room(partial)) dispatch(fd, partial);  // removes it from queued_
    else ++i;
  }
}

void ConnectionManager::refuse_busy(int fd) {
  if (int(busy_.size()) >= lim_.max_busy)
    refuse(fd, 503,
           "the server is serving its maximum of " + std::to_string(lim_.max_busy) +
               " requests at once (--max-connections); retry later",
           "too_many_connections", true);
  else
    refuse(fd, 503, "the server is reading its maximum of large request bodies at once; retry later",
           "too_many_connections", true);
}

void ConnectionManager::sweep(Clock::time_point now) {
  std::vector<std::pair<int, int>> expired;  // fd, what to do: 0 close, 1 408 headers, 2 408 body, 3 503
  for (const auto& [fd, c] : conns_) {
    if (c.state == State::Closing) {
      if (now - c.since > std::chrono::seconds(2)) expired.emplace_back(fd, 0);
    } else if (c.state == State::Queued) {
      if (now - c.since > std::chrono::microseconds(int64_t(lim_.queue_wait_s * 1e6))) expired.emplace_back(fd, 3);
    } else if (c.body_needed) {
      if (now - c.headers_at > std::chrono::microseconds(int64_t(lim_.read_timeout_s * 1e6))) expired.emplace_back(fd, 2);
    } else if (c.has_first_byte) {
      if (now - c.first_byte > std::chrono::microseconds(int64_t(lim_.header_timeout_s * 1e6))) expired.emplace_back(fd, 1);
    } else if (now - c.since > std::chrono::microseconds(int64_t(lim_.keep_alive_timeout_s * 1e6))) {
      expired.emplace_back(fd, 0);
    }
  }
  for (const auto& [fd, what] : expired) {
    if (what == 0) close_now(fd);
    else if (what == 3) refuse_busy(fd);
    else if (what == 1)
      refuse(fd, 408, "the request's headers did not arrive within " + std::to_string(int(lim_.header_timeout_s)) + " s",
             "request_timeout", false);
    else
      refuse(fd, 408, "the request body did not arrive within " + std::to_string(int(lim_.read_timeout_s)) + " s",
             "request_timeout", false);
  }
}

void ConnectionManager::poll_loop() {
  std::array<epoll_event, 256> evs;
  auto next_sweep = Clock::now();
  for (;;) {
    const int n = ::epoll_wait(epfd_, evs.data(), int(evs.size()), 100);
    std::lock_guard lock(mu_);
    if (stopping_) return;
    for (int i = 0; i < n; ++i) {
      const int fd = evs[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        [[maybe_unused]] const ssize_t r = ::read(wake_fd_, &v, sizeof v);
        continue;
      }
      const auto it = conns_.find(fd);
      if (it == conns_.end()) continue;  // handed to a worker by an earlier event of this batch
      on_readable(fd, it->second, (evs[i].events & (EPOLLHUP | EPOLLERR)) != 0);
    }
    const auto now = Clock::now();
    if (now >= next_sweep) {
      sweep(now);
      next_sweep = now + std::chrono::milliseconds(250);
    }
  }
}

void ConnectionManager::serve(int fd, bool partial) {
  ConnStream strm(fd, lim_);
  t_stream = &strm;
  bool keep = false;
  for (size_t count = lim_.keep_alive_max_count; count > 0; --count) {
    // The headers are here (the poller saw them) or, for a pipelined request, already read
    // ahead or on their way: either way they get header_timeout.
    strm.begin_request(after(lim_.header_timeout_s));
    bool stopping;
    {
      std::lock_guard lock(mu_);
      stopping = stopping_;
    }
    // A request after the first was read ahead by this worker, not peeked by the poller: its
    // framing is checked here (a proxy pipelining clients' requests on one connection is
    // where a smuggled one would hide).
    if (count != lim_.keep_alive_max_count) {
      const RequestFraming f = parse_framing(strm.buffer_headers());
      if (!f.error.empty() && f.header_bytes > 0) {
        const std::string msg = error_response(body_, 400, "malformed HTTP request: " + f.error, "", false);
        [[maybe_unused]] const ssize_t n = strm.write(msg.data(), msg.size());
        break;
      }
    }
    bool closed = false;
    const bool close = count == 1 || stopping;
    const bool ok = svr_.serve_request(strm, close, closed);
    if (partial) {  // only the first request of the connection came in early
      partial = false;
      std::lock_guard lock(mu_);
      --partial_busy_;
      admit_queued();
    }
    if (!ok || closed || close || strm.closing()) break;
    if (!strm.buffered()) {
      keep = true;
      break;
    }
  }
  t_stream = nullptr;
  {
    std::lock_guard lock(mu_);
    if (partial) --partial_busy_;
    busy_.erase(fd);
    if (!stopping_) admit_queued();
    if (keep && !stopping_) {
      hand_back(fd);
    } else {
      ::shutdown(fd, SHUT_RDWR);
      ::close(fd);
      --open_;
    }
  }
  trim_free_memory();  // after the slot is free: malloc_trim may take a while
}

void ConnectionManager::hand_back(int fd) {
  conns_[fd] = Conn{State::Waiting, Clock::now(), {}, false};
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
  ev.data.fd = fd;
  // A next request already in the socket is reported at once.
  if (::epoll_ctl(epfd_, EPOLL_CTL_ADD, fd, &ev) != 0) close_now(fd);
}

void ConnectionManager::stop() {
  {
    std::lock_guard lock(mu_);
    if (!started_ || stopping_) return;
    stopping_ = true;
    for (int fd : busy_) ::shutdown(fd, SHUT_RDWR);  // their workers close them
  }
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t r = ::write(wake_fd_, &one, sizeof one);
  }
  if (poller_.joinable()) poller_.join();
  {
    std::lock_guard lock(mu_);
    std::vector<int> fds;
    for (const auto& [fd, _] : conns_) fds.push_back(fd);
    for (int fd : fds) close_now(fd);
  }
  workers_.shutdown();
  std::lock_guard lock(mu_);
  started_ = false;
}

void ConnectionManager::headers_done() {
  if (t_stream) t_stream->body_phase();
}

void ConnectionManager::close_after_response() {
  if (t_stream) t_stream->close_after();
}

int ConnectionManager::current_fd() { return t_stream ? int(t_stream->socket()) : -1; }

bool ConnectionManager::current_timed_out() { return t_stream && t_stream->timed_out(); }

Clock::time_point ConnectionManager::current_started() { return t_stream ? t_stream->started() : Clock::now(); }

namespace {

bool matches(const sockaddr_storage& sa, socklen_t len, const std::string& host, int port) {
  std::string h;
  int p = -1;
  return numeric_name(sa, len, h, p) && h == host && p == port;
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
    : remote_(req.remote_addr), local_(req.local_addr), rport_(req.remote_port), lport_(req.local_port) {
  if (const int fd = ConnectionManager::current_fd(); fd >= 0) fd_ = fd;
}

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

long raise_descriptor_limit() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return 1024;
  if (rl.rlim_cur < rl.rlim_max) {
    rlimit want = rl;
    want.rlim_cur = rl.rlim_max == RLIM_INFINITY ? std::max<rlim_t>(rl.rlim_cur, 1 << 20) : rl.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &want) == 0) rl = want;
  }
  return rl.rlim_cur == RLIM_INFINITY ? (1L << 20) : long(rl.rlim_cur);
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

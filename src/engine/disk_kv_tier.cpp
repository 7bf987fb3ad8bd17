#include "engine/disk_kv_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <system_error>

#include "core/error.h"
#include "core/log.h"
#include "core/units.h"

namespace kvlm {

namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'K', 'V', 'L', 'M', 'P', 'A', 'G', 'E'};
constexpr uint32_t kVersion = 1;
constexpr const char* kExt = ".kvpage";
// Marks a failed read that says nothing about the file (it is kept).
constexpr const char* kTransient = "transient: ";

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
void put_hash(uint8_t* p, const PageHash& h) {
  put_u64(p, h.lo);
  put_u64(p + 8, h.hi);
}
PageHash get_hash(const uint8_t* p) { return {get_u64(p), get_u64(p + 8)}; }

// Header field offsets.
constexpr size_t kOffVersion = 8, kOffBlock = 12, kOffPage = 16, kOffRoot = 24, kOffChain = 40, kOffTokens = 56;

// Moves an I/O vector on by `done` bytes (a short preadv / pwritev continues from there).
template <size_t N>
void advance(iovec (&iov)[N], size_t done) {
  for (auto& v : iov) {
    const size_t n = std::min(done, v.iov_len);
    v.iov_base = static_cast<uint8_t*>(v.iov_base) + n;
    v.iov_len -= n;
    done -= n;
  }
}

bool read_all(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= size_t(r);
  }
  return true;
}

}  // namespace

uint64_t page_file_checksum(std::span<const uint8_t> bytes, uint64_t seed) {
  // Four independent lanes over 32-byte stripes (so the multiplies overlap), folded and mixed.
  constexpr uint64_t k1 = 0x9e3779b185ebca87ULL, k2 = 0xc2b2ae3d27d4eb4fULL;
  uint64_t lane[4] = {k1 ^ seed, k2 + seed, ~k1 ^ seed, ~k2 - seed};
  size_t i = 0;
  for (; i + 32 <= bytes.size(); i += 32)
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, bytes.data() + i + 8 * size_t(l), 8);
      lane[l] = std::rotl(lane[l] + w * k2, 31) * k1;
    }
  uint64_t h = std::rotl(lane[0], 1) + std::rotl(lane[1], 7) + std::rotl(lane[2], 12) + std::rotl(lane[3], 18);
  for (; i < bytes.size(); ++i) h = std::rotl(h ^ (uint64_t(bytes[i]) * k1), 11) * k2;
  h ^= uint64_t(bytes.size());
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

DiskKVTier::DiskKVTier(const fs::path& dir, uint64_t capacity_bytes, const PageHash& root, const std::string& description,
                       size_t page_bytes, int block_size)
    : dir_(dir / root.hex()), root_(root), page_bytes_(page_bytes),
      header_bytes_(kOffTokens + 4 * size_t(block_size)), file_bytes_(header_bytes_ + page_bytes + 8),
      block_size_(block_size) {
  KVLM_CHECK(page_bytes > 0 && block_size > 0, "disk tier: empty pages");
  capacity_ = size_t(capacity_bytes / file_bytes_);
  if (capacity_ < 1)
    throw Error("--kv-offload-disk-gib: " + human_bytes(capacity_bytes) + " holds no page of " + std::to_string(file_bytes_) +
                " bytes; give the disk tier more");
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec || !fs::is_directory(dir_))
    throw Error("--kv-offload-dir: cannot create " + dir_.string() + " (" + ec.message() +
                "); give a directory this process can write");
  // The pages hold what users' prompts computed: readable by this user only.
  fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::replace, ec);
  lock_fd_ = ::open((dir_ / "lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd_ < 0)
    throw Error("--kv-offload-dir: cannot write in " + dir_.string() + " (" + std::strerror(errno) +
                "); give a directory this process can write");
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(lock_fd_);
    throw Error("--kv-offload-dir: " + dir_.string() +
                " is in use by another kvlm serving the same model; give each server a directory of its own");
  }
  {
    std::ofstream about(dir_ / "model.txt", std::ios::trunc);
    about << "kvlm KV pages of:\n" << description << "\n";
  }
  scan();
  try {
    writer_ = std::thread([this] { writer_loop(); });
    for (int i = 0; i < kReaders; ++i) readers_.emplace_back([this] { reader_loop(); });
  } catch (...) {  // no thread to be had: stop the ones started, release the lock
    stop_threads();
    ::close(lock_fd_);
    throw;
  }
}

DiskKVTier::~DiskKVTier() {
  stop_threads();
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

void DiskKVTier::stop_threads() {
  {
    const std::lock_guard lock(mu_);
    stop_ = true;  // the writer finishes what is queued first
  }
  work_cv_.notify_all();
  read_cv_.notify_all();
  if (writer_.joinable()) writer_.join();
  for (std::thread& t : readers_) t.join();
}

fs::path DiskKVTier::path_of(const PageHash& chain) const { return dir_ / (chain.hex() + kExt); }

std::string DiskKVTier::check_header(std::span<const uint8_t> h, const PageHash* chain) const {
  if (h.size() < header_bytes_ || std::memcmp(h.data(), kMagic, 8) != 0) return "not a kvlm page file";
  if (get_u32(h.data() + kOffVersion) != kVersion) return "page file version " + std::to_string(get_u32(h.data() + kOffVersion));
  if (get_hash(h.data() + kOffRoot) != root_) return "written for another model or KV plan";
  if (get_u32(h.data() + kOffBlock) != uint32_t(block_size_) || get_u64(h.data() + kOffPage) != page_bytes_)
    return "another block size or page layout";
  if (chain && get_hash(h.data() + kOffChain) != *chain) return "its name and contents differ";
  return {};
}

void DiskKVTier::drop_damaged(const fs::path& file, const std::string& why) {
  log::warn("disk tier: ignored " + file.string() + ": " + why + "; removed");
  std::error_code ec;
  fs::remove(file, ec);
  ++damaged_;
}

void DiskKVTier::scan() {
  const auto t0 = std::chrono::steady_clock::now();
  struct Found {
    fs::file_time_type mtime;
    PageHash chain;
    Entry entry;
  };
  std::vector<Found> found;
  std::vector<uint8_t> header(header_bytes_);
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir_, ec)) {
    const fs::path p = de.path();
    const std::string name = p.filename().string();
    if (name.ends_with(".tmp")) {  // a write that never finished
      fs::remove(p, ec);
      continue;
    }
    if (!name.ends_with(kExt)) continue;
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    const bool got = read_all(fd, header.data(), header.size());
    ::close(fd);
    if (!got) {
      drop_damaged(p, "truncated");
      continue;
    }
    const PageHash chain = get_hash(header.data() + kOffChain);
    std::string why = check_header(header, nullptr);
    if (why.empty() && name != chain.hex() + kExt) why = "its name and contents differ";
    if (why.empty() && de.file_size(ec) != file_bytes_) why = "truncated or overlong";
    if (!why.empty()) {
      drop_damaged(p, why);
      continue;
    }
    Found f{de.last_write_time(ec), chain, {}};
    for (int i = 0; i < block_size_; ++i) f.entry.tokens.push_back(TokenId(get_u32(header.data() + kOffTokens + 4 * size_t(i))));
    found.push_back(std::move(f));
  }
  std::ranges::sort(found, {}, &Found::mtime);  // oldest first
  for (auto& f : found) {
    if (index_.count(f.chain)) continue;
    f.entry.lru = lru_.insert(lru_.end(), f.chain);
    index_.emplace(f.chain, std::move(f.entry));
  }
  while (index_.size() > capacity_) {  // a smaller --kv-offload-disk-gib than last time
    remove(lru_.front());
    ++evicted_;
  }
  loaded_ = index_.size();
  char line[256];
  std::snprintf(line, sizeof line, "disk tier: %zu pages of this model found in %s (%s of %s) in %.2f s", index_.size(),
                dir_.c_str(), human_bytes(uint64_t(index_.size()) * file_bytes_).c_str(),
                human_bytes(uint64_t(capacity_) * file_bytes_).c_str(), seconds_since(t0));
  log::info(line);
}

void DiskKVTier::remove(PageHash chain) {  // by value: callers pass lru_.front(), which this erases
  const auto it = index_.find(chain);
  if (it == index_.end()) return;
  lru_.erase(it->second.lru);
  index_.erase(it);
  std::error_code ec;
  fs::remove(path_of(chain), ec);
}

std::string DiskKVTier::read_file(const PageHash& chain, std::span<const TokenId> tokens, uint8_t* dst,
                                  std::vector<uint8_t>& header) const {
  const fs::path p = path_of(chain);
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    // Out of descriptors or memory says nothing about the file (it is kept); anything else
    // (gone, no permission) makes it unreadable for good.
    const int e = errno;
    const bool transient = e == EMFILE || e == ENFILE || e == ENOMEM || e == EAGAIN || e == EINTR;
    return std::string(transient ? kTransient : "") + "cannot be opened: " + std::strerror(e);
  }
  // Header, page and checksum in one call, the page straight into `dst`; one byte more shows an
  // overlong file.
  header.resize(header_bytes_ + 9);
  uint8_t* const h = header.data();
  iovec iov[3] = {{h, header_bytes_}, {dst, page_bytes_}, {h + header_bytes_, 9}};
  size_t got = 0;
  for (;;) {
    const ssize_t r = ::preadv(fd, iov, 3, off_t(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += size_t(r);
    advance(iov, size_t(r));  // a short read: on from where it stopped
    if (iov[2].iov_len == 0) break;
  }
  ::close(fd);
  if (got != file_bytes_) return "truncated or overlong";
  if (std::string why = check_header(std::span(h, header_bytes_), &chain); !why.empty()) return why;
  if (page_file_checksum(std::span(dst, page_bytes_), page_file_checksum(std::span(h, header_bytes_))) !=
      get_u64(h + header_bytes_))
    return "checksum mismatch";
  for (size_t i = 0; i < tokens.size(); ++i)
    if (TokenId(get_u32(h + kOffTokens + 4 * i)) != tokens[i]) return "its tokens differ from its index entry";
  return {};
}

bool DiskKVTier::settle_read(const PageHash& chain, const std::string& why, uint64_t& serial) {
  const auto it = index_.find(chain);
  if (it == index_.end()) return false;
  const fs::path p = path_of(chain);
  if (why.starts_with(kTransient)) {  // not the file's fault (too many open files, say): a miss, kept
    log::warn_once("disk tier read", "disk tier: " + p.string() + ": " + why.substr(std::strlen(kTransient)));
    return false;
  }
  if (!why.empty()) {
    lru_.erase(it->second.lru);
    index_.erase(it);
    drop_damaged(p, why);
    return false;
  }
  ::utimensat(AT_FDCWD, p.c_str(), nullptr, 0);  // the modification time is the LRU order a restart finds
  serial = it->second.serial;
  lru_.splice(lru_.end(), lru_, it->second.lru);
  ++read_;
  return true;
}

void DiskKVTier::read_async(std::vector<ReadJob> jobs) {
  size_t n = 0;
  {
    const std::lock_guard lock(mu_);
    for (ReadJob& j : jobs) {
      const auto it = index_.find(j.chain);
      if (it == index_.end() || !std::ranges::equal(it->second.tokens, j.tokens)) {
        missed_.push_back({j.tag, false, 0});
        continue;
      }
      lru_.splice(lru_.end(), lru_, it->second.lru);
      read_queue_.push_back(std::move(j));
      ++n;
    }
  }
  reads_in_flight_ += n;
  if (n > 0) read_cv_.notify_all();
}

std::vector<DiskKVTier::ReadDone> DiskKVTier::take_read(bool wait) {
  std::vector<ReadResult> done;
  {
    std::unique_lock lock(mu_);
    if (wait && read_done_.empty() && missed_.empty() && reads_in_flight_ > 0)
      read_done_cv_.wait(lock, [&] { return !read_done_.empty(); });
    done.swap(read_done_);
  }
  std::vector<ReadDone> out;
  out.swap(missed_);
  std::ranges::sort(done, {}, &ReadResult::start);  // the busy time below is a union of intervals
  for (ReadResult& d : done) {
    --reads_in_flight_;
    ReadDone r{.tag = d.job.tag};
    r.ok = settle_read(d.job.chain, d.why, r.serial);
    out.push_back(r);
    // The time during which any read ran (the readers overlap): the bandwidth's denominator.
    const auto from = std::max(d.start, read_busy_until_);
    if (d.end > from) read_s_ += seconds(d.end - from);
    read_busy_until_ = std::max(read_busy_until_, d.end);
  }
  return out;
}

void DiskKVTier::reader_loop() {
  std::vector<uint8_t> header;
  for (;;) {
    ReadResult r;
    {
      std::unique_lock lock(mu_);
      read_cv_.wait(lock, [&] { return stop_ || !read_queue_.empty(); });
      if (stop_) return;  // reads still queued are dropped: nobody will take them
      r.job = std::move(read_queue_.front());
      read_queue_.pop_front();
    }
    r.start = std::chrono::steady_clock::now();
    try {
      r.why = read_file(r.job.chain, r.job.tokens, r.job.dst, header);
    } catch (const std::exception& e) {  // never out of the thread: a miss
      r.why = std::string(kTransient) + e.what();
    }
    r.end = std::chrono::steady_clock::now();
    {
      const std::lock_guard lock(mu_);
      read_done_.push_back(std::move(r));
    }
    read_done_cv_.notify_all();
  }
}

void DiskKVTier::touch(const PageHash& chain) {
  if (const auto it = index_.find(chain); it != index_.end()) lru_.splice(lru_.end(), lru_, it->second.lru);
}

void DiskKVTier::make_room(size_t pages) {
  while (!lru_.empty() && index_.size() + in_flight_ + pages > capacity_) {
    remove(lru_.front());
    ++evicted_;
  }
}

void DiskKVTier::write(const PageHash& chain, uint64_t serial, std::span<const TokenId> tokens, const uint8_t* src) {
  write_async({WriteJob{chain, serial, std::vector<TokenId>(tokens.begin(), tokens.end()), src, -1}}, {});
  while (in_flight_ > 0) take_written(/*wait=*/true);
}

void DiskKVTier::write_async(std::vector<WriteJob> jobs, std::function<void()> fence) {
  std::vector<WriteJob> fresh;
  for (WriteJob& j : jobs) {
    KVLM_CHECK(j.tokens.size() == size_t(block_size_), "disk tier: a page of the wrong size");
    if (const auto it = index_.find(j.chain); it != index_.end()) {  // here already: only more recent
      lru_.splice(lru_.end(), lru_, it->second.lru);
      if (it->second.serial == 0) it->second.serial = j.serial;
      already_here_.push_back(j.tag);
      continue;
    }
    fresh.push_back(std::move(j));
  }
  make_room(fresh.size());
  // What still does not fit (writes in flight count): the newest go, the others' buffers come
  // back unwritten. (An empty batch still goes: its fence is called once, as promised.)
  const size_t room = capacity_ > index_.size() + in_flight_ ? capacity_ - index_.size() - in_flight_ : 0;
  if (fresh.size() > room) {
    const auto keep_from = fresh.end() - ptrdiff_t(room);
    for (auto it = fresh.begin(); it != keep_from; ++it) already_here_.push_back(it->tag);
    fresh.erase(fresh.begin(), keep_from);
  }
  const size_t n = fresh.size();
  {
    const std::lock_guard lock(mu_);
    queue_.push_back(Batch{std::move(fresh), std::move(fence)});
  }
  in_flight_ += n;
  work_cv_.notify_one();
}

std::vector<int> DiskKVTier::take_written(bool wait) {
  std::vector<Done> done;
  {
    std::unique_lock lock(mu_);
    if (wait && done_.empty() && already_here_.empty() && in_flight_ > 0) done_cv_.wait(lock, [&] { return !done_.empty(); });
    done.swap(done_);
  }
  std::vector<int> tags;
  tags.swap(already_here_);
  for (Done& d : done) {
    --in_flight_;
    tags.push_back(d.tag);
    if (!d.ok) continue;
    if (index_.count(d.chain)) continue;  // written twice (two batches of one page): once is indexed
    Entry e{std::move(d.tokens), d.serial, lru_.insert(lru_.end(), d.chain)};
    index_.emplace(d.chain, std::move(e));
    ++written_;
    write_s_ += d.seconds;
  }
  return tags;
}

void DiskKVTier::writer_loop() {
  std::vector<uint8_t> buf(header_bytes_ + 8);  // the page goes from the caller's buffer
  for (;;) {
    Batch b;
    {
      std::unique_lock lock(mu_);
      work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      b = std::move(queue_.front());
      queue_.pop_front();
    }
    bool fenced = true;
    try {
      if (b.fence) b.fence();
    } catch (const std::exception& e) {  // the copies failed: none of these pages can be trusted
      log::warn(std::string("disk tier: pages not written, their copies failed: ") + e.what());
      fenced = false;
    }
    for (WriteJob& j : b.jobs) {
      const auto t0 = std::chrono::steady_clock::now();
      std::string err = "copies failed";
      if (fenced) {
        try {
          err = write_file(j, buf);
        } catch (const std::exception& e) {  // never out of the thread: the page is just not written
          err = e.what();
        }
      }
      Done d{j.tag, j.chain, j.serial, std::move(j.tokens), err.empty(), seconds_since(t0)};
      if (!err.empty() && fenced) {
        bool first = false;
        {
          const std::lock_guard lock(mu_);
          first = !write_failed_;
          write_failed_ = true;
        }
        if (first)  // once: a full disk would say it for every page
          log::warn("disk tier: cannot write " + path_of(j.chain).string() + " (" + err +
                    "); pages that do not fit are dropped until writes succeed again");
      } else if (err.empty()) {
        const std::lock_guard lock(mu_);
        write_failed_ = false;
      }
      {
        const std::lock_guard lock(mu_);
        done_.push_back(std::move(d));
      }
      done_cv_.notify_all();
    }
  }
}

std::string DiskKVTier::write_file(const WriteJob& job, std::vector<uint8_t>& buf) const {
  uint8_t* h = buf.data();
  std::memset(h, 0, header_bytes_);
  std::memcpy(h, kMagic, 8);
  put_u32(h + kOffVersion, kVersion);
  put_u32(h + kOffBlock, uint32_t(block_size_));
  put_u64(h + kOffPage, page_bytes_);
  put_hash(h + kOffRoot, root_);
  put_hash(h + kOffChain, job.chain);
  for (size_t i = 0; i < job.tokens.size(); ++i) put_u32(h + kOffTokens + 4 * i, uint32_t(job.tokens[i]));
  put_u64(h + header_bytes_,
          page_file_checksum(std::span(job.src, page_bytes_), page_file_checksum(std::span(h, header_bytes_))));
  const fs::path p = path_of(job.chain);
  const fs::path tmp = p.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return std::strerror(errno);
  // Header, the page straight from the host tier's slot, checksum.
  iovec iov[3] = {{h, header_bytes_}, {const_cast<uint8_t*>(job.src), page_bytes_}, {h + header_bytes_, 8}};
  size_t put = 0;
  std::string err;
  while (put < file_bytes_) {
    const ssize_t r = ::pwritev(fd, iov, 3, off_t(put));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      err = r < 0 ? std::strerror(errno) : "short write";
      break;
    }
    put += size_t(r);
    advance(iov, size_t(r));
  }
  if (::close(fd) != 0 && err.empty()) err = std::strerror(errno);
  std::error_code ec;
  if (err.empty()) fs::rename(tmp, p, ec);
  if (err.empty() && ec) err = ec.message();
  if (!err.empty()) fs::remove(tmp, ec);
  return err;
}

}  // namespace kvlm

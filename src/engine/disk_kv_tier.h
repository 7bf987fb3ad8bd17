// The prefix cache's third tier (--kv-offload-dir, --kv-offload-disk-gib): pages the host tier
// (host_kv_tier.h) lets go of are written to local disk in their stored format, one file per
// page, and read back into host memory when a prompt's prefix reaches them — also after the
// server restarts with the same model, weights, KV plan and block size.
//
// Layout: DIR/<root>/ holds this model's pages, <root> being the hex of the chains' root
// (page_hash.h's kv_root: the model, its weight files, the KV plan, the device, the page
// layout), so a different model or plan never reads them and several can share DIR. A file
// <chain>.kvpage is
//   "KVLMPAGE", u32 version, u32 block size, u64 page bytes, 16 B root, 16 B chain,
//   int32 tokens[block size], page bytes (KVCache::save_page's layout), u64 checksum
// all little-endian; the checksum covers everything before it. Files are written under a
// temporary name and renamed, so a crash leaves no half page under a page's name.
//
// At start the directory is scanned: headers are checked (magic, version, root, sizes, the
// name), files that fail are logged and removed, and the rest join the index in the LRU order
// of their modification times (a read sets it, so the order survives a restart). A read checks the whole file again, checksum included:
// a page that fails is logged, removed and treated as a miss — never given to the model.
// A lock file keeps a second server from using the same directory for the same model. The
// pages hold what users' prompts computed: the directory and files are the owner's only (0700,
// 0600).
//
// Writes run on a writer thread of the tier's own (write_async): the caller hands over host
// buffers with a fence for the copies filling them (ModelRunner::page_fence) and takes them back
// once written (take_written). Reads run on reader threads (read_async, take_read), so that the
// scheduler goes on with other requests while a prefix comes from disk. The index changes only
// on the caller's thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <filesystem>
#include <list>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/index_types.h"
#include "engine/page_hash.h"

namespace kvlm {

class DiskKVTier {
 public:
  // `capacity_bytes` of files at most (each page_bytes plus a header); `description` is what
  // `root` hashes, written beside the pages for people reading the directory. Throws
  // kvlm::Error when the directory cannot be made or locked, or holds less than one page.
  DiskKVTier(const std::filesystem::path& dir, uint64_t capacity_bytes, const PageHash& root,
             const std::string& description, size_t page_bytes, int block_size);
  ~DiskKVTier();
  DiskKVTier(const DiskKVTier&) = delete;
  DiskKVTier& operator=(const DiskKVTier&) = delete;

  size_t capacity() const { return capacity_; }
  size_t size() const { return index_.size(); }
  size_t file_bytes() const { return file_bytes_; }
  const std::filesystem::path& directory() const { return dir_; }

  bool contains(const PageHash& chain) const { return index_.count(chain) > 0; }
  // Makes page `chain` the most recently used, if here (a read about to come: room made for
  // writes meanwhile is not taken from it).
  void touch(const PageHash& chain);
  // Pages to read on the tier's reader threads (kReaders of them), each file checked whole
  // and its page put into `dst` (page_bytes); `tag` is the caller's name for dst. The pages
  // become the most recently used at once (room made for writes meanwhile is not taken from
  // them). A page not here, or here with other tokens, is not read and comes back not ok.
  struct ReadJob {
    PageHash chain;
    std::vector<TokenId> tokens;
    uint8_t* dst = nullptr;
    int tag = 0;
  };
  static constexpr int kReaders = 4;
  void read_async(std::vector<ReadJob> jobs);
  // The reads done since the last call. Not ok: a miss (a damaged file is logged and removed).
  // `serial` is the pool serial the page had when written by this process, 0 when by an
  // earlier one. `wait`: blocks until at least one is done when none is and some are in flight.
  struct ReadDone {
    int tag = 0;
    bool ok = false;
    uint64_t serial = 0;
  };
  std::vector<ReadDone> take_read(bool wait = false);
  size_t reads_in_flight() const { return reads_in_flight_; }
  // Writes page `chain` from `src`, replacing the least recently used files when full; a page
  // already here becomes the most recently used. An I/O error is logged and the page skipped.
  // Waits for it and every write in flight (tests; not for a caller of write_async, whose tags it
  // would take).
  void write(const PageHash& chain, uint64_t serial, std::span<const TokenId> tokens, const uint8_t* src);

  // Pages to write on the writer thread: each from `src` (page_bytes), after `fence` returns
  // (the copies that fill them; called once, on the writer thread). Pages already here become
  // the most recently used instead, and their tags are given back at the next take_written.
  // Room is made at once (least recently used files first), so the files stay within capacity.
  struct WriteJob {
    PageHash chain;
    uint64_t serial = 0;
    std::vector<TokenId> tokens;
    const uint8_t* src = nullptr;
    int tag = 0;  // the caller's name for src
  };
  void write_async(std::vector<WriteJob> jobs, std::function<void()> fence);
  // The tags of the jobs done since the last call (written, or failed and logged): their
  // buffers are the caller's again. `wait`: blocks until at least one is done when none is
  // and some are in flight.
  std::vector<int> take_written(bool wait = false);
  size_t writes_in_flight() const { return in_flight_; }

  // Statistics.
  uint64_t pages_written() const { return written_; }
  uint64_t pages_read() const { return read_; }
  uint64_t evictions() const { return evicted_; }
  uint64_t damaged() const { return damaged_; }      // files found damaged or foreign and removed
  uint64_t loaded_at_start() const { return loaded_; }
  double write_seconds() const { return write_s_; }
  double read_seconds() const { return read_s_; }

 private:
  struct Entry {
    std::vector<TokenId> tokens;
    uint64_t serial = 0;
    std::list<PageHash>::iterator lru;
  };
  struct Done {
    int tag;
    PageHash chain;
    uint64_t serial;
    std::vector<TokenId> tokens;
    bool ok;
    double seconds;
  };
  struct Batch {
    std::vector<WriteJob> jobs;
    std::function<void()> fence;
  };
  struct ReadResult {
    ReadJob job;
    std::string why;  // empty: read and good
    std::chrono::steady_clock::time_point start, end;
  };
  void writer_loop();
  void reader_loop();
  void stop_threads();
  // Reads and checks one page file into dst (any thread; touches no index state; `header` is
  // the caller's buffer). Empty when it is good, else why not.
  std::string read_file(const PageHash& chain, std::span<const TokenId> tokens, uint8_t* dst,
                        std::vector<uint8_t>& header) const;
  // After read_file: the index's side of a good or bad read.
  bool settle_read(const PageHash& chain, const std::string& why, uint64_t& serial);
  // Writes one page file (the writer thread; touches no index state). Empty when written, else why not.
  std::string write_file(const WriteJob& job, std::vector<uint8_t>& buf) const;
  void make_room(size_t pages);  // removes least recently used files until `pages` more fit
  std::filesystem::path path_of(const PageHash& chain) const;
  // Empty when the header is a page of this root; else why not.
  std::string check_header(std::span<const uint8_t> header, const PageHash* chain) const;
  void scan();
  void remove(PageHash chain);
  void drop_damaged(const std::filesystem::path& file, const std::string& why);

  std::filesystem::path dir_;
  PageHash root_;
  size_t page_bytes_, header_bytes_, file_bytes_;
  int block_size_;
  size_t capacity_ = 0;
  int lock_fd_ = -1;
  std::unordered_map<PageHash, Entry, PageHashHasher> index_;
  std::list<PageHash> lru_;  // least recently used first
  uint64_t written_ = 0, read_ = 0, evicted_ = 0, damaged_ = 0, loaded_ = 0;
  double write_s_ = 0, read_s_ = 0;
  bool write_failed_ = false;
  size_t in_flight_ = 0;           // jobs handed to the writer and not yet taken back
  std::vector<int> already_here_;  // tags of jobs whose pages were here already
  size_t reads_in_flight_ = 0;     // read jobs handed to the readers and not yet taken back
  std::vector<ReadDone> missed_;   // read jobs refused at read_async
  std::chrono::steady_clock::time_point read_busy_until_;  // read_s_ counts the time any read ran

  std::mutex mu_;  // guards queue_, done_, read_queue_, read_done_, stop_
  std::condition_variable work_cv_, done_cv_, read_cv_, read_done_cv_;
  std::deque<Batch> queue_;
  std::vector<Done> done_;
  std::deque<ReadJob> read_queue_;
  std::vector<ReadResult> read_done_;
  bool stop_ = false;
  std::thread writer_;  // last: started once everything above exists
  std::vector<std::thread> readers_;
};

// The checksum of the page files: a 64-bit hash of `bytes` from `seed` (not cryptographic: it
// catches damage, the names are content hashes already). A file's is that of its page bytes
// seeded with that of its header.
uint64_t page_file_checksum(std::span<const uint8_t> bytes, uint64_t seed = 0);

}  // namespace kvlm

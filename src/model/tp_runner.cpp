#include "model/tp_runner.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

TensorParallelRunner::TensorParallelRunner(std::vector<Communicator*> comms, const Make& make, bool parallel_load,
                                           int first_rank)
    : comms_(std::move(comms)), leader_(first_rank == 0), busy_cores_(comms_.size() > 1 ? 2 * int(comms_.size()) : 0) {
  const int world = int(comms_.size());
  KVLM_CHECK(world >= 1, "a tensor-parallel runner needs a rank");
  ranks_.resize(size_t(world));
  // Loading: a thread per rank (a CUDA rank's thread makes its device current), joined here.
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  auto load = [&](int r) {
    try {
      ranks_[size_t(r)] = make(r);
    } catch (...) {
      errors[size_t(r)] = std::current_exception();
    }
  };
  if (parallel_load && world > 1) {
    std::vector<std::thread> loaders;
    for (int r = 0; r < world; ++r) loaders.emplace_back(load, r);
    for (auto& t : loaders) t.join();
  } else {
    for (int r = 0; r < world; ++r) load(r);
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (int r = 1; r < world; ++r) threads_.emplace_back([this, r] { worker(r); });
}

TensorParallelRunner::~TensorParallelRunner() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void TensorParallelRunner::fail(std::exception_ptr e) {
  {
    std::lock_guard lock(mu_);
    if (!error_) error_ = e;
  }
  for (Communicator* c : comms_) c->abort();  // peers blocked in a collective fail now
}

void TensorParallelRunner::worker(int r) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(ModelRunner&)>* job = nullptr;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    try {
      (*job)(*ranks_[size_t(r)]);
    } catch (...) {
      fail(std::current_exception());
    }
    {
      std::lock_guard lock(mu_);
      --pending_;
    }
    cv_.notify_all();
  }
}

void TensorParallelRunner::run(const std::function<void(ModelRunner&)>& first,
                               const std::function<void(ModelRunner&)>& rest) {
  {
    std::lock_guard lock(mu_);
    if (error_) {
      try {
        std::rethrow_exception(error_);
      } catch (const std::exception& e) {
        throw Error(std::string("the tensor-parallel ranks failed earlier (") + e.what() +
                    "); their KV caches may differ now, so this model cannot run further: restart kvlm");
      }
    }
    job_ = &rest;
    pending_ = int(threads_.size());
    ++generation_;
  }
  cv_.notify_all();
  try {
    first(*ranks_[0]);
  } catch (...) {
    fail(std::current_exception());
  }
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  job_ = nullptr;
  if (error_) std::rethrow_exception(error_);
  lock.unlock();
  remote([&] { remote_->check(); });  // a node that failed during the step fails the step
}

void TensorParallelRunner::remote(const std::function<void()>& send) {
  if (!remote_) return;
  {
    std::lock_guard lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }
  try {
    send();
  } catch (...) {
    fail(std::current_exception());  // the nodes' pools may differ from here on
    throw;
  }
}

void TensorParallelRunner::each_rank(const std::function<void(int, ModelRunner&)>& f) {
  const auto job = [&](ModelRunner& m) {
    int r = 0;
    while (ranks_[size_t(r)].get() != &m) ++r;
    f(r, m);
  };
  run(job, job);
}

std::string TensorParallelRunner::broken() const {
  std::lock_guard lock(mu_);
  if (!error_) return {};
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "a rank failed";
  }
}

size_t TensorParallelRunner::num_parameters() const {
  size_t n = 0;
  for (const auto& r : ranks_) n += r->num_parameters();
  return n;
}

size_t TensorParallelRunner::weight_bytes() const {
  size_t n = 0;
  for (const auto& r : ranks_) n += r->weight_bytes();
  return n;
}

size_t TensorParallelRunner::kv_bytes() const {
  size_t n = 0;
  for (const auto& r : ranks_) n += r->kv_bytes();
  return n;
}

void TensorParallelRunner::allocate_kv(int num_blocks, int block_size, int num_exact_pages) {
  remote([&] { remote_->allocate_kv(num_blocks, block_size, num_exact_pages); });
  const auto job = [&](ModelRunner& m) { m.allocate_kv(num_blocks, block_size, num_exact_pages); };
  run(job, job);
  for (const PageKind kind : {PageKind::Pages, PageKind::Exact}) {
    std::vector<size_t>& offs = kind == PageKind::Pages ? page_offsets_ : exact_offsets_;
    const size_t page = kv_page_bytes(block_size, kind);
    offs.assign(1, 0);
    for (const auto& r : ranks_) offs.push_back(page > 0 ? offs.back() + r->kv_page_bytes(block_size, kind) : 0);
  }
}

size_t TensorParallelRunner::kv_page_bytes(int block_size, PageKind kind) const {
  if (remote_ != nullptr || !leader_) return 0;  // other nodes' parts are out of reach
  size_t n = 0;
  for (const auto& r : ranks_) {
    const size_t b = r->kv_page_bytes(block_size, kind);
    if (b == 0) return 0;
    n += b;
  }
  return n;
}

void TensorParallelRunner::check_page_copies(PageKind kind) const {
  const std::vector<size_t>& offs = offsets(kind);
  KVLM_CHECK(!offs.empty() && offs.back() > 0, "page copies on ranks that cannot copy pages out");
}

size_t TensorParallelRunner::page_offset(const ModelRunner& m, PageKind kind) const {
  const std::vector<size_t>& offs = offsets(kind);
  for (size_t r = 0; r < ranks_.size(); ++r)
    if (ranks_[r].get() == &m) return offs[r];
  KVLM_CHECK(false, "page_offset of a runner that is not a rank");
  return 0;
}

void TensorParallelRunner::save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out, PageKind kind) {
  check_page_copies(kind);
  const auto job = [&](ModelRunner& m) {
    const size_t off = page_offset(m, kind);
    std::vector<uint8_t*> mine(out.begin(), out.end());
    for (uint8_t*& p : mine) p += off;
    m.save_pages(pages, mine, kind);
  };
  run(job, job);
}

void TensorParallelRunner::load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in,
                                      PageKind kind) {
  check_page_copies(kind);
  const auto job = [&](ModelRunner& m) {
    const size_t off = page_offset(m, kind);
    std::vector<const uint8_t*> mine(in.begin(), in.end());
    for (const uint8_t*& p : mine) p += off;
    m.load_pages(pages, mine, kind);
  };
  run(job, job);
}

void TensorParallelRunner::wait_pages() {
  const auto job = [](ModelRunner& m) { m.wait_pages(); };
  run(job, job);
}

std::function<void()> TensorParallelRunner::page_fence() {
  std::vector<std::function<void()>> fences;
  for (const auto& r : ranks_) fences.push_back(r->page_fence());
  return [fences = std::move(fences)] {
    std::exception_ptr first;
    for (const auto& f : fences) {  // every one, so that each rank's fence is released
      try {
        f();
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  };
}

ModelRunner::PageCopyTimes TensorParallelRunner::page_copy_times() {
  PageCopyTimes t;
  for (const auto& r : ranks_) {
    const PageCopyTimes x = r->page_copy_times();
    t.save_seconds = std::max(t.save_seconds, x.save_seconds);
    t.load_seconds = std::max(t.load_seconds, x.load_seconds);
  }
  return t;
}

double TensorParallelRunner::measure_host_to_device_bandwidth() {
  std::vector<double> each(ranks_.size(), 0);
  const auto job = [&](ModelRunner& m) {
    for (size_t r = 0; r < ranks_.size(); ++r)
      if (ranks_[r].get() == &m) each[r] = m.measure_host_to_device_bandwidth();
  };
  run(job, job);
  double sum = 0;
  for (double b : each) sum += b;
  return sum;
}

void TensorParallelRunner::forward(const ForwardBatch& batch, std::span<float> logits) {
  KVLM_CHECK(leader_, "forward on another node's ranks (they follow node 0)");
  remote([&] { remote_->forward(batch); });
  run([&](ModelRunner& m) { m.forward(batch, logits); }, [&](ModelRunner& m) { m.forward_follower(batch); });
}

void TensorParallelRunner::forward_sampled(const ForwardBatch& batch, std::span<const RowSampling> rows,
                                           std::span<TokenId> tokens, std::span<float> host_logits,
                                           const RowMaskFn& mask) {
  KVLM_CHECK(leader_, "forward_sampled on another node's ranks (they follow node 0)");
  remote([&] { remote_->forward(batch); });
  run([&](ModelRunner& m) { m.forward_sampled(batch, rows, tokens, host_logits, mask); },
      [&](ModelRunner& m) { m.forward_follower(batch); });
}

void TensorParallelRunner::copy_blocks(std::span<const PageCopy> copies) {
  remote([&] { remote_->copy_blocks(copies); });
  const auto job = [&](ModelRunner& m) { m.copy_blocks(copies); };
  run(job, job);
}

void TensorParallelRunner::allocate_states(int slots) {
  remote([&] { remote_->allocate_states(slots); });
  const auto job = [&](ModelRunner& m) { m.allocate_states(slots); };
  run(job, job);
}

void TensorParallelRunner::copy_states(std::span<const StateCopy> copies) {
  remote([&] { remote_->copy_states(copies); });
  const auto job = [&](ModelRunner& m) { m.copy_states(copies); };
  run(job, job);
}

void TensorParallelRunner::forward_follower(const ForwardBatch& batch) {
  KVLM_CHECK(!leader_, "forward_follower on node 0's ranks");
  const auto job = [&](ModelRunner& m) { m.forward_follower(batch); };
  run(job, job);
}

}  // namespace kvlm

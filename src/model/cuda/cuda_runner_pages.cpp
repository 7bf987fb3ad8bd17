// Page copies of the CUDA runner (cuda_runner.h): the copy-on-write of a shared prefix page
// (copy_blocks), and the prefix cache's host tier (engine/host_kv_tier.h): pages (or exact
// pages, through a table of their own) packed into a
// device staging buffer by one kernel and moved by one DMA per run of adjacent host buffers to
// pinned host memory, and back the same way, all on the runner's stream and in its order,
// without waiting.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <set>

#include "kv/kv_cache.h"
#include "model/cuda/cuda_runner_impl.h"
#include "ops/cuda/model_ops.h"

namespace kvlm {

void CudaModelRunner::copy_blocks(std::span<const PageCopy> pairs) {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  KVLM_CHECK(m.num_blocks > 0, "copy_blocks before allocate_kv");
  if (pairs.empty()) return;
  std::set<BlockId> srcs, dsts;
  bool chained = false;
  for (const auto& [s, d, es, ed] : pairs) {
    if (es >= 0 && ed >= 0) {  // the exact pages: one async copy per keeping layer and part
      KVLM_CHECK(es < m.num_exact && ed < m.num_exact, "copy_blocks: exact page id out of range");
      for (const CudaKVLayer& L : m.lkv)
        for (uint16_t* pool : {L.exact_k, L.exact_v})
          if (pool)
            KVLM_CUDA_CHECK(cudaMemcpyAsync(reinterpret_cast<uint8_t*>(pool) + size_t(ed) * L.exact_page_bytes,
                                            reinterpret_cast<uint8_t*>(pool) + size_t(es) * L.exact_page_bytes,
                                            L.exact_page_bytes, cudaMemcpyDeviceToDevice, m.stream));
    }
    KVLM_CHECK(s >= 0 && s < m.num_blocks && d >= 0 && d < m.num_blocks, "copy_blocks: page id out of range");
    srcs.insert(s);
    chained |= !dsts.insert(d).second;  // a page written twice: order matters
  }
  for (BlockId d : dsts) chained |= srcs.count(d) > 0;
  const size_t bytes = pairs.size() * 2 * sizeof(BlockId);
  BlockId* host = reinterpret_cast<BlockId*>(m.pairs_host.reserve(bytes));
  for (size_t i = 0; i < pairs.size(); ++i) {
    host[2 * i] = pairs[i].src;
    host[2 * i + 1] = pairs[i].dst;
  }
  if (bytes > m.pairs_dev.bytes()) {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    m.pairs_dev.allocate(std::max(bytes, size_t(4096)), "copy_blocks");
  }
  KVLM_CUDA_CHECK(cudaMemcpyAsync(m.pairs_dev.data(), host, bytes, cudaMemcpyHostToDevice, m.stream));
  const auto* layers = reinterpret_cast<const cuda::KVPagePools*>(m.kv_pools.data());
  const auto* dev_pairs = reinterpret_cast<const BlockId*>(m.pairs_dev.data());
  if (!chained) {
    cuda::copy_kv_pages(layers, int(m.lkv.size()), dev_pairs, int(pairs.size()), m.stream);
  } else {  // the CPU's sequential semantics: one pair after the other
    for (size_t i = 0; i < pairs.size(); ++i) cuda::copy_kv_pages(layers, int(m.lkv.size()), dev_pairs + 2 * i, 1, m.stream);
  }
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // the pinned pairs may be reused next call
}

size_t CudaModelRunner::kv_page_bytes(int block_size, PageKind kind) const {
  return kind == PageKind::Exact ? kv_exact_page_bytes(*impl_->plan, block_size)
                                 : ::kvlm::kv_page_bytes(*impl_->plan, block_size);
}

// The page table that pack_kv_pages reads for `kind` (the pool's, or the exact pages'), its
// layers and the ids it takes.
CudaModelRunner::Impl::PageTable CudaModelRunner::Impl::page_table(PageKind kind) const {
  if (kind == PageKind::Exact)
    return {reinterpret_cast<const cuda::KVPagePools*>(exact_pools.data()), num_exact_layers, num_exact};
  return {reinterpret_cast<const cuda::KVPagePools*>(kv_pools.data()), int(lkv.size()), num_blocks};
}

HostBytes CudaModelRunner::allocate_host(size_t bytes) {
  const DeviceScope dev(impl_->device);
  void* p = nullptr;
  // Portable: pinned for every device's context, so that tensor-parallel ranks on other GPUs
  // copy their parts of a page at the bus's speed too.
  if (const cudaError_t e = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocPortable); e != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error("cannot pin " + std::to_string(bytes >> 20) + " MiB of host memory for the KV cache's host tier (" +
                cudaGetErrorString(e) + "); lower --kv-offload-gib");
  }
  return HostBytes(static_cast<uint8_t*>(p), [](uint8_t* q) { cudaFreeHost(q); });
}

// The staging buffer the packed pages pass through (kPageStagingBytes, or one page if larger;
// the memory plan sets it aside): how many pages it holds per pass.
int CudaModelRunner::Impl::staging_pages(size_t page_bytes) {
  const size_t want = std::max(kPageStagingBytes, page_bytes);
  if (page_staging.bytes() < page_bytes) {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(stream));  // an older, smaller buffer may still be in use
    page_staging.allocate(want, "the host tier's staging buffer");
  }
  return int(std::min<size_t>(page_staging.bytes() / page_bytes, size_t(cuda::kMaxPackedPages)));
}

cudaEvent_t CudaModelRunner::Impl::take_event() {
  if (!spare_events.empty()) {
    const cudaEvent_t e = spare_events.back();
    spare_events.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  KVLM_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}

// The copies complete in stream order: the oldest first.
void CudaModelRunner::Impl::harvest_copies(ModelRunner::PageCopyTimes& t) {
  while (!copy_timings.empty()) {
    const CopyTiming c = copy_timings.front();
    const cudaError_t q = cudaEventQuery(c.end);
    if (q == cudaErrorNotReady) return;
    KVLM_CUDA_CHECK(q);
    float ms = 0;
    KVLM_CUDA_CHECK(cudaEventElapsedTime(&ms, c.start, c.end));
    (c.load ? t.load_seconds : t.save_seconds) += double(ms) / 1e3;
    spare_events.push_back(c.start);
    spare_events.push_back(c.end);
    copy_timings.pop_front();
  }
}

namespace {
// Host buffers evenly spaced in memory move as one DMA: consecutive ones (tier slots taken in
// order) as one plain copy, ones a constant stride apart (a tensor-parallel rank's part of
// consecutive slots) as one 2D copy. f(first index, pages, stride) for each run, in order.
// Strides stay within kMaxRunStride pages (a rank's parts under tensor parallelism of up to 16
// ranks; far below the copies' pitch limit, 2^31 - 1 bytes).
constexpr size_t kMaxRunStride = 16;
template <typename P, typename F>
void for_each_run(std::span<P* const> bufs, size_t page_bytes, F&& f) {
  const size_t max_stride = std::min(kMaxRunStride * page_bytes, size_t(INT32_MAX));
  for (size_t i = 0; i < bufs.size();) {
    size_t n = 1, stride = page_bytes;
    if (i + 1 < bufs.size() && bufs[i + 1] > bufs[i] && size_t(bufs[i + 1] - bufs[i]) >= page_bytes &&
        size_t(bufs[i + 1] - bufs[i]) <= max_stride) {
      stride = size_t(bufs[i + 1] - bufs[i]);
      while (i + n < bufs.size() && bufs[i + n] > bufs[i + n - 1] && size_t(bufs[i + n] - bufs[i + n - 1]) == stride) ++n;
    }
    f(i, n, stride);
    i += n;
  }
}
}  // namespace

void CudaModelRunner::save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out, PageKind kind) {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  KVLM_CHECK(m.num_blocks > 0, "save_pages before allocate_kv");
  KVLM_CHECK(out.size() == pages.size(), "save_pages: one buffer per page");
  const Impl::PageTable t = m.page_table(kind);
  for (BlockId id : pages) KVLM_CHECK(id >= 0 && id < t.num_ids, "save_pages: page id out of range");
  const size_t pb = kv_page_bytes(m.block_size, kind);
  KVLM_CHECK(pb > 0, "save_pages: no pages of that kind");
  const int per = m.staging_pages(pb);
  m.timed_copies(page_times_, false, [&] {
    for (size_t b = 0; b < pages.size(); b += size_t(per)) {
      const size_t n = std::min(pages.size() - b, size_t(per));
      cuda::pack_kv_pages(t.layers, t.num_layers, pages.data() + b, int(n), m.page_staging.data(), pb, m.stream);
      for_each_run(out.subspan(b, n), pb, [&](size_t i, size_t count, size_t stride) {
        const uint8_t* const src = m.page_staging.data() + i * pb;
        if (stride == pb || count == 1)
          KVLM_CUDA_CHECK(cudaMemcpyAsync(out[b + i], src, count * pb, cudaMemcpyDeviceToHost, m.stream));
        else
          KVLM_CUDA_CHECK(cudaMemcpy2DAsync(out[b + i], stride, src, pb, pb, count, cudaMemcpyDeviceToHost, m.stream));
      });
    }
  });
}

void CudaModelRunner::load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in, PageKind kind) {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  KVLM_CHECK(m.num_blocks > 0, "load_pages before allocate_kv");
  KVLM_CHECK(in.size() == pages.size(), "load_pages: one buffer per page");
  const Impl::PageTable t = m.page_table(kind);
  for (BlockId id : pages) KVLM_CHECK(id >= 0 && id < t.num_ids, "load_pages: page id out of range");
  KVLM_CHECK(std::set<BlockId>(pages.begin(), pages.end()).size() == pages.size(), "load_pages: a page given twice");
  const size_t pb = kv_page_bytes(m.block_size, kind);
  KVLM_CHECK(pb > 0, "load_pages: no pages of that kind");
  const int per = m.staging_pages(pb);
  m.timed_copies(page_times_, true, [&] {
    for (size_t b = 0; b < pages.size(); b += size_t(per)) {
      const size_t n = std::min(pages.size() - b, size_t(per));
      for_each_run(in.subspan(b, n), pb, [&](size_t i, size_t count, size_t stride) {
        uint8_t* const dst = m.page_staging.data() + i * pb;
        if (stride == pb || count == 1)
          KVLM_CUDA_CHECK(cudaMemcpyAsync(dst, in[b + i], count * pb, cudaMemcpyHostToDevice, m.stream));
        else
          KVLM_CUDA_CHECK(cudaMemcpy2DAsync(dst, pb, in[b + i], stride, pb, count, cudaMemcpyHostToDevice, m.stream));
      });
      cuda::unpack_kv_pages(t.layers, t.num_layers, pages.data() + b, int(n), m.page_staging.data(), pb, m.stream);
    }
  });
}

void CudaModelRunner::wait_pages() {
  const DeviceScope dev(impl_->device);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

std::function<void()> CudaModelRunner::page_fence() {
  const int device = impl_->device;
  const DeviceScope dev(device);
  cudaEvent_t e = nullptr;
  KVLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  KVLM_CUDA_CHECK(cudaEventRecord(e, impl_->stream));
  // Called once, on the disk tier's writer thread: the event is its own (not the runner's pool).
  return [device, e] {
    const DeviceScope scope(device);
    const cudaError_t r = cudaEventSynchronize(e);
    cudaEventDestroy(e);
    KVLM_CUDA_CHECK(r);
  };
}

ModelRunner::PageCopyTimes CudaModelRunner::page_copy_times() {
  const DeviceScope dev(impl_->device);
  impl_->harvest_copies(page_times_);
  return page_times_;
}

// Pinned host memory to the staging buffer, 64 MiB at a time, after the work already issued:
// the best of 5 rounds of 4 copies.
double CudaModelRunner::measure_host_to_device_bandwidth() {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  const size_t bytes = kPageStagingBytes;
  m.staging_pages(bytes);  // the staging buffer, at least `bytes`
  HostBytes host = allocate_host(bytes);
  std::memset(host.get(), 0, bytes);
  const cudaEvent_t a = m.take_event(), b = m.take_event();
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    KVLM_CUDA_CHECK(cudaEventRecord(a, m.stream));
    for (int i = 0; i < 4; ++i)
      KVLM_CUDA_CHECK(cudaMemcpyAsync(m.page_staging.data(), host.get(), bytes, cudaMemcpyHostToDevice, m.stream));
    KVLM_CUDA_CHECK(cudaEventRecord(b, m.stream));
    KVLM_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    KVLM_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (ms > 0) best = std::max(best, 4.0 * double(bytes) / (double(ms) / 1e3));
  }
  m.spare_events.push_back(a);
  m.spare_events.push_back(b);
  return best;
}

}  // namespace kvlm

// What a CUDA step hands back (cuda_runner.h): the logit rows' logits (forward), a follower
// rank's part (forward_follower), tokens sampled on the GPU with the rows that come back to the
// host (forward_sampled, with grammar masks gathered while the forward pass runs), greedy ids,
// and the DFlash drafter's passes. The step itself is enqueued by cuda_runner.cpp.
#include "core/host_threads.h"
#include "model/cuda/cuda_runner_impl.h"

namespace kvlm {

void CudaModelRunner::forward(const ForwardBatch& b, std::span<float> logits) {
  const size_t R = b.logit_rows.size(), V = size_t(output_width());
  KVLM_CHECK(logits.size() == R * V, "logits buffer size");
  const DeviceScope on(impl_->device);
  const float* dev = enqueue(b);
  std::vector<int32_t> rows(R);
  for (size_t i = 0; i < R; ++i) rows[i] = int32_t(i);
  copy_logit_rows(dev, rows, logits);
}

void CudaModelRunner::forward_follower(const ForwardBatch& b) {
  KVLM_CHECK(impl_->comm->rank() > 0, "forward_follower on a runner that is not a tensor-parallel rank other than 0");
  const DeviceScope on(impl_->device);
  enqueue(b);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

void CudaModelRunner::copy_logit_rows(const float* dev, std::span<const int32_t> rows, std::span<float> out,
                                      std::span<const int32_t> slots) {
  Impl& m = *impl_;
  KVLM_CHECK(m.comm->rank() == 0, "only tensor-parallel rank 0 forms logits; the other ranks run forward_follower");
  const size_t R = rows.size(), V = size_t(output_width());  // logits, or a pooling step's hidden states
  KVLM_CHECK(slots.empty() ? out.size() == R * V : slots.size() == R, "logits buffer size");
  for (const int32_t slot : slots) KVLM_CHECK(slot >= 0 && (size_t(slot) + 1) * V <= out.size(), "logits slot out of range");
  if (R == 0) {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    return;
  }
  // Device -> pinned staging -> the caller's buffer, in chunks of rows: the copy of chunk c
  // into the caller's (pageable) memory, spread over the host's cores, overlaps the DMA of
  // chunk c + 1 (64 rows of a 152k vocabulary are 39 MB: a single-threaded copy after one
  // big DMA took ~5 ms). Consecutive rows go in one DMA.
  const size_t bytes = R * V * sizeof(float);
  auto* staging = reinterpret_cast<float*>(m.logits_host.reserve(bytes));
  const size_t rows_per_chunk = std::max<size_t>(1, (size_t(4) << 20) / (V * sizeof(float)));
  const size_t chunks = (R + rows_per_chunk - 1) / rows_per_chunk;
  while (m.copy_events.size() < chunks) {
    cudaEvent_t e = nullptr;
    KVLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.copy_events.push_back(e);
  }
  for (size_t c = 0; c < chunks; ++c) {
    const size_t r0 = c * rows_per_chunk, r1 = std::min(R, r0 + rows_per_chunk);
    for (size_t i = r0; i < r1;) {
      size_t j = i + 1;
      while (j < r1 && rows[j] == rows[j - 1] + 1) ++j;
      KVLM_CUDA_CHECK(cudaMemcpyAsync(staging + i * V, dev + size_t(rows[i]) * V, (j - i) * V * sizeof(float),
                                      cudaMemcpyDeviceToHost, m.stream));
      i = j;
    }
    KVLM_CUDA_CHECK(cudaEventRecord(m.copy_events[c], m.stream));
  }
  for (size_t c = 0; c < chunks; ++c) {
    KVLM_CUDA_CHECK(cudaEventSynchronize(m.copy_events[c]));
    if (!slots.empty()) {  // rows to scattered slots, one row per piece
      const auto r0 = int64_t(c * rows_per_chunk), r1 = int64_t(std::min(R, (c + 1) * rows_per_chunk));
#pragma omp parallel for schedule(static) num_threads(host_threads::team()) if (r1 - r0 > 1)
      for (int64_t i = r0; i < r1; ++i)
        std::memcpy(out.data() + size_t(slots[size_t(i)]) * V, staging + size_t(i) * V, V * sizeof(float));
      continue;
    }
    const size_t r0 = c * rows_per_chunk, n = (std::min(R, r0 + rows_per_chunk) - r0) * V;
    const float* src = staging + r0 * V;
    float* dst = out.data() + r0 * V;
    constexpr size_t kPiece = size_t(1) << 16;  // floats per parallel piece (256 KB)
    const int64_t pieces = int64_t((n + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(static) num_threads(host_threads::team()) if (pieces > 1)
    for (int64_t i = 0; i < pieces; ++i) {
      const size_t o = size_t(i) * kPiece;
      std::memcpy(dst + o, src + o, std::min(kPiece, n - o) * sizeof(float));
    }
  }
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

void CudaModelRunner::forward_sampled(const ForwardBatch& b, std::span<const RowSampling> rows,
                                      std::span<TokenId> tokens, std::span<float> host_logits, const RowMaskFn& mask) {
  KVLM_CHECK(impl_->comm->rank() == 0, "only tensor-parallel rank 0 samples; the other ranks run forward_follower");
  Impl& m = *impl_;
  const size_t R = b.logit_rows.size(), V = size_t(cfg_.vocab_size), W = size_t(cuda::mask_words(int(V)));
  KVLM_CHECK(rows.size() == R && tokens.size() == R, "forward_sampled: one RowSampling and one token per logit row");
  std::vector<int32_t> slot(R, -1), masked_rows;  // each row's host slot (model_runner.h), the masked rows
  int32_t slots = 0;
  size_t on_device = 0;
  for (size_t i = 0; i < R; ++i) {
    KVLM_CHECK(rows[i].on_device || !rows[i].masked, "forward_sampled: a masked row must be sampled by the runner");
    KVLM_CHECK(!rows[i].on_device || !rows[i].params.has_penalties(), "forward_sampled: penalties are applied on the host");
    if (!rows[i].on_device || rows[i].masked) slot[i] = slots++;
    if (rows[i].masked) masked_rows.push_back(int32_t(i));
    on_device += rows[i].on_device;
  }
  KVLM_CHECK(host_logits.size() == size_t(slots) * V, "forward_sampled: host_logits must hold a slot per host or masked row");
  const DeviceScope on(m.device);
  const float* dev = enqueue(b);
  std::vector<bool> late(R, false);  // masked rows whose mask did not come in time
  TokenId* ids_host = nullptr;
  if (on_device > 0) {
    // Parameters (and the rows' masks) up, the sampling kernel, token ids down: all queued
    // before the host rows' copy, whose final synchronization covers them.
    const size_t param_bytes = R * (sizeof(cuda::SampleRowParams) + sizeof(TokenId));
    uint8_t* pinned = m.sample_host.reserve(param_bytes + masked_rows.size() * W * sizeof(uint64_t));
    auto* params = reinterpret_cast<cuda::SampleRowParams*>(pinned);
    ids_host = reinterpret_cast<TokenId*>(pinned + R * sizeof(cuda::SampleRowParams));
    auto* mask_words = reinterpret_cast<uint64_t*>(pinned + param_bytes);  // 8-byte aligned: params are
    for (size_t i = 0; i < R; ++i) {
      const GumbelParams g = gumbel_params(rows[i].params);
      params[i] = cuda::SampleRowParams{.inv_temperature = g.inv_temperature, .top_k = g.top_k, .top_p = g.top_p,
                                        .min_p_offset = g.min_p_offset, .seed = rows[i].seed,
                                        .counter = rows[i].counter, .skip = rows[i].on_device ? 0 : 1};
    }
    // The masks are gathered while the forward pass runs (a grammar's mask is computed on a
    // host thread from the previous token); a row whose mask is not ready when the pass ends
    // has its logits copied to the host instead.
    int32_t num_masks = 0;
    if (!masked_rows.empty()) {
      KVLM_CUDA_CHECK(cudaEventRecord(m.forward_done, m.stream));
      std::vector<int32_t> pending = masked_rows;
      for (;;) {
        std::erase_if(pending, [&](int32_t i) {
          std::span<uint64_t> words(mask_words + size_t(num_masks) * W, W);
          std::ranges::fill(words, 0);
          if (!mask || !mask(size_t(i), words)) return false;
          params[size_t(i)].mask_row = num_masks++;
          return true;
        });
        if (pending.empty()) break;
        const cudaError_t q = cudaEventQuery(m.forward_done);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) KVLM_CUDA_CHECK(q);
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      for (const int32_t i : pending) {
        late[size_t(i)] = true;
        params[size_t(i)].skip = 1;  // its logits go to the host
      }
      if (num_masks > 0) {
        const size_t bytes = size_t(num_masks) * W * sizeof(uint64_t);
        if (bytes > m.masks.bytes()) {
          KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // the previous step's sampling may read it
          m.masks.allocate(std::max(bytes, 2 * m.masks.bytes()), "grammar masks");
        }
        KVLM_CUDA_CHECK(cudaMemcpyAsync(m.masks.data(), mask_words, bytes, cudaMemcpyHostToDevice, m.stream));
      }
    }
    KVLM_CUDA_CHECK(cudaMemcpyAsync(m.sample, params, R * sizeof(cuda::SampleRowParams), cudaMemcpyHostToDevice, m.stream));
    cuda::sample_rows(dev, int(R), int(V), m.sample, reinterpret_cast<const uint64_t*>(m.masks.data()), m.ids,
                      m.stream);
    KVLM_CUDA_CHECK(cudaMemcpyAsync(ids_host, m.ids, R * sizeof(TokenId), cudaMemcpyDeviceToHost, m.stream));
  }
  // The rows whose logits come back (host rows, late masks), in row order = slot order.
  std::vector<int32_t> copy_rows, copy_slots;
  for (size_t i = 0; i < R; ++i)
    if (!rows[i].on_device || late[i]) {
      copy_rows.push_back(int32_t(i));
      copy_slots.push_back(slot[i]);
    }
  // The leading slots (no masked row sampled on the GPU before a copied row): one contiguous copy.
  const bool leading = copy_slots.empty() || copy_slots.back() == int32_t(copy_slots.size()) - 1;
  if (leading) copy_logit_rows(dev, copy_rows, host_logits.first(copy_rows.size() * V));
  else copy_logit_rows(dev, copy_rows, host_logits, copy_slots);
  // (copy_logit_rows ends with a stream synchronization: the sampled ids are here too)
  for (size_t i = 0; i < R; ++i)
    if (rows[i].on_device) tokens[i] = late[i] ? TokenId(-1) : ids_host[i];  // -1: sampled on the host
}

void CudaModelRunner::forward_greedy(const ForwardBatch& b, std::span<TokenId> tokens) {
  Impl& m = *impl_;
  const int R = int(b.logit_rows.size());
  KVLM_CHECK(tokens.size() == size_t(R), "one token per logit row");
  const DeviceScope on(m.device);
  argmax_to_host(enqueue(b), tokens);
}

void CudaModelRunner::argmax_to_host(const float* dev, std::span<TokenId> tokens) {
  Impl& m = *impl_;
  KVLM_CHECK(m.comm->rank() == 0, "only tensor-parallel rank 0 forms logits; the other ranks run forward_follower");
  const int R = int(tokens.size());
  if (R > 0) {
    cuda::argmax_rows(dev, R, cfg_.vocab_size, m.ids, m.stream);
    auto* host = reinterpret_cast<TokenId*>(m.logits_host.reserve(size_t(R) * sizeof(TokenId)));
    KVLM_CUDA_CHECK(cudaMemcpyAsync(host, m.ids, size_t(R) * sizeof(TokenId), cudaMemcpyDeviceToHost, m.stream));
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    std::copy_n(host, R, tokens.begin());
  } else {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  }
}

bool CudaModelRunner::has_drafter() const { return impl_->draft_def != nullptr; }

void CudaModelRunner::draft(const ForwardBatch& b, std::span<float> logits) {
  KVLM_CHECK(has_drafter(), "draft() without a drafter");
  const size_t R = b.logit_rows.size(), V = size_t(cfg_.vocab_size);
  KVLM_CHECK(logits.size() == R * V, "logits buffer size");
  const DeviceScope on(impl_->device);
  const float* dev = enqueue(b, /*draft=*/true);
  std::vector<int32_t> rows(R);
  for (size_t i = 0; i < R; ++i) rows[i] = int32_t(i);
  copy_logit_rows(dev, rows, logits);
}

void CudaModelRunner::draft_greedy(const ForwardBatch& b, std::span<TokenId> tokens) {
  Impl& m = *impl_;
  KVLM_CHECK(has_drafter(), "draft_greedy() without a drafter");
  const int R = int(b.logit_rows.size());
  KVLM_CHECK(tokens.size() == size_t(R), "one token per logit row");
  const DeviceScope on(m.device);
  argmax_to_host(enqueue(b, /*draft=*/true), tokens);
}

}  // namespace kvlm

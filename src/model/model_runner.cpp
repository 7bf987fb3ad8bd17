#include "model/model_runner.h"

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace kvlm {

void ModelRunner::forward_sampled(const ForwardBatch& batch, std::span<const RowSampling> rows,
                                  std::span<TokenId> tokens, std::span<float> host_logits, const RowMaskFn& mask) {
  const size_t r = batch.logit_rows.size(), v = size_t(config().vocab_size);
  KVLM_CHECK(rows.size() == r && tokens.size() == r, "forward_sampled: one RowSampling and one token per logit row");
  const size_t slots = size_t(std::ranges::count_if(rows, [](const RowSampling& x) { return !x.on_device || x.masked; }));
  KVLM_CHECK(host_logits.size() == slots * v, "forward_sampled: host_logits must hold a slot per host or masked row");
  std::vector<float> all(r * v);
  forward(batch, all);
  std::vector<uint64_t> words((v + 63) / 64);
  std::vector<float> masked;
  size_t h = 0;
  for (size_t i = 0; i < r; ++i) {
    const std::span<const float> row = std::span<const float>(all).subspan(i * v, v);
    KVLM_CHECK(rows[i].on_device || !rows[i].masked, "forward_sampled: a masked row must be sampled by the runner");
    if (rows[i].masked) {
      std::ranges::fill(words, 0);
      if (mask && mask(i, words)) {
        masked.assign(row.begin(), row.end());
        apply_token_mask(masked, words);
        tokens[i] = sample_gumbel(masked, rows[i].params, rows[i].seed, rows[i].counter);
      } else {
        tokens[i] = -1;
        std::ranges::copy(row, host_logits.begin() + ptrdiff_t(h * v));
      }
      ++h;
    } else if (rows[i].on_device) {
      tokens[i] = sample_gumbel(row, rows[i].params, rows[i].seed, rows[i].counter);
    } else {
      std::ranges::copy(row, host_logits.begin() + ptrdiff_t(h * v));
      ++h;
    }
  }
}

void ModelRunner::forward_follower(const ForwardBatch&) {
  throw Error("forward_follower on a runner that is not a tensor-parallel rank");
}

void ModelRunner::kv_plan_changed() {
  throw Error("this model runner cannot change its KV plan after loading (the CPU and CUDA runners of one rank can)");
}

HostBytes ModelRunner::allocate_host(size_t bytes) {
  return HostBytes(new uint8_t[bytes], [](uint8_t* p) { delete[] p; });
}

void ModelRunner::save_pages(std::span<const BlockId>, std::span<uint8_t* const>, PageKind) {
  throw Error("this model runner cannot copy its KV pages to host memory (--kv-offload-gib)");
}

void ModelRunner::load_pages(std::span<const BlockId>, std::span<const uint8_t* const>, PageKind) {
  throw Error("this model runner cannot copy KV pages from host memory (--kv-offload-gib)");
}

void ModelRunner::copy_states(std::span<const StateCopy> copies) {
  KVLM_CHECK(copies.empty(), "copy_states on a runner without recurrent states");
}

void ModelRunner::draft(const ForwardBatch&, std::span<float>) {
  throw Error("this model runner has no drafter loaded");
}

void ModelRunner::draft_greedy(const ForwardBatch& blocks, std::span<TokenId> tokens) {
  const size_t r = blocks.logit_rows.size(), v = size_t(config().vocab_size);
  KVLM_CHECK(tokens.size() == r, "draft_greedy: one token per logit row");
  std::vector<float> all(r * v);
  draft(blocks, all);
  for (size_t i = 0; i < r; ++i) {
    const auto row = std::span<const float>(all).subspan(i * v, v);
    tokens[i] = TokenId(std::ranges::max_element(row) - row.begin());
  }
}

}  // namespace kvlm

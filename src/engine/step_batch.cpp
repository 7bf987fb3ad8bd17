#include "engine/step_batch.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

void ExactLayout::begin(std::span<const int32_t> exact_map, int block_size) {
  map_ = exact_map;
  block_size_ = block_size;
  slots_.clear();
  tables_.clear();
}

void ExactLayout::add_token(BlockId page, int offset) {
  if (map_.empty()) return;
  const int32_t e = map_[size_t(page)];
  slots_.push_back(e < 0 ? -1 : SlotId(e) * block_size_ + offset);
}

void ExactLayout::add_sequence(std::span<const BlockId> pages) {
  for (BlockId b : map_.empty() ? std::span<const BlockId>{} : pages) tables_.push_back(map_[size_t(b)]);
}

void ExactLayout::bind(std::span<AttnSeq> seqs) const {
  if (map_.empty()) return;
  size_t at = 0;
  for (AttnSeq& a : seqs) {
    a.exact_table = std::span<const BlockId>(tables_).subspan(at, a.block_table.size());
    at += a.block_table.size();
  }
}

void StepBatch::build(std::span<Sequence* const> seqs, int block_size, bool device_sampling, bool has_eos,
                      size_t vocab, std::span<const int32_t> exact_map) {
  device_sampling_ = device_sampling;
  vocab_ = vocab;
  const int bs = block_size;
  int num_host_rows = 0;
  tokens_.clear();
  positions_.clear();
  slots_.clear();
  exact_.begin(exact_map, bs);
  attn_.clear();
  logit_rows_.clear();
  row_sampling_.clear();
  row_owner_.clear();
  host_row_.clear();
  for (Sequence* s : seqs) {
    const int q0 = int(tokens_.size());
    const int begin = s->num_computed, end = begin + s->scheduled;
    for (int p = begin; p < end; ++p) {
      tokens_.push_back(s->token_at(p));
      positions_.push_back(Position(p));
      slots_.push_back(SlotId(s->pages[size_t(p / bs)]) * bs + p % bs);
      exact_.add_token(s->pages[size_t(p / bs)], p % bs);
    }
    attn_.push_back(AttnSeq{
        .q_begin = q0, .q_len = s->scheduled, .kv_len = end, .state_slot = s->state_slot, .block_table = s->pages});
    exact_.add_sequence(s->pages);
    // Row p of the step follows token p: prompt rows first, then the rows that draw tokens.
    s->logit_row = int(logit_rows_.size());
    s->prompt_row0 = std::max(begin, s->prompt_rows_begin());
    const int prompt_end = std::min(end, s->prompt_rows_end());
    s->prompt_rows = std::max(0, prompt_end - s->prompt_row0);
    for (int p = s->prompt_row0; p < prompt_end; ++p) logit_rows_.push_back(q0 + p - begin);
    s->sample_rows = 0;
    s->sample_row0 = s->prompt_rows;
    if (end == int(s->tokens.size() + s->draft.size()) && s->req.max_tokens > 0) {
      s->sample_rows = 1 + int(s->draft.size());
      const int first = end - s->sample_rows;
      for (int p = first; p < end; ++p) {
        if (p < prompt_end) {  // the last prompt row also draws the first token
          s->sample_row0 = std::min(s->sample_row0, p - s->prompt_row0);
          continue;
        }
        logit_rows_.push_back(q0 + p - begin);
      }
    }
    s->logit_count = int(logit_rows_.size()) - s->logit_row;
    if (s->logit_count == 0) s->logit_row = -1;
    // The rows that draw tokens may be sampled by the runner unless their logits are needed
    // here (a prompt row shares them, or penalties, logprobs, logit bias); a grammar's or
    // min_tokens's masking goes with the row as its mask.
    s->device_sampled = device_sampling && s->sample_rows > 0 && s->prompt_rows == 0 && s->device_samplable();
    for (int r = 0; r < s->logit_count; ++r) {
      RowSampling rs;
      const int output_index = s->num_output() + r;
      if (s->device_sampled) {
        rs = RowSampling{.on_device = true, .masked = s->needs_mask(output_index, has_eos), .params = s->req.sampling,
                         .seed = s->req.seed, .counter = uint64_t(output_index)};
      }
      // A masked row keeps a host slot: its logits come back if its mask is late.
      host_row_.push_back(rs.on_device && !rs.masked ? -1 : num_host_rows++);
      row_sampling_.push_back(rs);
      row_owner_.push_back({s, output_index});
    }
  }
  exact_.bind(attn_);
  logits_.resize(size_t(num_host_rows) * vocab);
  device_tokens_.assign(logit_rows_.size(), -1);
}

void StepBatch::run(ModelRunner& runner, const MaskFn& mask) {
  const ForwardBatch fb{.tokens = tokens_, .positions = positions_, .slots = slots_, .exact_slots = exact_.slots(),
                        .seqs = attn_, .logit_rows = logit_rows_};
  if (!device_sampling_) {
    runner.forward(fb, logits_);
    return;
  }
  const RowMaskFn row_mask = [&](size_t row, std::span<uint64_t> words) {
    const auto& [s, output_index] = row_owner_[row];
    return mask && mask(*s, output_index, words);
  };
  runner.forward_sampled(fb, row_sampling_, device_tokens_, logits_, row_mask);
}

std::span<const float> StepBatch::logits(const Sequence& s, int r, int n) const {
  KVLM_CHECK(s.logit_row >= 0 && r >= 0 && r + n <= s.logit_count, "logit row out of range");
  const int h = host_row_[size_t(s.logit_row + r)];
  KVLM_CHECK(h >= 0, "the logits of a row sampled by the runner were used");
  KVLM_CHECK(n == 1 || host_row_[size_t(s.logit_row + r + n - 1)] == h + n - 1, "host logit rows are not consecutive");
  return std::span<const float>(logits_).subspan(size_t(h) * vocab_, size_t(n) * vocab_);
}

TokenId StepBatch::device_token(const Sequence& s, int r) const {
  KVLM_CHECK(s.logit_row >= 0 && r >= 0 && r < s.logit_count, "logit row out of range");
  return device_tokens_[size_t(s.logit_row + r)];
}

int StepBatch::late_masks() const {
  int n = 0;
  for (size_t i = 0; i < row_sampling_.size(); ++i) n += row_sampling_[i].masked && device_tokens_[i] < 0;
  return n;
}

}  // namespace kvlm

#include "engine/sequence.h"

#include <algorithm>

#include "core/error.h"

namespace kvlm {

namespace {
int blocks_for(int tokens, int block_size) { return (tokens + block_size - 1) / block_size; }
}  // namespace

SequenceRunner::SequenceRunner(Engine& engine, int capacity)
    : engine_(engine),
      capacity_(capacity),
      allocator_(std::max(1, blocks_for(capacity, engine.block_size()))) {
  const int max_len = engine.config().max_position_embeddings;
  if (capacity > max_len)
    throw Error("this request needs " + std::to_string(capacity) + " tokens of context but the model supports " +
                std::to_string(max_len) + " (max_position_embeddings); shorten the prompt or lower --max-tokens");
  engine.model().allocate_kv(allocator_.num_blocks(), engine.block_size());
}

std::vector<float> SequenceRunner::append(std::span<const TokenId> tokens, bool all_logits) {
  const int n = int(tokens.size());
  KVLM_CHECK(n > 0, "append of no tokens");
  if (length_ + n > capacity_)
    throw Error("sequence would grow to " + std::to_string(length_ + n) + " tokens, past its capacity of " +
                std::to_string(capacity_));
  const int bs = engine_.block_size();
  while (int(blocks_.size()) * bs < length_ + n) {
    auto b = allocator_.allocate();
    KVLM_CHECK(b.has_value(), "KV pool exhausted below capacity");
    blocks_.push_back(*b);
  }
  std::vector<Position> pos(static_cast<size_t>(n));
  std::vector<SlotId> slots(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const int p = length_ + i;
    pos[size_t(i)] = Position(p);
    slots[size_t(i)] = SlotId(blocks_[size_t(p / bs)]) * bs + p % bs;
  }
  length_ += n;
  const AttnSeq seq{.q_begin = 0, .q_len = n, .kv_len = length_, .block_table = blocks_};
  std::vector<int32_t> rows;
  if (all_logits)
    for (int i = 0; i < n; ++i) rows.push_back(i);
  else
    rows.push_back(n - 1);
  const int vocab = engine_.config().vocab_size;
  std::vector<float> logits(rows.size() * size_t(vocab));
  engine_.model().forward(ForwardBatch{.tokens = tokens, .positions = pos, .slots = slots, .seqs = {&seq, 1}, .logit_rows = rows},
                          logits);
  return logits;
}

}  // namespace kvlm

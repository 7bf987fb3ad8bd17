// One sequence running through a model: the building block of `kvlm generate` and of the
// golden tests. It (re)allocates the model runner's KV pool to its capacity, so only one
// SequenceRunner may use an engine at a time (the serving scheduler shares the pool among
// many sequences instead). Pages come from a BlockAllocator as the sequence grows; prefill
// can be split into chunks (a multi-token query over existing context).
#pragma once

#include <span>
#include <vector>

#include "engine/engine.h"
#include "kv/block_allocator.h"

namespace kvlm {

class SequenceRunner {
 public:
  // Room for `capacity` tokens. Throws kvlm::Error when that exceeds the model's context.
  SequenceRunner(Engine& engine, int capacity);

  // Appends `tokens` and runs them. Returns the next-token logits after every appended token
  // ([tokens.size()][vocab]) when all_logits, else after the last one only ([vocab]).
  std::vector<float> append(std::span<const TokenId> tokens, bool all_logits);

  int length() const { return length_; }
  int capacity() const { return capacity_; }
  const std::vector<BlockId>& block_table() const { return blocks_; }
  size_t kv_bytes() const { return engine_.model().kv_bytes(); }

 private:
  Engine& engine_;
  int capacity_;
  BlockAllocator allocator_;
  std::vector<BlockId> blocks_;
  int length_ = 0;
};

}  // namespace kvlm

// Host-side allocator of KV pages. A block id indexes the same page in every layer's pool,
// so one block table per sequence serves all layers.
#pragma once

#include <optional>
#include <vector>

#include "core/index_types.h"

namespace kvlm {

class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);
  std::optional<BlockId> allocate();  // nullopt when the pool is exhausted
  void free(BlockId id);              // returning a block twice is a bug (checked)
  int num_free() const { return int(free_.size()); }
  int num_blocks() const { return num_blocks_; }

 private:
  int num_blocks_;
  std::vector<BlockId> free_;   // LIFO: recently freed pages are reused first (warm in cache)
  std::vector<bool> in_use_;
};

}  // namespace kvlm

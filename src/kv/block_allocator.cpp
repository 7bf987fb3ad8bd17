#include "kv/block_allocator.h"

#include "core/error.h"

namespace kvlm {

BlockAllocator::BlockAllocator(int num_blocks) : num_blocks_(num_blocks), in_use_(size_t(num_blocks), false) {
  KVLM_CHECK(num_blocks >= 0, "negative block count");
  free_.reserve(size_t(num_blocks));
  for (int i = num_blocks - 1; i >= 0; --i) free_.push_back(BlockId(i));
}

std::optional<BlockId> BlockAllocator::allocate() {
  if (free_.empty()) return std::nullopt;
  const BlockId id = free_.back();
  free_.pop_back();
  in_use_[size_t(id)] = true;
  return id;
}

void BlockAllocator::free(BlockId id) {
  KVLM_CHECK(id >= 0 && id < num_blocks_, "block id out of range");
  KVLM_CHECK(in_use_[size_t(id)], "block freed twice");
  in_use_[size_t(id)] = false;
  free_.push_back(id);
}

}  // namespace kvlm

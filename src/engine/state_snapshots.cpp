#include "engine/state_snapshots.h"

#include "core/error.h"

namespace kvlm {

StateSnapshots::StateSnapshots(int first_slot, int count) : capacity_(count) {
  KVLM_CHECK(first_slot >= 0 && count >= 0, "state snapshots: bad slot range");
  for (int i = count; i-- > 0;) free_.push_back(first_slot + i);
}

int StateSnapshots::find(uint64_t serial) {
  const auto it = index_.find(serial);
  if (it == index_.end()) return -1;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->second;
}

int StateSnapshots::insert(uint64_t serial) {
  KVLM_CHECK(capacity_ > 0, "state snapshots: no slots");
  KVLM_CHECK(serial != 0 && !contains(serial), "state snapshots: a serial inserted twice");
  int slot;
  if (!free_.empty()) {
    slot = free_.back();
    free_.pop_back();
  } else {
    slot = lru_.back().second;
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  lru_.emplace_front(serial, slot);
  index_[serial] = lru_.begin();
  return slot;
}

}  // namespace kvlm

// Recurrent-state snapshots for the prefix cache of hybrid models (Gated DeltaNet layers).
//
// A prefix-cache hit skips the rows that would have built a recurrent layer's state, so a hit
// on a hybrid model must also restore the state as it was after exactly those rows. The
// scheduler keeps one snapshot per prompt, taken where the prompt's last full page ends (the
// furthest point a later hit on the same prompt, or on a prompt that extends it, can resume
// from), in state slots of their own beside the running sequences' (ModelRunner::copy_states
// moves them). A snapshot is keyed by the prefix-cache serial of the page it ends with: a
// serial names one chain of pages exactly and is never reused, so a snapshot can never be
// restored onto another prefix; one whose pages were evicted is simply never found again and
// ages out. Least recently used snapshots give their slots up first.
#pragma once

#include <cstdint>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvlm {

class StateSnapshots {
 public:
  // Slots first_slot .. first_slot + count - 1 of the runner's states hold the snapshots.
  StateSnapshots(int first_slot, int count);

  int capacity() const { return capacity_; }
  int size() const { return int(index_.size()); }
  bool contains(uint64_t serial) const { return index_.count(serial) > 0; }
  // The slot of the snapshot ending with the page of `serial` (now the most recently used),
  // or -1.
  int find(uint64_t serial);
  // A slot to hold the snapshot ending with `serial`'s page: a free one, else the least
  // recently used snapshot's. The caller copies the state into it. `serial` must be new.
  int insert(uint64_t serial);

 private:
  int capacity_;
  std::list<std::pair<uint64_t, int>> lru_;  // (serial, slot), most recently used first
  std::unordered_map<uint64_t, std::list<std::pair<uint64_t, int>>::iterator> index_;
  std::vector<int> free_;
};

}  // namespace kvlm

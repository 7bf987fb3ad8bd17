// Which keys a query reads, and which of them from the exact copy: the one rule the CPU
// backend, the CUDA kernels (host and device code include this header) and the engine's
// page bookkeeping follow.
#pragma once

#include "config/model_config.h"  // AttentionKind
#include "core/numeric.h"         // KVLM_HD

namespace kvlm {

// Key positions [lo, hi); empty when lo >= hi.
struct KeyRange {
  int lo = 0, hi = 0;
};

// The keys the query at position `pos` of a sequence of `kv_len` cached tokens sees: causal
// [0, pos], sliding [pos - window + 1, pos], non-causal every cached key.
KVLM_HD KeyRange visible_keys(AttentionKind kind, int window, int pos, int kv_len) {
  if (kind == AttentionKind::NonCausal) return {0, kv_len};
  const int lo = kind == AttentionKind::Sliding && pos - window + 1 > 0 ? pos - window + 1 : 0;
  return {lo, pos + 1};
}

// The position exact recent tokens are counted back from: the query's own, except in a
// non-causal layer, where every query of the sequence reads as its last position does.
KVLM_HD int exact_anchor(AttentionKind kind, int pos, int kv_len) {
  return kind == AttentionKind::NonCausal ? kv_len - 1 : pos;
}

// Whether the query anchored at `anchor` (exact_anchor) reads key `key` from its exact copy:
// the first `sink` positions of the sequence and the `recent` latest keys (itself included).
KVLM_HD bool kv_key_exact(int key, int anchor, int sink, int recent) {
  return key < sink || anchor - key < recent;
}

// The visible keys it reads from the quantized pages when sink / recent tokens are kept
// exact: `visible` minus the first `sink` keys and the `recent` latest — still one range.
KVLM_HD KeyRange quantized_keys(KeyRange visible, int anchor, int sink, int recent) {
  const int lo = visible.lo > sink ? visible.lo : sink;
  const int end = anchor - recent + 1;
  return {lo, visible.hi < end ? visible.hi : end};
}

// And the visible keys it reads from the exact copies: the sinks, then the recent window, two
// ranges (either may be empty) that are with quantized_keys' a partition of `visible`. Each
// bound grows with the anchor, as visible_keys' grow with the position.
struct ExactKeys {
  KeyRange sinks, recent;
};
KVLM_HD ExactKeys exact_keys(KeyRange visible, int anchor, int sink, int recent) {
  const int sink_hi = visible.hi < sink ? visible.hi : sink;
  const int sink_end = visible.lo > sink_hi ? visible.lo : sink_hi;
  const int win_lo = anchor - recent + 1 > sink_end ? anchor - recent + 1 : sink_end;
  return {{visible.lo, sink_end}, {win_lo, visible.hi}};
}

}  // namespace kvlm

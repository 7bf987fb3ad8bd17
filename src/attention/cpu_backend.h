// The CPU attention backend: the reference every other backend is tested against, and a
// usable engine for small models. Reads every KV format in place (a page at a time,
// dequantized into a page-sized scratch, as a GPU kernel would into registers / shared
// memory), for causal, sliding-window and non-causal attention.
#pragma once

#include "attention/backend.h"

namespace kvlm {

class CpuAttentionBackend final : public AttentionBackend {
 public:
  static const BackendCapabilities& capabilities();
  const BackendCapabilities& caps() const override { return capabilities(); }
  void store_kv(LayerKVCache& cache, const KVWrite& w) const override;
  void attend(const LayerKVCache& cache, const AttentionCall& call) const override;
};

}  // namespace kvlm

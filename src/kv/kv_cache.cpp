#include "kv/kv_cache.h"

#include "core/error.h"

namespace kvlm {

KVCache::KVCache(const KVPlan& plan, int num_blocks, int block_size) : num_blocks_(num_blocks), block_size_(block_size) {
  KVLM_CHECK(num_blocks > 0 && block_size > 0, "empty KV cache");
  layers_.reserve(plan.layers.size());
  for (const auto& spec : plan.layers) {
    LayerKVCache l;
    l.spec = &spec;
    l.num_blocks = num_blocks;
    l.block_size = block_size;
    const size_t tokens = size_t(num_blocks) * size_t(block_size);
    const size_t elems = tokens * size_t(spec.attn.num_kv_heads) * size_t(spec.attn.head_dim);
    l.k.assign(elems * dtype_size(spec.storage), 0);
    l.v.assign(elems * dtype_size(spec.storage), 0);
    if (is_per_token_head(spec.quant)) {
      l.k_scale.assign(tokens * size_t(spec.attn.num_kv_heads), 0.0f);
      l.v_scale.assign(tokens * size_t(spec.attn.num_kv_heads), 0.0f);
    }
    KVLM_CHECK(l.bytes() == tokens * spec.bytes_per_token(), "layer pool size disagrees with the plan's bytes per token");
    layers_.push_back(std::move(l));
  }
}

size_t KVCache::bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l.bytes();
  return b;
}

}  // namespace kvlm

#include "kv/kv_cache.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kv/kv_formats.h"

namespace kvlm {

KVPageBytes kv_page_bytes(const KVLayerSpec& spec, int block_size) {
  const size_t rows = size_t(spec.attn.num_kv_heads) * size_t(block_size);
  const int d = spec.attn.head_dim;
  return {.k_codes = rows * kv_row_code_bytes(spec.k, d),
          .v_codes = rows * kv_row_code_bytes(spec.v, d),
          .k_scales = rows * kv_row_scale_bytes(spec.k),
          .v_scales = rows * kv_row_scale_bytes(spec.v),
          .exact = spec.exact_bytes_per_token() / 2 * size_t(block_size)};
}

size_t kv_page_bytes(const KVPlan& plan, int block_size) {
  size_t total = 0;
  for (const auto& spec : plan.layers) {
    const KVPageBytes p = kv_page_bytes(spec, block_size);
    total += p.k_codes + p.v_codes + p.k_scales + p.v_scales;
  }
  return total;
}

size_t kv_exact_page_bytes(const KVPlan& plan, int block_size) {
  size_t total = 0;
  for (const auto& spec : plan.layers) total += 2 * kv_page_bytes(spec, block_size).exact;
  return total;
}

KVCache::KVCache(const KVPlan& plan, int num_blocks, int block_size, int num_exact_pages)
    : num_blocks_(num_blocks), block_size_(block_size), page_bytes_(kv_page_bytes(plan, block_size)),
      exact_page_bytes_(kv_exact_page_bytes(plan, block_size)) {
  KVLM_CHECK(num_blocks > 0 && block_size > 0, "empty KV cache");
  KVLM_CHECK(num_exact_pages >= 0, "negative exact page count");
  const bool any_exact = std::ranges::any_of(plan.layers, [](const KVLayerSpec& l) { return l.keeps_exact(); });
  KVLM_CHECK(!any_exact || num_exact_pages > 0, "layers keep exact tokens but the cache has no exact pages");
  num_exact_ = any_exact ? num_exact_pages : 0;
  layers_.reserve(plan.layers.size());
  for (const auto& spec : plan.layers) {
    LayerKVCache l;
    l.spec = &spec;
    l.num_blocks = num_blocks;
    l.block_size = block_size;
    const size_t tokens = size_t(num_blocks) * size_t(block_size);
    const KVPageBytes page = kv_page_bytes(spec, block_size);
    l.k.assign(page.k_codes * size_t(num_blocks), 0);
    l.v.assign(page.v_codes * size_t(num_blocks), 0);
    l.k_scale.assign(page.k_scales / sizeof(float) * size_t(num_blocks), 0.0f);
    l.v_scale.assign(page.v_scales / sizeof(float) * size_t(num_blocks), 0.0f);
    KVLM_CHECK(l.bytes() == tokens * spec.bytes_per_token(), "layer pool size disagrees with the plan's bytes per token");
    if (spec.keeps_exact()) {
      l.num_exact = num_exact_;
      l.ek.assign(page.exact * size_t(num_exact_), 0);
      l.ev.assign(page.exact * size_t(num_exact_), 0);
    }
    layers_.push_back(std::move(l));
  }
}

size_t KVCache::bytes() const {
  size_t b = 0;
  for (const auto& l : layers_) b += l.bytes();
  return b;
}

void KVCache::copy_block(BlockId src, BlockId dst) {
  KVLM_CHECK(src >= 0 && src < num_blocks_ && dst >= 0 && dst < num_blocks_, "copy_block: page id out of range");
  if (src == dst) return;
  for (auto& l : layers_) {
    const size_t page = l.k.size() / size_t(num_blocks_);
    std::copy_n(l.k.begin() + ptrdiff_t(size_t(src) * page), page, l.k.begin() + ptrdiff_t(size_t(dst) * page));
    std::copy_n(l.v.begin() + ptrdiff_t(size_t(src) * page), page, l.v.begin() + ptrdiff_t(size_t(dst) * page));
    if (!l.k_scale.empty()) {
      const size_t sp = l.k_scale.size() / size_t(num_blocks_);
      std::copy_n(l.k_scale.begin() + ptrdiff_t(size_t(src) * sp), sp, l.k_scale.begin() + ptrdiff_t(size_t(dst) * sp));
      std::copy_n(l.v_scale.begin() + ptrdiff_t(size_t(src) * sp), sp, l.v_scale.begin() + ptrdiff_t(size_t(dst) * sp));
    }
  }
}

void KVCache::copy_exact_page(int32_t src, int32_t dst) {
  KVLM_CHECK(src >= 0 && src < num_exact_ && dst >= 0 && dst < num_exact_, "copy_exact_page: exact page id out of range");
  if (src == dst) return;
  for (auto& l : layers_) {
    if (l.num_exact == 0) continue;
    const size_t page = l.ek.size() / size_t(num_exact_);
    std::copy_n(l.ek.begin() + ptrdiff_t(size_t(src) * page), page, l.ek.begin() + ptrdiff_t(size_t(dst) * page));
    std::copy_n(l.ev.begin() + ptrdiff_t(size_t(src) * page), page, l.ev.begin() + ptrdiff_t(size_t(dst) * page));
  }
}


void KVCache::save_page(BlockId id, std::span<uint8_t> out) const {
  KVLM_CHECK(id >= 0 && id < num_blocks_ && out.size() == page_bytes(), "save_page: page id or buffer size");
  uint8_t* o = out.data();
  for (const auto& l : layers_) {
    const KVPageBytes p = kv_page_bytes(*l.spec, block_size_);
    const auto part = [&](const auto& pool, size_t page) {
      if (page == 0) return;  // a side without token scales: its (empty) pool has no data
      std::memcpy(o, reinterpret_cast<const uint8_t*>(pool.data()) + size_t(id) * page, page);
      o += page;
    };
    part(l.k, p.k_codes);
    part(l.v, p.v_codes);
    part(l.k_scale, p.k_scales);
    part(l.v_scale, p.v_scales);
  }
}

void KVCache::load_page(BlockId id, std::span<const uint8_t> in) {
  KVLM_CHECK(id >= 0 && id < num_blocks_ && in.size() == page_bytes(), "load_page: page id or buffer size");
  const uint8_t* i = in.data();
  for (auto& l : layers_) {
    const KVPageBytes p = kv_page_bytes(*l.spec, block_size_);
    const auto part = [&](auto& pool, size_t page) {
      if (page == 0) return;
      std::memcpy(reinterpret_cast<uint8_t*>(pool.data()) + size_t(id) * page, i, page);
      i += page;
    };
    part(l.k, p.k_codes);
    part(l.v, p.v_codes);
    part(l.k_scale, p.k_scales);
    part(l.v_scale, p.v_scales);
  }
}

void KVCache::save_exact_page(int32_t id, std::span<uint8_t> out) const {
  KVLM_CHECK(id >= 0 && id < num_exact_ && out.size() == exact_page_bytes_, "save_exact_page: page id or buffer size");
  uint8_t* o = out.data();
  for (const auto& l : layers_) {
    if (l.num_exact == 0) continue;
    const size_t page = l.ek.size() / size_t(num_exact_);
    for (const auto* pool : {&l.ek, &l.ev}) {
      std::memcpy(o, pool->data() + size_t(id) * page, page);
      o += page;
    }
  }
}

void KVCache::load_exact_page(int32_t id, std::span<const uint8_t> in) {
  KVLM_CHECK(id >= 0 && id < num_exact_ && in.size() == exact_page_bytes_, "load_exact_page: page id or buffer size");
  const uint8_t* i = in.data();
  for (auto& l : layers_) {
    if (l.num_exact == 0) continue;
    const size_t page = l.ek.size() / size_t(num_exact_);
    for (auto* pool : {&l.ek, &l.ev}) {
      std::memcpy(pool->data() + size_t(id) * page, i, page);
      i += page;
    }
  }
}

}  // namespace kvlm

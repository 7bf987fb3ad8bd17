// Paged KV storage, one pool per attention layer, each sized exactly for that layer's spec
// (no padding to a common page size: a bf16 layer and an fp8 layer differ by 2x in bytes).
//
// Layout per layer (HND per block):
//   k, v     : [num_blocks][num_kv_heads][block_size][head_dim] elements of spec.k.storage
//              and spec.v.storage (int4: head_dim / 2 bytes per row, kv_format.h's packing)
//   k_scale, v_scale (a per-token-head side only): [num_blocks][num_kv_heads][block_size] 32-bit
//              slots (fp32 scales; int4: an f16 step and zero point)
// A token's slot is block_id * block_size + offset; the same block id is used in every layer.
//
// Layers with exact sink / recent tokens (KVLayerSpec::keeps_exact) also have exact pages:
//   ek, ev   : [num_exact][num_kv_heads][block_size][head_dim] elements of spec.exact_storage
// a second, smaller pool of the model dtype that holds again the tokens some query reads
// exact. The engine attaches an exact page to a page while that page holds such tokens
// (engine/block_manager.h); exact page ids are their own id space, the same in every layer.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kv/kv_plan.h"
#include "core/index_types.h"

namespace kvlm {

// One page of one layer, as every device lays it out: the bytes of its K and of its V codes,
// of its K and V per-token-head scales (0 for a side without them), and of one K (equally V)
// exact page (0 for layers without exact tokens).
struct KVPageBytes {
  size_t k_codes = 0, v_codes = 0;
  size_t k_scales = 0, v_scales = 0;
  size_t exact = 0;
};
KVPageBytes kv_page_bytes(const KVLayerSpec& spec, int block_size);
// One page in every layer of `plan`: K and V codes and token scales (exact pages not included).
size_t kv_page_bytes(const KVPlan& plan, int block_size);
// One exact page in every layer of `plan` that keeps exact tokens, K and V (0: none does).
size_t kv_exact_page_bytes(const KVPlan& plan, int block_size);

struct LayerKVCache {
  const KVLayerSpec* spec = nullptr;
  int num_blocks = 0;
  int block_size = 0;
  std::vector<uint8_t> k, v;
  std::vector<float> k_scale, v_scale;
  int num_exact = 0;  // exact pages (0 unless spec->keeps_exact())
  std::vector<uint8_t> ek, ev;

  size_t bytes() const { return k.size() + v.size() + 4 * (k_scale.size() + v_scale.size()) + ek.size() + ev.size(); }
  // Element offset of (block, head, offset-in-block, 0).
  size_t row(int64_t block, int head, int offset) const {
    return ((size_t(block) * size_t(spec->attn.num_kv_heads) + size_t(head)) * size_t(block_size) + size_t(offset)) *
           size_t(spec->attn.head_dim);
  }
  // Byte offset of that row in k (side K) or v (side V).
  size_t row_byte(KVSide side, int64_t block, int head, int offset) const {
    return dtype_bytes(spec->format(side).storage, row(block, head, offset));
  }
  size_t scale_index(int64_t block, int head, int offset) const {
    return (size_t(block) * size_t(spec->attn.num_kv_heads) + size_t(head)) * size_t(block_size) + size_t(offset);
  }
  // Byte offset of (exact page, head, offset-in-page, 0) in ek / ev.
  size_t exact_row_byte(int64_t page, int head, int offset) const {
    return scale_index(page, head, offset) * size_t(spec->attn.head_dim) * dtype_size(spec->exact_storage);
  }
};

class KVCache {
 public:
  // The plan must outlive the cache (layers point at its specs). num_exact_pages: the exact
  // pool of every layer that keeps exact tokens (ignored by the others).
  KVCache(const KVPlan& plan, int num_blocks, int block_size, int num_exact_pages = 0);
  LayerKVCache& layer(size_t i) { return layers_[i]; }
  const LayerKVCache& layer(size_t i) const { return layers_[i]; }
  size_t num_layers() const { return layers_.size(); }
  int num_blocks() const { return num_blocks_; }
  int block_size() const { return block_size_; }
  int num_exact_pages() const { return num_exact_; }
  size_t bytes() const;
  // Copies page `src` onto page `dst` in every layer (K, V and token scales).
  void copy_block(BlockId src, BlockId dst);
  // Copies exact page `src` onto exact page `dst` in every layer that has exact pages.
  void copy_exact_page(int32_t src, int32_t dst);
  // One page in every layer, serialized: per layer in order its K codes, V codes, K scales and
  // V scales (kv_page_bytes; exact pages not included). save_page writes page_bytes() bytes,
  // load_page reads them back. kPageLayoutVersion names this layout and the formats' encodings:
  // pages on disk from another version are never read (the disk tier's root covers it), so bump
  // it when either changes.
  static constexpr int kPageLayoutVersion = 1;
  size_t page_bytes() const { return page_bytes_; }
  void save_page(BlockId id, std::span<uint8_t> out) const;
  void load_page(BlockId id, std::span<const uint8_t> in);
  // One exact page in every layer that has them, serialized: per such layer its K then V exact
  // rows (exact_page_bytes() in all, 0 without such layers); the same version covers it.
  size_t exact_page_bytes() const { return exact_page_bytes_; }
  void save_exact_page(int32_t id, std::span<uint8_t> out) const;
  void load_exact_page(int32_t id, std::span<const uint8_t> in);

 private:
  int num_blocks_, block_size_, num_exact_ = 0;
  size_t page_bytes_ = 0, exact_page_bytes_ = 0;
  std::vector<LayerKVCache> layers_;
};

}  // namespace kvlm

// The CUDA kernels of the decoder (everything but attention and the GEMMs), host-callable,
// with no CUDA header: a stream is a `void*` (a cudaStream_t; nullptr = the legacy stream).
//
// Activations and weights are `act` = bfloat16 or float16 (the model's compute dtype), every
// reduction and every elementwise formula runs in fp32, and the residual stream is kept in
// fp32 (one rounding per layer output instead of one per residual add). Norm weights and
// RoPE frequencies are fp32. Every pointer is a device pointer; every launch is checked and
// a failure throws kvlm::Error naming the kernel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "config/model_config.h"  // GluActivation
#include "core/dtype.h"
#include "core/index_types.h"

namespace kvlm::cuda {

// x[r][:] = table[tokens[r]][:] * scale in fp32 (the residual stream). Token ids must be in
// range (the caller checks them on the host).
void embed_rows(DType act, const void* table, const TokenId* tokens, int rows, int hidden, float* x, void* stream,
                float scale = 1.0f);

// Residual add fused with RMSNorm (transformers' LlamaRMSNorm in fp32):
//   s = x[src] + delta[src]  (delta optional), written back to x[src] when row_map is null,
//   out[r] = weight * (s * 1/sqrt(mean(s^2) + eps))  rounded once to act.
// With row_map, output row r normalizes residual row row_map[r] (the final norm of the rows
// whose logits are wanted) and x is left as it is. With x null, s = delta: a plain RMSNorm of
// an act tensor (out may be delta).
struct AddRmsNormParams {
  DType act = DType::BF16;
  int rows = 0;
  int hidden = 0;
  float* x = nullptr;                // fp32 [*][hidden], or null
  const void* delta = nullptr;       // act [*][hidden] or null
  const float* weight = nullptr;     // fp32 [hidden]
  float eps = 1e-6f;
  void* out = nullptr;               // act [rows][hidden]
  const int32_t* row_map = nullptr;  // [rows] or null
  // Optionally also out quantized for the FP8 GEMM, exactly as quantize_rows_fp8 (gemm.h) would
  // quantize it (codes [rows][hidden]; code_group 0: scales [rows], 128: [hidden / 128][rows]):
  // the GEMM after the norm then reads these instead of running its own quantization pass.
  // Needs rmsnorm_fp8_fits and no row_map.
  uint8_t* codes = nullptr;
  float* code_scales = nullptr;
  int code_group = 0;
  // Optionally the rows in fp32 instead of (or beside) `out`: weight * s / rms, unrounded (an
  // embedding model's pooled output). out may then be null.
  float* out_f32 = nullptr;
};
void add_rmsnorm(const AddRmsNormParams& p, void* stream);
// Whether add_rmsnorm quantizes rows of this size in these groups (0: per row; 128: the norm's
// CTA shape must put each group in whole warps, true for hidden sizes that are multiples of 512
// among others).
bool rmsnorm_fp8_fits(int hidden, int group);

// The attention prologue in one pass over the fused QKV projection:
//   q heads: [Qwen3 q RMSNorm] -> RoPE -> bf16 q (the paged attention kernels' input);
//   k heads: [Qwen3 k RMSNorm] -> RoPE -> quantize (per the layer's KV format) -> page slot;
//   v heads:                              quantize -> page slot.
// Quantization is kv_store's, from the fp32 values (no bf16 round trip): code =
// encode(x / scale), per-token-head scale = max(absmax / qmax, 1e-6) (kv/kv_format.h).
// RoPE is rotate-half with angle = float(position) * inv_freq[i] (model/rope.cpp computes
// inv_freq for the default, linear and llama3 scalings). A negative slot (padding) stores
// nothing; q is written for every row.
struct QkvRopeStoreParams {
  DType act = DType::BF16;
  DType storage = DType::BF16;  // K's format, and V's unless v_format is set
  KVQuantMode quant = KVQuantMode::None;
  std::optional<KVStorage> v_format;  // V's format where it differs from K's (attention_ops.h)
  int num_tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;                  // even, <= 256
  const void* qkv = nullptr;         // act [num_tokens][qkv_stride]: q, k, v heads first
  int64_t qkv_stride = 0;            // elements per row; 0: (nh + 2 * kvh) * head_dim (a gated
                                     // attention's projection has its gate columns after v)
  const float* q_norm = nullptr;     // [head_dim] or null (no q/k norm)
  const float* k_norm = nullptr;     // [head_dim] or null
  float eps = 1e-6f;
  const Position* positions = nullptr;  // [num_tokens]
  const float* inv_freq = nullptr;      // [rotary_dim / 2]
  // Partial rotary (Qwen3.5 / Qwen3-Next): RoPE rotates the first rotary_dim dims (rotate-half
  // within them) and leaves the rest; 0 or head_dim: all of them.
  int rotary_dim = 0;
  uint16_t* q_out = nullptr;            // bf16 [num_tokens][nh][head_dim]
  const SlotId* slots = nullptr;        // [num_tokens]
  int block_size = 0;
  int num_blocks = 0;
  void* k_cache = nullptr;              // [num_blocks][kvh][block_size][head_dim] storage
  void* v_cache = nullptr;
  float* k_token_scale = nullptr;       // per-token-head modes: [num_blocks][kvh][block_size]
  float* v_token_scale = nullptr;
  const float* k_tensor_scale = nullptr;  // fp8_per_tensor: 1 or kvh scales
  const float* v_tensor_scale = nullptr;
  int num_tensor_scales = 1;
  // core/hadamard.h's R (signs of rotation_seed) after RoPE, power-of-two head_dim: rotate_k
  // rotates q and K, rotate_v rotates V (KVLayerSpec::rotate_k / rotate_v).
  bool rotate_k = false;
  bool rotate_v = false;
  uint32_t rotation_seed = 0;
  // Exact sink / recent tokens (null: none): K and V rows, as stored before quantizing (after
  // the rotation), also go to exact page slot exact_slots[t] (< 0: none) in the act dtype.
  const SlotId* exact_slots = nullptr;
  uint16_t* exact_k = nullptr;  // act [num_exact][kvh][block_size][head_dim]
  uint16_t* exact_v = nullptr;
  int num_exact = 0;
};
void qkv_rope_store(const QkvRopeStoreParams& p, void* stream);

// out[r] = R^T in[r] for each head row (core/hadamard.h; the attention output of a rotated
// layer): bf16 [rows][head_dim] in, act out (may alias in when act is bf16).
void unrotate_heads(DType act, const uint16_t* in, void* out, int64_t rows, int head_dim, uint32_t seed, void* stream);

// out[r][i] = f(gu[r][i]) * gu[r][inter + i]: the fused gate/up projection's halves, f SiLU or
// tanh-approximated GELU (ops/cpu's silu_mul / gelu_tanh_mul in fp32).
void glu(DType act, GluActivation f, const void* gu, void* out, int rows, int inter, void* stream);

// out[r] = argmax of logits[r][0, vocab): greedy sampling on the GPU. Ties go to the lowest
// token id, as the host Sampler's argmax.
void argmax_rows(const float* logits, int rows, int vocab, TokenId* out, void* stream);

// dst[r * ld + c] = act(src[r * cols + c]) for r < rows, c < cols: fp32 rows into columns of
// a wider activation (a drafter's features: each captured layer's output in its slot).
void f32_rows_to_act(DType act, const float* src, int rows, int cols, void* dst, int ld, void* stream);

// bf16 -> act (float16 models: the attention output feeds the o projection). n elements.
void bf16_to_act(DType act, const uint16_t* in, void* out, size_t n, void* stream);

// Copy-on-write of KV pages: for each pair and each layer, page src -> page dst of K, V and
// (per-token-head modes) both scale pools. `layers` and `pairs` live in device memory; pairs
// must not chain (no dst is another pair's src): the copies run in parallel.
struct KVPagePools {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
  uint8_t* k_scale = nullptr;  // null without token scales
  uint8_t* v_scale = nullptr;
  uint64_t k_page_bytes = 0, v_page_bytes = 0;              // bytes of one page of codes
  uint64_t k_scale_page_bytes = 0, v_scale_page_bytes = 0;  // of one page of scales; 0 without token scales
  uint64_t page_offset = 0;  // where this layer's parts start in a packed page (pack_kv_pages)
};
void copy_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pairs, int num_pairs, void* stream);

// The host tier's packed pages (engine/host_kv_tier.h; kv/kv_cache.h's KVCache::save_page
// layout): pack_kv_pages writes page pages[i] of every layer to packed + i * page_bytes, each
// layer at its page_offset as K codes, V codes, K scales, V scales (the parts it has);
// unpack_kv_pages writes them back. `pages` is a host array (passed by value, at most
// kMaxPackedPages); `packed` is device memory. Pages must be distinct for unpack.
inline constexpr int kMaxPackedPages = 256;
struct PackedPageList {
  BlockId pages[kMaxPackedPages];
};
void pack_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pages, int num_pages, uint8_t* packed,
                   uint64_t page_bytes, void* stream);
void unpack_kv_pages(const KVPagePools* layers, int num_layers, const BlockId* pages, int num_pages, const uint8_t* packed,
                     uint64_t page_bytes, void* stream);

}  // namespace kvlm::cuda

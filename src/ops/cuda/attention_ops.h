// CUDA attention over the paged KV cache, host-callable, with no CUDA header (a stream is
// passed as `void*`, a cudaStream_t; nullptr = the legacy default stream).
//
// Every pointer below is a device pointer, 16-byte aligned (cudaMalloc gives 256). Page layout is the CPU backend's (kv/kv_cache.h):
//   K, V pages   [num_blocks][num_kv_heads][block_size][head_dim] of the layer's storage type
//   token scales [num_blocks][num_kv_heads][block_size] 32-bit slots (per-token-head modes only:
//                fp32 scales; int4: {f16 step, f16 zero point}, kvfmt::I4)
// A token's slot is block_id * block_size + offset. Quantization follows kv/kv_format.h
// bit for bit (code = convert(x / scale); per-token-head scale = max(absmax / qmax, 1e-6)).
//
// Supported (storage, quant mode) pairs — anything else throws kvlm::Error naming this set:
//   bfloat16 / float16 with none; fp8_e4m3 / fp8_e5m2 with fp8_per_tensor;
//   fp8_e4m3 with fp8_per_token_head; int8 with int8_per_token_head; int4 with
//   int4_per_token_head (head_dim % 8 == 0; the tensor-core decode, mma.sync tiled and CUDA-core
//   kernels).
// K and V may be held in two different formats (v_format below): any two of bfloat16,
// fp8_e4m3/fp8_per_token_head, int8 and int4 (kv/kv_formats.h's kCudaSplitFormats). Such a
// layer's pages are sized per side; attention reads it with the decode tensor-core and the
// CUDA-core kernels (multi-token rows too: not the tiled prefill kernels).
// Head sizes: 64 and 128 (tensor-core decode and prefill kernels, also the CUDA-core one), 256
// (tiled prefill kernel and CUDA-core kernel), 8, 16 and 32 (CUDA-core kernel); others throw
// kvlm::Error naming the set. kv_store accepts any head size (int4: multiples of 8).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "config/model_config.h"  // AttentionKind
#include "core/dtype.h"
#include "core/index_types.h"

namespace kvlm::cuda {

// Quantize-and-scatter: rows of new K/V into the pages at their slots.
struct KVStoreParams {
  DType storage = DType::BF16;  // K's format, and V's unless v_format is set
  KVQuantMode quant = KVQuantMode::None;
  std::optional<KVStorage> v_format;  // V's format where it differs from K's
  int num_tokens = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int num_blocks = 0;
  const uint16_t* k = nullptr;      // bf16 [num_tokens][num_kv_heads][head_dim], RoPE applied
  const uint16_t* v = nullptr;      // bf16 [num_tokens][num_kv_heads][head_dim]
  const SlotId* slots = nullptr;    // [num_tokens]; a negative slot (padding) is skipped, and
                                    // so is one past the pool (a caller bug: never written)
  // Exact sink / recent tokens (kv/kv_cache.h's exact pages; null: none): each row also goes,
  // unquantized in bf16 (or f16 with exact_f16), to exact page slot exact_slots[t] (< 0: none).
  const SlotId* exact_slots = nullptr;
  uint16_t* exact_k = nullptr;      // [num_exact][num_kv_heads][block_size][head_dim]
  uint16_t* exact_v = nullptr;
  int num_exact = 0;
  bool exact_f16 = false;
  void* k_cache = nullptr;          // [num_blocks][num_kv_heads][block_size][head_dim] storage
  void* v_cache = nullptr;          // same
  float* k_token_scale = nullptr;   // [num_blocks][num_kv_heads][block_size]; per-token-head only
  float* v_token_scale = nullptr;   // same
  const float* k_tensor_scale = nullptr;  // [num_tensor_scales]; fp8_per_tensor only
  const float* v_tensor_scale = nullptr;  // [num_tensor_scales]
  int num_tensor_scales = 1;              // 1 (per layer) or num_kv_heads (per kv head)
};
void kv_store(const KVStoreParams& p, void* stream);

// Paged attention over a flattened ragged batch. Sequence s owns query rows
// [cu_q_lens[s], cu_q_lens[s+1]); its new tokens are already stored, so its query row i sits
// at position kv_len - q_len + i. Masks: Full = causal (keys <= pos), Sliding = causal and
// key > pos - window, NonCausal = all kv_len keys.
struct PagedAttentionParams {
  DType storage = DType::BF16;  // K's format, and V's unless v_format is set
  KVQuantMode quant = KVQuantMode::None;
  std::optional<KVStorage> v_format;  // V's format where it differs from K's
  int num_seqs = 0;
  int num_tokens = 0;          // total query rows (= cu_q_lens[num_seqs])
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
  int max_blocks_per_seq = 0;  // row stride of block_tables
  int max_q_len = 0;           // host-known bound: 1 selects the decode path
  int max_kv_len = 0;          // host-known bound, sizes the split-KV grid
  AttentionKind mask = AttentionKind::Full;
  int window = 0;              // Sliding only
  float softmax_scale = 1.0f;  // usually head_dim^-0.5
  // Learned attention sinks (GPT-OSS), fp32 [num_q_heads] or null: head h's softmax denominator
  // gains exp(sinks[h] - max), sinks in score units (after softmax_scale), as the CPU backend's
  // AttentionCall::sinks. Every kernel adds it where it normalizes: its own epilogue with one
  // split, the split-KV reduction otherwise (sink_term).
  const float* sinks = nullptr;
  const uint16_t* q = nullptr;          // bf16 [num_tokens][num_q_heads][head_dim], RoPE applied
  uint16_t* out = nullptr;              // bf16 [num_tokens][num_q_heads][head_dim]
  const void* k_cache = nullptr;        // [num_blocks][num_kv_heads][block_size][head_dim] storage
  const void* v_cache = nullptr;        // same
  const float* k_token_scale = nullptr; // [num_blocks][num_kv_heads][block_size]; per-token-head only
  const float* v_token_scale = nullptr; // same
  const float* k_tensor_scale = nullptr;  // [num_tensor_scales]; fp8_per_tensor only
  const float* v_tensor_scale = nullptr;  // [num_tensor_scales]
  int num_tensor_scales = 1;              // 1 or num_kv_heads
  const int32_t* cu_q_lens = nullptr;     // [num_seqs + 1] prefix sums of query lengths
  const int32_t* kv_lens = nullptr;       // [num_seqs] cached tokens incl. the new ones
  const BlockId* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq], padded
  // Exact sink / recent tokens (null exact_k: none): key j of the query at position pos is
  // read from the exact pages when j < keep_sink or pos - j < keep_recent
  // (kv/attention_mask.h's kv_key_exact; non-causal: pos = kv_len - 1), through exact_tables (the block tables'
  // shape: the exact page of each page). A tensor-core kernel takes the quantized keys — one
  // interval per query (kv/attention_mask.h's quantized_keys) — and the exact ones follow as
  // more splits for the reduction: after the decode kernel (2) the CUDA-core kernel's exact
  // pass, after the tiled prefill kernel (3) the same tiled kernel twice more over the exact
  // pages (read as a 16-bit cache: the sinks, then the recent window, one range per query each,
  // exact_keys). The CUDA-core kernel (1) alone reads both.
  const uint16_t* exact_k = nullptr;      // bf16 (f16 with exact_f16) [num_exact][num_kv_heads][block_size][head_dim]
  const uint16_t* exact_v = nullptr;
  const BlockId* exact_tables = nullptr;  // [num_seqs][max_blocks_per_seq]
  int keep_sink = 0;
  int keep_recent = 0;
  bool exact_f16 = false;
  void* workspace = nullptr;              // split-KV partials, paged_attention_workspace_bytes()
  size_t workspace_bytes = 0;
  int max_splits = 0;  // 0 = choose from the device's SM count; > 0 caps (tests force splits)
  // Lengths of the decode kernel's splits: 0 = automatic (decreasing when the grid runs in
  // more than one wave), 1 = equal, 2 = decreasing. For tests and the lab.
  int split_lengths = 0;
  // 0 = automatic: with block_size % 16 == 0, the tiled tensor-core prefill kernel when
  // max_q_len * group > 16 and head_dim is 64/128/256, else the tensor-core decode kernel when
  // head_dim is 64/128 and the GQA group is <= 16, else the CUDA-core kernel. 1 = CUDA-core,
  // 2 = tensor-core decode, 3 = tiled prefill (kvlm::Error if the shape does not fit). For
  // tests and the lab.
  int kernel = 0;
  // Operand layout of the tensor-core decode kernel (2): 0 = automatic (keys in M wherever the
  // CTA's (query row, head) pairs fit the mma's N = 8, i.e. max_q_len * group <= 8), 1 = query
  // rows in M (up to 16 pairs), 2 = keys in M (kvlm::Error when the GQA group exceeds 8). For
  // tests and the lab.
  int decode_layout = 0;
};
// Bytes of workspace `paged_attention(p)` needs (0 when no split is used). Depends on
// num_tokens, num_q_heads, head_dim, max_kv_len, max_splits and the current device.
size_t paged_attention_workspace_bytes(const PagedAttentionParams& p);
void paged_attention(const PagedAttentionParams& p, void* stream);

// What paged_attention will do for `p`, exposed for the lab and tests (one plan, the one the
// launcher uses; kvlm::Error for a shape no kernel covers): the kernel it runs (1, 2 or 3 as
// PagedAttentionParams::kernel), its number of KV splits, and whether the decode kernel's
// splits are of decreasing length (split_lengths).
struct PagedAttentionChoice {
  int kernel = 1;
  int splits = 1;
  bool decreasing_splits = false;
  bool keys_in_m = false;  // the decode kernel's layout (decode_layout 2)
};
PagedAttentionChoice paged_attention_choice(const PagedAttentionParams& p);

// The per-CTA timeline of the last decode tensor-core kernel launched, for the kernel lab
// (attention_lab --trace): in a build with -DKVLM_ATTN_TRACE=ON every CTA of that kernel
// records globaltimer nanoseconds at its start, when its first tile is in shared memory and at
// its end, and the SM it ran on (the first 65536 CTAs of a grid, in blockIdx order: x fastest).
// Empty in other builds, which record nothing.
struct AttnCtaTrace {
  uint64_t start = 0, first_tile = 0, end = 0, sm = 0;
};
static_assert(sizeof(AttnCtaTrace) == 32, "the trace file format is 4 x uint64 per CTA");
std::vector<AttnCtaTrace> paged_attention_last_trace();

}  // namespace kvlm::cuda

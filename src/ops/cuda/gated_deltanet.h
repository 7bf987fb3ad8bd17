// Gated DeltaNet's token mixer on CUDA: one linear-attention layer of a step, from its fused
// input projection to the gated-normed output before out_proj. ops/cpu/linear_attention.h is
// the reference (the formulas, the state layout); no CUDA header here (a stream is a void*).
//
// The kernels:
//   conv   a thread per (sequence, channel, 64 rows): the causal depthwise conv over q | k | v
//          with SiLU, its window starting from the step's earlier rows or the conv state (zeros
//          for a sequence whose step starts at position 0), the last inputs left there ->
//          qkv fp32 [T][conv_dim]
//   delta  decode and short steps: the recurrent form, a warp per (sequence, value head, 32
//          state columns): the state's columns in registers (column j of S is independent of
//          the others given q, k, g, beta), read once, the rows in order through the rule (q, k
//          L2-normalized in the warp, q scaled by dk^-0.5; g and beta from the a / b columns),
//          written once -> core fp32 [T][v_heads * dv]
//          prompts (gated_delta_net_takes_chunks, scratch given): the chunked WY form over
//          chunks of 64 rows, all chunks at once but for the state update
//          (gated_deltanet_chunked.cu says how)
//   norm   a warp per (row, value head): w * x / rms(x) * silu(z) -> out in the act dtype
// A padding sequence (state slot < 0: a CUDA graph's filler) runs from zeros and keeps nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace kvlm::cuda {

struct GatedDeltaNetParams {
  DType act = DType::BF16;
  int num_tokens = 0, num_seqs = 0;
  int k_heads = 0, v_heads = 0, dk = 0, dv = 0, conv_kernel = 0;  // LinearAttentionConfig
  const int32_t* cu_q_lens = nullptr;    // [S + 1]: sequence s's rows are [cu[s], cu[s + 1])
  const int32_t* kv_lens = nullptr;      // [S]: kv_len == q_len means the step starts at position 0
  const int32_t* state_slots = nullptr;  // [S]: the sequence's state slot, < 0 for none
  const void* mixed = nullptr;           // act [T][in_proj_dim]: q | k | v | z | b | a
  const float* conv_w = nullptr;         // [conv_dim][conv_kernel]
  const float* a_log = nullptr;          // [v_heads]
  const float* dt_bias = nullptr;        // [v_heads]
  const float* norm_w = nullptr;         // [dv]
  float eps = 1e-6f;                     // of the gated norm
  // This layer's states, [slots][state_bytes]: a slot holds the fp32 conv window, then the
  // [v_heads][dk][dv] matrices in state_dtype (LinearAttentionConfig::state_bytes()).
  uint8_t* states = nullptr;
  size_t state_bytes = 0;
  DType state_dtype = DType::F32;        // F32 or BF16
  int max_q_len = 0;                     // the longest sequence's rows (0: take num_tokens)
  float* scratch = nullptr;              // fp32 [gated_delta_net_scratch_floats]: null keeps every step recurrent
  float* qkv = nullptr;                  // scratch fp32 [T][conv_dim]
  float* core = nullptr;                 // scratch fp32 [T][v_heads * dv]
  void* out = nullptr;                   // act [T][v_heads * dv]
};

// Whether the kernels take these sizes (key heads of at most 128, conv kernels of at most 8 taps).
bool gated_delta_net_fits(int dk, int dv, int conv_kernel);
// Which form of the delta rule a step of num_tokens rows, the longest sequence max_q_len of
// them, runs (given the scratch). The chunked form costs about the same per row whatever the
// step's shape; the recurrent one a row's latency per row of the longest sequence, its
// sequences in parallel. Measured on the H200 at Qwen3.5's shape (docs/results/hybrid.md:
// chunked 0.43 us a row; recurrent 2.1 us a step up to 4 sequences, 0.32 us a row beyond), the
// chunked form pays from kGatedDeltaNetChunkedRows rows while the longest sequence holds more
// than a fifth of the step's rows: a prompt, a prompt's chunk beside decode rows, a few
// prompts. Many short prompts together stay recurrent. Value heads of at most 128.
inline constexpr int kGatedDeltaNetChunkedRows = 32;
bool gated_delta_net_chunk_fits(int dk, int dv);
bool gated_delta_net_takes_chunks(int num_tokens, int max_q_len, int dk, int dv);
// The scratch (fp32 values) such a step takes: 0 when it runs the recurrent kernel.
size_t gated_delta_net_scratch_floats(int num_tokens, int max_q_len, int v_heads, int dk, int dv);
void gated_delta_net(const GatedDeltaNetParams& p, void* stream);

// x[r][i] *= sigmoid(src[r * src_stride + col0 + i]) for r < rows, i < cols, in the act dtype
// (a gated attention output: the gate is the fused projection's last columns).
void sigmoid_gate(DType act, void* x, const void* src, int rows, int cols, int64_t src_stride, int64_t col0,
                  void* stream);

// y[r][i] += sigmoid(gate[r]) * s[r][i]: a shared expert's output (act) added to the routed
// experts' (act), its gate logit fp32 [rows].
void add_gated_rows(DType act, void* y, const void* s, const float* gate, int rows, int cols, void* stream);

}  // namespace kvlm::cuda

// The CUDA ops (model/ops.h) of the CUDA model runner: every op enqueues the kernels of
// ops/cuda on the runner's stream, so a step's launches can be captured into a CUDA graph.
// No CUDA header here (a stream is a void*).
//
// Types: the residual stream fp32, Hidden activations in the compute dtype (bf16/fp16),
// queries bf16 (the paged attention kernels' input), logits fp32. Weights: matrices and
// biases in the compute dtype, norms and RoPE frequencies fp32.
//
// Activations are carved from the runner's scratch arena, in the order the forward asks for
// them, after the step's metadata. A step run with `measure` set launches nothing and only
// counts the bytes it would carve: the runner sizes its arena from that, then runs the same
// forward for real, so a given step shape always gets the same addresses (what a captured
// graph bakes in).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "config/model_config.h"
#include "core/dtype.h"
#include "core/index_types.h"
#include "model/communicator.h"
#include "model/ops.h"
#include "ops/cuda/attention_ops.h"

namespace kvlm::cuda {
struct AddRmsNormParams;
}

namespace kvlm {

namespace cuda {
class Gemm;
}

// Bump allocation of 256-byte aligned pieces (cuBLASLt's default alignment assumption;
// cudaMalloc gives 256), from a base address (0 to measure).
struct Carver {
  static constexpr size_t kAlign = 256;
  static size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
  uintptr_t base = 0;
  size_t off = 0;
  void* take_bytes(size_t bytes) {
    void* p = reinterpret_cast<void*>(base + off);
    off += align_up(bytes);
    return p;
  }
  template <class T>
  T* take(size_t count) {
    return static_cast<T*>(take_bytes(count * sizeof(T)));
  }
};

// One layer's KV as the CUDA kernels see it: its format, mask, static scales and pages.
struct CudaKVLayer {
  int num_q_heads = 0, num_kv_heads = 0, head_dim = 0;  // the layer's own (a drafter's may differ)
  DType storage = DType::BF16;  // K's format, and V's unless v_format is set
  KVQuantMode quant = KVQuantMode::None;
  std::optional<KVStorage> v_format;  // V's where it differs (KVLayerSpec::v != k)
  bool rotate_k = false, rotate_v = false;  // KVLayerSpec::rotate_k / rotate_v, with rotation_seed's signs
  uint32_t rotation_seed = 0;
  AttentionKind kind = AttentionKind::Full;
  int window = 0;
  const float *k_tensor_scale = nullptr, *v_tensor_scale = nullptr;  // device, fp8_per_tensor
  int num_tensor_scales = 1;
  uint8_t *k = nullptr, *v = nullptr;  // the pool's pages (allocate_kv)
  float *k_scale = nullptr, *v_scale = nullptr;
  size_t k_page_bytes = 0, v_page_bytes = 0;              // one page of codes
  size_t k_scale_page_bytes = 0, v_scale_page_bytes = 0;  // one page of token scales (0: none)
  // Exact sink / recent tokens (KVLayerSpec::keeps_exact; null: none): exact pages in the act dtype.
  uint16_t *exact_k = nullptr, *exact_v = nullptr;
  int keep_sink = 0, keep_recent = 0;
  size_t exact_page_bytes = 0;
};

// A step as the kernels see it: its (possibly padded) shape and its metadata in device memory.
struct CudaStep {
  int T = 0, R = 0, S = 0, MB = 1, max_q = 1, max_kv = 1;
  const TokenId* tokens = nullptr;
  const Position* positions = nullptr;
  const SlotId* slots = nullptr;
  const int32_t* cu_q_lens = nullptr;
  const int32_t* kv_lens = nullptr;
  const BlockId* block_tables = nullptr;
  const int32_t* logit_rows = nullptr;
  const SlotId* exact_slots = nullptr;    // exact sink / recent tokens (null: none)
  const BlockId* exact_tables = nullptr;
  const int32_t* state_slots = nullptr;   // [S] Gated DeltaNet state slots (< 0: a padding sequence); null: none
};

class CudaOps final : public Ops {
 public:
  // `logits` false: a tensor-parallel rank other than 0, whose steps form no logits.
  CudaOps(DType act, void* stream, cuda::Gemm& gemm, Communicator& comm, bool logits = true);

  void set_kv(std::span<const CudaKVLayer> layers, int block_size, int num_blocks, int num_exact = 0);
  // Starts a step whose activations are carved from `carver` (already past the runner's
  // metadata); with `measure`, nothing is launched.
  void begin_step(const CudaStep& step, Carver carver, bool measure);
  // The arena offset reached so far in this step.
  size_t arena_end() const { return carver_.off; }

  int num_tokens() const override { return step_.T; }
  int num_logit_rows() const override { return logits_ ? step_.R : 0; }
  bool pooling() const override { return pooling_; }
  void set_pooling(bool on) { pooling_ = on; }
  Tensor alloc(ActRole role, int64_t rows, int64_t cols) override;
  void embed(const Weight& table, float scale, Tensor x) override;
  void add_rmsnorm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) override;
  void rmsnorm(Tensor x, const Weight& w, float eps, Tensor out) override;
  void final_norm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) override;
  void linear(Tensor x, const Weight& w, const Weight& bias, Tensor y) override;
  void mlp_down(GluActivation f, Tensor gu, const Weight& w, const Weight& bias, Tensor y) override;
  void attention_prologue(int layer, Tensor qkv, const PrologueWeights& w, Tensor q) override;
  void attention(int layer, Tensor q, Tensor out, float softmax_scale, const Weight& sinks) override;
  void moe(Tensor x, const MoeConfig& c, const MoeWeights& w, Tensor y) override;
  void gated_delta_net(int linear_layer, const LinearAttentionConfig& c, Tensor mixed, const GatedDeltaNetWeights& w,
                       Tensor out) override;
  void sigmoid_gate(Tensor x, Tensor src, int64_t col0) override;
  void all_reduce_sum(Tensor x) override;
  // Each Gated DeltaNet layer's states ([slots][state_values] fp32, device), by linear layer.
  void set_states(std::vector<uint8_t*> per_layer) { states_ = std::move(per_layer); }
  void capture(int layer, Tensor x) override;

  // Where an FP8 weight is dequantized for a GEMM of more rows than the FP8 GEMV takes and
  // the FP8 GEMM does not (the runner's buffer of its largest FP8 weight; null: the model has
  // none), the largest input size of its FP8 weights (the per-token quantized activations'
  // buffer), and how the FP8 GEMMs quantize their activations when every FP8 weight does it
  // alike (0: per token, 128: per 128-value group; -1: mixed or none), so that the norms
  // before them can quantize their output on the way (rmsnorm_fp8_fits).
  void set_fp8_scratch(void* p, int max_cols, int act_group) {
    fp8_scratch_ = p;
    fp8_max_cols_ = max_cols;
    fp8_norm_group_ = act_group;
  }

  // A drafter's features: slot_of[layer] >= 0 for the target layers it reads (empty: none).
  // features() is the step's [T][slots * hidden] Hidden tensor, carved at the first capture.
  void set_capture(std::vector<int> slot_of, int hidden);
  Tensor features() const { return features_; }

 private:
  cuda::PagedAttentionParams attn_params(const CudaKVLayer& L, float softmax_scale) const;
  // A buffer the ops need inside the step, carved at its first use and reused by the step's later
  // calls; one that needs more than it holds (a step's layers may differ: a shared expert's MLP
  // beside the dense ones) carves a larger one. Measuring and running carve alike.
  struct StepBuffer {
    void* data = nullptr;
    size_t bytes = 0;
  };
  void* step_buffer(StepBuffer& b, size_t bytes);
  // fp8_x_ and fp8_x_scales_ (per-token or per-128-group scales of the step's largest FP8 input).
  void carve_fp8_x();
  // y = x . w^T (+ bias) for an FP8 weight: gemv_fp8 at m <= 16 (one pass over the codes; the
  // tensor-core kernel from m = 2); above, with one scale per weight row or 128 x 128 blocks,
  // x quantized per token (per 128-value group for blocks; by the norm before, where it did:
  // norm_codes) and an FP8 tensor-core GEMM (kvlm's gemm_fp8_small for decode batches on
  // Hopper, else cuBLASLt's), else (other scale blocks, or a GPU whose cuBLASLt has no such
  // GEMM) the weight dequantized into the scratch buffer and the 16-bit GEMM. Carves its step
  // buffers also when measuring.
  // The gated MLP's input of an FP8 down projection: f(gate) * up of gu, into act where a path
  // needs it written (the FP8 GEMM's quantizer computes it instead: quantize_glu_rows_fp8).
  struct GluSource {
    GluActivation f;
    const void* gu;
  };
  // y = x . w^T for an FP8 weight; with glu, x is where f(gate) * up goes, computed here.
  void fp8_linear(void* x, const Weight& w, const Weight& bias, void* y, DType out, int m, const GluSource* glu = nullptr);
  // y = x . w^T (+ bias) for a weight of grouped integer codes (Weight::codes).
  void int_linear(const void* x, const Weight& w, const Weight& bias, void* y, DType out, int m);
  // A norm's output quantized for the FP8 GEMM by the norm itself (add_rmsnorm's codes): the
  // FP8 GEMMs that read x = `x` (m rows of k, activations quantized in `group`s) take fp8_x_
  // as it is. Valid until any op other than such a GEMM runs (each clears it: an op may write
  // the tensor, and any other FP8 GEMM overwrites fp8_x_).
  struct Fp8NormCodes {
    const void* x = nullptr;
    int m = 0, k = 0, group = -1;
  };
  // The norm params' codes for an output of rows x cols when the FP8 GEMM after it will want
  // them (carving fp8_x_ as fp8_linear does); sets or clears fp8_norm_codes_.
  void norm_codes(cuda::AddRmsNormParams& p, const Tensor& out);

  DType act_;
  void* stream_;
  cuda::Gemm& gemm_;
  Communicator& comm_;
  bool logits_ = true;
  bool pooling_ = false;
  std::span<const CudaKVLayer> layers_;
  int block_size_ = 0, num_blocks_ = 0, num_exact_ = 0;
  CudaStep step_;
  Carver carver_;
  bool measure_ = false;
  void* attn_ws_ = nullptr;
  void* fp8_scratch_ = nullptr;
  int fp8_max_cols_ = 0;
  StepBuffer fp8_x_;         // the step's activations quantized per token, [T][fp8_max_cols_]
  StepBuffer fp8_x_scales_;  // their scales, [T]
  int fp8_norm_group_ = -1;
  Fp8NormCodes fp8_norm_codes_;
  size_t attn_ws_bytes_ = 0;
  StepBuffer attn_bf16_;   // float16 models: the attention output before conversion
  StepBuffer glu_act_;     // mlp_down's input when SiLU-and-mul is not fused
  StepBuffer moe_logits_;  // the router's fp32 logits [T][E]
  StepBuffer moe_ws_;      // the MoE kernels' workspace (cuda/moe.h)
  StepBuffer gdn_qkv_;     // Gated DeltaNet: the conv's fp32 output [T][conv_dim]
  StepBuffer gdn_core_;    // and the delta rule's [T][value_dim]
  StepBuffer gdn_chunk_;   // and, for prompts, the chunked form's (gated_delta_net_scratch_floats)
  std::vector<uint8_t*> states_;  // per Gated DeltaNet layer: [slots][state_bytes]
  std::vector<int> slot_of_;
  int slots_ = 0, hidden_ = 0;
  Tensor features_;
};

}  // namespace kvlm

// The device-neutral ops a model's forward is written against (model/architecture.h).
//
// A model definition states its forward once, as calls on `Ops`; each device implements
// them: the CPU ops (model/cpu/cpu_runner.cpp) in fp32 are the reference, the CUDA ops
// (model/cuda/cuda_ops.cpp) enqueue the fast kernels on the runner's stream, so CUDA graph
// capture and programmatic dependent launch see exactly the launches they saw before the
// forward was shared. It is a small eager interface: every call runs (or enqueues) at once.
//
// One step: the runner lays out the step's metadata (tokens, positions, slots, the
// sequences' block tables, the rows whose logits are wanted) where its device reads it,
// points the ops at it, and calls the definition's forward, which allocates its activations
// through alloc() in a fixed order (the CUDA runner first runs the forward in a measuring
// mode to size its arena, so the same shape always gets the same addresses).
#pragma once

#include <cstdint>
#include <span>

#include "config/model_config.h"  // GluActivation
#include "core/dtype.h"
#include "core/error.h"

namespace kvlm {

// What an activation holds; each device chooses its element type per role.
enum class ActRole : uint8_t {
  Residual,  // the residual stream: fp32 on every device
  Hidden,    // values between ops: fp32 on the CPU, the compute dtype (bf16/fp16) on CUDA
  Query,     // attention queries after the prologue: fp32 on the CPU, bf16 on CUDA
  Logits,    // fp32 on every device
};

// A step's activation on the ops' device, row-major [rows][cols].
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;
  explicit operator bool() const { return data != nullptr; }
  int64_t numel() const { return rows * cols; }
};

// Rows [row0, row0 + rows) of a matrix kept in a GGUF file's quantization blocks, all of ggml
// type `type` (io/gguf.h): row r of the part is the `row_bytes` at data + r * row_bytes.
struct WeightBlocks {
  int64_t row0 = 0, rows = 0;
  uint32_t type = 0;
  const uint8_t* data = nullptr;
  size_t row_bytes = 0;
};

// Rows [row0, row0 + rows) of a matrix a GPU keeps as grouped integer codes
// (io/grouped_codes.h, ops/cuda/gemm.h IntWeight), all of one layout: codes [rows][cols * bits
// / 8], then one 32-bit (scale, offset) pair per group of `group` columns, [rows][cols / group].
struct WeightCodes {
  int64_t row0 = 0, rows = 0;
  int bits = 0, group = 0;
  bool zero_point = false;  // params hold (s, z) in the form grouped_param_zero_point writes
  bool e2m1 = false;        // 4-bit E2M1 codes (MXFP4), params as grouped_param_e2m1 writes
  const uint8_t* codes = nullptr;
  const uint32_t* params = nullptr;
};

// A weight on the ops' device: a matrix [rows][cols] in PyTorch's Linear layout
// ([out][in]), or a vector (cols = 1). Empty (null) for an absent optional weight.
struct Weight {
  const void* data = nullptr;
  DType dtype = DType::F32;  // F8E4M3: data holds FP8 codes, scaled by `scales` (a GPU's FP8 weights)
  int64_t rows = 0, cols = 0;
  const float* scales = nullptr;  // F8E4M3: [rows][cols / scale_block]
  int scale_block = 0;
  // F8E4M3 with 128 x 128 blocks (scale_block 128): one scale per block, [ceil(rows / 128)]
  // [ceil(cols / 128)] (the FP8 GEMM's layout); null when the blocks do not align.
  const float* block_scales = nullptr;
  // A matrix the device keeps in its GGUF blocks (WeightSink::keeps_blocks): its rows in parts
  // of one block type each (a fused q/k/v whose parts the file stores in different types);
  // `data` is the first part's. Empty for every other weight.
  std::span<const WeightBlocks> blocks;
  // A matrix a GPU keeps as grouped integer codes (GGUF blocks converted at load): its rows in
  // parts of one layout each (Q4_K rows become 4-bit codes, Q6_K rows 8-bit ones); `data` is
  // the first part's codes. Empty for every other weight.
  std::span<const WeightCodes> codes;
  explicit operator bool() const { return data != nullptr; }
  int64_t numel() const { return rows * cols; }
};

// The attention prologue of one layer: per-head RMSNorm of q and k (Qwen3, Gemma 3; empty
// weights skip it), rotary embedding with this layer's frequencies, then K and V quantized
// into the layer's pages as its KVLayerSpec says.
struct PrologueWeights {
  Weight q_norm, k_norm;  // fp32 [head_dim] or empty
  Weight inv_freq;        // fp32 [head_dim / 2]
  float eps = 1e-6f;      // of the q/k norms
};

// A mixture-of-experts MLP's weights (MoeConfig says how they combine). Expert e's rows of
// gate_up are [e * 2I, e * 2I + I) for the gate and the next I for up (I = the expert width,
// per rank under tensor parallelism); its rows of down are [e * H, (e + 1) * H).
struct MoeWeights {
  Weight router, router_bias;   // [E][H], [E] or empty
  Weight gate_up, gate_up_bias; // [E * 2I][H], [E * 2I] or empty
  Weight down, down_bias;       // [E * H][I], [E * H] or empty
  // The shared expert (MoeConfig::shared_expert_size S > 0): [2S][H] gate then up, [H][S], and
  // the gate's [1][H]; empty otherwise.
  Weight shared_gate_up, shared_down, shared_gate;
};

// A Gated DeltaNet layer's own weights beside its projections (LinearAttentionConfig says the
// sizes): the causal conv's [conv_dim][kernel] taps, A_log and dt_bias per value head, and the
// gated RMSNorm's [v_dim], all fp32.
struct GatedDeltaNetWeights {
  Weight conv, a_log, dt_bias, norm;
  float eps = 1e-6f;  // of the gated norm
};

class Ops {
 public:
  virtual ~Ops() = default;

  // The step: number of token rows, and of rows whose logits are wanted.
  virtual int num_tokens() const = 0;
  virtual int num_logit_rows() const = 0;
  // A pooling step (ModelRunner::set_pooling): the logit rows' final-normed hidden states are
  // the step's output (fp32, ActRole::Logits), and no LM head runs.
  virtual bool pooling() const { return false; }

  // An activation that lives until the step ends.
  virtual Tensor alloc(ActRole role, int64_t rows, int64_t cols) = 0;

  // x[r] = table[token r] * scale  (the residual stream, fp32).
  virtual void embed(const Weight& table, float scale, Tensor x) = 0;
  // x += delta (when delta is non-empty), then out = RMSNorm(x) * w, in fp32.
  virtual void add_rmsnorm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) = 0;
  // out = RMSNorm(x) * w, in fp32, on Hidden values (Gemma's norms after attention and MLP).
  // out may be x.
  virtual void rmsnorm(Tensor x, const Weight& w, float eps, Tensor out) = 0;
  // The final norm of the rows whose logits are wanted: out[r] = RMSNorm(x[row r] + delta[row r]) * w;
  // x is left as it is. out has num_logit_rows() rows.
  virtual void final_norm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) = 0;
  // y = x . w^T (+ bias).
  virtual void linear(Tensor x, const Weight& w, const Weight& bias, Tensor y) = 0;
  // y = (f(gate) * up) . w^T (+ bias), where gu = [gate | up] (the fused gate/up projection).
  virtual void mlp_down(GluActivation f, Tensor gu, const Weight& w, const Weight& bias, Tensor y) = 0;
  // Layer `layer`'s prologue on the fused projection qkv = [q heads | k heads | v heads]: q
  // (normed, rotated) into `q`, K and V into the layer's pages at the step's slots.
  virtual void attention_prologue(int layer, Tensor qkv, const PrologueWeights& w, Tensor q) = 0;
  // Paged attention of `q` over layer `layer`'s KV with the layer's mask -> out (Hidden).
  // `sinks`: the layer's learned attention sinks, fp32 [num_q_heads], or empty (AttentionCall).
  virtual void attention(int layer, Tensor q, Tensor out, float softmax_scale, const Weight& sinks) = 0;
  // y = the mixture of experts `c` over x (Hidden rows): each row's router picks its top_k
  // experts, whose gated MLPs' outputs (+ biases) are summed with the router's weights; with a
  // shared expert (c.shared_expert_size), plus sigmoid(x . shared_gate) times its gated MLP.
  virtual void moe(Tensor x, const MoeConfig& c, const MoeWeights& w, Tensor y) = 0;
  // Gated DeltaNet's token mixer (ops/cpu/linear_attention.h) for Gated DeltaNet layer
  // `linear_layer` (its index among the model's linear layers, which picks its states): mixed =
  // the input projection [num_tokens][q | k | v | z | b | a] (LinearAttentionConfig::in_proj_dim)
  // -> out [num_tokens][value_dim], the gated-normed output before out_proj. Each sequence of the
  // step reads and updates its state in the layer (a sequence whose first row is position 0
  // starts from zeros). A device without the kernels throws.
  virtual void gated_delta_net(int linear_layer, const LinearAttentionConfig& c, Tensor mixed,
                               const GatedDeltaNetWeights& w, Tensor out);
  // x[r][i] *= sigmoid(src[r][col0 + i]) for i < x.cols (a gated attention output, the gate
  // taken from the fused projection's columns after q | k | v). A device without it throws.
  virtual void sigmoid_gate(Tensor x, Tensor src, int64_t col0);
  // A drafter's conditioning (DFlash): `x`, the residual stream [num_tokens][hidden], holds
  // the output of layer `layer` (Hugging Face's hidden_states[layer + 1]); the step keeps it
  // when the drafter reads that layer. Definitions call this as soon as a layer's output
  // exists (at the next layer's first norm); a step without a drafter ignores it.
  virtual void capture(int layer, Tensor x) {
    (void)layer;
    (void)x;
  }
  // Sums x over the ranks of the runner's communicator (model/communicator.h), in place:
  // after a projection whose input dimension is split across ranks. One rank: nothing.
  virtual void all_reduce_sum(Tensor x) = 0;
};

inline void Ops::gated_delta_net(int, const LinearAttentionConfig&, Tensor, const GatedDeltaNetWeights&, Tensor) {
  throw Error("this device has no Gated DeltaNet kernels (Qwen3.5, Qwen3-Next); use --device cpu or cuda");
}
inline void Ops::sigmoid_gate(Tensor, Tensor, int64_t) {
  throw Error("this device has no gated attention output (Qwen3.5, Qwen3-Next); use --device cpu or cuda");
}

}  // namespace kvlm

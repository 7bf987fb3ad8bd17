#include "model/cuda/cuda_ops.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/log.h"
#include "ops/cuda/gated_deltanet.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/model_ops.h"
#include "ops/cuda/moe.h"

namespace kvlm {

namespace {

cuda::IntWeight int_weight(const WeightCodes& c) {
  return {.codes = c.codes, .params = c.params, .bits = c.bits, .group = c.group, .zero_point = c.zero_point,
          .e2m1 = c.e2m1};
}

}  // namespace

CudaOps::CudaOps(DType act, void* stream, cuda::Gemm& gemm, Communicator& comm, bool logits)
    : act_(act), stream_(stream), gemm_(gemm), comm_(comm), logits_(logits) {}

void CudaOps::set_kv(std::span<const CudaKVLayer> layers, int block_size, int num_blocks, int num_exact) {
  layers_ = layers;
  block_size_ = block_size;
  num_blocks_ = num_blocks;
  num_exact_ = num_exact;
}

cuda::PagedAttentionParams CudaOps::attn_params(const CudaKVLayer& L, float softmax_scale) const {
  return cuda::PagedAttentionParams{
      .storage = L.storage, .quant = L.quant, .v_format = L.v_format, .num_seqs = step_.S, .num_tokens = step_.T,
      .num_q_heads = L.num_q_heads, .num_kv_heads = L.num_kv_heads, .head_dim = L.head_dim,
      .block_size = block_size_, .max_blocks_per_seq = step_.MB, .max_q_len = step_.max_q,
      .max_kv_len = step_.max_kv, .mask = L.kind, .window = L.window, .softmax_scale = softmax_scale,
      .q = nullptr, .out = nullptr, .k_cache = L.k, .v_cache = L.v, .k_token_scale = L.k_scale,
      .v_token_scale = L.v_scale, .k_tensor_scale = L.k_tensor_scale, .v_tensor_scale = L.v_tensor_scale,
      .num_tensor_scales = L.num_tensor_scales, .cu_q_lens = step_.cu_q_lens, .kv_lens = step_.kv_lens,
      .block_tables = step_.block_tables, .exact_k = L.exact_k, .exact_v = L.exact_v,
      .exact_tables = L.exact_k ? step_.exact_tables : nullptr, .keep_sink = L.keep_sink, .keep_recent = L.keep_recent,
      .exact_f16 = act_ == DType::F16, .workspace = attn_ws_, .workspace_bytes = attn_ws_bytes_};
}

void CudaOps::begin_step(const CudaStep& step, Carver carver, bool measure) {
  step_ = step;
  carver_ = carver;
  measure_ = measure;
  attn_bf16_ = glu_act_ = fp8_x_ = fp8_x_scales_ = moe_logits_ = moe_ws_ = gdn_qkv_ = gdn_core_ = gdn_chunk_ =
      StepBuffer{};
  fp8_norm_codes_ = {};
  features_ = Tensor{};
  // The split-KV workspace: the largest any layer's format needs for this shape.
  attn_ws_ = nullptr;
  attn_ws_bytes_ = 0;
  size_t ws = 0;
  for (const CudaKVLayer& L : layers_) ws = std::max(ws, cuda::paged_attention_workspace_bytes(attn_params(L, 1.0f)));
  attn_ws_ = carver_.take_bytes(ws);
  attn_ws_bytes_ = ws;
}

void CudaOps::set_capture(std::vector<int> slot_of, int hidden) {
  slot_of_ = std::move(slot_of);
  slots_ = int(std::ranges::count_if(slot_of_, [](int s) { return s >= 0; }));
  hidden_ = hidden;
}

void CudaOps::capture(int layer, Tensor x) {
  if (layer < 0 || size_t(layer) >= slot_of_.size() || slot_of_[size_t(layer)] < 0) return;
  if (!features_) features_ = alloc(ActRole::Hidden, step_.T, int64_t(slots_) * hidden_);
  if (measure_) return;
  const int slot = slot_of_[size_t(layer)];
  cuda::f32_rows_to_act(act_, static_cast<const float*>(x.data), step_.T, hidden_,
                        static_cast<uint16_t*>(features_.data) + size_t(slot) * size_t(hidden_), slots_ * hidden_, stream_);
}

void* CudaOps::step_buffer(StepBuffer& b, size_t bytes) {
  if (!b.data || bytes > b.bytes) b = StepBuffer{.data = carver_.take_bytes(bytes), .bytes = bytes};
  return b.data;
}

void CudaOps::carve_fp8_x() {
  step_buffer(fp8_x_, size_t(step_.T) * size_t(fp8_max_cols_));
  step_buffer(fp8_x_scales_, size_t(step_.T) * size_t(std::max(1, fp8_max_cols_ / 128)) * sizeof(float));
}

Tensor CudaOps::alloc(ActRole role, int64_t rows, int64_t cols) {
  DType t = DType::F32;
  switch (role) {
    case ActRole::Residual:
    case ActRole::Logits: t = DType::F32; break;
    case ActRole::Hidden: t = act_; break;
    case ActRole::Query: t = DType::BF16; break;
  }
  void* p = carver_.take_bytes(size_t(rows * cols) * dtype_size(t));
  return Tensor{.data = p, .dtype = t, .rows = rows, .cols = cols};
}

void CudaOps::embed(const Weight& table, float scale, Tensor x) {
  fp8_norm_codes_ = {};
  if (measure_) return;
  if (!table.codes.empty()) {
    KVLM_CHECK(table.codes.size() == 1, "an embedding table of grouped codes in one part");
    const WeightCodes& c = table.codes[0];
    const cuda::IntWeight w = int_weight(c);
    cuda::embed_rows_int(act_, w, step_.tokens, int(x.rows), int(x.cols), static_cast<float*>(x.data), stream_, scale);
    return;
  }
  cuda::embed_rows(act_, table.data, step_.tokens, int(x.rows), int(x.cols), static_cast<float*>(x.data), stream_, scale);
}

void CudaOps::norm_codes(cuda::AddRmsNormParams& p, const Tensor& out) {
  fp8_norm_codes_ = {};
  const int m = int(out.rows), k = int(out.cols);
  // Where fp8_linear will quantize this output for an FP8 GEMM: above the GEMV's rows, every
  // FP8 weight quantizing its input alike, an input no larger than the buffers'. Decode batches
  // only (m <= 64): there the norm's CTA per row has time to spare and the quantizer's launch
  // is what costs (24-64 x 4k steps 1-2% faster on an H200), while for 4096-row batches the
  // norm quantizing its 4096 rows made the step 4.5% slower (97.4 vs 93.2 ms) than the
  // quantizer's own pass.
  if (fp8_norm_group_ < 0 || m <= cuda::kGemvFp8MaxM || m > cuda::kGemmFp8SmallMaxM || m > step_.T ||
      k > fp8_max_cols_ ||
      !cuda::rmsnorm_fp8_fits(k, fp8_norm_group_) || !cuda::kernel_switches().fp8_gemm ||
      !cuda::kernel_switches().fp8_norm_codes)
    return;
  carve_fp8_x();
  p.codes = static_cast<uint8_t*>(fp8_x_.data);
  p.code_scales = static_cast<float*>(fp8_x_scales_.data);
  p.code_group = fp8_norm_group_;
  fp8_norm_codes_ = {.x = out.data, .m = m, .k = k, .group = fp8_norm_group_};
}

void CudaOps::add_rmsnorm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) {
  cuda::AddRmsNormParams p{.act = act_, .rows = int(x.rows), .hidden = int(x.cols), .x = static_cast<float*>(x.data),
                           .delta = delta.data, .weight = static_cast<const float*>(w.data), .eps = eps,
                           .out = out.data};
  norm_codes(p, out);
  if (measure_) return;
  cuda::add_rmsnorm(p, stream_);
}

void CudaOps::rmsnorm(Tensor x, const Weight& w, float eps, Tensor out) {
  cuda::AddRmsNormParams p{.act = act_, .rows = int(x.rows), .hidden = int(x.cols), .x = nullptr, .delta = x.data,
                           .weight = static_cast<const float*>(w.data), .eps = eps, .out = out.data};
  norm_codes(p, out);
  if (measure_) return;
  cuda::add_rmsnorm(p, stream_);
}

void CudaOps::final_norm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) {
  fp8_norm_codes_ = {};
  if (measure_) return;
  const bool f32 = out.dtype == DType::F32;  // a pooling step's output
  cuda::add_rmsnorm({.act = act_, .rows = int(out.rows), .hidden = int(x.cols), .x = static_cast<float*>(x.data),
                     .delta = delta.data, .weight = static_cast<const float*>(w.data), .eps = eps,
                     .out = f32 ? nullptr : out.data, .row_map = step_.logit_rows,
                     .out_f32 = f32 ? static_cast<float*>(out.data) : nullptr},
                    stream_);
}

void CudaOps::fp8_linear(void* x, const Weight& w, const Weight& bias, void* y, DType out, int m, const GluSource* glu) {
  const cuda::Fp8Weight f{.codes = static_cast<const uint8_t*>(w.data), .scales = w.scales,
                          .scale_block = w.scale_block, .block_scales = w.block_scales};
  const int n = int(w.rows), k = int(w.cols);
  const bool gemv = m <= cuda::kGemvFp8MaxM && gemm_.small_m_kernel(1);  // small-m kernels on (--no-gemv: off)
  // Block-scaled weights quantize the activations per 128-value group, the others per token.
  const bool block = w.scale_block < k;
  const bool gemm_fits = cuda::fp8_gemm_fits(n, k, w.scale_block) && (!block || w.block_scales);
  // x quantized by the norm that wrote it (norm_codes), as this GEMM quantizes it: kept for the
  // next GEMM on the same x; any other FP8 linear clears it (its quantization, if any, writes fp8_x_).
  const Fp8NormCodes ready = fp8_norm_codes_;
  const bool have_codes = !glu && ready.x == x && ready.m == m && ready.k == k && ready.group == (block ? 128 : 0);
  if (!have_codes) fp8_norm_codes_ = {};
  if (!gemv && fp8_max_cols_ > 0 && gemm_fits) {
    // (carved whether or not the GEMM runs, so that measuring and running carve the same)
    KVLM_CHECK(m <= step_.T && k <= fp8_max_cols_, "an FP8 GEMM larger than its step buffers");
    carve_fp8_x();
    if (measure_) return;
  }
  if (!gemv && fp8_x_.data && gemm_fits && cuda::kernel_switches().fp8_gemm) {
    auto* codes = static_cast<uint8_t*>(fp8_x_.data);
    auto* scales = static_cast<float*>(fp8_x_scales_.data);
    // x's codes and scales for the GEMM's first `rows` rows. The norm's serve where their layout
    // is the GEMM's: per token any prefix of rows; per group, whose scales are [k / 128][rows],
    // only all m rows.
    auto quantize = [&](int rows) {
      if (glu) {
        cuda::quantize_glu_rows_fp8(act_, glu->f, glu->gu, codes, scales, rows, k, stream_, block ? 128 : 0);
      } else if (!have_codes || (block && rows != m)) {
        cuda::quantize_rows_fp8(act_, x, codes, scales, rows, k, stream_, block ? 128 : 0);
        fp8_norm_codes_ = {};  // fp8_x_ holds this quantization now
      }
    };
    // Block-scaled weights above 32 rows stay on cuBLASLt's 128 x 128 kernels, which beat
    // kvlm's N = 64 tile there (a Qwen3-8B layer 88 vs 96 µs at m = 64; at m = 32 kvlm's 79 vs
    // 88; H200, docs/results/kernel-lab.md).
    if (cuda::kernel_switches().fp8_small_gemm && cuda::gemm_fp8_small_available() &&
        cuda::gemm_fp8_small_fits(m, k, w.scale_block) && (!block || m <= 32) &&
        (out != DType::F32 || !bias.data)) {
      // Decode batches: kvlm's kernel, one pass over the codes.
      quantize(m);
      cuda::gemm_fp8_small(out, codes, scales, f, bias.data, y, m, n, k, stream_);
      return;
    }
    // cuBLASLt: the GEMM's rows (block scales: a multiple of 4), then the rest (< 4) through gemv_fp8.
    const int mg = cuda::fp8_gemm_rows(m, k, w.scale_block);
    quantize(mg);
    if (gemm_.linear_fp8(out, codes, scales, f, bias.data, y, mg, n, k, stream_)) {
      if (mg < m) {
        const size_t out_bytes = dtype_size(out);
        if (glu)  // the rows past the GEMM's need f(gate) * up written
          cuda::glu(act_, glu->f, static_cast<const uint8_t*>(glu->gu) + size_t(mg) * size_t(2 * k) * dtype_size(act_),
                    static_cast<uint8_t*>(x) + size_t(mg) * size_t(k) * dtype_size(act_), m - mg, k, stream_);
        cuda::gemv_fp8(act_, out, static_cast<const uint8_t*>(x) + size_t(mg) * size_t(k) * dtype_size(act_), f,
                       bias.data, static_cast<uint8_t*>(y) + size_t(mg) * size_t(n) * out_bytes, m - mg, n, k, stream_);
      }
      return;
    }
    // No algorithm for this shape (found on its first, eager use): the dequantizing path.
    log::warn_once("fp8-gemm-shape", "cuBLASLt has no FP8 GEMM for some shapes here (first: m=" + std::to_string(mg) +
                                         " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                                         "); those dequantize the weight for a 16-bit GEMM");
  }
  if (measure_) return;
  if (glu) cuda::glu(act_, glu->f, glu->gu, x, m, k, stream_);
  if (gemv) {
    // One pass over the FP8 bytes for all m rows (the tensor-core kernel from m = 2).
    cuda::gemv_fp8(act_, out, x, f, bias.data, y, m, int(w.rows), int(w.cols), stream_);
    return;
  }
  KVLM_CHECK(fp8_scratch_ != nullptr, "an FP8 weight without the runner's dequantization buffer");
  cuda::dequantize_fp8(act_, f, fp8_scratch_, int(w.rows), int(w.cols), stream_);
  gemm_.linear(act_, out, x, fp8_scratch_, bias.data, y, m, int(w.rows), int(w.cols), stream_);
}

// Grouped integer codes, part by part into its rows of y: up to 16 rows of x the GEMV, up to 64
// gemm_int (one pass over the codes for all rows: 0.56-1.13 bytes per weight); above that each
// part dequantized into its rows of the scratch and one 16-bit GEMM, which reads the codes,
// writes 2 bytes per weight and reads them again but runs cuBLASLt's tiles: at 128 rows that
// already beats two passes of gemm_int on most Qwen3-8B matrices (docs/results/weights-4bit.md).
// GPUs without gemm_int's shared memory run the GEMV in passes of 16 up to 64 rows instead.
void CudaOps::int_linear(const void* x, const Weight& w, const Weight& bias, void* y, DType out, int m) {
  if (measure_) return;
  const int n = int(w.rows), k = int(w.cols);
  const bool direct = m <= cuda::kGemmIntMaxM;
  const bool gemm_int = direct && m > cuda::kGemvIntMaxM && cuda::gemm_int_available(cuda::gemm_int_tile_rows(m, n));
  KVLM_CHECK(direct || fp8_scratch_ != nullptr, "a weight of grouped codes without the runner's dequantization buffer");
  for (const WeightCodes& p : w.codes) {
    const cuda::IntWeight iw = int_weight(p);
    if (direct) {
      // biases are in the compute dtype (gpu_weight_dtype)
      const void* b = bias ? static_cast<const uint8_t*>(bias.data) + size_t(p.row0) * dtype_size(act_) : nullptr;
      if (gemm_int) {
        cuda::gemm_int(act_, out, x, iw, b, static_cast<uint8_t*>(y) + size_t(p.row0) * dtype_size(out), n, m,
                       int(p.rows), k, stream_);
        continue;
      }
      for (int r0 = 0; r0 < m; r0 += cuda::kGemvIntMaxM)
        cuda::gemv_int(act_, out, static_cast<const uint8_t*>(x) + size_t(r0) * size_t(k) * dtype_size(act_), iw, b,
                       static_cast<uint8_t*>(y) + (size_t(r0) * size_t(n) + size_t(p.row0)) * dtype_size(out), n,
                       std::min(cuda::kGemvIntMaxM, m - r0), int(p.rows), k, stream_);
    } else {
      cuda::dequantize_int(act_, iw, static_cast<uint8_t*>(fp8_scratch_) + size_t(p.row0) * size_t(k) * dtype_size(act_),
                           int(p.rows), k, stream_);
    }
  }
  if (!direct) gemm_.linear(act_, out, x, fp8_scratch_, bias.data, y, m, n, k, stream_);
}

void CudaOps::linear(Tensor x, const Weight& w, const Weight& bias, Tensor y) {
  if (w.dtype == DType::F8E4M3) return fp8_linear(x.data, w, bias, y.data, y.dtype, int(x.rows));
  if (!w.codes.empty()) {
    fp8_norm_codes_ = {};
    return int_linear(x.data, w, bias, y.data, y.dtype, int(x.rows));
  }
  fp8_norm_codes_ = {};
  if (measure_) return;
  gemm_.linear(act_, y.dtype, x.data, w.data, bias.data, y.data, int(x.rows), int(w.rows), int(x.cols), stream_);
}

void CudaOps::mlp_down(GluActivation f, Tensor gu, const Weight& w, const Weight& bias, Tensor y) {
  fp8_norm_codes_ = {};
  const int T = int(gu.rows), I = int(gu.cols / 2), H = int(w.rows);
  // Carved whether or not it is used, so that measuring and running carve the same.
  void* act = step_buffer(glu_act_, size_t(T) * size_t(I) * dtype_size(act_));
  if (w.dtype == DType::F8E4M3) {
    // Above the GEMV's rows the FP8 GEMM's activation quantizer computes f(gate) * up itself
    // (one read of gu instead of glu's write and the quantizer's read). Not fused into the GEMV
    // at batch 1: its warps own 2 rows each, so a fused SiLU-and-mul would be recomputed by every
    // warp (2048 times per element at down_proj's 4096 rows), ~0.4 ms of a Qwen3-8B step; there
    // fp8_linear runs one glu pass.
    const GluSource src{.f = f, .gu = gu.data};
    fp8_linear(act, w, bias, y.data, act_, T, &src);
    return;
  }
  if (measure_) return;
  if (!w.codes.empty()) {
    cuda::glu(act_, f, gu.data, act, T, I, stream_);
    return int_linear(act, w, bias, y.data, act_, T);
  }
  if (f == GluActivation::Silu && T == 1 && gemm_.small_m_kernel(T) && cuda::gemv_fits(T, I, gu.data, w.data)) {
    // batch 1: SiLU-and-mul fused into the GEMV's input
    cuda::gemv_small_m(act_, act_, gu.data, w.data, bias.data, y.data, T, H, I, stream_, 0, /*glu_input=*/true);
  } else {
    cuda::glu(act_, f, gu.data, act, T, I, stream_);
    gemm_.linear(act_, act_, act, w.data, bias.data, y.data, T, H, I, stream_);
  }
}

void CudaOps::attention_prologue(int layer, Tensor qkv, const PrologueWeights& w, Tensor q) {
  fp8_norm_codes_ = {};
  if (measure_) return;
  const CudaKVLayer& L = layers_[size_t(layer)];
  cuda::qkv_rope_store({.act = act_, .storage = L.storage, .quant = L.quant, .v_format = L.v_format,
                        .num_tokens = int(qkv.rows),
                        .num_q_heads = L.num_q_heads, .num_kv_heads = L.num_kv_heads, .head_dim = L.head_dim,
                        .qkv = qkv.data, .qkv_stride = qkv.cols,
                        .q_norm = static_cast<const float*>(w.q_norm.data),
                        .k_norm = static_cast<const float*>(w.k_norm.data), .eps = w.eps,
                        .positions = step_.positions, .inv_freq = static_cast<const float*>(w.inv_freq.data),
                        .rotary_dim = int(2 * w.inv_freq.rows),
                        .q_out = static_cast<uint16_t*>(q.data), .slots = step_.slots, .block_size = block_size_,
                        .num_blocks = num_blocks_, .k_cache = L.k, .v_cache = L.v, .k_token_scale = L.k_scale,
                        .v_token_scale = L.v_scale, .k_tensor_scale = L.k_tensor_scale,
                        .v_tensor_scale = L.v_tensor_scale, .num_tensor_scales = L.num_tensor_scales,
                        .rotate_k = L.rotate_k, .rotate_v = L.rotate_v, .rotation_seed = L.rotation_seed,
                        .exact_slots = L.exact_k ? step_.exact_slots : nullptr,
                        .exact_k = L.exact_k, .exact_v = L.exact_v, .num_exact = num_exact_},
                       stream_);
}

void CudaOps::attention(int layer, Tensor q, Tensor out, float softmax_scale, const Weight& sinks) {
  fp8_norm_codes_ = {};
  // The kernels write bf16; a float16 model converts for the o projection.
  void* bf16_out = out.data;
  if (act_ != DType::BF16) bf16_out = step_buffer(attn_bf16_, size_t(out.numel()) * 2);
  if (measure_) return;
  const CudaKVLayer& L = layers_[size_t(layer)];
  cuda::PagedAttentionParams p = attn_params(L, softmax_scale);
  p.q = static_cast<const uint16_t*>(q.data);
  p.out = static_cast<uint16_t*>(bf16_out);
  p.sinks = static_cast<const float*>(sinks.data);  // fp32 [heads] (a norm's role), or null
  cuda::paged_attention(p, stream_);
  if (L.rotate_v)  // the output is a sum of rotated V rows: R^T per head, converted to act on the way
    cuda::unrotate_heads(act_, static_cast<const uint16_t*>(bf16_out), out.data, out.numel() / L.head_dim, L.head_dim,
                         L.rotation_seed, stream_);
  else if (act_ != DType::BF16)
    cuda::bf16_to_act(act_, static_cast<const uint16_t*>(bf16_out), out.data, size_t(out.numel()), stream_);
}

void CudaOps::moe(Tensor x, const MoeConfig& c, const MoeWeights& w, Tensor y) {
  fp8_norm_codes_ = {};
  const int T = int(x.rows), H = int(x.cols), E = c.num_experts, held = c.held_experts();
  const int I = int(w.gate_up.rows / (2 * int64_t(held)));
  KVLM_CHECK(w.router.rows == E && w.down.rows == int64_t(held) * H && w.down.cols == I && y.cols == H,
             "moe: weight shapes");
  // Experts kept as grouped codes (4-bit checkpoints, GGUF blocks): one layout for all of them.
  auto expert_codes = [&](const Weight& m, const char* what) {
    if (m.codes.size() != 1)
      throw Error(std::string("the experts' ") + what +
                  " weights are not grouped codes of one layout, which the CUDA MoE kernels need when the "
                  "experts are kept quantized; load with --dequantize-weights");
    return int_weight(m.codes.front());
  };
  const bool codes = !w.gate_up.codes.empty() || !w.down.codes.empty();
  cuda::IntWeight gu_codes, down_codes;
  if (codes) gu_codes = expert_codes(w.gate_up, "gate/up"), down_codes = expert_codes(w.down, "down");
  // Carved whether or not it runs, so that measuring and running carve the same.
  auto* logits = static_cast<float*>(step_buffer(moe_logits_, size_t(T) * size_t(E) * sizeof(float)));
  void* ws = step_buffer(moe_ws_, cuda::moe_workspace_bytes(act_, T, H, I, E, c.top_k, codes));
  linear(x, w.router, Weight{}, Tensor{.data = logits, .dtype = DType::F32, .rows = T, .cols = E});  // any held form
  if (!measure_) {
    cuda::moe({.act = act_, .rows = T, .hidden = H, .inter = I, .config = c, .logits = logits,
               .router_bias = w.router_bias.data, .x = x.data, .gate_up = w.gate_up.data,
               .gate_up_bias = w.gate_up_bias.data, .down = w.down.data, .down_bias = w.down_bias.data, .y = y.data,
               .workspace = ws, .gate_up_codes = gu_codes, .down_codes = down_codes},
              stream_);
  }
  if (c.shared_expert_size > 0) {  // y += sigmoid(x . w_gate) * down(silu(gate x) * up x), through the dense ops
    const int64_t S = w.shared_down.cols;
    KVLM_CHECK(w.shared_gate_up.rows == 2 * S && w.shared_down.rows == H && w.shared_gate.rows == 1,
               "moe: shared expert weight shapes");
    const Tensor gu = alloc(ActRole::Hidden, T, 2 * S), s = alloc(ActRole::Hidden, T, H), g = alloc(ActRole::Logits, T, 1);
    linear(x, w.shared_gate_up, Weight{}, gu);
    mlp_down(GluActivation::Silu, gu, w.shared_down, Weight{}, s);
    linear(x, w.shared_gate, Weight{}, g);
    if (!measure_) cuda::add_gated_rows(act_, y.data, s.data, static_cast<const float*>(g.data), T, H, stream_);
  }
}

void CudaOps::gated_delta_net(int linear_layer, const LinearAttentionConfig& c, Tensor mixed,
                              const GatedDeltaNetWeights& w, Tensor out) {
  fp8_norm_codes_ = {};
  const int T = int(mixed.rows);
  KVLM_CHECK(mixed.cols == c.in_proj_dim() && out.rows == T && out.cols == c.value_dim(), "gated_delta_net: shape mismatch");
  auto* qkv = static_cast<float*>(step_buffer(gdn_qkv_, size_t(T) * size_t(c.conv_dim()) * sizeof(float)));
  auto* core = static_cast<float*>(step_buffer(gdn_core_, size_t(T) * size_t(c.value_dim()) * sizeof(float)));
  const size_t chunk_floats = cuda::gated_delta_net_scratch_floats(T, step_.max_q, c.v_heads, c.k_dim, c.v_dim);
  auto* chunk = chunk_floats ? static_cast<float*>(step_buffer(gdn_chunk_, chunk_floats * sizeof(float))) : nullptr;
  if (measure_) return;
  KVLM_CHECK(linear_layer >= 0 && size_t(linear_layer) < states_.size() && states_[size_t(linear_layer)] &&
                 step_.state_slots,
             "Gated DeltaNet layer without states (allocate_states)");
  cuda::gated_delta_net({.act = act_, .num_tokens = T, .num_seqs = step_.S, .k_heads = c.k_heads, .v_heads = c.v_heads,
                         .dk = c.k_dim, .dv = c.v_dim, .conv_kernel = c.conv_kernel, .cu_q_lens = step_.cu_q_lens,
                         .kv_lens = step_.kv_lens, .state_slots = step_.state_slots, .mixed = mixed.data,
                         .conv_w = static_cast<const float*>(w.conv.data),
                         .a_log = static_cast<const float*>(w.a_log.data),
                         .dt_bias = static_cast<const float*>(w.dt_bias.data),
                         .norm_w = static_cast<const float*>(w.norm.data), .eps = w.eps,
                         .states = states_[size_t(linear_layer)], .state_bytes = c.state_bytes(),
                         .state_dtype = c.state_dtype, .max_q_len = step_.max_q, .scratch = chunk, .qkv = qkv,
                         .core = core, .out = out.data},
                        stream_);
}

void CudaOps::sigmoid_gate(Tensor x, Tensor src, int64_t col0) {
  fp8_norm_codes_ = {};
  KVLM_CHECK(x.rows == src.rows && col0 >= 0 && col0 + x.cols <= src.cols, "sigmoid_gate: shape mismatch");
  if (measure_) return;
  cuda::sigmoid_gate(act_, x.data, src.data, int(x.rows), int(x.cols), src.cols, col0, stream_);
}

void CudaOps::all_reduce_sum(Tensor x) {
  fp8_norm_codes_ = {};
  if (measure_ || comm_.world_size() == 1) return;
  comm_.all_reduce_sum(x.data, x.dtype, size_t(x.numel()), stream_);
}

}  // namespace kvlm

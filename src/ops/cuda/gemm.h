// Linear layers on the GPU through cuBLASLt, with no CUDA header: a stream is a `void*`.
//
//   y[m][n] = x[m][k] . w[n][k]^T (+ bias[n])
// x and w (PyTorch Linear layout, row-major [out][in]) are bfloat16 or float16, both the
// same type; accumulation is fp32; y is the same 16-bit type or float32 (logits). The bias
// (same type as y) is added in the GEMM's epilogue. Pointers must be 256-byte aligned
// (cuBLASLt's default alignment assumption; every kvlm device allocation is).
//
// m <= 8 (decode at batch 1-8, short prefill chunks) runs gemv_small_m: kernels that stream
// w once at memory speed, where cuBLASLt's tiles leave bandwidth unused (gemv.cu; figures in
// docs/results/cuda-runner.md). Larger m goes to cuBLASLt: on the first use of a shape its
// heuristic proposes up to 16 algorithms; for m <= 512 (decode batches, short prefill chunks,
// where the choice matters most and timing is cheap) each is timed on the real operands and
// the fastest kept, else the top one. Plans are cached, so a steady state issues no query and
// no timing; the workspace is the caller's (fixed, so calls can be captured in a CUDA graph —
// first uses must not be). set_small_m_kernel(false) sends every m to cuBLASLt (for
// measurements: decode_bench --no-gemv).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "config/model_config.h"  // GluActivation
#include "core/dtype.h"
#include "core/index_types.h"

namespace kvlm::cuda {

inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;
inline constexpr int kGemvMaxM = 4;      // the FMA kernels (variants 1, 2)
inline constexpr int kGemvMmaMaxM = 8;   // the tensor-core kernel (variant 3)

// The small-m kernels on their own (tests, the lab). Need 1 <= m <= kGemvMmaMaxM, k % 8 == 0
// and 16-byte aligned x and w; gemv_fits says whether they apply. variant: 0 = automatic (m = 1:
// the rows or the split kernel by shape; m >= 2: the tensor-core kernel), 1 = the rows kernel,
// 2 = the split-k kernel (both m <= kGemvMaxM), 3 = the tensor-core kernel (gemv.cu). glu_input: x is a fused
// gate/up projection [m][2k] and the kernel's input row is silu(gate) * up, computed on the
// fly in fp32 (SiLU-and-mul fused into the down projection; needs out == ab and m <= kGemvMaxM;
// the tensor-core kernel takes none).
bool gemv_fits(int m, int k, const void* x, const void* w);
void gemv_small_m(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
                  void* stream, int variant = 0, bool glu_input = false);

// A weight held as FP8 E4M3 codes [n][k] with fp32 scales [n][nb], nb = ceil(k / scale_block):
// the value at (r, c) is code * scales[r * nb + c / scale_block]. scale_block = k is one
// scale per row (per-tensor and per-channel checkpoints, --quantization fp8); 128 the
// block-wise formats (their blocks' rows expanded to one scale row per weight row).
struct Fp8Weight {
  const uint8_t* codes = nullptr;
  const float* scales = nullptr;
  int scale_block = 0;
  // scale_block 128: the scales once per 128 x 128 block, [ceil(n / 128)][fp8_block_scale_ld(k)]
  // (a row's ceil(k / 128) blocks padded to a multiple of 4: cuBLASLt's layout for its 128 x 128
  // block scaling, which read unpadded rows of 3 as if they were 4); may be null.
  const float* block_scales = nullptr;
};
// The row stride of Fp8Weight::block_scales for k input columns.
inline constexpr int fp8_block_scale_ld(int k) { return ((k + 127) / 128 + 3) / 4 * 4; }
// Whether GPUs of this compute capability run FP8 weights (sm_89+: the cvt instructions);
// older ones get the weights dequantized at load.
bool fp8_weights_supported(int compute_capability);
// Whether gemv_fp8 / dequantize_fp8 take a row of k with this scale block (k % 16 == 0, the
// block a multiple of 16).
bool fp8_layout_fits(int k, int scale_block);
// Whether gemv_fp8's tensor-core kernel takes it too: one scale per row (scale_block >= k) or
// a block that is a multiple of 64 (the block-wise formats' 128).
bool gemv_fp8_mma_fits(int k, int scale_block);
inline constexpr int kGemvFp8MaxM = 16;  // gemv_fp8's rows of x
// y[m][n] = x[m][k] . dequant(w)[n][k]^T (+ bias), 1 <= m <= kGemvFp8MaxM (gemv_fp8.cu); x, y
// and bias as for gemv_small_m (no SiLU-and-mul input: gemv_fp8.cu says why). variant: 0 =
// automatic (m = 1: an FMA kernel; m >= 2: the tensor-core kernel where gemv_fp8_mma_fits,
// else an FMA kernel), 1 = the rows FMA kernel and 3 = the split-k FMA kernel (kGemvMaxM rows of
// x per pass over the codes), 2 = the tensor-core kernel (one pass for all m rows; needs
// gemv_fp8_mma_fits).
void gemv_fp8(DType ab, DType out, const void* x, const Fp8Weight& w, const void* bias, void* y, int m, int n, int k,
              void* stream, int variant = 0);
// The last tensor-core launch's CTA shape (tiles, cluster split, grid, resident CTAs), for the lab.
std::string gemv_fp8_last_launch();
// The weight in the compute type (bf16 / f16) into out [n][k], for the GEMM at larger m.
void dequantize_fp8(DType to, const Fp8Weight& w, void* out, int n, int k, void* stream);
// Per-token activation quantization for the FP8 GEMM: each row of x [m][k] (bf16 / f16), or
// with group = 128 each 128-value group of a row, gets scale = max |x| / 448 (1 when all
// zero) and its E4M3 codes (core/numeric.h's f32_to_e4m3 of x / scale: round to nearest even,
// saturating) into codes [m][k]. scales: [m] per row; per group [k / 128][m] (token fastest:
// cuBLASLt's VEC128 layout). Needs k % 8 == 0 (group: k % 128 == 0) and 16-byte aligned x and
// codes.
void quantize_rows_fp8(DType ab, const void* x, uint8_t* codes, float* scales, int m, int k, void* stream,
                       int group = 0);
// quantize_rows_fp8 of x = f(gate) * up for the gated MLP's gu = [gate | up] ([m][2k]), x's
// values rounded to ab exactly as model_ops.h's glu writes them, but never written: the down
// projection's FP8 GEMM reads its input once (the codes) instead of three times (glu's write,
// the quantizer's read, the codes). The codes and scales equal those of glu + quantize_rows_fp8.
void quantize_glu_rows_fp8(DType ab, GluActivation f, const void* gu, uint8_t* codes, float* scales, int m, int k,
                           void* stream, int group = 0);
// Whether Gemm::linear_fp8 takes a weight of n rows, k columns and this scale block: one
// scale per row with k, n multiples of 16 (cuBLASLt's FP8 leading dimensions), or 128 x 128
// blocks with k, n multiples of 128 (the activations then quantized per 128-value group).
bool fp8_gemm_fits(int n, int k, int scale_block);
// The rows of m that Gemm::linear_fp8 takes for a weight with this scale block (the first
// ones; the caller runs the rest, fewer than 4, through gemv_fp8): all of them with row
// scales, a multiple of 4 with block scales.
int fp8_gemm_rows(int m, int k, int scale_block);

inline constexpr int kGemmFp8SmallMaxM = 64;  // gemm_fp8_small's rows of x
// Whether gemm_fp8_small runs here: a compute capability 9.0 GPU and sm_90a code in the build
// (it is built on Hopper's FP8 warpgroup MMAs).
bool gemm_fp8_small_available();
// Whether gemm_fp8_small takes m rows and a weight of k columns with this scale block: 1 <= m
// <= kGemmFp8SmallMaxM, k % 16 == 0, and one scale per weight row (scale_block >= k) or 128 x
// 128 blocks (scale_block 128, k % 128 == 0; the weight must carry block_scales).
bool gemm_fp8_small_fits(int m, int k, int scale_block);
// Gemm::linear_fp8's product for decode batches, by a kernel of kvlm's own (gemm_fp8_small.cu:
// one pass over the weight's codes, FP8 wgmma, fp32 sums): x [m][k] E4M3 codes with
// quantize_rows_fp8's scales times w's codes with theirs — per token [m] with row scales, per
// token and 128-value group [k / 128][m] with 128 x 128 blocks (w.block_scales). Needs
// gemm_fp8_small_available and gemm_fp8_small_fits. out: bf16, f16 or f32 (the bias, of out's
// type, needs a 16-bit out). splits > 0 forces the cluster split of k (1, 2, 4 or 8, else an
// Error; for tests and the lab).
void gemm_fp8_small(DType out, const uint8_t* x, const float* x_scales, const Fp8Weight& w, const void* bias, void* y,
                    int m, int n, int k, void* stream, int splits = 0);
// The last gemm_fp8_small launch's shape (N, cluster split, grid, resident CTAs), for the lab.
std::string gemm_fp8_small_last_launch();

// A weight held as grouped integer codes (io/grouped_codes.h): w[r][c] = s * code + b, where
// (s, b) are group c / group of row r, two values of the compute type in one 32-bit word (s in
// the low half), params [n][k / group]; codes [n][k * bits / 8], 4-bit codes 0..15 two per byte
// (the lower column in the low nibble) or 8-bit codes signed. GGUF's block types convert to
// it at load; every 4-bit and 8-bit weight format is to map onto it.
struct IntWeight {
  const uint8_t* codes = nullptr;
  const uint32_t* params = nullptr;
  int bits = 0;   // 4 or 8
  int group = 0;  // columns per (s, b)
  // 4-bit: the words hold (s, -(M + z)) (io/grouped_codes.h grouped_param_zero_point) and
  // w = s * (code - z), the zero point subtracted exactly
  bool zero_point = false;
  // 4-bit: the codes are E2M1 values (MXFP4), the words' low halves a power-of-two multiplier
  // (grouped_param_e2m1): w = E2M1(code) * 2^(e - 127), exact
  bool e2m1 = false;
};
// Whether the kernels take grouped codes of `bits` in groups of `group` for rows of k: a
// lane's 16 bytes of codes must lie in one group (4-bit: k and group multiples of 32; 8-bit:
// of 16) and the groups must tile the row.
bool int_layout_fits(int k, int bits, int group);
inline constexpr int kGemvIntMaxM = 16;  // gemv_int's rows of x
// Whether gemv_int applies the scale after the MMA for this layout (bf16 4-bit codes in groups
// of a multiple of 128, unless KernelSwitches::int_scale_after_mma is off): its weight values
// are then s * code + b exact, not rounded to the compute type.
bool gemv_int_scales_after_mma(DType ab, int bits, int group);
// Whether gemv_int's tensor-core GEMV of an m x k x n product runs the kernel whose CTA shares x
// through shared memory (KernelSwitches::int_shared_x_min_m, int_shared_x_by_shape): at 9-16 rows
// of x, 4-bit codes, k <= 4096 and n >= 6144, where it measured faster (weights-4bit.md).
bool gemv_int_shares_x(const IntWeight& w, int m, int n, int k);
// y[r][c] (row stride ldy >= n) = x[m][k] . w^T (+ bias[n]), 1 <= m <= kGemvIntMaxM
// (gemv_int.cu: one pass over the codes, decoded in registers for the tensor cores). x, bias
// and out as gemv_small_m's; the weight's values are s * code + b rounded to the compute type
// (or exact: gemv_int_scales_after_mma).
// ldy lets the parts of a fused weight held in different layouts write their rows of one y.
void gemv_int(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
              int n, int k, void* stream);
// A mixture's experts as one IntWeight (expert e's n rows after the previous experts', in codes
// and params alike) and the routing's tiles (moe.cu's sort, device arrays): tile i multiplies
// expert[i]'s rows by count[i] (1..kGemvIntMaxM) rows of x, x_rows[first[i] ...] (null:
// rows first[i] ...), into rows first[i] ... of y [*][n]; *tiles of the max_tiles slots are
// used. routed: about how many tiles a step has (sizes the launch; any value is correct).
struct IntExpertTiles {
  const int32_t* expert = nullptr;
  const int32_t* first = nullptr;
  const int32_t* count = nullptr;
  const int32_t* tiles = nullptr;
  const int32_t* x_rows = nullptr;
  int max_tiles = 0;
  int routed = 1;
};
// y = x . w_e^T (+ bias_e, bias [experts][n]) per tile, the GEMV's one pass over each routed
// expert's codes (moe.cu's decode batches). The tiles come from the kernel before this one
// (launched with PDL: it waits for them). max_m: the most rows a tile can hold (picks the
// variant). y is in the compute type.
void gemv_int_experts(DType ab, const void* x, const IntWeight& w, const void* bias, void* y, int max_m, int n, int k,
                      const IntExpertTiles& tiles, void* stream);
inline constexpr int kGemmIntMaxM = 64;  // gemm_int's rows of x
// y[r][c] (row stride ldy >= n) = x[m][k] . w^T (+ bias[n]) for decode batches, 1 <= m <=
// kGemmIntMaxM (gemm_int.cu: one pass over the codes for all m rows, x staged in shared
// memory). Arguments and weight values as gemv_int's per-weight decode (s * code + b rounded to
// the compute type). tile_rows: weight rows per CTA, 128 or 256 (0: gemm_int_tile_rows);
// splits: the cluster split of k, 1-8 (0: the launcher's). Needs gemm_int_available.
void gemm_int(DType ab, DType out, const void* x, const IntWeight& w, const void* bias, void* y, int ldy, int m,
              int n, int k, void* stream, int tile_rows = 0, int splits = 0);
// The tile gemm_int takes by default for m rows of x and n of the weight.
int gemm_int_tile_rows(int m, int n);
// Whether gemm_int runs here with tiles of tile_rows: tensor cores of sm_80+ and the shared
// memory its largest stage ring needs (up to 168 KB at 256 rows, 108 KB at 128).
bool gemm_int_available(int tile_rows);
// The weight in the compute type (bf16 / f16), the GEMV's values, into out [n][k]: the larger
// m run the 16-bit GEMM on it.
void dequantize_int(DType to, const IntWeight& w, void* out, int n, int k, void* stream);
// x[r][:] = w[tokens[r]][:] * scale in fp32 (an embedding table held as grouped codes; s * code
// + b in fp32). Token ids must be in range.
void embed_rows_int(DType act, const IntWeight& w, const TokenId* tokens, int rows, int hidden, float* x,
                    void* stream, float scale = 1.0f);

class Gemm {
 public:
  Gemm();  // creates the cuBLASLt handle; throws kvlm::Error on failure
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  void set_workspace(void* workspace, size_t bytes);
  // Whether the small-m kernels are used (default on), and whether
  // they run the GEMMs of m rows (1 <= m <= kGemvMmaMaxM).
  void set_small_m_kernel(bool on);
  bool small_m_kernel(int m) const;
  // ab: DType::BF16 or DType::F16; out: the same or DType::F32. bias may be null.
  void linear(DType ab, DType out, const void* x, const void* w, const void* bias, void* y, int m, int n, int k,
              void* stream);
  // y[m][n] = (x[m][k] * x_scales[m]) . (w.codes[n][k] * w.scales[n])^T (+ bias): FP8 E4M3 on
  // the tensor cores (sm_89+; fp32 accumulation), the activation scaled per token
  // (quantize_rows_fp8) and the weight per row, both applied by cuBLASLt's outer-vector
  // scaling; for a block-scaled weight (scale_block 128, block_scales set) the activation per
  // token and 128-value group and the weight per 128 x 128 block (cuBLASLt's VEC128 /
  // BLK128x128 scaling). Needs fp8_gemm_fits. out: bf16, f16 or f32; the bias (out's type, as
  // linear's) may be null. Returns false (launching nothing) when cuBLASLt has no algorithm
  // for the shape — found on its first use, remembered after.
  bool linear_fp8(DType out, const uint8_t* x, const float* x_scales, const Fp8Weight& w, const void* bias, void* y,
                  int m, int n, int k, void* stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm::cuda

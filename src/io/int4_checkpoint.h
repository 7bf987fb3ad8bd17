// 4-bit integer weight checkpoints from Hugging Face's quantizers: AutoAWQ's GEMM layout, GPTQ
// (AutoGPTQ / GPTQModel, checkpoint_format gptq and gptq_v2, with or without desc_act) and
// llm-compressor's compressed-tensors pack-quantized W4A16. config.json's quantization_config
// says which; each quantized Linear `m` then has no `m.weight` but packed int32 codes, zero
// points and 16-bit scales:
//
//   AWQ   m.qweight [in][out / 8]   8 output columns per int32, nibble i holding column
//                                   8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
//         m.qzeros  [in / g][out / 8] the same packing
//         m.scales  [in / g][out]
//         w[o][i] = (q - z) s of group i / g
//   GPTQ  m.qweight [in / 8][out]   8 input rows per int32, nibble j holding row 8 r + j
//         m.qzeros  [groups][out / 8] 8 output columns per int32 in order; checkpoint_format
//                                   gptq stores z - 1 (decoded z = stored + 1, as its kernels
//                                   do), gptq_v2 stores z
//         m.scales  [groups][out]
//         m.g_idx   [in]            input row i's group (desc_act: any order; else i / g)
//         w[o][i] = (q - z) s of group g_idx[i]
//   compressed-tensors pack-quantized
//         m.weight_packed     [out][ceil(in / 8)] 8 input columns per int32, nibble j holding
//                             column 8 c + j, stored as the signed code + 8
//         m.weight_shape      [2] int64 (or int32): out, in
//         m.weight_scale      [out][groups] (groups = 1 for strategy channel)
//         m.weight_zero_point [ceil(out / 8)][groups] int32, packed along the output (nibble j
//                             of word r: row 8 r + j), signed + 8; absent when symmetric
//         m.weight_g_idx      [in] (older llm-compressor with actorder "group"), as GPTQ's
//         w[o][i] = (q - z) s with q and z the signed codes
//   MXFP4 (GPT-OSS's experts; quant_method mxfp4): a fused expert tensor `t` [E][in][out] is
//         t_blocks [E][out][in / 32][16] uint8, byte b of a block holding columns 2 b (low
//                  nibble) and 2 b + 1 (high), each an E2M1 code (sign, 2-bit exponent, 1-bit
//                  mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
//         t_scales [E][out][in / 32] uint8, an E8M0 exponent e: the block's codes times 2^(e - 127)
//         t = the transpose of that [E][out][in], as transformers' convert_moe_packed_tensors lays it
//
// The checkpoint (io/checkpoint.h) shows each such module as a float32 `m.weight` of shape
// [out][in] (MXFP4: each expert's gate, up and down weight, mxfp4_expert_to_ggml), dequantized
// when viewed, and hides the packed tensors, so every architecture loads these checkpoints with
// no change, or keeps them quantized where the device can.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/weight_quant.h"
#include "io/safetensors.h"

namespace kvlm {

// The names of one module's tensors under a scheme: base + sep + "qweight" ..., "" where it has
// none; the dequantized tensor is base + weight.
struct Int4TensorNames {
  const char *packed, *zeros, *scales, *g_idx, *shape;
  char sep;
  const char* weight;
};
const Int4TensorNames& int4_tensor_names(Int4Scheme::Kind k);

// The tensors of one quantized module (`base` + ".qweight" ...), checked against each other.
struct Int4Module {
  const TensorInfo* qweight = nullptr;
  const TensorInfo* qzeros = nullptr;  // may be absent for a symmetric compressed-tensors scheme
  const TensorInfo* scales = nullptr;
  const TensorInfo* g_idx = nullptr;   // GPTQ, compressed-tensors; may be absent
  int64_t rows = 0, cols = 0;          // the weight's [out][in]
  int64_t experts = 0;                 // MXFP4: E (the weight is [E][in][out]); else 0
};
// Shapes and dtypes of a module's tensors for `s`: throws kvlm::Error naming the tensor and
// what it should be. `shape` is compressed-tensors' weight_shape (its packed tensor rounds the
// input up to whole words), nullptr for AWQ and GPTQ.
Int4Module check_int4_module(const Int4Scheme& s, const std::string& base, const TensorInfo* qweight,
                             const TensorInfo* qzeros, const TensorInfo* scales, const TensorInfo* g_idx,
                             const TensorView* shape = nullptr);

// The module's weight [rows][cols] in fp32: (q - z) s exactly (16-bit scales times integers).
// `qzeros` may be null where check_int4_module allowed it. Not for MXFP4 (mxfp4_expert_to_ggml).
std::vector<float> dequantize_int4(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                                   const TensorView* qzeros, const TensorView& scales, const TensorView* g_idx);

// MXFP4 experts one expert at a time, as kvlm holds GPT-OSS's experts (MoeConfig::
// per_expert_tensors): expert `expert`'s rows of the module's [out][in] weight, every row
// (parity -1) or every other one from `parity` (0 or 1: gate_up_proj's gate and up rows, which
// alternate). mxfp4_expert_rows: how many rows that is (throws for an odd count split in two).
int64_t mxfp4_expert_rows(const Int4Module& m, int parity);
// Those rows as ggml MXFP4 blocks (io/gguf.h GGMLType::MXFP4: the E8M0 byte, then 16 bytes
// holding values j and j + 16 of the block in byte j's low and high nibble), in / 32 * 17 bytes a
// row: the same weights bit for bit, in the layout the block kernels and GGUF files share
// (dequantize_ggml gives their fp32 values).
void mxfp4_expert_to_ggml(const Int4Module& m, const TensorView& blocks, const TensorView& scales, int64_t expert,
                          int parity, uint8_t* out);

// The group a module keeps as grouped codes (io/grouped_codes.h grouped_rows_type): its
// scheme's group, or the whole row for per-channel scales; 0 where it cannot: MXFP4 (E2M1
// values are not affine in the code), an act-order g_idx (columns not in consecutive groups) or
// a group the 4-bit kernels do not take (not a multiple of 32).
int int4_grouped_group(const Int4Scheme& s, const Int4Module& m, const TensorView* g_idx);

// The module as m.rows grouped rows (grouped_rows_bytes(group, m.cols) bytes each) into `out`:
// the codes q, and per group s and z (w = (q - z) s), in the zero-point layout.
void int4_to_grouped_rows(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                          const TensorView* qzeros, const TensorView& scales, const TensorView* g_idx, int group,
                          uint8_t* out);

}  // namespace kvlm

// 4-bit integer weight checkpoints from Hugging Face's quantizers: AutoAWQ's GEMM layout and
// GPTQ (AutoGPTQ / GPTQModel, checkpoint_format gptq and gptq_v2, with or without desc_act).
// config.json's quantization_config says which; each quantized Linear `m` then has no
// `m.weight` but packed int32 codes, zero points and fp16 scales:
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
//
// The checkpoint (io/checkpoint.h) shows each such module as a float32 `m.weight` of shape
// [out][in], dequantized when viewed, and hides the packed tensors, so every architecture loads
// AWQ and GPTQ checkpoints with no change (the GPU then holds the values in its compute dtype).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/weight_quant.h"
#include "io/safetensors.h"

namespace kvlm {

// The tensors of one quantized module (`base` + ".qweight" ...), checked against each other.
struct Int4Module {
  const TensorInfo* qweight = nullptr;
  const TensorInfo* qzeros = nullptr;
  const TensorInfo* scales = nullptr;
  const TensorInfo* g_idx = nullptr;  // GPTQ; may be absent
  int64_t rows = 0, cols = 0;         // the weight's [out][in]
};
// Shapes and dtypes of a module's tensors for `s`: throws kvlm::Error naming the tensor and
// what it should be.
Int4Module check_int4_module(const Int4Scheme& s, const std::string& base, const TensorInfo* qweight,
                             const TensorInfo* qzeros, const TensorInfo* scales, const TensorInfo* g_idx);

// The module's weight [rows][cols] in fp32: (q - z) s exactly (fp16 scales times integers).
std::vector<float> dequantize_int4(const Int4Scheme& s, const Int4Module& m, const TensorView& qweight,
                                   const TensorView& qzeros, const TensorView& scales, const TensorView* g_idx);

}  // namespace kvlm

// A mixture-of-experts MLP on the GPU (model/ops.h's Ops::moe), with no CUDA header: a
// stream is a `void*`. The router's logits come in (a GEMM the caller runs); from there, in
// one pass each and with no host synchronization (CUDA-graph capturable):
//
//   route    each row's top_k experts by logit (+ router bias; ties: the lower index) and
//            their weights (softmax over the k, or over every expert): ops::cpu::moe_route
//   sort     the rows x top_k (row, expert) pairs grouped by expert and cut into tiles of at
//            most 16 pairs of one expert
//   experts  batches of at most 4 rows (decode): the expert GEMV, per routed expert the
//            gate/up rows streamed once with f(gate) * up in the epilogue, then the down rows;
//            larger batches: a grouped GEMM whose CTAs each take one tile and 32-64 output
//            columns, the activation (SiLU, or GPT-OSS's clamped SwiGLU) as its own pass, and
//            the grouped GEMM over W_down (+ b). A step reads only the routed experts.
//   combine  y[row] = sum over its k pairs of weight * down output, in fp32, rounded once
//
// Activations and weights are `act` (bfloat16 or float16); logits and routing weights fp32.
// Layouts (ops.h MoeWeights): gate_up [E][2I][H] (I gate rows, then I up rows), down
// [E][H][I], biases [E][2I] and [E][H]. Needs H % 32 == 0 and I % 32 == 0 (moe_fits).
#pragma once

#include <cstddef>

#include "config/model_config.h"  // MoeConfig
#include "core/dtype.h"

namespace kvlm::cuda {

struct MoeParams {
  DType act = DType::BF16;
  int rows = 0;                 // T
  int hidden = 0;               // H
  int inter = 0;                // I, each expert's width (per rank under tensor parallelism)
  MoeConfig config;             // experts, top_k, norm_topk, activation (router_bias: given below); under
                                // expert parallelism the held experts (expert_begin, local_experts)
  const float* logits = nullptr;        // fp32 [T][E], the router's x . Wr^T
  const void* router_bias = nullptr;    // act [E] or null
  const void* x = nullptr;              // act [T][H]
  const void* gate_up = nullptr;        // act [E][2I][H] (E: the held experts)
  const void* gate_up_bias = nullptr;   // act [E][2I] or null
  const void* down = nullptr;           // act [E][H][I]
  const void* down_bias = nullptr;      // act [E][H] or null
  void* y = nullptr;                    // act [T][H]
  void* workspace = nullptr;            // moe_workspace_bytes, 256-byte aligned
};

// Whether the kernels take these sizes (H and I multiples of 32, 1 <= top_k <= experts <= 1024).
bool moe_fits(int hidden, int inter, int experts, int top_k);
size_t moe_workspace_bytes(DType act, int rows, int hidden, int inter, int experts, int top_k);
void moe(const MoeParams& p, void* stream);

}  // namespace kvlm::cuda

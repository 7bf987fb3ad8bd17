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
//
// Experts may instead be held as grouped integer codes (gemm.h IntWeight, the same rows:
// 4-bit AWQ / GPTQ / compressed-tensors experts, GGUF blocks). Batches short of the wide path
// then run the integer GEMV per tile (gemv_int_experts: a routed expert's codes read once per
// 16 of its pairs), with the activation as its own pass; prefill-sized batches dequantize a
// run of experts at a time (about 256 MiB) into the workspace and run the wide grouped GEMM
// over that run's tiles.
#pragma once

#include <cstddef>

#include "config/model_config.h"  // MoeConfig
#include "core/dtype.h"
#include "ops/cuda/gemm.h"  // IntWeight

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
  // Experts held as grouped codes (both set, or neither): used in place of gate_up and down.
  IntWeight gate_up_codes, down_codes;
  // The wide path over codes: experts dequantized at a time, at most the workspace's run (0:
  // that run; tests set fewer to cut the experts into several runs).
  int int_run_experts = 0;
};

// Whether the kernels take these sizes (H and I multiples of 32, 1 <= top_k <= experts <= 1024).
bool moe_fits(int hidden, int inter, int experts, int top_k);
// Whether experts of grouped codes in this layout run (int_layout_fits for both projections).
bool moe_int_fits(int hidden, int inter, int bits, int group);
// int_experts: the experts are grouped codes (adds the wide path's dequantized run).
size_t moe_workspace_bytes(DType act, int rows, int hidden, int inter, int experts, int top_k, bool int_experts = false);
void moe(const MoeParams& p, void* stream);

}  // namespace kvlm::cuda

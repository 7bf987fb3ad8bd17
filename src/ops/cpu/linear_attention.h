// Gated DeltaNet's token mixer on the CPU (fp32): the pieces of a Qwen3-Next / Qwen3.5 linear-
// attention layer between its input projections and its output projection, as references for
// the device kernels. A layer keeps, per sequence, a fixed-size state instead of a KV cache:
// the causal convolution's last kernel - 1 inputs and the delta rule's matrix per value head.
//
//   conv      x'[t] = silu(sum_j w[c][j] x[t - K + 1 + j][c]) per channel c (depthwise, kernel
//             K, no bias), over the mixed q | k | v rows; inputs before the chunk come from
//             the conv state, which then keeps the chunk's last K - 1 inputs
//   gates     g = -exp(A_log) softplus(a + dt_bias) (the log decay), beta = sigmoid(b)
//   delta     per value head, q and k L2-normalized (eps 1e-6; k heads shared by
//   rule      num_v_heads / num_k_heads value heads, head h reading k head h / ratio) and q
//             scaled by dk^-0.5:   S <- exp(g_t) S ;  S <- S + k_t (beta_t (v_t - S^T k_t))^T ;
//             o_t = S^T q_t.  S is [dk][dv].
//   norm      out = w * x / sqrt(mean(x^2) + eps) * silu(z) per value head (z: the gate
//             projection)
//
// The delta rule has two forms that must agree: the recurrent one above (decode: one token
// at a time) and the chunked one (prefill: chunks of 64 tokens, the WY / UT form that
// flash-linear-attention's kernels use, turned into matrix products). Both take a state in
// and leave the state after the last token, so a prompt may arrive in pieces.
#pragma once

#include <span>

namespace kvlm::ops::cpu {

struct DeltaRuleShape {
  int k_heads = 0, v_heads = 0;  // v_heads a multiple of k_heads
  int dk = 0, dv = 0;            // head sizes
};

// One sequence's `tokens` rows. q, k: [tokens][k_heads][dk] (normalized inside; not
// modified); v: [tokens][v_heads][dv]; g, beta: [tokens][v_heads]; state: [v_heads][dk][dv],
// read and then overwritten with the state after the last row; out: [tokens][v_heads][dv].
void delta_rule_recurrent(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                          std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                          std::span<float> state, std::span<float> out);
// The same in chunks of `chunk` rows (64 in transformers and flash-linear-attention).
void delta_rule_chunked(const DeltaRuleShape& s, int tokens, std::span<const float> q, std::span<const float> k,
                        std::span<const float> v, std::span<const float> g, std::span<const float> beta,
                        std::span<float> state, std::span<float> out, int chunk = 64);

// The causal depthwise convolution with SiLU over one sequence's `tokens` rows of `channels`:
// x [tokens][channels] -> out (may alias x); w [channels][kernel]; state [kernel - 1][channels],
// the inputs before row 0 (oldest first), read and then overwritten with the last kernel - 1
// inputs.
void causal_conv_silu(int tokens, int channels, int kernel, std::span<const float> x, std::span<const float> w,
                      std::span<float> state, std::span<float> out);

// g[r][h] = -exp(a_log[h]) * softplus(a[r][h] + dt_bias[h]); beta[r][h] = sigmoid(b[r][h]), in
// place over a and b. softplus as PyTorch's (x past 20: x).
void delta_rule_gates(int rows, int heads, std::span<const float> a_log, std::span<const float> dt_bias,
                      std::span<float> a_to_g, std::span<float> b_to_beta);

// out[r][:] = w * x[r] / sqrt(mean(x[r]^2) + eps) * silu(z[r]) over rows of `dim`. In place allowed.
void rmsnorm_gated(std::span<const float> x, std::span<const float> z, int rows, int dim, std::span<const float> w,
                   float eps, std::span<float> out);

}  // namespace kvlm::ops::cpu

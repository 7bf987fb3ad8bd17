// Reference CPU ops: fp32 in, fp32 out, fp32 accumulation. Buffers are row-major; the
// shape of every argument is in its comment.
#pragma once

#include <cstdint>
#include <span>

#include "config/model_config.h"  // GluActivation
#include "core/index_types.h"

namespace kvlm::ops::cpu {

// y[m][n] = x[m][k] . w[n][k]^T (+ bias[n] when non-empty). w is a PyTorch Linear weight.
void linear(std::span<const float> x, int m, int k, std::span<const float> w, int n, std::span<const float> bias,
            std::span<float> y);

// y[r][c0:c1] = x[r][:] . w[c0:c1][:]^T for r < m, y's rows n apart, no bias, on the calling
// thread: linear's unit of work, for callers that split the product their own way.
void linear_columns(const float* x, int m, int k, const float* w, int c0, int c1, int n, float* y);

// out[r][:] = x[r][:] / sqrt(mean(x[r]^2) + eps) * w[:], for `rows` rows of `dim`. In place allowed.
void rmsnorm(std::span<const float> x, int rows, int dim, std::span<const float> w, float eps, std::span<float> out);

// out[i] = silu(gate[i]) * up[i]. In place allowed (out may alias gate).
void silu_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out);

// out[i] = gelu_tanh(gate[i]) * up[i], gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// (PyTorch's gelu(approximate="tanh")). In place allowed.
void gelu_tanh_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out);

// GPT-OSS's clamped SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = g * sigmoid(alpha g) * (u + 1). In place allowed.
void swiglu_clamp_mul(std::span<const float> gate, std::span<const float> up, std::span<float> out, float alpha,
                      float limit);

// The gated MLP's activation f(gate) * up, f chosen by `f` (alpha, limit: SwigluClamp's).
void glu(GluActivation f, std::span<const float> gate, std::span<const float> up, std::span<float> out,
         float alpha = 1.702f, float limit = 7.0f);

// A mixture-of-experts router: for each of `rows` rows of logits [rows][experts], the top_k
// experts by logit (ties: the lower index first) in descending order into ids [rows][top_k],
// and their weights into weights [rows][top_k]: exp(l - max) over the sum of exp(l - max) of
// the top_k (norm_topk) or of every expert.
void moe_route(std::span<const float> logits, int rows, int experts, int top_k, bool norm_topk, std::span<int32_t> ids,
               std::span<float> weights);

// Rotary embedding, rotate-half convention (Hugging Face): x[t][h][0:d/2] and x[t][h][d/2:d]
// are the two halves of each rotated pair. x: [tokens][heads][head_dim], in place.
// inv_freq: [head_dim / 2]; angle = positions[t] * inv_freq[i] in fp32. Partial rotary: a
// shorter inv_freq [r / 2] rotates the first r dimensions (pairs i, i + r / 2) and leaves the rest.
void rope(std::span<float> x, int tokens, int heads, int head_dim, std::span<const Position> positions,
          std::span<const float> inv_freq);

// y[i] += x[i]
void add_inplace(std::span<float> y, std::span<const float> x);

}  // namespace kvlm::ops::cpu

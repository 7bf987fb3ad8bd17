// The KL-divergence bounds the golden tests hold kvlm's next-token distributions to, per KV
// mode: one table for the CPU goldens (test_golden.cpp) and the CUDA ones (test_cuda_golden.cpp).
#pragma once

#include <stdexcept>
#include <string_view>
#include <utility>

#include <nlohmann/json.hpp>

#include "core/dtype.h"

namespace kvlm::test {

// A mixture of experts: its golden records the smallest gap between a row's k-th and (k+1)-th
// router logit (tools/make_goldens.py).
inline bool is_moe(const nlohmann::json& meta) {
  return meta.contains("min_router_gap") && !meta["min_router_gap"].is_null();
}

// Upper bounds on the KL divergence of next-token distributions, per KV mode: about 2x
// the largest value measured (docs/results/golden.md), separately for the random-weight
// checkpoints and for stories260K, the one trained model: training gives K/V a wider dynamic
// range with large channels, and FP8's 3-bit mantissa costs ~20x more KL there.
//
// Mixtures of experts (qwen3-moe, gpt-oss) get their own bounds for the FP8 modes: an FP8
// cache's error (~6% of a value) moves router logits by more than the goldens' smallest gap
// between a row's k-th and (k+1)-th expert (>= 0.02), so some rows swap an expert, a jump the
// dense models do not have (measured max_kld: fp8_e4m3 0.045, fp8_e5m2 0.86,
// fp8_per_token_head 0.10 on gpt-oss; session 32). The 16-bit and int8 modes move router
// logits less and keep the dense bounds.
struct KldBounds {
  KVCacheDType dt;
  double mean_kld, max_kld;                  // random-weight models
  double trained_mean_kld, trained_max_kld;  // stories260K
  double moe_mean_kld = 0, moe_max_kld = 0;  // random-weight MoE models; 0: the dense bounds
};
inline constexpr KldBounds kKldBounds[] = {
    // MoE: qwen3.5-moe's max measured 1.5e-6 / 1.6e-6 / 2.0e-6 with OpenBLAS's Sandybridge /
    // Haswell / SkylakeX kernels (the machine's CPU picks one; OPENBLAS_CORETYPE forces it):
    // its routers amplify the GEMMs' rounding, and 2e-6 failed on an AVX-512 machine. 4e-6 is
    // 2x the largest.
    {KVCacheDType::Float16, 5e-7, 2e-6, 1e-5, 4e-5, 5e-7, 4e-6},
    {KVCacheDType::BFloat16, 3e-5, 1.2e-4, 4e-4, 2e-3},
    {KVCacheDType::Fp8E4M3, 6e-3, 3e-2, 0.12, 0.6, 8e-3, 0.1},
    {KVCacheDType::Fp8E5M2, 2.5e-2, 0.25, 0.5, 2.0, 7e-2, 1.8},
    {KVCacheDType::Fp8PerTokenHead, 5e-3, 2.5e-2, 0.08, 0.55, 1.2e-2, 0.25},
    {KVCacheDType::Int8PerTokenHead, 3e-4, 1.5e-3, 1.5e-3, 5e-3},
    // Rotated (--kv-cache-rotation auto): measured 6.3e-3-2.4e-2 / 3.2e-2-0.11 on the random
    // models, 0.12 / 0.72 on stories260K (head_dim 8: the rotation mixes only 8 values).
    // int4 max_kld: 0.196 on the CPU and 0.314 on CUDA (bf16 compute) for
    // qwen3-mixed-fp8-block's prompt (one row of 86; session 19), the largest seen: 0.6 is ~2x it.
    {KVCacheDType::Int4PerTokenHead, 5e-2, 0.6, 0.25, 1.5},
};

// The {mean, max} bounds of mode `b` for the golden named `name` with metadata `meta`.
inline std::pair<double, double> kld_bounds(const KldBounds& b, std::string_view name, const nlohmann::json& meta) {
  if (name == "stories260K") return {b.trained_mean_kld, b.trained_max_kld};
  if (is_moe(meta) && b.moe_max_kld > 0) return {b.moe_mean_kld, b.moe_max_kld};
  return {b.mean_kld, b.max_kld};
}

// The bounds of KV mode `dt` (one of kKldBounds) for that golden.
inline std::pair<double, double> kld_bounds(KVCacheDType dt, std::string_view name, const nlohmann::json& meta) {
  for (const KldBounds& b : kKldBounds)
    if (b.dt == dt) return kld_bounds(b, name, meta);
  throw std::invalid_argument("no KL bounds for this KV mode");
}

}  // namespace kvlm::test

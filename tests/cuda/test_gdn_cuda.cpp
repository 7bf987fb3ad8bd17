// The CUDA Gated DeltaNet kernels (ops/cuda/gated_deltanet.h) against the CPU reference
// (ops/cpu/linear_attention.h), for both activation dtypes and both forms of the delta rule
// (recurrent, and chunked where a step holds a prompt): sequences of 1 (decode), a few, one
// chunk, part of one and 259 rows (past four 64-row chunks) in one step, a sequence starting
// fresh beside ones continuing from a state, a padding sequence (no state slot), the step run
// twice so that the second reads the states the first left, Qwen3.5's head sizes (128) and a
// small odd shape (key heads of 16 shared by 3 value heads of 24, conv kernel 3). Also the
// gated attention output and the shared expert's gated add.
//
// The reference gets the same act-rounded projection; the kernels keep everything else in fp32
// as the reference does, so what differs is summation order (and the recurrent form against the
// CPU's chunked one for prompts): states within 1e-4 relative of their scale, outputs within
// two steps of the act dtype. With bf16-held state matrices (--mamba-ssm-cache-dtype bfloat16)
// both sides start from the same rounded matrices and the reference rounds its result as the
// CPU runner does: a stored value may then sit one bf16 step away where fp32 sums straddle a
// rounding boundary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "act_test_util.h"
#include "config/model_config.h"
#include "core/numeric.h"
#include "cuda_test_util.h"
#include "ops/cpu/linear_attention.h"
#include "ops/cuda/gated_deltanet.h"

using namespace kvlm;
using kvlm::test::Dev;
using namespace kvlm::test::act;

namespace {

struct GdnCase {
  int k_heads, v_heads, dk, dv, conv_kernel;
  std::vector<int> q_lens;  // per sequence
  std::vector<bool> fresh;  // the step starts the sequence at position 0
  std::vector<int> slots;   // its state slot (-1: a padding sequence)
};

// Slots of fp32 values (conv window, then matrices) to the device's bytes, and back.
std::vector<uint8_t> pack(const LinearAttentionConfig& l, const std::vector<float>& values, int slots) {
  const size_t per = l.state_values(), conv_n = l.conv_state_values(), bytes = l.state_bytes();
  std::vector<uint8_t> out(size_t(slots) * bytes, 0);
  for (int s = 0; s < slots; ++s) {
    const float* v = values.data() + size_t(s) * per;
    uint8_t* b = out.data() + size_t(s) * bytes;
    std::memcpy(b, v, conv_n * sizeof(float));
    if (l.state_dtype == DType::BF16)
      for (size_t i = conv_n; i < per; ++i) reinterpret_cast<uint16_t*>(b + conv_n * 4)[i - conv_n] = num::f32_to_bf16(v[i]);
    else
      std::memcpy(b + conv_n * 4, v + conv_n, (per - conv_n) * sizeof(float));
  }
  return out;
}
std::vector<float> unpack(const LinearAttentionConfig& l, const std::vector<uint8_t>& bytes_in, int slots) {
  const size_t per = l.state_values(), conv_n = l.conv_state_values(), bytes = l.state_bytes();
  std::vector<float> out(size_t(slots) * per);
  for (int s = 0; s < slots; ++s) {
    float* v = out.data() + size_t(s) * per;
    const uint8_t* b = bytes_in.data() + size_t(s) * bytes;
    std::memcpy(v, b, conv_n * sizeof(float));
    if (l.state_dtype == DType::BF16)
      for (size_t i = conv_n; i < per; ++i) v[i] = num::bf16_to_f32(reinterpret_cast<const uint16_t*>(b + conv_n * 4)[i - conv_n]);
    else
      std::memcpy(v + conv_n, b + conv_n * 4, (per - conv_n) * sizeof(float));
  }
  return out;
}

// chunked: give the kernels the prefill scratch, so that steps holding a prompt take the
// chunked form (gated_delta_net_takes_chunks; else every step is recurrent).
void run(DType act, const GdnCase& c, uint32_t seed, DType state_dtype, bool chunked) {
  SCOPED_TRACE(std::string(dtype_name(act)) + (chunked ? " chunked" : " recurrent") + " state " +
               std::string(dtype_name(state_dtype)) + " dk " + std::to_string(c.dk) + " dv " + std::to_string(c.dv));
  std::mt19937 rng(seed);
  LinearAttentionConfig l{.k_heads = c.k_heads, .v_heads = c.v_heads, .k_dim = c.dk, .v_dim = c.dv,
                          .conv_kernel = c.conv_kernel, .state_dtype = state_dtype};
  const int S = int(c.q_lens.size()), W = l.in_proj_dim(), CD = l.conv_dim(), VD = l.value_dim(), KD = l.key_dim(),
            HV = l.v_heads;
  const size_t per = l.state_values(), conv_n = l.conv_state_values();
  int T = 0;
  std::vector<int> cu{0};
  for (int n : c.q_lens) cu.push_back(T += n);
  const int slots = 1 + *std::max_element(c.slots.begin(), c.slots.end());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  std::vector<float> conv_w(size_t(CD) * size_t(c.conv_kernel)), a_log(static_cast<size_t>(HV)), dt_bias(static_cast<size_t>(HV)),
      norm_w(static_cast<size_t>(c.dv));
  for (auto& v : conv_w) v = nd(rng) / std::sqrt(float(c.conv_kernel));
  for (auto& v : a_log) v = std::log(1.0f + 15.0f * ud(rng));
  for (auto& v : dt_bias) v = 0.5f * nd(rng);
  for (auto& v : norm_w) v = 1.0f + 0.1f * nd(rng);
  std::vector<float> states(size_t(slots) * per);
  for (auto& v : states) v = 0.3f * nd(rng);
  states = unpack(l, pack(l, states, slots), slots);  // the values a bf16-held matrix starts from
  Dev<float> d_conv(conv_w), d_alog(a_log), d_dt(dt_bias), d_norm(norm_w);
  Dev<uint8_t> d_states(pack(l, states, slots));
  std::vector<int32_t> kv_lens, slot_ids(c.slots.begin(), c.slots.end());
  for (int s = 0; s < S; ++s) kv_lens.push_back(c.q_lens[size_t(s)] + (c.fresh[size_t(s)] ? 0 : 9));
  Dev<int32_t> d_cu(std::vector<int32_t>(cu.begin(), cu.end())), d_kv(kv_lens), d_slots(slot_ids);
  Dev<float> d_qkv(size_t(T) * size_t(CD)), d_core(size_t(T) * size_t(VD));
  Dev<uint16_t> d_out(size_t(T) * size_t(VD));
  const int max_q = *std::max_element(c.q_lens.begin(), c.q_lens.end());
  const size_t scratch_floats = chunked ? cuda::gated_delta_net_scratch_floats(T, max_q, HV, c.dk, c.dv) : 0;
  // Every case's prompts are a large part of its step: they take the chunked form when offered.
  EXPECT_EQ(scratch_floats > 0, chunked && max_q >= cuda::kGatedDeltaNetChunkedRows) << "which form runs";
  Dev<float> d_scratch(std::max<size_t>(scratch_floats, 1));

  for (int step = 0; step < 2; ++step) {
    if (step == 1) {  // every sequence now continues from the state the first step left
      for (int s = 0; s < S; ++s) kv_lens[size_t(s)] = c.q_lens[size_t(s)] + 20;
      d_kv.upload(kv_lens);
    }
    const auto mixed = random_act(act, size_t(T) * size_t(W), rng);
    Dev<uint16_t> d_mixed(codes(act, mixed));
    d_out.poison();
    cuda::gated_delta_net({.act = act, .num_tokens = T, .num_seqs = S, .k_heads = l.k_heads, .v_heads = HV, .dk = c.dk,
                           .dv = c.dv, .conv_kernel = c.conv_kernel, .cu_q_lens = d_cu.p, .kv_lens = d_kv.p,
                           .state_slots = d_slots.p, .mixed = d_mixed.p, .conv_w = d_conv.p, .a_log = d_alog.p,
                           .dt_bias = d_dt.p, .norm_w = d_norm.p, .eps = 1e-6f, .states = d_states.p,
                           .state_bytes = l.state_bytes(), .state_dtype = state_dtype, .max_q_len = max_q,
                           .scratch = scratch_floats ? d_scratch.p : nullptr, .qkv = d_qkv.p,
                           .core = d_core.p, .out = d_out.p},
                          nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

    // The reference, sequence by sequence, as CpuOps::gated_delta_net runs it.
    std::vector<float> ref(size_t(T) * size_t(VD));
    const std::vector<float> before = states;
    for (int s = 0; s < S; ++s) {
      const size_t n = size_t(c.q_lens[size_t(s)]), r0 = size_t(cu[size_t(s)]);
      const int slot = c.slots[size_t(s)];
      std::vector<float> st(per, 0.0f);
      if (slot >= 0 && !(step == 0 && c.fresh[size_t(s)])) st.assign(before.begin() + ptrdiff_t(size_t(slot) * per),
                                                                     before.begin() + ptrdiff_t(size_t(slot + 1) * per));
      std::vector<float> qkv(n * size_t(CD)), z(n * size_t(VD)), g(n * size_t(HV)), beta(n * size_t(HV));
      for (size_t r = 0; r < n; ++r) {
        const float* row = mixed.data() + (r0 + r) * size_t(W);
        std::copy_n(row, CD, qkv.data() + r * size_t(CD));
        std::copy_n(row + CD, VD, z.data() + r * size_t(VD));
        std::copy_n(row + CD + VD, HV, beta.data() + r * size_t(HV));
        std::copy_n(row + CD + VD + HV, HV, g.data() + r * size_t(HV));
      }
      ops::cpu::causal_conv_silu(int(n), CD, c.conv_kernel, qkv, conv_w, std::span<float>(st).first(conv_n), qkv);
      ops::cpu::delta_rule_gates(int(n), HV, a_log, dt_bias, g, beta);
      std::vector<float> q(n * size_t(KD)), k(n * size_t(KD)), v(n * size_t(VD));
      for (size_t r = 0; r < n; ++r) {
        std::copy_n(qkv.data() + r * size_t(CD), KD, q.data() + r * size_t(KD));
        std::copy_n(qkv.data() + r * size_t(CD) + KD, KD, k.data() + r * size_t(KD));
        std::copy_n(qkv.data() + r * size_t(CD) + 2 * KD, VD, v.data() + r * size_t(VD));
      }
      const std::span<float> core(ref.data() + r0 * size_t(VD), n * size_t(VD));
      const ops::cpu::DeltaRuleShape shape{l.k_heads, HV, c.dk, c.dv};
      if (n == 1)
        ops::cpu::delta_rule_recurrent(shape, 1, q, k, v, g, beta, std::span<float>(st).subspan(conv_n), core);
      else
        ops::cpu::delta_rule_chunked(shape, int(n), q, k, v, g, beta, std::span<float>(st).subspan(conv_n), core);
      ops::cpu::rmsnorm_gated(core, z, int(n) * HV, c.dv, norm_w, 1e-6f, core);
      if (state_dtype == DType::BF16)  // stored rounded, as the CPU runner and the kernel do
        for (size_t i = conv_n; i < per; ++i) st[i] = num::bf16_to_f32(num::f32_to_bf16(st[i]));
      if (slot >= 0) std::copy(st.begin(), st.end(), states.begin() + ptrdiff_t(size_t(slot) * per));
    }
    // Outputs: the act dtype's rounding of the output plus the inputs' order of sums.
    std::vector<float> got;
    for (uint16_t v : d_out.download()) got.push_back(act_value(act, v));
    size_t bad = 0, worst = 0;
    double worst_excess = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double tol = 2 * act_rel_tol(act) * std::fabs(ref[i]) + 2e-3;
      const double e = std::isnan(got[i]) ? 1e30 : std::fabs(double(got[i]) - ref[i]);
      bad += e > tol;
      if (e / tol > worst_excess) {
        worst_excess = e / tol;
        worst = i;
      }
    }
    EXPECT_EQ(bad, 0u) << dtype_name(act) << " step " << step << ": " << bad << " of " << got.size()
                       << " outputs beyond tolerance; worst row " << worst / size_t(VD) << " col " << worst % size_t(VD)
                       << " got " << got[worst] << " reference " << ref[worst];
    // States: what the next step reads. Padding sequences leave theirs alone.
    const std::vector<float> dev = unpack(l, d_states.download(), slots);
    double scale = 0;
    for (float v : states) scale = std::max(scale, double(std::fabs(v)));
    size_t bad_states = 0, worst_state = 0;
    double worst_state_excess = 0;
    for (size_t i = 0; i < dev.size(); ++i) {
      // A bf16-held value: one step of bf16 (at most 2^-7 of it) where the sums straddle a rounding.
      const bool rounded = state_dtype == DType::BF16 && i % per >= conv_n;
      const double tol = 1e-4 * scale + 1e-5 + (rounded ? std::ldexp(std::fabs(double(states[i])), -7) : 0.0);
      const double e = std::fabs(double(dev[i]) - states[i]);
      bad_states += !(e <= tol);
      if (!(e / tol <= worst_state_excess)) worst_state_excess = e / tol, worst_state = i;
    }
    EXPECT_EQ(bad_states, 0u) << dtype_name(act) << " state " << dtype_name(state_dtype) << " step " << step << ": "
                              << bad_states << " states beyond tolerance; worst: slot " << worst_state / per << " value "
                              << worst_state % per << " got " << dev[worst_state] << " reference " << states[worst_state];
  }
}

}  // namespace

TEST(CudaGatedDeltaNet, MatchesTheCpuReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const GdnCase qwen{.k_heads = 2, .v_heads = 4, .dk = 128, .dv = 128, .conv_kernel = 4,
                     .q_lens = {1, 150, 5, 3}, .fresh = {false, true, false, true}, .slots = {2, 0, 3, -1}};
  const GdnCase odd{.k_heads = 2, .v_heads = 6, .dk = 16, .dv = 24, .conv_kernel = 3,
                    .q_lens = {1, 1, 70, 2}, .fresh = {false, true, false, false}, .slots = {1, 4, 0, 2}};
  const GdnCase decode{.k_heads = 1, .v_heads = 2, .dk = 64, .dv = 40, .conv_kernel = 4,
                       .q_lens = {1, 1, 1, 1, 1}, .fresh = {false, false, false, false, true}, .slots = {4, 3, 2, 1, 0}};
  // Prompts for the chunked form: 5 chunks (the last of 3 rows) continuing a state, exactly one
  // chunk, one partial chunk just past the threshold, beside decode rows and a padding sequence.
  const GdnCase prompts{.k_heads = 1, .v_heads = 3, .dk = 128, .dv = 128, .conv_kernel = 4,
                        .q_lens = {259, 1, 64, 16, 40}, .fresh = {false, false, true, false, true},
                        .slots = {0, 1, 2, 3, -1}};
  const GdnCase mid{.k_heads = 2, .v_heads = 4, .dk = 32, .dv = 64, .conv_kernel = 2,
                    .q_lens = {97, 33}, .fresh = {true, false}, .slots = {1, 0}};
  uint32_t seed = 7;
  for (bool chunked : {true, false}) {
    for (DType act : kActs)
      for (const GdnCase& c : {qwen, odd, decode, prompts, mid}) run(act, c, seed++, DType::F32, chunked);
    for (const GdnCase& c : {qwen, odd, decode, prompts}) run(DType::BF16, c, seed++, DType::BF16, chunked);  // bf16-held matrices
  }
}

TEST(CudaGatedDeltaNet, TakesTheChunkedFormWherePromptsDominateTheStep) {
  EXPECT_TRUE(cuda::gated_delta_net_takes_chunks(16384, 16384, 128, 128));   // one long prompt
  EXPECT_TRUE(cuda::gated_delta_net_takes_chunks(2048 + 255, 2048, 128, 128));  // a prompt's chunk and 255 decode rows
  EXPECT_TRUE(cuda::gated_delta_net_takes_chunks(4 * 4096, 4096, 128, 128));  // a few prompts
  EXPECT_FALSE(cuda::gated_delta_net_takes_chunks(16 * 1024, 1024, 128, 128));  // many: the recurrent kernel is faster
  EXPECT_FALSE(cuda::gated_delta_net_takes_chunks(256, 1, 128, 128));          // decode
  EXPECT_FALSE(cuda::gated_delta_net_takes_chunks(20, 20, 128, 128));          // short
  EXPECT_FALSE(cuda::gated_delta_net_takes_chunks(4096, 4096, 128, 256));      // value heads past the tiles
  EXPECT_EQ(cuda::gated_delta_net_scratch_floats(256, 1, 32, 128, 128), 0u);
  EXPECT_EQ(cuda::gated_delta_net_scratch_floats(100, 64, 32, 128, 128), size_t(100) * 32 * (2 + 128 + 128));
}

TEST(CudaGatedDeltaNet, RefusesSizesItCannotHold) {
  EXPECT_TRUE(cuda::gated_delta_net_fits(128, 128, 4));
  EXPECT_FALSE(cuda::gated_delta_net_fits(256, 128, 4));
  EXPECT_FALSE(cuda::gated_delta_net_fits(128, 128, 9));
}

TEST(CudaGatedDeltaNet, SigmoidGateAndGatedAdd) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(3);
  for (DType act : kActs) {
    const int rows = 37, cols = 72, stride = 200, col0 = 100;
    const auto x = random_act(act, size_t(rows) * cols, rng), src = random_act(act, size_t(rows) * stride, rng, 3.0f);
    Dev<uint16_t> dx(codes(act, x)), dsrc(codes(act, src));
    cuda::sigmoid_gate(act, dx.p, dsrc.p, rows, cols, stride, col0, nullptr);
    const auto s = random_act(act, size_t(rows) * cols, rng);
    std::vector<float> gate(static_cast<size_t>(rows));
    for (auto& g : gate) g = 2.0f * std::normal_distribution<float>(0.0f, 1.0f)(rng);
    Dev<uint16_t> dy(codes(act, x)), ds(codes(act, s));
    Dev<float> dg(gate);
    cuda::add_gated_rows(act, dy.p, ds.p, dg.p, rows, cols, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto gx = dx.download(), gy = dy.download();
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < cols; ++i) {
        const size_t at = size_t(r) * cols + size_t(i);
        const float sg = 1.0f / (1.0f + std::exp(-src[size_t(r) * stride + size_t(col0 + i)]));
        EXPECT_NEAR(act_value(act, gx[at]), x[at] * sg, act_rel_tol(act) * std::fabs(x[at] * sg) + 1e-6) << r << " " << i;
        const float want = x[at] + s[at] / (1.0f + std::exp(-gate[size_t(r)]));
        EXPECT_NEAR(act_value(act, gy[at]), want, act_rel_tol(act) * std::fabs(want) + 1e-6) << r << " " << i;
      }
  }
}

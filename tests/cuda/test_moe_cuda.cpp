// The CUDA mixture-of-experts kernels (ops/cuda/moe.h) against the CPU reference
// (ops::cpu::moe_route and the expert loop of CpuOps::moe), for both activation dtypes: odd
// expert counts, top k from 1 to 8, experts no row chooses, every row routed to one expert,
// decode-sized batches (1-4 rows: the expert GEMV), larger ones (the grouped GEMM) and
// prefill-sized ones (>= 48 pairs per expert: the wide grouped GEMM, tiles of 128 pairs),
// SiLU and GPT-OSS's clamped SwiGLU with router and expert biases, both router normalizations,
// and one rank's run of experts under expert parallelism. Experts held as grouped integer
// codes (4-bit with offsets or zero points, 8-bit) take the integer GEMV per tile and, on the
// wide path, runs of dequantized experts; the reference then uses the codes' values.
//
// The reference rounds where the kernels round — the gate/up projection, the activation and
// each expert's output to the activation dtype, the combined output once — so what remains is
// fp32 summation order, which can put a value on the other side of a rounding edge. At the
// output that is one or two 16-bit steps (an expert's output, weighted, plus the final
// rounding: measured 1.4 steps, 4 of 48,960 values, at hidden 2880 in bf16); inside, an
// element of gate/up that rounds the other way moves h by one step, and the down projection
// carries that into the output as up to one step of the sum of its terms' magnitudes, which
// near an output of zero is many of the output's steps (seen: 31 of 1,152,000 values at 400
// rows, hidden 2880). So an output must agree within 4 steps of itself (4 x 2^-8 relative in
// bf16, 4 x 2^-10 in fp16) plus one step of its terms' magnitude plus 2e-3. Routing is
// compared exactly (ids and fp32 weights), since both sides read the same fp32 logits.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "act_test_util.h"
#include "cuda_test_util.h"
#include "io/grouped_codes.h"
#include "ops/cuda/gemv_int_dp4a.h"
#include "ops/cpu/ops.h"
#include "ops/cuda/moe.h"

using namespace kvlm;
using kvlm::test::Dev;
using namespace kvlm::test::act;

namespace {

struct MoeCase {
  int rows, hidden, inter, experts, top_k;
  bool norm_topk = true;
  GluActivation act = GluActivation::Silu;
  bool biases = false;
  int force_expert = -1;  // a router bias that sends every row to this expert first
  // Expert parallelism: the kernels hold experts [first, first + held) only (held 0: all) and
  // sum only their pairs; the reference sums the same.
  int first = 0, held = 0;
  // Experts as grouped codes (bits 4 or 8; 0: act weights), and experts per dequantized run on
  // the wide path (0: the kernels' choice).
  GroupedLayout codes{};
  int run_experts = 0;
};

// Random grouped codes for [rows][cols] and their values as the kernels decode them (s * code + b,
// or s (code - z), rounded to the compute type; the scale-after-MMA variant's unrounded values
// differ by half a step of a weight, within the tolerance's one step of the terms).
// exact: the unrounded values, what gemv_int_dp4a computes with (dp4a_linear).
struct Codes {
  std::vector<uint8_t> codes;
  std::vector<uint32_t> params;
  std::vector<float> values, exact;
};
Codes random_codes(DType act, GroupedLayout l, int64_t rows, int64_t cols, float scale, std::mt19937& rng) {
  Codes c;
  const size_t cb = grouped_code_bytes(l, cols), ng = size_t(grouped_groups(l, cols));
  c.codes.resize(size_t(rows) * cb);
  c.params.resize(size_t(rows) * ng);
  c.values.resize(size_t(rows * cols));
  std::uniform_int_distribution<int> byte(0, 255), zero(0, 15);
  std::uniform_real_distribution<float> s(0.5f, 1.5f);
  const float step = scale / (l.bits == 4 ? 7.5f : 127.5f);  // a code's step: values about +-scale
  for (auto& b : c.codes) b = uint8_t(byte(rng));
  for (int64_t r = 0; r < rows; ++r) {
    for (size_t g = 0; g < ng; ++g) {
      const float sg = step * s(rng);
      c.params[size_t(r) * ng + g] = l.zero_point ? grouped_param_zero_point(act, sg, zero(rng))
                                                  : grouped_param(act, sg, l.bits == 4 ? -8.0f * sg : 0.0f);
    }
    grouped_dequantize_row(l, act, c.codes.data() + size_t(r) * cb, c.params.data() + size_t(r) * ng, cols,
                           std::span<float>(c.values).subspan(size_t(r * cols), size_t(cols)));
  }
  c.exact = c.values;
  for (auto& v : c.values) v = act_round(act, v);
  return c;
}

// gemv_int_dp4a's arithmetic (decode batches of up to 4 rows): x quantized to int8 per block of
// `block` columns as the kernel quantizes it (dx = max |x| / 127, q = x * (127 / max |x|)
// rounded to nearest even, in fp32), every weight's exact value (offset included) times dx q;
// y = x . w^T (+ bias), w [n][k].
void dp4a_linear(std::span<const float> x, int k, const float* exact, int n, std::span<const float> bias, int block,
                 std::span<float> y) {
  std::vector<double> xq(static_cast<size_t>(k));
  for (int b0 = 0; b0 < k; b0 += block) {
    float amax = 0.0f;
    for (int i = b0; i < b0 + block; ++i) amax = std::max(amax, std::fabs(x[size_t(i)]));
    const float inv = amax > 0x1p-100f ? 127.0f / amax : 0.0f, dx = inv > 0.0f ? amax / 127.0f : 0.0f;
    for (int i = b0; i < b0 + block; ++i) xq[size_t(i)] = double(dx) * std::nearbyint(x[size_t(i)] * inv);
  }
  for (int j = 0; j < n; ++j) {
    double acc = bias.empty() ? 0.0 : bias[size_t(j)];
    for (int i = 0; i < k; ++i) {
      const size_t at = size_t(j) * size_t(k) + size_t(i);
      acc += double(exact[at]) * xq[size_t(i)];
    }
    y[size_t(j)] = float(acc);
  }
}
void run(DType act, const MoeCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int T = c.rows, H = c.hidden, I = c.inter, E = c.experts, K = c.top_k;
  const auto x = random_act(act, size_t(T) * H, rng);
  std::optional<Codes> gu_codes, down_codes;
  if (c.codes.bits) {
    gu_codes = random_codes(act, c.codes, int64_t(E) * 2 * I, H, 1.0f / std::sqrt(float(H)), rng);
    down_codes = random_codes(act, c.codes, int64_t(E) * H, I, 1.0f / std::sqrt(float(I)), rng);
  }
  const auto gate_up = gu_codes ? gu_codes->values : random_act(act, size_t(E) * 2 * I * H, rng, 1.0f / std::sqrt(float(H)));
  const auto down = down_codes ? down_codes->values : random_act(act, size_t(E) * H * I, rng, 1.0f / std::sqrt(float(I)));
  std::vector<float> gu_bias, down_bias, router_bias;
  if (c.biases) {
    gu_bias = random_act(act, size_t(E) * 2 * I, rng, 0.5f);
    down_bias = random_act(act, size_t(E) * H, rng, 0.5f);
  }
  if (c.biases || c.force_expert >= 0) router_bias = random_act(act, size_t(E), rng, 0.5f);
  if (c.force_expert >= 0) router_bias[size_t(c.force_expert)] = act_round(act, 64.0f);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(size_t(T) * E);
  for (auto& l : logits) l = nd(rng);
  MoeConfig cfg{.num_experts = E, .top_k = K, .expert_size = I, .norm_topk = c.norm_topk, .router_bias = !router_bias.empty(),
                .expert_bias = c.biases, .act = c.act, .swiglu_alpha = 1.702f, .swiglu_limit = 1.5f,
                .expert_parallel = c.held > 0, .expert_begin = c.first, .local_experts = c.held};
  const int held = cfg.held_experts(), first = cfg.expert_begin;

  // CPU reference, rounding where the kernels round.
  std::vector<float> biased = logits;
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      if (!router_bias.empty()) biased[size_t(t) * E + size_t(e)] += router_bias[size_t(e)];
  std::vector<int32_t> ids(size_t(T) * K);
  std::vector<float> wts(ids.size());
  ops::cpu::moe_route(biased, T, E, K, c.norm_topk, ids, wts);
  std::vector<float> ref(size_t(T) * H, 0.0f);
  // mag: the sum of the absolute values of the terms each output adds up. The kernels round
  // gate_up's output and h to the activation type as the reference does, but their fp32 sums
  // run in another order, so an element that lies near a rounding boundary can round the other
  // way: one ulp of h, which moves an output by up to rel * mag.
  std::vector<double> mag(size_t(T) * H, 0.0);
  std::vector<float> gu(size_t(2 * I)), h(static_cast<size_t>(I)), out(static_cast<size_t>(H));
  // Decode batches of grouped codes may run gemv_int_dp4a (int8 x): the reference then computes
  // as it does.
  auto dp4a_takes = [&](int n, int k) {
    return c.codes.bits > 0 && T <= 4 &&
           cuda::gemv_int_dp4a_takes(act, {.bits = c.codes.bits, .group = c.codes.group, .zero_point = c.codes.zero_point},
                                     T, k) &&
           cuda::gemv_int_dp4a_pays(T, n, k);
  };
  const bool gu_dp4a = dp4a_takes(2 * I, H), dn_dp4a = dp4a_takes(H, I);
  const int block = c.codes.bits ? 128 / c.codes.bits : 0;
  for (int t = 0; t < T; ++t) {
    std::vector<double> acc(static_cast<size_t>(H), 0.0);
    for (int k = 0; k < K; ++k) {
      const int e = ids[size_t(t) * K + size_t(k)];
      if (e < first || e >= first + held) continue;  // another rank's expert
      const auto gub =
          gu_bias.empty() ? std::span<const float>{} : std::span<const float>(gu_bias).subspan(size_t(e) * 2 * I, size_t(2 * I));
      if (gu_dp4a)
        dp4a_linear(std::span<const float>(x).subspan(size_t(t) * H, size_t(H)), H,
                    gu_codes->exact.data() + size_t(e) * 2 * I * H, 2 * I, gub, block, gu);
      else
        ops::cpu::linear(std::span<const float>(x).subspan(size_t(t) * H, size_t(H)), 1, H,
                         std::span<const float>(gate_up).subspan(size_t(e) * 2 * I * H, size_t(2 * I) * H), 2 * I, gub, gu);
      for (auto& v : gu) v = act_round(act, v);
      ops::cpu::glu(c.act, std::span<const float>(gu).first(size_t(I)), std::span<const float>(gu).subspan(size_t(I)), h,
                    cfg.swiglu_alpha, cfg.swiglu_limit);
      for (auto& v : h) v = act_round(act, v);
      const auto db =
          down_bias.empty() ? std::span<const float>{} : std::span<const float>(down_bias).subspan(size_t(e) * H, size_t(H));
      if (dn_dp4a)
        dp4a_linear(h, I, down_codes->exact.data() + size_t(e) * H * I, H, db, block, out);
      else
        ops::cpu::linear(h, 1, I, std::span<const float>(down).subspan(size_t(e) * H * I, size_t(H) * I), H, db, out);
      const double wk = wts[size_t(t) * K + size_t(k)];
      for (int j = 0; j < H; ++j) {
        acc[size_t(j)] += wk * act_round(act, out[size_t(j)]);
        const float* dr = down.data() + (size_t(e) * H + size_t(j)) * size_t(I);
        double m = down_bias.empty() ? 0.0 : std::fabs(down_bias[size_t(e) * H + size_t(j)]);
        for (int i = 0; i < I; ++i) m += std::fabs(double(h[size_t(i)]) * dr[i]);
        mag[size_t(t) * H + size_t(j)] += wk * m;
      }
    }
    for (int j = 0; j < H; ++j) ref[size_t(t) * H + size_t(j)] = float(acc[size_t(j)]);
  }

  // The device holds the held experts' weights only.
  auto held_part = [&](const std::vector<float>& v) {
    const size_t per = v.size() / size_t(E);
    return std::vector<float>(v.begin() + std::ptrdiff_t(size_t(first) * per), v.begin() + std::ptrdiff_t(size_t(first + held) * per));
  };
  Dev<uint16_t> dx(codes(act, x)), dgu(codes(act, held_part(gate_up))), ddown(codes(act, held_part(down))),
      dy(size_t(T) * H);
  Dev<float> dlogits(logits);
  std::optional<Dev<uint16_t>> dgub, ddb, drb;
  if (!gu_bias.empty()) dgub.emplace(codes(act, held_part(gu_bias)));
  if (!down_bias.empty()) ddb.emplace(codes(act, held_part(down_bias)));
  if (!router_bias.empty()) drb.emplace(codes(act, router_bias));
  Dev<uint8_t> ws(cuda::moe_workspace_bytes(act, T, H, I, E, K, c.codes.bits > 0));
  // Codes: the held experts' rows of codes and params.
  std::optional<Dev<uint8_t>> gu_c, dn_c;
  std::optional<Dev<uint32_t>> gu_p, dn_p;
  cuda::IntWeight gu_w, dn_w;
  if (gu_codes) {
    auto held_rows = [&](const auto& v) {
      using T0 = typename std::decay_t<decltype(v)>::value_type;
      const size_t per = v.size() / size_t(E);
      return std::vector<T0>(v.begin() + std::ptrdiff_t(size_t(first) * per), v.begin() + std::ptrdiff_t(size_t(first + held) * per));
    };
    gu_c.emplace(held_rows(gu_codes->codes));
    gu_p.emplace(held_rows(gu_codes->params));
    dn_c.emplace(held_rows(down_codes->codes));
    dn_p.emplace(held_rows(down_codes->params));
    const cuda::IntWeight base{.bits = c.codes.bits, .group = c.codes.group, .zero_point = c.codes.zero_point};
    gu_w = base, dn_w = base;
    gu_w.codes = gu_c->p, gu_w.params = gu_p->p, dn_w.codes = dn_c->p, dn_w.params = dn_p->p;
  }
  dy.poison();
  cuda::moe({.act = act, .rows = T, .hidden = H, .inter = I, .config = cfg, .logits = dlogits.p,
             .router_bias = drb ? drb->p : nullptr, .x = dx.p, .gate_up = gu_codes ? nullptr : dgu.p,
             .gate_up_bias = dgub ? dgub->p : nullptr, .down = gu_codes ? nullptr : ddown.p,
             .down_bias = ddb ? ddb->p : nullptr, .y = dy.p, .workspace = ws.p, .gate_up_codes = gu_w,
             .down_codes = dn_w, .int_run_experts = c.run_experts},
            nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> got;
  for (uint16_t v : dy.download()) got.push_back(act_value(act, v));
  const double rel = act_rel_tol(act), abs = 2e-3;
  auto tol = [&](size_t i) { return 4 * rel * std::fabs(double(ref[i])) + rel * mag[i] + abs; };
  auto excess = [&](size_t i) { return std::isnan(got[i]) ? 1e30 : std::fabs(double(got[i]) - ref[i]) / tol(i); };
  // Report the element furthest beyond its tolerance, not the largest error (which may be within it).
  size_t worst = 0, bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    bad += excess(i) > 1.0;
    if (excess(i) > excess(worst)) worst = i;
  }
  EXPECT_EQ(bad, 0u) << dtype_name(act) << " T=" << T << " E=" << E << " k=" << K << " H=" << H << " I=" << I
                         << " codes " << c.codes.bits << "-bit g" << c.codes.group << (c.codes.zero_point ? " zp" : "")
                         << ": " << bad << " of " << got.size() << " beyond tolerance; worst at row " << worst / size_t(H)
                         << " column " << worst % size_t(H) << " (got " << got[worst] << ", reference " << ref[worst]
                         << ", " << excess(worst) << "x the tolerance)";
  // The routing itself: the kernel's ids and weights (the workspace's first two arrays).
  std::vector<uint8_t> w = ws.download();
  const auto* gids = reinterpret_cast<const int32_t*>(w.data());
  const size_t ids_bytes = (size_t(T) * K * 4 + 255) / 256 * 256;
  const auto* gwts = reinterpret_cast<const float*>(w.data() + ids_bytes);
  for (size_t i = 0; i < ids.size(); ++i) {
    ASSERT_EQ(gids[i], ids[i]) << "pair " << i;
    EXPECT_NEAR(gwts[i], wts[i], 1e-6f) << "pair " << i;
  }
}

}  // namespace

TEST(CudaMoe, MatchesTheCpuReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const MoeCase cases[] = {
      {.rows = 5, .hidden = 64, .inter = 32, .experts = 7, .top_k = 3, .norm_topk = false},
      {.rows = 1, .hidden = 256, .inter = 64, .experts = 128, .top_k = 8},  // a decode step: 8 of 128 experts
      {.rows = 70, .hidden = 256, .inter = 96, .experts = 128, .top_k = 8},
      {.rows = 33, .hidden = 96, .inter = 64, .experts = 5, .top_k = 2, .act = GluActivation::SwigluClamp, .biases = true},
      {.rows = 300, .hidden = 64, .inter = 32, .experts = 9, .top_k = 1},
      {.rows = 40, .hidden = 128, .inter = 64, .experts = 6, .top_k = 1, .force_expert = 3},  // every row to expert 3
      {.rows = 17, .hidden = 2880, .inter = 64, .experts = 4, .top_k = 2, .act = GluActivation::SwigluClamp,
       .biases = true},  // GPT-OSS's hidden: A staged in 6 chunks
      // Batches of up to 4 rows take the expert GEMV (one kernel for 1 row, one for 2-4).
      {.rows = 3, .hidden = 2880, .inter = 96, .experts = 32, .top_k = 4, .act = GluActivation::SwigluClamp,
       .biases = true},  // GPT-OSS's shape: 360 16-byte vectors per weight row, not a multiple of the warp's stride
      {.rows = 16, .hidden = 128, .inter = 96, .experts = 6, .top_k = 2, .force_expert = 1},  // 16 rows on one expert
      {.rows = 2, .hidden = 96, .inter = 32, .experts = 3, .top_k = 3, .norm_topk = false},  // every expert, both rows
      // The wide grouped GEMM: columns not a multiple of its 128, K from one 32-wide step (down
      // over inter 32) to 90 (hidden 2880), an expert with 300 pairs (tiles of 128, 128, 44).
      {.rows = 600, .hidden = 160, .inter = 96, .experts = 5, .top_k = 2},
      {.rows = 400, .hidden = 2880, .inter = 64, .experts = 4, .top_k = 2, .act = GluActivation::SwigluClamp,
       .biases = true},
      {.rows = 300, .hidden = 128, .inter = 64, .experts = 6, .top_k = 2, .force_expert = 2},
      {.rows = 200, .hidden = 64, .inter = 32, .experts = 3, .top_k = 1},
  };
  uint32_t seed = 1;
  for (DType act : kActs)
    for (const MoeCase& c : cases) run(act, c, seed++);
  for (int k = 1; k <= 8; ++k) run(DType::BF16, {.rows = 9, .hidden = 64, .inter = 32, .experts = 11, .top_k = k}, 100 + k);
  // Expert parallelism: one rank's run of experts, in the GEMV (1-4 rows) and grouped paths,
  // with biases; a rank none of whose experts a row chose gives zeros for that row.
  for (const MoeCase& c : {MoeCase{.rows = 1, .hidden = 256, .inter = 64, .experts = 128, .top_k = 8, .first = 64, .held = 32},
                           MoeCase{.rows = 3, .hidden = 96, .inter = 64, .experts = 8, .top_k = 2,
                                   .act = GluActivation::SwigluClamp, .biases = true, .first = 4, .held = 4},
                           MoeCase{.rows = 70, .hidden = 256, .inter = 96, .experts = 128, .top_k = 8, .first = 0, .held = 64},
                           MoeCase{.rows = 33, .hidden = 96, .inter = 64, .experts = 6, .top_k = 2,
                                   .act = GluActivation::SwigluClamp, .biases = true, .first = 3, .held = 3},
                           MoeCase{.rows = 256, .hidden = 128, .inter = 64, .experts = 8, .top_k = 2, .first = 4, .held = 4}})
    for (DType act : kActs) run(act, c, seed++);
}

// Experts held as grouped codes: the integer GEMV over the routing's tiles (1-4 rows, decode
// batches, tiles of 16 pairs with several per expert), and the wide path's runs of dequantized
// experts (one run, and runs of 2 and 3 experts that cut the tiles' experts), 4-bit with
// offsets (g32) or zero points (g128: bf16 scales after the MMA), 8-bit (g32), expert parallelism.
TEST(CudaMoe, GroupedCodeExpertsMatchTheCpuReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  const GroupedLayout q4{.bits = 4, .group = 32}, zp{.bits = 4, .group = 128, .zero_point = true}, q8{.bits = 8, .group = 32};
  const MoeCase cases[] = {
      {.rows = 1, .hidden = 256, .inter = 128, .experts = 128, .top_k = 8, .codes = q4},
      {.rows = 1, .hidden = 256, .inter = 128, .experts = 128, .top_k = 8, .codes = zp},
      {.rows = 3, .hidden = 2880, .inter = 96, .experts = 32, .top_k = 4, .act = GluActivation::SwigluClamp,
       .biases = true, .codes = q4},
      {.rows = 2, .hidden = 96, .inter = 32, .experts = 3, .top_k = 3, .norm_topk = false, .codes = q8},
      {.rows = 70, .hidden = 256, .inter = 128, .experts = 128, .top_k = 8, .codes = zp},
      {.rows = 33, .hidden = 96, .inter = 64, .experts = 5, .top_k = 2, .act = GluActivation::SwigluClamp,
       .biases = true, .codes = q4},  // 13 pairs an expert: tiles of 16 pairs, several per expert
      {.rows = 40, .hidden = 128, .inter = 64, .experts = 6, .top_k = 1, .force_expert = 3, .codes = q8},
      {.rows = 600, .hidden = 160, .inter = 96, .experts = 5, .top_k = 2, .codes = q4},
      {.rows = 600, .hidden = 256, .inter = 128, .experts = 5, .top_k = 2, .codes = zp, .run_experts = 2},
      {.rows = 400, .hidden = 2880, .inter = 64, .experts = 4, .top_k = 2, .act = GluActivation::SwigluClamp,
       .biases = true, .codes = q4, .run_experts = 3},
      {.rows = 1, .hidden = 256, .inter = 64, .experts = 128, .top_k = 8, .first = 64, .held = 32, .codes = q4},
      {.rows = 256, .hidden = 128, .inter = 64, .experts = 8, .top_k = 2, .first = 4, .held = 4, .codes = q8,
       .run_experts = 3},
  };
  uint32_t seed = 500;
  for (DType act : kActs)
    for (const MoeCase& c : cases) run(act, c, seed++);
}

TEST(CudaMoe, RefusesShapesItCannotRun) {
  EXPECT_FALSE(cuda::moe_fits(72, 32, 8, 2));  // hidden not a multiple of 32
  EXPECT_FALSE(cuda::moe_fits(64, 40, 8, 2));
  EXPECT_FALSE(cuda::moe_fits(64, 32, 8, 9));
  EXPECT_FALSE(cuda::moe_fits(64, 32, 2048, 2));
  EXPECT_TRUE(cuda::moe_fits(2048, 768, 128, 8));
  EXPECT_TRUE(cuda::moe_fits(2880, 2880, 32, 4));
  EXPECT_TRUE(cuda::moe_int_fits(2048, 768, 4, 128));
  EXPECT_FALSE(cuda::moe_int_fits(2880, 2880, 4, 128));  // groups of 128 do not tile 2880
  EXPECT_TRUE(cuda::moe_int_fits(2880, 2880, 4, 32));
  EXPECT_FALSE(cuda::moe_int_fits(2048, 768, 4, 16));    // a lane's 32 codes would span two groups
}

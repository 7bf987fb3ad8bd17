// The CPU attention backend against two references, for every KV format, every mask kind,
// several head sizes and GQA ratios, on a ragged batch whose block tables have holes:
//  1. exact: softmax attention in double over the rows as stored (decoded one by one),
//     which isolates the paging, masking and online-softmax logic (tolerance 2e-5);
//  2. quantization: the same attention over the original fp32 K/V, with a per-format bound
//     on the relative rms error (justified next to bound() below).
// Outputs are poisoned with NaN before each run, so an unwritten row fails.
#include <gtest/gtest.h>

#include <optional>

#include <algorithm>
#include <bit>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>

#include "attention/cpu_backend.h"
#include "kv/kv_format.h"
#include "kv/kv_plan.h"
#include "core/hadamard.h"

using namespace kvlm;

namespace {

struct SeqShape {
  int kv_len, q_len;
};

struct Case {
  KVCacheDType dtype;
  AttentionKind kind;
  int window;
  int head_dim;
  int q_heads, kv_heads;
  int block_size;
  bool rotate = false;  // as CpuOps does for a rotated layer: R q, R k, R v in, R^T on the output
  int keep_sink = 0, keep_recent = 0;  // exact sink / recent tokens
  bool exact_bf16 = false;             // exact copies in bfloat16 (else the fp32 model dtype)
  bool sinks = false;                  // learned attention sinks, one per query head (GPT-OSS)
  float sink_fill = NAN;               // with sinks: every head's sink (NaN: random, head 0 at -inf)
  std::optional<KVCacheDType> v_dtype;  // V in its own format (K: dtype)
};

// Bound on rms(out - ref) / rms(ref) against attention over the unquantized K/V.
// Rounding to a float format with p significand bits has relative rms error about
// 2^-p / sqrt(3); K and V errors both reach the output (K through the softmax weights),
// so the bound is 4x that: float16 (p=11) 1.1e-3, bfloat16 (p=8) 9e-3, e4m3 (p=4) 0.144,
// e5m2 (p=3) 0.29; per-token-head e4m3 rescales each row to [-448, 448] first: same p.
// int8 per token-head: step absmax/127 with rms error step/sqrt(12); rows holding an x8
// outlier channel have absmax ~25x their rms, giving ~0.02 -> bound 0.06.
// int4 with a zero point: step (max - min) / 15, about 17x int8's absmax / 127 on these rows
// (an 8x outlier channel makes max - min ~ 2 absmax): ~0.028 x 17 ~ 0.47 -> bound 0.6. The
// Hadamard rotation spreads the outlier over the row first (RotationHelpsInt4 below).
// Measured (printed by the test): 5e-4, 5.5e-3, 0.079, 0.128, 0.040, 0.028, 0.12-0.38.
double bound(KVCacheDType d) {
  switch (d) {
    case KVCacheDType::Float16: return 1.1e-3;
    case KVCacheDType::BFloat16: return 9e-3;
    case KVCacheDType::Fp8:
    case KVCacheDType::Fp8E4M3: return 0.144;
    case KVCacheDType::Fp8E5M2: return 0.29;
    case KVCacheDType::Fp8PerTokenHead: return 0.144;
    case KVCacheDType::Int8PerTokenHead: return 0.06;
    case KVCacheDType::Int4PerTokenHead: return 0.6;
    case KVCacheDType::Auto: return 2e-6;  // fp32 storage: only summation order differs
  }
  return 0;
}

std::pair<int, int> visible(const Case& c, int pos, int kv_len) {
  switch (c.kind) {
    case AttentionKind::Full: return {0, pos + 1};
    case AttentionKind::Sliding: return {std::max(0, pos - c.window + 1), pos + 1};
    case AttentionKind::NonCausal: return {0, kv_len};
  }
  return {0, 0};
}

// Attention in double for one (token, head): rows k/v are [kv_len][d] fp32.
void ref_attend(const Case& c, const float* q, const std::vector<float>& k, const std::vector<float>& v, int pos, int kv_len,
                int d, float scale, double* out, double sink = -INFINITY) {
  auto [lo, hi] = visible(c, pos, kv_len);
  std::vector<double> s(size_t(hi - lo));
  double m = -1e300;
  for (int j = lo; j < hi; ++j) {
    double dot = 0;
    for (int x = 0; x < d; ++x) dot += double(q[x]) * k[size_t(j) * size_t(d) + size_t(x)];
    s[size_t(j - lo)] = dot * scale;
    m = std::max(m, s[size_t(j - lo)]);
  }
  double sum = std::exp(sink - m);  // a sink joins the denominator only (transformers: a column of the softmax)
  for (auto& e : s) sum += (e = std::exp(e - m));
  for (int x = 0; x < d; ++x) {
    double acc = 0;
    for (int j = lo; j < hi; ++j) acc += s[size_t(j - lo)] * v[size_t(j) * size_t(d) + size_t(x)];
    out[x] = acc / sum;
  }
}

struct Result {
  double exact_err = 0;  // max |out - exact reference|
  double quant_err = 0;  // rms(out - unquantized reference) / rms(unquantized reference)
};

Result run_case(const Case& c, uint32_t seed, std::vector<float>* output = nullptr) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const std::vector<SeqShape> shapes{{37, 5}, {1, 1}, {70, 70}, {18, 3}};
  const int d = c.head_dim, kvh = c.kv_heads, nh = c.q_heads, bs = c.block_size;

  CacheConfig cc;
  cc.kv_cache_dtype = c.dtype;
  cc.keep_sink = c.keep_sink;
  cc.keep_recent = c.keep_recent;
  const AttentionLayerDesc desc{.layer = 0, .kind = c.kind, .window = c.window, .num_q_heads = nh, .num_kv_heads = kvh,
                                .head_dim = d, .sinks = c.sinks};
  KVPlan plan = build_kv_plan(cc, {&desc, 1}, DType::F32, std::nullopt, {});
  if (c.v_dtype) plan.layers[0].v = *kv_storage_of(*c.v_dtype);
  if (plan.layers[0].k.mode == KVQuantMode::Fp8PerTensor || plan.layers[0].v.mode == KVQuantMode::Fp8PerTensor) {
    plan.layers[0].k_scale = {0.5f};  // a non-trivial static scale
    plan.layers[0].v_scale = {0.25f};
  }
  const bool keep = plan.layers[0].keeps_exact();
  if (keep && c.exact_bf16) plan.layers[0].exact_storage = DType::BF16;
  // Pages: shuffled pool twice the size needed, so tables are scattered with holes.
  int pages_needed = 0;
  for (auto s : shapes) pages_needed += (s.kv_len + bs - 1) / bs;
  KVCache cache(plan, 2 * pages_needed + 3, bs, keep ? 2 * pages_needed + 3 : 0);
  std::vector<BlockId> pool(size_t(cache.num_blocks()));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  // Exact pages, from their own shuffled pool (another generator: the data stays as without).
  std::mt19937 erng(seed + 1000);
  std::vector<BlockId> epool(size_t(cache.num_exact_pages()));
  std::iota(epool.begin(), epool.end(), 0);
  std::shuffle(epool.begin(), epool.end(), erng);
  size_t next_exact = 0;
  std::vector<std::vector<BlockId>> exact_tables;
  // Whether key j is read exact by the query at `pos` (non-causal: the last position).
  auto read_exact = [&](int j, int pos, int kv_len) {
    const int qpos = c.kind == AttentionKind::NonCausal ? kv_len - 1 : pos;
    return keep && kv_key_exact(j, qpos, c.keep_sink, c.keep_recent);
  };

  const CpuAttentionBackend be;
  std::vector<std::vector<BlockId>> tables;
  std::vector<std::vector<float>> k_orig, v_orig;
  size_t next_page = 0;
  int total_q = 0;
  for (auto s : shapes) {
    std::vector<BlockId> t;
    for (int i = 0; i < (s.kv_len + bs - 1) / bs; ++i) {
      t.push_back(pool[next_page]);
      next_page += 2;  // leave a hole
    }
    tables.push_back(t);
    // An exact page only where some query of the call reads a key of it exact: the backend
    // must never look for one elsewhere.
    std::vector<BlockId> et(t.size(), -1);
    for (int t_ = 0; t_ < s.q_len; ++t_) {
      const int pos = s.kv_len - s.q_len + t_;
      auto [lo, hi] = visible(c, pos, s.kv_len);
      for (int j = lo; j < hi; ++j)
        if (read_exact(j, pos, s.kv_len) && et[size_t(j / bs)] < 0) et[size_t(j / bs)] = epool[next_exact++];
    }
    exact_tables.push_back(et);
    std::vector<SlotId> exact_slots;
    if (keep)
      for (int p = 0; p < s.kv_len; ++p)
        exact_slots.push_back(et[size_t(p / bs)] < 0 ? -1 : SlotId(et[size_t(p / bs)]) * bs + p % bs);
    std::vector<float> k(size_t(s.kv_len) * size_t(kvh) * size_t(d)), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      const bool outlier = (i % size_t(d)) % 50 == 7;  // a few large K channels, as in real LLMs
      k[i] = nd(rng) * (outlier ? 8.0f : 1.0f);
      v[i] = nd(rng);
    }
    std::vector<SlotId> slots(static_cast<size_t>(s.kv_len));
    for (int p = 0; p < s.kv_len; ++p) slots[size_t(p)] = SlotId(t[size_t(p / bs)]) * bs + p % bs;
    std::vector<float> ks = k, vs = v;
    if (c.rotate)
      for (size_t r = 0; r < ks.size() / size_t(d); ++r) {
        num::hadamard_rotate(ks.data() + r * size_t(d), d);
        num::hadamard_rotate(vs.data() + r * size_t(d), d);
      }
    be.store_kv(cache.layer(0), KVWrite{.k = ks, .v = vs, .slots = slots, .exact_slots = exact_slots});
    k_orig.push_back(std::move(k));
    v_orig.push_back(std::move(v));
    total_q += s.q_len;
  }
  std::vector<float> q(size_t(total_q) * size_t(nh) * size_t(d));
  for (auto& x : q) x = nd(rng);
  // Sinks from well below to above the scores, and one head without (-inf).
  std::vector<float> sinks;
  if (c.sinks) {
    for (int h = 0; h < nh; ++h) sinks.push_back(3.0f * nd(rng));
    sinks[0] = -std::numeric_limits<float>::infinity();
    if (!std::isnan(c.sink_fill)) std::ranges::fill(sinks, c.sink_fill);
  }
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<AttnSeq> seqs;
  int row = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    seqs.push_back({.q_begin = row, .q_len = shapes[i].q_len, .kv_len = shapes[i].kv_len, .block_table = tables[i],
                    .exact_table = keep ? std::span<const BlockId>(exact_tables[i]) : std::span<const BlockId>{}});
    row += shapes[i].q_len;
  }
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<float> qa = q;  // what the backend sees: rotated queries for a rotated layer
  if (c.rotate)
    for (size_t r = 0; r < qa.size() / size_t(d); ++r) num::hadamard_rotate(qa.data() + r * size_t(d), d);
  be.attend(cache.layer(0), AttentionCall{.q = qa, .out = out, .seqs = seqs, .softmax_scale = scale, .sinks = sinks});
  std::vector<float> out_rot = out;  // the backend's own output (rotated space)
  if (output) *output = out;
  if (c.rotate)
    for (size_t r = 0; r < out.size() / size_t(d); ++r) num::hadamard_rotate(out.data() + r * size_t(d), d, true);

  Result r;
  double err2 = 0, ref2 = 0;
  const LayerKVCache& L = cache.layer(0);
  const KVLayerSpec& spec = plan.layers[0];
  for (size_t si = 0; si < shapes.size(); ++si) {
    const auto s = shapes[si];
    for (int g = 0; g < kvh; ++g) {
      // Rows as stored, decoded one at a time through the format codec; exact copies too.
      std::vector<float> ks(size_t(s.kv_len) * size_t(d)), vs(ks.size()), ko(ks.size()), vo(ks.size());
      std::vector<float> ke(ks.size(), std::numeric_limits<float>::quiet_NaN()), ve(ke);
      if (keep)
        kvfmt::dispatch_kv(spec.exact_storage, KVQuantMode::None, [&](auto fmt) {
          using Exact = decltype(fmt);
          for (int p = 0; p < s.kv_len; ++p) {
            const BlockId e = exact_tables[si][size_t(p / bs)];
            if (e < 0) continue;
            const size_t at = L.exact_row_byte(e, g, p % bs);
            Exact::decode_row(L.ek.data() + at, 1.0f, {ke.data() + size_t(p) * size_t(d), size_t(d)});
            Exact::decode_row(L.ev.data() + at, 1.0f, {ve.data() + size_t(p) * size_t(d), size_t(d)});
          }
        });
      for (const KVSide side : {KVSide::K, KVSide::V}) {  // each side in its own format
        const KVStorage& kv = spec.format(side);
        const bool is_k = side == KVSide::K;
        kvfmt::dispatch_kv(kv.storage, kv.mode, [&](auto fmt) {
          using Fmt = decltype(fmt);
          for (int p = 0; p < s.kv_len; ++p) {
            const int64_t blk = tables[si][size_t(p / bs)];
            const int off = p % bs;
            float sc = is_k ? spec.k_scale_for(g) : spec.v_scale_for(g);
            if (is_per_token_head(kv.mode)) sc = (is_k ? L.k_scale : L.v_scale)[L.scale_index(blk, g, off)];
            Fmt::decode_row((is_k ? L.k : L.v).data() + L.row_byte(side, blk, g, off), sc,
                            {(is_k ? ks : vs).data() + size_t(p) * size_t(d), size_t(d)});
          }
        });
      }
      for (int p = 0; p < s.kv_len; ++p)
        for (int x = 0; x < d; ++x) {
          ko[size_t(p) * size_t(d) + size_t(x)] = k_orig[si][(size_t(p) * size_t(kvh) + size_t(g)) * size_t(d) + size_t(x)];
          vo[size_t(p) * size_t(d) + size_t(x)] = v_orig[si][(size_t(p) * size_t(kvh) + size_t(g)) * size_t(d) + size_t(x)];
        }
      for (int t = 0; t < s.q_len; ++t) {
        const int pos = s.kv_len - s.q_len + t;
        for (int hg = 0; hg < nh / kvh; ++hg) {
          const int h = g * (nh / kvh) + hg;
          const size_t at = (size_t(seqs[si].q_begin + t) * size_t(nh) + size_t(h)) * size_t(d);
          std::vector<double> e(static_cast<size_t>(d)), o(static_cast<size_t>(d));
          std::vector<float> kq = ks, vq = vs;  // the rows this query reads
          for (int j = 0; j < s.kv_len; ++j)
            if (read_exact(j, pos, s.kv_len)) {
              std::copy_n(ke.begin() + ptrdiff_t(j) * d, d, kq.begin() + ptrdiff_t(j) * d);
              std::copy_n(ve.begin() + ptrdiff_t(j) * d, d, vq.begin() + ptrdiff_t(j) * d);
            }
          const double sink = c.sinks ? double(sinks[size_t(h)]) : -INFINITY;
          ref_attend(c, qa.data() + at, kq, vq, pos, s.kv_len, d, scale, e.data(), sink);
          ref_attend(c, q.data() + at, ko, vo, pos, s.kv_len, d, scale, o.data(), sink);
          for (int x = 0; x < d; ++x) {
            const double got = out[at + size_t(x)];
            if (std::isnan(got)) return {1e9, 1e9};
            r.exact_err = std::max(r.exact_err, std::fabs(double(out_rot[at + size_t(x)]) - e[size_t(x)]));
            err2 += (got - o[size_t(x)]) * (got - o[size_t(x)]);
            ref2 += o[size_t(x)] * o[size_t(x)];
          }
        }
      }
    }
  }
  r.quant_err = std::sqrt(err2 / ref2);
  return r;
}

}  // namespace

class AttentionAllFormats : public ::testing::TestWithParam<KVCacheDType> {};

TEST_P(AttentionAllFormats, MatchesReferences) {
  const KVCacheDType dt = GetParam();
  const Case shapes[] = {
      {dt, AttentionKind::Full, 0, 64, 8, 2, 16},
      {dt, AttentionKind::Full, 0, 128, 4, 4, 16},
      {dt, AttentionKind::Sliding, 8, 64, 8, 2, 16},
      {dt, AttentionKind::Sliding, 20, 32, 6, 3, 8},
      {dt, AttentionKind::NonCausal, 0, 64, 8, 2, 16},
      {dt, AttentionKind::NonCausal, 0, 256, 4, 1, 16},
      {dt, AttentionKind::Full, 0, 8, 8, 4, 1},  // stories260K-like head, block size 1
      // GPT-OSS: learned sinks, on full and sliding layers (head_dim 64, 8 q / 2 kv heads here).
      {.dtype = dt, .kind = AttentionKind::Full, .window = 0, .head_dim = 64, .q_heads = 8, .kv_heads = 2,
       .block_size = 16, .sinks = true},
      {.dtype = dt, .kind = AttentionKind::Sliding, .window = 8, .head_dim = 64, .q_heads = 8, .kv_heads = 2,
       .block_size = 16, .sinks = true},
      {.dtype = dt, .kind = AttentionKind::NonCausal, .window = 0, .head_dim = 32, .q_heads = 4, .kv_heads = 4,
       .block_size = 8, .sinks = true},
  };
  uint32_t seed = 1;
  for (const Case& c : shapes) {
    const Result r = run_case(c, seed++);
    std::printf("[attention] %-20s %-10s%s hd=%-3d heads=%d/%d bs=%-2d exact=%.2e vs-unquantized=%.3e (bound %.1e)\n",
                std::string(kv_cache_dtype_name(dt)).c_str(), std::string(attention_kind_name(c.kind)).c_str(),
                c.sinks ? " sinks" : "", c.head_dim,
                c.q_heads, c.kv_heads, c.block_size, r.exact_err, r.quant_err, bound(dt));
    EXPECT_LT(r.exact_err, 2e-5) << attention_kind_name(c.kind) << " hd " << c.head_dim;
    EXPECT_LT(r.quant_err, bound(dt)) << attention_kind_name(c.kind) << " hd " << c.head_dim;
  }
}

INSTANTIATE_TEST_SUITE_P(KV, AttentionAllFormats,
                         ::testing::Values(KVCacheDType::Auto, KVCacheDType::Float16, KVCacheDType::BFloat16, KVCacheDType::Fp8,
                                           KVCacheDType::Fp8E5M2, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                                           KVCacheDType::Int4PerTokenHead),
                         [](const auto& info) { return std::string(kv_cache_dtype_name(info.param)); });

// K and V in different formats (KVLayerSpec::k != v): every useful pair, every mask, exact
// tokens and sinks; each side decodes with its own codec, so the output matches attention over
// the stored rows as closely as a uniform format's, and stays within the looser side's bound.
TEST(Attention, SeparateKAndVFormats) {
  uint32_t seed = 100;
  for (const KVCacheDType k : {KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead})
    for (const KVCacheDType v : {KVCacheDType::Fp8, KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
      const Case shapes[] = {
          {.dtype = k, .kind = AttentionKind::Full, .window = 0, .head_dim = 64, .q_heads = 8, .kv_heads = 2, .block_size = 16,
           .v_dtype = v},
          {.dtype = k, .kind = AttentionKind::Sliding, .window = 8, .head_dim = 32, .q_heads = 6, .kv_heads = 3,
           .block_size = 8, .keep_sink = 2, .keep_recent = 4, .v_dtype = v},
          {.dtype = k, .kind = AttentionKind::NonCausal, .window = 0, .head_dim = 64, .q_heads = 8, .kv_heads = 2,
           .block_size = 16, .sinks = true, .v_dtype = v},
      };
      for (const Case& c : shapes) {
        const Result r = run_case(c, seed++);
        const double b = std::max(bound(k), bound(v));
        std::printf("[attention] K %-19s V %-19s %-10s exact=%.2e vs-unquantized=%.3e (bound %.1e)\n",
                    std::string(kv_cache_dtype_name(k)).c_str(), std::string(kv_cache_dtype_name(v)).c_str(),
                    std::string(attention_kind_name(c.kind)).c_str(), r.exact_err, r.quant_err, b);
        EXPECT_LT(r.exact_err, 2e-5) << kv_cache_dtype_name(k) << " / " << kv_cache_dtype_name(v);
        EXPECT_LT(r.quant_err, b) << kv_cache_dtype_name(k) << " / " << kv_cache_dtype_name(v);
      }
    }
}

// The rotation (core/hadamard.h) on K with 8x outlier channels: every per-token-head format
// stays exact against its own stored rows; the integer formats' error against unquantized
// attention drops (measured: int8 2.3-2.5x, int4 1.7-2.0x — int4's 16 levels leave a large
// error on the Gaussian rows the rotation makes), FP8's does not (its relative error per
// element does not depend on the row's range: measured 1.0-1.35x worse, as on real models,
// docs/results/accuracy-real.md), so FP8 only has to stay inside its bound.
TEST(Attention, RotationHelpsQuantizedFormats) {
  for (KVCacheDType dt : {KVCacheDType::Int4PerTokenHead, KVCacheDType::Int8PerTokenHead, KVCacheDType::Fp8PerTokenHead}) {
    for (const Case& base : {Case{dt, AttentionKind::Full, 0, 64, 8, 2, 16}, Case{dt, AttentionKind::Sliding, 20, 128, 4, 4, 16},
                             Case{dt, AttentionKind::NonCausal, 0, 256, 4, 1, 16}}) {
      Case rot = base;
      rot.rotate = true;
      const Result plain = run_case(base, 7), rotated = run_case(rot, 7);
      std::printf("[rotation] %-20s hd=%-3d unrotated %.3e rotated %.3e (exact %.1e)\n",
                  std::string(kv_cache_dtype_name(dt)).c_str(), base.head_dim, plain.quant_err, rotated.quant_err,
                  rotated.exact_err);
      EXPECT_LT(rotated.exact_err, 2e-5);
      const double gain = dt == KVCacheDType::Int8PerTokenHead ? 2.0 : dt == KVCacheDType::Int4PerTokenHead ? 1.5 : 0.0;
      if (gain > 0) EXPECT_LT(rotated.quant_err * gain, plain.quant_err) << kv_cache_dtype_name(dt) << " hd " << base.head_dim;
      EXPECT_LT(rotated.quant_err, bound(dt)) << kv_cache_dtype_name(dt) << " hd " << base.head_dim;
    }
  }
}

// Exact sink / recent tokens (kv_plan.h's kv_key_exact): the backend reads each query's keys
// from the exact pages exactly where the rule says — the stored-rows reference picks the same
// rows per query (exact within 2e-5; a misread row is an O(step) error, far above that) —
// and nowhere else (exact pages exist only where some query needs one; any other lookup
// throws). Keeping tokens exact lowers the error against unquantized attention; keeping more
// than the context in fp32 leaves only summation order.
TEST(Attention, ExactSinkAndRecentTokens) {
  for (KVCacheDType dt : {KVCacheDType::Int4PerTokenHead, KVCacheDType::Int8PerTokenHead, KVCacheDType::Fp8}) {
    for (const Case& base : {Case{dt, AttentionKind::Full, 0, 64, 8, 2, 16}, Case{dt, AttentionKind::Sliding, 20, 32, 6, 3, 8},
                             Case{dt, AttentionKind::NonCausal, 0, 128, 4, 1, 16}, Case{dt, AttentionKind::Full, 0, 8, 8, 4, 1},
                             Case{.dtype = dt, .kind = AttentionKind::Sliding, .window = 8, .head_dim = 64, .q_heads = 8,
                                  .kv_heads = 2, .block_size = 16, .sinks = true}}) {
      const Result plain = run_case(base, 11);
      for (auto [sink, recent, rotate, bf16] : {std::tuple{4, 8, false, false}, std::tuple{0, 16, true, false},
                                                std::tuple{3, 0, false, true}, std::tuple{2, 5, true, true}}) {
        Case c = base;
        c.keep_sink = sink;
        c.keep_recent = recent;
        c.rotate = rotate && dt != KVCacheDType::Fp8;
        c.exact_bf16 = bf16;
        const Result r = run_case(c, 11);
        std::printf("[exact] %-20s %-10s hd=%-3d sink %d recent %-2d%s%s exact=%.2e vs-unquantized %.3e (none kept %.3e)\n",
                    std::string(kv_cache_dtype_name(dt)).c_str(), std::string(attention_kind_name(base.kind)).c_str(),
                    base.head_dim, sink, recent, c.rotate ? " rotated" : "", bf16 ? " bf16" : "", r.exact_err, r.quant_err,
                    plain.quant_err);
        EXPECT_LT(r.exact_err, 2e-5) << kv_cache_dtype_name(dt) << " " << attention_kind_name(base.kind);
        if (!c.rotate && !bf16) EXPECT_LT(r.quant_err, plain.quant_err) << kv_cache_dtype_name(dt);
        EXPECT_LT(r.quant_err, bound(dt));
      }
      Case all = base;  // every key within the recent window: fp32 throughout
      all.keep_recent = 1000;
      const Result r = run_case(all, 11);
      EXPECT_LT(r.exact_err, 2e-5);
      EXPECT_LT(r.quant_err, bound(KVCacheDType::Auto)) << kv_cache_dtype_name(dt) << " " << attention_kind_name(base.kind);
    }
  }
}

// A sink of -inf adds exp(-inf) = 0 to the denominator: the output is bit for bit the plain
// softmax's, in every format (GPT-OSS's sinks must cost nothing where they are absent).
TEST(Attention, SinkOfMinusInfinityIsThePlainSoftmax) {
  for (KVCacheDType dt : {KVCacheDType::Auto, KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead,
                          KVCacheDType::Int4PerTokenHead}) {
    for (AttentionKind kind : {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal}) {
      const Case plain{dt, kind, 8, 64, 8, 2, 16};
      Case sunk = plain;
      sunk.sinks = true;
      sunk.sink_fill = -std::numeric_limits<float>::infinity();
      std::vector<float> a, b;
      run_case(plain, 5, &a);
      run_case(sunk, 5, &b);
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)))
          << kv_cache_dtype_name(dt) << " " << attention_kind_name(kind);
    }
  }
}

// core/hadamard.h: R is orthogonal (R^T R = I, checked in double against the explicit matrix
// H diag(s) / sqrt(d)), and the inverse undoes the forward transform.
TEST(Attention, HadamardRotationIsOrthogonal) {
  for (int d : {8, 16, 64, 128, 256}) {
    std::vector<double> m(size_t(d) * size_t(d));
    for (int j = 0; j < d; ++j) {  // column j = R e_j
      std::vector<float> e(size_t(d), 0.0f);
      e[size_t(j)] = 1.0f;
      num::hadamard_rotate(e.data(), d);
      for (int i = 0; i < d; ++i) {
        m[size_t(i) * size_t(d) + size_t(j)] = e[size_t(i)];
        const double h = (std::popcount(unsigned(i & j)) % 2 ? -1.0 : 1.0) * (num::hadamard_sign_negative(uint32_t(j)) ? -1.0 : 1.0) /
                         std::sqrt(double(d));
        EXPECT_NEAR(e[size_t(i)], h, 1e-7) << "d " << d << " (" << i << ", " << j << ")";
      }
    }
    for (int a = 0; a < d; ++a)
      for (int b = 0; b < d; ++b) {
        double dot = 0;
        for (int i = 0; i < d; ++i) dot += m[size_t(i) * size_t(d) + size_t(a)] * m[size_t(i) * size_t(d) + size_t(b)];
        EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-6);
      }
    std::mt19937 rng{uint32_t(d)};
    std::normal_distribution<float> nd;
    std::vector<float> x(static_cast<size_t>(d)), y;
    for (auto& v : x) v = nd(rng);
    y = x;
    num::hadamard_rotate(y.data(), d);
    num::hadamard_rotate(y.data(), d, true);
    for (int i = 0; i < d; ++i) EXPECT_NEAR(y[size_t(i)], x[size_t(i)], 1e-5);
  }
}

// Guard rails: a block table that is too short or names a page outside the pool is a bug
// in the caller, reported as an error instead of reading out of bounds.
TEST(Attention, RejectsBadBlockTables) {
  CacheConfig cc;  // (reused below with exact tokens)
  const AttentionLayerDesc desc{.num_q_heads = 2, .num_kv_heads = 1, .head_dim = 8};
  const KVPlan plan = build_kv_plan(cc, {&desc, 1}, DType::F32, std::nullopt, {});
  KVCache cache(plan, 4, 4);
  const CpuAttentionBackend be;
  std::vector<float> q(16), out(16);
  const std::vector<BlockId> short_table{0};
  const AttnSeq s1{.q_begin = 0, .q_len = 1, .kv_len = 8, .block_table = short_table};
  EXPECT_THROW(be.attend(cache.layer(0), {.q = q, .out = out, .seqs = {&s1, 1}}), Error);
  const std::vector<BlockId> bad{0, 9};
  const AttnSeq s2{.q_begin = 0, .q_len = 1, .kv_len = 8, .block_table = bad};
  EXPECT_THROW(be.attend(cache.layer(0), {.q = q, .out = out, .seqs = {&s2, 1}}), Error);
  const std::vector<float> kv(8);
  const std::vector<SlotId> slot{16};
  EXPECT_THROW(be.store_kv(cache.layer(0), {.k = kv, .v = kv, .slots = slot}), Error);
  // Exact tokens: a page whose keys a query reads exact must have an exact page (the engine's
  // bookkeeping), or the call is an error, not a read of the quantized rows instead.
  cc.kv_cache_dtype = KVCacheDType::Int8PerTokenHead;
  cc.keep_sink = 1;
  cc.keep_recent = 2;
  const KVPlan kp = build_kv_plan(cc, {&desc, 1}, DType::F32, std::nullopt, {});
  KVCache kc(kp, 4, 4, 4);
  const std::vector<BlockId> table{0, 1};
  const std::vector<BlockId> no_window{0, -1}, fine{0, 3}, none{};
  for (const auto& et : {no_window, none}) {
    const AttnSeq s3{.q_begin = 0, .q_len = 1, .kv_len = 8, .block_table = table, .exact_table = et};
    EXPECT_THROW(be.attend(kc.layer(0), {.q = q, .out = out, .seqs = {&s3, 1}}), Error);
  }
  const AttnSeq s4{.q_begin = 0, .q_len = 1, .kv_len = 8, .block_table = table, .exact_table = fine};
  EXPECT_NO_THROW(be.attend(kc.layer(0), {.q = q, .out = out, .seqs = {&s4, 1}}));
}

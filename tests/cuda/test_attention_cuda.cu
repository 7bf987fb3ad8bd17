// The CUDA attention kernels (src/ops/cuda) against CpuAttentionBackend, the reference.
//
// For every KV format the CUDA kernels support, head sizes 8/16/32/64/128/256, causal /
// sliding / non-causal masks and GQA ratios 1/4/8:
//  1. kv_store on the GPU must write pages (codes and per-token-head scales) byte-identical
//     to CpuAttentionBackend::store_kv on the same bf16-representable inputs. Both sides
//     compute x / scale with IEEE division and round with the same rule (fp8: saturating
//     RNE, hardware cvt on the GPU = core/numeric.h on the CPU, proven on all 2^32 inputs —
//     and core/numeric.h itself on the GPU on sm_80 or in a KVLM_FORCE_SOFTWARE_FP8 build;
//     int8: rint half-to-even; fp16: RNE), so no tie can differ: equality is required.
//  2. paged_attention on those pages must match the CPU backend's attend (fp32 queries with
//     the same bf16-representable values) on ragged batches: a decode batch (split-KV path
//     with its reduction) and a batch mixing decode rows with multi-token rows, run once with
//     automatic splits and once unsplit. Block tables are shuffled with holes and padded
//     with -1, so a read past a sequence's pages faults (and compute-sanitizer reports it).
//     Slots no sequence wrote hold NaN bytes, and outputs are poisoned with NaN first.
// Tolerance (same for every format, since both backends read the same stored codes): the
// GPU output is rounded to bf16 (relative error <= 2^-9) and the fp32 sums run in another
// order (scale folded into q, exp2 instead of exp, split merging: relative ~1e-6), so
// |gpu - cpu| <= 2^-8 * |cpu| + 1e-4 leaves 2x margin over the bf16 rounding alone. Where a
// kernel rounds the softmax weights to 16 bits before P.V (the decode kernel for 1-byte
// caches, the tiled prefill kernel always) the absolute floor becomes u * max|V|, u the unit
// roundoff of P's type (see run_batch).
//
// All three kernels run: the tiled prefill kernel (automatic for multi-token rows at head
// 64/128/256, block size % 16 == 0), the decode tensor-core kernel (single rows at head
// 64/128, and forced on multi-token rows) and the CUDA-core one (head 8/16/32, other block
// sizes, and forced here for 64/128/256 too).
// KVLM_CUDA_TEST_REDUCED=1 (used under compute-sanitizer) runs four cases per format. A build
// with -DKVLM_FORCE_SOFTWARE_FP8=ON runs all of this through sm_80's software FP8 path.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>

#include "attention/cpu_backend.h"
#include "attention/cuda_caps.h"
#include "attention/selector.h"
#include "kv/kv_plan.h"
#include "kv/kv_formats.h"
#include "core/error.h"
#include "core/numeric.h"
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/kernel_switches.h"

using namespace kvlm;

namespace {

bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

bool reduced() {
  const char* e = std::getenv("KVLM_CUDA_TEST_REDUCED");
  return e && *e && *e != '0';
}

template <class T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (count) EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
  }
  Dev(const std::vector<T>& h) : Dev(h.size()) { upload(h); }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  void upload(const std::vector<T>& h) {
    if (n) EXPECT_EQ(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> h(n);
    if (n) EXPECT_EQ(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

float bf16_round(float x) { return num::bf16_to_f32(num::f32_to_bf16(x)); }

struct Case {
  KVCacheDType dtype;
  AttentionKind kind;
  int window;
  int head_dim;
  int q_heads, kv_heads;
  int block_size;
  int keep_sink = 0, keep_recent = 0;  // exact sink / recent tokens (every page gets an exact page)
  bool sinks = false;                  // learned attention sinks (GPT-OSS), one per query head
  std::optional<KVCacheDType> v_dtype;  // V's format where it differs from K's (dtype)
};

struct Stats {
  double max_abs = 0, max_rel = 0;  // rel = |err| / (|ref| + 1e-3)
  size_t bad = 0, checked = 0;
  size_t page_mismatch = 0;
  int runs[4] = {0, 0, 0, 0};  // batches per kernel (1 CUDA cores, 2 decode mma, 3 tiled prefill)
  int keys_in_m = 0;           // decode mma batches in the keys-in-M layout
  std::string first_bad;       // where the first output out of tolerance was, for the failure message
};

struct SeqShape {
  int kv_len, q_len;
};

// One batch: store all tokens on both backends, compare pages, attend on both, compare.
// split_lengths, decode_layout: PagedAttentionParams (2 = decreasing split lengths in the decode
// kernel; 1 / 2 = the decode kernel's query-rows-in-M / keys-in-M layout, 0 = automatic).
// mag scales K and V (and Q by 1 / mag, so the scores keep their size): small K/V rows give
// per-token-head scales below f16's normal range, which reach the decode kernel's f16 P (times
// the V scale and 2^8) and the prefill kernels' per-key factors; the absolute error floor
// scales with mag.
void run_batch(const Case& c, const std::vector<SeqShape>& shapes, uint32_t seed, int max_splits, int kernel, Stats& st,
               int split_lengths = 0, float mag = 1.0f, int decode_layout = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int d = c.head_dim, kvh = c.kv_heads, nh = c.q_heads, bs = c.block_size;

  CacheConfig cc;
  cc.kv_cache_dtype = c.dtype;
  cc.v_cache_dtype = c.v_dtype;
  cc.keep_sink = c.keep_sink;
  cc.keep_recent = c.keep_recent;
  const AttentionLayerDesc desc{.layer = 0, .kind = c.kind, .window = c.window, .num_q_heads = nh, .num_kv_heads = kvh,
                                .head_dim = d, .sinks = c.sinks};
  KVPlan plan = build_kv_plan(cc, {&desc, 1}, DType::BF16, std::nullopt, {});
  KVLayerSpec& spec = plan.layers[0];
  const bool keep = spec.keeps_exact();
  if (spec.k.mode == KVQuantMode::Fp8PerTensor) {
    if (spec.k.storage == DType::F8E4M3) {  // per-kv-head scales (compressed-tensors attn_head)
      spec.k_scale.clear();
      spec.v_scale.clear();
      for (int g = 0; g < kvh; ++g) {
        spec.k_scale.push_back(0.5f + 0.25f * float(g));
        spec.v_scale.push_back(0.125f * float(g + 1));
      }
    } else {  // one scale per layer, K and V different
      spec.k_scale = {2.0f};
      spec.v_scale = {0.25f};
    }
  }
  int pages_needed = 0, max_blocks = 0, max_q = 0, max_kv = 0, total_q = 0, total_kv = 0;
  for (auto s : shapes) {
    const int nb = (s.kv_len + bs - 1) / bs;
    pages_needed += nb;
    max_blocks = std::max(max_blocks, nb);
    max_q = std::max(max_q, s.q_len);
    max_kv = std::max(max_kv, s.kv_len);
    total_q += s.q_len;
    total_kv += s.kv_len;
  }
  KVCache cache(plan, 2 * pages_needed + 3, bs, keep ? 2 * pages_needed + 3 : 0);
  LayerKVCache& L = cache.layer(0);
  std::vector<BlockId> pool(size_t(cache.num_blocks()));
  std::iota(pool.begin(), pool.end(), 0);
  std::shuffle(pool.begin(), pool.end(), rng);
  std::vector<BlockId> epool(size_t(cache.num_exact_pages()));  // reversed: exact ids differ from page ids
  std::iota(epool.rbegin(), epool.rend(), 0);

  // Block tables (padded with -1), slots, K/V rows (bf16-representable, with outlier channels).
  std::vector<BlockId> tables(shapes.size() * size_t(max_blocks), -1), etables(tables);
  std::vector<SlotId> slots, eslots;
  std::vector<float> kf, vf;
  size_t next_page = 0;
  for (size_t si = 0; si < shapes.size(); ++si) {
    const int nb = (shapes[si].kv_len + bs - 1) / bs;
    for (int b = 0; b < nb; ++b) {
      tables[si * size_t(max_blocks) + size_t(b)] = pool[next_page];
      if (keep) etables[si * size_t(max_blocks) + size_t(b)] = epool[next_page];
      next_page += 2;  // a hole
    }
    for (int pos = 0; pos < shapes[si].kv_len; ++pos) {
      slots.push_back(SlotId(tables[si * size_t(max_blocks) + size_t(pos / bs)]) * bs + pos % bs);
      if (keep) eslots.push_back(SlotId(etables[si * size_t(max_blocks) + size_t(pos / bs)]) * bs + pos % bs);
      for (int i = 0; i < kvh * d; ++i) {
        const bool outlier = (i % d) % 50 == 7;
        kf.push_back(bf16_round(nd(rng) * (outlier ? 8.0f : 1.0f) * mag));
        vf.push_back(bf16_round(nd(rng) * mag));
      }
    }
  }
  const CpuAttentionBackend cpu;
  cpu.store_kv(L, KVWrite{.k = kf, .v = vf, .slots = slots, .exact_slots = eslots});

  // GPU: the same rows as bf16, stored by kv_store into zeroed pages.
  std::vector<uint16_t> kb(kf.size()), vb(vf.size());
  for (size_t i = 0; i < kf.size(); ++i) {
    kb[i] = num::f32_to_bf16(kf[i]);
    vb[i] = num::f32_to_bf16(vf[i]);
  }
  Dev<uint16_t> dk(kb), dv(vb);
  Dev<SlotId> dslots(slots);
  Dev<uint8_t> dkc(L.k.size()), dvc(L.v.size());
  cudaMemset(dkc.p, 0, dkc.n);
  cudaMemset(dvc.p, 0, dvc.n);
  Dev<float> dks(L.k_scale.size()), dvs(L.v_scale.size());
  if (dks.n) cudaMemset(dks.p, 0, dks.n * 4);
  if (dvs.n) cudaMemset(dvs.p, 0, dvs.n * 4);
  Dev<float> dkts(spec.k_scale), dvts(spec.v_scale);
  const std::optional<KVStorage> v_format = spec.v != spec.k ? std::optional(spec.v) : std::nullopt;
  Dev<SlotId> deslots(eslots);
  Dev<uint16_t> dek(L.ek.size() / 2), dev_(L.ev.size() / 2);
  if (keep) {
    cudaMemset(dek.p, 0, dek.n * 2);
    cudaMemset(dev_.p, 0, dev_.n * 2);
  }
  cuda::kv_store({.storage = spec.k.storage, .quant = spec.k.mode, .v_format = v_format, .num_tokens = total_kv, .num_kv_heads = kvh, .head_dim = d,
                  .block_size = bs, .num_blocks = cache.num_blocks(), .k = dk.p, .v = dv.p, .slots = dslots.p,
                  .exact_slots = keep ? deslots.p : nullptr, .exact_k = dek.p, .exact_v = dev_.p,
                  .num_exact = cache.num_exact_pages(), .k_cache = dkc.p, .v_cache = dvc.p, .k_token_scale = dks.p,
                  .v_token_scale = dvs.p, .k_tensor_scale = dkts.p, .v_tensor_scale = dvts.p,
                  .num_tensor_scales = int(spec.k_scale.size())},
                 nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  {
    const auto gk = dkc.download(), gv = dvc.download();
    for (size_t i = 0; i < gk.size(); ++i) st.page_mismatch += gk[i] != L.k[i];
    for (size_t i = 0; i < gv.size(); ++i) st.page_mismatch += gv[i] != L.v[i];
    if (keep) {  // the exact pages: bf16 copies of the same rows on both sides
      const auto gek = dek.download(), gev = dev_.download();
      st.page_mismatch += size_t(std::memcmp(gek.data(), L.ek.data(), L.ek.size()) != 0) +
                          size_t(std::memcmp(gev.data(), L.ev.data(), L.ev.size()) != 0);
    }
    const auto gks = dks.download(), gvs = dvs.download();
    for (size_t i = 0; i < gks.size(); ++i) st.page_mismatch += std::memcmp(&gks[i], &L.k_scale[i], 4) != 0;
    for (size_t i = 0; i < gvs.size(); ++i) st.page_mismatch += std::memcmp(&gvs[i], &L.v_scale[i], 4) != 0;
  }
  // Slots no sequence wrote now hold 0xff bytes — NaN in bf16, fp16, e4m3, e5m2 and in the
  // fp32 scales — as stale slots of a live cache may: no kernel may let them reach an output
  // (a tile that reads them whole must mask them, and 0 * NaN in P.V is NaN).
  {
    std::vector<char> written(size_t(cache.num_blocks()) * size_t(bs), 0);
    for (SlotId s : slots) written[size_t(s)] = 1;
    auto gk = dkc.download(), gv = dvc.download();
    auto gks = dks.download(), gvs = dvs.download();
    const size_t krow = dtype_bytes(spec.k.storage, size_t(d)), vrow = dtype_bytes(spec.v.storage, size_t(d));
    for (size_t b = 0; b < size_t(cache.num_blocks()); ++b)
      for (size_t h = 0; h < size_t(kvh); ++h)
        for (size_t s = 0; s < size_t(bs); ++s) {
          if (written[b * size_t(bs) + s]) continue;
          const size_t r = (b * size_t(kvh) + h) * size_t(bs) + s;
          std::memset(gk.data() + r * krow, 0xff, krow);
          std::memset(gv.data() + r * vrow, 0xff, vrow);
          if (dks.n) std::memset(&gks[r], 0xff, 4);
          if (dvs.n) std::memset(&gvs[r], 0xff, 4);
        }
    dkc.upload(gk);
    dvc.upload(gv);
    if (dks.n) dks.upload(gks);
    if (dvs.n) dvs.upload(gvs);
  }

  // Queries and the CPU reference.
  std::vector<float> qf(size_t(total_q) * size_t(nh) * size_t(d));
  for (auto& x : qf) x = bf16_round(nd(rng) / mag);
  std::vector<float> ref(qf.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<AttnSeq> seqs;
  std::vector<int32_t> cu{0}, kv_lens;
  for (size_t si = 0; si < shapes.size(); ++si) {
    const size_t nb = size_t((shapes[si].kv_len + bs - 1) / bs);
    seqs.push_back({.q_begin = cu.back(), .q_len = shapes[si].q_len, .kv_len = shapes[si].kv_len,
                    .block_table = std::span<const BlockId>(tables.data() + si * size_t(max_blocks), nb),
                    .exact_table = keep ? std::span<const BlockId>(etables.data() + si * size_t(max_blocks), nb)
                                        : std::span<const BlockId>{}});
    cu.push_back(cu.back() + shapes[si].q_len);
    kv_lens.push_back(shapes[si].kv_len);
  }
  const float scale = 1.0f / std::sqrt(float(d));
  // Sinks from below the scores to above them (an 8: most of a row's weight), head 0 without.
  std::vector<float> sinks;
  if (c.sinks) {
    for (int h = 0; h < nh; ++h) sinks.push_back(h % 5 == 3 ? 8.0f : 3.0f * nd(rng));
    sinks[0] = -std::numeric_limits<float>::infinity();
  }
  cpu.attend(L, AttentionCall{.q = qf, .out = ref, .seqs = seqs, .softmax_scale = scale, .sinks = sinks});
  Dev<float> dsinks(sinks.empty() ? std::vector<float>{0.0f} : sinks);

  std::vector<uint16_t> qb(qf.size());
  for (size_t i = 0; i < qf.size(); ++i) qb[i] = num::f32_to_bf16(qf[i]);
  Dev<uint16_t> dq(qb), dout(qb.size());
  cudaMemset(dout.p, 0xff, dout.n * 2);  // 0xffff: a bf16 NaN in every output element
  Dev<int32_t> dcu(cu), dkvl(kv_lens);
  Dev<BlockId> dtab(tables), detab(etables);
  cuda::PagedAttentionParams p{.storage = spec.k.storage, .quant = spec.k.mode, .v_format = v_format,
                               .num_seqs = int(shapes.size()),
                               .num_tokens = total_q, .num_q_heads = nh, .num_kv_heads = kvh, .head_dim = d,
                               .block_size = bs, .max_blocks_per_seq = max_blocks, .max_q_len = max_q,
                               .max_kv_len = max_kv, .mask = c.kind, .window = c.window, .softmax_scale = scale,
                               .q = dq.p, .out = dout.p, .k_cache = dkc.p, .v_cache = dvc.p,
                               .k_token_scale = dks.p, .v_token_scale = dvs.p, .k_tensor_scale = dkts.p,
                               .v_tensor_scale = dvts.p, .num_tensor_scales = int(spec.k_scale.size()),
                               .cu_q_lens = dcu.p, .kv_lens = dkvl.p, .block_tables = dtab.p,
                               .exact_k = keep ? dek.p : nullptr, .exact_v = dev_.p, .exact_tables = detab.p,
                               .keep_sink = c.keep_sink, .keep_recent = c.keep_recent, .max_splits = max_splits,
                               .split_lengths = split_lengths, .kernel = kernel, .decode_layout = decode_layout};
  p.sinks = c.sinks ? dsinks.p : nullptr;
  const size_t ws_bytes = cuda::paged_attention_workspace_bytes(p);
  Dev<uint8_t> ws(ws_bytes);
  p.workspace = ws.p;
  p.workspace_bytes = ws_bytes;
  cuda::paged_attention(p, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = dout.download();
  // Softmax weights rounded to the mma type before P.V bound the error by u * max|V| on an
  // output (u: the type's unit roundoff; each weight's relative error <= u, the weights sum to
  // the row's normaliser), which becomes the absolute floor (V dequantized, this batch). The
  // decode kernel rounds P to f16 for 1-byte caches (u = 2^-11; kSplitP in
  // paged_attention_mma.cuh) and carries ~16 bits (hi + lo) for 16-bit caches. The tiled
  // prefill kernel (kernel 3) rounds P once, as FlashAttention and cuDNN do: bf16 for a bf16
  // cache (u = 2^-9), f16 otherwise (u = 2^-11).
  const cuda::PagedAttentionChoice choice = cuda::paged_attention_choice(p);
  const int ran = choice.kernel;
  if (kernel != 0) EXPECT_EQ(ran, kernel);
  if (split_lengths == 2 && choice.splits > 1) EXPECT_TRUE(choice.decreasing_splits);
  if (ran == 2 && decode_layout != 0) EXPECT_EQ(choice.keys_in_m, decode_layout == 2);
  st.keys_in_m += ran == 2 && choice.keys_in_m;
  double abs_floor = 1e-4 * mag;
  int p_exponent = 0;  // log2(u) of the P rounding, 0 = none
  if (ran == 3) p_exponent = spec.k.storage == DType::BF16 ? -9 : -11;
  else if (ran == 2 && dtype_bits(spec.v.storage) <= 8) p_exponent = -11;  // P follows V's format
  // int4 on the warp-specialised prefill kernel: its producer writes each K / V value as the f16
  // of code * step + zero, so V's rounding (u = 2^-11 of |V| <= max|V|) adds a second
  // u * max|V| to P's (and K's, relative 2^-11 per term of a score, is far inside the bf16 term).
  if (ran == 3 && spec.k.storage == DType::I4) p_exponent = -10;
  // Exact sink / recent tokens on the tiled kernel: its exact passes read the exact pages as a
  // bf16 cache, so their P is rounded to bf16.
  if (ran == 3 && keep) p_exponent = -9;
  float vmax = 0;
  for (float x : vf) vmax = std::max(vmax, std::fabs(x));
  if (p_exponent != 0) abs_floor = std::max(abs_floor, std::ldexp(double(vmax), p_exponent));
  // int4 K on the decode kernel with keys in M: Q goes to the integer tensor cores as
  // qstep * (hi + lo / 256), each element within max|q| / 65024 (paged_attention_mma.cuh, kQ8),
  // so a score moves by up to max|q| 2^-16 sum|k| softmax_scale and an output by twice that
  // times max|V| (o = sum w v / sum w). With a 1-byte or 4-bit V the P rounding above covers
  // it; beside a 16-bit V it is the floor.
  if (ran == 2 && choice.keys_in_m && spec.k.storage == DType::I4) {
    double qmax = 0, kl1 = 0;
    for (float x : qf) qmax = std::max(qmax, double(std::fabs(x)));
    for (size_t r = 0; r < kf.size(); r += size_t(d)) {
      double l1 = 0;
      for (int i = 0; i < d; ++i) l1 += std::fabs(kf[r + size_t(i)]);
      kl1 = std::max(kl1, l1 * 1.1);  // (the stored codes: within a step of each value)
    }
    abs_floor = std::max(abs_floor, 2.0 * std::ldexp(qmax * kl1 * scale * vmax, -16));
  }
  ++st.runs[ran];
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = num::bf16_to_f32(got[i]), r = ref[i];
    const double err = std::isnan(g) ? 1e9 : std::fabs(g - r);
    st.max_abs = std::max(st.max_abs, err);
    st.max_rel = std::max(st.max_rel, err / (std::fabs(r) + 1e-3));
    const bool bad = err > std::ldexp(std::fabs(r), -8) + abs_floor;
    if (bad && st.first_bad.empty()) {
      const size_t row = i / (size_t(nh) * size_t(d)), h = i / size_t(d) % size_t(nh), dim = i % size_t(d);
      st.first_bad = "row " + std::to_string(row) + " head " + std::to_string(h) + " dim " + std::to_string(dim) +
                     ": got " + std::to_string(g) + ", want " + std::to_string(r) + " (kernel " + std::to_string(ran) +
                     (ran == 2 ? choice.keys_in_m ? ", keys in M" : ", rows in M" : "") + ", " +
                     std::to_string(choice.splits) + " splits, mag " + std::to_string(mag) + ", seed " +
                     std::to_string(seed) + ")";
    }
    st.bad += bad;
    ++st.checked;
  }
}

const KVCacheDType kFormats[] = {KVCacheDType::BFloat16,        KVCacheDType::Float16,
                                 KVCacheDType::Fp8E4M3,         KVCacheDType::Fp8E5M2,
                                 KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                                 KVCacheDType::Int4PerTokenHead};

}  // namespace

class CudaAttention : public ::testing::TestWithParam<KVCacheDType> {};

TEST_P(CudaAttention, MatchesCpuBackend) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const KVCacheDType dt = GetParam();
  // 4200 keys: ~33 splits, so the reduction runs with all 8 of its split lanes (>= 8 and
  // >= 16 splits take 2 and 4).
  const std::vector<SeqShape> decode{{1, 1}, {37, 1}, {300, 1}, {1000, 1}, {129, 1}, {4200, 1}};
  const std::vector<SeqShape> mixed{{37, 5}, {1, 1}, {70, 70}, {200, 1}, {18, 3}, {150, 33}};
  // Prefill: whole prompts and chunks over existing context, several 64-key tiles and CTAs.
  const std::vector<SeqShape> prefill{{300, 260}, {64, 64}, {129, 100}, {5, 5}, {1, 1}, {200, 17}};
  const AttentionKind kinds[] = {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal};
  Stats total;
  uint32_t seed = 100;
  int cases = 0;
  for (int hd : {8, 16, 32, 64, 128, 256}) {
    for (AttentionKind kind : kinds) {
      for (int gqa : {1, 4, 7, 8}) {
        if (reduced() && !((hd == 128 || hd == 16) && gqa == 4 && kind != AttentionKind::NonCausal)) continue;
        // GQA 7 (Qwen2.5's 28 / 4 heads): a group that divides neither layout's 8 or 16 (pairs)
        // evenly, on the tensor-core head sizes.
        if (gqa == 7 && hd != 64 && hd != 128) continue;
        const int kvh = gqa == 8 ? 1 : 2;
        // Block sizes: 32 at head 128, 48 (not a power of two) at head 64, 16 otherwise.
        const Case c{dt, kind, kind == AttentionKind::Sliding ? 64 : 0, hd, kvh * gqa, kvh, hd == 128 ? 32 : hd == 64 ? 48 : 16};
        Stats st;
        // kernel 0 = automatic (tiled prefill for multi-token rows at head 64/128/256, decode
        // tensor cores for single rows at head 64/128), 1 = CUDA cores, 2 = decode tensor
        // cores (also what short multi-token rows, e.g. speculative verification, take).
        // max_splits 0 = automatic (small test grids split), 1 = unsplit.
        const bool int4 = dt == KVCacheDType::Int4PerTokenHead;
        const bool mma_fits = hd == 64 || hd == 128;
        run_batch(c, decode, seed++, 0, 0, st);
        run_batch(c, mixed, seed++, 0, 0, st);
        run_batch(c, prefill, seed++, 0, 0, st);
        run_batch(c, decode, seed++, 0, 1, st);
        if (!reduced()) {
          run_batch(c, mixed, seed++, 1, 0, st);
          run_batch(c, prefill, seed++, 1, 0, st);
          run_batch(c, mixed, seed++, 0, 1, st);
          if (mma_fits) run_batch(c, mixed, seed++, 0, 2, st);
        }
        // Decreasing split lengths (automatic only when the grid runs in several waves, which
        // these small batches do not): split 3 of 4 may be empty for short sequences.
        if (mma_fits) {
          run_batch(c, decode, seed++, 0, 2, st, 2);
          if (!reduced()) run_batch(c, mixed, seed++, 4, 2, st, 2);
          // Both layouts of the decode kernel on the same shapes: decode rows (keys in M by
          // default at GQA <= 8) with query rows in M, and multi-token rows (query rows in M by
          // default) with keys in M, 8 / group rows per CTA.
          run_batch(c, decode, seed++, 0, 2, st, 0, 1.0f, 1);
          if (!reduced() && gqa <= 8) run_batch(c, mixed, seed++, 0, 2, st, 0, 1.0f, 2);
        }
        // Small rows (per-token-head scales ~1e-6, under f16's normal range).
        if (!reduced() && (dt == KVCacheDType::Fp8PerTokenHead || dt == KVCacheDType::Int8PerTokenHead || int4)) {
          run_batch(c, prefill, seed++, 0, 0, st, 0, 0x1p-12f);
          run_batch(c, mixed, seed++, 0, 0, st, 0, 0x1p-12f);
          run_batch(c, decode, seed++, 0, 0, st, 0, 0x1p-12f);
        }
        ++cases;
        EXPECT_EQ(st.page_mismatch, 0u) << "kv_store pages differ: hd " << hd << " " << attention_kind_name(kind) << " gqa " << gqa;
        EXPECT_EQ(st.bad, 0u) << "outputs out of tolerance: hd " << hd << " " << attention_kind_name(kind) << " gqa " << gqa
                              << " max abs err " << st.max_abs;
        total.max_abs = std::max(total.max_abs, st.max_abs);
        total.max_rel = std::max(total.max_rel, st.max_rel);
        total.checked += st.checked;
        total.bad += st.bad;
        total.page_mismatch += st.page_mismatch;
        for (int k = 0; k < 4; ++k) total.runs[k] += st.runs[k];
        total.keys_in_m += st.keys_in_m;
      }
    }
  }
  std::printf("[cuda-attention] %-20s cases=%d batches rows/mma(keys in M)/tiled=%d/%d(%d)/%d outputs=%zu "
              "max_abs_err=%.3e max_rel_err=%.3e out_of_tol=%zu page_byte_mismatches=%zu\n",
              std::string(kv_cache_dtype_name(dt)).c_str(), cases, total.runs[1], total.runs[2], total.keys_in_m,
              total.runs[3], total.checked, total.max_abs, total.max_rel, total.bad, total.page_mismatch);
  EXPECT_GT(total.runs[3], 0) << "the tiled prefill kernel never ran";
  EXPECT_GT(total.keys_in_m, 0) << "the decode tensor-core kernel never ran with keys in M";
  EXPECT_GT(total.runs[2], total.keys_in_m) << "the decode tensor-core kernel never ran with query rows in M";
}

INSTANTIATE_TEST_SUITE_P(KV, CudaAttention, ::testing::ValuesIn(kFormats),
                         [](const auto& info) { return std::string(kv_cache_dtype_name(info.param)); });

// Exact sink / recent tokens (kv_plan.h's kv_key_exact): each tensor-core kernel over the
// quantized keys plus the CUDA-core kernel's exact pass — the decode kernel (head 64 / 128,
// chosen automatically for short rows), the tiled prefill kernels (head 64 / 128 / 256, chosen
// for long rows; at head 64 / 128 both the warp-specialised and the mma.sync one), forced and
// split — and the CUDA-core kernel alone (head 16, and forced): against the CPU backend over
// the same quantized and exact pages, every quantized format, mask, sink / window settings
// that straddle pages and tiles (a prefill's first rows read every visible key exact, so their
// quantized range is empty); kv_store's exact pages byte for byte.
TEST(CudaAttentionExact, MatchesCpuBackend) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<SeqShape> decode{{1, 1}, {37, 1}, {300, 1}, {1000, 1}, {129, 1}};
  const std::vector<SeqShape> mixed{{37, 5}, {1, 1}, {70, 70}, {200, 1}, {18, 3}, {150, 33}};
  const std::vector<SeqShape> prefill{{300, 260}, {64, 64}, {129, 100}, {5, 5}, {200, 17}, {700, 600}};
  const auto saved = cuda::kernel_switches();
  Stats total;
  uint32_t seed = 900;
  for (KVCacheDType dt : {KVCacheDType::Fp8E4M3, KVCacheDType::Fp8E5M2, KVCacheDType::Fp8PerTokenHead,
                          KVCacheDType::Int8PerTokenHead, KVCacheDType::Int4PerTokenHead}) {
    for (int hd : {16, 64, 128, 256}) {
      for (AttentionKind kind : {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal}) {
        for (auto [sink, recent] : {std::pair{4, 9}, std::pair{0, 33}, std::pair{17, 0}, std::pair{4, 150}}) {
          if (reduced() && !(hd == 64 && sink == 4 && recent == 9)) continue;
          if (recent == 150 && hd != 128) continue;  // a window wider than a prefill tile: once per format
          const int gqa = hd == 16 ? 1 : 4, kvh = 2;
          const Case c{dt, kind, kind == AttentionKind::Sliding ? 64 : 0, hd, kvh * gqa, kvh, 16, sink, recent};
          const bool mma_fits = hd == 64 || hd == 128;
          Stats st;
          if (hd != 256) {
            run_batch(c, decode, seed++, 0, 0, st);
            run_batch(c, mixed, seed++, 0, 0, st);
            run_batch(c, mixed, seed++, 1, 1, st);
          }
          if (mma_fits) run_batch(c, decode, seed++, 4, 2, st);  // several key splits + the exact pass
          if (hd != 16) {
            run_batch(c, prefill, seed++, 0, 0, st);  // automatic: the tiled kernel
            run_batch(c, prefill, seed++, 1, 3, st);  // one split of quantized keys + the exact pass
            if (!reduced()) run_batch(c, prefill, seed++, 3, 3, st);
            if (mma_fits) {  // the mma.sync tiled kernel where the warp-specialised one would run
              auto sw = saved;
              sw.wgmma = false;
              cuda::set_kernel_switches(sw);
              run_batch(c, prefill, seed++, 0, 3, st);
              cuda::set_kernel_switches(saved);
            }
          }
          EXPECT_EQ(st.page_mismatch, 0u) << kv_cache_dtype_name(dt) << " hd " << hd << " " << attention_kind_name(kind);
          EXPECT_EQ(st.bad, 0u) << kv_cache_dtype_name(dt) << " hd " << hd << " " << attention_kind_name(kind) << " sink "
                                << sink << " recent " << recent << " max abs err " << st.max_abs << "; first: " << st.first_bad;
          if (hd != 16) EXPECT_GE(st.runs[3], 3) << "the tiled prefill kernel did not take exact tokens";
          if (mma_fits) EXPECT_GE(st.runs[2], 2) << "the decode tensor-core kernel did not take exact tokens";
          total.max_abs = std::max(total.max_abs, st.max_abs);
          total.checked += st.checked;
          total.bad += st.bad;
          for (int k = 0; k < 4; ++k) total.runs[k] += st.runs[k];
        }
      }
    }
  }
  std::printf("[cuda-attention] exact sink/recent tokens: batches rows/mma/tiled=%d/%d/%d outputs=%zu max_abs_err=%.3e "
              "out_of_tol=%zu\n",
              total.runs[1], total.runs[2], total.runs[3], total.checked, total.max_abs, total.bad);
}

// Learned attention sinks (GPT-OSS) in every kernel's normalization: each kernel's own epilogue
// (one split) and the split-KV reduction (several, and the exact tokens' extra pass), every
// format, mask and a spread of head sizes and GQA ratios, against the CPU backend.
TEST(CudaAttentionSinks, MatchesCpuBackend) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<SeqShape> decode{{1, 1}, {37, 1}, {300, 1}, {4200, 1}};
  const std::vector<SeqShape> mixed{{37, 5}, {1, 1}, {70, 70}, {200, 1}, {150, 33}};
  const std::vector<SeqShape> prefill{{300, 260}, {64, 64}, {129, 100}, {5, 5}};
  Stats total;
  uint32_t seed = 5000;
  for (KVCacheDType dt : kFormats) {
    for (int hd : {16, 64, 128}) {
      for (AttentionKind kind : {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal}) {
        for (int gqa : {1, 8}) {
          if (reduced() && !(hd == 64 && gqa == 8)) continue;
          const int kvh = 2;
          Case c{dt, kind, kind == AttentionKind::Sliding ? 64 : 0, hd, kvh * gqa, kvh, 16};
          c.sinks = true;
          Stats st;
          run_batch(c, decode, seed++, 0, 0, st);  // automatic: split decode, reduction
          run_batch(c, decode, seed++, 1, 0, st);  // one split: the kernel's own epilogue
          run_batch(c, mixed, seed++, 0, 1, st);   // CUDA cores
          run_batch(c, mixed, seed++, 1, 1, st);
          run_batch(c, prefill, seed++, 0, 0, st);  // tiled prefill (head 64 / 128)
          run_batch(c, prefill, seed++, 1, 0, st);
          if (hd != 16) {
            run_batch(c, mixed, seed++, 1, 2, st);  // the decode tensor-core kernel, unsplit and split
            run_batch(c, decode, seed++, 4, 2, st);
          }
          if (dt != KVCacheDType::BFloat16 && dt != KVCacheDType::Float16) {  // with exact tokens: one more pass
            Case e = c;
            e.keep_sink = 4;
            e.keep_recent = 9;
            run_batch(e, decode, seed++, 0, 0, st);
            run_batch(e, mixed, seed++, 1, 1, st);
            run_batch(e, prefill, seed++, 0, 0, st);  // the tiled kernel (head 64 / 128), then the exact pass
          }
          EXPECT_EQ(st.bad, 0u) << kv_cache_dtype_name(dt) << " hd " << hd << " " << attention_kind_name(kind) << " gqa "
                                << gqa << " max abs err " << st.max_abs;
          total.max_abs = std::max(total.max_abs, st.max_abs);
          total.checked += st.checked;
          total.bad += st.bad;
          for (int k = 0; k < 4; ++k) total.runs[k] += st.runs[k];
        }
      }
    }
  }
  std::printf("[cuda-attention] sinks: batches rows/mma/tiled=%d/%d/%d outputs=%zu max_abs_err=%.3e out_of_tol=%zu\n",
              total.runs[1], total.runs[2], total.runs[3], total.checked, total.max_abs, total.bad);
  EXPECT_GT(total.runs[1], 0);
  EXPECT_GT(total.runs[2], 0);
  EXPECT_GT(total.runs[3], 0);
}

// K and V in two formats (kv/kv_formats.h's kCudaSplitFormats; every pair, both ways round):
// kv_store's pages byte for byte, and the decode tensor-core kernel (both operand layouts, split
// and unsplit, multi-token rows too) and the CUDA-core kernel (every head size) against the CPU
// backend, in every mask, GQA 1 / 4 / 8, with small rows, exact sink / recent tokens and
// learned sinks. The tiled prefill kernels read one format: never chosen here, and refused
// when forced; a pair outside the list is refused naming the list.
TEST(CudaAttentionSplitKV, MatchesCpuBackend) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const std::vector<SeqShape> decode{{1, 1}, {37, 1}, {300, 1}, {1000, 1}, {4200, 1}};
  const std::vector<SeqShape> mixed{{37, 5}, {1, 1}, {70, 70}, {200, 1}, {18, 3}, {150, 33}};
  const KVCacheDType formats[] = {KVCacheDType::BFloat16, KVCacheDType::Fp8PerTokenHead, KVCacheDType::Int8PerTokenHead,
                                  KVCacheDType::Int4PerTokenHead};
  const AttentionKind kinds[] = {AttentionKind::Full, AttentionKind::Sliding, AttentionKind::NonCausal};
  uint32_t seed = 7000;
  int pairs = 0;
  for (KVCacheDType kd : formats)
    for (KVCacheDType vd : formats) {
      if (kd == vd) continue;
      ++pairs;
      Stats st;
      for (int hd : {16, 64, 128, 256})
        for (AttentionKind kind : kinds)
          for (int gqa : {1, 4, 8}) {
            if (reduced() && !(hd == 128 && gqa == 4 && kind == AttentionKind::Full)) continue;
            const int kvh = gqa == 8 ? 1 : 2;
            Case c{kd, kind, kind == AttentionKind::Sliding ? 64 : 0, hd, kvh * gqa, kvh, hd == 128 ? 32 : hd == 64 ? 48 : 16};
            c.v_dtype = vd;
            const bool mma_fits = hd == 64 || hd == 128;
            const Stats before = st;
            run_batch(c, decode, seed++, 0, 0, st);  // automatic: the decode kernel where it fits, split
            run_batch(c, mixed, seed++, 0, 0, st);   // multi-token rows: the decode kernel too
            run_batch(c, mixed, seed++, 1, 1, st);   // CUDA cores, unsplit
            if (!reduced()) run_batch(c, decode, seed++, 0, 1, st);
            if (mma_fits) {
              run_batch(c, decode, seed++, 1, 2, st, 0, 1.0f, 1);  // query rows in M, unsplit
              if (!reduced()) run_batch(c, mixed, seed++, 4, 2, st, 2, 1.0f, 2);  // keys in M, decreasing splits
            }
            if (!reduced() && hd == 128) run_batch(c, mixed, seed++, 0, 0, st, 0, 0x1p-12f);  // scales under f16's normals
            if (hd != 256 && gqa == 4) {  // exact sink / recent tokens (one more pass) and learned sinks
              Case e = c;
              e.keep_sink = 4;
              e.keep_recent = 9;
              e.sinks = true;
              run_batch(e, decode, seed++, 0, 0, st);
              run_batch(e, mixed, seed++, 1, 1, st);
            }
            EXPECT_EQ(st.bad, before.bad) << kv_cache_dtype_name(kd) << " / " << kv_cache_dtype_name(vd) << " hd " << hd
                                          << " " << attention_kind_name(kind) << " gqa " << gqa << " max abs err "
                                          << st.max_abs << "; first: " << st.first_bad;
          }
      const std::string name = "K " + std::string(kv_cache_dtype_name(kd)) + ", V " + std::string(kv_cache_dtype_name(vd));
      EXPECT_EQ(st.page_mismatch, 0u) << name << ": kv_store pages differ";
      EXPECT_EQ(st.runs[3], 0) << name << ": the tiled prefill kernel ran";
      EXPECT_GT(st.runs[1], 0) << name;
      EXPECT_GT(st.keys_in_m, 0) << name << ": the decode kernel never ran with keys in M";
      EXPECT_GT(st.runs[2], st.keys_in_m) << name << ": the decode kernel never ran with query rows in M";
      std::printf("[cuda-attention] split %-42s batches rows/mma(keys in M)=%d/%d(%d) outputs=%zu max_abs_err=%.3e "
                  "out_of_tol=%zu page_byte_mismatches=%zu\n",
                  name.c_str(), st.runs[1], st.runs[2], st.keys_in_m, st.checked, st.max_abs, st.bad, st.page_mismatch);
    }
  EXPECT_EQ(pairs, 12);
  Stats st;
  Case c{KVCacheDType::Int8PerTokenHead, AttentionKind::Full, 0, 64, 8, 2, 16};
  c.v_dtype = KVCacheDType::Int4PerTokenHead;
  EXPECT_THROW(run_batch(c, mixed, 1, 0, 3, st), Error);  // the tiled prefill kernel, forced
  c.v_dtype = KVCacheDType::Fp8E4M3;  // per-tensor V: not a pair of the list
  try {
    run_batch(c, mixed, 2, 0, 0, st);
    FAIL() << "K int8, V fp8 per tensor accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("they read " + describe_kv_pairs(KVFormatSet::Cuda)), std::string::npos) << e.what();
  }
}

// Unsupported formats and head sizes are clear errors, before anything is launched.
TEST(CudaAttentionErrors, UnsupportedFormatOrHeadSize) {
  cuda::PagedAttentionParams p{.storage = DType::F32, .quant = KVQuantMode::None, .num_seqs = 1, .num_tokens = 1,
                               .num_q_heads = 1, .num_kv_heads = 1, .head_dim = 128, .block_size = 16,
                               .max_blocks_per_seq = 1, .max_q_len = 1, .max_kv_len = 1};
  try {
    cuda::paged_attention(p, nullptr);
    FAIL() << "float32 pages accepted";
  } catch (const Error& e) {
    const std::string supported = "supported: " + describe_kv_formats(KVFormatSet::Cuda);
    EXPECT_NE(std::string(e.what()).find(supported), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("float16/bfloat16 with none"), std::string::npos) << e.what();
  }
  p.storage = DType::BF16;
  p.head_dim = 96;
  EXPECT_THROW(cuda::paged_attention(p, nullptr), Error);
  p.head_dim = 32;
  p.kernel = 3;  // the tiled kernel takes head 64/128/256 only: an error, not a fallback
  EXPECT_THROW(cuda::paged_attention_choice(p), Error);
  p.head_dim = 128;
  p.block_size = 8;  // nor block sizes that are not multiples of 16
  EXPECT_THROW(cuda::paged_attention_choice(p), Error);
  p.kernel = 0;
  EXPECT_EQ(cuda::paged_attention_choice(p).kernel, 1);  // automatic: the CUDA-core kernel covers it
  p.split_lengths = 3;
  EXPECT_THROW(cuda::paged_attention_choice(p), Error);
  p.split_lengths = 0;
  p.block_size = 16;
  p.decode_layout = 3;
  EXPECT_THROW(cuda::paged_attention_choice(p), Error);
  p.decode_layout = 2;
  p.num_q_heads = 16;  // GQA 16 does not fit N = 8
  EXPECT_THROW(cuda::paged_attention_choice(p), Error);
  p.decode_layout = 0;
  if (have_gpu()) {  // the decode kernel's plan asks the device for its occupancy
    EXPECT_EQ(cuda::paged_attention_choice(p).kernel, 2);
    EXPECT_FALSE(cuda::paged_attention_choice(p).keys_in_m);  // GQA 16: query rows in M
    p.num_q_heads = 1;
    EXPECT_TRUE(cuda::paged_attention_choice(p).keys_in_m);  // decode at GQA 1: keys in M
  }
  p.num_q_heads = 1;
  cuda::KVStoreParams s{.storage = DType::F8E5M2, .quant = KVQuantMode::Fp8PerTokenHead, .num_tokens = 1, .num_kv_heads = 1,
                        .head_dim = 64, .block_size = 16, .num_blocks = 1};
  EXPECT_THROW(cuda::kv_store(s, nullptr), Error);
}

TEST(CudaAttentionCaps, DeclaresWhatIsTested) {
  const BackendCapabilities& c = cuda_attention_capabilities();
  EXPECT_EQ(c.device, Device::Cuda);
  EXPECT_EQ(c.kv_formats.size(), 7u);
  EXPECT_EQ(c.head_sizes, (std::vector<int>{8, 16, 32, 64, 128, 256}));
  EXPECT_TRUE(c.causal && c.sliding_window && c.non_causal);
  EXPECT_EQ(c.kv_pairs, KVFormatSet::Cuda);  // the K != V pairs CudaAttentionSplitKV runs
  // The tiers follow this build's CMAKE_CUDA_ARCHITECTURES (tests/unit/test_selector.cpp
  // checks them per architecture list): 8.0 in the default build, 9.0 in an sm_90a-only one.
  ASSERT_FALSE(c.compute_tiers.empty()) << c.description;
  EXPECT_GE(c.min_compute_capability, 80);
  EXPECT_EQ(c.min_compute_capability, c.compute_tiers.front().min_cc);
  EXPECT_GT(c.priority, CpuAttentionBackend::capabilities().priority);
#ifdef KVLM_FORCE_SOFTWARE_FP8
  for (const auto& t : c.compute_tiers) EXPECT_EQ(t.software_fp8.size(), 3u) << c.description;
#endif
  // The GPU these tests run on is one the declaration covers, with the FP8 path it states.
  if (!have_gpu()) return;
  int dev = 0, major = 0, minor = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev), cudaSuccess);
  const ComputeTier* t = find_compute_tier(c, major * 10 + minor);
  ASSERT_NE(t, nullptr) << "compute capability " << major << "." << minor << " not covered: " << c.description;
  std::printf("[cuda-attention] compute capability %d.%d runs %s, FP8 conversions in %s\n", major, minor, t->code.c_str(),
              t->software_fp8.empty() ? "hardware" : "software");
}

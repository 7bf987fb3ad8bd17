#include "attention/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kv/kv_format.h"
#include "core/error.h"

namespace kvlm {

const BackendCapabilities& CpuAttentionBackend::capabilities() {
  static const BackendCapabilities caps{
      .name = "cpu",
      .device = Device::Cpu,
      .kv_formats = kv_formats_of(KVFormatSet::All),  // every format of the table
      .kv_pairs = KVFormatSet::All,  // K and V in any two of them
      .head_sizes = {},
      .max_head_size = 1024,
      .causal = true,
      .sliding_window = true,
      .non_causal = true,
      .exact_tokens = true,
      .attention_sinks = true,
      .min_compute_capability = 0,
      .priority = 10,
      .description = "reference backend: every KV format, every mask, fp32 accumulation",
  };
  return caps;
}

namespace {

// Quantizes one side's rows (K or V: [slot][kv head][head_dim]) into the slots' pages, with
// their per-token-head scales. One format dispatch per call.
void encode_rows(LayerKVCache& c, KVSide side, std::span<const float> x, std::span<const SlotId> slots) {
  const KVLayerSpec& s = *c.spec;
  const int kvh = s.attn.num_kv_heads, d = s.attn.head_dim;
  uint8_t* codes = (side == KVSide::K ? c.k : c.v).data();
  std::vector<float>& row_scales = side == KVSide::K ? c.k_scale : c.v_scale;
  const KVStorage kv = s.format(side);
  kvfmt::dispatch_kv(kv.storage, kv.mode, [&](auto fmt) {
    using Fmt = decltype(fmt);
    for (size_t i = 0; i < slots.size(); ++i) {
      const SlotId slot = slots[i];
      KVLM_CHECK(slot >= 0 && slot < SlotId(c.num_blocks) * c.block_size, "slot out of range");
      const int64_t block = slot / c.block_size;
      const int off = int(slot % c.block_size);
      for (int g = 0; g < kvh; ++g) {
        const size_t src = (i * size_t(kvh) + size_t(g)) * size_t(d);
        const float tensor_scale = side == KVSide::K ? s.k_scale_for(g) : s.v_scale_for(g);
        const float r = Fmt::encode_row(x.subspan(src, size_t(d)), codes + c.row_byte(side, block, g, off), tensor_scale);
        if constexpr (Fmt::policy == kvfmt::ScalePolicy::PerTokenHead) row_scales[c.scale_index(block, g, off)] = r;
      }
    }
  });
}

// The same rows into the exact pages (the model dtype); slots < 0 are skipped.
void encode_exact_rows(LayerKVCache& c, KVSide side, std::span<const float> x, std::span<const SlotId> slots) {
  const int kvh = c.spec->attn.num_kv_heads, d = c.spec->attn.head_dim;
  uint8_t* codes = (side == KVSide::K ? c.ek : c.ev).data();
  kvfmt::dispatch_kv(c.spec->exact_storage, KVQuantMode::None, [&](auto fmt) {
    using Exact = decltype(fmt);
    for (size_t i = 0; i < slots.size(); ++i) {
      const SlotId slot = slots[i];
      if (slot < 0) continue;
      KVLM_CHECK(slot < SlotId(c.num_exact) * c.block_size, "exact slot out of range");
      const int64_t page = slot / c.block_size;
      const int off = int(slot % c.block_size);
      for (int g = 0; g < kvh; ++g) {
        const size_t src = (i * size_t(kvh) + size_t(g)) * size_t(d);
        Exact::encode_row(x.subspan(src, size_t(d)), codes + c.exact_row_byte(page, g, off), 1.0f);
      }
    }
  });
}

}  // namespace

void CpuAttentionBackend::store_kv(LayerKVCache& c, const KVWrite& w) const {
  const KVLayerSpec& s = *c.spec;
  const size_t n = w.slots.size();
  KVLM_CHECK(w.k.size() == n * size_t(s.attn.num_kv_heads * s.attn.head_dim) && w.v.size() == w.k.size(),
             "K/V rows do not match the slot count");
  encode_rows(c, KVSide::K, w.k, w.slots);
  encode_rows(c, KVSide::V, w.v, w.slots);
  if (!s.keeps_exact()) return;
  KVLM_CHECK(w.exact_slots.size() == n, "a layer with exact tokens was written without exact slots");
  encode_exact_rows(c, KVSide::K, w.k, w.exact_slots);
  encode_exact_rows(c, KVSide::V, w.v, w.exact_slots);
}

namespace {

constexpr int kQueryTile = 16;  // queries sharing one decoded page

KeyRange visible(const KVLayerSpec& s, int pos, int kv_len) { return visible_keys(s.attn.kind, s.attn.window, pos, kv_len); }

// Decodes rows [off0, off1) of (page, head g) of one side into out (row `off` at off * head_dim),
// scales applied. One format dispatch per call: the loops over keys below are format-free.
void decode_rows(const LayerKVCache& c, KVSide side, BlockId page, int g, int off0, int off1, float* out) {
  const KVLayerSpec& s = *c.spec;
  const size_t d = size_t(s.attn.head_dim);
  const uint8_t* codes = (side == KVSide::K ? c.k : c.v).data();
  const std::vector<float>& row_scales = side == KVSide::K ? c.k_scale : c.v_scale;
  const KVStorage kv = s.format(side);
  kvfmt::dispatch_kv(kv.storage, kv.mode, [&](auto fmt) {
    using Fmt = decltype(fmt);
    for (int off = off0; off < off1; ++off) {
      float scale = 1.0f;
      if constexpr (Fmt::policy == kvfmt::ScalePolicy::PerTensor)
        scale = side == KVSide::K ? s.k_scale_for(g) : s.v_scale_for(g);
      else if constexpr (Fmt::policy == kvfmt::ScalePolicy::PerTokenHead)
        scale = row_scales[c.scale_index(page, g, off)];
      Fmt::decode_row(codes + c.row_byte(side, page, g, off), scale, {out + size_t(off) * d, d});
    }
  });
}

// The same rows of one side's exact page (the model dtype, unscaled).
void decode_exact_rows(const LayerKVCache& c, KVSide side, BlockId page, int g, int off0, int off1, float* out) {
  const size_t d = size_t(c.spec->attn.head_dim);
  const uint8_t* codes = (side == KVSide::K ? c.ek : c.ev).data();
  kvfmt::dispatch_kv(c.spec->exact_storage, KVQuantMode::None, [&](auto fmt) {
    using Fmt = decltype(fmt);
    for (int off = off0; off < off1; ++off)
      Fmt::decode_row(codes + c.exact_row_byte(page, g, off), 1.0f, {out + size_t(off) * d, d});
  });
}

}  // namespace

void CpuAttentionBackend::attend(const LayerKVCache& c, const AttentionCall& call) const {
  const KVLayerSpec& s = *c.spec;
  const int nh = s.attn.num_q_heads, kvh = s.attn.num_kv_heads, d = s.attn.head_dim, bs = c.block_size;
  const int group = nh / kvh;
  KVLM_CHECK(call.q.size() == call.out.size(), "query and output sizes differ");
  KVLM_CHECK(call.sinks.empty() || call.sinks.size() == size_t(nh), "attention sinks: one per query head");
  KVLM_CHECK(call.sinks.empty() == !s.attn.sinks, "attention sinks given for a layer without them, or missing");
  for (const AttnSeq& seq : call.seqs) {
    KVLM_CHECK(seq.q_len >= 0 && seq.q_len <= seq.kv_len, "more queries than cached tokens");
    KVLM_CHECK(size_t(seq.q_begin + seq.q_len) * size_t(nh * d) <= call.q.size(), "query rows out of range");
    KVLM_CHECK(seq.block_table.size() * size_t(bs) >= size_t(seq.kv_len), "block table shorter than the context");
    for (BlockId b : seq.block_table) KVLM_CHECK(b >= 0 && b < c.num_blocks, "block id out of range");
    if (s.keeps_exact()) {
      KVLM_CHECK(seq.exact_table.size() == seq.block_table.size(), "a layer with exact tokens was called without exact pages");
      for (BlockId e : seq.exact_table) KVLM_CHECK(e >= -1 && e < c.num_exact, "exact page id out of range");
      // Every key a query reads exact has an exact page (checked here: an exception cannot
      // leave the parallel loop below). Per query: its sink keys and its recent window.
      const int first_pos = seq.kv_len - seq.q_len;
      auto covered = [&](int a, int b) {  // keys [a, b)
        for (int bi = a / bs; a < b && bi <= (b - 1) / bs; ++bi)
          KVLM_CHECK(seq.exact_table[size_t(bi)] >= 0, "a key read exact has no exact page (engine bookkeeping)");
      };
      for (int t = 0; t < seq.q_len; ++t) {
        const KeyRange sp = visible(s, first_pos + t, seq.kv_len);
        const int qpos = exact_anchor(s.attn.kind, first_pos + t, seq.kv_len);
        covered(sp.lo, std::min(sp.hi, s.keep_sink));
        covered(std::max(sp.lo, qpos - s.keep_recent + 1), sp.hi);
      }
    }
  }
  // Exact sink / recent tokens: key j of the query at position p is read from the exact page
  // when kv_key_exact(j, exact_anchor(...), ...) (kv/attention_mask.h).
  const bool exact = s.keeps_exact();
  // The formats are dispatched inside the parallel loop, which no exception may leave: check here.
  for (const KVStorage& kv : {s.k, s.v})
    if (!find_kv_format(kv)) throw_unsupported_kv(kv, KVFormatSet::All, "KV pages");
  if (exact && !find_kv_format({s.exact_storage, KVQuantMode::None}))
    throw_unsupported_kv({s.exact_storage, KVQuantMode::None}, KVFormatSet::All, "exact KV pages");
  for (const AttnSeq& seq : call.seqs) {
    const int first_pos = seq.kv_len - seq.q_len;
    const int tiles = (seq.q_len + kQueryTile - 1) / kQueryTile;
    // Threads only pay off for real work: waking a team costs more than attention over a
    // short context (and its spinning workers then steal cycles from the BLAS threads).
    const bool parallel = int64_t(seq.q_len) * seq.kv_len * nh * d > (int64_t(1) << 22);
#pragma omp parallel for collapse(2) schedule(dynamic) if (parallel)
    for (int g = 0; g < kvh; ++g) {
      for (int tile = 0; tile < tiles; ++tile) {
        const int t0 = tile * kQueryTile, t1 = std::min(seq.q_len, t0 + kQueryTile);
        const int rows = (t1 - t0) * group;
        // Online-softmax state per (query, head of the group): running max, sum, output.
        std::vector<float> m(size_t(rows), -std::numeric_limits<float>::infinity()), l(size_t(rows), 0.0f);
        std::vector<float> acc(size_t(rows) * size_t(d), 0.0f);
        std::vector<float> kpage(size_t(bs) * size_t(d)), vpage(size_t(bs) * size_t(d));
        std::vector<float> kexact(exact ? size_t(bs) * size_t(d) : 0), vexact(kexact.size());
        std::vector<float> score(static_cast<size_t>(bs));
        int lo = std::numeric_limits<int>::max(), hi = 0;
        for (int t = t0; t < t1; ++t) {
          const KeyRange sp = visible(s, first_pos + t, seq.kv_len);
          lo = std::min(lo, sp.lo);
          hi = std::max(hi, sp.hi);
        }
        for (int bi = lo / bs; bi * bs < hi; ++bi) {
          const BlockId page = seq.block_table[size_t(bi)];
          const int j0 = std::max(lo, bi * bs), j1 = std::min(hi, (bi + 1) * bs);
          const int off0 = j0 - bi * bs, off1 = j1 - bi * bs;
          decode_rows(c, KVSide::K, page, g, off0, off1, kpage.data());
          decode_rows(c, KVSide::V, page, g, off0, off1, vpage.data());
          const BlockId exact_page = exact ? seq.exact_table[size_t(bi)] : -1;
          if (exact_page >= 0) {
            decode_exact_rows(c, KVSide::K, exact_page, g, off0, off1, kexact.data());
            decode_exact_rows(c, KVSide::V, exact_page, g, off0, off1, vexact.data());
          }
          for (int t = t0; t < t1; ++t) {
            const KeyRange sp = visible(s, first_pos + t, seq.kv_len);
            const int a = std::max(j0, sp.lo), b = std::min(j1, sp.hi);
            if (a >= b) continue;
            // This query's rows of the page: exact where kv_key_exact says so.
            const int qpos = exact_anchor(s.attn.kind, first_pos + t, seq.kv_len);
            auto key_row = [&](const std::vector<float>& quant, const std::vector<float>& ex, int j) {
              const bool from_exact = exact && kv_key_exact(j, qpos, s.keep_sink, s.keep_recent);  // page checked above
              return (from_exact ? ex.data() : quant.data()) + size_t(j - bi * bs) * size_t(d);
            };
            for (int hg = 0; hg < group; ++hg) {
              const int h = g * group + hg;
              const float* q = call.q.data() + (size_t(seq.q_begin + t) * size_t(nh) + size_t(h)) * size_t(d);
              const size_t r = size_t(t - t0) * size_t(group) + size_t(hg);
              float pmax = -std::numeric_limits<float>::infinity();
              for (int j = a; j < b; ++j) {
                const float* k = key_row(kpage, kexact, j);
                // Vector lanes of partial sums (a strict left-to-right sum does not vectorize:
                // attention took 40% of the linears' time on a 128-token Gemma 3 prefill).
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int x = 0; x < d; ++x) dot += q[x] * k[x];
                score[size_t(j - a)] = dot * call.softmax_scale;
                pmax = std::max(pmax, score[size_t(j - a)]);
              }
              const float new_m = std::max(m[r], pmax);
              const float correction = std::exp(m[r] - new_m);  // exp(-inf) = 0 on the first page
              float* o = acc.data() + r * size_t(d);
              for (int x = 0; x < d; ++x) o[x] *= correction;
              l[r] *= correction;
              for (int j = a; j < b; ++j) {
                const float p = std::exp(score[size_t(j - a)] - new_m);
                l[r] += p;
                const float* v = key_row(vpage, vexact, j);
                for (int x = 0; x < d; ++x) o[x] += p * v[x];
              }
              m[r] = new_m;
            }
          }
        }
        for (int t = t0; t < t1; ++t) {
          for (int hg = 0; hg < group; ++hg) {
            const int h = g * group + hg;
            const size_t r = size_t(t - t0) * size_t(group) + size_t(hg);
            float* out = call.out.data() + (size_t(seq.q_begin + t) * size_t(nh) + size_t(h)) * size_t(d);
            // A sink joins the denominator only: exp(s_h - m), at the running max m (a sink above
            // every score is exp of a positive number, as in transformers' softmax over the
            // scores and the sink together).
            const float denom = l[r] + (call.sinks.empty() ? 0.0f : std::exp(call.sinks[size_t(h)] - m[r]));
            const float inv = denom > 0 ? 1.0f / denom : 0.0f;
            for (int x = 0; x < d; ++x) out[x] = acc[r * size_t(d) + size_t(x)] * inv;
          }
        }
      }
    }
  }
}

}  // namespace kvlm

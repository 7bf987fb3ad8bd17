// Paged attention over every KV format, reading the pages in place. Three kernels:
//
// - attn_mma_kernel (paged_attention_mma.cuh): tensor cores, the decode path for head
//   64/128, block_size % 16 == 0 and GQA groups <= 16. A CTA owns one KV head, up to
//   16 / group query rows of one sequence and one split of their key range; each warp
//   streams its own key tiles straight from the pages.
// - attn_prefill_kernel (paged_attention_prefill.cu): tensor cores, the multi-token path
//   (prefill, chunked prefill) for head 64/128/256 and block_size % 16 == 0: a CTA holds
//   64-128 (query row, head) pairs in shared memory and streams K/V tiles once for all.
// - attn_rows_kernel (paged_attention_rows.cuh): CUDA cores, any GQA group, head sizes
//   8/16/32 (paged_attention_small.cu) and 64/128/256, any block size. A CTA owns one query
//   row, one KV head (up to 8 of its query heads) and one split.
//
// In all three the visible range comes from each row's position and the mask, so causal /
// sliding / non-causal and ragged batches mixing decode rows with prefill chunks go through
// the same code. When the grid would not fill the GPU (few rows, long contexts: decode),
// the key range is split across CTAs and `attn_reduce_kernel` merges the partial (max, sum,
// output) triples. Kernel and split count come from one function, make_plan, shared with
// paged_attention_workspace_bytes.

#include "ops/cuda/paged_attention_rows.cuh"
#include "ops/cuda/per_device.cuh"
#include "ops/cuda/paged_attention_mma.cuh"
namespace kvlm::cuda {
namespace {

#ifdef KVLM_ATTN_TRACE
int64_t g_last_mma_ctas = 0;  // grid size of the last decode tensor-core launch (for the trace)
#endif

// Resident CTAs per SM of the tensor-core kernel for (Fmt, HD, layout), from the occupancy API
// (bounded by its shared-memory ring and registers); also opts the kernel in to > 48 KB
// of dynamic shared memory. Computed once per instantiation and device.
template <class Fmt, int HD, bool kT>
int mma_ctas_per_sm() {
  static PerDevice<int> n;
  return n.get([] {
    constexpr size_t smem = mma::mma_smem_bytes<Fmt, HD>();
    if (cudaFuncSetAttribute(mma::attn_mma_kernel<Fmt, HD, kT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(smem)) != cudaSuccess)
      throw Error("CUDA paged attention: cannot reserve " + std::to_string(smem) + " bytes of shared memory");
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, mma::attn_mma_kernel<Fmt, HD, kT>, mma::kMmaWarps * 32,
                                                      smem) !=
            cudaSuccess ||
        blocks <= 0) {
      cudaGetLastError();
      blocks = 2;
    }
    return blocks;
  });
}

// Which kernel runs, its grid shape and its split count: one function, shared by the
// launcher and paged_attention_workspace_bytes so they cannot disagree.
struct Plan {
  int kernel = 1;  // 1 CUDA cores, 2 decode tensor cores, 3 tiled prefill (PagedAttentionParams::kernel)
  bool mma = false;
  int group = 1, head_chunks = 1, rows_per_cta = 1, row_groups = 1, splits = 1;
  int64_t ctas_per_split = 1;
  bool decreasing_splits = false;  // decode tensor-core kernel (RowsArgs::decreasing_splits)
  // Exact tokens on a tensor-core kernel: the partials after the quantized keys' splits — the
  // decode kernel's one (the CUDA-core exact pass), the tiled kernel's one per exact pass it
  // runs (sinks, recent window).
  int exact_splits = 0;
  bool keys_in_m = false;   // decode tensor-core kernel: keys in M, (row, head) pairs in N (decode_layout)
};

Plan make_plan(const PagedAttentionParams& p) {
  Plan pl;
  pl.group = p.num_q_heads / p.num_kv_heads;
  const bool mma_fits = (p.head_dim == 64 || p.head_dim == 128) && p.block_size % 16 == 0 && pl.group <= 16;
  const bool tiled_fits = (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) && p.block_size % 16 == 0 &&
                          pl.group <= prefill_rows_per_cta(p.head_dim);
  if (p.kernel == 2 && !mma_fits)
    throw Error("CUDA paged attention: the tensor-core kernel needs head_dim 64 or 128, block_size % 16 == 0 and at "
                "most 16 query heads per kv head");
  if (p.kernel == 3 && !tiled_fits)
    throw Error("CUDA paged attention: the tiled prefill kernel needs head_dim 64, 128 or 256, block_size % 16 == 0 "
                "and a GQA group that fits its M tile");
  if (p.kernel < 0 || p.kernel > 3) throw Error("CUDA paged attention: kernel must be 0 (automatic), 1, 2 or 3");
  if (p.decode_layout < 0 || p.decode_layout > 2)
    throw Error("CUDA paged attention: decode_layout must be 0 (automatic), 1 (query rows in M) or 2 (keys in M)");
  if (p.decode_layout == 2 && pl.group > 8)
    throw Error("CUDA paged attention: the keys-in-M decode layout holds at most 8 query heads per kv head");
  const bool split_kv = k_format_of(p) != v_format_of(p);
  if (split_kv && p.kernel == 3)
    throw Error("CUDA paged attention: the tiled prefill kernel (3) reads K and V in one format; use 1 or 2");
  // Automatic: the tiled kernel once the rows of a sequence exceed one mma M tile (16 (row,
  // head) pairs: more than 4 query tokens at GQA 4), the decode kernel below that, the
  // CUDA-core kernel for what neither covers.
  if (p.kernel != 0) pl.kernel = p.kernel;
  // K != V: not the tiled prefill kernels, for now (the decode kernel takes multi-token rows
  // too, 16 / group of them per CTA). Exact sink / recent tokens run on every kernel: the
  // tensor-core ones take each query's quantized keys (one interval) and the exact keys
  // follow as more splits (launch_hd).
  else if (split_kv) pl.kernel = mma_fits ? 2 : 1;
  else if (tiled_fits && int64_t(p.max_q_len) * pl.group > 16) pl.kernel = 3;
  else if (mma_fits) pl.kernel = 2;
  else pl.kernel = 1;
  pl.mma = pl.kernel == 2;
  // The CUDA-core kernel's heads per CTA (also its exact pass's, after a tensor-core kernel).
  pl.head_chunks = (pl.group + kMaxGroupPerCta - 1) / kMaxGroupPerCta;
  if (pl.kernel == 3) {
    pl.rows_per_cta = prefill_rows_per_cta(p.head_dim) / pl.group;
    pl.row_groups = (p.max_q_len + pl.rows_per_cta - 1) / pl.rows_per_cta;
    pl.ctas_per_split = int64_t(p.num_seqs) * pl.row_groups * p.num_kv_heads;
  } else if (pl.mma) {
    // Keys in M: a CTA's (query row, head) pairs are the mma's N = 8 (decode at GQA <= 8; more
    // rows of a sequence take more CTAs, each streaming the keys again, so multi-token rows
    // keep the query-rows-in-M layout, which holds 16 pairs, unless a test forces it).
    pl.keys_in_m = p.decode_layout == 2 || (p.decode_layout == 0 && int64_t(p.max_q_len) * pl.group <= 8);
    pl.rows_per_cta = (pl.keys_in_m ? 8 : 16) / pl.group;
    pl.row_groups = (p.max_q_len + pl.rows_per_cta - 1) / pl.rows_per_cta;
    pl.ctas_per_split = int64_t(p.num_seqs) * pl.row_groups * p.num_kv_heads;
  } else {
    pl.ctas_per_split = int64_t(p.num_tokens) * p.num_kv_heads * pl.head_chunks;
  }
  // Split count: the grid runs in waves of `slots` resident CTAs, and a last, partial wave
  // leaves most SMs idle (64 x 4k FP8: 512 CTAs on 396 slots took 1.3x the time of one full
  // wave). Model: each wave costs keys per CTA + a fixed cost worth ~512 keys (pipeline fill,
  // warp merge, partial write); a partial wave after full ones runs faster per CTA, as its
  // CTAs share the bandwidth with fewer others, but at most kPartialWaveRate times (fitted on
  // the H200: 64 x 4k FP8 took 175 / 157 / 163 µs at 1 / 2 / 3 splits; counting the partial
  // wave as a full one picked 3); each split adds kKeysPerSplit keys' worth of reduction
  // (fitted at 1 x 4k: 18.3 / 15.4 / 17.2 µs at 8 / 16 / 32 splits; without it the model
  // picked 32). Pick the s minimising it (64 x 1k FP8 split 3-way ran 20% slower than
  // unsplit: the fixed cost is real). Splits >= 128 keys.
  int per_sm = 4;  // CUDA-core kernel: ~128 registers, static shared memory
  if (pl.kernel == 3) {
    per_sm = prefill_ctas_per_sm(p);
  } else if (pl.mma) {
    dispatch_cuda_kv_pair(k_format_of(p), v_format_of(p), "CUDA paged attention", [&](auto fmt) {
      using Fmt = decltype(fmt);
      if (pl.keys_in_m) per_sm = p.head_dim == 64 ? mma_ctas_per_sm<Fmt, 64, true>() : mma_ctas_per_sm<Fmt, 128, true>();
      else per_sm = p.head_dim == 64 ? mma_ctas_per_sm<Fmt, 64, false>() : mma_ctas_per_sm<Fmt, 128, false>();
    });
  }
  const int64_t slots = int64_t(sm_count()) * per_sm;
  int64_t max_s = std::max<int64_t>(1, std::min<int64_t>((p.max_kv_len + 127) / 128, 256));
  if (p.max_splits > 0) max_s = std::min<int64_t>(max_s, p.max_splits);
  constexpr double kPartialWaveRate = 1.34, kKeysPerSplit = 14.0;
  int64_t splits = 1;
  double best = 1e30;
  for (int64_t s = 1; s <= max_s; ++s) {
    const int64_t ctas = pl.ctas_per_split * s, full = ctas / slots, rest = ctas % slots;
    double waves = double(full);
    if (rest > 0) waves += full == 0 ? 1.0 : 1.0 / std::min(kPartialWaveRate, double(slots) / double(rest));
    const double cost = waves * (double(p.max_kv_len) / double(s) + 512.0) + (s > 1 ? kKeysPerSplit * double(s) : 0.0);
    if (cost < best - 1e-12) {
      best = cost;
      splits = s;
    }
  }
  pl.splits = int(std::clamp<int64_t>(splits, 1, 65535));
  // Split lengths. Equal splits leave the last, partial wave as long as the others: at 64 x 4k
  // FP8 (1024 CTAs on 396 slots) its 232 CTAs ran from ~60% of the call on, one or two per SM
  // and bound by their own latency (docs/results/kernel-lab.md). Decreasing lengths (split s
  // of S gets a share proportional to S - s) leave the short splits for that wave. In a single
  // wave they only lengthen the longest CTA (16 x 4k FP8, 3 splits: 47 -> 51 µs), so not there.
  if (p.split_lengths < 0 || p.split_lengths > 2)
    throw Error("CUDA paged attention: split_lengths must be 0 (automatic), 1 (equal) or 2 (decreasing)");
  pl.decreasing_splits = pl.mma && pl.splits > 1 &&
                         (p.split_lengths == 2 || (p.split_lengths == 0 && pl.ctas_per_split * pl.splits > slots));
  if (p.exact_k && pl.kernel == 2) pl.exact_splits = 1;
  if (p.exact_k && pl.kernel == 3) pl.exact_splits = (p.keep_sink > 0) + (p.keep_recent > 0);
  pl.splits += pl.exact_splits;
  return pl;
}

template <class Fmt, int HD, bool kT>
void launch_mma(const RowsArgs& a, cudaStream_t st) {
  const dim3 grid(unsigned(a.p.num_seqs * a.row_groups), unsigned(a.p.num_kv_heads), unsigned(a.range_splits));
  constexpr size_t smem = mma::mma_smem_bytes<Fmt, HD>();
  mma_ctas_per_sm<Fmt, HD, kT>();  // sets the shared-memory attribute (once)
  // Launched with PDL (pdl.cuh): the kernel reads the step's metadata, then waits for the
  // kernel before (which wrote Q and this step's K/V rows).
  cuda_check(launch_pdl<mma::attn_mma_kernel<Fmt, HD, kT>>(grid, dim3(mma::kMmaWarps * 32), smem, st, a),
             "paged_attention launch");
#ifdef KVLM_ATTN_TRACE
  g_last_mma_ctas = int64_t(grid.x) * grid.y * grid.z;
#endif
}

// The exact pages as a 16-bit cache of the same page layout, for the tiled kernel's exact passes.
PagedAttentionParams exact_view(const PagedAttentionParams& p) {
  PagedAttentionParams e = p;
  e.storage = p.exact_f16 ? DType::F16 : DType::BF16;
  e.quant = KVQuantMode::None;
  e.v_format = std::nullopt;
  e.k_cache = p.exact_k;
  e.v_cache = p.exact_v;
  e.k_token_scale = e.v_token_scale = nullptr;
  e.block_tables = p.exact_tables;
  return e;
}

template <class Fmt, int HD>
void launch_hd(const RowsArgs& a, int kernel, cudaStream_t st) {
  if (kernel == 3) {
    launch_prefill(a, st);  // the quantized keys (all of them without exact tokens)
    // Exact tokens: the sinks and the recent window are one range each per query row, which
    // the same kernel takes over the exact pages (a CTA's window keys overlap its rows': one
    // or two tiles), each pass one more partial.
    if (a.p.exact_k) {
      RowsArgs e = a;
      e.p = exact_view(a.p);
      for (int part : {1, 2}) {
        if ((part == 1 ? a.p.keep_sink : a.p.keep_recent) == 0) continue;
        e.exact_part = part;
        launch_prefill(e, st);
      }
    }
    if (a.num_splits > 1) launch_reduce(a, st);
    return;
  }
  if constexpr (HD <= 128) {
    if (kernel == 2) {
      if (a.keys_in_m) launch_mma<Fmt, HD, true>(a, st);
      else launch_mma<Fmt, HD, false>(a, st);
      if (a.p.exact_k) {  // the exact keys: the CUDA-core kernel's exact pass, then the reduction
        RowsArgs e = a;
        e.exact_pass = true;
        return launch_rows<Fmt, HD>(e, st);
      }
      if (a.num_splits > 1) launch_reduce(a, st);
      return;
    }
  }
  launch_rows<Fmt, HD>(a, st);
}

void validate(const PagedAttentionParams& p) {
  if (p.head_dim != 8 && p.head_dim != 16 && p.head_dim != 32 && p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256)
    throw Error("CUDA paged attention: head size " + std::to_string(p.head_dim) +
                " is not supported; supported: 8, 16, 32, 64, 128, 256");
  if (p.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    throw Error("CUDA paged attention: num_q_heads must be a positive multiple of num_kv_heads");
  if (p.block_size <= 0 || p.max_blocks_per_seq <= 0) throw Error("CUDA paged attention: empty block tables");
  if (p.mask == AttentionKind::Sliding && p.window <= 0) throw Error("CUDA paged attention: sliding window must be positive");
  if (p.num_seqs <= 0 || p.num_tokens <= 0) throw Error("CUDA paged attention: empty batch");
  if (p.max_q_len <= 0 || p.max_kv_len <= 0) throw Error("CUDA paged attention: max_q_len and max_kv_len must be set");
  if (p.exact_k && (!p.exact_v || !p.exact_tables || p.keep_sink < 0 || p.keep_recent < 0))
    throw Error("CUDA paged attention: exact sink / recent tokens need exact_v, exact_tables and keep counts >= 0");
}

}  // namespace

std::vector<AttnCtaTrace> paged_attention_last_trace() {
  std::vector<AttnCtaTrace> out;
#ifdef KVLM_ATTN_TRACE
  static_assert(sizeof(mma::g_cta_trace[0]) == sizeof(AttnCtaTrace), "one device record per AttnCtaTrace");
  out.resize(size_t(std::min<int64_t>(g_last_mma_ctas, mma::kTraceCtas)));
  cuda_check(cudaDeviceSynchronize(), "paged_attention_last_trace");
  if (!out.empty())
    cuda_check(cudaMemcpyFromSymbol(out.data(), mma::g_cta_trace, out.size() * sizeof(AttnCtaTrace)),
               "paged_attention_last_trace");
#endif
  return out;
}

PagedAttentionChoice paged_attention_choice(const PagedAttentionParams& p) {
  validate(p);
  const Plan pl = make_plan(p);
  return {.kernel = pl.kernel, .splits = pl.splits - pl.exact_splits, .decreasing_splits = pl.decreasing_splits,
          .keys_in_m = pl.keys_in_m};
}

size_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  const int s = make_plan(p).splits;
  if (s <= 1) return 0;
  return size_t(p.num_tokens) * size_t(p.num_q_heads) * size_t(s) * size_t(p.head_dim + 2) * sizeof(float);
}

void paged_attention(const PagedAttentionParams& p, void* stream) {
  validate(p);
  dispatch_cuda_kv_pair(k_format_of(p), v_format_of(p), "CUDA paged attention", [&](auto fmt) {
    using Fmt = decltype(fmt);
    check_kv_pages<Fmt>(p, "CUDA paged attention");
    const Plan pl = make_plan(p);
    RowsArgs a{.p = p, .group = pl.group, .head_chunks = pl.head_chunks, .rows_per_cta = pl.rows_per_cta,
               .row_groups = pl.row_groups, .num_splits = pl.splits, .part_o = nullptr, .part_ml = nullptr,
               .decreasing_splits = pl.decreasing_splits, .range_splits = pl.splits - pl.exact_splits,
               .keys_in_m = pl.keys_in_m};
    if (a.num_splits > 1) {
      const size_t need = paged_attention_workspace_bytes(p);
      if (!p.workspace || p.workspace_bytes < need)
        throw Error("CUDA paged attention: workspace of " + std::to_string(p.workspace_bytes) + " bytes, needs " +
                    std::to_string(need) + " (paged_attention_workspace_bytes)");
      a.part_o = static_cast<float*>(p.workspace);
      a.part_ml = a.part_o + size_t(p.num_tokens) * p.num_q_heads * a.num_splits * p.head_dim;
    }
    const auto st = static_cast<cudaStream_t>(stream);
    switch (p.head_dim) {
      case 64: launch_hd<Fmt, 64>(a, pl.kernel, st); break;
      case 128: launch_hd<Fmt, 128>(a, pl.kernel, st); break;
      case 256: launch_hd<Fmt, 256>(a, pl.kernel, st); break;
      default: launch_rows_small_heads(a, st); break;  // 8, 16, 32 (validated above)
    }
  });
}

}  // namespace kvlm::cuda

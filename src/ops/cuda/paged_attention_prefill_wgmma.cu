// The warp-specialised tiled prefill kernel for Hopper (sm_90a), head sizes 64 and 128: the
// algorithm of paged_attention_prefill.cuh with warpgroup MMAs.
//
// The same algorithm as the mma.sync kernel, warp-specialised. Three
// warpgroups: warpgroup 0 produces, 1 and 2 consume, 64 M rows each (BM = 128 as above, so the
// plan's rows per CTA do not change). The producer streams 128-key tiles of K and V (WsSmem)
// into a ring of shared-memory stages — cp.async straight into the 128-byte-swizzled layout
// the descriptors describe (wgmma.cuh) for 16-bit caches; for 1-byte caches raw into a
// private ring, then expanded to f16 into the stage by the thread that loaded the piece; int4
// caches the same, each thread also loading the {step, zero} slots of its pieces' rows and
// writing code * step + zero as f16 (one HFMA2 per pair), so the consumers see an f16 cache
// with no per-key factors — and publishes each stage on its "full" mbarrier; every consumer thread releases the stage on its
// "empty" mbarrier once its GEMMs have read it (async_pipeline.cuh). So the consumers never
// meet at a CTA-wide barrier: the two warpgroups drift apart and one's softmax overlaps the
// other's GEMMs, and the loads' address arithmetic is off their issue slots. setmaxnreg moves
// registers from the producer (addresses only) to the consumers (64 O + BN / 2 S accumulators
// and the P fragments at head 128). Per tile, each consumer warpgroup: S = Q K^T (HD / 16 wgmma
// m64n{BN}k16, Q and K read through shared-memory descriptors), mask and online softmax (the
// mma.sync kernel's), O += P V (BN / 16 wgmma m64n{HD}k16, P from registers: the m64
// accumulator layout is the A-fragment layout per warp; V read transposed). Overlapping the
// next tile's S GEMM with this tile's softmax inside a warpgroup (FlashAttention-3) was tried
// twice (docs/results/kernel-lab.md): ptxas serialises every wgmma when an S accumulator array
// lives across loop iterations (C7514 / C7515), and the version it does not serialise (S fresh
// per iteration, P V of tile j - 1 issued after S of tile j) was 4% slower at bf16 than this.
#include "ops/cuda/async_pipeline.cuh"
#include "ops/cuda/kernel_switches.h"
#include "ops/cuda/paged_attention_prefill.cuh"
#include "ops/cuda/wgmma.cuh"

namespace kvlm::cuda {
namespace {

constexpr int kWsThreads = 384;

// Tile shape, shared-memory layout and register split of the warpgroup kernel per format.
// 128-key tiles, as many stages as fit in 227 KB: 16-bit caches 3 (224 KB at head 128);
// 1-byte caches 2 expanded stages and 2 raw tiles (224 KB), per-token-head ones 1 raw tile
// (their scales would not fit beside a second); int4 2 and 2 (raw tiles are half as big), plus
// each producer thread's own step / zero slots per raw tile.
// setmaxnreg moves registers within the CTA's pool (384 x the count ptxas gave the kernel,
// 168 under __launch_bounds__(384, 1)): the producer warpgroup's 128 threads give theirs up to
// kProducerRegs, the consumers' 256 take kConsumerRegs. The split must fit the pool, or the
// consumers' setmaxnreg.inc waits forever (a hang, seen with 64 / 224): wgmma_occupancy
// checks it on the host before the first launch. Expanding 128-key tiles takes the producer
// 64 registers.
template <class Fmt, int HD>
struct WsSmem {
  static constexpr int BITS = Fmt::kBits;
  static constexpr bool kI4 = kIsInt4<Fmt>;
  // Per-key scales the consumers apply (int4's are applied by the producer).
  static constexpr bool kPTH = Fmt::kScale == Scale::PerTokenHead && !kI4;
  static constexpr int RB = HD * BITS / 8;  // bytes of one stored K/V row
  static constexpr int BM = 128, BN = 128;
  static_assert(BM == PrefillTile<HD>::BM, "both kernels must take the plan's rows per CTA");
  static constexpr int kStages = BITS == 16 ? 3 : 2;          // K/V tiles the consumers read
  static constexpr int kRaw = BITS == 16 ? 0 : kPTH ? 1 : 2;  // the producer's raw tiles
  static constexpr int kPieces = BN * RB / 16 / 128;          // 16-byte pieces per producer thread (K or V)
  static constexpr int kProducerRegs = BITS < 16 ? 64 : 56;
  static constexpr int kConsumerRegs = BITS < 16 ? 216 : 224;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kWsThreads * (65536 / kWsThreads / 8 * 8),
                "the register split exceeds the largest pool __launch_bounds__(384, 1) allows");
  static constexpr size_t tile16 = size_t(BN) * HD * 2;
  static constexpr size_t raw = size_t(BN) * RB;
  static constexpr size_t q = size_t(BM) * HD * 2;  // Q at offset 0
  static constexpr size_t stages = q;
  static constexpr size_t raws = stages + kStages * 2 * tile16;
  static constexpr size_t scales = raws + kRaw * 2 * raw;  // per stage: BN K then BN V scales
  static constexpr size_t raw_scales = scales + (kPTH ? kStages * 2 * BN * sizeof(float) : 0);
  // int4: per raw tile, [K, V][piece][producer thread] slots; 1-byte per-token-head: BN K then BN V scales.
  static constexpr size_t raw_scale_bytes = kI4 ? 2 * kPieces * 128 * sizeof(uint32_t) : kPTH ? 2 * BN * sizeof(float) : 0;
  static constexpr size_t bars = raw_scales + kRaw * raw_scale_bytes;
  static constexpr size_t total = bars + 2 * kStages * sizeof(uint64_t) + 1024;  // + alignment
  static_assert(total <= 227 * 1024, "the warpgroup kernel's shared memory exceeds 227 KB");
};

// int4: the producer thread's K and V slots ({f16 step, f16 zero}) of the rows of its pieces of
// the BN keys from kb, each 4 bytes by cp.async into slots[(kv * kPieces + it) * 128 + tid];
// keys outside [t0, t1) get 0 (step and zero 0: their zero-filled codes expand to 0, never to
// a stale page's NaN). Does not commit.
template <int BN, int RB, int kPieces>
__device__ __forceinline__ void load_i4_slots(const PagedAttentionParams& p, const PageRows& pr, const CtaWork& w, int kb,
                                              uint32_t* slots, int tid) {
#pragma unroll
  for (int it = 0; it < kPieces; ++it) {
    const int key = kb + (tid + it * 128) / (RB / 16);
    const bool ok = key >= w.t0 && key < w.t1;
    const size_t row = ok ? size_t(pr.row(key)) : 0;
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const float* src = (kv ? p.v_token_scale : p.k_token_scale) + row;
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(slots + (kv * kPieces + it) * 128 + tid));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0));
    }
  }
}

// int4: this thread's pieces of a raw tile -> f16 values code * step + zero (one rounding, by
// HFMA2), chunk X c + x of row r at dst(r, X c + x) of k_out / v_out.
template <int BN, int HD, class Dst>
__device__ __forceinline__ void expand_i4_tile(const char* k_raw, const char* v_raw, const uint32_t* slots, uint4* k_out,
                                               uint4* v_out, Dst dst, int tid) {
  constexpr int RB = HD / 2, X = 4, kPieces = BN * RB / 16 / 128;
#pragma unroll
  for (int it = 0; it < kPieces; ++it) {
    const int i = tid + it * 128;
    const int r = i / (RB / 16), c = i % (RB / 16);
#pragma unroll
    for (int kv = 0; kv < 2; ++kv) {
      const uint4 raw = reinterpret_cast<const uint4*>(kv ? v_raw : k_raw)[i];
      const uint32_t slot = slots[(kv * kPieces + it) * 128 + tid];
      const __half2 step = __half2half2(__ushort_as_half(uint16_t(slot & 0xffffu)));
      const __half2 zero = __half2half2(__ushort_as_half(uint16_t(slot >> 16)));
      uint32_t w[4 * X];
      mma::to_pairs<FmtI4, 16>(&raw, w);
#pragma unroll
      for (int k = 0; k < 4 * X; ++k) {
        __half2 h;
        memcpy(&h, &w[k], 4);
        h = __hfma2(h, step, zero);
        memcpy(&w[k], &h, 4);
      }
      uint4* out = kv ? v_out : k_out;
#pragma unroll
      for (int x = 0; x < X; ++x) out[dst(r, X * c + x)] = make_uint4(w[4 * x], w[4 * x + 1], w[4 * x + 2], w[4 * x + 3]);
    }
  }
}

// Chunk index (uint4 units) of row r, 8-value chunk c of a 16-bit tile of R rows in the
// 128-byte-swizzled layout: 64-value column blocks of R x 128 B, chunk (c % 8) ^ (r % 8).
template <int R>
__device__ __forceinline__ int sw128(int r, int c) {
  return (c >> 3) * (R * 8) + r * 8 + ((c & 7) ^ (r & 7));
}

template <class Fmt, int HD>
__global__ void __launch_bounds__(kWsThreads, 1) attn_prefill_wgmma_kernel(const RowsArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  allow_dependents();
  using Sm = WsSmem<Fmt, HD>;
  constexpr int BM = Sm::BM, BN = Sm::BN, kStages = Sm::kStages;
  constexpr bool kBF = mma::MmaCodec<Fmt>::kBF16;
  constexpr int BITS = Sm::BITS;
  constexpr bool kPTH = Sm::kPTH;  // per-key scales in the consumers (not int4: see WsSmem)
  constexpr bool kI4 = Sm::kI4;
  constexpr int RB = Sm::RB;
  constexpr int CPR = HD / 8;
  constexpr int NT = BN / 8;
  constexpr int DT = HD / 8;
  constexpr int WG = 128;  // threads per warpgroup
  constexpr float kPScale = kPTH ? 256.0f : 1.0f;

  const PagedAttentionParams& p = a.p;
  const int G = a.group;
  const int kvh = blockIdx.y, split = CtaWork::split(a);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wtid = tid & (WG - 1);
  CtaWork w;
  if (!w.init(a)) return;
  const int ntiles = w.num_tiles(BN);
  const int consumers = w.mrows > 64 ? 2 : 1;  // consumer warpgroups holding a valid M row

  extern __shared__ uint4 smem_u4[];
  // The swizzle pattern repeats every 1024 B and the descriptors assume aligned tiles.
  const uint32_t sbase = pipe::smem_addr(smem_u4);
  char* const smem = reinterpret_cast<char*>(smem_u4) + ((1024 - (sbase & 1023)) & 1023);
  float* const sScales = reinterpret_cast<float*>(smem + Sm::scales);
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + Sm::bars);
  uint64_t* const empty = full + kStages;
  auto stage_k = [&](int s) { return smem + Sm::stages + s * 2 * Sm::tile16; };
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      pipe::mbar_init(full + s, WG);                // every producer thread
      pipe::mbar_init(empty + s, WG * consumers);   // every thread of an active consumer warpgroup
    }
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: tile j into stage j % kStages once the consumers released its previous use.
    pipe::regs_dec<Sm::kProducerRegs>();
    const PageRows pr(p, w.seq, kvh);
    const int base0 = w.first_key();
    if constexpr (BITS == 16) {
      for (int j = 0; j < ntiles; ++j) {
        const int s = j % kStages;
        if (j >= kStages) pipe::mbar_wait(empty + s, ((j / kStages) - 1) & 1);
        load_kv_tile<BN, RB, WG, false>(p, pr, w, base0 + j * BN, stage_k(s), stage_k(s) + Sm::tile16, nullptr,
                                        [](int r, int c, int) { return sw128<BN>(r, c) * 16; }, wtid);
        pipe::mbar_arrive_cp_async(full + s);
      }
    } else {
      constexpr int kRaw = Sm::kRaw;
      float* const raw_sc = reinterpret_cast<float*>(smem + Sm::raw_scales);
      uint32_t* const raw_slots = reinterpret_cast<uint32_t*>(smem + Sm::raw_scales);  // int4
      // Always commits a group (empty past the last tile): "wait_group kRaw - 1" then always
      // means "tile j landed". A raw slot is refilled as soon as this thread has expanded its
      // pieces of it (no other thread reads them), so kRaw tiles are always in flight.
      auto issue_raw = [&](int j) {
        if (j < ntiles) {
          char* rs = smem + Sm::raws + (j % kRaw) * 2 * Sm::raw;
          load_kv_tile<BN, RB, WG, kPTH>(p, pr, w, base0 + j * BN, rs, rs + Sm::raw, raw_sc + (j % kRaw) * 2 * BN,
                                         [](int, int, int i) { return i * 16; }, wtid);
          if constexpr (kI4)
            load_i4_slots<BN, RB, Sm::kPieces>(p, pr, w, base0 + j * BN, raw_slots + (j % kRaw) * 2 * Sm::kPieces * WG, wtid);
        }
        asm volatile("cp.async.commit_group;\n" ::);
      };
#pragma unroll
      for (int j = 0; j < kRaw; ++j) issue_raw(j);
      for (int j = 0; j < ntiles; ++j) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kRaw - 1));
        const int s = j % kStages;
        if (j >= kStages) pipe::mbar_wait(empty + s, ((j / kStages) - 1) & 1);
        const char* rs = smem + Sm::raws + (j % kRaw) * 2 * Sm::raw;
        uint4* const st = reinterpret_cast<uint4*>(stage_k(s));
        // This thread expands (and copies the scales of) exactly the pieces it loaded.
        if constexpr (kI4)
          expand_i4_tile<BN, HD>(rs, rs + Sm::raw, raw_slots + (j % kRaw) * 2 * Sm::kPieces * WG, st, st + BN * CPR,
                                 [](int r, int c) { return sw128<BN>(r, c); }, wtid);
        else
          expand_tile<Fmt, BN, HD, WG>(rs, rs + Sm::raw, st, st + BN * CPR, [](int r, int c) { return sw128<BN>(r, c); },
                                       wtid);
        if constexpr (kPTH) {
          if (wtid < BN / 2) {
            const int o = scale_piece<BN>(wtid);
            *reinterpret_cast<float4*>(sScales + s * 2 * BN + o) =
                *reinterpret_cast<const float4*>(raw_sc + (j % kRaw) * 2 * BN + o);
          }
        }
        wgmma::fence_proxy_async();  // st.shared -> the consumers' wgmma reads
        pipe::mbar_arrive(full + s);
        issue_raw(j + kRaw);
      }
    }
    asm volatile("cp.async.wait_all;\n" ::);
    return;
  }

  // Consumers: warpgroup cw = wg - 1 owns M rows 64 cw .. 64 cw + 63, this warp 16 of them.
  pipe::regs_inc<Sm::kConsumerRegs>();
  const int cw = wg - 1;
  if (cw >= consumers) return;  // warpgroup-uniform: wgmma needs all 4 warps
  const int g = lane >> 2, t = lane & 3;
  const int row_base = (warp - 4) * 16;
  int rlo[2], rhi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) w.row_range(p, row_base + g + 8 * i, G, rlo[i], rhi[i]);

  load_q<64, HD, WG, kBF>(p, w, G, kvh, reinterpret_cast<uint4*>(smem), [](int m, int c) { return sw128<BM>(m, c); }, wtid,
                          64 * cw);
  wgmma::fence_proxy_async();
  pipe::named_sync(1 + cw, WG);  // this warpgroup's Q rows stored

  float sscale, vscale;
  score_scales<Fmt>(p, kvh, sscale, vscale);
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  const uint64_t dq0 = wgmma::desc_sw128(smem + cw * 64 * 128, 16, 1024);

  for (int j = 0; j < ntiles; ++j) {
    const int s = j % kStages;
    pipe::mbar_wait(full + s, (j / kStages) & 1);
    if constexpr (BITS == 16) wgmma::fence_proxy_async();  // the producer's cp.async -> wgmma
    const char* const tk = stage_k(s);

    // S = Q K_j^T over HD / 16 k-steps: 32 B further into the 128-B rows per step, the next
    // 64-column block every 4 steps. Descriptor start addresses are in 16-byte units in the
    // low field, so a byte offset inside shared memory is added as offset / 16.
    float sc[NT][4];
    {
      const uint64_t dk0 = wgmma::desc_sw128(tk, 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kc = 0; kc < HD / 16; ++kc) {
        const uint64_t dq = dq0 + uint64_t(((kc >> 2) * (BM * 128) + (kc & 3) * 32) >> 4);
        const uint64_t dk = dk0 + uint64_t(((kc >> 2) * (BN * 128) + (kc & 3) * 32) >> 4);
        wgmma::wgmma_ss<BN, kBF>(&sc[0][0], dq, dk, kc > 0);
      }
      wgmma::commit();
      wgmma::wait<0>();
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) wgmma::fence_operand(sc[nt][e]);
    }

    const int kb = w.first_key() + j * BN;
    const float* const ksc = sScales + s * 2 * BN;
    auto softmax = [&](bool full) {  // a literal in each branch, as in the mma.sync kernel
      float kf[NT][2], vf[NT][2];
      key_factors<NT, kPTH>(kf, vf, sscale, ksc, ksc + BN, kPScale, full, kb, t, w.t0, w.t1);
      softmax_rows<NT, DT, kPTH>(sc, o, m_run, l_run, kf, vf, sscale, full, kb, t, rlo, rhi);
    };
    if (kb >= w.lo_inner && kb + BN <= w.hi_inner)
      softmax(true);
    else
      softmax(false);

    // O += P V_j: k-step kk covers keys 16 kk .. 16 kk + 15 (two 1024-B row groups); the
    // 64-dim column blocks of V are BN * 128 B apart (LBO).
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = mma::pack2<kBF>(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = mma::pack2<kBF>(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = mma::pack2<kBF>(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = mma::pack2<kBF>(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
    const uint64_t dv0 = wgmma::desc_sw128(tk + Sm::tile16, BN * 128, 1024);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma::wgmma_rs<HD, kBF>(&o[0][0], pa[kk], dv0 + uint64_t((kk * 16 * 128) >> 4), 1);
    wgmma::commit();
    wgmma::wait<0>();
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e) wgmma::fence_operand(o[d][e]);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) wgmma::fence_operand(pa[kk][e]);
    pipe::mbar_arrive(empty + s);  // this thread is done reading stage s (its scales, its wgmma operands)
  }
  store_rows<HD>(a, o, m_run, l_run, row_base + g, w.mrows, G, size_t(w.q_begin + w.r0), kvh, split, t, vscale, kPScale);
#else
  __trap();  // launched only where sm_90a code is loaded (prefill_wgmma_available)
#endif
}

// Resident CTAs per SM; checks once per instantiation and device that the register split fits
// the pool the compiler gave the kernel (a misfit would hang the GPU).
template <class Fmt, int HD>
int wgmma_occupancy() {
  static PerDevice<bool> fits;
  fits.get([] {
    cudaFuncAttributes fa{};
    cuda_check(cudaFuncGetAttributes(&fa, attn_prefill_wgmma_kernel<Fmt, HD>), "paged_attention prefill attributes");
    using Sm = WsSmem<Fmt, HD>;
    if (fa.numRegs * kWsThreads < 128 * Sm::kProducerRegs + 256 * Sm::kConsumerRegs)
      throw Error("CUDA paged attention: the warp-specialised prefill kernel was compiled with " +
                  std::to_string(fa.numRegs) + " registers per thread, too few for its register split (" +
                  std::to_string(Sm::kProducerRegs) + " / " + std::to_string(Sm::kConsumerRegs) +
                  "); report this build (the lab's --no-wgmma runs the mma.sync kernel)");
    return true;
  });
  return occupancy<attn_prefill_wgmma_kernel<Fmt, HD>>(WsSmem<Fmt, HD>::total, kWsThreads);
}

template <class F>
void dispatch_wgmma_hd(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
  }
  throw Error("CUDA paged attention: the warp-specialised prefill kernel takes head sizes 64 and 128, not " +
              std::to_string(head_dim));
}

}  // namespace

// Whether the warpgroup kernel can run: this build compiled sm_90a code (KVLM_CUDA_SM90A,
// set by CMake when CMAKE_CUDA_ARCHITECTURES lists 90a) and the current GPU is compute
// capability 9.0, the only one that loads it. kernel_switches().wgmma = false turns it off
// (the mma.sync kernel runs instead; for comparisons and as an escape hatch).
bool prefill_wgmma_available() {
  if (!kernel_switches().wgmma) return false;
#if defined(KVLM_CUDA_SM90A)
  return compute_capability() == 90;
#else
  return false;
#endif
}

int prefill_wgmma_ctas_per_sm(const PagedAttentionParams& p) {
  int n = 1;
  dispatch_cuda_kv(p.storage, p.quant, [&](auto fmt) {
    dispatch_wgmma_hd(p.head_dim, [&](auto hd) { n = wgmma_occupancy<decltype(fmt), decltype(hd)::value>(); });
  });
  return n;
}

void launch_prefill_wgmma(const RowsArgs& a, cudaStream_t st) {
  dispatch_cuda_kv(a.p.storage, a.p.quant, [&](auto fmt) {
    using Fmt = decltype(fmt);
    dispatch_wgmma_hd(a.p.head_dim, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      wgmma_occupancy<Fmt, HD>();  // the register check and the smem opt-in, once
      attn_prefill_wgmma_kernel<Fmt, HD><<<prefill_grid(a), kWsThreads, WsSmem<Fmt, HD>::total, st>>>(a);
    });
  });
}

}  // namespace kvlm::cuda

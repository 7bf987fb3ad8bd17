// The mma.sync tiled prefill kernel (every GPU; the algorithm is described in
// paged_attention_prefill.cuh) and the prefill entry points, which run the warp-specialised
// kernel of paged_attention_prefill_wgmma.cu instead where sm_90a code runs.
#include "ops/cuda/paged_attention_prefill.cuh"

namespace kvlm::cuda {
namespace {

template <class Fmt, int HD>
__global__ void __launch_bounds__(kPrefillWarps * 32, 2) attn_prefill_kernel(const RowsArgs a) {
  allow_dependents();
  using Tile = PrefillTile<HD>;
  using Sm = PrefillSmem<Fmt, HD>;
  constexpr int MT = Tile::MT, BM = Tile::BM, BN = Tile::BN;
  constexpr bool kBF = mma::MmaCodec<Fmt>::kBF16;
  constexpr int BITS = Sm::BITS;
  constexpr bool kPTH = Sm::kPTH;
  constexpr bool kI4 = Sm::kI4;  // codes * step + zero (paged_attention_mma.cuh)
  constexpr int RB = HD * BITS / 8;  // bytes of one stored K/V row
  constexpr int CPR = HD / 8;    // 16-byte chunks per 16-bit row
  constexpr int NT = BN / 8;     // n-tiles of S
  constexpr int DT = HD / 8;     // n-tiles of O
  constexpr int THREADS = kPrefillWarps * 32;
  // Per-token-head V scales ride on P times 2^8 (f16 range, as in the decode kernel).
  constexpr float kPScale = kI4 ? 16.0f : kPTH ? 256.0f : 1.0f;  // int4: see paged_attention_mma.cuh

  const PagedAttentionParams& p = a.p;
  const int G = a.group;
  const int kvh = blockIdx.y, split = CtaWork::split(a);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  CtaWork w;
  if (!w.init(a)) return;

  const int row_base = warp * 16 * MT;
  const bool warp_active = row_base < w.mrows;  // warp-uniform: no valid M row -> skip the math
  int rlo[MT][2], rhi[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < 2; ++i) w.row_range(p, row_base + mt * 16 + g + 8 * i, G, rlo[mt][i], rhi[mt][i]);

  extern __shared__ uint4 smem_u4[];
  char* const smem = reinterpret_cast<char*>(smem_u4);
  uint4* const sQ = smem_u4;
  char* const stages = smem + Sm::q;
  uint4* const sConv = reinterpret_cast<uint4*>(stages + 2 * Sm::stage);  // 1-byte and 4-bit caches only
  float* const sQsum = reinterpret_cast<float*>(stages + 2 * Sm::stage + Sm::conv);  // int4 only

  const PageRows pr(p, w.seq, kvh);
  const int base0 = w.first_key();
  const int ntiles = w.num_tiles(BN);

  // Tile j: keys [base0 + j * BN, + BN) into stage j % 2; 16-bit codes land swizzled (the
  // ldmatrix layout), 1-byte codes raw (expanded per tile below).
  auto issue = [&](int j) {
    char* st = stages + (j & 1) * Sm::stage;
    load_kv_tile<BN, RB, THREADS, kPTH>(p, pr, w, base0 + j * BN, st, st + Sm::kv, reinterpret_cast<float*>(st + 2 * Sm::kv),
                                        [](int r, int c, int i) { return BITS == 16 ? swz<HD>(r, c) * 16 : i * 16; }, tid);
    asm volatile("cp.async.commit_group;\n" ::);
  };
  if (ntiles > 0) issue(0);
  load_q<BM, HD, THREADS, kBF>(p, w, G, kvh, sQ, [](int m, int c) { return swz<HD>(m, c); }, tid, 0);
  // int4: sum(q) of every M row, from the f16 values the mma reads.
  float qs[MT][2] = {}, zacc[MT][2] = {};
  if constexpr (kI4) {
    __syncthreads();
    for (int m = tid; m < BM; m += THREADS) {
      float sum = 0.0f;
      for (int c = 0; c < CPR; ++c) {
        const uint4 v = sQ[swz<HD>(m, c)];
        const uint32_t x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float2 f = mma::unpack2<kBF>(x[k]);
          sum += f.x + f.y;
        }
      }
      sQsum[m] = sum;
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 2; ++i) qs[mt][i] = sQsum[row_base + mt * 16 + g + 8 * i];
  }

  // Score scale: softmax_scale * log2(e) * per-tensor K scale; V's per-tensor scale at the end.
  float sscale, vscale;
  score_scales<Fmt>(p, kvh, sscale, vscale);

  float o[MT][DT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < DT; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.0f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.0f;

  // Per-thread ldmatrix row offsets (uint4 units) and swizzled low chunk bits. Q and V rows
  // take chunk 2i + lane / 16, K rows chunk 2i + (lane / 8) % 2 (fragment order of m16n8k16).
  const int q_row = (row_base + (lane & 15)) * CPR;
  const int k_row = ((lane & 7) + ((lane >> 4) << 3)) * CPR;
  const int v_row = ((lane & 7) + (((lane >> 3) & 1) << 3)) * CPR;
  int qx[4], kx[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    qx[i] = (2 * i + (lane >> 4)) ^ (lane & 7);
    kx[i] = (2 * i + ((lane >> 3) & 1)) ^ (lane & 7);
  }

  for (int j = 0; j < ntiles; ++j) {
    asm volatile("cp.async.wait_group 0;\n" ::);
    __syncthreads();  // tile j landed for everyone; everyone is done with tile j - 1
    if (j + 1 < ntiles) issue(j + 1);
    const char* st = stages + (j & 1) * Sm::stage;
    const uint4* sK = reinterpret_cast<const uint4*>(st);
    const uint4* sV = reinterpret_cast<const uint4*>(st + Sm::kv);
    if constexpr (BITS < 16) {
      uint4* cK = sConv;
      uint4* cV = sConv + BN * CPR;
      expand_tile<Fmt, BN, HD, THREADS>(reinterpret_cast<const char*>(sK), reinterpret_cast<const char*>(sV), cK, cV,
                                        [](int r, int c) { return swz<HD>(r, c); }, tid);
      __syncthreads();
      sK = cK;
      sV = cV;
    }
    if (!warp_active) continue;
    const int kb = base0 + j * BN;
    const float* ksc = reinterpret_cast<const float*>(st + 2 * Sm::kv);
    const float* vsc = ksc + BN;

    // S = Q K^T. Operand addresses: every ldmatrix row index r has r % 8 == lane % 8, so the
    // swizzled chunk of logical chunk c is (c & ~7) | ((c & 7) ^ (lane & 7)): a compile-time
    // part plus one of 4 per-thread values (qx / kx below), keeping address registers few.
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
#pragma unroll
    for (int kc = 0; kc < HD / 16; ++kc) {
      uint32_t qa[MT][4];
      const int qc = (2 * kc & ~7) + qx[kc % 4], kc_ = (2 * kc & ~7) + kx[kc % 4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldsm_x4(qa[mt], sQ + q_row + mt * 16 * CPR + qc);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t kf[4];
        ldsm_x4(kf, sK + k_row + np * 16 * CPR + kc_);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::mma16816<kBF>(s[mt][2 * np], qa[mt], kf[0], kf[1]);
          mma::mma16816<kBF>(s[mt][2 * np + 1], qa[mt], kf[2], kf[3]);
        }
      }
    }

    // `full` as a literal in each branch: tiles no row masks compile without the mask.
    auto softmax = [&](bool full) {
      float kf[NT][2], vf[NT][2];
      KeyZeros<NT> zp;
      key_factors<NT, kPTH, kI4>(kf, vf, sscale, ksc, vsc, kPScale, full, kb, t, w.t0, w.t1, &zp);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        softmax_rows<NT, DT, kPTH, kI4>(s[mt], o[mt], m_run[mt], l_run[mt], kf, vf, sscale, full, kb, t, rlo[mt],
                                        rhi[mt], &zp, qs[mt], zacc[mt]);
    };
    if (kb >= w.lo_inner && kb + BN <= w.hi_inner)
      softmax(true);
    else
      softmax(false);

    // O += P V: the S accumulators of n-tiles 2kk and 2kk + 1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = mma::pack2<kBF>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = mma::pack2<kBF>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = mma::pack2<kBF>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = mma::pack2<kBF>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < HD / 16; ++dp) {
        uint32_t vf[4];
        ldsm_x4_trans(vf, sV + v_row + kk * 16 * CPR + (2 * dp & ~7) + qx[dp % 4]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma::mma16816<kBF>(o[mt][2 * dp], pa[mt], vf[0], vf[1]);
          mma::mma16816<kBF>(o[mt][2 * dp + 1], pa[mt], vf[2], vf[3]);
        }
      }
    }
  }
  asm volatile("cp.async.wait_all;\n" ::);
  if (!warp_active) return;
  if constexpr (kI4)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) add_zero_points(o[mt], zacc[mt]);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    store_rows<HD>(a, o[mt], m_run[mt], l_run[mt], row_base + mt * 16 + g, w.mrows, G, size_t(w.q_begin + w.r0), kvh,
                   split, t, vscale, kPScale);
}

}  // namespace

int prefill_rows_per_cta(int head_dim) {
  int bm = 0;
  dispatch_prefill_hd(head_dim, [&](auto hd) { bm = PrefillTile<decltype(hd)::value>::BM; });
  return bm;
}

bool use_wgmma(const PagedAttentionParams& p) {
  return p.head_dim <= 128 && prefill_wgmma_available();
}

int prefill_ctas_per_sm(const PagedAttentionParams& p) {
  if (use_wgmma(p)) return prefill_wgmma_ctas_per_sm(p);
  int n = 1;
  dispatch_cuda_kv(p.storage, p.quant, [&](auto fmt) {
    dispatch_prefill_hd(p.head_dim, [&](auto hd) {
      using Fmt = decltype(fmt);
      constexpr int HD = decltype(hd)::value;
      n = occupancy<attn_prefill_kernel<Fmt, HD>>(PrefillSmem<Fmt, HD>::total, kPrefillWarps * 32);
    });
  });
  return n;
}

void launch_prefill(const RowsArgs& a, cudaStream_t st) {
  if (use_wgmma(a.p)) {
    launch_prefill_wgmma(a, st);
  } else {
    dispatch_cuda_kv(a.p.storage, a.p.quant, [&](auto fmt) {
      using Fmt = decltype(fmt);
      dispatch_prefill_hd(a.p.head_dim, [&](auto hd) {
        constexpr int HD = decltype(hd)::value;
        occupancy<attn_prefill_kernel<Fmt, HD>>(PrefillSmem<Fmt, HD>::total, kPrefillWarps * 32);  // the smem opt-in, once
        attn_prefill_kernel<Fmt, HD><<<prefill_grid(a), kPrefillWarps * 32, PrefillSmem<Fmt, HD>::total, st>>>(a);
      });
    });
  }
  cuda_check(cudaGetLastError(), "paged_attention prefill launch");
}

}  // namespace kvlm::cuda

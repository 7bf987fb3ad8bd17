// End-to-end decode benchmark of the CUDA model runner, through the ModelRunner interface
// the engines use (ForwardBatch in, fp32 logits on the host out).
//
//   decode_bench --model DIR [--kv bfloat16,fp8,int4_per_token_head/none,int4_per_token_head@4:64,k=int8_per_token_head;v=int4_per_token_head,plan:FILE]
//                [--shapes 1x512,64x4096]
//                [--steps 32] [--gemv-lab] [--int-lab] [--kernels]
//                [--no-gemv] [--dequantize-weights] [--no-pdl] [--quantization fp8] [--fp8-weights auto|keep|dequantize]
//                [--fp8-tc-no-carveout] [--fp8-fma-max-m M] [--no-fp8-gemm] [--no-fp8-small-gemm]
//                [--no-fp8-norm-codes] [--int-dp4a-max-m 0-4] [--int-dp4a-pipeline] [--draft DIR [--spec-tokens K]] [--tp N] [--enable-expert-parallel]
//
// --quantization fp8 loads the model with its linear weights quantized to FP8 at load (per
// output channel), as `kvlm --quantization fp8` does; --fp8-weights keep holds them as FP8 on
// the GPU (the FP8 GEMV; auto, the default, dequantizes weights that fit in half of the GPU),
// and the weights-read bound counts the bytes actually held. --fp8-tc-no-carveout launches the
// FP8 tensor-core GEMV without asking for the largest shared-memory carve-out, --fp8-fma-max-m M
// runs FP8 GEMMs of up to M rows on the FMA kernels instead, --no-fp8-gemm dequantizes FP8
// weights for the 16-bit GEMM above m = 16 (weight-only), --no-fp8-small-gemm runs cuBLASLt's
// FP8 GEMM instead of kvlm's at m = 17-64, --no-fp8-norm-codes has the FP8 GEMMs quantize their
// input themselves instead of the RMSNorm before them, --int-dp4a-max-m M runs grouped codes at
// up to M rows on gemv_int_dp4a (0: the tensor-core GEMV), --int-dp4a-pipeline has its warps load
// their next task's codes during their current one (off by default until measured)
// (KernelSwitches; all for comparison).
// --gemv-lab first times the decode GEMM shapes alone (no model needed): each small-m kernel
// and cuBLASLt at m = 1, 2, 4, 8 and 16, then cuBLASLt at m = 32, 64 and 256 (batched decode);
// then gemv_fp8's kernels (FMA rows / split at m = 1 and 4, tensor cores at m = 1-16, per-row
// and 128-block scales) and dequantize_fp8, and the tensor-core kernel's CTA shapes; last the
// W8A8 path of m = 32, 64 and 256 (per-token quantization, cuBLASLt's FP8 GEMM and kvlm's
// gemm_fp8_small, alone and together).
//
// --kernels runs each shape's GPU-greedy graph run once more under CUPTI (kernel_timeline.h)
// and prints the step's kernels: by name, then in order (the first kernels, one layer averaged
// over the layers, the last ones), each with its time start to end and its exclusive time (what
// it added to the step past the kernels before it). With --tp every GPU's kernels are mixed.
//
// For each KV dtype the model is loaded once; for each shape (batch x context) the pool is
// sized for it and every sequence decodes `steps` tokens after 3 warm-up steps, starting at
// position `context` (the context's pages are the pool's zeroed pages, not a prefill: the
// bytes a decode step reads are the same, and a 64 x 4k prefill would cost more than the
// whole benchmark). Each step is timed two ways: forward() with every row's fp32 logits
// copied to the host (the ModelRunner interface, host sampling), and forward_greedy() (the
// same step, argmax on the GPU, only token ids cross), each with CUDA graphs off and on.
// --no-gemv routes the batch 1-8 GEMMs (the small-m kernels' share) to cuBLASLt, --no-pdl
// launches without programmatic dependent launch (both for comparison).
//
// --draft DIR [--spec-tokens K, default 15] (a DFlash drafter for the model; tools/make_random_model.py --shape
// qwen3-8b-dflash writes one) measures instead what a drafting step costs against a plain
// decode step, GPU greedy with CUDA graphs, per KV dtype and shape: the plain step with the
// model loaded alone; then, with the drafter loaded, one drafter forward over every
// sequence's block [last token, mask x (B - 1)] (argmax of K rows) followed by the target's
// verification of those K + 1 tokens (which also runs the drafter's context pass). The cost
// is (draft + verify) / plain; a drafting step yields tau tokens where a plain step yields
// one, so the predicted speedup at mean acceptance length tau is tau / cost.
//
// --tp N runs the model tensor-parallel over GPUs 0..N-1 (model/tensor_parallel.h; with
// --enable-expert-parallel a mixture of experts puts whole experts on each GPU): the floors
// are one GPU's (rank 0's weights, its share of the KV), and after each shape's GPU-greedy
// graph run the all-reduces of a step are timed alone (2 per layer, [batch][hidden], as one
// CUDA graph on every rank at once) to give their share of the step.
//
// Floors, from the same run's device-to-device copy bandwidth (read + write bytes / time):
//   weights-read bound: every weight but the embedding table (a decode step reads B rows of
//   it) is read once per step, and of a mixture of experts the experts B rows choose (their
//   expectation under uniform routing); tokens/s bound at batch B = B / (bytes / bandwidth).
//   step floor: weights read + the KV bytes the step's attention reads.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <sstream>
#include <tuple>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "kv/kv_plan_file.h"
#include "model/loaded_model.h"
#include "model/cuda/cuda_runner.h"
#include "model/tp_runner.h"
#include "io/grouped_codes.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "kernel_timeline.h"

using namespace kvlm;
using kvlm::bench::KernelTimeline;

namespace {

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(std::string(what) + ": " + cudaGetErrorString(e));
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string t; std::getline(ss, t, ',');)
    if (!t.empty()) out.push_back(t);
  return out;
}

double copy_bandwidth() {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  ck(cudaMalloc(&a, bytes), "cudaMalloc");
  ck(cudaMalloc(&b, bytes), "cudaMalloc");
  ck(cudaMemset(a, 1, bytes), "cudaMemset");
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "event");
  ck(cudaEventCreate(&e1), "event");
  std::vector<float> t;
  for (int i = 0; i < 13; ++i) {
    ck(cudaEventRecord(e0), "record");
    ck(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice), "copy");
    ck(cudaEventRecord(e1), "record");
    ck(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    if (i >= 3) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (double(t[t.size() / 2]) * 1e-3);
}

struct Result {
  double ms = 0, tok_s = 0;
};

// Decodes `steps` tokens for `batch` sequences of `context` cached tokens; returns ms/step.
// `r` is one GPU's runner or a tensor-parallel group (then GPU greedy goes through
// forward_sampled at temperature 0: rank 0 samples on its GPU).
// `tl` (--kernels): each timed step is marked on it.
Result run(ModelRunner& r, int batch, int context, int steps, bool host_logits, int bs, bool exact = false,
           KernelTimeline* tl = nullptr) {
  const int warm = 3, V = r.config().vocab_size;
  const int per_seq = (context + warm + steps + 1 + bs - 1) / bs;
  std::vector<std::vector<BlockId>> tables(static_cast<size_t>(batch));
  for (int s = 0; s < batch; ++s)
    for (int i = 0; i < per_seq; ++i) tables[size_t(s)].push_back(BlockId(s * per_seq + i));
  std::mt19937 rng(1);
  std::vector<TokenId> tokens(static_cast<size_t>(batch));
  std::vector<Position> pos(static_cast<size_t>(batch));
  std::vector<SlotId> slots(static_cast<size_t>(batch));
  std::vector<AttnSeq> seqs(static_cast<size_t>(batch));
  std::vector<int32_t> rows;
  for (int i = 0; i < batch; ++i) rows.push_back(i);
  std::vector<float> out(host_logits ? rows.size() * size_t(V) : 0);
  std::vector<TokenId> ids(rows.size());
  std::vector<RowSampling> greedy(rows.size(), RowSampling{.on_device = true});
  for (auto& g : greedy) g.params.temperature = 0;
  auto step = [&](int i) {
    const int p = context + i;
    for (int s = 0; s < batch; ++s) {
      tokens[size_t(s)] = TokenId(std::uniform_int_distribution<int>(0, V - 1)(rng));
      pos[size_t(s)] = p;
      slots[size_t(s)] = SlotId(tables[size_t(s)][size_t(p / bs)]) * bs + p % bs;
      seqs[size_t(s)] = {.q_begin = s, .q_len = 1, .kv_len = p + 1, .block_table = tables[size_t(s)]};
      if (r.config().linear_attention) seqs[size_t(s)].state_slot = s;  // a hybrid's Gated DeltaNet state
      if (exact) seqs[size_t(s)].exact_table = tables[size_t(s)];  // every page has its exact page, same id
    }
    const ForwardBatch fb{.tokens = tokens, .positions = pos, .slots = slots,
                          .exact_slots = exact ? std::span<const SlotId>(slots) : std::span<const SlotId>{}, .seqs = seqs,
                          .logit_rows = rows};
    if (host_logits) r.forward(fb, out);
    else if (auto* c = dynamic_cast<CudaModelRunner*>(&r)) c->forward_greedy(fb, ids);
    else r.forward_sampled(fb, greedy, ids, {}, {});
  };
  for (int i = 0; i < warm; ++i) step(i);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    if (tl) tl->mark();
    step(warm + i);
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
  return {ms, batch * 1000.0 / ms};
}

// Times of one drafting step's parts, ms (spec_step).
struct SpecResult {
  double draft_ms = 0, verify_ms = 0;
};

// `steps` drafting steps for `batch` sequences of `context` cached tokens, drafting K tokens
// from blocks of `block`: the drafter's greedy proposals are verified as they come (random
// weights: the tokens do not matter to the time). Each step advances one position.
SpecResult run_spec(CudaModelRunner& r, int batch, int context, int steps, int bs, int block, int K) {
  const int warm = 3, V = r.config().vocab_size;
  const int per_seq = (context + warm + steps + block + 1 + bs - 1) / bs;
  std::vector<std::vector<BlockId>> tables(static_cast<size_t>(batch));
  for (int s = 0; s < batch; ++s)
    for (int i = 0; i < per_seq; ++i) tables[size_t(s)].push_back(BlockId(s * per_seq + i));
  std::mt19937 rng(1);
  const TokenId mask = TokenId(r.config().vocab_size - 1);
  std::vector<TokenId> last(static_cast<size_t>(batch)), drafted(size_t(batch) * size_t(K)), verified;
  for (auto& t : last) t = TokenId(std::uniform_int_distribution<int>(0, V - 1)(rng));
  std::vector<TokenId> tokens;
  std::vector<Position> pos;
  std::vector<SlotId> slots;
  std::vector<AttnSeq> seqs;
  std::vector<int32_t> rows;
  auto slot = [&](int s, int p) { return SlotId(tables[size_t(s)][size_t(p / bs)]) * bs + p % bs; };
  auto pass = [&](int p, int q_len, bool block_pass) {
    tokens.clear(), pos.clear(), slots.clear(), seqs.clear(), rows.clear();
    for (int s = 0; s < batch; ++s) {
      const int q0 = int(tokens.size());
      for (int j = 0; j < q_len; ++j) {
        tokens.push_back(j == 0 ? last[size_t(s)] : block_pass ? mask : drafted[size_t(s) * size_t(K) + size_t(j - 1)]);
        pos.push_back(p + j);
        slots.push_back(slot(s, p + j));
        if (!block_pass || (j >= 1 && j <= K)) rows.push_back(q0 + j);
      }
      seqs.push_back({.q_begin = q0, .q_len = q_len, .kv_len = p + q_len, .block_table = tables[size_t(s)]});
    }
    return ForwardBatch{.tokens = tokens, .positions = pos, .slots = slots, .seqs = seqs, .logit_rows = rows};
  };
  SpecResult res;
  for (int i = 0; i < warm + steps; ++i) {
    const int p = context + i;
    const auto t0 = std::chrono::steady_clock::now();
    r.draft_greedy(pass(p, block, true), drafted);
    const auto t1 = std::chrono::steady_clock::now();
    verified.resize(size_t(batch) * size_t(K + 1));
    r.forward_greedy(pass(p, K + 1, false), verified);
    const auto t2 = std::chrono::steady_clock::now();
    for (int s = 0; s < batch; ++s) last[size_t(s)] = verified[size_t(s) * size_t(K + 1)];
    if (i >= warm) {
      res.draft_ms += std::chrono::duration<double, std::milli>(t1 - t0).count() / steps;
      res.verify_ms += std::chrono::duration<double, std::milli>(t2 - t1).count() / steps;
    }
  }
  return res;
}

// The decode GEMM shapes of Qwen3-8B: at m = 1-16 each small-m kernel that takes m and cuBLASLt,
// at m = 32, 64 and 256 (batched decode) cuBLASLt, timed with CUDA events over copies of w that
// together exceed the L2 (each call reads HBM).
// int_only (--int-lab): the grouped-code table alone.
void gemv_lab(double bw, bool int_only) {
  struct Shape {
    const char* name;
    int n, k;
    bool f32;
  };
  const Shape shapes[] = {{"qkv", 6144, 4096, false},     {"o", 4096, 4096, false},
                          {"gate_up", 24576, 4096, false}, {"down", 4096, 12288, false},
                          {"lm_head", 151936, 4096, true}};
  cuda::Gemm gemm;
  void* ws = nullptr;
  ck(cudaMalloc(&ws, cuda::kGemmWorkspaceBytes), "cudaMalloc");
  gemm.set_workspace(ws, cuda::kGemmWorkspaceBytes);
  cudaEvent_t e0, e1;
  ck(cudaEventCreate(&e0), "event");
  ck(cudaEventCreate(&e1), "event");
  // The operands of one (m, shape): enough copies of w (filled with a finite bf16) that a call
  // never finds its w in the L2; `time_us(call)` is the mean of 30 calls after 3 (the first
  // call of a cuBLASLt shape chooses its algorithm), call(i) using copy i % copies.
  struct Operands {
    size_t wbytes;
    int copies;
    std::vector<void*> w;
    void *x = nullptr, *y = nullptr;
    Operands(const Operands&) = delete;
    Operands& operator=(const Operands&) = delete;
    Operands(int m, const Shape& sh) : wbytes(size_t(sh.n) * size_t(sh.k) * 2) {
      copies = int(std::max<size_t>(2, (size_t(200) << 20) / wbytes + 1));
      w.resize(size_t(copies));
      for (auto& p : w) {
        ck(cudaMalloc(&p, wbytes), "cudaMalloc");
        ck(cudaMemset(p, 0x3c, wbytes), "cudaMemset");  // bf16 0x3c3c: a finite value
      }
      ck(cudaMalloc(&x, size_t(m) * sh.k * 2), "cudaMalloc");
      ck(cudaMemset(x, 0x3c, size_t(m) * sh.k * 2), "cudaMemset");
      ck(cudaMalloc(&y, size_t(m) * sh.n * 4), "cudaMalloc");
    }
    ~Operands() {
      for (auto p : w) cudaFree(p);
      cudaFree(x);
      cudaFree(y);
    }
    void* wi(int i) const { return w[size_t(i % copies)]; }
    double gbs(double us) const { return double(wbytes) / (us * 1e-6) / 1e9; }
  };
  auto time_us = [&](auto&& call) {
    for (int i = 0; i < 3; ++i) call(i);
    const int reps = 30;
    ck(cudaEventRecord(e0), "record");
    for (int i = 0; i < reps; ++i) call(i);
    ck(cudaEventRecord(e1), "record");
    ck(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    ck(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
    return 1e3 * ms / reps;
  };
  // Copies of one random FP8 weight of nk codes (no NaN) totalling > 200 MB, so that every call
  // reads HBM; and device buffers of `count` floats set to v (the scales).
  auto fp8_copies = [&](size_t nk) {
    std::vector<void*> copies(std::max<size_t>(2, (size_t(200) << 20) / nk + 1));
    std::vector<uint8_t> host(nk);
    std::mt19937 rng(5);
    for (auto& c : host) {
      do c = uint8_t(rng());
      while ((c & 0x7f) == 0x7f);
    }
    for (auto& p : copies) {
      ck(cudaMalloc(&p, nk), "cudaMalloc");
      ck(cudaMemcpy(p, host.data(), nk, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
    return copies;
  };
  auto device_floats = [&](size_t count, float v) {
    void* p = nullptr;
    const std::vector<float> h(count, v);
    ck(cudaMalloc(&p, count * 4), "cudaMalloc");
    ck(cudaMemcpy(p, h.data(), count * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    return p;
  };
  if (!int_only) {
    std::printf("\n# small-m GEMMs (bf16, Qwen3-8B shapes): µs per call and GB/s of weights read; copy bandwidth %.0f GB/s\n",
                bw / 1e9);
    std::printf("| m | matrix | n x k | MB | rows kernel µs | GB/s | split kernel µs | GB/s | mma kernel µs | GB/s | "
                "cuBLASLt µs | GB/s |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int m : {1, 2, 4, 8, 16}) {
      for (const Shape& sh : shapes) {
        const Operands o(m, sh);
        const DType out = sh.f32 ? DType::F32 : DType::BF16;
        std::string cells;
        for (int v = 1; v <= 4; ++v) {  // gemv_small_m variants 1-3, then cuBLASLt
          if ((v <= 2 && m > cuda::kGemvMaxM) || (v == 3 && m > cuda::kGemvMmaMaxM)) {
            cells += " | - | -";
            continue;
          }
          const double us = time_us([&](int i) {
            if (v <= 3) {
              cuda::gemv_small_m(DType::BF16, out, o.x, o.wi(i), nullptr, o.y, m, sh.n, sh.k, nullptr, v);
            } else {
              gemm.set_small_m_kernel(false);
              gemm.linear(DType::BF16, out, o.x, o.wi(i), nullptr, o.y, m, sh.n, sh.k, nullptr);
            }
          });
          char buf[64];
          std::snprintf(buf, sizeof buf, " | %.1f | %.0f", us, o.gbs(us));
          cells += buf;
        }
        std::printf("| %d | %s | %d x %d | %.0f%s |\n", m, sh.name, sh.n, sh.k, double(o.wbytes) / 1e6, cells.c_str());
        std::fflush(stdout);
      }
    }
    // FP8 weights (gemm.h Fp8Weight): gemv_fp8's FMA kernel (variant 1, 4 rows of x per pass) and
    // tensor-core kernel (variant 2, one pass for m <= 16) read one byte per weight; dequantize_fp8
    // (the path to the GEMM at larger m) reads one and writes two. Random codes (no NaN), one scale
    // per row ("row") or per 128-column block ("b128").
    std::printf("\n# FP8 weights (Qwen3-8B shapes): gemv_fp8 µs and GB/s of FP8 weights read (rows / split: the FMA "
                "kernels, tc: the tensor-core kernel); dequantize_fp8 µs and GB/s (read + write)\n");
    const int fp8_cols[][2] = {{1, 1}, {1, 3}, {1, 2}, {2, 1}, {2, 3}, {2, 2}, {4, 1}, {4, 3}, {4, 2}, {8, 2}, {16, 2}};  // (m, variant)
    std::string sweep;  // the tensor-core kernel's CTA shapes, printed after the table
    std::printf("| matrix | scales | n x k | FP8 MB |");
    for (const auto& c : fp8_cols) std::printf(" m=%d %s µs | GB/s |", c[0], c[1] == 1 ? "rows" : c[1] == 3 ? "split" : "tc");
    std::printf(" dequantize µs | GB/s |\n|---|---|---|---|");
    for (size_t i = 0; i < std::size(fp8_cols); ++i) std::printf("---|---|");
    std::printf("---|---|\n");
    for (const Shape& sh : shapes) {
      const size_t nk = size_t(sh.n) * size_t(sh.k);
      const std::vector<void*> codes = fp8_copies(nk);
      const int copies = int(codes.size());
      const int nb128 = (sh.k + 127) / 128;
      void* const scales = device_floats(size_t(sh.n) * size_t(nb128), 1e-3f);
      void *x = nullptr, *y = nullptr, *deq = nullptr;
      ck(cudaMalloc(&x, size_t(16) * sh.k * 2), "cudaMalloc");
      ck(cudaMemset(x, 0x3c, size_t(16) * sh.k * 2), "cudaMemset");
      ck(cudaMalloc(&y, size_t(16) * sh.n * 4), "cudaMalloc");
      ck(cudaMalloc(&deq, nk * 2), "cudaMalloc");
      {  // the tensor-core kernel's CTA shape: 16-row tiles per CTA x CTAs per cluster (row scales)
        const cuda::KernelSwitches saved = cuda::kernel_switches();
        auto wf = [&](int i) {
          return cuda::Fp8Weight{.codes = static_cast<const uint8_t*>(codes[size_t(i % copies)]),
                                 .scales = static_cast<const float*>(scales), .scale_block = sh.k};
        };
        const DType out = sh.f32 ? DType::F32 : DType::BF16;
        for (int m : {1, 8, 16})
          for (int tiles : {4, 2, 1}) {
            std::string cells;
            for (int splits : {0, 1, 2, 4, 8, -1}) {  // -1: automatic, without PDL
              cuda::KernelSwitches sw = saved;
              sw.fp8_tc_tiles = tiles;
              sw.fp8_tc_splits = std::max(splits, 0);
              if (splits < 0) sw.pdl = false;
              cuda::set_kernel_switches(sw);
              const double us = time_us(
                  [&](int i) { cuda::gemv_fp8(DType::BF16, out, x, wf(i), nullptr, y, m, sh.n, sh.k, nullptr, 2); });
              char buf[64];
              std::snprintf(buf, sizeof buf, " %.1f |", us);
              if (splits == 0 && m == 1) sweep += "<!-- " + std::string(sh.name) + " tiles " + std::to_string(tiles) + " auto: " + cuda::gemv_fp8_last_launch() + " -->\n";
              cells += buf;
            }
            cuda::set_kernel_switches(saved);
            char head[96];
            std::snprintf(head, sizeof head, "| %s | %d | %d |", sh.name, m, tiles);
            sweep += head + cells + "\n";
          }
      }
      for (int block : {sh.k, 128}) {
        auto wf = [&](int i) {
          return cuda::Fp8Weight{.codes = static_cast<const uint8_t*>(codes[size_t(i % copies)]),
                                 .scales = static_cast<const float*>(scales), .scale_block = block};
        };
        const DType out = sh.f32 ? DType::F32 : DType::BF16;
        std::string cells;
        for (const auto& c : fp8_cols) {
          const double us = time_us(
              [&](int i) { cuda::gemv_fp8(DType::BF16, out, x, wf(i), nullptr, y, c[0], sh.n, sh.k, nullptr, c[1]); });
          char buf[64];
          std::snprintf(buf, sizeof buf, " | %.1f | %.0f", us, double(nk) / (us * 1e-6) / 1e9);
          cells += buf;
        }
        const double dus = time_us([&](int i) { cuda::dequantize_fp8(DType::BF16, wf(i), deq, sh.n, sh.k, nullptr); });
        std::printf("| %s | %s | %d x %d | %.0f%s | %.1f | %.0f |\n", sh.name, block == sh.k ? "row" : "b128", sh.n, sh.k,
                    double(nk) / 1e6, cells.c_str(), dus, 3.0 * double(nk) / (dus * 1e-6) / 1e9);
        std::fflush(stdout);
      }
      for (auto p : codes) cudaFree(p);
      cudaFree(scales);
      cudaFree(x);
      cudaFree(y);
      cudaFree(deq);
    }
    std::printf("\n# FP8 tensor-core kernel (row scales): µs by 16-row tiles per CTA and CTAs per cluster (auto: the "
                "launcher's choice)\n| matrix | m | tiles | auto | 1 | 2 | 4 | 8 | auto, no PDL |\n|---|---|---|---|---|---|---|---|---|\n%s",
                sweep.c_str());
  }  // !int_only
  // Grouped integer codes (gemm.h IntWeight): gemv_int reads bits / 8 bytes per weight plus 4
  // bytes of (scale, offset) per group; dequantize_int (the path to the GEMM above m = 16) reads
  // those and writes 2 bytes per weight. Random codes, parameters (1e-3, -8e-3).
  std::printf("\n# Grouped integer codes (Qwen3-8B shapes): gemv_int µs and GB/s of codes and parameters read; "
              "dequantize_int µs and GB/s (read + write)\n| matrix | layout | n x k | MB |");
  const int int_ms[] = {1, 2, 4, 8, 16};
  for (int m : int_ms) std::printf(" m=%d µs | GB/s |", m);
  // m = 1-4 run gemv_int_dp4a where it takes the layout and pays (gemv_int_dp4a_pays); beside
  // them the same m forced onto gemv_int_dp4a (KernelSwitches::int_dp4a_by_shape off) and onto
  // the tensor-core GEMV (int_dp4a_max_m = 0).
  const int tc_ms[] = {1, 2, 4};
  for (int m : tc_ms) std::printf(" m=%d DP4A µs |", m);
  for (int m : tc_ms) std::printf(" m=%d tensor cores µs |", m);
  std::printf(" dequantize µs | GB/s |\n|---|---|---|---|");
  for (size_t i = 0; i < std::size(int_ms); ++i) std::printf("---|---|");
  for (size_t i = 0; i < 2 * std::size(tc_ms); ++i) std::printf("---|");
  std::printf("---|---|\n");
  std::vector<Shape> int_shapes(std::begin(shapes), std::end(shapes));
  int_shapes.push_back({"long k", 8192, 16384, false});  // 4x the rounds per warp of the 4096-column ones
  for (const Shape& sh : int_shapes)
    for (const auto& lay : {std::tuple{4, 32, true, false}, std::tuple{4, 32, true, true}, std::tuple{4, 128, true, false},
                            std::tuple{4, 128, false, false}, std::tuple{8, 32, true, false},
                            std::tuple{8, 16, true, false}}) {
      // sam: bf16 4-bit codes in groups of 128 scale after the MMA; false: the per-weight decode.
      // e2m1: MXFP4's E2M1 codes (before them, MXFP4 took the 8-bit groups of 32)
      const auto [bits, group, sam, e2m1] = lay;
      auto sw = cuda::kernel_switches();
      sw.int_scale_after_mma = sam;
      cuda::set_kernel_switches(sw);
      const size_t cb = size_t(sh.n) * size_t(sh.k) * size_t(bits) / 8, pb = size_t(sh.n) * size_t(sh.k / group) * 4;
      const size_t bytes = cb + pb;
      std::vector<void*> copies(std::max<size_t>(2, (size_t(200) << 20) / bytes + 1));
      {
        std::vector<uint8_t> host(bytes);
        std::mt19937 rng(9);
        for (size_t i = 0; i < cb; ++i) host[i] = uint8_t(rng());
        const uint32_t p = e2m1 ? grouped_param_e2m1(DType::BF16, 0x1p-7f)
                                : uint32_t(num::f32_to_bf16(1e-3f)) | uint32_t(num::f32_to_bf16(-8e-3f)) << 16;
        for (size_t i = cb; i + 4 <= bytes; i += 4) std::memcpy(host.data() + i, &p, 4);
        for (auto& c : copies) {
          ck(cudaMalloc(&c, bytes), "cudaMalloc");
          ck(cudaMemcpy(c, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        }
      }
      void *x = nullptr, *y = nullptr, *deq = nullptr;
      ck(cudaMalloc(&x, size_t(16) * sh.k * 2), "cudaMalloc");
      ck(cudaMemset(x, 0x3c, size_t(16) * sh.k * 2), "cudaMemset");
      ck(cudaMalloc(&y, size_t(16) * sh.n * 4), "cudaMalloc");
      ck(cudaMalloc(&deq, size_t(sh.n) * sh.k * 2), "cudaMalloc");
      auto wi = [&](int i) {
        const auto* base = static_cast<const uint8_t*>(copies[size_t(i) % copies.size()]);
        return cuda::IntWeight{.codes = base, .params = reinterpret_cast<const uint32_t*>(base + cb), .bits = bits,
                               .group = group, .e2m1 = e2m1};
      };
      const DType out = sh.f32 ? DType::F32 : DType::BF16;
      std::string cells;
      for (int m : int_ms) {
        const double us =
            time_us([&](int i) { cuda::gemv_int(DType::BF16, out, x, wi(i), nullptr, y, sh.n, m, sh.n, sh.k, nullptr); });
        char buf[64];
        std::snprintf(buf, sizeof buf, " | %.1f | %.0f", us, double(bytes) / (us * 1e-6) / 1e9);
        cells += buf;
      }
      for (const bool dp4a : {true, false}) {
        auto forced = cuda::kernel_switches();
        const auto saved = forced;
        if (dp4a) forced.int_dp4a_by_shape = false;
        else forced.int_dp4a_max_m = 0;
        cuda::set_kernel_switches(forced);
        for (int m : tc_ms) {
          const double us =
              time_us([&](int i) { cuda::gemv_int(DType::BF16, out, x, wi(i), nullptr, y, sh.n, m, sh.n, sh.k, nullptr); });
          char buf[32];
          std::snprintf(buf, sizeof buf, " | %.1f", us);
          cells += buf;
        }
        cuda::set_kernel_switches(saved);
      }
      const double dus = time_us([&](int i) { cuda::dequantize_int(DType::BF16, wi(i), deq, sh.n, sh.k, nullptr); });
      std::printf("| %s | %s, groups of %d%s | %d x %d | %.0f%s | %.1f | %.0f |\n", sh.name,
                  e2m1 ? "E2M1 (MXFP4)" : bits == 4 ? "4-bit" : "8-bit", group, sam || e2m1 ? "" : " (decode per weight)", sh.n, sh.k, double(bytes) / 1e6, cells.c_str(), dus,
                  (double(bytes) + 2.0 * sh.n * sh.k) / (dus * 1e-6) / 1e9);
      std::fflush(stdout);
      for (auto c : copies) cudaFree(c);
      cudaFree(x);
      cudaFree(y);
      cudaFree(deq);
      sw.int_scale_after_mma = true;
      cuda::set_kernel_switches(sw);
    }
  // Decode batches of grouped codes (m = 17-64, and 128 / 256 in passes of 64): gemm_int's two
  // tiles against the paths it replaces (gemv_int in passes of 16; dequantize_int + the 16-bit
  // GEMM) and against cuBLASLt on a bf16 weight of the same shape (what --dequantize-weights
  // runs). GB/s: codes and parameters read by the best kept-codes path.
  std::printf("\n# Grouped codes at decode batches: µs per call; kept/bf16 = bf16 cuBLASLt µs / best kept-codes µs\n"
              "| matrix | layout | m | gemm_int 128 rows | gemm_int 256 rows | gemv_int passes | dequantize + GEMM | "
              "bf16 cuBLASLt | best kept GB/s | kept/bf16 |\n|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Shape& sh : shapes)
    for (const auto& lay : {std::tuple{4, 32, false}, std::tuple{4, 128, true}, std::tuple{8, 16, false}}) {
      const auto [bits, group, zp] = lay;
      const size_t cb = size_t(sh.n) * size_t(sh.k) * size_t(bits) / 8, pb = size_t(sh.n) * size_t(sh.k / group) * 4;
      const size_t bytes = cb + pb;
      std::vector<void*> copies(std::max<size_t>(2, (size_t(200) << 20) / bytes + 1));
      {
        std::vector<uint8_t> host(bytes);
        std::mt19937 rng(9);
        for (size_t i = 0; i < cb; ++i) host[i] = uint8_t(rng());
        const uint32_t p = zp ? grouped_param_zero_point(DType::BF16, 1e-3f, 8) : grouped_param(DType::BF16, 1e-3f, -8e-3f);
        for (size_t i = cb; i + 4 <= bytes; i += 4) std::memcpy(host.data() + i, &p, 4);
        for (auto& c : copies) {
          ck(cudaMalloc(&c, bytes), "cudaMalloc");
          ck(cudaMemcpy(c, host.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
        }
      }
      auto wi = [&](int i) {
        const auto* base = static_cast<const uint8_t*>(copies[size_t(i) % copies.size()]);
        return cuda::IntWeight{.codes = base, .params = reinterpret_cast<const uint32_t*>(base + cb), .bits = bits,
                               .group = group, .zero_point = zp};
      };
      const DType out = sh.f32 ? DType::F32 : DType::BF16;
      const size_t ob = sh.f32 ? 4 : 2;
      for (int m : {17, 32, 64, 128, 256}) {
        const Operands o(m, sh);  // x, y and the bf16 weights
        void* deq = nullptr;
        ck(cudaMalloc(&deq, size_t(sh.n) * sh.k * 2), "cudaMalloc");
        auto passes = [&](int i, int per, auto&& one) {
          for (int r0 = 0; r0 < m; r0 += per)
            one(static_cast<const uint8_t*>(o.x) + size_t(r0) * sh.k * 2,
                static_cast<uint8_t*>(o.y) + size_t(r0) * sh.n * ob, std::min(per, m - r0), i);
        };
        double cell[5] = {-1, -1, -1, -1, -1};
        for (int tile : {128, 256})
          if (cuda::gemm_int_available(tile))
            cell[tile / 128 - 1] = time_us([&](int i) {
              passes(i, cuda::kGemmIntMaxM, [&](const void* x, void* y, int mm, int ii) {
                cuda::gemm_int(DType::BF16, out, x, wi(ii), nullptr, y, sh.n, mm, sh.n, sh.k, nullptr, tile);
              });
            });
        if (m <= 64)
          cell[2] = time_us([&](int i) {
            passes(i, cuda::kGemvIntMaxM, [&](const void* x, void* y, int mm, int ii) {
              cuda::gemv_int(DType::BF16, out, x, wi(ii), nullptr, y, sh.n, mm, sh.n, sh.k, nullptr);
            });
          });
        gemm.set_small_m_kernel(false);
        cell[3] = time_us([&](int i) {
          cuda::dequantize_int(DType::BF16, wi(i), deq, sh.n, sh.k, nullptr);
          gemm.linear(DType::BF16, out, o.x, deq, nullptr, o.y, m, sh.n, sh.k, nullptr);
        });
        cell[4] = time_us([&](int i) { gemm.linear(DType::BF16, out, o.x, o.wi(i), nullptr, o.y, m, sh.n, sh.k, nullptr); });
        gemm.set_small_m_kernel(true);
        double best = 1e30;
        for (int c = 0; c < 4; ++c)
          if (cell[c] > 0) best = std::min(best, cell[c]);
        std::string cells;
        for (double c : cell) {
          char buf[32];
          std::snprintf(buf, sizeof buf, c > 0 ? " %.1f |" : " - |", c);
          cells += buf;
        }
        std::printf("| %s | %d-bit g%d%s | %d |%s %.0f | %.2fx |\n", sh.name, bits, group, zp ? " zp" : "", m,
                    cells.c_str(), double(bytes) / (best * 1e-6) / 1e9, cell[4] / best);
        std::fflush(stdout);
        cudaFree(deq);
      }
      for (auto c : copies) cudaFree(c);
    }
  if (!int_only) {
    // Batched decode from m = 17 runs cuBLASLt. At m <= 64 these GEMMs are bound by reading w
    // (2 * m FLOP per 2-byte weight: m FLOP per byte, against the ~150 an H200 sustains, ~650
    // dense bf16 TFLOP/s over ~4.2 TB/s), so % of copy is the figure of merit; from m ~ 150 they
    // are compute-bound and TFLOP/s is.
    std::printf("\n# batched GEMMs (bf16, cuBLASLt): µs per call, GB/s of weights, %% of copy bandwidth, TFLOP/s\n");
    std::printf("| m | matrix | n x k | MB | floor µs | cuBLASLt µs | GB/s | %% of copy | TFLOP/s |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    gemm.set_small_m_kernel(false);
    for (int m : {32, 64, 256}) {
      for (const Shape& sh : shapes) {
        const Operands o(m, sh);
        const DType out = sh.f32 ? DType::F32 : DType::BF16;
        const double us =
            time_us([&](int i) { gemm.linear(DType::BF16, out, o.x, o.wi(i), nullptr, o.y, m, sh.n, sh.k, nullptr); });
        std::printf("| %d | %s | %d x %d | %.0f | %.1f | %.1f | %.0f | %.0f%% | %.0f |\n", m, sh.name, sh.n, sh.k,
                    double(o.wbytes) / 1e6, double(o.wbytes) / bw * 1e6, us, o.gbs(us), 100.0 * o.gbs(us) * 1e9 / bw,
                    2.0 * m * sh.n * sh.k / (us * 1e-6) / 1e12);
        std::fflush(stdout);
      }
    }
    // Above m = 16 FP8 weights run W8A8: x quantized per token (per 128-value group for block
    // scales), then an FP8 tensor-core GEMM: kvlm's gemm_fp8_small up to m = 64, cuBLASLt's
    // (outer-vector or 128-block scaling) above. Each part timed alone, and the quantization with
    // the GEMM the engine runs at that m in sequence, as a decode step at batch m runs them.
    std::printf("\n# batched FP8 GEMMs (W8A8): µs per call; %% of copy on the FP8 weight bytes; 'both' = quantize + "
                "the GEMM the engine runs (kvlm's at m <= %d)\n", cuda::kGemmFp8SmallMaxM);
    std::printf("| m | matrix | FP8 MB | floor µs | row: quantize µs | cuBLASLt µs | kvlm µs | both µs | %% of copy | "
                "b128: quantize µs | cuBLASLt µs | kvlm µs | both µs | %% of copy |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& sh : shapes) {
      if (sh.f32) continue;  // the LM head stays 16-bit
      const size_t nk = size_t(sh.n) * size_t(sh.k);
      const std::vector<void*> codes = fp8_copies(nk);
      const int copies = int(codes.size()), nb = (sh.k + 127) / 128;
      void* const rs = device_floats(size_t(sh.n), 1e-3f);                       // one scale per row
      void* const bs = device_floats(size_t(sh.n) * size_t(nb), 1e-3f);          // block scales, one row per weight row
      void* const bsc = device_floats(size_t((sh.n + 127) / 128) * size_t(cuda::fp8_block_scale_ld(sh.k)), 1e-3f);  // ... once per 128 x 128 block
      void *x = nullptr, *xq = nullptr, *xs = nullptr, *y = nullptr;
      constexpr int kMaxM = 256;
      ck(cudaMalloc(&x, size_t(kMaxM) * sh.k * 2), "cudaMalloc");
      ck(cudaMemset(x, 0x3c, size_t(kMaxM) * sh.k * 2), "cudaMemset");
      ck(cudaMalloc(&xq, size_t(kMaxM) * sh.k), "cudaMalloc");
      ck(cudaMalloc(&xs, size_t(kMaxM) * nb * 4), "cudaMalloc");
      ck(cudaMalloc(&y, size_t(kMaxM) * sh.n * 2), "cudaMalloc");
      for (int m : {32, 64, 256}) {
        std::string cells;
        for (bool block : {false, true}) {
          auto wf = [&](int i) {
            return cuda::Fp8Weight{.codes = static_cast<const uint8_t*>(codes[size_t(i % copies)]),
                                   .scales = static_cast<const float*>(block ? bs : rs),
                                   .scale_block = block ? 128 : sh.k,
                                   .block_scales = block ? static_cast<const float*>(bsc) : nullptr};
          };
          auto quant = [&] {
            cuda::quantize_rows_fp8(DType::BF16, x, static_cast<uint8_t*>(xq), static_cast<float*>(xs), m, sh.k, nullptr,
                                    block ? 128 : 0);
          };
          bool ok = true;
          auto cublas = [&](int i) {
            ok = gemm.linear_fp8(DType::BF16, static_cast<const uint8_t*>(xq), static_cast<const float*>(xs), wf(i), nullptr,
                                 y, m, sh.n, sh.k, nullptr) && ok;
          };
          const bool small = cuda::gemm_fp8_small_available() && cuda::gemm_fp8_small_fits(m, sh.k, block ? 128 : sh.k);
          auto ours = [&](int i) {
            cuda::gemm_fp8_small(DType::BF16, static_cast<const uint8_t*>(xq), static_cast<const float*>(xs), wf(i),
                                 nullptr, y, m, sh.n, sh.k, nullptr);
          };
          const double q = time_us([&](int) { quant(); });
          const double g = time_us(cublas);
          const double o = small ? time_us(ours) : 0.0;
          const double both = time_us([&](int i) {
            quant();
            small ? ours(i) : cublas(i);
          });
          char qs[32], gs[32] = " - |", os[32] = " - |", bs_[64] = " - | - |";
          std::snprintf(qs, sizeof qs, " %.1f |", q);
          if (ok) std::snprintf(gs, sizeof gs, " %.1f |", g);
          if (small) std::snprintf(os, sizeof os, " %.1f |", o);
          if (ok || small) std::snprintf(bs_, sizeof bs_, " %.1f | %.0f%% |", both, 100.0 * double(nk) / bw / (both * 1e-6));
          cells += std::string(qs) + gs + os + bs_;
        }
        std::printf("| %d | %s | %.0f | %.1f |%s\n", m, sh.name, double(nk) / 1e6, double(nk) / bw * 1e6, cells.c_str());
        std::fflush(stdout);
      }
      for (auto p : codes) cudaFree(p);
      for (void* p : {rs, bs, bsc, x, xq, xs, y}) cudaFree(p);
    }
  }  // !int_only
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(ws);
}

// --draft: the cost of a drafting step in plain decode steps, per KV dtype and shape.
int spec_table(const std::string& model, const std::string& draft, int spec_tokens, const std::string& kvs,
               const std::string& shapes, int steps, bool gemv) {
  std::printf("| kv cache | batch | context | plain step ms | draft ms | verify ms (K+1 rows) | cost (x plain) | "
              "predicted speedup tau=3 | tau=5 | tau=6.5 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string& kv : split(kvs)) {
    ModelOptions o;
    o.model_dir = model;
    o.cache.kv_cache_dtype = parse_kv_cache_dtype(kv);
    o.device = Device::Cuda;
    std::vector<double> plain;
    {
      auto e = LoadedModel::load(o);
      auto& r = dynamic_cast<CudaModelRunner&>(e->model());
      r.set_small_m_gemv(gemv);
      for (const std::string& sh : split(shapes)) {
        const auto x = sh.find('x');
        const int batch = std::stoi(sh.substr(0, x)), context = std::stoi(sh.substr(x + 1)), bs = e->block_size();
        r.allocate_kv(batch * ((context + 3 + steps + 1 + bs - 1) / bs), bs);
        plain.push_back(run(r, batch, context, steps, false, bs).ms);
      }
    }
    o.speculative = parse_speculative_config(R"({"method":"dflash","model":")" + draft +
                                             R"(","num_speculative_tokens":)" + std::to_string(spec_tokens) + "}");
    auto e = LoadedModel::load(o);
    auto& r = dynamic_cast<CudaModelRunner&>(e->model());
    r.set_small_m_gemv(gemv);
    const int block = e->drafter_config()->dflash->block_size, K = o.speculative->num_speculative_tokens;
    std::fprintf(stderr, "drafter %s: %d layers, blocks of %d, K = %d\n", draft.c_str(), e->drafter_config()->num_layers,
                 block, K);
    size_t i = 0;
    for (const std::string& sh : split(shapes)) {
      const auto x = sh.find('x');
      const int batch = std::stoi(sh.substr(0, x)), context = std::stoi(sh.substr(x + 1)), bs = e->block_size();
      r.allocate_kv(batch * ((context + 3 + steps + block + 1 + bs - 1) / bs), bs);
      const SpecResult sr = run_spec(r, batch, context, steps, bs, block, K);
      const double cost = (sr.draft_ms + sr.verify_ms) / plain[i++];
      std::printf("| %s | %d | %d | %.3f | %.3f | %.3f | %.2f | %.2fx | %.2fx | %.2fx |\n", kv.c_str(), batch, context,
                  plain[i - 1], sr.draft_ms, sr.verify_ms, cost, 3.0 / cost, 5.0 / cost, 6.5 / cost);
      std::fflush(stdout);
    }
  }
  return 0;
}

// Every CUDA runner of `m`: itself, or each rank of a tensor-parallel group.
std::vector<CudaModelRunner*> cuda_ranks(ModelRunner& m) {
  if (auto* tp = dynamic_cast<TensorParallelRunner*>(&m)) {
    std::vector<CudaModelRunner*> out;
    for (int r = 0; r < tp->world_size(); ++r) out.push_back(&dynamic_cast<CudaModelRunner&>(tp->rank(r)));
    return out;
  }
  return {&dynamic_cast<CudaModelRunner&>(m)};
}

// ms per decode step that a tensor-parallel group spends in its all-reduces alone: the step's
// 2 x layers sums of [batch][hidden] in the compute dtype, on every rank at once, as one CUDA
// graph (as a decode step issues them).
double allreduce_ms(TensorParallelRunner& tp, int batch, int hidden, int layers, DType act) {
  std::vector<double> ms(static_cast<size_t>(tp.world_size()));
  tp.each_rank([&](int r, ModelRunner& m) {
    auto& c = dynamic_cast<CudaModelRunner&>(m);
    ck(cudaSetDevice(c.device_index()), "cudaSetDevice");
    const size_t n = size_t(batch) * size_t(hidden);
    void* buf = nullptr;
    ck(cudaMalloc(&buf, n * 2), "cudaMalloc");
    ck(cudaMemset(buf, 0, n * 2), "cudaMemset");
    cudaStream_t st = nullptr;
    ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
    Communicator& comm = tp.comm(r);
    comm.all_reduce_sum(buf, act, n, st);  // NCCL's first call sets up its channels
    ck(cudaStreamSynchronize(st), "sync");
    cudaGraph_t g = nullptr;
    ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed), "capture");
    for (int i = 0; i < 2 * layers; ++i) comm.all_reduce_sum(buf, act, n, st);
    ck(cudaStreamEndCapture(st, &g), "capture");
    cudaGraphExec_t ex = nullptr;
    ck(cudaGraphInstantiate(&ex, g, 0), "instantiate");
    for (int i = 0; i < 3; ++i) ck(cudaGraphLaunch(ex, st), "launch");
    ck(cudaStreamSynchronize(st), "sync");
    const int iters = 20;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) ck(cudaGraphLaunch(ex, st), "launch");
    ck(cudaStreamSynchronize(st), "sync");
    ms[size_t(r)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / iters;
    cudaGraphExecDestroy(ex);
    cudaGraphDestroy(g);
    cudaStreamDestroy(st);
    cudaFree(buf);
  });
  return *std::max_element(ms.begin(), ms.end());
}

}  // namespace

int main(int argc, char** argv) {
  std::string model, kvs = "bfloat16,fp8", shapes = "1x512,64x4096", draft, quantization;
  int steps = 32, spec_tokens = 15, tp = 1;
  bool expert_parallel = false;
  bool lab = false, int_lab = false, gemv = true, dequantize_weights = false, kernels = false;
  DType state_dtype = DType::F32;  // --mamba-ssm-cache-dtype (hybrid models)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--model") model = next();
    else if (a == "--kv") kvs = next();
    else if (a == "--shapes") shapes = next();
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--gemv-lab") lab = true;
    else if (a == "--int-lab") int_lab = true;
    else if (a == "--kernels") kernels = true;
    else if (a == "--draft") draft = next();
    else if (a == "--spec-tokens") spec_tokens = std::stoi(next());
    else if (a == "--no-gemv") gemv = false;
    else if (a == "--dequantize-weights") dequantize_weights = true;
    else if (a == "--mamba-ssm-cache-dtype") state_dtype = parse_linear_state_dtype(next(), a);
    else if (a == "--tp") tp = std::stoi(next());
    else if (a == "--enable-expert-parallel") expert_parallel = true;
    else if (a == "--fp8-fma-max-m") {
      auto sw = cuda::kernel_switches();
      sw.fp8_fma_max_m = std::stoi(next());
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--fp8-tc-no-carveout") {
      auto sw = cuda::kernel_switches();
      sw.fp8_tc_carveout = false;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--quantization") quantization = next();
    else if (a == "--fp8-weights") {
      const std::string v = next();
      auto sw = cuda::kernel_switches();
      sw.fp8_weights = v == "keep" ? cuda::KernelSwitches::Fp8Weights::Keep
                       : v == "dequantize" ? cuda::KernelSwitches::Fp8Weights::Dequantize
                                           : cuda::KernelSwitches::Fp8Weights::Auto;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--no-fp8-gemm") {
      auto sw = cuda::kernel_switches();
      sw.fp8_gemm = false;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--no-fp8-small-gemm") {
      auto sw = cuda::kernel_switches();
      sw.fp8_small_gemm = false;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--no-fp8-norm-codes") {
      auto sw = cuda::kernel_switches();
      sw.fp8_norm_codes = false;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--int-dp4a-max-m") {
      auto sw = cuda::kernel_switches();
      sw.int_dp4a_max_m = std::stoi(next());
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--int-dp4a-pipeline") {
      auto sw = cuda::kernel_switches();
      sw.int_dp4a_pipeline = true;
      cuda::set_kernel_switches(sw);
    }
    else if (a == "--no-pdl") {
      auto sw = cuda::kernel_switches();
      sw.pdl = false;
      cuda::set_kernel_switches(sw);
    }
    else {
      std::fprintf(stderr, "usage: decode_bench --model DIR [--kv bfloat16,fp8] [--shapes 1x512,64x4096] [--steps 32] "
                           "[--gemv-lab] [--int-lab] [--kernels] [--no-gemv] [--dequantize-weights] [--no-pdl] [--quantization fp8] [--fp8-weights auto|keep|dequantize] "
                           "[--fp8-tc-no-carveout] [--fp8-fma-max-m M] [--no-fp8-gemm] [--no-fp8-small-gemm] [--no-fp8-norm-codes] [--int-dp4a-max-m 0-4] [--int-dp4a-pipeline] [--draft DIR [--spec-tokens K]] [--tp N] [--enable-expert-parallel] [--mamba-ssm-cache-dtype float32|bfloat16]\n");
      return 2;
    }
  }
  if (kernels && !KernelTimeline::available()) {
    std::fprintf(stderr, "decode_bench: --kernels needs CUPTI, and this build found no libcupti in the CUDA toolkit\n");
    return 2;
  }
  if (model.empty() && !lab && !int_lab) {
    std::fprintf(stderr, "decode_bench: --model DIR is required (tools/make_random_model.py writes one)\n");
    return 2;
  }
  try {
    cudaDeviceProp prop{};
    ck(cudaGetDeviceProperties(&prop, 0), "device properties");
    const double bw = copy_bandwidth();
    if (lab || int_lab) gemv_lab(bw, int_lab);
    if (model.empty()) return 0;
    std::printf("# decode_bench: %s, %s, copy bandwidth %.0f GB/s (1 GiB device-to-device, read + write)\n", model.c_str(),
                prop.name, bw / 1e9);
    if (!draft.empty()) return spec_table(model, draft, spec_tokens, kvs, shapes, steps, gemv);
    std::printf("| kv cache | batch | context | graphs | sampling | ms/step | tokens/s | weights read GB | KV (+ state) read GB "
                "| floor ms | %% of floor | weights-read bound tok/s | %% of bound |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<std::tuple<std::string, int, int, double>> best;  // kv, batch, context, tokens/s (graphs, logits)
    for (const std::string& kv : split(kvs)) {
      ModelOptions o;
      o.model_dir = model;
      // "DTYPE[/ROTATION][@SINK:RECENT]": int4_per_token_head/none times the rotation's cost,
      // int4_per_token_head@4:64 exact sink / recent tokens (every page then has an exact page).
      // "plan:FILE": a plan file (--kv-cache-plan); "k=A;v=B": K and V apart (--kv-cache-dtype k=A,v=B).
      const bool plan = kv.starts_with("plan:");  // (the path may hold '/' and '@')
      const auto at = plan ? std::string::npos : kv.find('@');
      const std::string fmt = kv.substr(0, at);
      const auto slash = plan ? std::string::npos : fmt.find('/');
      if (plan) {
        o.cache.plan_file = load_kv_plan_file(fmt.substr(5));
      } else if (fmt.starts_with("k=")) {
        std::string pair = fmt.substr(0, slash);
        std::ranges::replace(pair, ';', ',');
        o.cache.set_kv_dtypes(parse_kv_cache_dtypes(pair));
      } else {
        o.cache.kv_cache_dtype = parse_kv_cache_dtype(fmt.substr(0, slash));
      }
      if (slash != std::string::npos) o.cache.rotation = parse_kv_rotation(fmt.substr(slash + 1));
      if (at != std::string::npos) {
        const std::string keep = kv.substr(at + 1);
        o.cache.keep_sink = std::stoi(keep.substr(0, keep.find(':')));
        o.cache.keep_recent = std::stoi(keep.substr(keep.find(':') + 1));
      }
      o.device = Device::Cuda;
      o.quantization = quantization;  // fp8: the linear weights in FP8 (the weights-read bound follows)
      o.dequantize_weights = dequantize_weights;  // a GGUF file's blocks dequantized at load
      o.cache.linear_state_dtype = state_dtype;   // hybrids: the Gated DeltaNet matrices in fp32 or bf16
      o.tensor_parallel_size = tp;
      o.expert_parallel = expert_parallel;
      const auto t0 = std::chrono::steady_clock::now();
      auto e = LoadedModel::load(o);
      const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      ModelRunner& r = e->model();
      const std::vector<CudaModelRunner*> ranks = cuda_ranks(r);
      for (auto* c : ranks) c->set_small_m_gemv(gemv);
      const ModelConfig& c = e->config();
      const double embed = double(ranks[0]->embedding_bytes());
      // Rank 0 reads the most (it alone holds an untied LM head): its bytes bound the step.
      const double wheld = double(ranks[0]->weight_bytes()) - (c.tie_word_embeddings ? 0.0 : embed);
      // A mixture of experts reads only the experts its rows chose. Random weights route about
      // uniformly, so B rows choose E (1 - (1 - k/E)^B) distinct experts per MoE layer in
      // expectation (exactly k at B = 1); the others' bytes are not read.
      const auto weights_read = [&](int batch) {
        if (!c.moe) return wheld;
        // Rank 0 holds 1/tp of every expert's width, or with expert parallelism E/tp whole experts.
        const MoeConfig& m = *c.moe;
        const double E = m.num_experts, H = c.hidden_size, ep = expert_parallel ? tp : 1;
        const double I = double(m.expert_size) / (expert_parallel ? 1 : tp), held = E / ep;
        const double moe_layers = double(std::ranges::count(c.moe_layers, true));
        // An expert's matrices as held (16-bit, or 4-bit codes with their parameters), and its biases.
        const double per_expert = double(ranks[0]->expert_bytes()) / (moe_layers * held) +
                                  (m.expert_bias ? (2 * I + H) * 2 : 0.0);
        const double chosen = held * (1 - std::pow(1 - double(m.top_k) / E, batch));
        return wheld - moe_layers * (held - chosen) * per_expert;
      };
      std::fprintf(stderr, "loaded %s with a %s cache in %.1f s (%.2f GB of weights%s)\n", model.c_str(), kv.c_str(),
                   load_s, double(r.weight_bytes()) / 1e9,
                   tp > 1 ? (", " + std::to_string(tp) + " GPUs, rank 0 holds " +
                             std::to_string(double(ranks[0]->weight_bytes()) / 1e9).substr(0, 5) + " GB").c_str()
                          : "");
      for (const std::string& sh : split(shapes)) {
        const auto x = sh.find('x');
        const int batch = std::stoi(sh.substr(0, x)), context = std::stoi(sh.substr(x + 1));
        const int bs = e->block_size();
        const int per_seq = (context + 3 + steps + 1 + bs - 1) / bs;
        const bool exact = e->plan().exact_bytes_per_token() > 0;
        r.allocate_kv(batch * per_seq, bs, exact ? batch * per_seq : 0);
        r.allocate_states(batch);  // hybrid models: a recurrent state per sequence (others ignore it)
        double kv_read = 0;  // average over the timed steps, per GPU
        for (const auto& l : e->rank_plan().layers)
          kv_read += double(batch) * (context + 3 + steps / 2.0) * double(l.bytes_per_token());
        // A hybrid's Gated DeltaNet layers read and write each sequence's state once a step:
        // counted with the KV, as what the step must move besides the weights.
        if (const auto& la = c.linear_attention)
          kv_read += 2.0 * double(batch) * double(la->state_bytes()) * double(c.num_linear_layers());
        const double wread = weights_read(batch);
        const double floor_ms = (wread + kv_read) / bw * 1e3;
        for (bool logits : {true, false}) {
          for (bool graphs : {false, true}) {
            for (auto* rk : ranks) rk->set_cuda_graphs(graphs);
            const Result res = run(r, batch, context, steps, logits, bs, exact);
            const double bound_tok = batch / (wread / bw);
            std::printf("| %s | %d | %d | %s | %s | %.3f | %.1f | %.2f | %.2f | %.3f | %.1f%% | %.1f | %.1f%% |\n", kv.c_str(),
                        batch, context, graphs ? "on" : "off", logits ? "host (fp32 logits)" : "gpu greedy", res.ms, res.tok_s, wread / 1e9,
                        kv_read / 1e9, floor_ms, 100 * floor_ms / res.ms, bound_tok, 100 * res.tok_s / bound_tok);
            std::fflush(stdout);
            if (graphs) best.emplace_back(kv + (logits ? "" : " (gpu greedy)"), batch, context, res.tok_s);
            if (graphs && !logits && kernels) {
              // the same run again under CUPTI (its graphs captured anew with the tracing on)
              KernelTimeline tl;
              for (auto* rk : ranks) rk->set_cuda_graphs(true);
              const Result traced = run(r, batch, context, steps, false, bs, exact, &tl);
              char title[256];
              std::snprintf(title, sizeof title, "%s, batch %d x %d, graphs, GPU greedy, %.3f ms a step (%.3f untraced)",
                            kv.c_str(), batch, context, traced.ms, res.ms);
              tl.report(stdout, title, c.num_layers);
              std::printf("\n| kv cache | batch | context | graphs | sampling | ms/step | tokens/s | weights read GB | KV (+ state) read GB "
                          "| floor ms | %% of floor | weights-read bound tok/s | %% of bound |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
            }
            if (graphs && !logits && tp > 1) {
              const double ar = allreduce_ms(dynamic_cast<TensorParallelRunner&>(r), batch, c.hidden_size, c.num_layers,
                                             e->dtype());
              std::printf("# tp=%d all-reduces alone at batch %d: %.3f ms per step, %.1f%% of the step's %.3f ms\n", tp,
                          batch, ar, 100 * ar / res.ms, res.ms);
            }
          }
        }
      }
    }
    // FP8 vs BF16 at the same shape (graphs on).
    for (const auto& [kv, b, ctx, tok] : best)
      for (const auto& [kv2, b2, ctx2, tok2] : best)
        if (b == b2 && ctx == ctx2 && kv2.rfind("bfloat16", 0) == 0 && kv.rfind("bfloat16", 0) != 0 &&
            (kv.find("gpu greedy") != std::string::npos) == (kv2.find("gpu greedy") != std::string::npos))
          std::printf("# speedup %s over %s at %d x %d: %.2fx (%.1f vs %.1f tokens/s)\n", kv.c_str(), kv2.c_str(), b, ctx,
                      tok / tok2, tok, tok2);
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "decode_bench: %s\n", ex.what());
    return 1;
  }
  return 0;
}

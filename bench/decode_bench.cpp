// End-to-end decode benchmark of the CUDA model runner, through the ModelRunner interface
// the engines use (ForwardBatch in, fp32 logits on the host out).
//
//   decode_bench --model DIR [--kv bfloat16,fp8,int4_per_token_head/none,int4_per_token_head@4:64,k=int8_per_token_head;v=int4_per_token_head,plan:FILE]
//                [--shapes 1x512,64x4096]
//                [--steps 32] [--gemv-lab] [--int-lab] [--kernels]
//                [--no-gemv] [--dequantize-weights] [--no-pdl] [--quantization fp8] [--fp8-weights auto|keep|dequantize]
//                [--fp8-tc-no-carveout] [--fp8-fma-max-m M] [--no-fp8-gemm] [--no-fp8-small-gemm]
//                [--no-fp8-norm-codes] [--int-dp4a-max-m 0-4] [--int-shared-x M] [--draft DIR [--spec-tokens K]] [--tp N] [--enable-expert-parallel]
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
// up to M rows on gemv_int_dp4a (0: the tensor-core GEMV), --int-shared-x M runs the tensor-core
// GEMV whose CTA shares x from M rows of x where the shape suits it (default 9; 17: never) (KernelSwitches; all for comparison).
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
#include "ops/cuda/kernel_switches.h"
#include "gemv_lab.h"
#include "kernel_timeline.h"
#include "lab_util.h"

using namespace kvlm;
using kvlm::bench::gemv_lab;
using kvlm::bench::KernelTimeline;
using kvlm::lab::ck;

namespace {

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

// The header of the step table main prints, a row per KV dtype, shape, graphs and sampling.
void step_table_header() {
  std::printf("| kv cache | batch | context | graphs | sampling | ms/step | tokens/s | weights read GB | KV (+ state) read GB "
              "| floor ms | %% of floor | weights-read bound tok/s | %% of bound |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
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
    else if (a == "--int-shared-x") {
      auto sw = cuda::kernel_switches();
      sw.int_shared_x_min_m = std::stoi(next());
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
                           "[--fp8-tc-no-carveout] [--fp8-fma-max-m M] [--no-fp8-gemm] [--no-fp8-small-gemm] [--no-fp8-norm-codes] [--int-dp4a-max-m 0-4] [--int-shared-x M] [--draft DIR [--spec-tokens K]] [--tp N] [--enable-expert-parallel] [--mamba-ssm-cache-dtype float32|bfloat16]\n");
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
    step_table_header();
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
              std::printf("\n");
              step_table_header();  // the table goes on after the timeline
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

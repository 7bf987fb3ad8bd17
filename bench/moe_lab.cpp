// The mixture-of-experts kernels (ops/cuda/moe.h) alone, on one layer of a real model's shape
// with random weights: time per call (one call captured as a CUDA graph, as the runner's decode
// steps run, with L2 flushed before each; CUDA events, median of 20 after 3 warm-ups), the weight
// bytes the call must read (the experts its rows chose, counted from its own routing, plus the
// router's logits and the activations), and the bandwidth that makes. Decode batches should
// run near the GPU's copy bandwidth; prefill batches are compute-bound and report TFLOP/s
// (2 x rows x top_k x 3 x hidden x width). From 512 rows it also times the same FLOPs as two
// dense bf16 GEMMs through cuBLASLt (one expert's shapes, rows x top_k rows: [P][H] . [2I][H]^T
// and [P][I] . [H][I]^T), the rate a grouped GEMM should approach. --codes BITS:GROUP holds the
// experts as grouped integer codes instead (4-bit AWQ / GPTQ-style experts: 4:128, GGUF's Q4_K:
// 4:32), their bytes counted as codes and 32-bit parameters. Results: docs/results/moe.md.
//
//   moe_lab [--shape qwen3-30b-a3b|gpt-oss-20b] [--rows 1,8,64,512,4096] [--codes 4:128]
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/grouped_codes.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/moe.h"
#include "lab_util.h"

using namespace kvlm;
using kvlm::lab::graph_ms;

namespace {

struct Shape {
  std::string name;
  int hidden, inter, experts, top_k;
  GluActivation act;
  bool biases;
};

template <class T>
T* device_random(size_t n, std::mt19937& rng, float stddev) {
  std::vector<uint16_t> h(n);
  std::normal_distribution<float> nd(0.0f, stddev);
  for (auto& v : h) v = num::f32_to_bf16(nd(rng));
  T* d = nullptr;
  CHECK(cudaMalloc(&d, n * 2));
  CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

template <class T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

// Random grouped codes for [rows][cols], scales about `stddev` / 4 (4-bit codes' spread) and
// offsets centring them, as a quantizer's would.
cuda::IntWeight device_codes(GroupedLayout l, int64_t rows, int64_t cols, std::mt19937& rng, float stddev) {
  std::vector<uint8_t> codes(size_t(rows) * grouped_code_bytes(l, cols));
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : codes) b = uint8_t(byte(rng));
  const float s = stddev / (l.bits == 4 ? 4.0f : 64.0f);
  std::vector<uint32_t> params(size_t(rows) * size_t(grouped_groups(l, cols)),
                               grouped_param(DType::BF16, s, l.bits == 4 ? -7.5f * s : 0.0f));
  return {.codes = device_copy(codes), .params = device_copy(params), .bits = l.bits, .group = l.group};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes{{"qwen3-30b-a3b", 2048, 768, 128, 8, GluActivation::Silu, false},
                            {"gpt-oss-20b", 2880, 2880, 32, 4, GluActivation::SwigluClamp, true}};
  std::string only;
  std::vector<int> rows_list{1, 8, 16, 64, 512, 4096};
  GroupedLayout codes{};
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--shape") {
      only = v;
    } else if (a == "--codes" && std::sscanf(v.c_str(), "%d:%d", &codes.bits, &codes.group) == 2 &&
               (codes.bits == 4 || codes.bits == 8)) {
    } else if (a == "--rows") {
      rows_list.clear();
      std::stringstream ss(v);
      for (std::string t; std::getline(ss, t, ',');) rows_list.push_back(std::stoi(t));
    } else {
      std::fprintf(stderr, "usage: moe_lab [--shape qwen3-30b-a3b|gpt-oss-20b] [--rows 1,8,64] [--codes 4:128]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("moe_lab on %s, experts %s\n", prop.name,
              codes.bits ? (std::to_string(codes.bits) + "-bit codes in groups of " + std::to_string(codes.group)).c_str()
                         : "bf16");
  std::printf("%-14s %6s %10s %12s %10s %10s %8s %14s\n", "shape", "rows", "us/call", "weight MB", "GB/s", "TFLOP/s",
              "experts", "dense TFLOP/s");
  cuda::Gemm gemm;
  void* gemm_ws = nullptr;
  CHECK(cudaMalloc(&gemm_ws, cuda::kGemmWorkspaceBytes));
  gemm.set_workspace(gemm_ws, cuda::kGemmWorkspaceBytes);
  std::mt19937 rng(1);
  // Written before each timed call: a layer's weights read by the call before it would
  // otherwise partly still sit in L2 (50 MB), where a model's 48 layers never leave them.
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  for (const Shape& s : shapes) {
    if (!only.empty() && s.name != only) continue;
    const int H = s.hidden, I = s.inter, E = s.experts, K = s.top_k;
    const int max_rows = *std::max_element(rows_list.begin(), rows_list.end());
    auto* gate_up = device_random<uint16_t>(size_t(E) * 2 * I * H, rng, 1.0f / std::sqrt(float(H)));
    auto* down = device_random<uint16_t>(size_t(E) * H * I, rng, 1.0f / std::sqrt(float(I)));
    cuda::IntWeight gu_codes, down_codes;
    if (codes.bits) {
      if (!cuda::moe_int_fits(H, I, codes.bits, codes.group)) {
        std::printf("%-14s codes %d:%d do not tile its sizes\n", s.name.c_str(), codes.bits, codes.group);
        continue;
      }
      gu_codes = device_codes(codes, int64_t(E) * 2 * I, H, rng, 1.0f / std::sqrt(float(H)));
      down_codes = device_codes(codes, int64_t(E) * H, I, rng, 1.0f / std::sqrt(float(I)));
    }
    // Bytes a weight element takes: 2, or a code and its share of a 32-bit parameter word.
    const double per_weight = codes.bits ? codes.bits / 8.0 + 4.0 / codes.group : 2.0;
    uint16_t* gub = s.biases ? device_random<uint16_t>(size_t(E) * 2 * I, rng, 0.5f) : nullptr;
    uint16_t* db = s.biases ? device_random<uint16_t>(size_t(E) * H, rng, 0.5f) : nullptr;
    auto* x = device_random<uint16_t>(size_t(max_rows) * H, rng, 1.0f);
    uint16_t* y = nullptr;
    CHECK(cudaMalloc(&y, size_t(max_rows) * H * 2));
    std::vector<float> logits(size_t(max_rows) * E);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (auto& l : logits) l = nd(rng);
    float* dlogits = nullptr;
    CHECK(cudaMalloc(&dlogits, logits.size() * 4));
    CHECK(cudaMemcpy(dlogits, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice));
    for (int T : rows_list) {
      void* ws = nullptr;
      const size_t wsb = cuda::moe_workspace_bytes(DType::BF16, T, H, I, E, K, codes.bits > 0);
      CHECK(cudaMalloc(&ws, wsb));
      MoeConfig cfg{.num_experts = E, .top_k = K, .expert_size = I, .norm_topk = true, .router_bias = false,
                    .expert_bias = s.biases, .act = s.act};
      const cuda::MoeParams p{.act = DType::BF16, .rows = T, .hidden = H, .inter = I, .config = cfg, .logits = dlogits,
                              .x = x, .gate_up = gate_up, .gate_up_bias = gub, .down = down, .down_bias = db, .y = y,
                              .workspace = ws, .gate_up_codes = gu_codes, .down_codes = down_codes};
      // The experts this batch's rows chose (the routing is the workspace's first array).
      for (int i = 0; i < 3; ++i) cuda::moe(p, nullptr);
      CHECK(cudaDeviceSynchronize());
      std::vector<int32_t> ids(size_t(T) * K);
      CHECK(cudaMemcpy(ids.data(), ws, ids.size() * 4, cudaMemcpyDeviceToHost));
      const std::set<int32_t> used(ids.begin(), ids.end());
      const double sec = graph_ms([&](cudaStream_t st) { cuda::moe(p, st); }, flush, flush_bytes, 20) * 1e-3;
      const double weight_bytes = double(used.size()) * 3.0 * H * I * per_weight;
      const double bytes = weight_bytes + double(T) * E * 4 + 2.0 * T * H * 2;
      const double flops = 2.0 * T * K * 3.0 * H * I;
      // The same FLOPs as dense GEMMs (gate/up then down over P = T x top_k rows), graph-timed
      // the same way.
      std::string dense = "-";
      if (T >= 512) {
        const int P = T * K;
        uint16_t *a = nullptr, *h = nullptr, *o = nullptr;
        CHECK(cudaMalloc(&a, size_t(P) * H * 2));
        CHECK(cudaMalloc(&h, size_t(P) * 2 * I * 2));
        CHECK(cudaMalloc(&o, size_t(P) * H * 2));
        CHECK(cudaMemset(a, 0x3c, size_t(P) * H * 2));
        CHECK(cudaMemset(h, 0x3c, size_t(P) * 2 * I * 2));
        auto run_dense = [&](cudaStream_t ds) {
          gemm.linear(DType::BF16, DType::BF16, a, gate_up, nullptr, h, P, 2 * I, H, ds);
          gemm.linear(DType::BF16, DType::BF16, h, down, nullptr, o, P, H, I, ds);
        };
        run_dense(nullptr);  // cuBLASLt's heuristics and workspace, outside the capture
        CHECK(cudaDeviceSynchronize());
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1f", flops / (graph_ms(run_dense, flush, flush_bytes, 10) * 1e-3) / 1e12);
        dense = buf;
        for (void* ptr : {static_cast<void*>(a), static_cast<void*>(h), static_cast<void*>(o)}) CHECK(cudaFree(ptr));
      }
      std::printf("%-14s %6d %10.1f %12.1f %10.0f %10.1f %5zu/%d %14s\n", s.name.c_str(), T, sec * 1e6, weight_bytes / 1e6,
                  bytes / sec / 1e9, flops / sec / 1e12, used.size(), E, dense.c_str());
      CHECK(cudaFree(ws));
    }
    for (void* ptr : {static_cast<void*>(gate_up), static_cast<void*>(down), static_cast<void*>(gub), static_cast<void*>(db),
                      static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(dlogits),
                      static_cast<void*>(const_cast<uint8_t*>(gu_codes.codes)),
                      static_cast<void*>(const_cast<uint32_t*>(gu_codes.params)),
                      static_cast<void*>(const_cast<uint8_t*>(down_codes.codes)),
                      static_cast<void*>(const_cast<uint32_t*>(down_codes.params))})
      if (ptr) CHECK(cudaFree(ptr));
  }
  CHECK(cudaFree(flush));
  CHECK(cudaFree(gemm_ws));
  return 0;
}

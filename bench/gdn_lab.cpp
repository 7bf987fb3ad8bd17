// Gated DeltaNet's token mixer (ops/cuda/gated_deltanet.h: conv, delta rule, gated norm) alone,
// on one linear-attention layer of Qwen3.5 / Qwen3-Next's shape (16 key heads and 32 value
// heads of 128, conv kernel 4) with random inputs: median time per call of a captured graph
// (L2 flushed before each), for
//   prefill  sequences x rows, every sequence starting at position 0: the form the kernels pick
//            for the step (gated_delta_net_takes_chunks) against the recurrent kernel alone
//   decode   sequences x 1 row continuing a state: time, and the bandwidth of the state traffic
//            (each sequence's matrices and conv window read and written once, its projection
//            row read) against --bandwidth
// bench/fla_gdn.py times flash-linear-attention's kernels on the same shapes. Results:
// docs/results/hybrid.md.
//
//   gdn_lab [--prefill 1x16384,4x4096] [--decode 1,64,256] [--state float32|bfloat16]
//           [--bandwidth GB/s (4000)]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "config/model_config.h"
#include "core/numeric.h"
#include "lab_util.h"
#include "ops/cuda/gated_deltanet.h"

using namespace kvlm;
using kvlm::lab::graph_ms;

namespace {

template <class T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK(cudaMalloc(&d, h.size() * sizeof(T)));
  CHECK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

struct Layer {
  LinearAttentionConfig l;
  float *conv_w, *a_log, *dt_bias, *norm_w;
};

Layer make_layer(DType state_dtype, std::mt19937& rng) {
  Layer L{.l = {.k_heads = 16, .v_heads = 32, .k_dim = 128, .v_dim = 128, .conv_kernel = 4, .state_dtype = state_dtype},
          .conv_w = nullptr, .a_log = nullptr, .dt_bias = nullptr, .norm_w = nullptr};
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  std::vector<float> conv(size_t(L.l.conv_dim()) * 4), alog(32), dt(32), nw(128);
  for (auto& v : conv) v = nd(rng) * 0.5f;
  for (auto& v : alog) v = std::log(1.0f + 15.0f * ud(rng));
  for (auto& v : dt) v = 0.5f * nd(rng);
  for (auto& v : nw) v = 1.0f + 0.1f * nd(rng);
  L.conv_w = device_copy(conv);
  L.a_log = device_copy(alog);
  L.dt_bias = device_copy(dt);
  L.norm_w = device_copy(nw);
  return L;
}

// One call's inputs: S sequences of n rows each.
struct Call {
  cuda::GatedDeltaNetParams p;
  size_t state_bytes_total = 0;
};

Call make_call(const Layer& L, int S, int n, bool fresh, bool chunked, std::mt19937& rng) {
  const int T = S * n, W = L.l.in_proj_dim();
  std::vector<uint16_t> mixed(size_t(T) * size_t(W));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : mixed) v = num::f32_to_bf16(nd(rng));
  std::vector<int32_t> cu{0}, kv, slots;
  for (int s = 0; s < S; ++s) {
    cu.push_back(cu.back() + n);
    kv.push_back(fresh ? n : n + 100);
    slots.push_back(s);
  }
  const size_t sb = L.l.state_bytes();
  uint8_t* states = nullptr;
  CHECK(cudaMalloc(&states, sb * size_t(S)));
  CHECK(cudaMemset(states, 0, sb * size_t(S)));
  float *qkv = nullptr, *core = nullptr, *scratch = nullptr;
  void* out = nullptr;
  CHECK(cudaMalloc(&qkv, size_t(T) * size_t(L.l.conv_dim()) * 4));
  CHECK(cudaMalloc(&core, size_t(T) * size_t(L.l.value_dim()) * 4));
  CHECK(cudaMalloc(&out, size_t(T) * size_t(L.l.value_dim()) * 2));
  const size_t sf = chunked ? cuda::gated_delta_net_scratch_floats(T, n, L.l.v_heads, L.l.k_dim, L.l.v_dim) : 0;
  if (sf) CHECK(cudaMalloc(&scratch, sf * 4));
  Call c;
  c.p = {.act = DType::BF16, .num_tokens = T, .num_seqs = S, .k_heads = L.l.k_heads, .v_heads = L.l.v_heads,
         .dk = L.l.k_dim, .dv = L.l.v_dim, .conv_kernel = L.l.conv_kernel, .cu_q_lens = device_copy(cu),
         .kv_lens = device_copy(kv), .state_slots = device_copy(slots), .mixed = device_copy(mixed),
         .conv_w = L.conv_w, .a_log = L.a_log, .dt_bias = L.dt_bias, .norm_w = L.norm_w, .eps = 1e-6f,
         .states = states, .state_bytes = sb, .state_dtype = L.l.state_dtype, .max_q_len = n, .scratch = scratch,
         .qkv = qkv, .core = core, .out = out};
  c.state_bytes_total = sb * size_t(S);
  return c;
}

void free_call(Call& c) {
  const void* held[] = {c.p.cu_q_lens, c.p.kv_lens, c.p.state_slots, c.p.mixed, c.p.states,
                        c.p.qkv,       c.p.core,    c.p.out,         c.p.scratch};
  for (const void* p : held)
    if (p) CHECK(cudaFree(const_cast<void*>(p)));
}

double time_call(const Call& c, void* flush, size_t flush_bytes, int runs) {
  cuda::gated_delta_net(c.p, nullptr);  // eager first: the kernels' one-time attributes
  CHECK(cudaDeviceSynchronize());
  return graph_ms([&](cudaStream_t st) { cuda::gated_delta_net(c.p, st); }, flush, flush_bytes, runs);
}

std::vector<std::string> split(const std::string& v) {
  std::vector<std::string> out;
  std::stringstream ss(v);
  for (std::string t; std::getline(ss, t, ',');) out.push_back(t);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> prefill{"1x16384", "4x4096", "16x1024", "64x256", "1x1024", "16x64"}, decode{"1", "64", "256"};
  DType state_dtype = DType::F32;
  double bandwidth = 4000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--prefill") prefill = split(v);
    else if (a == "--decode") decode = split(v);
    else if (a == "--state" && (v == "float32" || v == "bfloat16")) state_dtype = v == "float32" ? DType::F32 : DType::BF16;
    else if (a == "--bandwidth") bandwidth = std::stod(v);
    else {
      std::fprintf(stderr,
                   "usage: gdn_lab [--prefill 1x16384,4x4096] [--decode 1,64,256] [--state float32|bfloat16] "
                   "[--bandwidth GB/s]\n");
      return 2;
    }
  }
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("gdn_lab on %s: one Gated DeltaNet layer (16 k heads, 32 v heads of 128, conv 4), bf16 activations, "
              "%s state\n",
              prop.name, state_dtype == DType::F32 ? "fp32" : "bf16");
  std::mt19937 rng(1);
  const Layer L = make_layer(state_dtype, rng);
  const size_t flush_bytes = size_t(256) << 20;
  void* flush = nullptr;
  CHECK(cudaMalloc(&flush, flush_bytes));
  std::printf("\n%-10s %10s %10s %12s %14s %14s %8s\n", "prefill", "form", "ms", "tok/s", "recurrent ms",
              "recurrent tok/s", "speedup");
  for (const std::string& shape : prefill) {
    const size_t x = shape.find('x');
    const int S = std::stoi(shape.substr(0, x)), n = std::stoi(shape.substr(x + 1));
    Call ch = make_call(L, S, n, true, true, rng), rec = make_call(L, S, n, true, false, rng);
    const double a = time_call(ch, flush, flush_bytes, 10), b = time_call(rec, flush, flush_bytes, 5);
    const double tokens = double(S) * n;
    const bool chunks = cuda::gated_delta_net_takes_chunks(S * n, n, L.l.k_dim, L.l.v_dim);
    std::printf("%-10s %10s %10.3f %12.0f %14.3f %14.0f %7.1fx\n", shape.c_str(), chunks ? "chunked" : "recurrent", a,
                tokens / (a * 1e-3), b, tokens / (b * 1e-3), b / a);
    free_call(ch);
    free_call(rec);
  }
  std::printf("\n%-10s %12s %14s %14s %10s\n", "decode", "us", "state MB", "GB/s", "% of bw");
  for (const std::string& shape : decode) {
    const int S = std::stoi(shape);
    Call c = make_call(L, S, 1, false, true, rng);
    const double ms = time_call(c, flush, flush_bytes, 20);
    const double bytes = 2.0 * double(c.state_bytes_total) + double(S) * L.l.in_proj_dim() * 2 + double(S) * L.l.value_dim() * 2;
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-10s %12.1f %14.1f %14.0f %9.1f%%\n", shape.c_str(), ms * 1e3, double(c.state_bytes_total) / 1e6, gbs,
                100.0 * gbs / bandwidth);
    free_call(c);
  }
  return 0;
}

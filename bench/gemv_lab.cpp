// decode_bench --gemv-lab and --int-lab (gemv_lab.h): the decode GEMM shapes of Qwen3-8B timed
// kernel by kernel, without a model.
#include "gemv_lab.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "io/grouped_codes.h"
#include "ops/cuda/gemm.h"
#include "ops/cuda/kernel_switches.h"
#include "lab_util.h"

namespace kvlm::bench {

using lab::ck;

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
  // m = 8 and 16 on each tensor-core GEMV: x loaded by each warp, and shared by the CTA
  // (KernelSwitches::int_shared_x_min_m) with 128- and 256-row CTAs.
  const int xs_ms[] = {8, 16};
  for (int m : xs_ms) std::printf(" m=%d x per warp µs | m=%d x shared, 128 rows µs | m=%d x shared, 256 rows µs |", m, m, m);
  std::printf(" dequantize µs | GB/s |\n|---|---|---|---|");
  for (size_t i = 0; i < std::size(int_ms); ++i) std::printf("---|---|");
  for (size_t i = 0; i < 2 * std::size(tc_ms) + 3 * std::size(xs_ms); ++i) std::printf("---|");
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
      // One more cell: gemv_int at m rows under switches changed by `force`, restored after.
      auto forced_cell = [&](int m, auto force) {
        const auto saved = cuda::kernel_switches();
        auto forced = saved;
        force(forced);
        cuda::set_kernel_switches(forced);
        const double us =
            time_us([&](int i) { cuda::gemv_int(DType::BF16, out, x, wi(i), nullptr, y, sh.n, m, sh.n, sh.k, nullptr); });
        char buf[32];
        std::snprintf(buf, sizeof buf, " | %.1f", us);
        cells += buf;
        cuda::set_kernel_switches(saved);
      };
      for (const bool dp4a : {true, false})
        for (int m : tc_ms)
          forced_cell(m, [&](cuda::KernelSwitches& f) {
            if (dp4a) f.int_dp4a_by_shape = false;
            else f.int_dp4a_max_m = 0;
          });
      for (int m : xs_ms)
        for (int tiles : {0, 1, 2})  // 0: x per warp
          forced_cell(m, [&](cuda::KernelSwitches& f) {
            f.int_shared_x_min_m = tiles == 0 ? cuda::kGemvIntMaxM + 1 : 1;
            f.int_shared_x_by_shape = false;
            f.int_shared_x_tiles = tiles;
          });
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

}  // namespace kvlm::bench

// The attention kernel lab: for each KV mode and decode shape (Llama-3-8B attention: 32 q
// heads, 8 kv heads, head 128, block size 16, shuffled pages), first validates the kernel
// against a simple reference kernel (software decoding through core/numeric.h, two-pass
// softmax), then times it with CUDA events (warm-up, median of repeats), rotating through
// copies of the cache whose total exceeds 2x the L2 (so every timed call reads HBM), and
// prints one markdown row: µs, achieved GB/s of the bytes that must move (K+V codes, scales,
// q, out), % of the device-to-device copy bandwidth measured in the same run, and speedup
// over bf16 of the same shape.
//
//   attention_lab [--quick] [--prefill] [--prefill-only] [--block N] [--head N] [--shapes BxC,...]
//                 [--modes NAME,...] [--max-splits N] [--split-lengths N] [--decode-layout N] [--trace DIR]
//                 [--no-wgmma] [--no-pdl] [--sinks] [--exact S:R] [--kernel N]
//
// --prefill adds the prefill table (causal prompts of 4k and 16k tokens and a 1k chunk over a
// 16k context, every KV mode: µs, TFLOP/s, speedup over bf16); --prefill-only skips decode.
// --head N sets the head size (64, 128 or 256; default 128, Llama-3-8B's).
// --shapes picks decode shapes (e.g. 64x4096,1x32768), --modes KV modes (e.g. bf16,fp8_e4m3);
// --max-splits caps the decode split count (PagedAttentionParams::max_splits), to explore it;
// --split-lengths sets PagedAttentionParams::split_lengths (0 automatic, 1 equal, 2 decreasing);
// column `splits` marks decreasing lengths with "d".
// --decode-layout sets PagedAttentionParams::decode_layout (0 automatic, 1 query rows in the mma's
// M, 2 keys in M); column `splits` marks the keys-in-M layout with "k".
// --sinks gives every q head a learned attention sink (GPT-OSS), values in [-2, 4) in score
// units, checked by the reference too: run with and without it to see what sinks cost.
// --exact S:R (prefill table) keeps the first S and the latest R keys of each query exact, as
// --kv-cache-keep-sink / --kv-cache-keep-recent do: every quantized mode's rows then read them
// from bf16 exact pages (random values of their own, which the reference reads too) through
// the kernel's exact pass; bf16 / fp16 rows run without them, the baseline.
// --kernel N forces PagedAttentionParams::kernel (1 CUDA cores, 2 decode tensor cores, 3 tiled
// prefill) in both tables, to compare with the automatic choice (0).
// --trace DIR (a build with -DKVLM_ATTN_TRACE=ON) writes the per-CTA timeline of each decode
// row's last timed call to DIR/trace-MODE-BxC.bin: per CTA four little-endian uint64 (start,
// first tile, end in globaltimer ns; SM); tools/attn_trace.py summarises them.
//
// Each timed call is queued behind a short spin kernel, so the events bracket the GPU time of
// the call alone: the host's launch latency (several µs, which a CUDA graph removes in the
// engine's decode step) is not counted. Timings before 2026-11-22 included it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/numeric.h"
#include "kv/attention_mask.h"
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/kernel_switches.h"

using namespace kvlm;

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace {

constexpr int kQHeads = 32, kKVHeads = 8;
int kHead = 128;  // --head N
int kBlock = 16;  // --block N
float* g_sinks = nullptr;  // --sinks: fp32 [kQHeads] on the device
int g_keep_sink = -1, g_keep_recent = -1;  // --exact S:R (prefill); -1: none
int g_kernel = 0;                          // --kernel N
constexpr double kL2 = 60e6;

// A KV mode: K's format, and V's where it differs (vstorage set: the K != V pairs).
struct Mode {
  const char* name;
  DType storage;
  KVQuantMode quant;
  std::optional<DType> vstorage = std::nullopt;
  KVQuantMode vquant = KVQuantMode::None;
  DType vst() const { return vstorage.value_or(storage); }
  KVQuantMode vq() const { return vstorage ? vquant : quant; }
};
const Mode kModes[] = {
    {"bf16", DType::BF16, KVQuantMode::None},
    {"fp16", DType::F16, KVQuantMode::None},
    {"fp8_e4m3", DType::F8E4M3, KVQuantMode::Fp8PerTensor},
    {"fp8_e5m2", DType::F8E5M2, KVQuantMode::Fp8PerTensor},
    {"fp8_per_token_head", DType::F8E4M3, KVQuantMode::Fp8PerTokenHead},
    {"int8_per_token_head", DType::I8, KVQuantMode::Int8PerTokenHead},
    {"int4_per_token_head", DType::I4, KVQuantMode::Int4PerTokenHead},
    // K and V apart (kv/kv_formats.h's CUDA pairs): K 16 / 8 bits beside V in 4 or 8.
    {"k_bf16_v_int4", DType::BF16, KVQuantMode::None, DType::I4, KVQuantMode::Int4PerTokenHead},
    {"k_int8_v_int4", DType::I8, KVQuantMode::Int8PerTokenHead, DType::I4, KVQuantMode::Int4PerTokenHead},
    {"k_fp8_v_int4", DType::F8E4M3, KVQuantMode::Fp8PerTokenHead, DType::I4, KVQuantMode::Int4PerTokenHead},
    {"k_bf16_v_int8", DType::BF16, KVQuantMode::None, DType::I8, KVQuantMode::Int8PerTokenHead},
};
size_t esize(DType t) { return (t == DType::BF16 || t == DType::F16) ? 2 : 1; }  // bytes filled per code (int4: a byte of two)
size_t code_bytes(DType t, size_t elems) { return t == DType::I4 ? elems / 2 : elems * esize(t); }
__host__ __device__ inline bool per_token(KVQuantMode q) {
  return q == KVQuantMode::Fp8PerTokenHead || q == KVQuantMode::Int8PerTokenHead || q == KVQuantMode::Int4PerTokenHead;
}

__device__ __host__ inline uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}

// Random finite codes: 2-byte formats get values in [-1, 1); fp8 bytes lose bit 6 (the top
// exponent bit), which excludes NaN/inf in both e4m3 and e5m2; int8 takes any byte.
__global__ void fill_codes(uint8_t* p, size_t n_elems, int esz, int fmt, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_elems; i += size_t(gridDim.x) * blockDim.x) {
    const uint32_t h = hash32(i * 0x9E3779B97F4A7C15ULL + seed);
    if (esz == 2) {
      const float x = float(int32_t(h)) * (1.0f / 2147483648.0f);
      const uint16_t c = fmt == 0 ? kvlm::num::f32_to_bf16(x) : kvlm::num::f32_to_f16(x);
      reinterpret_cast<uint16_t*>(p)[i] = c;
    } else {
      p[i] = uint8_t(fmt == 2 ? h : (h & 0xBFu));
    }
  }
}
// Token scales in [0.005, 0.015); int4's slot packs that step (f16) with the zero point
// -7.5 steps (f16), so its values lie in [-0.11, 0.11].
__global__ void fill_scales(float* p, size_t n, uint64_t seed, bool int4) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float s = 0.005f + float(hash32(i + seed) % 1000) * 1e-5f;
    if (int4) {
      const uint32_t w = uint32_t(kvlm::num::f32_to_f16(s)) | uint32_t(kvlm::num::f32_to_f16(-7.5f * s)) << 16;
      p[i] = __uint_as_float(w);
    } else {
      p[i] = s;
    }
  }
}

// Element i of row `sidx` dequantized (int4: code * step + zero from the packed slot).
__device__ float int4_value(const uint8_t* base, size_t sidx, int d, int head_dim, const float* slots) {
  const uint8_t* row = base + sidx * size_t(head_dim) / 2;
  const int code = (row[(d / 8) * 4 + d % 4] >> ((d % 8) >= 4 ? 4 : 0)) & 0xf;
  const uint32_t w = __float_as_uint(slots[sidx]);
  return float(code) * kvlm::num::f16_to_f32(uint16_t(w & 0xffff)) + kvlm::num::f16_to_f32(uint16_t(w >> 16));
}

__device__ float decode_sw(const uint8_t* base, size_t i, DType st) {
  switch (st) {
    case DType::BF16: return kvlm::num::bf16_to_f32(reinterpret_cast<const uint16_t*>(base)[i]);
    case DType::F16: return kvlm::num::f16_to_f32(reinterpret_cast<const uint16_t*>(base)[i]);
    case DType::F8E4M3: return kvlm::num::e4m3_to_f32(base[i]);
    case DType::F8E5M2: return kvlm::num::e5m2_to_f32(base[i]);
    default: return float(int8_t(base[i]));
  }
}

// Simple reference: one CTA per (checked query row, q head). Row i is query row item.y of
// sequence item.x seeing its first item.z keys (causal): scores in a global scratch (stride
// max_keys), two-pass softmax, fp32 throughout, codes decoded in software.
__global__ void reference_attend(cuda::PagedAttentionParams p, DType vst, KVQuantMode vq, const int3* items, int max_keys,
                                 float* scratch, float* out) {
  const int ri = blockIdx.x, h = blockIdx.y, g = h / (p.num_q_heads / p.num_kv_heads);
  const int3 it = items[ri];
  const int seq = it.x, n = it.z;
  const uint8_t* K = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* V = static_cast<const uint8_t*>(p.v_cache);
  float ks = 1, vs = 1;
  if (p.quant == KVQuantMode::Fp8PerTensor) ks = p.k_tensor_scale[0];
  if (vq == KVQuantMode::Fp8PerTensor) vs = p.v_tensor_scale[0];
  const BlockId* table = p.block_tables + size_t(seq) * p.max_blocks_per_seq;
  float* sc = scratch + (size_t(ri) * p.num_q_heads + h) * max_keys;
  const uint16_t* q = p.q + (size_t(it.y) * p.num_q_heads + h) * p.head_dim;
  // Exact sink / recent keys (causal: the query is at position n - 1) from the bf16 exact pages.
  const BlockId* etable = p.exact_k ? p.exact_tables + size_t(seq) * p.max_blocks_per_seq : nullptr;
  auto exact_at = [&](int j) -> size_t {
    if (!p.exact_k || !kv_key_exact(j, n - 1, p.keep_sink, p.keep_recent)) return SIZE_MAX;
    return ((size_t(etable[j / p.block_size]) * p.num_kv_heads + g) * p.block_size + j % p.block_size) * p.head_dim;
  };
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const size_t sidx = (size_t(table[j / p.block_size]) * p.num_kv_heads + g) * p.block_size + j % p.block_size;
    float s = 0;
    if (const size_t e = exact_at(j); e != SIZE_MAX) {
      for (int d = 0; d < p.head_dim; ++d) s += kvlm::num::bf16_to_f32(q[d]) * kvlm::num::bf16_to_f32(p.exact_k[e + d]);
      sc[j] = s * p.softmax_scale;
      continue;
    }
    if (p.storage == DType::I4) {
      for (int d = 0; d < p.head_dim; ++d) s += kvlm::num::bf16_to_f32(q[d]) * int4_value(K, sidx, d, p.head_dim, p.k_token_scale);
      sc[j] = s * p.softmax_scale;
      continue;
    }
    for (int d = 0; d < p.head_dim; ++d) s += kvlm::num::bf16_to_f32(q[d]) * decode_sw(K, sidx * p.head_dim + d, p.storage);
    sc[j] = s * (per_token(p.quant) ? p.k_token_scale[sidx] : ks) * p.softmax_scale;
  }
  __syncthreads();
  __shared__ float red[256];
  float m = -INFINITY;
  for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
  red[threadIdx.x] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < blockDim.x; ++i) m = fmaxf(m, red[i]);
    red[0] = m;
  }
  __syncthreads();
  m = red[0];
  __syncthreads();
  float l = 0;
  for (int j = threadIdx.x; j < n; j += blockDim.x) l += (sc[j] = expf(sc[j] - m));
  red[threadIdx.x] = l;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int i = 1; i < blockDim.x; ++i) l += red[i];
    red[0] = l;
  }
  __syncthreads();
  l = red[0];
  if (p.sinks) l += expf(p.sinks[h] - m);  // the sink joins the denominator only
  for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x) {
    float o = 0;
    for (int j = 0; j < n; ++j) {
      const size_t sidx = (size_t(table[j / p.block_size]) * p.num_kv_heads + g) * p.block_size + j % p.block_size;
      if (const size_t e = exact_at(j); e != SIZE_MAX) {
        o += sc[j] * kvlm::num::bf16_to_f32(p.exact_v[e + d]);
        continue;
      }
      o += sc[j] * (vst == DType::I4 ? int4_value(V, sidx, d, p.head_dim, p.v_token_scale)
                                     : decode_sw(V, sidx * p.head_dim + d, vst) * (per_token(vq) ? p.v_token_scale[sidx] : vs));
    }
    out[(size_t(ri) * p.num_q_heads + h) * p.head_dim + d] = o / l;
  }
}

// Runs reference_attend over `items` into a device buffer of [items][q heads][head] floats
// (the caller frees it).
float* reference(const cuda::PagedAttentionParams& p, const std::vector<int3>& items, int max_keys) {
  const KVStorage v = p.v_format.value_or(KVStorage{p.storage, p.quant});
  int3* ditems;
  float *scratch, *out;
  CK(cudaMalloc(&ditems, items.size() * sizeof(int3)));
  CK(cudaMemcpy(ditems, items.data(), items.size() * sizeof(int3), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&scratch, items.size() * kQHeads * size_t(max_keys) * 4));
  CK(cudaMalloc(&out, items.size() * kQHeads * kHead * 4));
  reference_attend<<<dim3(unsigned(items.size()), kQHeads), 256>>>(p, v.storage, v.mode, ditems, max_keys, scratch, out);
  CK(cudaDeviceSynchronize());
  cudaFree(ditems);
  cudaFree(scratch);
  return out;
}

// Spins for `ns` nanoseconds: queued before a timed call, it keeps the stream busy while the
// host enqueues the call and its closing event, so the events measure GPU time only.
__global__ void hold(long long ns) {
  const long long t0 = clock64();
  while (clock64() - t0 < ns * 2) {  // >= ns at clocks up to 2 GHz
  }
}

// Median GPU time in ms of `reps` calls of fn(i) after `warm` untimed ones.
template <class F>
double time_calls(F&& fn, int warm, int reps) {
  static cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (!e0) {
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
  }
  std::vector<float> t;
  for (int i = 0; i < warm + reps; ++i) {
    hold<<<1, 1>>>(100000);  // 100 µs: ample for the host to enqueue one call
    CK(cudaEventRecord(e0));
    fn(i);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= warm) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double copy_bandwidth(void* a, void* b, size_t bytes) {
  const double ms = time_calls([&](int) { CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 3, 10);
  return 2.0 * double(bytes) / (ms * 1e-3);  // read + write
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, prefill = false, prefill_only = false, sinks = false;
  std::string shapes_arg, modes_arg, trace_dir;
  int max_splits = 0, split_lengths = 0, decode_layout = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--prefill")) prefill = true;
    if (!std::strcmp(argv[i], "--prefill-only")) prefill = prefill_only = true;
    if (!std::strcmp(argv[i], "--block") && i + 1 < argc) kBlock = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--head") && i + 1 < argc) kHead = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--shapes") && i + 1 < argc) shapes_arg = argv[++i];
    if (!std::strcmp(argv[i], "--modes") && i + 1 < argc) modes_arg = argv[++i];
    if (!std::strcmp(argv[i], "--max-splits") && i + 1 < argc) max_splits = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--split-lengths") && i + 1 < argc) split_lengths = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--decode-layout") && i + 1 < argc) decode_layout = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--trace") && i + 1 < argc) trace_dir = argv[++i];
    if (!std::strcmp(argv[i], "--sinks")) sinks = true;
    if (!std::strcmp(argv[i], "--kernel") && i + 1 < argc) g_kernel = std::atoi(argv[++i]);
    if (!std::strcmp(argv[i], "--exact") && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d:%d", &g_keep_sink, &g_keep_recent) != 2 || g_keep_sink < 0 || g_keep_recent < 0) {
        std::fprintf(stderr, "attention_lab: --exact takes SINK:RECENT (two counts >= 0), e.g. 4:64\n");
        return 2;
      }
    }
    if (!std::strcmp(argv[i], "--no-wgmma")) {
      auto sw = cuda::kernel_switches();
      sw.wgmma = false;
      cuda::set_kernel_switches(sw);
    }
    if (!std::strcmp(argv[i], "--no-pdl")) {
      auto sw = cuda::kernel_switches();
      sw.pdl = false;
      cuda::set_kernel_switches(sw);
    }
  }
  if (kHead != 64 && kHead != 128 && kHead != 256) {
    std::fprintf(stderr, "attention_lab: --head takes 64, 128 or 256, not %d\n", kHead);
    return 2;
  }
  // --shapes BxC,... (decode) and --modes NAME,...: comma lists, matched exactly.
  auto listed = [](const std::string& list, const std::string& item) {
    return list.empty() || ("," + list + ",").find("," + item + ",") != std::string::npos;
  };
  auto mode_on = [&](const Mode& m) { return listed(modes_arg, m.name); };
  auto shape_on = [&](int b, int c) { return listed(shapes_arg, std::to_string(b) + "x" + std::to_string(c)); };
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  size_t free_b = 0, total_b = 0;
  CK(cudaMemGetInfo(&free_b, &total_b));
  // One arena for K+V codes (largest shape, bf16) and one for scales, reused by every row.
  const bool small = quick && shapes_arg.empty();
  const std::vector<int> batches = small ? std::vector<int>{1, 64} : std::vector<int>{1, 16, 64, 256};
  const std::vector<int> contexts = small ? std::vector<int>{1024, 4096} : std::vector<int>{1024, 4096, 16384, 32768};
  const size_t arena_bytes = std::min<size_t>(size_t(42) << 30, free_b - (size_t(8) << 30));
  uint8_t* arena = nullptr;
  CK(cudaMalloc(&arena, arena_bytes));
  const size_t copy_bytes = size_t(1) << 30;
  const double copy_bw = copy_bandwidth(arena, arena + copy_bytes, copy_bytes);
  std::printf("# attention_lab on %s (%d SMs, L2 %.0f MB), copy bandwidth %.0f GB/s (D2D memcpy, read+write), block size %d, "
              "head size %d%s\n\n",
              prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_bw / 1e9, kBlock, kHead,
              sinks ? ", learned sinks" : "");
  std::printf("| mode | batch | context | splits | valid (max err) | µs | floor µs | GB/s | %% of copy | vs bf16 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  float* scales = nullptr;  // per-token-head scales: K then V
  const size_t max_tokens = size_t(batches.back()) * contexts.back();
  const size_t scale_elems = max_tokens * kKVHeads * 4 + (size_t(1) << 24);
  CK(cudaMalloc(&scales, 2 * scale_elems * sizeof(float)));
  float* tensor_scales = nullptr;
  CK(cudaMalloc(&tensor_scales, 2 * sizeof(float)));
  const float ts_host[2] = {0.5f, 0.25f};
  CK(cudaMemcpy(tensor_scales, ts_host, sizeof ts_host, cudaMemcpyHostToDevice));
  if (sinks) {
    std::vector<float> hs(kQHeads);
    for (int h = 0; h < kQHeads; ++h) hs[size_t(h)] = -2.0f + 6.0f * float(hash32(uint64_t(h) + 31) % 1000) / 1000.0f;
    CK(cudaMalloc(&g_sinks, hs.size() * sizeof(float)));
    CK(cudaMemcpy(g_sinks, hs.data(), hs.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  const size_t ws_bytes = size_t(2) << 30;  // prefill with --exact: 16k rows x 32 heads x a few splits
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));

  std::vector<std::vector<double>> bf16_us(batches.size(), std::vector<double>(contexts.size(), 0));
  for (const Mode& mode : kModes) {
    if (prefill_only) break;
    if (!mode_on(mode)) continue;
    for (size_t bi = 0; bi < batches.size(); ++bi) {
      for (size_t ci = 0; ci < contexts.size(); ++ci) {
        const int B = batches[bi], C = contexts[ci];
        if (!shape_on(B, C)) continue;
        const size_t tokens = size_t(B) * C;
        const size_t k_bytes = code_bytes(mode.storage, tokens * kKVHeads * kHead);
        const size_t v_bytes = code_bytes(mode.vst(), tokens * kKVHeads * kHead);
        const size_t scale_bytes = ((per_token(mode.quant) ? 1 : 0) + (per_token(mode.vq()) ? 1 : 0)) * tokens * kKVHeads * 4;
        const size_t per_copy = k_bytes + v_bytes + scale_bytes;
        if (k_bytes + v_bytes > arena_bytes) {
          std::printf("| %s | %d | %d | - | skipped: %.1f GB of K+V exceeds the arena | | | | | |\n", mode.name, B, C,
                      (k_bytes + v_bytes) / 1e9);
          continue;
        }
        const int copies = int(std::clamp<size_t>(size_t(std::ceil(2.2 * kL2 / double(per_copy))), 1,
                                                  std::min<size_t>(32, arena_bytes / (k_bytes + v_bytes))));
        const int nb = C / kBlock;
        const int num_blocks = copies * B * nb;
        uint8_t* K = arena;
        const size_t elems = size_t(num_blocks) * kBlock * kKVHeads * kHead;
        uint8_t* V = arena + code_bytes(mode.storage, elems);
        // Codes of one side (int4: any byte is two valid codes).
        const auto fill = [&](uint8_t* at, DType st, uint64_t seed) {
          const bool i4 = st == DType::I4;
          const int fmt = st == DType::BF16 ? 0 : st == DType::F16 ? 1 : st == DType::I8 || i4 ? 2 : 3;
          fill_codes<<<4096, 256>>>(at, i4 ? elems / 2 : elems, int(esize(st)), fmt, seed);
        };
        fill(K, mode.storage, 1);
        fill(V, mode.vst(), 2);
        const size_t ntok_all = size_t(num_blocks) * kBlock * kKVHeads;
        if (per_token(mode.quant)) fill_scales<<<1024, 256>>>(scales, ntok_all, 3, mode.storage == DType::I4);
        if (per_token(mode.vq())) fill_scales<<<1024, 256>>>(scales + scale_elems, ntok_all, 4, mode.vst() == DType::I4);
        CK(cudaGetLastError());
        // Shuffled block tables: copy c owns pages [c*B*nb, (c+1)*B*nb) in a random order.
        std::vector<BlockId> tables(static_cast<size_t>(num_blocks));
        for (int c = 0; c < copies; ++c) {
          std::vector<BlockId> perm(size_t(B) * nb);
          for (size_t i = 0; i < perm.size(); ++i) perm[i] = BlockId(size_t(c) * perm.size() + i);
          for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[hash32(i + 77 * c) % i]);
          std::copy(perm.begin(), perm.end(), tables.begin() + ptrdiff_t(size_t(c) * perm.size()));
        }
        BlockId* dtables;
        CK(cudaMalloc(&dtables, tables.size() * sizeof(BlockId)));
        CK(cudaMemcpy(dtables, tables.data(), tables.size() * sizeof(BlockId), cudaMemcpyHostToDevice));
        std::vector<int32_t> cuq(size_t(B) + 1, 0);
        std::vector<int32_t> kvl(size_t(B), C);
        for (int i = 0; i <= B; ++i) cuq[size_t(i)] = i;
        int32_t *dcu, *dkvl;
        CK(cudaMalloc(&dcu, cuq.size() * 4));
        CK(cudaMalloc(&dkvl, kvl.size() * 4));
        CK(cudaMemcpy(dcu, cuq.data(), cuq.size() * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dkvl, kvl.data(), kvl.size() * 4, cudaMemcpyHostToDevice));
        const size_t qn = size_t(B) * kQHeads * kHead;
        uint16_t *dq, *dout;
        CK(cudaMalloc(&dq, qn * 2 * copies));
        CK(cudaMalloc(&dout, qn * 2 * copies));
        {
          std::vector<uint16_t> hq(qn * copies);
          for (size_t i = 0; i < hq.size(); ++i) hq[i] = num::f32_to_bf16(float(int32_t(hash32(i + 999))) / 2147483648.0f * 2.0f);
          CK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
        }
        auto params = [&](int c) {
          return cuda::PagedAttentionParams{
              .storage = mode.storage, .quant = mode.quant,
              .v_format = mode.vstorage ? std::optional(KVStorage{mode.vst(), mode.vq()}) : std::nullopt,
              .num_seqs = B, .num_tokens = B, .num_q_heads = kQHeads,
              .num_kv_heads = kKVHeads, .head_dim = kHead, .block_size = kBlock, .max_blocks_per_seq = nb, .max_q_len = 1,
              .max_kv_len = C, .mask = AttentionKind::Full, .softmax_scale = 1.0f / std::sqrt(float(kHead)),
              .sinks = g_sinks, .q = dq + qn * c, .out = dout + qn * c, .k_cache = K, .v_cache = V, .k_token_scale = scales,
              .v_token_scale = scales + scale_elems, .k_tensor_scale = tensor_scales, .v_tensor_scale = tensor_scales + 1,
              .num_tensor_scales = 1, .cu_q_lens = dcu, .kv_lens = dkvl, .block_tables = dtables + size_t(c) * B * nb,
              .workspace = ws, .workspace_bytes = ws_bytes, .max_splits = max_splits,
              .split_lengths = split_lengths, .kernel = g_kernel, .decode_layout = decode_layout};
        };
        const auto p0 = params(0);
        const cuda::PagedAttentionChoice choice = cuda::paged_attention_choice(p0);
        const int splits = choice.splits;
        // Validation on copy 0, the first min(B, 2) sequences.
        const int vb = std::min(B, 2);
        cuda::paged_attention(p0, nullptr);
        std::vector<int3> items;
        for (int b = 0; b < vb; ++b) items.push_back(make_int3(b, b, C));  // sequence b's one query sees all C keys
        float* rout = reference(p0, items, C);
        std::vector<uint16_t> got(size_t(vb) * kQHeads * kHead);
        std::vector<float> want(got.size());
        CK(cudaMemcpy(got.data(), dout, got.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(want.data(), rout, want.size() * 4, cudaMemcpyDeviceToHost));
        double max_err = 0;
        bool ok = true;
        for (size_t i = 0; i < got.size(); ++i) {
          const double g = num::bf16_to_f32(got[i]), w = want[i];
          const double e = std::isnan(g) ? 1e9 : std::fabs(g - w);
          max_err = std::max(max_err, e);
          ok = ok && e <= std::ldexp(std::fabs(w), -8) + 1e-4;
        }
        cudaFree(rout);
        // Timing: 5 warm-up calls, then the median of 25 timed calls, each on the next copy.
        const double us = time_calls([&](int i) { cuda::paged_attention(params(i % copies), nullptr); }, 5, 25) * 1e3;
        if (!trace_dir.empty()) {
          const std::vector<cuda::AttnCtaTrace> tr = cuda::paged_attention_last_trace();
          if (tr.empty()) {
            std::fprintf(stderr, "--trace: no timeline recorded (build with -DKVLM_ATTN_TRACE=ON; only the decode "
                                 "tensor-core kernel records one)\n");
            return 2;
          }
          const std::string path = trace_dir + "/trace-" + mode.name + "-" + std::to_string(B) + "x" + std::to_string(C) + ".bin";
          FILE* f = std::fopen(path.c_str(), "wb");
          if (!f || std::fwrite(tr.data(), sizeof(tr[0]), tr.size(), f) != tr.size() || std::fclose(f) != 0) {
            std::fprintf(stderr, "--trace: cannot write %s\n", path.c_str());
            return 2;
          }
        }
        const double bytes = double(k_bytes + v_bytes + scale_bytes + 2 * qn * 2);
        const double gbs = bytes / (us * 1e-6) / 1e9;
        if (mode.storage == DType::BF16 && !mode.vstorage) bf16_us[bi][ci] = us;  // the uniform bf16 row
        const double floor_us = bytes / copy_bw * 1e6;
        char vs[32] = "-";
        if (bf16_us[bi][ci] > 0) std::snprintf(vs, sizeof vs, "%.2fx", bf16_us[bi][ci] / us);
        std::printf("| %s | %d | %d | %d%s%s | %s (%.1e) | %.1f | %.1f | %.0f | %.0f%% | %s |\n", mode.name, B, C, splits,
                    choice.decreasing_splits ? "d" : "", choice.keys_in_m ? "k" : "",
                    ok ? "ok" : "FAIL", max_err, us, floor_us, gbs, 100.0 * gbs * 1e9 / copy_bw, vs);
        std::fflush(stdout);
        cudaFree(dtables);
        cudaFree(dcu);
        cudaFree(dkvl);
        cudaFree(dq);
        cudaFree(dout);
      }
    }
  }
  if (prefill) {
    // Prefill: one sequence of q_len new tokens after `context - q_len` cached ones, causal,
    // every KV mode, through the automatic kernel choice (the tiled kernel). Validated on a
    // sample of rows against reference_attend, then timed (the K/V of a prompt is re-read
    // from L2 by design here, so no copy rotation: the kernel is compute-bound).
    std::printf("\n| prefill mode | q_len | context | kernel | splits | valid (max err) | µs | TFLOP/s | vs bf16 |\n"
                "|---|---|---|---|---|---|---|---|---|\n");
    struct PShape {
      int q_len, context;
    };
    const std::vector<PShape> pshapes = quick ? std::vector<PShape>{{4096, 4096}}
                                              : std::vector<PShape>{{4096, 4096}, {16384, 16384}, {1024, 16384}};
    std::vector<double> bf16_pus(pshapes.size(), 0);
    for (const Mode& mode : kModes) {
      if (mode.vstorage) continue;  // K != V: the tiled prefill kernels read one format (the decode table has them)
      if (!mode_on(mode)) continue;
      for (size_t si = 0; si < pshapes.size(); ++si) {
        const int Lq = pshapes[si].q_len, C = pshapes[si].context, nb = C / kBlock;
        const size_t elems = size_t(nb) * kBlock * kKVHeads * kHead;
        uint8_t* K = arena;
        uint8_t* V = arena + code_bytes(mode.storage, elems);
        const bool int4 = mode.storage == DType::I4;
        const int fmt = mode.storage == DType::BF16 ? 0 : mode.storage == DType::F16 ? 1 : mode.storage == DType::I8 || int4 ? 2 : 3;
        fill_codes<<<4096, 256>>>(K, int4 ? elems / 2 : elems, int(esize(mode.storage)), fmt, 5);
        fill_codes<<<4096, 256>>>(V, int4 ? elems / 2 : elems, int(esize(mode.storage)), fmt, 6);
        if (per_token(mode.quant)) {
          fill_scales<<<1024, 256>>>(scales, size_t(nb) * kBlock * kKVHeads, 7, int4);
          fill_scales<<<1024, 256>>>(scales + scale_elems, size_t(nb) * kBlock * kKVHeads, 8, int4);
        }
        std::vector<BlockId> tab(static_cast<size_t>(nb));
        for (int i = 0; i < nb; ++i) tab[size_t(i)] = i;
        for (size_t i = tab.size(); i > 1; --i) std::swap(tab[i - 1], tab[hash32(i + 5) % i]);
        BlockId* dt;
        int32_t *dcu, *dkvl;
        uint16_t *dq, *dout;
        CK(cudaMalloc(&dt, size_t(nb) * 4));
        CK(cudaMemcpy(dt, tab.data(), size_t(nb) * 4, cudaMemcpyHostToDevice));
        const int32_t cuq2[2] = {0, Lq}, kl = C;
        CK(cudaMalloc(&dcu, 8));
        CK(cudaMalloc(&dkvl, 4));
        CK(cudaMemcpy(dcu, cuq2, 8, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dkvl, &kl, 4, cudaMemcpyHostToDevice));
        const size_t qn = size_t(Lq) * kQHeads * kHead;
        CK(cudaMalloc(&dq, qn * 2));
        CK(cudaMalloc(&dout, qn * 2));
        {
          std::vector<uint16_t> hq(qn);
          for (size_t i = 0; i < hq.size(); ++i) hq[i] = num::f32_to_bf16(float(int32_t(hash32(i + 4242))) / 2147483648.0f * 2.0f);
          CK(cudaMemcpy(dq, hq.data(), hq.size() * 2, cudaMemcpyHostToDevice));
        }
        // --exact: bf16 exact pages of their own (random values), the exact page of page i at tab[i].
        const bool exact = g_keep_sink >= 0 && esize(mode.storage) == 1;
        uint16_t *ek = nullptr, *ev = nullptr;
        if (exact) {
          CK(cudaMalloc(&ek, elems * 2));
          CK(cudaMalloc(&ev, elems * 2));
          fill_codes<<<4096, 256>>>(reinterpret_cast<uint8_t*>(ek), elems, 2, 0, 9);
          fill_codes<<<4096, 256>>>(reinterpret_cast<uint8_t*>(ev), elems, 2, 0, 10);
        }
        cuda::PagedAttentionParams p{
            .storage = mode.storage, .quant = mode.quant, .num_seqs = 1, .num_tokens = Lq, .num_q_heads = kQHeads,
            .num_kv_heads = kKVHeads, .head_dim = kHead, .block_size = kBlock, .max_blocks_per_seq = nb, .max_q_len = Lq,
            .max_kv_len = C, .mask = AttentionKind::Full, .softmax_scale = 1.0f / std::sqrt(float(kHead)),
            .sinks = g_sinks, .q = dq, .out = dout, .k_cache = K, .v_cache = V, .k_token_scale = scales,
            .v_token_scale = scales + scale_elems,
            .k_tensor_scale = tensor_scales, .v_tensor_scale = tensor_scales + 1, .num_tensor_scales = 1, .cu_q_lens = dcu,
            .kv_lens = dkvl, .block_tables = dt, .workspace = ws, .workspace_bytes = ws_bytes, .kernel = g_kernel};
        if (exact) {
          p.exact_k = ek;
          p.exact_v = ev;
          p.exact_tables = dt;
          p.keep_sink = g_keep_sink;
          p.keep_recent = g_keep_recent;
        }
        if (cuda::paged_attention_workspace_bytes(p) > ws_bytes) {
          std::fprintf(stderr, "attention_lab: the prefill workspace exceeds %zu bytes\n", ws_bytes);
          return 1;
        }
        CK(cudaMemset(dout, 0xff, qn * 2));
        cuda::paged_attention(p, nullptr);
        // Validate rows 0, 1, 63, 64, Lq / 2 + 17 and Lq - 1 (every q head).
        const std::vector<int> rows{0, 1, 63, 64, Lq / 2 + 17, Lq - 1};
        std::vector<int3> items;
        for (int r : rows) items.push_back(make_int3(0, r, C - Lq + r + 1));
        float* rout = reference(p, items, C);
        std::vector<uint16_t> got(qn);
        std::vector<float> want(rows.size() * kQHeads * kHead);
        CK(cudaMemcpy(got.data(), dout, qn * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(want.data(), rout, want.size() * 4, cudaMemcpyDeviceToHost));
        // max |V| of the fill: 16-bit values in [-1, 1), fp8 codes without exponent bit 6
        // (|x| <= 1.875), int8 up to 128; times the V tensor scale (0.25) or token scales (<= 0.015).
        double max_err = 0, vmax = esize(mode.storage) == 2 ? 1.0 : mode.storage == DType::I8 ? 128.0 : 1.875;
        if (mode.quant == KVQuantMode::Fp8PerTensor) vmax *= 0.25;
        if (per_token(mode.quant)) vmax *= 0.015;
        if (mode.storage == DType::I4) vmax = 7.5 * 0.015;
        // P is rounded to bf16 (bf16 cache) or f16 before P.V: |err| <= u * max|V| (see tests).
        // (--exact: the exact passes read bf16 pages of values in [-1, 1), and round P to bf16.)
        const double floor = std::ldexp(exact ? std::max(vmax, 1.0) : vmax, mode.storage == DType::BF16 || exact ? -9 : -11) + 1e-4;
        bool ok = true;
        for (size_t r = 0; r < rows.size(); ++r)
          for (int i = 0; i < kQHeads * kHead; ++i) {
            const double g = num::bf16_to_f32(got[size_t(rows[r]) * kQHeads * kHead + size_t(i)]);
            const double w = want[r * kQHeads * kHead + size_t(i)];
            const double e = std::isnan(g) ? 1e9 : std::fabs(g - w);
            max_err = std::max(max_err, e);
            ok = ok && e <= std::ldexp(std::fabs(w), -8) + floor;
          }
        cudaFree(rout);
        const double us = time_calls([&](int) { cuda::paged_attention(p, nullptr); }, 2, 6) * 1e3;
        // Causal FLOPs: 4 * H * D per visible (query, key) pair.
        double pairs = 0;
        for (int r = 0; r < Lq; ++r) pairs += double(C - Lq + r + 1);
        const double flops = 4.0 * pairs * kQHeads * kHead;
        if (mode.storage == DType::BF16) bf16_pus[si] = us;
        char vs[32] = "-";
        if (bf16_pus[si] > 0) std::snprintf(vs, sizeof vs, "%.2fx", bf16_pus[si] / us);
        const cuda::PagedAttentionChoice choice = cuda::paged_attention_choice(p);
        const std::string name = std::string(mode.name) +
                                 (exact ? "@" + std::to_string(g_keep_sink) + ":" + std::to_string(g_keep_recent) : "");
        std::printf("| %s | %d | %d | %d | %d | %s (%.1e) | %.0f | %.1f | %s |\n", name.c_str(), Lq, C, choice.kernel,
                    choice.splits, ok ? "ok" : "FAIL", max_err, us,
                    flops / (us * 1e-6) / 1e12, vs);
        std::fflush(stdout);
        cudaFree(ek);
        cudaFree(ev);
        cudaFree(dt);
        cudaFree(dcu);
        cudaFree(dkvl);
        cudaFree(dq);
        cudaFree(dout);
      }
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}

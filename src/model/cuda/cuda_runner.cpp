// The CUDA model runner (cuda_runner.h). One step, for T tokens of S sequences with R logit
// rows, on the runner's own stream:
//
//   metadata (tokens, positions, slots, cu_q_lens, kv_lens, block tables, logit rows):
//       packed into pinned host memory, one cudaMemcpyAsync
//   embed_rows                                   -> x (fp32 residual)
//   per layer:
//     add_rmsnorm(x += delta, input norm)        -> h
//     GEMM h . Wqkv^T (+ qkv bias, epilogue)      -> qkv          (q, k, v weights fused at load)
//     qkv_rope_store                             -> q (bf16); K/V quantized into the pages
//     paged_attention (the layer's format, mask) -> attn (bf16)
//     GEMM attn . Wo^T (+ bias)                   -> delta
//     add_rmsnorm(x += delta, post norm)         -> h
//     GEMM h . Wgate_up^T (+ bias)                -> gu           (gate and up fused at load)
//     silu_mul                                   -> act          (batch 1: fused into the
//     GEMM act . Wdown^T (+ bias)                 -> delta         down GEMV, see gemm.h)
//   add_rmsnorm(x += delta, final norm) on the logit rows only -> hl
//   GEMM hl . Wlm^T, fp32 out                     -> logits -> pinned host -> caller's span
//
// CUDA graphs: a decode step (every sequence one query token, logits for every row, at most
// 256 rows) is padded to a power-of-two batch B and its block tables to a power-of-two
// stride MB; the kernels of a (B, MB) step are captured once and replayed. Everything a
// graph bakes in is a function of (B, MB): buffer addresses (the scratch arena is carved
// deterministically from the shape and only grows, which drops every graph), the attention
// split count (planned for max_kv_len = MB * block_size; the kernels divide each sequence's
// true key range, read from kv_lens in memory, among those splits), GEMM shapes (and their
// tuned algorithms, chosen in the eager run before capture). Padding rows have
// slot -1 (nothing stored), kv_len 1 and page 0 in their table (a valid page: read, never
// used); their logits are computed and dropped. A (B, MB) shape runs eagerly the first time
// it is seen (warming cuBLASLt's heuristics and the kernels' one-time attributes) and is
// captured the second time.
#include "model/cuda/cuda_runner.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

#include "attention/selector.h"
#include "config/cache_config.h"
#include "core/error.h"
#include "core/log.h"
#include "core/numeric.h"
#include "model/rope.h"
#include "ops/cuda/attention_ops.h"
#include "ops/cuda/cuda_check.cuh"
#include "ops/cuda/gemm.h"
#include "ops/cuda/model_ops.h"
#include "ops/cuda/sampling.h"

namespace kvlm {

namespace {

constexpr size_t kAlign = 256;  // cuBLASLt's default alignment assumption; cudaMalloc gives 256
constexpr int kMaxGraphBatch = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", double(bytes) / double(size_t(1) << 30));
  return buf;
}

int next_pow2(int n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// One device allocation, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void allocate(size_t bytes, const std::string& what) {
    reset();
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
      throw Error("cannot allocate " + gib(bytes) + " of GPU memory for " + what + " (" + gib(free_b) + " free of " +
                  gib(total_b) + "): " + cudaGetErrorString(err));
    }
    bytes_ = bytes;
  }
  void reset() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Pinned host memory that only grows.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* reserve(size_t bytes) {
    if (bytes > bytes_) {
      const size_t want = std::max(bytes, bytes_ * 2);
      if (ptr_) cudaFreeHost(ptr_);
      ptr_ = nullptr;
      bytes_ = 0;
      KVLM_CUDA_CHECK(cudaHostAlloc(&ptr_, want, cudaHostAllocDefault));
      bytes_ = want;
    }
    return static_cast<uint8_t*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Bump allocation of 256-byte aligned pieces, from a base address (0 to measure).
struct Carver {
  uintptr_t base = 0;
  size_t off = 0;
  template <class T>
  T* take(size_t count) {
    T* p = reinterpret_cast<T*>(base + off);
    off += align_up(count * sizeof(T));
    return p;
  }
};

// The shape of one step and where its buffers live in the scratch arena.
struct StepShape {
  int T = 0, R = 0, S = 0, MB = 1, max_q = 1, max_kv = 1;
};

struct StepBuffers {
  // metadata (one host -> device copy: [meta_begin, meta_end))
  TokenId* tokens = nullptr;
  Position* positions = nullptr;
  SlotId* slots = nullptr;
  int32_t* cu = nullptr;
  int32_t* kv_lens = nullptr;
  BlockId* tables = nullptr;
  int32_t* logit_rows = nullptr;
  size_t meta_bytes = 0;
  // activations ([meta_bytes, total) is what poisoning fills)
  float* x = nullptr;
  uint16_t *h = nullptr, *qkv = nullptr, *q = nullptr, *attn = nullptr, *attn_act = nullptr, *delta = nullptr,
           *gu = nullptr, *act = nullptr, *hl = nullptr;
  float* logits = nullptr;
  TokenId* ids = nullptr;  // forward_greedy's argmax / forward_sampled's token per logit row
  cuda::SampleRowParams* sample = nullptr;  // forward_sampled's per-row parameters
  uint8_t* attn_ws = nullptr;
  size_t attn_ws_bytes = 0;
  size_t total = 0;
};

struct LayerWeights {
  const float *in_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  const void *wqkv = nullptr, *bqkv = nullptr, *wo = nullptr, *bo = nullptr, *wgu = nullptr, *bgu = nullptr,
             *wdown = nullptr, *bdown = nullptr;
};

struct LayerKV {
  DType storage = DType::BF16;
  KVQuantMode quant = KVQuantMode::None;
  AttentionKind kind = AttentionKind::Full;
  int window = 0;
  const float *k_tensor_scale = nullptr, *v_tensor_scale = nullptr;  // device, fp8_per_tensor
  int num_tensor_scales = 1;
  // the pool (allocate_kv)
  uint8_t *k = nullptr, *v = nullptr;
  float *k_scale = nullptr, *v_scale = nullptr;
  size_t page_bytes = 0, scale_page_bytes = 0;
};

// A weight tensor on the device, possibly several checkpoint tensors concatenated along
// dim 0 (fused QKV, gate/up).
struct WeightSlot {
  std::vector<std::pair<std::string, std::vector<int64_t>>> pieces;
  DType type = DType::BF16;  // on the device
  size_t offset = 0, bytes = 0;
  std::vector<float> host_f32;  // instead of pieces: small fp32 data (KV scales, inv_freq)
};

}  // namespace

struct CudaModelRunner::Impl {
  ModelConfig cfg;
  DType act = DType::BF16;
  cudaStream_t stream = nullptr;
  cuda::Gemm gemm;
  DeviceBuffer weights, gemm_ws, kv, kv_pools, pairs_dev, scratch;
  PinnedBuffer meta_host, logits_host, pairs_host, sample_host;
  size_t num_params = 0, weight_bytes = 0;
  const void* embed = nullptr;
  const void* lm_head = nullptr;
  const float* final_norm = nullptr;
  const float* inv_freq = nullptr;
  std::vector<LayerWeights> lw;
  std::vector<LayerKV> lkv;
  int num_blocks = 0, block_size = 0;
  size_t kv_bytes = 0;
  size_t pairs_capacity = 0;
  bool poison = false;
  TokenId* ids = nullptr;                  // the last step's argmax buffer (StepBuffers::ids)
  cuda::SampleRowParams* sample = nullptr;  // the last step's StepBuffers::sample
  std::vector<cudaEvent_t> copy_events;    // forward's chunked logits copy
  bool graphs_on = true;
  std::set<std::pair<int, int>> graph_seen;              // (B, MB) run once eagerly
  std::map<std::pair<int, int>, cudaGraphExec_t> graphs;  // (B, MB) -> captured step

  ~Impl() {
    clear_graphs();
    for (cudaEvent_t e : copy_events) cudaEventDestroy(e);
    if (stream) cudaStreamDestroy(stream);
  }

  void clear_graphs() {
    for (auto& [k, g] : graphs) cudaGraphExecDestroy(g);
    graphs.clear();
    graph_seen.clear();
  }

  int hidden() const { return cfg.hidden_size; }
  int qkv_width() const { return (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim; }

  cuda::PagedAttentionParams attn_params(const LayerKV& L, const StepShape& s, const StepBuffers& b) const {
    return cuda::PagedAttentionParams{
        .storage = L.storage, .quant = L.quant, .num_seqs = s.S, .num_tokens = s.T, .num_q_heads = cfg.num_heads,
        .num_kv_heads = cfg.num_kv_heads, .head_dim = cfg.head_dim, .block_size = block_size,
        .max_blocks_per_seq = s.MB, .max_q_len = s.max_q, .max_kv_len = s.max_kv, .mask = L.kind, .window = L.window,
        .softmax_scale = 1.0f / std::sqrt(float(cfg.head_dim)), .q = b.q, .out = b.attn, .k_cache = L.k, .v_cache = L.v,
        .k_token_scale = L.k_scale, .v_token_scale = L.v_scale, .k_tensor_scale = L.k_tensor_scale,
        .v_tensor_scale = L.v_tensor_scale, .num_tensor_scales = L.num_tensor_scales, .cu_q_lens = b.cu,
        .kv_lens = b.kv_lens, .block_tables = b.tables, .workspace = b.attn_ws, .workspace_bytes = b.attn_ws_bytes};
  }

  // Carves the step's buffers from `base` (0: only measures). The attention workspace is the
  // largest any layer's format needs for this shape.
  StepBuffers carve(uintptr_t base, const StepShape& s) const {
    StepBuffers b;
    Carver c{base};
    const size_t T = size_t(s.T), H = size_t(hidden()), I = size_t(cfg.intermediate_size);
    const size_t QD = size_t(cfg.num_heads) * size_t(cfg.head_dim);
    b.tokens = c.take<TokenId>(T);
    b.positions = c.take<Position>(T);
    b.slots = c.take<SlotId>(T);
    b.cu = c.take<int32_t>(size_t(s.S) + 1);
    b.kv_lens = c.take<int32_t>(size_t(s.S));
    b.tables = c.take<BlockId>(size_t(s.S) * size_t(s.MB));
    b.logit_rows = c.take<int32_t>(size_t(std::max(s.R, 1)));
    b.meta_bytes = c.off;
    b.x = c.take<float>(T * H);
    b.h = c.take<uint16_t>(T * H);
    b.qkv = c.take<uint16_t>(T * size_t(qkv_width()));
    b.q = c.take<uint16_t>(T * QD);
    b.attn = c.take<uint16_t>(T * QD);
    b.attn_act = act == DType::BF16 ? b.attn : c.take<uint16_t>(T * QD);
    b.delta = c.take<uint16_t>(T * H);
    b.gu = c.take<uint16_t>(T * 2 * I);
    b.act = c.take<uint16_t>(T * I);
    b.hl = c.take<uint16_t>(size_t(s.R) * H);
    b.logits = c.take<float>(size_t(s.R) * size_t(cfg.vocab_size));
    b.ids = c.take<TokenId>(size_t(std::max(s.R, 1)));
    b.sample = c.take<cuda::SampleRowParams>(size_t(std::max(s.R, 1)));
    size_t ws = 0;
    for (const LayerKV& L : lkv) ws = std::max(ws, cuda::paged_attention_workspace_bytes(attn_params(L, s, b)));
    b.attn_ws_bytes = ws;
    b.attn_ws = c.take<uint8_t>(ws);
    b.total = c.off;
    return b;
  }

  // The scratch arena for `s`, grown (never shrunk) when too small; growing drops graphs.
  StepBuffers buffers_for(const StepShape& s) {
    const StepBuffers need = carve(0, s);
    if (need.total > scratch.bytes()) {
      KVLM_CUDA_CHECK(cudaStreamSynchronize(stream));
      clear_graphs();
      scratch.allocate(std::max(need.total, scratch.bytes() + scratch.bytes() / 2), "activations");
    }
    return carve(reinterpret_cast<uintptr_t>(scratch.data()), s);
  }

  // Every kernel of a step after the metadata upload: eager or under graph capture.
  void run_kernels(const StepShape& s, const StepBuffers& b) {
    void* st = stream;
    const int T = s.T, H = hidden(), I = cfg.intermediate_size, d = cfg.head_dim;
    const int nh = cfg.num_heads, kvh = cfg.num_kv_heads;
    const float eps = float(cfg.rms_norm_eps);
    cuda::embed_rows(act, embed, b.tokens, T, H, b.x, st);
    for (size_t li = 0; li < lw.size(); ++li) {
      const LayerWeights& W = lw[li];
      const LayerKV& L = lkv[li];
      cuda::add_rmsnorm({.act = act, .rows = T, .hidden = H, .x = b.x, .delta = li == 0 ? nullptr : b.delta,
                         .weight = W.in_norm, .eps = eps, .out = b.h},
                        st);
      gemm.linear(act, act, b.h, W.wqkv, W.bqkv, b.qkv, T, qkv_width(), H, st);
      cuda::qkv_rope_store({.act = act, .storage = L.storage, .quant = L.quant, .num_tokens = T, .num_q_heads = nh,
                            .num_kv_heads = kvh, .head_dim = d, .qkv = b.qkv, .q_norm = W.q_norm, .k_norm = W.k_norm,
                            .eps = eps, .positions = b.positions, .inv_freq = inv_freq, .q_out = b.q,
                            .slots = b.slots, .block_size = block_size, .num_blocks = num_blocks, .k_cache = L.k,
                            .v_cache = L.v, .k_token_scale = L.k_scale, .v_token_scale = L.v_scale,
                            .k_tensor_scale = L.k_tensor_scale, .v_tensor_scale = L.v_tensor_scale,
                            .num_tensor_scales = L.num_tensor_scales},
                           st);
      cuda::paged_attention(attn_params(L, s, b), st);
      if (act != DType::BF16) cuda::bf16_to_act(act, b.attn, b.attn_act, size_t(T) * size_t(nh) * size_t(d), st);
      gemm.linear(act, act, b.attn_act, W.wo, W.bo, b.delta, T, H, nh * d, st);
      cuda::add_rmsnorm({.act = act, .rows = T, .hidden = H, .x = b.x, .delta = b.delta, .weight = W.post_norm,
                         .eps = eps, .out = b.h},
                        st);
      gemm.linear(act, act, b.h, W.wgu, W.bgu, b.gu, T, 2 * I, H, st);
      if (T == 1 && gemm.small_m_kernel(T) && cuda::gemv_fits(T, I, b.gu, W.wdown)) {  // batch 1: SiLU-and-mul fused
        cuda::gemv_small_m(act, act, b.gu, W.wdown, W.bdown, b.delta, T, H, I, st, 0, /*glu_input=*/true);
      } else {
        cuda::silu_mul(act, b.gu, b.act, T, I, st);
        gemm.linear(act, act, b.act, W.wdown, W.bdown, b.delta, T, H, I, st);
      }
    }
    if (s.R > 0) {
      cuda::add_rmsnorm({.act = act, .rows = s.R, .hidden = H, .x = b.x, .delta = b.delta, .weight = final_norm,
                         .eps = eps, .out = b.hl, .row_map = b.logit_rows},
                        st);
      gemm.linear(act, DType::F32, b.hl, lm_head, nullptr, b.logits, s.R, cfg.vocab_size, H, st);
    }
  }
};

// ---- loading ------------------------------------------------------------------------------

CudaModelRunner::CudaModelRunner(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan, DType compute)
    : cfg_(std::move(config)), impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = cfg_;
  if (compute != DType::BF16 && compute != DType::F16)
    throw Error("the CUDA runner computes in bfloat16 or float16, not " + std::string(dtype_name(compute)) +
                "; use --dtype bfloat16 or float16 (or --device cpu)");
  m.act = compute;
  KVLM_CHECK(plan.layers.size() == size_t(cfg_.num_layers), "one KV spec per layer");
  for (const auto& l : plan.layers)
    if (l.backend != "cuda")
      throw Error("the CUDA runner runs every layer on the 'cuda' attention backend, but " + describe_layer(l) +
                  " was assigned '" + l.backend + "'");
  KVLM_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));

  const int64_t hd = cfg_.hidden_size, d = cfg_.head_dim, nh = cfg_.num_heads, kvh = cfg_.num_kv_heads;
  const int64_t inter = cfg_.intermediate_size, vocab = cfg_.vocab_size;
  using Shape = std::vector<int64_t>;
  std::vector<WeightSlot> slots;
  std::set<std::string> used;
  auto add = [&](std::vector<std::pair<std::string, Shape>> pieces, DType type) {
    WeightSlot w;
    w.type = type;
    size_t n = 0;
    for (auto& [name, shape] : pieces) {
      used.insert(name);
      size_t e = 1;
      for (int64_t s : shape) e *= size_t(s);
      n += e;
    }
    w.pieces = std::move(pieces);
    w.bytes = n * dtype_size(type);
    slots.push_back(std::move(w));
    return slots.size() - 1;
  };
  auto add_f32 = [&](std::vector<float> data) {
    WeightSlot w;
    w.type = DType::F32;
    w.bytes = data.size() * sizeof(float);
    w.host_f32 = std::move(data);
    slots.push_back(std::move(w));
    return slots.size() - 1;
  };
  const DType A = m.act, F = DType::F32;
  const size_t s_embed = add({{"model.embed_tokens.weight", {vocab, hd}}}, A);
  size_t s_lm = s_embed;
  if (cfg_.tie_word_embeddings) {
    used.insert("lm_head.weight");
  } else if (!ckpt.find("lm_head.weight")) {
    throw Error("the checkpoint has no 'lm_head.weight' and config.json does not set tie_word_embeddings");
  } else {
    s_lm = add({{"lm_head.weight", {vocab, hd}}}, A);
  }
  const size_t s_final = add({{"model.norm.weight", {hd}}}, F);
  struct LayerSlots {
    size_t in_norm, post_norm, qkv, bqkv = SIZE_MAX, o, bo = SIZE_MAX, q_norm = SIZE_MAX, k_norm = SIZE_MAX, gu,
                                     bgu = SIZE_MAX, down, bdown = SIZE_MAX, ks = SIZE_MAX, vs = SIZE_MAX;
  };
  std::vector<LayerSlots> ls(size_t(cfg_.num_layers));
  for (int i = 0; i < cfg_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    LayerSlots& s = ls[size_t(i)];
    s.in_norm = add({{p + "input_layernorm.weight", {hd}}}, F);
    s.post_norm = add({{p + "post_attention_layernorm.weight", {hd}}}, F);
    s.qkv = add({{p + "self_attn.q_proj.weight", {nh * d, hd}},
                 {p + "self_attn.k_proj.weight", {kvh * d, hd}},
                 {p + "self_attn.v_proj.weight", {kvh * d, hd}}},
                A);
    if (cfg_.qkv_bias)
      s.bqkv = add({{p + "self_attn.q_proj.bias", {nh * d}},
                    {p + "self_attn.k_proj.bias", {kvh * d}},
                    {p + "self_attn.v_proj.bias", {kvh * d}}},
                   A);
    s.o = add({{p + "self_attn.o_proj.weight", {hd, nh * d}}}, A);
    if (cfg_.o_bias) s.bo = add({{p + "self_attn.o_proj.bias", {hd}}}, A);
    if (cfg_.qk_norm) {
      s.q_norm = add({{p + "self_attn.q_norm.weight", {d}}}, F);
      s.k_norm = add({{p + "self_attn.k_norm.weight", {d}}}, F);
    }
    s.gu = add({{p + "mlp.gate_proj.weight", {inter, hd}}, {p + "mlp.up_proj.weight", {inter, hd}}}, A);
    if (cfg_.mlp_bias) s.bgu = add({{p + "mlp.gate_proj.bias", {inter}}, {p + "mlp.up_proj.bias", {inter}}}, A);
    s.down = add({{p + "mlp.down_proj.weight", {hd, inter}}}, A);
    if (cfg_.mlp_bias) s.bdown = add({{p + "mlp.down_proj.bias", {hd}}}, A);
    const KVLayerSpec& spec = plan.layers[size_t(i)];
    if (spec.quant == KVQuantMode::Fp8PerTensor) {
      s.ks = add_f32(spec.k_scale);
      s.vs = add_f32(spec.v_scale);
    }
  }
  const size_t s_inv = add_f32(rope_inv_freq(cfg_.rope, cfg_.head_dim));

  // One allocation for everything, then the uploads.
  size_t total = 0, tensor_bytes = 0;
  for (auto& w : slots) {
    w.offset = total;
    total += align_up(w.bytes);
    if (w.host_f32.empty()) tensor_bytes += w.bytes;
  }
  m.weights.allocate(total, "the model weights");
  log::Progress progress("uploading weights", tensor_bytes >= (size_t(256) << 20) ? tensor_bytes : 0);
  size_t done = 0;
  std::vector<uint16_t> conv16;
  std::vector<float> conv32;
  for (auto& w : slots) {
    uint8_t* dst = m.weights.data() + w.offset;
    if (!w.host_f32.empty()) {
      KVLM_CUDA_CHECK(cudaMemcpy(dst, w.host_f32.data(), w.bytes, cudaMemcpyHostToDevice));
      continue;
    }
    for (const auto& [name, shape] : w.pieces) {
      const TensorView v = ckpt.view(name);
      const TensorInfo& t = *v.info;
      if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16)
        throw Error("tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                    "; kvlm loads bfloat16, float16 and float32 weights (quantized weights are not supported)");
      if (!std::ranges::equal(t.shape, shape))
        throw Error("tensor '" + t.name + "' has shape " + shape_str(t.shape) + " but config.json implies " +
                    shape_str(shape));
      const size_t n = size_t(t.numel());
      m.num_params += n;
      if (t.dtype == w.type) {
        KVLM_CUDA_CHECK(cudaMemcpy(dst, v.bytes.data(), v.bytes.size(), cudaMemcpyHostToDevice));
      } else {
        conv32.resize(n);
        convert_to_f32(t.dtype, v.bytes, conv32);
        if (w.type == DType::F32) {
          KVLM_CUDA_CHECK(cudaMemcpy(dst, conv32.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        } else {
          conv16.resize(n);
          for (size_t i = 0; i < n; ++i)
            conv16[i] = w.type == DType::BF16 ? num::f32_to_bf16(conv32[i]) : num::f32_to_f16(conv32[i]);
          KVLM_CUDA_CHECK(cudaMemcpy(dst, conv16.data(), n * 2, cudaMemcpyHostToDevice));
        }
      }
      dst += n * dtype_size(w.type);
      progress.update(done += v.bytes.size());
    }
    m.weight_bytes += w.bytes;
  }
  std::vector<std::string> extra;
  for (const auto& n : ckpt.names())
    if (!used.count(n) && !n.ends_with("_scale") && !n.ends_with("rotary_emb.inv_freq")) extra.push_back(n);
  if (!extra.empty())
    log::warn("ignoring " + std::to_string(extra.size()) + " checkpoint tensor(s) this architecture does not use, e.g. '" +
              extra.front() + "'");

  auto ptr = [&](size_t slot) -> const void* { return slot == SIZE_MAX ? nullptr : m.weights.data() + slots[slot].offset; };
  auto fptr = [&](size_t slot) { return static_cast<const float*>(ptr(slot)); };
  m.embed = ptr(s_embed);
  m.lm_head = ptr(s_lm);
  m.final_norm = fptr(s_final);
  m.inv_freq = fptr(s_inv);
  for (int i = 0; i < cfg_.num_layers; ++i) {
    const LayerSlots& s = ls[size_t(i)];
    m.lw.push_back({.in_norm = fptr(s.in_norm), .post_norm = fptr(s.post_norm), .q_norm = fptr(s.q_norm),
                    .k_norm = fptr(s.k_norm), .wqkv = ptr(s.qkv), .bqkv = ptr(s.bqkv), .wo = ptr(s.o), .bo = ptr(s.bo),
                    .wgu = ptr(s.gu), .bgu = ptr(s.bgu), .wdown = ptr(s.down), .bdown = ptr(s.bdown)});
    const KVLayerSpec& spec = plan.layers[size_t(i)];
    LayerKV L;
    L.storage = spec.storage;
    L.quant = spec.quant;
    L.kind = spec.attn.kind;
    L.window = spec.attn.window;
    if (spec.quant == KVQuantMode::Fp8PerTensor) {
      L.k_tensor_scale = fptr(s.ks);
      L.v_tensor_scale = fptr(s.vs);
      L.num_tensor_scales = int(spec.k_scale.size());
    }
    m.lkv.push_back(L);
  }
  m.gemm_ws.allocate(cuda::kGemmWorkspaceBytes, "the GEMM workspace");
  m.gemm.set_workspace(m.gemm_ws.data(), m.gemm_ws.bytes());
  if (const char* e = std::getenv("KVLM_CUDA_GRAPHS"); e && std::string_view(e) == "0") m.graphs_on = false;
}

CudaModelRunner::~CudaModelRunner() {
  if (impl_ && impl_->stream) cudaStreamSynchronize(impl_->stream);
}

size_t CudaModelRunner::num_parameters() const { return impl_->num_params; }
size_t CudaModelRunner::weight_bytes() const { return impl_->weight_bytes; }
int CudaModelRunner::kv_num_blocks() const { return impl_->num_blocks; }
size_t CudaModelRunner::kv_bytes() const { return impl_->kv_bytes; }
DType CudaModelRunner::compute_dtype() const { return impl_->act; }
void CudaModelRunner::set_poison_scratch(bool on) { impl_->poison = on; }
int CudaModelRunner::num_cuda_graphs() const { return int(impl_->graphs.size()); }

void CudaModelRunner::set_cuda_graphs(bool on) {
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  impl_->graphs_on = on;
  impl_->clear_graphs();
}

// ---- the KV pool --------------------------------------------------------------------------

void CudaModelRunner::allocate_kv(int num_blocks, int block_size) {
  Impl& m = *impl_;
  if (num_blocks < 1) throw Error("the KV pool needs at least one page, got " + std::to_string(num_blocks));
  validate_block_size(block_size);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.clear_graphs();
  m.kv.reset();
  m.num_blocks = m.block_size = 0;
  m.kv_bytes = 0;
  const size_t kvh = size_t(cfg_.num_kv_heads), d = size_t(cfg_.head_dim), bs = size_t(block_size);
  // Exactly kv/kv_cache.h's layout, per layer: K, V [num_blocks][kvh][block_size][head_dim]
  // of the layer's storage type; per-token-head modes add fp32 [num_blocks][kvh][block_size].
  size_t total = 0;
  std::vector<size_t> offs;
  for (LayerKV& L : m.lkv) {
    L.page_bytes = kvh * bs * d * dtype_size(L.storage);
    L.scale_page_bytes = is_per_token_head(L.quant) ? kvh * bs * sizeof(float) : 0;
    for (size_t part : {L.page_bytes, L.page_bytes, L.scale_page_bytes, L.scale_page_bytes}) {
      offs.push_back(total);
      total += align_up(part * size_t(num_blocks));
      m.kv_bytes += part * size_t(num_blocks);
    }
  }
  m.kv.allocate(total, "the KV cache (" + std::to_string(num_blocks) + " pages of " + std::to_string(block_size) +
                           " tokens; lower the context length or batch size)");
  KVLM_CUDA_CHECK(cudaMemsetAsync(m.kv.data(), 0, total, m.stream));
  std::vector<cuda::KVPagePools> pools;
  for (size_t i = 0; i < m.lkv.size(); ++i) {
    LayerKV& L = m.lkv[i];
    L.k = m.kv.data() + offs[4 * i];
    L.v = m.kv.data() + offs[4 * i + 1];
    L.k_scale = L.scale_page_bytes ? reinterpret_cast<float*>(m.kv.data() + offs[4 * i + 2]) : nullptr;
    L.v_scale = L.scale_page_bytes ? reinterpret_cast<float*>(m.kv.data() + offs[4 * i + 3]) : nullptr;
    pools.push_back({.k = L.k, .v = L.v, .k_scale = reinterpret_cast<uint8_t*>(L.k_scale),
                     .v_scale = reinterpret_cast<uint8_t*>(L.v_scale), .page_bytes = L.page_bytes,
                     .scale_page_bytes = L.scale_page_bytes});
  }
  m.kv_pools.allocate(pools.size() * sizeof(cuda::KVPagePools), "the KV page table");
  KVLM_CUDA_CHECK(cudaMemcpy(m.kv_pools.data(), pools.data(), pools.size() * sizeof(cuda::KVPagePools),
                             cudaMemcpyHostToDevice));
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.num_blocks = num_blocks;
  m.block_size = block_size;
}

void CudaModelRunner::copy_blocks(std::span<const std::pair<BlockId, BlockId>> pairs) {
  Impl& m = *impl_;
  KVLM_CHECK(m.num_blocks > 0, "copy_blocks before allocate_kv");
  if (pairs.empty()) return;
  std::set<BlockId> srcs, dsts;
  bool chained = false;
  for (const auto& [s, d] : pairs) {
    KVLM_CHECK(s >= 0 && s < m.num_blocks && d >= 0 && d < m.num_blocks, "copy_blocks: page id out of range");
    srcs.insert(s);
    chained |= !dsts.insert(d).second;  // a page written twice: order matters
  }
  for (BlockId d : dsts) chained |= srcs.count(d) > 0;
  const size_t bytes = pairs.size() * 2 * sizeof(BlockId);
  BlockId* host = reinterpret_cast<BlockId*>(m.pairs_host.reserve(bytes));
  for (size_t i = 0; i < pairs.size(); ++i) {
    host[2 * i] = pairs[i].first;
    host[2 * i + 1] = pairs[i].second;
  }
  if (bytes > m.pairs_dev.bytes()) {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    m.pairs_dev.allocate(std::max(bytes, size_t(4096)), "copy_blocks");
  }
  KVLM_CUDA_CHECK(cudaMemcpyAsync(m.pairs_dev.data(), host, bytes, cudaMemcpyHostToDevice, m.stream));
  const auto* layers = reinterpret_cast<const cuda::KVPagePools*>(m.kv_pools.data());
  const auto* dev_pairs = reinterpret_cast<const BlockId*>(m.pairs_dev.data());
  if (!chained) {
    cuda::copy_kv_pages(layers, int(m.lkv.size()), dev_pairs, int(pairs.size()), m.stream);
  } else {  // the CPU's sequential semantics: one pair after the other
    for (size_t i = 0; i < pairs.size(); ++i) cuda::copy_kv_pages(layers, int(m.lkv.size()), dev_pairs + 2 * i, 1, m.stream);
  }
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // the pinned pairs may be reused next call
}

void CudaModelRunner::download_kv_layer(size_t layer, LayerKVCache& out) const {
  const Impl& m = *impl_;
  KVLM_CHECK(layer < m.lkv.size() && out.num_blocks == m.num_blocks && out.block_size == m.block_size,
             "download_kv_layer: pool shape differs");
  const LayerKV& L = m.lkv[layer];
  KVLM_CHECK(out.k.size() == L.page_bytes * size_t(m.num_blocks) &&
                 out.k_scale.size() * sizeof(float) == L.scale_page_bytes * size_t(m.num_blocks),
             "download_kv_layer: layer format differs");
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  KVLM_CUDA_CHECK(cudaMemcpy(out.k.data(), L.k, out.k.size(), cudaMemcpyDeviceToHost));
  KVLM_CUDA_CHECK(cudaMemcpy(out.v.data(), L.v, out.v.size(), cudaMemcpyDeviceToHost));
  if (!out.k_scale.empty()) {
    KVLM_CUDA_CHECK(cudaMemcpy(out.k_scale.data(), L.k_scale, out.k_scale.size() * 4, cudaMemcpyDeviceToHost));
    KVLM_CUDA_CHECK(cudaMemcpy(out.v_scale.data(), L.v_scale, out.v_scale.size() * 4, cudaMemcpyDeviceToHost));
  }
}

// ---- forward --------------------------------------------------------------------------------

// Validates the batch, uploads its metadata and enqueues the step on the stream (no sync);
// returns the device buffer holding its logits, [R][vocab] fp32.
float* CudaModelRunner::enqueue(const ForwardBatch& b) {
  Impl& m = *impl_;
  KVLM_CHECK(m.num_blocks > 0, "forward before allocate_kv");
  const int T = int(b.tokens.size()), S = int(b.seqs.size()), R = int(b.logit_rows.size());
  const int vocab = cfg_.vocab_size, bs = m.block_size;
  KVLM_CHECK(T > 0 && S > 0, "forward of an empty batch");
  KVLM_CHECK(b.positions.size() == size_t(T) && b.slots.size() == size_t(T), "batch arrays differ in length");
  for (const TokenId id : b.tokens)
    if (id < 0 || id >= vocab)
      throw Error("token id " + std::to_string(id) + " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
  const SlotId pool_slots = SlotId(m.num_blocks) * bs;
  for (const SlotId s : b.slots) KVLM_CHECK(s < pool_slots, "slot outside the KV pool");
  // The kernels take sequences as consecutive row ranges, in order (cu_q_lens).
  StepShape shape{.T = T, .R = R, .S = S};
  int rows = 0, max_blocks = 1;
  bool decode = true;
  for (const AttnSeq& s : b.seqs) {
    KVLM_CHECK(s.q_begin == rows && s.q_len >= 1 && s.kv_len >= s.q_len,
               "the CUDA runner needs each sequence's rows right after the previous one's, q_len >= 1, kv_len >= q_len");
    const int nb = (s.kv_len + bs - 1) / bs;
    KVLM_CHECK(s.block_table.size() >= size_t(nb), "block table shorter than the sequence");
    for (int i = 0; i < nb; ++i)
      KVLM_CHECK(s.block_table[size_t(i)] >= 0 && s.block_table[size_t(i)] < m.num_blocks, "block id outside the KV pool");
    rows += s.q_len;
    max_blocks = std::max(max_blocks, nb);
    shape.max_q = std::max(shape.max_q, s.q_len);
    shape.max_kv = std::max(shape.max_kv, s.kv_len);
    decode &= s.q_len == 1;
  }
  KVLM_CHECK(rows == T, "sequences must cover every row of the batch");
  for (const int32_t r : b.logit_rows) KVLM_CHECK(r >= 0 && r < T, "logit row out of range");
  shape.MB = max_blocks;

  // A decode step that a graph can serve: pad to (B, MB) buckets.
  bool graph = m.graphs_on && !m.poison && decode && R == T && T <= kMaxGraphBatch;
  for (int i = 0; graph && i < R; ++i) graph = b.logit_rows[size_t(i)] == i;
  if (graph) {
    const int B = next_pow2(T), MB = next_pow2(max_blocks);
    shape = StepShape{.T = B, .R = B, .S = B, .MB = MB, .max_q = 1, .max_kv = MB * bs};
  }
  const StepBuffers buf = m.buffers_for(shape);
  m.ids = buf.ids;
  m.sample = buf.sample;

  // Metadata into pinned memory (same layout as the device region), one copy.
  uint8_t* host = m.meta_host.reserve(buf.meta_bytes);
  auto hp = [&](auto* dev) { return reinterpret_cast<decltype(dev)>(host + (reinterpret_cast<uint8_t*>(dev) - m.scratch.data())); };
  TokenId* h_tokens = hp(buf.tokens);
  Position* h_pos = hp(buf.positions);
  SlotId* h_slots = hp(buf.slots);
  int32_t* h_cu = hp(buf.cu);
  int32_t* h_kvl = hp(buf.kv_lens);
  BlockId* h_tab = hp(buf.tables);
  int32_t* h_rows = hp(buf.logit_rows);
  std::copy(b.tokens.begin(), b.tokens.end(), h_tokens);
  std::copy(b.positions.begin(), b.positions.end(), h_pos);
  std::copy(b.slots.begin(), b.slots.end(), h_slots);
  std::fill_n(h_tab, size_t(shape.S) * size_t(shape.MB), BlockId(-1));
  h_cu[0] = 0;
  for (int s = 0; s < S; ++s) {
    const AttnSeq& q = b.seqs[size_t(s)];
    h_cu[s + 1] = q.q_begin + q.q_len;
    h_kvl[s] = q.kv_len;
    const int nb = (q.kv_len + bs - 1) / bs;
    std::copy_n(q.block_table.begin(), nb, h_tab + size_t(s) * size_t(shape.MB));
  }
  for (int i = T; i < shape.T; ++i) {  // graph padding rows, one per padding sequence
    h_tokens[i] = 0;
    h_pos[i] = 0;
    h_slots[i] = -1;
    h_cu[i + 1] = i + 1;
    h_kvl[i] = 1;
    h_tab[size_t(i) * size_t(shape.MB)] = 0;
  }
  for (int r = 0; r < shape.R; ++r) h_rows[r] = r < R ? b.logit_rows[size_t(r)] : r;
  KVLM_CUDA_CHECK(cudaMemcpyAsync(m.scratch.data(), host, buf.meta_bytes, cudaMemcpyHostToDevice, m.stream));
  if (m.poison)
    KVLM_CUDA_CHECK(cudaMemsetAsync(m.scratch.data() + buf.meta_bytes, 0xff, buf.total - buf.meta_bytes, m.stream));

  if (graph) {
    const auto key = std::make_pair(shape.T, shape.MB);
    auto it = m.graphs.find(key);
    if (it == m.graphs.end() && !m.graph_seen.insert(key).second) {
      cudaGraph_t g = nullptr;
      KVLM_CUDA_CHECK(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeRelaxed));
      try {
        m.run_kernels(shape, buf);
      } catch (...) {
        cudaStreamEndCapture(m.stream, &g);
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
        throw;
      }
      KVLM_CUDA_CHECK(cudaStreamEndCapture(m.stream, &g));
      cudaGraphExec_t exec = nullptr;
      const cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
      cudaGraphDestroy(g);
      KVLM_CUDA_CHECK(err);
      it = m.graphs.emplace(key, exec).first;
    }
    if (it != m.graphs.end()) KVLM_CUDA_CHECK(cudaGraphLaunch(it->second, m.stream));
    else m.run_kernels(shape, buf);
  } else {
    m.run_kernels(shape, buf);
  }

  return buf.logits;
}

void CudaModelRunner::forward(const ForwardBatch& b, std::span<float> logits) {
  const size_t R = b.logit_rows.size(), V = size_t(cfg_.vocab_size);
  KVLM_CHECK(logits.size() == R * V, "logits buffer size");
  const float* dev = enqueue(b);
  std::vector<int32_t> rows(R);
  for (size_t i = 0; i < R; ++i) rows[i] = int32_t(i);
  copy_logit_rows(dev, rows, logits);
}

void CudaModelRunner::copy_logit_rows(const float* dev, std::span<const int32_t> rows, std::span<float> out) {
  Impl& m = *impl_;
  const size_t R = rows.size(), V = size_t(cfg_.vocab_size);
  KVLM_CHECK(out.size() == R * V, "logits buffer size");
  if (R == 0) {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    return;
  }
  // Device -> pinned staging -> the caller's buffer, in chunks of rows: the copy of chunk c
  // into the caller's (pageable) memory, spread over the host's cores, overlaps the DMA of
  // chunk c + 1 (64 rows of a 152k vocabulary are 39 MB: a single-threaded copy after one
  // big DMA took ~5 ms). Consecutive rows go in one DMA.
  const size_t bytes = R * V * sizeof(float);
  auto* staging = reinterpret_cast<float*>(m.logits_host.reserve(bytes));
  const size_t rows_per_chunk = std::max<size_t>(1, (size_t(4) << 20) / (V * sizeof(float)));
  const size_t chunks = (R + rows_per_chunk - 1) / rows_per_chunk;
  while (m.copy_events.size() < chunks) {
    cudaEvent_t e = nullptr;
    KVLM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.copy_events.push_back(e);
  }
  for (size_t c = 0; c < chunks; ++c) {
    const size_t r0 = c * rows_per_chunk, r1 = std::min(R, r0 + rows_per_chunk);
    for (size_t i = r0; i < r1;) {
      size_t j = i + 1;
      while (j < r1 && rows[j] == rows[j - 1] + 1) ++j;
      KVLM_CUDA_CHECK(cudaMemcpyAsync(staging + i * V, dev + size_t(rows[i]) * V, (j - i) * V * sizeof(float),
                                      cudaMemcpyDeviceToHost, m.stream));
      i = j;
    }
    KVLM_CUDA_CHECK(cudaEventRecord(m.copy_events[c], m.stream));
  }
  for (size_t c = 0; c < chunks; ++c) {
    KVLM_CUDA_CHECK(cudaEventSynchronize(m.copy_events[c]));
    const size_t r0 = c * rows_per_chunk, n = (std::min(R, r0 + rows_per_chunk) - r0) * V;
    const float* src = staging + r0 * V;
    float* dst = out.data() + r0 * V;
    constexpr size_t kPiece = size_t(1) << 16;  // floats per parallel piece (256 KB)
    const int64_t pieces = int64_t((n + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(static) if (pieces > 1)
    for (int64_t i = 0; i < pieces; ++i) {
      const size_t o = size_t(i) * kPiece;
      std::memcpy(dst + o, src + o, std::min(kPiece, n - o) * sizeof(float));
    }
  }
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
}

void CudaModelRunner::forward_sampled(const ForwardBatch& b, std::span<const RowSampling> rows,
                                      std::span<TokenId> tokens, std::span<float> host_logits) {
  Impl& m = *impl_;
  const size_t R = b.logit_rows.size(), V = size_t(cfg_.vocab_size);
  KVLM_CHECK(rows.size() == R && tokens.size() == R, "forward_sampled: one RowSampling and one token per logit row");
  std::vector<int32_t> host_rows;
  for (size_t i = 0; i < R; ++i)
    if (!rows[i].on_device) host_rows.push_back(int32_t(i));
  KVLM_CHECK(host_logits.size() == host_rows.size() * V, "forward_sampled: host_logits must hold the host rows' logits");
  const float* dev = enqueue(b);
  const bool any_device = host_rows.size() < R;
  TokenId* ids_host = nullptr;
  if (any_device) {
    // Parameters up, the sampling kernel, token ids down: all queued before the host rows'
    // copy, whose final synchronization covers them.
    uint8_t* pinned = m.sample_host.reserve(R * (sizeof(cuda::SampleRowParams) + sizeof(TokenId)));
    auto* params = reinterpret_cast<cuda::SampleRowParams*>(pinned);
    ids_host = reinterpret_cast<TokenId*>(pinned + R * sizeof(cuda::SampleRowParams));
    for (size_t i = 0; i < R; ++i) {
      const GumbelParams g = gumbel_params(rows[i].params);
      KVLM_CHECK(!rows[i].on_device || !rows[i].params.has_penalties(), "forward_sampled: penalties are applied on the host");
      params[i] = cuda::SampleRowParams{.inv_temperature = g.inv_temperature, .top_k = g.top_k, .top_p = g.top_p,
                                        .min_p_offset = g.min_p_offset, .seed = rows[i].seed,
                                        .counter = rows[i].counter, .skip = rows[i].on_device ? 0 : 1};
    }
    KVLM_CUDA_CHECK(cudaMemcpyAsync(m.sample, params, R * sizeof(cuda::SampleRowParams), cudaMemcpyHostToDevice, m.stream));
    cuda::sample_rows(dev, int(R), int(V), m.sample, m.ids, m.stream);
    KVLM_CUDA_CHECK(cudaMemcpyAsync(ids_host, m.ids, R * sizeof(TokenId), cudaMemcpyDeviceToHost, m.stream));
  }
  copy_logit_rows(dev, host_rows, host_logits);  // ends with a stream synchronization
  if (any_device)
    for (size_t i = 0; i < R; ++i)
      if (rows[i].on_device) tokens[i] = ids_host[i];
}

void CudaModelRunner::forward_greedy(const ForwardBatch& b, std::span<TokenId> tokens) {
  Impl& m = *impl_;
  const int R = int(b.logit_rows.size());
  KVLM_CHECK(tokens.size() == size_t(R), "one token per logit row");
  const float* dev = enqueue(b);
  if (R > 0) {
    cuda::argmax_rows(dev, R, cfg_.vocab_size, m.ids, m.stream);
    auto* host = reinterpret_cast<TokenId*>(m.logits_host.reserve(size_t(R) * sizeof(TokenId)));
    KVLM_CUDA_CHECK(cudaMemcpyAsync(host, m.ids, size_t(R) * sizeof(TokenId), cudaMemcpyDeviceToHost, m.stream));
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    std::copy_n(host, R, tokens.begin());
  } else {
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  }
}

}  // namespace kvlm

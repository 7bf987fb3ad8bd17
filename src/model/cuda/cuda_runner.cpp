// The CUDA model runner (cuda_runner.h): the model definition's forward (model/arch/) on
// the CUDA ops (cuda_ops.h), on the runner's own stream. One step, for T tokens of S
// sequences with R logit rows:
//
//   metadata (tokens, positions, slots, cu_q_lens, kv_lens, block tables, logit rows):
//       packed into pinned host memory, one cudaMemcpyAsync
//   the definition's forward: every op enqueues its kernels (for the Llama family: embedding,
//       per layer fused residual + RMSNorm, the fused QKV GEMM, the attention prologue, paged
//       attention, o GEMM, residual + RMSNorm, the fused gate/up GEMM, SiLU-and-mul + down
//       GEMM; the final norm of the logit rows and the LM head, fp32 logits)
//   logits -> pinned host -> caller's span, or sampling on the GPU and only ids back
//
// Scratch: the step's metadata, then the forward's activations, carved from one arena that
// only grows. A step's layout is measured first (the forward run by the ops in measuring
// mode: nothing launched, bytes counted), then the same forward runs for real at the same
// offsets.
//
// CUDA graphs: a step whose sequences have at most 32 query rows each (decode: one; a
// speculative verification: the last token and its draft; a drafter's blocks; short prompts
// beside decodes) runs as a graph of its shape, captured once and replayed. The shape: S
// sequences of Q rows at most (T rows in all), a block-table stride MB (the longest table,
// to a power of two), R logit rows (to a power of two, at most T), target or drafter pass.
// When every sequence has Q rows (decode, verification of equal drafts, drafter blocks), S
// is padded to a power of two with padding sequences of Q rows, so a batch that grows or
// shrinks reuses a few graphs; when the sequences' rows differ (drafts of different
// lengths, a short prompt), S and T are kept as they are (padding the rows would cost
// GEMM work for every sequence; a vLLM-style padding of the token count would need
// zero-row sequences the kernels do not take).
// Everything a graph bakes in is a function of that key: buffer addresses (the arena is
// carved deterministically from the shape and only grows, which drops every graph), the
// attention kernel and split count (planned for max_q_len = Q and max_kv_len = MB *
// block_size; the kernels read each sequence's rows and key range from cu_q_lens and kv_lens
// in memory), GEMM shapes (and their tuned algorithms, chosen in the eager run before
// capture); which rows are logit rows is read from memory too. Padding sequences have Q rows
// with slot -1 (nothing stored), kv_len Q and page 0 in their table (a valid page: read,
// never used); padding logit rows are computed and dropped. A shape runs eagerly the first
// time it is seen (warming cuBLASLt's heuristics and the kernels' one-time attributes) and
// is captured the second time; at most 512 graphs are kept, the least recently used dropped
// first.
#include "kv/kv_formats.h"
#include "model/cuda/cuda_runner_impl.h"
#include "ops/cuda/gated_deltanet.h"

#include "io/grouped_codes.h"

namespace kvlm {

namespace {

// Scales of a kept FP8 weight's 128 x 128 blocks (the FP8 GEMM's layout), or 0: not
// block-scaled, or a shape the block-scaled GEMM does not take, or pieces whose rows do not
// start on a block row.
size_t block_scale_count(const WeightSpec& s, int scale_block) {
  if (scale_block != 128 || scale_block >= s.cols() || !cuda::fp8_gemm_fits(int(s.rows()), int(s.cols()), scale_block))
    return 0;
  for (const WeightPiece& p : s.pieces)
    if (p.shape.empty() || p.shape[0] % 128 != 0) return 0;
  return size_t((s.rows() + 127) / 128) * size_t(cuda::fp8_block_scale_ld(int(s.cols())));
}

// Whether an FP8 weight with this scale block runs the FP8 GEMM above m = 16.
bool fp8_gemm_takes(const WeightSpec& s, int scale_block) {
  if (scale_block >= s.cols()) return cuda::fp8_gemm_fits(int(s.rows()), int(s.cols()), scale_block);
  return block_scale_count(s, scale_block) > 0;
}

}  // namespace

// A matrix kept as grouped codes is held in parts, one per run of consecutive pieces whose
// block types share a layout (a fused q/k/v of Q4_K and Q6_K pieces: two parts): each part's
// codes [rows][cols * bits / 8], then its (scale, offset) words [rows][cols / group].
struct CodeRun {
  GroupedLayout layout;
  size_t first = 0, count = 0;  // pieces
  int64_t rows = 0;
};
std::vector<CodeRun> code_runs(std::span<const uint32_t> types, std::span<const int64_t> piece_rows) {
  std::vector<CodeRun> runs;
  for (size_t i = 0; i < types.size(); ++i) {
    const GroupedLayout l = *grouped_layout_of_ggml(types[i]);
    if (runs.empty() || !(runs.back().layout == l)) runs.push_back(CodeRun{.layout = l, .first = i});
    runs.back().count++;
    runs.back().rows += piece_rows[i];
  }
  return runs;
}
size_t code_bytes(const CodeRun& r, int64_t cols) { return align_up(size_t(r.rows) * grouped_code_bytes(r.layout, cols)); }
size_t param_bytes(const CodeRun& r, int64_t cols) {
  return align_up(size_t(r.rows) * size_t(grouped_groups(r.layout, cols)) * sizeof(uint32_t));
}
std::vector<int64_t> piece_rows(const WeightSpec& s) {
  std::vector<int64_t> rows;
  for (const auto& p : s.pieces) rows.push_back(p.held_shape().at(0));
  return rows;
}

// Puts the weights in one device allocation, each in its role's type (matrices and biases in
// the compute dtype, norms and constants in fp32), converting on the host where the
// checkpoint's dtype differs. FP8 projections (SpecQuant::fp8) stay FP8 where the GPU runs
// FP8 weights (sm_89+) and the layout fits the kernels: codes [rows][cols], then fp32 scales
// [rows][ceil(cols / scale_block)] (per-tensor and per-channel scales become one per row,
// block scales one per row and column block); elsewhere they are dequantized to the compute
// dtype here, with a warning. GGUF matrices whose block type has a grouped-code layout stay
// quantized (CudaRunnerOptions::keep_blocks): their blocks become grouped codes here, scales
// and offsets in the compute dtype (store_blocks).
class CudaModelRunner::WeightUploader final : public WeightSink {
 public:
  WeightUploader(Impl& m, DeviceBuffer& into) : m_(m), into_(into) {
    const auto gpus = cuda_devices();
    if (m_.device >= 0 && m_.device < int(gpus.size())) cc_ = gpus[size_t(m_.device)].compute_capability;
  }
  bool keeps_blocks(uint32_t type) const override {
    return m_.keep_blocks && cc_ >= 80 && grouped_layout_of_ggml(type).has_value();
  }
  void reserve(std::span<const WeightSpec> specs, std::span<const SpecQuant> quant) override {
    const int cc = cc_;
    // FP8 on the GPU halves the weights' memory and speeds up decode up to batch 16 (gemv_fp8).
    // Above it and in prefill, a weight with one scale per row, or with 128 x 128 blocks that
    // its pieces' rows align with, runs the FP8 tensor-core GEMM on activations quantized per
    // token (Gemm::linear_fp8: Hopper's cuBLASLt), faster than a 16-bit weight; any other is
    // dequantized before a 16-bit GEMM, slower than a 16-bit weight. By default the weights
    // stay FP8 on Hopper when every one takes the GEMM, and anywhere their 16-bit copy would
    // take more than half of the GPU.
    size_t dense = 0, fp8_specs = 0, fp8_gemm_ok = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      dense += size_t(specs[i].rows() * specs[i].cols()) * dtype_size(gpu_weight_dtype(specs[i].role, m_.act));
      fp8_specs += quant[i].fp8;
      fp8_gemm_ok += quant[i].fp8 && fp8_gemm_takes(specs[i], quant[i].scale_block);
    }
    using Policy = cuda::KernelSwitches::Fp8Weights;
    const Policy policy = cuda::kernel_switches().fp8_weights;
    const auto mem = cuda_memory_info(m_.device);
    const bool large = mem && dense > mem->total / 2;
    const bool gemm = cc >= 90 && fp8_gemm_ok == fp8_specs;
    const bool want_fp8 = policy == Policy::Keep || (policy == Policy::Auto && (large || gemm));
    if (fp8_specs > 0 && cuda::fp8_weights_supported(cc) && !m_.fp8_policy_said) {
      const std::string act(dtype_name(m_.act));
      log::info(want_fp8 ? "FP8 weights stay FP8 on the GPU" +
                               std::string(policy == Policy::Keep ? ""
                                           : gemm ? ""
                                                  : " (their " + act + " copy would take more than half of its memory)") +
                               (gemm ? ": half the memory; batches above 16 and prefill quantize activations per "
                                       "token for FP8 tensor-core GEMMs"
                                     : ": half the memory, faster up to batch 16, slower than " + act +
                                           " weights above it and in prefill (block scales: dequantized per GEMM)")
                         : "FP8 weights are dequantized to " + act +
                               " at load: they fit, and with " +
                               (cc >= 90 ? std::string("block scales") : std::string("this GPU")) +
                               " that is faster above batch 16 and in prefill (weights that would not fit in half of "
                               "the GPU stay FP8)");
      m_.fp8_policy_said = true;
    }
    size_t total = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
      const WeightSpec& s = specs[i];
      offsets_.push_back(total);
      if (!quant[i].block_types.empty()) {  // grouped codes (store_blocks)
        keep_.push_back(false);
        blocks_.push_back(0);
        for (const CodeRun& r : code_runs(quant[i].block_types, piece_rows(s)))
          total += code_bytes(r, s.cols()) + param_bytes(r, s.cols());
        // Stacked experts dequantize a run of experts into the MoE workspace instead (moe.h).
        if (!s.experts) m_.fp8_scratch_elems = std::max(m_.fp8_scratch_elems, size_t(s.rows() * s.cols()));
        continue;
      }
      const bool fits = quant[i].fp8 && cuda::fp8_layout_fits(int(s.cols()), quant[i].scale_block);
      const bool keep = want_fp8 && fits && cuda::fp8_weights_supported(cc);
      keep_.push_back(keep);
      if (quant[i].fp8 && want_fp8 && !keep && !warned_fp8_) {
        log::warn(fits ? "this GPU (compute capability " + std::to_string(cc / 10) + "." + std::to_string(cc % 10) +
                             ") has no FP8 instructions: FP8 weights are dequantized to " +
                             std::string(dtype_name(m_.act)) + " at load (twice the memory and no FP8 speed-up)"
                       : "FP8 weight '" + s.pieces[0].name + "' has a shape the FP8 kernels do not take (input size " +
                             std::to_string(s.cols()) + " not a multiple of 16): such weights are dequantized to " +
                             std::string(dtype_name(m_.act)) + " at load");
        warned_fp8_ = true;
      }
      if (keep) {
        const size_t nb = size_t((s.cols() + quant[i].scale_block - 1) / quant[i].scale_block);
        blocks_.push_back(quant[i].scale_block);
        total += align_up(size_t(s.rows() * s.cols())) + align_up(size_t(s.rows()) * nb * sizeof(float)) +
                 align_up(block_scale_count(s, quant[i].scale_block) * sizeof(float));
        m_.fp8_scratch_elems = std::max(m_.fp8_scratch_elems, size_t(s.rows() * s.cols()));
        m_.fp8_max_cols = std::max(m_.fp8_max_cols, int(s.cols()));
        const int group = quant[i].scale_block >= s.cols() ? 0 : quant[i].scale_block == 128 ? 128 : -1;
        m_.fp8_act_group = !m_.fp8_act_group || *m_.fp8_act_group == group ? group : -1;
      } else {
        blocks_.push_back(0);
        total += align_up(size_t(s.rows() * s.cols()) * dtype_size(gpu_weight_dtype(s.role, m_.act)));
      }
    }
    into_.allocate(total, "the model weights");
  }
  Weight store_blocks(const WeightSpec& s, std::span<const Checkpoint::Blocks> pieces) override {
    const size_t index = next_++;
    uint8_t* at = into_.data() + offsets_[index];
    const int64_t cols = s.cols();
    std::vector<uint32_t> types;
    for (const auto& p : pieces) types.push_back(p.type);
    auto& parts = m_.weight_codes.emplace_back();
    std::vector<uint8_t> rows_in, codes;
    std::vector<uint32_t> params;
    std::vector<float> sc, off;
    int64_t row0 = 0;
    for (const CodeRun& r : code_runs(types, piece_rows(s))) {
      const size_t cb = grouped_code_bytes(r.layout, cols), ng = size_t(grouped_groups(r.layout, cols));
      codes.resize(size_t(r.rows) * cb);
      params.resize(size_t(r.rows) * ng);
      sc.resize(ng);
      off.resize(ng);
      int64_t row = 0;
      for (size_t pi = r.first; pi < r.first + r.count; ++pi) {
        const Checkpoint::Blocks& p = pieces[pi];
        rows_in.resize(size_t(p.rows) * p.row_bytes);
        copy_block_rows(p, rows_in.data());  // Hugging Face's row order
        for (int64_t i = 0; i < p.rows; ++i, ++row) {
          ggml_row_to_grouped(p.type, rows_in.data() + size_t(i) * p.row_bytes, cols, codes.data() + size_t(row) * cb,
                              sc.data(), off.data());
          for (size_t g = 0; g < ng; ++g) {
            try {
              params[size_t(row) * ng + g] = r.layout.zero_point ? grouped_param_zero_point(m_.act, sc[g], int(off[g]))
                                             : r.layout.e2m1     ? grouped_param_e2m1(m_.act, sc[g])
                                                                 : grouped_param(m_.act, sc[g], off[g]);
            } catch (const Error& e) {
              throw Error("tensor '" + s.pieces[pi].name + "': " + e.what() + "; run it with " +
                          (r.layout.e2m1 ? "" : "--dtype bfloat16 or ") + "--dequantize-weights");
            }
          }
        }
      }
      const size_t cbytes = code_bytes(r, cols);
      KVLM_CUDA_CHECK(cudaMemcpy(at, codes.data(), codes.size(), cudaMemcpyHostToDevice));
      KVLM_CUDA_CHECK(cudaMemcpy(at + cbytes, params.data(), params.size() * sizeof(uint32_t), cudaMemcpyHostToDevice));
      parts.push_back(WeightCodes{.row0 = row0, .rows = r.rows, .bits = r.layout.bits, .group = r.layout.group,
                                  .zero_point = r.layout.zero_point, .e2m1 = r.layout.e2m1, .codes = at,
                                  .params = reinterpret_cast<const uint32_t*>(at + cbytes)});
      m_.weight_bytes += codes.size() + params.size() * sizeof(uint32_t);
      at += cbytes + param_bytes(r, cols);
      row0 += r.rows;
    }
    return Weight{.data = parts.front().codes, .dtype = DType::U8, .rows = s.rows(), .cols = cols, .codes = parts};
  }
  Weight store(const WeightSpec& s, std::span<const TensorView> pieces, std::span<const PieceQuant> quant,
               std::span<const float> values) override {
    const size_t index = next_++;
    if (keep_[index]) return store_fp8(s, pieces, quant, into_.data() + offsets_[index], blocks_[index]);
    const DType type = gpu_weight_dtype(s.role, m_.act);
    uint8_t* const base = into_.data() + offsets_[index];
    uint8_t* dst = base;
    if (!values.empty() || pieces.empty()) {
      KVLM_CHECK(type == DType::F32, "fp32 values for a 16-bit weight");
      KVLM_CUDA_CHECK(cudaMemcpy(dst, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
    } else {
      for (size_t i = 0; i < pieces.size(); ++i) {
        const TensorView& v = pieces[i];
        const TensorInfo& t = *v.info;
        const size_t n = size_t(t.numel());
        if (t.dtype == type && !quant[i]) {
          KVLM_CUDA_CHECK(cudaMemcpy(dst, v.bytes.data(), v.bytes.size(), cudaMemcpyHostToDevice));
        } else {
          conv32_.resize(n);
          piece_to_f32(v, quant[i], conv32_);  // FP8 pieces not kept as FP8: their values, dequantized
          if (type == DType::F32) {
            KVLM_CUDA_CHECK(cudaMemcpy(dst, conv32_.data(), n * sizeof(float), cudaMemcpyHostToDevice));
          } else {
            conv16_.resize(n);
            for (size_t i = 0; i < n; ++i)
              conv16_[i] = type == DType::BF16 ? num::f32_to_bf16(conv32_[i]) : num::f32_to_f16(conv32_[i]);
            KVLM_CUDA_CHECK(cudaMemcpy(dst, conv16_.data(), n * 2, cudaMemcpyHostToDevice));
          }
        }
        dst += n * dtype_size(type);
      }
    }
    const size_t bytes = size_t(s.rows() * s.cols()) * dtype_size(type);
    if (!pieces.empty()) m_.weight_bytes += bytes;
    return Weight{.data = base, .dtype = type, .rows = s.rows(), .cols = s.cols()};
  }

 private:
  // Codes and one scale row per weight row, piece by piece (rows concatenate).
  Weight store_fp8(const WeightSpec& s, std::span<const TensorView> pieces, std::span<const PieceQuant> quant,
                   uint8_t* base, int scale_block) {
    const int64_t cols = s.cols();
    const size_t nb = size_t((cols + scale_block - 1) / scale_block);
    uint8_t* codes = base;
    float* const scales_dev = reinterpret_cast<float*>(base + align_up(size_t(s.rows() * cols)));
    std::vector<float> scales;
    scales.reserve(size_t(s.rows()) * nb);
    std::vector<uint8_t> q;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const TensorView& v = pieces[i];
      const int64_t rows = v.info->shape[0];
      const size_t n = size_t(rows * cols);
      if (quant[i].fp8()) {  // the checkpoint's codes; its scales, one row per weight row
        KVLM_CUDA_CHECK(cudaMemcpy(codes, v.bytes.data(), n, cudaMemcpyHostToDevice));
        const std::vector<float> rs = fp8_row_scales(quant[i], rows, cols);
        KVLM_CHECK(rs.size() == size_t(rows) * nb, "the piece's scale block differs from the weight's");
        scales.insert(scales.end(), rs.begin(), rs.end());
      } else {  // --quantization fp8: quantized here, per row
        KVLM_CHECK(quant[i].quantize && nb == 1, "an FP8 weight piece with neither codes nor quantization");
        conv32_.resize(n);
        convert_to_f32(v.info->dtype, v.bytes, conv32_);
        q.resize(n);
        const std::vector<float> rs = fp8_quantize_rows(conv32_, rows, cols, q);
        KVLM_CUDA_CHECK(cudaMemcpy(codes, q.data(), n, cudaMemcpyHostToDevice));
        scales.insert(scales.end(), rs.begin(), rs.end());
      }
      codes += n;
    }
    KVLM_CHECK(scales.size() == size_t(s.rows()) * nb, "one scale row per weight row");
    KVLM_CUDA_CHECK(cudaMemcpy(scales_dev, scales.data(), scales.size() * sizeof(float), cudaMemcpyHostToDevice));
    m_.weight_bytes += size_t(s.rows() * cols) + scales.size() * sizeof(float);
    // 128 x 128 blocks: one scale per block for the FP8 GEMM, when every block's rows share
    // their scales (each piece starts on a block row).
    const float* block_dev = nullptr;
    if (const size_t count = block_scale_count(s, scale_block); count > 0) {
      const size_t rb = size_t((s.rows() + 127) / 128), ld = size_t(cuda::fp8_block_scale_ld(int(cols)));
      std::vector<float> blocks(rb * ld, 0.0f);  // (padding: never a block's scale)
      bool same = true;
      for (size_t r = 0; r < size_t(s.rows()); ++r)
        for (size_t c = 0; c < nb; ++c) {
          const float v = scales[r * nb + c];
          if (r % 128 == 0) blocks[(r / 128) * ld + c] = v;
          else same &= v == blocks[(r / 128) * ld + c];
        }
      if (same) {
        auto* dst = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(scales_dev) + align_up(scales.size() * sizeof(float)));
        KVLM_CUDA_CHECK(cudaMemcpy(dst, blocks.data(), count * sizeof(float), cudaMemcpyHostToDevice));
        block_dev = dst;
      }
    }
    return Weight{.data = base, .dtype = DType::F8E4M3, .rows = s.rows(), .cols = cols, .scales = scales_dev,
                  .scale_block = scale_block, .block_scales = block_dev};
  }

  Impl& m_;
  DeviceBuffer& into_;
  std::vector<size_t> offsets_;
  std::vector<bool> keep_;
  std::vector<int> blocks_;
  size_t next_ = 0;
  std::vector<uint16_t> conv16_;
  std::vector<float> conv32_;
  bool warned_fp8_ = false;
  int cc_ = 0;
};

// ---- loading ------------------------------------------------------------------------------

CudaModelRunner::CudaModelRunner(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan, DType compute,
                                 CudaRunnerOptions opts, const DrafterSource* drafter)
    : cfg_(std::move(config)) {
  const DeviceScope on(opts.device);
  impl_ = std::make_unique<Impl>();  // its cuBLASLt handle belongs to the current device
  Impl& m = *impl_;
  m.device = opts.device;
  m.keep_blocks = opts.keep_blocks;
  m.cfg = cfg_;
  if (compute != DType::BF16 && compute != DType::F16)
    throw Error("the CUDA runner computes in bfloat16 or float16, not " + std::string(dtype_name(compute)) +
                "; use --dtype bfloat16 or float16 (or --device cpu)");
  m.act = compute;
  m.plan = &plan;
  KVLM_CHECK(plan.layers.size() == size_t(cfg_.num_kv_layers()) + (drafter ? size_t(drafter->config.num_layers) : 0),
             "one KV spec per layer");
  for (const auto& l : plan.layers)
    if (l.backend != "cuda")
      throw Error("the CUDA runner runs every layer on the 'cuda' attention backend, but " + describe_layer(l) +
                  " was assigned '" + l.backend + "'");
  if (cfg_.moe) {
    const int world = opts.comm ? opts.comm->world_size() : 1;
    const int inter = int(tp_layout(cfg_, world).expert_width);
    if (!cuda::moe_fits(cfg_.hidden_size, inter, cfg_.moe->num_experts, cfg_.moe->top_k))
      throw Error(std::string(arch_name(cfg_.arch)) + ": the CUDA expert kernels need hidden_size (" +
                  std::to_string(cfg_.hidden_size) + ") and each rank's expert width (" + std::to_string(inter) +
                  ") to be multiples of 32 and at most 16 of 1024 experts per token; run it with --device cpu");
  }
  if (opts.comm) m.comm = opts.comm;
  const TpRank tp{m.comm->rank(), m.comm->world_size()};
  KVLM_CHECK(tp.world == 1 || !drafter, "a drafter under tensor parallelism");
  const ModelConfig rank_cfg = tp.world > 1 ? shard_config(cfg_, tp) : cfg_;
  m.def = make_model_definition(rank_cfg);
  if (rank_cfg.linear_attention) m.state_bytes = rank_cfg.linear_attention->state_bytes();  // the rank's heads
  KVLM_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  KVLM_CUDA_CHECK(cudaEventCreateWithFlags(&m.forward_done, cudaEventDisableTiming));
  WeightUploader up(m, m.weights);
  // The checkpoint's shapes are the whole model's: the list comes from its definition.
  const std::unique_ptr<ModelDefinition> whole =
      tp.world > 1 ? make_model_definition(weight_config(cfg_, tp.world)) : nullptr;
  LoadedWeights lw = load_weights((whole ? *whole : *m.def).weights(), ckpt, up, cfg_.weight_quant, tp);
  m.w = std::move(lw.weights);
  m.num_params = lw.num_params;
  m.block_tensors = lw.block_tensors;
  std::vector<int> slot_of;
  if (drafter) {
    m.draft_def = make_dflash_draft(drafter->config, drafter->prefix, cfg_.num_kv_layers());
    WeightUploader dup(m, m.draft_weights);
    LoadedWeights dw = load_weights(m.draft_def->weights(), *drafter->checkpoint, dup, drafter->config.weight_quant);
    m.draft_w = std::move(dw.weights);
    m.draft_w.push_back(m.w[m.def->embedding_index()]);
    m.draft_w.push_back(m.w[m.def->lm_head_index()]);
    m.num_params += dw.num_params;
    slot_of.assign(size_t(cfg_.num_layers), -1);
    int slot = 0;
    for (int l : m.draft_def->feature_layers()) slot_of[size_t(l)] = slot++;
  }

  m.build_kv_layers();
  if (const auto& la = cfg_.linear_attention; la && !cuda::gated_delta_net_fits(la->k_dim, la->v_dim, la->conv_kernel))
    throw Error("this model's Gated DeltaNet layers (key heads of " + std::to_string(la->k_dim) + ", a conv kernel of " +
                std::to_string(la->conv_kernel) + " taps) are larger than the CUDA kernels take (128 and 8); use --device cpu");
  m.gemm_ws.allocate(cuda::kGemmWorkspaceBytes, "the GEMM workspace");
  m.gemm.set_workspace(m.gemm_ws.data(), m.gemm_ws.bytes());
  // A rank other than 0 forms no logits (it has no LM head: model/tensor_parallel.h).
  m.ops = std::make_unique<CudaOps>(m.act, m.stream, m.gemm, *m.comm, /*logits=*/tp.rank == 0);
  if (m.fp8_scratch_elems > 0) {
    m.fp8_scratch.allocate(m.fp8_scratch_elems * dtype_size(m.act), "the quantized weights' dequantization buffer");
    m.ops->set_fp8_scratch(m.fp8_scratch.data(), m.fp8_max_cols, m.fp8_act_group.value_or(-1));
  }
  m.ops->set_kv(m.lkv, 0, 0);
  if (m.draft_def) m.ops->set_capture(std::move(slot_of), cfg_.hidden_size);
  m.graphs_on = opts.cuda_graphs;
  m.gemm.set_small_m_kernel(opts.small_m_gemv);
}

void CudaModelRunner::Impl::build_kv_layers() {
  lkv.clear();
  kv_tensor_scales.reset();
  // Static FP8 scales (fp8_per_tensor layers), one small allocation.
  std::vector<float> scales;
  std::vector<size_t> scale_at(plan->layers.size(), SIZE_MAX);
  for (size_t i = 0; i < plan->layers.size(); ++i) {
    const KVLayerSpec& spec = plan->layers[i];
    if (spec.k.mode != KVQuantMode::Fp8PerTensor) continue;
    KVLM_CHECK(spec.k_scale.size() == spec.v_scale.size(), "k and v scales differ in count");
    scale_at[i] = scales.size();
    scales.insert(scales.end(), spec.k_scale.begin(), spec.k_scale.end());
    scales.insert(scales.end(), spec.v_scale.begin(), spec.v_scale.end());
  }
  if (!scales.empty()) {
    kv_tensor_scales.allocate(scales.size() * sizeof(float), "the KV scales");
    KVLM_CUDA_CHECK(cudaMemcpy(kv_tensor_scales.data(), scales.data(), scales.size() * sizeof(float),
                               cudaMemcpyHostToDevice));
  }
  for (size_t i = 0; i < plan->layers.size(); ++i) {
    const KVLayerSpec& spec = plan->layers[i];
    CudaKVLayer L;
    L.num_q_heads = spec.attn.num_q_heads;
    L.num_kv_heads = spec.attn.num_kv_heads;
    L.head_dim = spec.attn.head_dim;
    // K and V in two formats: a pair the kernels read (the selector refused the others for 'cuda').
    KVLM_CHECK(spec.k == spec.v || kv_pair_in(spec.k, spec.v, KVFormatSet::Cuda), "a CUDA layer with a K / V pair the kernels lack");
    L.storage = spec.k.storage;
    L.quant = spec.k.mode;
    if (spec.v != spec.k) L.v_format = spec.v;
    L.rotate_k = spec.rotate_k;
    L.rotate_v = spec.rotate_v;
    L.rotation_seed = spec.rotation_seed;
    L.kind = spec.attn.kind;
    L.window = spec.attn.window;
    if (scale_at[i] != SIZE_MAX) {
      const float* s = reinterpret_cast<const float*>(kv_tensor_scales.data()) + scale_at[i];
      L.num_tensor_scales = int(spec.k_scale.size());
      L.k_tensor_scale = s;
      L.v_tensor_scale = s + spec.k_scale.size();
    }
    lkv.push_back(L);
  }
}

CudaModelRunner::~CudaModelRunner() {
  if (!impl_) return;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = impl_->device;
  cudaSetDevice(impl_->device);
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  impl_.reset();  // frees device memory on the runner's device
  cudaSetDevice(previous);
}

size_t CudaModelRunner::num_parameters() const { return impl_->num_params; }
size_t CudaModelRunner::block_tensors() const { return impl_->block_tensors; }
namespace {
// A weight's bytes as held: grouped codes with their parameters, or its elements (FP8 codes
// without their scales).
size_t held_bytes(const Weight& w) {
  if (w.codes.empty()) return size_t(w.numel()) * dtype_size(w.dtype);
  size_t n = 0;
  for (const WeightCodes& c : w.codes) n += size_t(c.rows) * grouped_row_bytes({c.bits, c.group}, w.cols);
  return n;
}
}  // namespace

size_t CudaModelRunner::embedding_bytes() const { return held_bytes(impl_->w[impl_->def->embedding_index()]); }
size_t CudaModelRunner::expert_bytes() const {
  const auto& specs = impl_->def->weights().specs;
  size_t n = 0;
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].experts) n += held_bytes(impl_->w[i]);
  return n;
}
size_t CudaModelRunner::weight_bytes() const { return impl_->weight_bytes; }
int CudaModelRunner::kv_num_blocks() const { return impl_->num_blocks; }
size_t CudaModelRunner::kv_bytes() const { return impl_->kv_bytes; }
DType CudaModelRunner::compute_dtype() const { return impl_->act; }
int CudaModelRunner::device_index() const { return impl_->device; }

void CudaModelRunner::set_small_m_gemv(bool on) {
  const DeviceScope dev(impl_->device);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  impl_->gemm.set_small_m_kernel(on);
  impl_->clear_graphs();  // captured GEMMs bake in the kernel choice
}
void CudaModelRunner::set_poison_scratch(bool on) { impl_->poison = on; }
int CudaModelRunner::num_cuda_graphs() const { return int(impl_->graphs.size()); }

void CudaModelRunner::set_pooling(bool on) {
  KVLM_CHECK(!on || !has_drafter(), "a pooling runner with a drafter");
  const DeviceScope dev(impl_->device);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  ModelRunner::set_pooling(on);
  impl_->ops->set_pooling(on);
  impl_->clear_graphs();  // they were captured computing logits
}

void CudaModelRunner::set_cuda_graphs(bool on) {
  const DeviceScope dev(impl_->device);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  impl_->graphs_on = on;
  impl_->clear_graphs();
}

// ---- the KV pool --------------------------------------------------------------------------

void CudaModelRunner::kv_plan_changed() {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  m.drop_kv();
  m.build_kv_layers();
  m.ops->set_kv(m.lkv, 0, 0);
}

void CudaModelRunner::allocate_kv(int num_blocks, int block_size, int num_exact_pages) {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  if (num_blocks < 1) throw Error("the KV pool needs at least one page, got " + std::to_string(num_blocks));
  const bool keeps = std::ranges::any_of(m.plan->layers, [](const KVLayerSpec& l) { return l.keeps_exact(); });
  KVLM_CHECK(num_exact_pages >= 0 && (!keeps || num_exact_pages > 0), "layers keep exact tokens but no exact pages were given");
  validate_block_size(block_size);
  m.drop_kv();
  // kv/kv_cache.h's layout, per layer: K, V [num_blocks][kvh][block_size][head_dim] of the
  // layer's storage type; per-token-head modes add fp32 [num_blocks][kvh][block_size].
  size_t total = 0;
  std::vector<size_t> offs;
  for (size_t i = 0; i < m.lkv.size(); ++i) {
    CudaKVLayer& L = m.lkv[i];
    const KVPageBytes page = ::kvlm::kv_page_bytes(m.plan->layers[i], block_size);
    L.k_page_bytes = page.k_codes;
    L.v_page_bytes = page.v_codes;
    L.k_scale_page_bytes = page.k_scales;
    L.v_scale_page_bytes = page.v_scales;
    for (size_t part : {L.k_page_bytes, L.v_page_bytes, L.k_scale_page_bytes, L.v_scale_page_bytes}) {
      offs.push_back(total);
      total += align_up(part * size_t(num_blocks));
      m.kv_bytes += part * size_t(num_blocks);
    }
  }
  m.kv.allocate(total, "the KV cache (" + std::to_string(num_blocks) + " pages of " + std::to_string(block_size) +
                           " tokens; lower the context length or batch size)");
  KVLM_CUDA_CHECK(cudaMemsetAsync(m.kv.data(), 0, total, m.stream));
  std::vector<cuda::KVPagePools> pools;
  uint64_t packed_offset = 0;  // the host tier's packed page (pack_kv_pages)
  for (size_t i = 0; i < m.lkv.size(); ++i) {
    CudaKVLayer& L = m.lkv[i];
    L.k = m.kv.data() + offs[4 * i];
    L.v = m.kv.data() + offs[4 * i + 1];
    L.k_scale = L.k_scale_page_bytes ? reinterpret_cast<float*>(m.kv.data() + offs[4 * i + 2]) : nullptr;
    L.v_scale = L.v_scale_page_bytes ? reinterpret_cast<float*>(m.kv.data() + offs[4 * i + 3]) : nullptr;
    pools.push_back({.k = L.k, .v = L.v, .k_scale = reinterpret_cast<uint8_t*>(L.k_scale),
                     .v_scale = reinterpret_cast<uint8_t*>(L.v_scale), .k_page_bytes = L.k_page_bytes,
                     .v_page_bytes = L.v_page_bytes, .k_scale_page_bytes = L.k_scale_page_bytes,
                     .v_scale_page_bytes = L.v_scale_page_bytes, .page_offset = packed_offset});
    packed_offset += L.k_page_bytes + L.v_page_bytes + L.k_scale_page_bytes + L.v_scale_page_bytes;
  }
  // Exact pages: [num_exact][kvh][block_size][head_dim] in the act dtype, K then V, for each
  // keeping layer (kv/kv_cache.h).
  if (keeps) {
    size_t etotal = 0;
    std::vector<size_t> eoffs;
    for (size_t i = 0; i < m.lkv.size(); ++i) {
      const KVLayerSpec& spec = m.plan->layers[i];
      KVLM_CHECK(!spec.keeps_exact() || spec.exact_storage == m.act, "exact pages in another dtype than the model's");
      CudaKVLayer& L = m.lkv[i];
      L.exact_page_bytes = ::kvlm::kv_page_bytes(spec, block_size).exact;
      L.keep_sink = spec.keep_sink;
      L.keep_recent = spec.keep_recent;
      eoffs.push_back(etotal);
      etotal += 2 * align_up(L.exact_page_bytes * size_t(num_exact_pages));
      m.kv_bytes += 2 * L.exact_page_bytes * size_t(num_exact_pages);
    }
    m.exact.allocate(etotal, "the exact sink / recent tokens (" + std::to_string(num_exact_pages) +
                                 " pages; lower --max-num-seqs or the kept tokens)");
    KVLM_CUDA_CHECK(cudaMemsetAsync(m.exact.data(), 0, etotal, m.stream));
    // The host tier's table of them: K then V exact rows per keeping layer, no scales
    // (KVCache::save_exact_page's layout).
    std::vector<cuda::KVPagePools> epools;
    uint64_t eoffset = 0;
    for (size_t i = 0; i < m.lkv.size(); ++i) {
      CudaKVLayer& L = m.lkv[i];
      if (L.exact_page_bytes == 0) continue;
      const size_t part = align_up(L.exact_page_bytes * size_t(num_exact_pages));
      L.exact_k = reinterpret_cast<uint16_t*>(m.exact.data() + eoffs[i]);
      L.exact_v = reinterpret_cast<uint16_t*>(m.exact.data() + eoffs[i] + part);
      epools.push_back({.k = reinterpret_cast<uint8_t*>(L.exact_k), .v = reinterpret_cast<uint8_t*>(L.exact_v),
                        .k_page_bytes = L.exact_page_bytes, .v_page_bytes = L.exact_page_bytes, .page_offset = eoffset});
      eoffset += 2 * L.exact_page_bytes;
    }
    m.exact_pools.allocate(epools.size() * sizeof(cuda::KVPagePools), "the exact page table");
    KVLM_CUDA_CHECK(cudaMemcpy(m.exact_pools.data(), epools.data(), epools.size() * sizeof(cuda::KVPagePools),
                               cudaMemcpyHostToDevice));
    m.num_exact = num_exact_pages;
    m.num_exact_layers = int(epools.size());
  }
  m.kv_pools.allocate(pools.size() * sizeof(cuda::KVPagePools), "the KV page table");
  KVLM_CUDA_CHECK(cudaMemcpy(m.kv_pools.data(), pools.data(), pools.size() * sizeof(cuda::KVPagePools),
                             cudaMemcpyHostToDevice));
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.num_blocks = num_blocks;
  m.block_size = block_size;
  m.ops->set_kv(m.lkv, block_size, num_blocks, m.num_exact);
}

void CudaModelRunner::allocate_states(int slots) {
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  m.clear_graphs();
  m.states.reset();
  m.state_slots = 0;
  std::vector<uint8_t*> per_layer;
  if (cfg_.linear_attention && slots > 0) {
    const size_t per = m.state_bytes * size_t(slots), layers = size_t(cfg_.num_linear_layers());
    m.states.allocate(per * layers, "the Gated DeltaNet states of " + std::to_string(slots) + " sequences");
    KVLM_CUDA_CHECK(cudaMemsetAsync(m.states.data(), 0, m.states.bytes(), m.stream));
    KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
    for (size_t l = 0; l < layers; ++l) per_layer.push_back(static_cast<uint8_t*>(m.states.data()) + l * per);
    m.state_slots = slots;
  }
  m.ops->set_states(std::move(per_layer));
}

void CudaModelRunner::copy_states(std::span<const StateCopy> copies) {
  if (copies.empty()) return;
  Impl& m = *impl_;
  const DeviceScope dev(m.device);
  // Every layer's slot in one strided copy: the layers' states are [layers][slots][values].
  const size_t per = m.state_bytes;
  const size_t pitch = per * size_t(m.state_slots), layers = size_t(cfg_.num_linear_layers());
  auto* base = static_cast<uint8_t*>(m.states.data());
  for (const StateCopy& c : copies) {
    KVLM_CHECK(c.src >= 0 && c.src < m.state_slots && c.dst >= 0 && c.dst < m.state_slots, "copy_states: slot out of range");
    KVLM_CUDA_CHECK(cudaMemcpy2DAsync(base + size_t(c.dst) * per, pitch, base + size_t(c.src) * per, pitch, per, layers,
                                      cudaMemcpyDeviceToDevice, m.stream));
  }
}

void CudaModelRunner::download_kv_layer(size_t layer, LayerKVCache& out) const {
  const Impl& m = *impl_;
  const DeviceScope dev(m.device);
  KVLM_CHECK(layer < m.lkv.size() && out.num_blocks == m.num_blocks && out.block_size == m.block_size,
             "download_kv_layer: pool shape differs");
  const CudaKVLayer& L = m.lkv[layer];
  const size_t nb = size_t(m.num_blocks);
  KVLM_CHECK(out.k.size() == L.k_page_bytes * nb && out.v.size() == L.v_page_bytes * nb &&
                 out.k_scale.size() * sizeof(float) == L.k_scale_page_bytes * nb &&
                 out.v_scale.size() * sizeof(float) == L.v_scale_page_bytes * nb,
             "download_kv_layer: layer format differs");
  KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  KVLM_CUDA_CHECK(cudaMemcpy(out.k.data(), L.k, out.k.size(), cudaMemcpyDeviceToHost));
  KVLM_CUDA_CHECK(cudaMemcpy(out.v.data(), L.v, out.v.size(), cudaMemcpyDeviceToHost));
  if (!out.k_scale.empty())
    KVLM_CUDA_CHECK(cudaMemcpy(out.k_scale.data(), L.k_scale, out.k_scale.size() * 4, cudaMemcpyDeviceToHost));
  if (!out.v_scale.empty())
    KVLM_CUDA_CHECK(cudaMemcpy(out.v_scale.data(), L.v_scale, out.v_scale.size() * 4, cudaMemcpyDeviceToHost));
}

// ---- forward --------------------------------------------------------------------------------

// Validates the batch, uploads its metadata and enqueues the step on the stream (no sync);
// returns the device buffer holding its logits, [R][vocab] fp32.
float* CudaModelRunner::enqueue(const ForwardBatch& b, bool draft) {
  Impl& m = *impl_;
  KVLM_CHECK(m.comm->rank() == 0 || !draft, "a drafter under tensor parallelism");
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
  bool uniform = true;
  for (const AttnSeq& s : b.seqs) {
    KVLM_CHECK(s.q_begin == rows && s.q_len >= 1 && s.kv_len >= s.q_len,
               "the CUDA runner needs each sequence's rows right after the previous one's, q_len >= 1, kv_len >= q_len");
    const int nb = (s.kv_len + bs - 1) / bs;
    KVLM_CHECK(s.block_table.size() >= size_t(nb), "block table shorter than the sequence");
    for (int i = 0; i < nb; ++i)
      KVLM_CHECK(s.block_table[size_t(i)] >= 0 && s.block_table[size_t(i)] < m.num_blocks, "block id outside the KV pool");
    rows += s.q_len;
    max_blocks = std::max(max_blocks, nb);
    uniform &= s.q_len == b.seqs.front().q_len;
    shape.max_q = std::max(shape.max_q, s.q_len);
    shape.max_kv = std::max(shape.max_kv, s.kv_len);
  }
  KVLM_CHECK(rows == T, "sequences must cover every row of the batch");
  for (const int32_t r : b.logit_rows) KVLM_CHECK(r >= 0 && r < T, "logit row out of range");
  shape.MB = max_blocks;

  // A step a graph can serve: padded to its graph shape (the comment at the top).
  const int Q = shape.max_q;
  const bool graph = m.graphs_on && !m.poison && Q <= kMaxGraphQ && S <= kMaxGraphBatch;
  if (graph) {
    const int Sp = uniform ? next_pow2(S) : S, Tp = uniform ? Sp * Q : T;
    const int mb = next_pow2(std::max(max_blocks, (Q + bs - 1) / bs));  // padding sequences read ceil(Q / bs) pages
    shape = StepShape{.T = Tp, .R = std::min(Tp, next_pow2(std::max(R, 1))), .S = Sp, .MB = mb, .max_q = Q,
                      .max_kv = mb * bs};
  }
  const Impl::GraphKey key{shape.S, shape.max_q, shape.T, shape.MB, shape.R, draft};
  // The layout: a graph's own, or measured (and the arena grown to it).
  auto git = graph ? m.graphs.find(key) : m.graphs.end();
  StepLayout lay;
  if (git != m.graphs.end()) {
    lay = git->second.layout;
  } else {
    lay = m.measure(shape, draft);
    m.reserve_scratch(lay);
  }
  uint8_t* const dev = m.scratch.data();
  m.ids = reinterpret_cast<TokenId*>(dev + lay.ids);
  m.sample = reinterpret_cast<cuda::SampleRowParams*>(dev + lay.sample);

  // Metadata into pinned memory (same layout as the device region), one copy.
  uint8_t* host = m.meta_host.reserve(lay.meta_bytes);
  TokenId* h_tokens = reinterpret_cast<TokenId*>(host + lay.tokens);
  Position* h_pos = reinterpret_cast<Position*>(host + lay.positions);
  SlotId* h_slots = reinterpret_cast<SlotId*>(host + lay.slots);
  int32_t* h_cu = reinterpret_cast<int32_t*>(host + lay.cu);
  int32_t* h_kvl = reinterpret_cast<int32_t*>(host + lay.kv_lens);
  BlockId* h_tab = reinterpret_cast<BlockId*>(host + lay.tables);
  int32_t* h_rows = reinterpret_cast<int32_t*>(host + lay.logit_rows);
  std::fill_n(h_tab, size_t(shape.S) * size_t(shape.MB), BlockId(-1));
  if (m.num_exact) {  // exact sink / recent tokens: exact slots and tables (-1 = none, also for padding)
    SlotId* h_es = reinterpret_cast<SlotId*>(host + lay.exact_slots);
    BlockId* h_et = reinterpret_cast<BlockId*>(host + lay.exact_tables);
    std::fill_n(h_es, size_t(shape.T), SlotId(-1));
    std::fill_n(h_et, size_t(shape.S) * size_t(shape.MB), BlockId(-1));
    KVLM_CHECK(b.exact_slots.size() == size_t(T), "layers keep exact tokens but the batch has no exact slots");
    const SlotId exact_slots = SlotId(m.num_exact) * bs;
    for (int t = 0; t < T; ++t) {
      KVLM_CHECK(b.exact_slots[size_t(t)] < exact_slots, "exact slot outside the exact pages");
      h_es[t] = b.exact_slots[size_t(t)];
    }
    for (int s = 0; s < S; ++s) {
      const AttnSeq& q = b.seqs[size_t(s)];
      const size_t nb = size_t((q.kv_len + bs - 1) / bs);
      KVLM_CHECK(q.exact_table.size() >= nb, "exact table shorter than the sequence");
      for (size_t i = 0; i < nb; ++i) {
        KVLM_CHECK(q.exact_table[i] >= -1 && q.exact_table[i] < m.num_exact, "exact page id outside the exact pages");
        h_et[size_t(s) * size_t(shape.MB) + i] = q.exact_table[i];
      }
    }
  }
  if (m.cfg.linear_attention) {  // each sequence's state slot; padding sequences none (-1)
    int32_t* h_ss = reinterpret_cast<int32_t*>(host + lay.state_slots);
    std::fill_n(h_ss, size_t(shape.S), -1);
    for (int s = 0; s < S; ++s) {
      const int slot = b.seqs[size_t(s)].state_slot;
      KVLM_CHECK(slot >= 0 && slot < m.state_slots, "a sequence of a hybrid model without a state slot (allocate_states)");
      h_ss[s] = slot;
    }
  }
  std::copy(b.tokens.begin(), b.tokens.end(), h_tokens);
  std::copy(b.positions.begin(), b.positions.end(), h_pos);
  std::copy(b.slots.begin(), b.slots.end(), h_slots);
  h_cu[0] = 0;
  for (int s = 0; s < S; ++s) {
    const AttnSeq& q = b.seqs[size_t(s)];
    h_cu[s + 1] = q.q_begin + q.q_len;
    h_kvl[s] = q.kv_len;
    std::copy_n(q.block_table.begin(), (q.kv_len + bs - 1) / bs, h_tab + size_t(s) * size_t(shape.MB));
  }
  // Padding sequences (a graph's): Q rows each of token 0 at position 0, nothing stored, Q
  // keys on page 0.
  for (int s = S; s < shape.S; ++s) {
    const int r0 = T + (s - S) * Q;
    std::fill_n(h_tokens + r0, Q, TokenId(0));
    std::fill_n(h_pos + r0, Q, Position(0));
    std::fill_n(h_slots + r0, Q, SlotId(-1));
    h_cu[s + 1] = r0 + Q;
    h_kvl[s] = Q;
    std::fill_n(h_tab + size_t(s) * size_t(shape.MB), (Q + bs - 1) / bs, BlockId(0));
  }
  std::copy(b.logit_rows.begin(), b.logit_rows.end(), h_rows);
  std::fill(h_rows + R, h_rows + shape.R, 0);  // padding logit rows: computed, dropped
  KVLM_CUDA_CHECK(cudaMemcpyAsync(dev, host, lay.meta_bytes, cudaMemcpyHostToDevice, m.stream));
  if (m.poison) KVLM_CUDA_CHECK(cudaMemsetAsync(dev + lay.meta_bytes, 0xff, lay.total - lay.meta_bytes, m.stream));

  if (graph && git == m.graphs.end() && m.graph_seen.size() >= 4 * kMaxGraphs) m.graph_seen.clear();
  if (git != m.graphs.end()) {
    git->second.last_used = ++m.graph_clock;
    KVLM_CUDA_CHECK(cudaGraphLaunch(git->second.exec, m.stream));
  } else if (graph && !m.graph_seen.insert(key).second) {
    if (m.graphs.size() >= kMaxGraphs) {  // drop the least recently used
      auto lru = std::ranges::min_element(m.graphs, {}, [](const auto& kv) { return kv.second.last_used; });
      KVLM_CUDA_CHECK(cudaStreamSynchronize(m.stream));  // it may be the one still running
      KVLM_CUDA_CHECK(cudaGraphExecDestroy(lru->second.exec));
      m.graphs.erase(lru);
    }
    cudaGraph_t g = nullptr;
    KVLM_CUDA_CHECK(cudaStreamBeginCapture(m.stream, cudaStreamCaptureModeRelaxed));
    try {
      m.run_forward(shape, lay, draft);
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
    m.graphs.emplace(key, Impl::Graph{exec, lay, ++m.graph_clock});
    KVLM_CUDA_CHECK(cudaGraphLaunch(exec, m.stream));
  } else {
    m.run_forward(shape, lay, draft);
  }
  return lay.logits == SIZE_MAX ? nullptr : reinterpret_cast<float*>(dev + lay.logits);
}

}  // namespace kvlm

#include "model/cpu/cpu_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>

#include "core/error.h"
#include "core/hadamard.h"
#include "core/numeric.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "ops/cpu/linear_attention.h"
#include "ops/cpu/ops.h"
#include "ops/cpu/quant_matmul.h"

namespace kvlm {

namespace cpu = ops::cpu;

namespace {

std::span<float> f32(const Tensor& t) { return {static_cast<float*>(t.data), size_t(t.numel())}; }
std::span<const float> f32(const Weight& w) {
  KVLM_CHECK(w.blocks.empty(), "an fp32 view of a weight kept in GGUF blocks (this op does not read blocks)");
  return w ? std::span<const float>(static_cast<const float*>(w.data), size_t(w.numel())) : std::span<const float>{};
}

// y[r] += bias for every row of y (a matrix of bias.size() columns); nothing without a bias.
void add_bias(const Weight& bias, std::span<float> y) {
  if (!bias) return;
  const auto b = f32(bias);
  KVLM_CHECK(!b.empty() && y.size() % b.size() == 0, "linear: bias size mismatch");
  for (size_t r = 0; r < y.size() / b.size(); ++r)
    for (size_t c = 0; c < b.size(); ++c) y[r * b.size() + c] += b[c];
}

// y = x . w^T (+ bias) for fp32 weights and GGUF blocks alike.
void linear_any(std::span<const float> x, int m, int k, const Weight& w, const Weight& bias, std::span<float> y,
                cpu::BlockMath math) {
  if (w.blocks.empty()) return cpu::linear(x, m, k, f32(w), int(w.rows), f32(bias), y);
  KVLM_CHECK(w.cols == k && x.size() == size_t(m) * size_t(k) && y.size() == size_t(m) * size_t(w.rows),
             "linear: shape mismatch");
  for (const WeightBlocks& p : w.blocks)
    cpu::block_linear(x.data(), m, k,
                      cpu::BlockMatrix{.type = p.type, .data = p.data, .row_bytes = p.row_bytes, .rows = p.rows, .cols = k},
                      y.data() + p.row0, w.rows, math);
  KVLM_CHECK(!bias || bias.numel() == w.rows, "linear: bias size mismatch");
  add_bias(bias, y);
}

// Elements [begin, begin + n) of an fp32 bias (one expert's part of a mixture's stacked biases,
// which the checkpoint may shape [E][n]) as a vector; empty for an absent bias.
Weight bias_slice(const Weight& b, int64_t begin, int64_t n) {
  if (!b) return b;
  KVLM_CHECK(b.blocks.empty() && begin >= 0 && begin + n <= b.numel(), "bias_slice: out of range");
  return Weight{.data = static_cast<const float*>(b.data) + begin, .dtype = b.dtype, .rows = n, .cols = 1};
}

// Rows [row0, row0 + rows) of a matrix (one expert's part of a mixture's stacked weights), fp32
// or kept in blocks; a kept matrix's parts go in `parts`, which must outlive the view.
Weight row_slice(const Weight& w, int64_t row0, int64_t rows, std::vector<WeightBlocks>& parts) {
  KVLM_CHECK(row0 >= 0 && row0 + rows <= w.rows, "row_slice: rows out of range");
  Weight r = w;
  r.rows = rows;
  if (w.blocks.empty()) {
    r.data = static_cast<const float*>(w.data) + size_t(row0) * size_t(w.cols);
    return r;
  }
  parts.clear();
  for (const WeightBlocks& p : w.blocks) {
    const int64_t lo = std::max(row0, p.row0), hi = std::min(row0 + rows, p.row0 + p.rows);
    if (lo >= hi) continue;
    parts.push_back(WeightBlocks{.row0 = lo - row0, .rows = hi - lo, .type = p.type,
                                 .data = p.data + size_t(lo - p.row0) * p.row_bytes, .row_bytes = p.row_bytes});
  }
  r.blocks = parts;
  r.data = parts.front().data;
  return r;
}

// linear_any one sequence's rows at a time, in fixed blocks of 64 output columns, so that a row's
// result depends on its own sequence alone and not on what else shares the step: a pooling
// model then gives the same text the same vector in any batch. OpenBLAS's sgemm computes a row
// differently by its place in the call (its micro-kernels take rows in tiles, 12 on Zen, with
// the tail apart) and the same text twice in one batch came back 1e-5 apart. A block of W stays
// in cache while the sequences take their turns, so W is still read from memory about once.
// The threads split the blocks (fixed: they do not depend on the rows either). Rows outside
// every sequence are not computed: `seqs` must cover all of x's rows.
void linear_per_sequence(std::span<const float> x, int k, const Weight& w, const Weight& bias, std::span<float> y,
                         cpu::BlockMath math, std::span<const AttnSeq> seqs) {
  const int64_t n = w.rows;
  KVLM_CHECK(w.cols == k && y.size() * size_t(k) == x.size() * size_t(n), "linear: shape mismatch");
  constexpr int64_t kCols = 64;
  const int64_t nblocks = (n + kCols - 1) / kCols;
  const double work = double(x.size()) * double(n);
#pragma omp parallel for schedule(static) if (work >= double(1 << 18))
  for (int64_t cb = 0; cb < nblocks; ++cb) {
    const int64_t c0 = cb * kCols, c1 = std::min(n, c0 + kCols);
    for (const AttnSeq& s : seqs) {
      if (s.q_len == 0) continue;
      const float* xs = x.data() + size_t(s.q_begin) * size_t(k);
      float* ys = y.data() + size_t(s.q_begin) * size_t(n);
      if (w.blocks.empty()) {
        cpu::linear_columns(xs, s.q_len, k, f32(w).data(), int(c0), int(c1), int(n), ys);
        continue;
      }
      for (const WeightBlocks& p : w.blocks) {
        const int64_t r0 = std::max(c0, p.row0), r1 = std::min(c1, p.row0 + p.rows);
        if (r0 >= r1) continue;
        cpu::block_linear(xs, s.q_len, k,
                          cpu::BlockMatrix{.type = p.type, .data = p.data + size_t(r0 - p.row0) * p.row_bytes,
                                           .row_bytes = p.row_bytes, .rows = r1 - r0, .cols = k},
                          ys + r0, n, math);
      }
    }
  }
  KVLM_CHECK(!bias || bias.numel() == n, "linear: bias size mismatch");
  add_bias(bias, y);
}

// Holds every weight in fp32, and GGUF matrices in their blocks where the kernels read them.
class HostWeightSink final : public WeightSink {
 public:
  HostWeightSink(std::vector<std::vector<float>>& storage, std::deque<std::vector<uint8_t>>& block_storage,
                 std::deque<std::vector<WeightBlocks>>& block_parts, bool keep_blocks, size_t& bytes)
      : storage_(storage), block_storage_(block_storage), block_parts_(block_parts), keep_blocks_(keep_blocks),
        bytes_(bytes) {}
  // GGUF blocks the kernels read (MXFP4 too: GPT-OSS's experts, from a GGUF file or a Hugging
  // Face checkpoint, 4.25 bits a weight), and 4-bit checkpoints' grouped rows as Q4_1 blocks.
  bool keeps_blocks(uint32_t type) const override { return keep_blocks_ && cpu::held_block_type(type) != 0; }
  Weight store_blocks(const WeightSpec& s, std::span<const Checkpoint::Blocks> pieces) override {
    auto held_type = [&](const Checkpoint::Blocks& p) { return cpu::held_block_type(p.type); };
    auto held_bytes = [&](const Checkpoint::Blocks& p) {
      return held_type(p) != p.type ? cpu::block_row_bytes(held_type(p), p.cols) : p.row_bytes;
    };
    size_t total = 0;
    for (const auto& p : pieces) total += size_t(p.rows) * held_bytes(p);
    auto& bytes = block_storage_.emplace_back(total);
    auto& parts = block_parts_.emplace_back();
    size_t off = 0;
    int64_t row = 0;
    std::vector<uint8_t> grouped;
    for (const auto& p : pieces) {
      const size_t rb = held_bytes(p);
      if (held_type(p) != p.type) {  // converted row by row: grouped rows to Q4_1
        grouped.resize(size_t(p.rows) * p.row_bytes);
        copy_block_rows(p, grouped.data());
        const int group = grouped_layout_of_ggml(p.type)->group;
        bool exact = true;
#pragma omp parallel for schedule(static) reduction(&& : exact)
        for (int64_t r = 0; r < p.rows; ++r)
          exact = grouped_row_to_q4_1(group, grouped.data() + size_t(r) * p.row_bytes, p.cols,
                                      bytes.data() + off + size_t(r) * rb) &&
                  exact;
        if (!exact)
          throw Error("weight '" + s.pieces[0].name + "' has a scale that float16 cannot hold exactly, which the CPU's "
                      "4-bit kernels need; run it with --dequantize-weights");
      } else {
        copy_block_rows(p, bytes.data() + off);
      }
      parts.push_back(WeightBlocks{.row0 = row, .rows = p.rows, .type = held_type(p),
                                   .data = bytes.data() + off, .row_bytes = rb});
      off += size_t(p.rows) * rb;
      row += p.rows;
    }
    KVLM_CHECK(row == s.rows() && pieces.front().cols == s.cols(), "GGUF block pieces do not make the weight's shape");
    bytes_ += total;
    return Weight{.data = bytes.data(), .dtype = DType::U8, .rows = s.rows(), .cols = s.cols(), .blocks = parts};
  }
  void reserve(std::span<const WeightSpec> specs, std::span<const SpecQuant>) override { storage_.reserve(specs.size()); }
  Weight store(const WeightSpec& s, std::span<const TensorView> pieces, std::span<const PieceQuant> quant,
               std::span<const float> values) override {
    std::vector<float> data;
    if (!values.empty() || pieces.empty()) {
      data.assign(values.begin(), values.end());
    } else {
      data.resize(size_t(s.rows() * s.cols()));
      size_t off = 0;
      for (size_t i = 0; i < pieces.size(); ++i) {
        const size_t n = size_t(pieces[i].info->numel());
        piece_to_f32(pieces[i], quant[i], std::span<float>(data).subspan(off, n));  // FP8: dequantized
        off += n;
      }
    }
    storage_.push_back(std::move(data));
    bytes_ += storage_.back().size() * sizeof(float);
    return Weight{.data = storage_.back().data(), .dtype = DType::F32, .rows = s.rows(), .cols = s.cols()};
  }

 private:
  std::vector<std::vector<float>>& storage_;
  std::deque<std::vector<uint8_t>>& block_storage_;
  std::deque<std::vector<WeightBlocks>>& block_parts_;
  bool keep_blocks_;
  size_t& bytes_;
};

// The reference ops: fp32 everywhere, the attention through each layer's backend.
class CpuOps final : public Ops {
 public:
  // `logits` false: a tensor-parallel follower's step, which forms no logits.
  CpuOps(const ForwardBatch& b, KVCache& cache, std::span<const AttentionBackend* const> backends, Communicator& comm,
         const CpuModelRunner::KVObserver& observer, cpu::BlockMath math, bool logits = true)
      : b_(b), cache_(cache), backends_(backends), comm_(comm), observer_(observer), logits_(logits), math_(math) {}

  // Keeps the outputs of the layers with a slot (slot_of[layer] >= 0) in `features`
  // ([num_tokens][slots * hidden]).
  void set_states(std::vector<std::vector<uint8_t>>* states, int slots) {
    states_ = states;
    state_slots_ = slots;
  }

  void set_capture(std::span<const int> slot_of, std::vector<float>* features, int64_t hidden) {
    slot_of_ = slot_of;
    features_ = features;
    hidden_ = hidden;
    const int slots = int(std::ranges::count_if(slot_of, [](int s) { return s >= 0; }));
    features->resize(b_.tokens.size() * size_t(slots * hidden));  // every slot is written by capture()
    slots_ = slots;
  }
  Tensor features() {
    return Tensor{.data = features_->data(), .dtype = DType::F32, .rows = int64_t(b_.tokens.size()),
                  .cols = slots_ * hidden_};
  }
  void capture(int layer, Tensor x) override {
    if (layer < 0 || size_t(layer) >= slot_of_.size() || slot_of_[size_t(layer)] < 0) return;
    const size_t slot = size_t(slot_of_[size_t(layer)]), H = size_t(hidden_), W = size_t(slots_) * H;
    const auto xs = f32(x);
    for (size_t t = 0; t < b_.tokens.size(); ++t)
      std::copy_n(xs.data() + t * H, H, features_->data() + t * W + slot * H);
  }

  int num_tokens() const override { return int(b_.tokens.size()); }
  int num_logit_rows() const override { return logits_ ? int(b_.logit_rows.size()) : 0; }
  bool pooling() const override { return pooling_; }
  void set_pooling(bool on) { pooling_ = on; }

  Tensor alloc(ActRole, int64_t rows, int64_t cols) override {
    auto& v = arena_.emplace_back(size_t(rows * cols));
    return Tensor{.data = v.data(), .dtype = DType::F32, .rows = rows, .cols = cols};
  }

  void embed(const Weight& table, float scale, Tensor x) override {
    const int64_t hd = x.cols, vocab = table.rows;
    const auto out = f32(x);
    for (size_t t = 0; t < b_.tokens.size(); ++t) {
      const TokenId id = b_.tokens[t];
      if (id < 0 || id >= vocab)
        throw Error("token id " + std::to_string(id) + " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
      float* row = out.data() + t * size_t(hd);
      if (table.blocks.empty()) {
        std::copy_n(f32(table).data() + size_t(id * hd), hd, row);
      } else {  // the row's blocks, dequantized
        const auto p = std::ranges::find_if(table.blocks, [&](const WeightBlocks& b) { return id < b.row0 + b.rows; });
        cpu::block_dequantize_row(cpu::BlockMatrix{.type = p->type, .data = p->data, .row_bytes = p->row_bytes,
                                                   .rows = p->rows, .cols = hd},
                                  id - p->row0, row);
      }
      for (int64_t i = 0; i < hd; ++i) row[i] *= scale;
    }
  }

  void add_rmsnorm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) override {
    if (delta) cpu::add_inplace(f32(x), f32(delta));
    cpu::rmsnorm(f32(x), int(x.rows), int(x.cols), f32(w), eps, f32(out));
  }

  void rmsnorm(Tensor x, const Weight& w, float eps, Tensor out) override {
    cpu::rmsnorm(f32(x), int(x.rows), int(x.cols), f32(w), eps, f32(out));
  }

  void final_norm(Tensor x, Tensor delta, const Weight& w, float eps, Tensor out) override {
    const size_t hd = size_t(x.cols);
    const auto xs = f32(x), o = f32(out);
    for (size_t r = 0; r < b_.logit_rows.size(); ++r) {
      const int row = b_.logit_rows[r];
      KVLM_CHECK(row >= 0 && row < x.rows, "logit row out of range");
      for (size_t i = 0; i < hd; ++i)
        o[r * hd + i] = xs[size_t(row) * hd + i] + (delta ? f32(delta)[size_t(row) * hd + i] : 0.0f);
    }
    cpu::rmsnorm(o, int(out.rows), int(hd), f32(w), eps, o);
  }

  void linear(Tensor x, const Weight& w, const Weight& bias, Tensor y) override {
    linear_rows(f32(x), int(x.rows), int(x.cols), w, bias, f32(y));
  }

  void mlp_down(GluActivation f, Tensor gu, const Weight& w, const Weight& bias, Tensor y) override {
    const size_t rows = size_t(gu.rows), inter = size_t(gu.cols / 2);
    act_.resize(rows * inter);
    const auto g = f32(gu);
    for (size_t r = 0; r < rows; ++r)
      cpu::glu(f, g.subspan(r * 2 * inter, inter), g.subspan(r * 2 * inter + inter, inter),
               std::span<float>(act_).subspan(r * inter, inter));
    linear_rows(act_, int(rows), int(inter), w, bias, f32(y));
  }

  void attention_prologue(int layer, Tensor qkv, const PrologueWeights& w, Tensor q) override {
    const AttentionLayerDesc& a = cache_.layer(size_t(layer)).spec->attn;
    const int T = int(qkv.rows), nh = a.num_q_heads, kvh = a.num_kv_heads, d = a.head_dim;
    const float eps = w.eps;
    const size_t qd = size_t(nh * d), kd = size_t(kvh * d);
    k_.resize(size_t(T) * kd);
    v_.resize(size_t(T) * kd);
    const auto in = f32(qkv), qo = f32(q);
    for (size_t t = 0; t < size_t(T); ++t) {
      const float* row = in.data() + t * size_t(qkv.cols);
      std::copy_n(row, qd, qo.data() + t * qd);
      std::copy_n(row + qd, kd, k_.data() + t * kd);
      std::copy_n(row + qd + kd, kd, v_.data() + t * kd);
    }
    if (w.q_norm) cpu::rmsnorm(qo, T * nh, d, f32(w.q_norm), eps, qo);
    if (w.k_norm) cpu::rmsnorm(k_, T * kvh, d, f32(w.k_norm), eps, k_);
    cpu::rope(qo, T, nh, d, b_.positions, f32(w.inv_freq));
    cpu::rope(k_, T, kvh, d, b_.positions, f32(w.inv_freq));
    if (observer_) observer_(size_t(layer), k_, v_);  // unrotated K/V, as stored without a rotation
    const KVLayerSpec& s = *cache_.layer(size_t(layer)).spec;
    if (s.rotate_k) {  // R q, R k (core/hadamard.h): the scores are unchanged
      for (size_t r = 0; r < size_t(T * nh); ++r) num::hadamard_rotate(qo.data() + r * size_t(d), d, false, s.rotation_seed);
      for (size_t r = 0; r < size_t(T * kvh); ++r) num::hadamard_rotate(k_.data() + r * size_t(d), d, false, s.rotation_seed);
    }
    if (s.rotate_v)  // R v; attention() rotates the output back
      for (size_t r = 0; r < size_t(T * kvh); ++r) num::hadamard_rotate(v_.data() + r * size_t(d), d, false, s.rotation_seed);
    backends_[size_t(layer)]->store_kv(cache_.layer(size_t(layer)),
                                      KVWrite{.k = k_, .v = v_, .slots = b_.slots, .exact_slots = b_.exact_slots});
  }

  void attention(int layer, Tensor q, Tensor out, float softmax_scale, const Weight& sinks) override {
    backends_[size_t(layer)]->attend(cache_.layer(size_t(layer)),
                                     AttentionCall{.q = f32(q), .out = f32(out), .seqs = b_.seqs,
                                                   .softmax_scale = softmax_scale, .sinks = f32(sinks)});
    const KVLayerSpec& s = *cache_.layer(size_t(layer)).spec;
    if (s.rotate_v) {  // the output is a sum of rotated V rows: R^T brings it back
      const auto o = f32(out);
      const size_t d = size_t(s.attn.head_dim);
      for (size_t r = 0; r < o.size() / d; ++r)
        num::hadamard_rotate(o.data() + r * d, int(d), /*inverse=*/true, s.rotation_seed);
    }
  }

  void gated_delta_net(int linear_layer, const LinearAttentionConfig& c, Tensor mixed, const GatedDeltaNetWeights& w,
                       Tensor out) override {
    KVLM_CHECK(states_ != nullptr && linear_layer >= 0 && size_t(linear_layer) < states_->size(),
               "Gated DeltaNet layer without states (allocate_states)");
    const size_t T = size_t(mixed.rows), W = size_t(c.in_proj_dim()), CD = size_t(c.conv_dim()),
                 VD = size_t(c.value_dim()), HV = size_t(c.v_heads), KD = size_t(c.key_dim());
    KVLM_CHECK(mixed.cols == int64_t(W) && out.rows == int64_t(T) && out.cols == int64_t(VD),
               "gated_delta_net: shape mismatch");
    std::vector<uint8_t>& layer = (*states_)[size_t(linear_layer)];
    const size_t per = c.state_bytes(), conv_n = c.conv_state_values(), mat_n = c.matrix_values();
    const bool bf16 = c.state_dtype == DType::BF16;
    const auto m = f32(mixed), o = f32(out);
    const cpu::DeltaRuleShape shape{c.k_heads, c.v_heads, c.k_dim, c.v_dim};
    for (const AttnSeq& s : b_.seqs) {
      if (s.q_len == 0) continue;
      KVLM_CHECK(s.state_slot >= 0 && s.state_slot < state_slots_, "a sequence without a state slot");
      uint8_t* const st = layer.data() + size_t(s.state_slot) * per;
      if (s.kv_len == s.q_len) std::fill_n(st, per, uint8_t(0));  // its first rows: a fresh state (+0 in fp32 and bf16)
      // The slot: the fp32 conv window, then the matrices (fp32 in place; bf16 through fp32).
      const std::span<float> conv_state(reinterpret_cast<float*>(st), conv_n);
      uint8_t* const mat = st + conv_n * sizeof(float);
      std::span<float> rec(reinterpret_cast<float*>(mat), mat_n);
      if (bf16) {
        gdn_matrix_.resize(mat_n);
        const auto* h = reinterpret_cast<const uint16_t*>(mat);
        for (size_t i = 0; i < mat_n; ++i) gdn_matrix_[i] = num::bf16_to_f32(h[i]);
        rec = gdn_matrix_;
      }
      const size_t n = size_t(s.q_len), r0 = size_t(s.q_begin);
      gdn_qkv_.resize(n * CD);
      gdn_z_.resize(n * VD);
      gdn_g_.resize(n * HV);
      gdn_beta_.resize(n * HV);
      for (size_t r = 0; r < n; ++r) {
        const float* row = m.data() + (r0 + r) * W;
        std::copy_n(row, CD, gdn_qkv_.data() + r * CD);
        std::copy_n(row + CD, VD, gdn_z_.data() + r * VD);
        std::copy_n(row + CD + VD, HV, gdn_beta_.data() + r * HV);  // b, then a
        std::copy_n(row + CD + VD + HV, HV, gdn_g_.data() + r * HV);
      }
      cpu::causal_conv_silu(int(n), int(CD), c.conv_kernel, gdn_qkv_, f32(w.conv), conv_state, gdn_qkv_);
      cpu::delta_rule_gates(int(n), int(HV), f32(w.a_log), f32(w.dt_bias), gdn_g_, gdn_beta_);
      gdn_q_.resize(n * KD);
      gdn_k_.resize(n * KD);
      gdn_v_.resize(n * VD);
      for (size_t r = 0; r < n; ++r) {
        const float* row = gdn_qkv_.data() + r * CD;
        std::copy_n(row, KD, gdn_q_.data() + r * KD);
        std::copy_n(row + KD, KD, gdn_k_.data() + r * KD);
        std::copy_n(row + 2 * KD, VD, gdn_v_.data() + r * VD);
      }
      const std::span<float> core = o.subspan(r0 * VD, n * VD);
      if (n == 1)
        cpu::delta_rule_recurrent(shape, 1, gdn_q_, gdn_k_, gdn_v_, gdn_g_, gdn_beta_, rec, core);
      else
        cpu::delta_rule_chunked(shape, int(n), gdn_q_, gdn_k_, gdn_v_, gdn_g_, gdn_beta_, rec, core);
      if (bf16) {  // rounded once per step, as the CUDA kernels store it
        auto* h = reinterpret_cast<uint16_t*>(mat);
        for (size_t i = 0; i < mat_n; ++i) h[i] = num::f32_to_bf16(gdn_matrix_[i]);
      }
      cpu::rmsnorm_gated(core, gdn_z_, int(n * HV), c.v_dim, f32(w.norm), w.eps, core);
    }
  }

  void sigmoid_gate(Tensor x, Tensor src, int64_t col0) override {
    KVLM_CHECK(x.rows == src.rows && col0 >= 0 && col0 + x.cols <= src.cols, "sigmoid_gate: shape mismatch");
    const auto xs = f32(x), gs = f32(src);
    for (size_t r = 0; r < size_t(x.rows); ++r)
      for (size_t i = 0; i < size_t(x.cols); ++i)
        xs[r * size_t(x.cols) + i] /= 1.0f + std::exp(-gs[r * size_t(src.cols) + size_t(col0) + i]);
  }

  void moe(Tensor x, const MoeConfig& c, const MoeWeights& w, Tensor y) override {
    const int T = int(x.rows), H = int(x.cols), E = c.num_experts, K = c.top_k;
    // The experts this rank holds: all of them, or under expert parallelism its run of them
    // (routing still chooses among all E; the others' rows are another rank's to sum).
    const int held = c.held_experts(), first = c.expert_begin;
    const int64_t I = w.gate_up.rows / (2 * int64_t(held));
    KVLM_CHECK(w.router.rows == E && w.down.rows == int64_t(held) * H && w.down.cols == I && y.cols == H,
               "moe: weight shapes");
    // The router: logits, then each row's experts and weights.
    route_logits_.resize(size_t(T) * size_t(E));
    linear_any(f32(x), T, H, w.router, w.router_bias, route_logits_, math_);
    route_ids_.resize(size_t(T) * size_t(K));
    route_weights_.resize(route_ids_.size());
    cpu::moe_route(route_logits_, T, E, K, c.norm_topk, route_ids_, route_weights_);
    // Each expert's rows, in row order; experts in ascending order (transformers' order of sums).
    std::vector<std::vector<std::pair<int, float>>> rows_of(static_cast<size_t>(E));
    for (int t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k) {
        const size_t i = size_t(t) * size_t(K) + size_t(k);
        rows_of[size_t(route_ids_[i])].push_back({t, route_weights_[i]});
      }
    const auto xs = f32(x), ys = f32(y);
    std::fill(ys.begin(), ys.end(), 0.0f);
    const size_t gu_rows = size_t(2 * I), h = size_t(H), inter = size_t(I);
    std::vector<WeightBlocks> gu_parts, dn_parts;  // an expert's rows of weights kept in blocks
    for (int e = first; e < first + held; ++e) {
      const auto& rows = rows_of[size_t(e)];
      if (rows.empty()) continue;  // an expert no row chose costs nothing
      const size_t le = size_t(e - first);  // its place among the held experts' weights
      const size_t n = rows.size();
      expert_x_.resize(n * h);
      for (size_t r = 0; r < n; ++r) std::copy_n(xs.data() + size_t(rows[r].first) * h, h, expert_x_.data() + r * h);
      expert_gu_.resize(n * gu_rows);
      linear_any(expert_x_, int(n), H, row_slice(w.gate_up, int64_t(le * gu_rows), int64_t(gu_rows), gu_parts),
                 bias_slice(w.gate_up_bias, int64_t(le * gu_rows), int64_t(gu_rows)), expert_gu_, math_);
      act_.resize(n * inter);
      for (size_t r = 0; r < n; ++r)
        cpu::glu(c.act, std::span<const float>(expert_gu_).subspan(r * gu_rows, inter),
                 std::span<const float>(expert_gu_).subspan(r * gu_rows + inter, inter),
                 std::span<float>(act_).subspan(r * inter, inter), c.swiglu_alpha, c.swiglu_limit);
      expert_y_.resize(n * h);
      linear_any(act_, int(n), int(I), row_slice(w.down, int64_t(le * h), int64_t(h), dn_parts),
                 bias_slice(w.down_bias, int64_t(le * h), int64_t(h)), expert_y_, math_);
      for (size_t r = 0; r < n; ++r) {
        float* out = ys.data() + size_t(rows[r].first) * h;
        const float wt = rows[r].second;
        for (size_t i = 0; i < h; ++i) out[i] += wt * expert_y_[r * h + i];
      }
    }
    if (c.shared_expert_size > 0) {  // every row: y += sigmoid(x . w_gate) * down(silu(gate x) * up x)
      const int64_t S = w.shared_down.cols;
      KVLM_CHECK(w.shared_gate_up.rows == 2 * S && w.shared_gate_up.cols == H && w.shared_down.rows == H &&
                     w.shared_gate.rows == 1 && w.shared_gate.cols == H,
                 "moe: shared expert weight shapes");
      expert_gu_.resize(size_t(T) * size_t(2 * S));
      linear_any(xs, T, H, w.shared_gate_up, Weight{}, expert_gu_, math_);
      act_.resize(size_t(T) * size_t(S));
      for (size_t r = 0; r < size_t(T); ++r)
        cpu::glu(GluActivation::Silu, std::span<const float>(expert_gu_).subspan(r * size_t(2 * S), size_t(S)),
                 std::span<const float>(expert_gu_).subspan(r * size_t(2 * S) + size_t(S), size_t(S)),
                 std::span<float>(act_).subspan(r * size_t(S), size_t(S)), c.swiglu_alpha, c.swiglu_limit);
      expert_y_.resize(size_t(T) * h);
      linear_any(act_, T, int(S), w.shared_down, Weight{}, expert_y_, math_);
      route_logits_.resize(size_t(T));
      linear_any(xs, T, H, w.shared_gate, Weight{}, route_logits_, math_);
      for (size_t r = 0; r < size_t(T); ++r) {
        const float g = 1.0f / (1.0f + std::exp(-route_logits_[r]));
        for (size_t i = 0; i < h; ++i) ys[r * h + i] += g * expert_y_[r * h + i];
      }
    }
  }

  void all_reduce_sum(Tensor x) override {
    if (comm_.world_size() > 1) comm_.all_reduce_sum(x.data, x.dtype, size_t(x.numel()), nullptr);
  }

 private:
  // A pooling model's rows go sequence by sequence (linear_per_sequence), one sequence alone
  // too (its column blocks must be those of a batch), wherever the rows are the sequences'.
  void linear_rows(std::span<const float> x, int m, int k, const Weight& w, const Weight& bias, std::span<float> y) {
    if (pooling_ && m == int(b_.tokens.size()) && rows_are_sequences())
      return linear_per_sequence(x, k, w, bias, y, math_, b_.seqs);
    linear_any(x, m, k, w, bias, y, math_);
  }
  bool rows_are_sequences() const {
    int next = 0;
    for (const AttnSeq& s : b_.seqs) {
      if (s.q_begin != next) return false;
      next += s.q_len;
    }
    return next == int(b_.tokens.size());
  }

  const ForwardBatch& b_;
  KVCache& cache_;
  std::span<const AttentionBackend* const> backends_;
  Communicator& comm_;
  const CpuModelRunner::KVObserver& observer_;
  bool logits_ = true;
  bool pooling_ = false;
  cpu::BlockMath math_;
  std::deque<std::vector<float>> arena_;
  std::vector<float> k_, v_, act_;
  std::vector<float> route_logits_, route_weights_, expert_x_, expert_gu_, expert_y_;
  std::vector<int32_t> route_ids_;
  std::vector<float> gdn_qkv_, gdn_z_, gdn_g_, gdn_beta_, gdn_q_, gdn_k_, gdn_v_;
  std::vector<float> gdn_matrix_;  // a bf16-held state's matrices in fp32 while a step runs
  std::vector<std::vector<uint8_t>>* states_ = nullptr;
  int state_slots_ = 0;
  std::span<const int> slot_of_;
  std::vector<float>* features_ = nullptr;
  int64_t hidden_ = 0, slots_ = 0;
};

}  // namespace

CpuModelRunner::CpuModelRunner(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan,
                               std::vector<const AttentionBackend*> backends, const DrafterSource* drafter,
                               Communicator* comm, CpuRunnerOptions options)
    : cfg_(std::move(config)), plan_(&plan), backends_(std::move(backends)), options_(options) {
  if (comm) comm_ = comm;
  const TpRank tp{comm_->rank(), comm_->world_size()};
  KVLM_CHECK(tp.world == 1 || !drafter, "a drafter under tensor parallelism");
  const ModelConfig rank_cfg = tp.world > 1 ? shard_config(cfg_, tp) : cfg_;
  def_ = make_model_definition(rank_cfg);
  if (rank_cfg.linear_attention) state_bytes_ = rank_cfg.linear_attention->state_bytes();  // the rank's heads
  const size_t draft_layers = drafter ? size_t(drafter->config.num_layers) : 0;
  KVLM_CHECK(plan.layers.size() == size_t(cfg_.num_kv_layers()) + draft_layers && backends_.size() == plan.layers.size(),
             "one KV spec and one backend per layer");
  HostWeightSink sink(storage_, block_storage_, block_parts_, options_.keep_blocks, weight_bytes_);
  // The checkpoint's shapes are the whole model's: the list comes from its definition.
  const std::unique_ptr<ModelDefinition> whole =
      tp.world > 1 ? make_model_definition(weight_config(cfg_, tp.world)) : nullptr;
  LoadedWeights lw = load_weights((whole ? *whole : *def_).weights(), ckpt, sink, cfg_.weight_quant, tp);
  weights_ = std::move(lw.weights);
  num_params_ = lw.num_params;
  block_tensors_ = lw.block_tensors;
  if (drafter) {
    draft_def_ = make_dflash_draft(drafter->config, drafter->prefix, cfg_.num_kv_layers());
    LoadedWeights dw = load_weights(draft_def_->weights(), *drafter->checkpoint, sink, drafter->config.weight_quant);
    draft_weights_ = std::move(dw.weights);
    draft_weights_.push_back(weights_[def_->embedding_index()]);
    draft_weights_.push_back(weights_[def_->lm_head_index()]);
    num_params_ += dw.num_params;
    block_tensors_ += dw.block_tensors;
    feature_slot_.assign(size_t(cfg_.num_layers), -1);
    int slot = 0;
    for (int l : draft_def_->feature_layers()) feature_slot_[size_t(l)] = slot++;
  }
}

CpuModelRunner::~CpuModelRunner() = default;

cpu::BlockMath CpuModelRunner::block_math() const {
  return options_.exact_blocks ? cpu::BlockMath::Exact : cpu::BlockMath::Int8;
}

void CpuModelRunner::allocate_kv(int num_blocks, int block_size, int num_exact_pages) {
  cache_.reset();  // release the old pool before allocating the new one
  cache_ = std::make_unique<KVCache>(*plan_, num_blocks, block_size, num_exact_pages);
}

void CpuModelRunner::allocate_states(int slots) {
  states_.clear();
  state_slots_ = 0;
  if (!cfg_.linear_attention || slots <= 0) return;
  const size_t per = state_bytes_ * size_t(slots);
  states_.assign(size_t(cfg_.num_linear_layers()), std::vector<uint8_t>(per, uint8_t(0)));
  state_slots_ = slots;
}

void CpuModelRunner::copy_states(std::span<const StateCopy> copies) {
  if (copies.empty()) return;
  const size_t per = state_bytes_;
  for (const StateCopy& c : copies) {
    KVLM_CHECK(c.src >= 0 && c.src < state_slots_ && c.dst >= 0 && c.dst < state_slots_, "copy_states: slot out of range");
    for (std::vector<uint8_t>& layer : states_)
      std::copy_n(layer.begin() + ptrdiff_t(size_t(c.src) * per), per, layer.begin() + ptrdiff_t(size_t(c.dst) * per));
  }
}

void CpuModelRunner::copy_blocks(std::span<const PageCopy> copies) {
  KVLM_CHECK(cache_ != nullptr, "copy_blocks before allocate_kv");
  for (const PageCopy& c : copies) {
    cache_->copy_block(c.src, c.dst);
    if (c.exact_src >= 0 && c.exact_dst >= 0) cache_->copy_exact_page(c.exact_src, c.exact_dst);
  }
}

// A tensor-parallel rank holds a share of the KV heads: its part of each page (the TP runner
// puts the ranks' parts side by side).
size_t CpuModelRunner::kv_page_bytes(int block_size, PageKind kind) const {
  // A tensor-parallel rank's: its heads' part.
  return kind == PageKind::Exact ? kv_exact_page_bytes(*plan_, block_size) : ::kvlm::kv_page_bytes(*plan_, block_size);
}

void CpuModelRunner::save_pages(std::span<const BlockId> pages, std::span<uint8_t* const> out, PageKind kind) {
  KVLM_CHECK(cache_ != nullptr, "save_pages before allocate_kv");
  KVLM_CHECK(out.size() == pages.size(), "save_pages: one buffer per page");
  const bool exact = kind == PageKind::Exact;
  const size_t page = exact ? cache_->exact_page_bytes() : cache_->page_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < pages.size(); ++i)
    exact ? cache_->save_exact_page(pages[i], {out[i], page}) : cache_->save_page(pages[i], {out[i], page});
  page_times_.save_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void CpuModelRunner::load_pages(std::span<const BlockId> pages, std::span<const uint8_t* const> in, PageKind kind) {
  KVLM_CHECK(cache_ != nullptr, "load_pages before allocate_kv");
  KVLM_CHECK(in.size() == pages.size(), "load_pages: one buffer per page");
  const bool exact = kind == PageKind::Exact;
  const size_t page = exact ? cache_->exact_page_bytes() : cache_->page_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < pages.size(); ++i)
    exact ? cache_->load_exact_page(pages[i], {in[i], page}) : cache_->load_page(pages[i], {in[i], page});
  page_times_.load_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void CpuModelRunner::forward(const ForwardBatch& b, std::span<float> logits) {
  KVLM_CHECK(comm_->rank() == 0, "only tensor-parallel rank 0 forms logits; the other ranks run forward_follower");
  KVLM_CHECK(cache_ != nullptr, "forward before allocate_kv");
  const size_t T = b.tokens.size();
  KVLM_CHECK(b.positions.size() == T && b.slots.size() == T, "batch arrays differ in length");
  KVLM_CHECK(logits.size() == b.logit_rows.size() * size_t(output_width()), "logits buffer size");
  KVLM_CHECK(cache_->num_layers() == plan_->layers.size(), "KV cache built for another plan");
  CpuOps ops(b, *cache_, backends_, *comm_, observer_, block_math());
  ops.set_pooling(pooling());
  ops.set_states(&states_, state_slots_);
  if (draft_def_) ops.set_capture(feature_slot_, &features_, cfg_.hidden_size);
  const Tensor out = def_->forward(ops, weights_);
  if (!b.logit_rows.empty()) std::ranges::copy(f32(out), logits.begin());
  if (draft_def_) draft_def_->context(ops, draft_weights_, ops.features());
}

void CpuModelRunner::forward_follower(const ForwardBatch& b) {
  KVLM_CHECK(comm_->world_size() > 1, "forward_follower on a runner that is not a tensor-parallel rank");
  KVLM_CHECK(cache_ != nullptr, "forward before allocate_kv");
  KVLM_CHECK(b.positions.size() == b.tokens.size() && b.slots.size() == b.tokens.size(), "batch arrays differ in length");
  CpuOps ops(b, *cache_, backends_, *comm_, observer_, block_math(), /*logits=*/false);
  ops.set_states(&states_, state_slots_);
  def_->forward(ops, weights_);
}

void CpuModelRunner::draft(const ForwardBatch& b, std::span<float> logits) {
  KVLM_CHECK(draft_def_ != nullptr, "draft() without a drafter");
  KVLM_CHECK(cache_ != nullptr, "draft before allocate_kv");
  KVLM_CHECK(b.positions.size() == b.tokens.size() && b.slots.size() == b.tokens.size(), "batch arrays differ in length");
  KVLM_CHECK(logits.size() == b.logit_rows.size() * size_t(cfg_.vocab_size), "logits buffer size");
  CpuOps ops(b, *cache_, backends_, *comm_, observer_, block_math());
  const Tensor out = draft_def_->forward(ops, draft_weights_);
  if (!b.logit_rows.empty()) std::ranges::copy(f32(out), logits.begin());
}

}  // namespace kvlm

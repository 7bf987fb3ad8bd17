#include "model/decoder.h"

#include <cmath>
#include <set>

#include "core/error.h"
#include "core/log.h"
#include "model/rope.h"
#include "ops/cpu/ops.h"

namespace kvlm {

namespace cpu = ops::cpu;

DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt) {
  if (cfg.declared_dtype) return *cfg.declared_dtype;
  if (auto d = ckpt.dtype_of("model.embed_tokens.weight"); d && (*d == DType::F32 || *d == DType::F16 || *d == DType::BF16))
    return *d;
  return DType::BF16;
}

namespace {

class WeightLoader {
 public:
  // Large checkpoints show a progress line while loading (small ones would only flicker).
  explicit WeightLoader(const Checkpoint& c)
      : c_(c), progress_("loading weights", c.total_bytes() >= (size_t(256) << 20) ? c.total_bytes() : 0) {}
  std::vector<float> get(const std::string& name, std::initializer_list<int64_t> shape) {
    used_.insert(name);
    auto w = c_.load_f32(name, std::vector<int64_t>(shape));
    count_ += w.size();
    const TensorInfo* t = c_.find(name);
    progress_.update(bytes_ += t->end - t->begin);
    return w;
  }
  std::vector<float> opt(bool present, const std::string& name, std::initializer_list<int64_t> shape) {
    return present ? get(name, shape) : std::vector<float>{};
  }
  void note_used(const std::string& name) { used_.insert(name); }
  size_t count() const { return count_; }
  // Tensors the model did not consume, other than KV scales and cached RoPE tables.
  std::vector<std::string> unused() const {
    std::vector<std::string> out;
    for (const auto& n : c_.names()) {
      if (used_.count(n) || n.ends_with("_scale") || n.ends_with("rotary_emb.inv_freq")) continue;
      out.push_back(n);
    }
    return out;
  }

 private:
  const Checkpoint& c_;
  std::set<std::string> used_;
  size_t count_ = 0, bytes_ = 0;
  log::Progress progress_;
};

}  // namespace

DecoderModel::DecoderModel(ModelConfig config, const Checkpoint& ckpt, const KVPlan& plan,
                           std::vector<const AttentionBackend*> backends)
    : cfg_(std::move(config)), plan_(&plan), backends_(std::move(backends)) {
  const int64_t hd = cfg_.hidden_size, d = cfg_.head_dim, nh = cfg_.num_heads, kvh = cfg_.num_kv_heads;
  const int64_t inter = cfg_.intermediate_size, vocab = cfg_.vocab_size;
  KVLM_CHECK(plan.layers.size() == size_t(cfg_.num_layers) && backends_.size() == plan.layers.size(),
             "one KV spec and one backend per layer");
  WeightLoader w(ckpt);
  embed_ = w.get("model.embed_tokens.weight", {vocab, hd});
  if (cfg_.tie_word_embeddings) {
    w.note_used("lm_head.weight");  // some tied checkpoints still carry a copy
  } else if (!ckpt.find("lm_head.weight")) {
    throw Error("the checkpoint has no 'lm_head.weight' and config.json does not set tie_word_embeddings");
  } else {
    lm_head_ = w.get("lm_head.weight", {vocab, hd});
  }
  final_norm_ = w.get("model.norm.weight", {hd});
  layers_.resize(size_t(cfg_.num_layers));
  for (int i = 0; i < cfg_.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    Layer& L = layers_[size_t(i)];
    L.in_norm = w.get(p + "input_layernorm.weight", {hd});
    L.post_norm = w.get(p + "post_attention_layernorm.weight", {hd});
    L.wq = w.get(p + "self_attn.q_proj.weight", {nh * d, hd});
    L.wk = w.get(p + "self_attn.k_proj.weight", {kvh * d, hd});
    L.wv = w.get(p + "self_attn.v_proj.weight", {kvh * d, hd});
    L.wo = w.get(p + "self_attn.o_proj.weight", {hd, nh * d});
    L.bq = w.opt(cfg_.qkv_bias, p + "self_attn.q_proj.bias", {nh * d});
    L.bk = w.opt(cfg_.qkv_bias, p + "self_attn.k_proj.bias", {kvh * d});
    L.bv = w.opt(cfg_.qkv_bias, p + "self_attn.v_proj.bias", {kvh * d});
    L.bo = w.opt(cfg_.o_bias, p + "self_attn.o_proj.bias", {hd});
    L.q_norm = w.opt(cfg_.qk_norm, p + "self_attn.q_norm.weight", {d});
    L.k_norm = w.opt(cfg_.qk_norm, p + "self_attn.k_norm.weight", {d});
    L.w_gate = w.get(p + "mlp.gate_proj.weight", {inter, hd});
    L.w_up = w.get(p + "mlp.up_proj.weight", {inter, hd});
    L.w_down = w.get(p + "mlp.down_proj.weight", {hd, inter});
    L.b_gate = w.opt(cfg_.mlp_bias, p + "mlp.gate_proj.bias", {inter});
    L.b_up = w.opt(cfg_.mlp_bias, p + "mlp.up_proj.bias", {inter});
    L.b_down = w.opt(cfg_.mlp_bias, p + "mlp.down_proj.bias", {hd});
  }
  num_params_ = w.count();
  if (auto extra = w.unused(); !extra.empty())
    log::warn("ignoring " + std::to_string(extra.size()) + " checkpoint tensor(s) this architecture does not use, e.g. '" +
              extra.front() + "'");
  inv_freq_ = rope_inv_freq(cfg_.rope, cfg_.head_dim);
}

void DecoderModel::allocate_kv(int num_blocks, int block_size) {
  cache_.reset();  // release the old pool before allocating the new one
  cache_ = std::make_unique<KVCache>(*plan_, num_blocks, block_size);
}

void DecoderModel::copy_blocks(std::span<const std::pair<BlockId, BlockId>> pairs) {
  KVLM_CHECK(cache_ != nullptr, "copy_blocks before allocate_kv");
  for (const auto& [src, dst] : pairs) cache_->copy_block(src, dst);
}

void DecoderModel::forward(const ForwardBatch& b, std::span<float> logits) {
  KVLM_CHECK(cache_ != nullptr, "forward before allocate_kv");
  KVCache& cache = *cache_;
  const int T = int(b.tokens.size());
  const int hd = cfg_.hidden_size, d = cfg_.head_dim, nh = cfg_.num_heads, kvh = cfg_.num_kv_heads;
  const int inter = cfg_.intermediate_size, vocab = cfg_.vocab_size;
  const float eps = float(cfg_.rms_norm_eps);
  KVLM_CHECK(b.positions.size() == size_t(T) && b.slots.size() == size_t(T), "batch arrays differ in length");
  KVLM_CHECK(logits.size() == b.logit_rows.size() * size_t(vocab), "logits buffer size");
  KVLM_CHECK(cache.num_layers() == layers_.size(), "KV cache built for another plan");

  std::vector<float> x(size_t(T) * hd), h(size_t(T) * hd), tmp(size_t(T) * hd);
  std::vector<float> q(size_t(T) * nh * d), k(size_t(T) * kvh * d), v(size_t(T) * kvh * d), attn(size_t(T) * nh * d);
  std::vector<float> gate(size_t(T) * inter), up(size_t(T) * inter);
  for (int t = 0; t < T; ++t) {
    const TokenId id = b.tokens[size_t(t)];
    if (id < 0 || id >= vocab)
      throw Error("token id " + std::to_string(id) + " is outside the vocabulary (0.." + std::to_string(vocab - 1) + ")");
    std::copy_n(embed_.begin() + ptrdiff_t(id) * hd, hd, x.begin() + ptrdiff_t(t) * hd);
  }
  const float softmax_scale = 1.0f / std::sqrt(float(d));
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    cpu::rmsnorm(x, T, hd, L.in_norm, eps, h);
    cpu::linear(h, T, hd, L.wq, nh * d, L.bq, q);
    cpu::linear(h, T, hd, L.wk, kvh * d, L.bk, k);
    cpu::linear(h, T, hd, L.wv, kvh * d, L.bv, v);
    if (cfg_.qk_norm) {
      cpu::rmsnorm(q, T * nh, d, L.q_norm, eps, q);
      cpu::rmsnorm(k, T * kvh, d, L.k_norm, eps, k);
    }
    cpu::rope(q, T, nh, d, b.positions, inv_freq_);
    cpu::rope(k, T, kvh, d, b.positions, inv_freq_);
    if (observer_) observer_(li, k, v);
    const AttentionBackend& be = *backends_[li];
    be.store_kv(cache.layer(li), KVWrite{.k = k, .v = v, .slots = b.slots});
    be.attend(cache.layer(li), AttentionCall{.q = q, .out = attn, .seqs = b.seqs, .softmax_scale = softmax_scale});
    cpu::linear(attn, T, nh * d, L.wo, hd, L.bo, tmp);
    cpu::add_inplace(x, tmp);
    cpu::rmsnorm(x, T, hd, L.post_norm, eps, h);
    cpu::linear(h, T, hd, L.w_gate, inter, L.b_gate, gate);
    cpu::linear(h, T, hd, L.w_up, inter, L.b_up, up);
    cpu::silu_mul(gate, up, gate);
    cpu::linear(gate, T, inter, L.w_down, hd, L.b_down, tmp);
    cpu::add_inplace(x, tmp);
  }
  const int R = int(b.logit_rows.size());
  std::vector<float> last(size_t(R) * hd);
  for (int r = 0; r < R; ++r) {
    const int row = b.logit_rows[size_t(r)];
    KVLM_CHECK(row >= 0 && row < T, "logit row out of range");
    std::copy_n(x.begin() + ptrdiff_t(row) * hd, hd, last.begin() + ptrdiff_t(r) * hd);
  }
  cpu::rmsnorm(last, R, hd, final_norm_, eps, last);
  cpu::linear(last, R, hd, lm_head_.empty() ? embed_ : lm_head_, vocab, {}, logits);
}

}  // namespace kvlm

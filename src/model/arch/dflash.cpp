// DFlash's block drafter (arXiv 2602.06036; the layout of its reference code's
// DFlashDraftModel and vLLM's qwen3_dflash.py): a few Qwen3 decoder layers at the target's
// hidden size, no embedding or LM head of their own, conditioned on target features.
//
//   context (every row of a target step, position p):
//     c = RMSNorm_hidden_norm( concat(target layer outputs at target_layer_ids) Wfc^T )
//     per layer: k = RoPE(k_norm(c Wk^T)), v = c Wv^T -> the layer's pages at p
//       (the context enters only as K/V: no input norm, no query, the same c for every layer)
//   block (a sequence's next block_size positions n .. n + B - 1):
//     x = embed_target([last token, mask, ..., mask])
//     per layer: the Qwen3 decoder layer, its attention non-causal over the context's K/V
//                and the block's own (the block's K/V go to the pages at n .., where the
//                target's next steps overwrite them)
//     logits = RMSNorm_norm(x) Wlm_target^T; row i > 0 proposes the token at n + i
#include <cmath>
#include <string>

#include <nlohmann/json.hpp>

#include "config/json_get.h"
#include "core/error.h"
#include "model/arch/blocks.h"
#include "model/architecture.h"

namespace kvlm {

namespace {

using namespace arch;

class DFlashDraft final : public DraftDefinition {
 public:
  DFlashDraft(const ModelConfig& c, const std::string& p, int first_layer)
      : cfg_(c), first_layer_(first_layer), features_(c.dflash->target_layer_ids) {
    const int64_t H = c.hidden_size, n = int64_t(features_.size());
    fc_ = weights_.add(WeightSpec{.pieces = {{p + "fc.weight", {H, n * H}}}, .role = WeightRole::Matrix, .linear = true});
    hidden_norm_ = add_norm(weights_, p + "hidden_norm.weight", H);
    norm_ = add_norm(weights_, p + "norm.weight", H);
    inv_freq_ = add_rope(weights_, c.rope, c.head_dim);
    for (int i = 0; i < c.num_layers; ++i)
      layers_.push_back(add_pre_norm_layer(weights_, c, p + "layers." + std::to_string(i) + "."));
  }

  std::span<const int> feature_layers() const override { return features_; }

  void context(Ops& ops, std::span<const Weight> w, Tensor features) const override {
    auto W = [&](size_t i) { return weight_or_empty(w, i); };
    const float eps = float(cfg_.rms_norm_eps);
    const int64_t T = ops.num_tokens(), H = cfg_.hidden_size;
    const int64_t QKV = int64_t(cfg_.num_heads + 2 * cfg_.num_kv_heads) * cfg_.head_dim;
    const Tensor c = ops.alloc(ActRole::Hidden, T, H);
    const Tensor qkv = ops.alloc(ActRole::Hidden, T, QKV);
    const Tensor q = ops.alloc(ActRole::Query, T, int64_t(cfg_.num_heads) * cfg_.head_dim);  // unused
    ops.linear(features, w[fc_], {}, c);
    ops.rmsnorm(c, w[hidden_norm_], eps, c);
    for (size_t li = 0; li < layers_.size(); ++li) {
      const PreNormLayerWeights& L = layers_[li];
      ops.linear(c, w[L.attn.qkv], W(L.attn.bqkv), qkv);
      ops.attention_prologue(
          first_layer_ + int(li), qkv,
          {.q_norm = W(L.attn.q_norm), .k_norm = W(L.attn.k_norm), .inv_freq = w[inv_freq_], .eps = eps}, q);
    }
  }

  Tensor forward(Ops& ops, std::span<const Weight> w) const override {
    const float scale = softmax_scale(cfg_, cfg_.rope);
    const Weight embed = w[weights_.specs.size()], lm_head = w[weights_.specs.size() + 1];
    const DecoderActivations a = alloc_decoder_activations(ops, cfg_);
    ops.embed(embed, 1.0f, a.x);
    Tensor pending;
    for (size_t li = 0; li < layers_.size(); ++li)
      pending = pre_norm_layer(ops, cfg_, a, w, layers_[li], first_layer_ + int(li), pending, w[inv_freq_], scale, -1);
    return final_logits(ops, cfg_, a.x, pending, w[norm_], lm_head);
  }

 private:
  ModelConfig cfg_;
  int first_layer_;
  std::vector<int> features_;
  size_t fc_ = kNoWeight, hidden_norm_ = kNoWeight, norm_ = kNoWeight, inv_freq_ = kNoWeight;
  std::vector<PreNormLayerWeights> layers_;
};

// DFlash's fields; every drafter layer attends non-causally (the block sees itself whole and
// the context before it). target_layer_ids default as the DFlash reference code builds them:
// one layer for a 1-layer drafter (the middle one), else spread evenly over [1, N - 3].
DFlashConfig parse_dflash(const nlohmann::json& cfg, ModelConfig& m) {
  DFlashConfig d;
  const std::string where = "config.json (DFlash drafter)";
  d.block_size = int(json_get::req_int(cfg, "block_size", where));
  if (d.block_size < 2 || d.block_size > 64)
    throw Error(where + ": block_size must be between 2 and 64, got " + std::to_string(d.block_size));
  d.num_target_layers = int(json_get::opt_int(cfg, "num_target_layers", where).value_or(0));
  const nlohmann::json* dc = json_get::find(cfg, "dflash_config");
  if (!dc || !dc->is_object()) throw Error(where + ": 'dflash_config' (mask_token_id, target_layer_ids) is missing");
  const auto mask = json_get::opt_int(*dc, "mask_token_id", where + " dflash_config");
  if (!mask) throw Error(where + ": dflash_config.mask_token_id is missing");
  if (*mask < 0 || *mask >= m.vocab_size)
    throw Error(where + ": dflash_config.mask_token_id " + std::to_string(*mask) + " is outside the vocabulary");
  d.mask_token_id = TokenId(*mask);
  if (const nlohmann::json* ids = json_get::find(*dc, "target_layer_ids")) {
    if (!ids->is_array() || ids->empty()) throw Error(where + ": dflash_config.target_layer_ids must be a non-empty list");
    for (const nlohmann::json& v : *ids) {
      if (!v.is_number_integer() || v.get<long long>() < 0)
        throw Error(where + ": dflash_config.target_layer_ids must hold non-negative layer indices");
      d.target_layer_ids.push_back(int(v.get<long long>()));
    }
  } else {
    if (d.num_target_layers <= 0)
      throw Error(where + ": dflash_config.target_layer_ids is missing and there is no num_target_layers to derive it");
    const int n = d.num_target_layers, k = m.num_layers;
    if (k == 1) {
      d.target_layer_ids = {n / 2};
    } else {
      const double start = 1, span = double(n - 3) - start;
      for (int i = 0; i < k; ++i) d.target_layer_ids.push_back(int(std::nearbyint(start + double(i) * span / double(k - 1))));  // Python's round: ties to even
    }
  }
  for (const auto& l : m.layers)
    if (l.kind == AttentionKind::Sliding)
      throw Error(where + ": sliding-window drafter layers are not supported (a DFlash block attends to its whole context)");
  for (auto& l : m.layers) l = {AttentionKind::NonCausal, 0};
  return d;
}

void parse(const nlohmann::json& cfg, ModelConfig& m) {
  arch_config::require_silu(cfg, "DFlash drafters");
  arch_config::parse_standard_rope(cfg, m);
  m.qk_norm = true;
  m.qkv_bias = m.o_bias = json_get::opt_bool(cfg, "attention_bias", "config.json").value_or(false);
  arch_config::set_qwen_layer_windows(cfg, m);
  m.dflash = parse_dflash(cfg, m);
}

}  // namespace

namespace arch_specs {
extern const ArchSpec dflash{
    .name = "DFlashDraftModel",
    .parse = parse,
    .not_a_model = "this is a DFlash drafter (DFlashDraftModel), not a model that generates on its own; use it as "
                   "--speculative-config '{\"method\":\"dflash\",\"model\":DIR,...}' next to its target model"};
}  // namespace arch_specs

std::unique_ptr<DraftDefinition> make_dflash_draft(const ModelConfig& cfg, const std::string& prefix, int first_layer) {
  KVLM_CHECK(cfg.dflash.has_value(), "make_dflash_draft for a config without dflash fields");
  return std::make_unique<DFlashDraft>(cfg, prefix, first_layer);
}

}  // namespace kvlm

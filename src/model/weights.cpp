#include "model/weights.h"

#include <algorithm>
#include <set>

#include "core/error.h"
#include "core/log.h"

namespace kvlm {

int64_t WeightSpec::rows() const {
  if (pieces.empty()) return int64_t(constant.size());
  int64_t r = 0;
  for (const auto& p : pieces) r += p.shape.empty() ? 1 : p.shape[0];
  return r;
}

int64_t WeightSpec::cols() const {
  if (pieces.empty() || pieces[0].shape.size() < 2) return 1;
  int64_t c = 1;
  for (size_t i = 1; i < pieces[0].shape.size(); ++i) c *= pieces[0].shape[i];
  return c;
}

DType model_dtype(const ModelConfig& cfg, const Checkpoint& ckpt) {
  if (cfg.declared_dtype) return *cfg.declared_dtype;
  if (auto d = ckpt.dtype_of("model.embed_tokens.weight"); d && (*d == DType::F32 || *d == DType::F16 || *d == DType::BF16))
    return *d;
  return DType::BF16;
}

LoadedWeights load_weights(const WeightList& list, const Checkpoint& ckpt, WeightSink& sink) {
  std::set<std::string> used(list.known_unused.begin(), list.known_unused.end());
  size_t tensor_bytes = 0;
  for (const WeightSpec& s : list.specs) {
    for (const WeightPiece& p : s.pieces) {
      const TensorInfo* t = ckpt.find(p.name);
      if (!t) throw Error("the checkpoint is missing tensor '" + p.name + "'" + s.missing_hint);
      tensor_bytes += t->end - t->begin;
    }
  }
  sink.reserve(list.specs);
  // Large checkpoints show a progress line while loading (small ones would only flicker).
  log::Progress progress("loading weights", tensor_bytes >= (size_t(256) << 20) ? tensor_bytes : 0);
  LoadedWeights out;
  size_t done = 0;
  std::vector<TensorView> views;
  std::vector<float> values, conv;
  for (const WeightSpec& s : list.specs) {
    views.clear();
    for (const WeightPiece& p : s.pieces) {
      const TensorInfo& t = *ckpt.find(p.name);  // checked before the view: a GGUF view dequantizes
      if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16)
        throw Error("tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                    "; kvlm loads bfloat16, float16 and float32 weights (quantized weights are not supported)");
      if (!std::ranges::equal(t.shape, p.shape))
        throw Error("tensor " + ckpt.describe(t.name) + " has shape " + shape_str(t.shape) + " but " +
                    (ckpt.embedded_config() ? "the GGUF metadata implies " : "config.json implies ") + shape_str(p.shape));
      used.insert(p.name);
      out.num_params += size_t(t.numel());
      views.push_back(ckpt.view(p.name));
    }
    values.clear();
    if (s.role == WeightRole::Constant) {
      values = s.constant;
    } else if (s.role == WeightRole::Norm) {
      for (const TensorView& v : views) {
        conv.resize(size_t(v.info->numel()));
        convert_to_f32(v.info->dtype, v.bytes, conv);
        values.insert(values.end(), conv.begin(), conv.end());
      }
      if (s.add_one)
        for (float& x : values) x += 1.0f;
    }
    out.weights.push_back(sink.store(s, views, values));
    for (const TensorView& v : views) progress.update(done += v.bytes.size());
    for (const WeightPiece& p : s.pieces) ckpt.release(p.name);  // a GGUF tensor's dequantized copy
  }
  std::vector<std::string> extra;
  for (const auto& n : ckpt.names())
    if (!used.count(n) && !n.ends_with("_scale") && !n.ends_with("rotary_emb.inv_freq")) extra.push_back(n);
  if (!extra.empty())
    log::warn("ignoring " + std::to_string(extra.size()) + " checkpoint tensor(s) this architecture does not use, e.g. '" +
              extra.front() + "'");
  return out;
}

}  // namespace kvlm

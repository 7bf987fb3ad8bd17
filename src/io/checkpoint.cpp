#include "io/checkpoint.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/error.h"
#include "core/log.h"
#include "io/ggml_dequant.h"
#include "io/gguf.h"
#include "io/grouped_codes.h"
#include "io/gguf_model.h"

namespace kvlm {

using nlohmann::json;

std::string shape_str(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Checkpoint::~Checkpoint() = default;
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;

ModelConfig Checkpoint::model_config(const std::filesystem::path& dir) const {
  if (gguf_config_) return parse_model_config(*gguf_config_, gguf_gen_ ? &*gguf_gen_ : nullptr);
  ModelConfig c = load_model_config(dir);
  if (!slices_.empty()) {  // MXFP4 experts, shown one expert at a time (split_mxfp4_experts)
    if (!c.moe)
      throw Error("the checkpoint holds MXFP4 expert tensors, but its config describes " +
                  std::string(arch_name(c.arch)) + ", which has no experts");
    c.moe->per_expert_tensors = true;
  }
  return c;
}

Checkpoint Checkpoint::open(const std::filesystem::path& dir) {
  Checkpoint c;
  std::error_code ec;
  if (const auto gguf = find_gguf(dir)) {
    c.gguf_file_ = std::make_unique<GGUFFile>(*gguf);
    GGUFModel m = map_gguf_model(c.gguf_file_->header(), gguf->string());
    add_rope_freq_factors(*c.gguf_file_, m);
    c.gguf_config_ = m.config;
    c.gguf_gen_ = m.generation_config;
    c.gguf_notes_ = m.notes;
    c.gguf_infos_.reserve(m.tensors.size());
    c.gguf_sources_.reserve(m.tensors.size());
    c.gguf_data_.resize(m.tensors.size());
    for (const auto& [name, src] : m.tensors) {
      const GGUFTensorInfo* t = c.gguf_file_->header().find_tensor(src.gguf_name);
      TensorInfo info{.name = name, .dtype = DType::F32, .shape = gguf_source_shape(*t, src), .begin = 0};
      info.end = size_t(info.numel()) * sizeof(float);
      c.gguf_infos_.push_back(std::move(info));
      c.gguf_sources_.push_back(src);
      c.tensors_.emplace(name, std::make_pair(nullptr, &c.gguf_infos_.back()));
    }
    log::info("opened " + gguf->string() + ": " + std::to_string(m.tensors.size()) + " tensors");
    return c;
  }
  if (std::filesystem::is_regular_file(dir, ec)) check_model_dir(dir);  // says what a file --model must be
  if (!std::filesystem::is_directory(dir, ec))
    throw Error("model directory '" + dir.string() + "' does not exist or is not a directory");
  const auto single = dir / "model.safetensors";
  const auto index = dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index, ec)) {
    const json j = read_json_file(index);
    const json* wm = j.is_object() && j.contains("weight_map") ? &j["weight_map"] : nullptr;
    if (!wm || !wm->is_object() || wm->empty())
      throw Error(index.string() + ": expected a non-empty 'weight_map' object");
    std::map<std::string, const SafetensorsFile*> opened;
    for (auto it = wm->begin(); it != wm->end(); ++it) {
      if (!it.value().is_string()) throw Error(index.string() + ": weight_map entry '" + it.key() + "' is not a file name");
      const std::string file = it.value().get<std::string>();
      const std::filesystem::path rel(file);
      if (file.empty() || rel.is_absolute() || file.find("..") != std::string::npos)
        throw Error(index.string() + ": weight_map entry '" + it.key() + "' points outside the model directory: '" + file + "'");
      auto [pos, fresh] = opened.try_emplace(file, nullptr);
      if (fresh) {
        if (!std::filesystem::exists(dir / rel, ec))
          throw Error(index.string() + " lists shard '" + file + "' (for tensor '" + it.key() + "'), which is missing");
        c.files_.push_back(std::make_unique<SafetensorsFile>(dir / rel));
        pos->second = c.files_.back().get();
      }
      const TensorInfo* t = pos->second->find(it.key());
      if (!t) throw Error(index.string() + " says tensor '" + it.key() + "' is in '" + file + "', but that shard does not hold it");
      c.tensors_.emplace(it.key(), std::make_pair(pos->second, t));
    }
  } else if (std::filesystem::exists(single, ec)) {
    c.files_.push_back(std::make_unique<SafetensorsFile>(single));
    for (const auto& t : c.files_.back()->header().tensors) c.tensors_.emplace(t.name, std::make_pair(c.files_.back().get(), &t));
  } else {
    throw Error("'" + dir.string() + "' has neither model.safetensors nor model.safetensors.index.json; kvlm loads safetensors checkpoints");
  }
  // A bare base model (saved from Qwen3Model and its kind, as Qwen3-Embedding ships): its
  // tensors lack the "model." prefix that the ...ForCausalLM names carry. transformers loads
  // it under the prefix; so does kvlm, which then finds no lm_head (embedding models have none).
  if (!c.tensors_.contains("model.embed_tokens.weight") && c.tensors_.contains("embed_tokens.weight") &&
      std::ranges::none_of(c.tensors_, [](const auto& e) { return e.first.starts_with("model."); })) {
    decltype(c.tensors_) prefixed;
    for (auto& [name, where] : c.tensors_) prefixed.emplace(name == "lm_head.weight" ? name : "model." + name, where);
    c.tensors_ = std::move(prefixed);
    c.bare_base_model_ = true;
  }
  // A multimodal checkpoint (Qwen3_5ForConditionalGeneration): its language model's tensors
  // under model.language_model. (transformers 5) or language_model.model. (4.x), which kvlm
  // finds under the causal model's names; the vision tower's keep theirs (unused: skipped).
  if (std::ranges::any_of(c.tensors_, [](const auto& e) {
        return e.first.starts_with("model.language_model.") || e.first.starts_with("language_model.model.");
      })) {
    decltype(c.tensors_) renamed;
    for (auto& [name, where] : c.tensors_) {
      std::string n = name;
      for (const std::string_view p : {"model.language_model.", "language_model.model."})
        if (n.starts_with(p)) n = "model." + n.substr(p.size());
      if (n == "language_model.lm_head.weight") n = "lm_head.weight";
      renamed.emplace(std::move(n), where);
    }
    c.tensors_ = std::move(renamed);
    c.renamed_ = true;
  }
  c.open_int4(dir);
  return c;
}

void Checkpoint::open_int4(const std::filesystem::path& dir) {
  // Only a checkpoint with packed modules reads its config here (the model config's own parse
  // reports a malformed config.json, as for any checkpoint).
  auto bases_of = [&](Int4Scheme::Kind k) {
    const Int4TensorNames& n = int4_tensor_names(k);
    const std::string suffix = n.sep + std::string(n.packed);
    std::vector<std::string> out;
    for (const auto& [name, where] : tensors_)
      if (name.size() > suffix.size() && name.ends_with(suffix)) out.push_back(name.substr(0, name.size() - suffix.size()));
    return out;
  };
  using K = Int4Scheme::Kind;
  const std::pair<K, std::vector<std::string>> found[] = {
      {K::Awq, bases_of(K::Awq)}, {K::CompressedTensors, bases_of(K::CompressedTensors)}, {K::Mxfp4, bases_of(K::Mxfp4)}};
  std::error_code ec;
  const auto cfg = dir / "config.json";
  if (std::ranges::all_of(found, [](const auto& f) { return f.second.empty(); }) || !std::filesystem::exists(cfg, ec))
    return;
  int4_scheme_ = parse_int4_scheme(read_json_file(cfg));
  if (!int4_scheme_) return;
  const Int4TensorNames& n = int4_tensor_names(int4_scheme_->kind);
  const K packing = int4_scheme_->kind == K::Gptq ? K::Awq : int4_scheme_->kind;  // AWQ and GPTQ: .qweight
  const std::vector<std::string>* bases = nullptr;
  for (const auto& [k, b] : found) {
    if (k == packing) {
      bases = &b;
    } else if (!b.empty()) {
      const Int4TensorNames& o = int4_tensor_names(k);
      throw Error("tensor '" + b.front() + o.sep + o.packed + "' is packed as " +
                  (k == K::Awq ? "AWQ or GPTQ lay it out" : k == K::Mxfp4 ? "MXFP4 lays it out"
                                                                          : "compressed-tensors lays it out") +
                  ", but config.json declares " + int4_scheme_->describe() +
                  "; the checkpoint's tensors and its quantization_config disagree");
    }
  }
  int4_infos_.reserve(bases->size());  // stable addresses: tensors_ points at them
  int4_sources_.reserve(bases->size());
  int4_data_.resize(bases->size());
  auto take = [&](const std::string& name) -> std::pair<const SafetensorsFile*, const TensorInfo*> {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) return {nullptr, nullptr};
    auto v = it->second;
    tensors_.erase(it);
    return v;
  };
  auto named = [&](const std::string& b, const char* suffix) { return *suffix ? b + n.sep + suffix : std::string(); };
  for (const std::string& b : *bases) {
    const std::string weight = b + n.weight;
    if (tensors_.contains(weight))
      throw Error("the checkpoint has both '" + weight + "' and '" + named(b, n.packed) + "'; it is not a valid " +
                  int4_scheme_->describe() + " checkpoint");
    Int4Source src{.base = b, .qweight = take(named(b, n.packed)), .qzeros = take(named(b, n.zeros)),
                   .scales = take(named(b, n.scales)), .g_idx = take(named(b, n.g_idx))};
    const auto shape = take(named(b, n.shape));
    const TensorView shape_view = shape.first ? shape.first->view(*shape.second) : TensorView{};
    src.module = check_int4_module(*int4_scheme_, b, src.qweight.second, src.qzeros.second, src.scales.second,
                                   src.g_idx.second, shape.first ? &shape_view : nullptr);
    src.group = int4_grouped_group(*int4_scheme_, src.module, Int4Views(src).index());
    const Int4Module& m = src.module;
    std::vector<int64_t> dims = m.experts ? std::vector<int64_t>{m.experts, m.cols, m.rows}
                                          : std::vector<int64_t>{m.rows, m.cols};
    const uint64_t numel = uint64_t(m.rows * m.cols * std::max<int64_t>(m.experts, 1));
    int4_infos_.push_back(
        TensorInfo{.name = weight, .dtype = DType::F32, .shape = std::move(dims), .begin = 0, .end = numel * sizeof(float)});
    int4_sources_.push_back(std::move(src));
    tensors_.emplace(weight, std::make_pair(nullptr, &int4_infos_.back()));
  }
  log::info("opened " + std::to_string(bases->size()) + " " + int4_scheme_->describe() + " tensors");
  if (int4_scheme_->kind == K::Mxfp4) split_mxfp4_experts();
}

void Checkpoint::split_mxfp4_experts() {
  size_t count = 0;
  for (const Int4Source& s : int4_sources_) count += size_t(s.module.experts) * 6;  // an upper bound
  slice_infos_.reserve(count);  // stable addresses: tensors_ points at them
  slices_.reserve(count);
  auto add = [&](const std::string& name, ExpertSlice slice, std::vector<int64_t> shape) {
    TensorInfo info{.name = name, .dtype = DType::F32, .shape = std::move(shape), .begin = 0};
    info.end = size_t(info.numel()) * sizeof(float);
    slice_infos_.push_back(std::move(info));
    slices_.push_back(slice);
    tensors_.emplace(name, std::make_pair(nullptr, &slice_infos_.back()));
  };
  for (size_t i = 0; i < int4_sources_.size(); ++i) {
    const Int4Source& s = int4_sources_[i];
    const Int4Module& m = s.module;
    const bool gate_up = s.base.ends_with(".gate_up_proj");
    if (!gate_up && !s.base.ends_with(".down_proj"))
      throw Error("MXFP4 tensor '" + s.base + "_blocks': kvlm reads MXFP4 as GPT-OSS's experts "
                  "(mlp.experts.gate_up_proj and down_proj), not in other modules");
    const std::string prefix = s.base.substr(0, s.base.rfind('.') + 1);  // "model.layers.N.mlp.experts."
    tensors_.erase(s.base);  // the fused virtual tensor: the experts stand in for it
    // The fused bias [E][rows], if any, goes the same way.
    const std::string bias_name = s.base + "_bias";
    std::pair<const SafetensorsFile*, const TensorInfo*> bias{};
    if (auto it = tensors_.find(bias_name); it != tensors_.end() && it->second.first) {
      bias = it->second;
      const TensorInfo& t = *bias.second;
      if (t.shape != std::vector<int64_t>{m.experts, m.rows} ||
          (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16))
        throw Error("tensor '" + bias_name + "' has dtype " + std::string(dtype_name(t.dtype)) + " and shape " +
                    shape_str(t.shape) + "; expected a floating-point [" + std::to_string(m.experts) + ", " +
                    std::to_string(m.rows) + "] (one bias per expert and row of '" + s.base + "_blocks')");
      tensors_.erase(it);
    }
    const std::pair<const char*, int> parts[2] = {gate_up ? std::pair{"gate_proj", 0} : std::pair{"down_proj", -1},
                                                  {"up_proj", 1}};
    for (int64_t e = 0; e < m.experts; ++e)
      for (int pi = 0; pi < (gate_up ? 2 : 1); ++pi) {
        const auto [part, parity] = parts[pi];
        const std::string x = prefix + std::to_string(e) + "." + part;
        const int64_t rows = mxfp4_expert_rows(m, parity);
        add(x + ".weight", {.module = ptrdiff_t(i), .expert = e, .parity = parity}, {rows, m.cols});
        if (bias.first) add(x + ".bias", {.bias = bias, .expert = e, .parity = parity}, {rows});
      }
  }
  slice_data_.resize(slices_.size());
}

ptrdiff_t Checkpoint::slice_index(const TensorInfo* t) const {
  if (slice_infos_.empty() || t < slice_infos_.data() || t >= slice_infos_.data() + slice_infos_.size()) return -1;
  return t - slice_infos_.data();
}

Checkpoint::Int4Views::Int4Views(const Int4Source& s) {
  auto view_of = [](const std::pair<const SafetensorsFile*, const TensorInfo*>& p) {
    return p.first ? p.first->view(*p.second) : TensorView{};
  };
  qweight = view_of(s.qweight);
  qzeros = view_of(s.qzeros);
  scales = view_of(s.scales);
  g_idx = view_of(s.g_idx);
}

ptrdiff_t Checkpoint::int4_index(const TensorInfo* t) const {
  if (int4_infos_.empty() || t < int4_infos_.data() || t >= int4_infos_.data() + int4_infos_.size()) return -1;
  return t - int4_infos_.data();
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : it->second.second;
}

TensorView Checkpoint::view(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw Error("the checkpoint is missing tensor '" + std::string(name) + "'");
  if (const ptrdiff_t x = it->second.first ? -1 : slice_index(it->second.second); x >= 0) {  // an MXFP4 expert
    const ExpertSlice& sl = slices_[size_t(x)];
    std::lock_guard lock(*gguf_mu_);
    auto& data = slice_data_[size_t(x)];
    if (data.empty()) {
      if (sl.module >= 0) {  // through the ggml rows blocks() hands over: one conversion, the block kernels' values
        const Int4Source& s = int4_sources_[size_t(sl.module)];
        const Int4Views v(s);
        const int64_t rows = mxfp4_expert_rows(s.module, sl.parity);
        std::vector<uint8_t> blocks(size_t(rows * s.module.cols / 32 * 17));
        mxfp4_expert_to_ggml(s.module, v.qweight, v.scales, sl.expert, sl.parity, blocks.data());
        data.resize(size_t(rows * s.module.cols));
        dequantize_ggml(uint32_t(GGMLType::MXFP4), blocks, data);
      } else {  // a bias: expert's row of [E][rows], every entry or every other one
        const TensorView b = sl.bias.first->view(*sl.bias.second);
        const int64_t all = sl.bias.second->shape[1];
        std::vector<float> row(static_cast<size_t>(all));
        const size_t es = dtype_size(b.info->dtype);
        convert_to_f32(b.info->dtype, b.bytes.subspan(size_t(sl.expert * all) * es, size_t(all) * es), row);
        for (int64_t r = 0; r < all; ++r)
          if (sl.parity < 0 || r % 2 == sl.parity) data.push_back(row[size_t(r)]);
      }
    }
    return {it->second.second, {reinterpret_cast<const uint8_t*>(data.data()), data.size() * sizeof(float)}};
  }
  if (const ptrdiff_t q = it->second.first ? -1 : int4_index(it->second.second); q >= 0) {  // 4-bit modules
    const Int4Source& s = int4_sources_[size_t(q)];
    std::lock_guard lock(*gguf_mu_);
    auto& data = int4_data_[size_t(q)];
    if (data.empty()) {
      const Int4Views v(s);
      data = dequantize_int4(*int4_scheme_, s.module, v.qweight, v.zeros(), v.scales, v.index());
    }
    return {it->second.second, {reinterpret_cast<const uint8_t*>(data.data()), data.size() * sizeof(float)}};
  }
  if (!it->second.first) {  // GGUF: dequantized now, held until release()
    const TensorInfo* t = it->second.second;
    const size_t i = size_t(t - gguf_infos_.data());
    std::lock_guard lock(*gguf_mu_);
    auto& data = gguf_data_[i];
    if (data.empty()) data = load_gguf_tensor(*gguf_file_, gguf_sources_[i]);
    return {t, {reinterpret_cast<const uint8_t*>(data.data()), data.size() * sizeof(float)}};
  }
  return it->second.first->view(*it->second.second);
}

std::optional<Checkpoint::Blocks> Checkpoint::blocks(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end() || it->second.first) return std::nullopt;
  if (const ptrdiff_t x = slice_index(it->second.second); x >= 0) {  // an MXFP4 expert's weight as ggml MXFP4 rows
    const ExpertSlice& sl = slices_[size_t(x)];
    if (sl.module < 0) return std::nullopt;
    const Int4Source& s = int4_sources_[size_t(sl.module)];
    return Blocks{.type = uint32_t(GGMLType::MXFP4), .rows = mxfp4_expert_rows(s.module, sl.parity),
                  .cols = s.module.cols, .row_bytes = size_t(s.module.cols / 32 * 17),
                  .fill = [&s, sl](uint8_t* out) {
                    const Int4Views v(s);
                    mxfp4_expert_to_ggml(s.module, v.qweight, v.scales, sl.expert, sl.parity, out);
                  }};
  }
  if (const ptrdiff_t q = int4_index(it->second.second); q >= 0) {  // a 4-bit module as grouped rows, if it fits
    const Int4Source& s = int4_sources_[size_t(q)];
    if (!s.group) return std::nullopt;
    return Blocks{.type = grouped_rows_type(s.group), .rows = s.module.rows, .cols = s.module.cols,
                  .row_bytes = grouped_rows_bytes(s.group, s.module.cols), .fill = [this, &s](uint8_t* out) {
                    const Int4Views v(s);
                    int4_to_grouped_rows(*int4_scheme_, s.module, v.qweight, v.zeros(), v.scales, v.index(), s.group,
                                         out);
                  }};
  }
  const GGUFTensorSource& src = gguf_sources_[size_t(it->second.second - gguf_infos_.data())];
  const GGUFTensorInfo* t = gguf_file_->header().find_tensor(src.gguf_name);
  const auto traits = ggml_type_traits(t->type);
  if (!traits || traits->block == 1 || src.minus_one || t->ne.size() != (src.expert >= 0 ? 3u : 2u)) return std::nullopt;
  const int64_t cols = t->ne[0], rows = t->ne[1];
  return Blocks{.type = t->type, .bytes = gguf_source_bytes(*gguf_file_, *t, src), .rows = rows, .cols = cols,
                .row_bytes = size_t(cols / traits->block * traits->block_bytes), .unpermute_heads = src.unpermute_heads};
}

std::string Checkpoint::describe(std::string_view name) const {
  std::string s = "'" + std::string(name) + "'";
  auto it = tensors_.find(name);
  if (const ptrdiff_t x = it != tensors_.end() && !it->second.first ? slice_index(it->second.second) : -1; x >= 0) {
    const ExpertSlice& sl = slices_[size_t(x)];
    const std::string rows = sl.parity < 0 ? "" : sl.parity == 0 ? "even rows of " : "odd rows of ";
    s += " (expert " + std::to_string(sl.expert) + "'s " + rows +
         (sl.module >= 0 ? "MXFP4 '" + int4_sources_[size_t(sl.module)].base + "_blocks'"
                         : "'" + sl.bias.second->name + "'") +
         ")";
  } else if (it != tensors_.end() && !it->second.first && int4_index(it->second.second) >= 0)
    s += " (" + int4_scheme_->describe() + ", from '" + int4_sources_[size_t(int4_index(it->second.second))].base +
         int4_tensor_names(int4_scheme_->kind).sep + int4_tensor_names(int4_scheme_->kind).packed + "')";
  else if (it != tensors_.end() && !it->second.first)
    s += " (" + gguf_source_label(gguf_sources_[size_t(it->second.second - gguf_infos_.data())]) + ")";
  else if (it != tensors_.end() && (bare_base_model_ || renamed_) && it->second.second->name != name)
    s += " (stored as '" + it->second.second->name + "')";
  return s;
}

void Checkpoint::release(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end() || it->second.first) return;
  std::lock_guard lock(*gguf_mu_);
  if (const ptrdiff_t x = slice_index(it->second.second); x >= 0) {
    std::vector<float>().swap(slice_data_[size_t(x)]);
    return;
  }
  if (const ptrdiff_t q = int4_index(it->second.second); q >= 0) {
    std::vector<float>().swap(int4_data_[size_t(q)]);
    return;
  }
  std::vector<float>().swap(gguf_data_[size_t(it->second.second - gguf_infos_.data())]);
}

size_t Checkpoint::total_bytes() const {
  size_t b = 0;
  for (const auto& [name, ft] : tensors_) b += ft.second->end - ft.second->begin;
  return b;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : tensors_) out.push_back(k);
  return out;
}

std::optional<DType> Checkpoint::dtype_of(std::string_view name) const {
  const TensorInfo* t = find(name);
  return t ? std::optional<DType>(t->dtype) : std::nullopt;
}

std::vector<float> Checkpoint::load_f32(std::string_view name, std::span<const int64_t> expected_shape) const {
  const TensorView v = view(name);
  const TensorInfo& t = *v.info;
  if (t.dtype != DType::F32 && t.dtype != DType::F16 && t.dtype != DType::BF16)
    throw Error("tensor '" + t.name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                "; kvlm loads bfloat16, float16 and float32 weights (quantized weights are not supported)");
  if (!std::ranges::equal(t.shape, expected_shape))
    throw Error("tensor '" + t.name + "' has shape " + shape_str(t.shape) + " but config.json implies " + shape_str(expected_shape));
  std::vector<float> out(size_t(t.numel()));
  convert_to_f32(t.dtype, v.bytes, out);
  return out;
}

namespace {

std::optional<std::vector<float>> load_scale(const Checkpoint& c, const std::string& name) {
  const TensorInfo* t = c.find(name);
  if (!t) return std::nullopt;
  if (t->shape.size() > 1) throw Error("scale tensor '" + name + "' has shape " + shape_str(t->shape) + "; expected a scalar or a vector");
  const std::vector<int64_t> shape = t->shape;
  return c.load_f32(name, shape);
}

}  // namespace

std::optional<CheckpointScales> find_kv_scales(const Checkpoint& c, const AttentionLayerDesc& layer) {
  const std::string p = "model.layers." + std::to_string(layer.layer) + ".self_attn.";
  const std::pair<std::string, std::string> pairs[] = {
      {p + "k_scale", p + "v_scale"},
      {p + "attn.k_scale", p + "attn.v_scale"},
      {p + "k_proj.k_scale", p + "v_proj.v_scale"},
      {p + "k_proj.output_scale", p + "v_proj.output_scale"},
  };
  for (const auto& [kn, vn] : pairs) {
    auto k = load_scale(c, kn);
    auto v = load_scale(c, vn);
    if (k && v) return CheckpointScales{*k, *v, kn, vn};
    if (k || v)
      throw Error("the checkpoint has '" + (k ? kn : vn) + "' but not its partner '" + (k ? vn : kn) + "'");
  }
  if (auto kv = load_scale(c, p + "kv_scale")) return CheckpointScales{*kv, *kv, p + "kv_scale", p + "kv_scale"};
  return std::nullopt;
}

}  // namespace kvlm

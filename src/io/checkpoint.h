// A Hugging Face checkpoint: model.safetensors, or shards listed by
// model.safetensors.index.json, all mmapped — or a GGUF file (io/gguf_model.h), mmapped too,
// whose tensors appear as fp32 under their Hugging Face names (each dequantized when first
// viewed and held until release(), so a loader that releases what it has stored holds one
// dequantized tensor at a time) and whose metadata gives the config.json. Tensors are looked
// up by name; loading checks dtype and shape and names the tensor in every error.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kv/kv_plan.h"
#include "config/model_config.h"
#include "io/gguf_model.h"
#include "io/int4_checkpoint.h"
#include "io/safetensors.h"

namespace kvlm {

class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& dir);
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  // An AWQ, GPTQ, compressed-tensors W4A16 or MXFP4 checkpoint's scheme (io/int4_checkpoint.h):
  // its quantized modules appear as float32 `.weight` tensors (MXFP4's experts one expert at a
  // time: split_mxfp4_experts), dequantized when viewed and held until release().
  const std::optional<Int4Scheme>& int4_scheme() const { return int4_scheme_; }
  size_t int4_modules() const { return int4_infos_.size(); }

  // A GGUF model: the config.json its metadata describes (nullptr for safetensors), the open
  // file, and where each config field came from (GGUFModel::notes).
  const nlohmann::json* embedded_config() const { return gguf_config_ ? &*gguf_config_ : nullptr; }
  const GGUFFile* gguf_file() const { return gguf_file_.get(); }
  const std::vector<std::string>& gguf_notes() const { return gguf_notes_; }
  // The model's config: config.json (+ generation_config.json) of `dir`, or the GGUF file's.
  ModelConfig model_config(const std::filesystem::path& dir) const;

  const TensorInfo* find(std::string_view name) const;
  TensorView view(std::string_view name) const;  // throws when missing
  // 'name' for messages, with the GGUF tensor it comes from where it does.
  std::string describe(std::string_view name) const;
  // A GGUF tensor stored in quantization blocks (Q4_0 .. Q6_K: not F32/F16/BF16), as stored:
  // [rows][cols] with each row whole blocks. `unpermute_heads` > 0: the rows are Llama q/k rows
  // in GGUF's order (llama_head_source_row says where each Hugging Face row is). nullopt for a
  // safetensors tensor, a float GGUF tensor, or one whose values the loader changes (Gemma's
  // norms). view() still dequantizes such a tensor. A 4-bit checkpoint's modules come as blocks
  // too: grouped rows where their groups fit, an MXFP4 expert as ggml MXFP4 rows.
  struct Blocks {
    uint32_t type = 0;  // ggml type (io/gguf.h), or io/grouped_codes.h's grouped_rows_type
    std::span<const uint8_t> bytes;
    int64_t rows = 0, cols = 0;
    size_t row_bytes = 0;
    int unpermute_heads = 0;
    // Rows formed on request instead of `bytes` (a 4-bit checkpoint's module as grouped rows):
    // writes rows * row_bytes bytes.
    std::function<void(uint8_t*)> fill;
  };
  std::optional<Blocks> blocks(std::string_view name) const;
  // The caller is done with the tensor's view: a GGUF tensor's dequantized copy is freed.
  void release(std::string_view name) const;
  std::vector<std::string> names() const;
  size_t num_files() const { return files_.size(); }
  // The tensors were stored as a bare base model's ("embed_tokens.weight", "layers.0...."): they
  // are found here under the "model." names every architecture uses.
  bool bare_base_model() const { return bare_base_model_; }
  size_t total_bytes() const;  // all tensors' data
  // dtype of the first floating-point weight (embed_tokens), when config.json has none.
  std::optional<DType> dtype_of(std::string_view name) const;

  // Loads a floating-point tensor (F32/F16/BF16) as fp32 after checking its shape.
  std::vector<float> load_f32(std::string_view name, std::span<const int64_t> expected_shape) const;

 private:
  Checkpoint() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  // Safetensors tensors point into files_; GGUF ones (file nullptr) into gguf_infos_ / gguf_data_.
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>, std::less<>> tensors_;
  std::optional<nlohmann::json> gguf_config_;
  std::optional<nlohmann::json> gguf_gen_;  // its generation_config.json (gguf_model.h)
  std::unique_ptr<GGUFFile> gguf_file_;
  std::vector<std::string> gguf_notes_;
  bool bare_base_model_ = false;  // tensors stored without the "model." prefix (open() adds it)
  bool renamed_ = false;          // a multimodal checkpoint's language model, found under the causal names
  std::vector<TensorInfo> gguf_infos_;
  std::vector<GGUFTensorSource> gguf_sources_;
  mutable std::vector<std::vector<float>> gguf_data_;  // dequantized on view(), freed by release()
  std::unique_ptr<std::mutex> gguf_mu_ = std::make_unique<std::mutex>();
  // 4-bit modules: the virtual `.weight` tensors (file nullptr, like GGUF's), their packed
  // tensors (taken out of tensors_) and their values while viewed.
  struct Int4Source {
    std::string base;
    Int4Module module;
    std::pair<const SafetensorsFile*, const TensorInfo*> qweight, qzeros, scales, g_idx;
    int group = 0;  // the group blocks() hands it over in (int4_grouped_group), 0: none
  };
  // A module's tensors as views; zeros() and index() are null where it has none.
  struct Int4Views {
    explicit Int4Views(const Int4Source& s);
    TensorView qweight, qzeros, scales, g_idx;
    const TensorView* zeros() const { return qzeros.info ? &qzeros : nullptr; }
    const TensorView* index() const { return g_idx.info ? &g_idx : nullptr; }
  };
  std::optional<Int4Scheme> int4_scheme_;
  std::vector<TensorInfo> int4_infos_;
  std::vector<Int4Source> int4_sources_;
  mutable std::vector<std::vector<float>> int4_data_;
  // The index of a virtual tensor in int4_infos_, or -1 (a GGUF one).
  ptrdiff_t int4_index(const TensorInfo* t) const;
  void open_int4(const std::filesystem::path& dir);
  // MXFP4 experts (GPT-OSS) appear one expert at a time, as MoeConfig::per_expert_tensors reads
  // them: mlp.experts.E.{gate,up,down}_proj.{weight,bias}, each weight a slice of a module's
  // blocks that blocks() hands over as ggml MXFP4 rows (kept quantized where the device keeps
  // them), each bias a slice of the fused bias tensor. Their virtual tensors (file nullptr).
  struct ExpertSlice {
    ptrdiff_t module = -1;  // a weight: its int4_sources_ index; else a bias, of `bias` [E][rows]
    std::pair<const SafetensorsFile*, const TensorInfo*> bias{};
    int64_t expert = 0;
    int parity = -1;  // -1: every row; 0 / 1: the even / odd ones (gate / up of gate_up_proj)
  };
  std::vector<TensorInfo> slice_infos_;
  std::vector<ExpertSlice> slices_;
  mutable std::vector<std::vector<float>> slice_data_;
  ptrdiff_t slice_index(const TensorInfo* t) const;
  void split_mxfp4_experts();
};

// Per-tensor KV scales for one layer, under the names vLLM-compatible checkpoints use:
// self_attn.{k,v}_scale, self_attn.attn.{k,v}_scale, ModelOpt self_attn.{k,v}_proj.{k,v}_scale,
// compressed-tensors self_attn.{k,v}_proj.output_scale, legacy self_attn.kv_scale (both).
std::optional<CheckpointScales> find_kv_scales(const Checkpoint& ckpt, const AttentionLayerDesc& layer);

std::string shape_str(std::span<const int64_t> shape);

}  // namespace kvlm

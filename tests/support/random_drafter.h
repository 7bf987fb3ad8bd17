// A random DFlash drafter (DFlashDraftModel) for the bundled kvlm-tiny target, written as a
// model directory for the tests: config.json plus fp32 safetensors, its tensors kept for
// reference computations.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace kvlm::test {

// A random DFlash drafter for kvlm-tiny: `layers` Qwen3 layers at hidden 384 (6 q heads, 2 kv
// heads, head_dim 64), features from target layers 1, 3, 5, blocks of `block` tokens.
struct Drafter {
  std::filesystem::path dir;
  std::map<std::string, std::vector<float>> w;  // every tensor, fp32
  int layers = 1, block = 8, hidden = 384, nh = 6, kvh = 2, d = 64, inter = 512;
  std::vector<int> ids{1, 3, 5};
  TokenId mask = 5;
};

// `shape`: the drafter's sizes (another target than kvlm-tiny: pass its vocab_size and
// num_target_layers in `overrides` too).
inline Drafter make_drafter(const std::string& name, nlohmann::json overrides = nlohmann::json::object(), bool prefix = false,
                            Drafter shape = {}) {
  Drafter D = std::move(shape);
  D.dir = std::filesystem::temp_directory_path() / ("kvlm-dflash-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(D.dir);
  std::filesystem::create_directories(D.dir);
  nlohmann::json c = {{"architectures", {"DFlashDraftModel"}},
                      {"model_type", "qwen3"},
                      {"hidden_size", D.hidden},
                      {"intermediate_size", D.inter},
                      {"num_hidden_layers", D.layers},
                      {"num_attention_heads", D.nh},
                      {"num_key_value_heads", D.kvh},
                      {"head_dim", D.d},
                      {"vocab_size", 1911},
                      {"max_position_embeddings", 9216},
                      {"rms_norm_eps", 1e-6},
                      {"rope_theta", 100000.0},
                      {"hidden_act", "silu"},
                      {"tie_word_embeddings", false},
                      {"torch_dtype", "float32"},
                      {"block_size", D.block},
                      {"num_target_layers", 7},
                      {"dflash_config", {{"mask_token_id", D.mask}, {"target_layer_ids", D.ids}}}};
  c.update(overrides, true);
  std::ofstream(D.dir / "config.json") << c.dump(2);
  std::mt19937 rng(17);
  auto add = [&](const std::string& n, size_t count, float scale, float bias = 0.0f) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(count);
    for (auto& x : v) x = bias + dist(rng);
    D.w[n] = v;
  };
  const size_t H = size_t(D.hidden), QD = size_t(D.nh * D.d), KD = size_t(D.kvh * D.d);
  add("fc.weight", H * H * D.ids.size(), 0.03f);
  add("hidden_norm.weight", H, 0.1f, 1.0f);
  add("norm.weight", H, 0.1f, 1.0f);
  for (int l = 0; l < D.layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", H, 0.1f, 1.0f);
    add(p + "post_attention_layernorm.weight", H, 0.1f, 1.0f);
    add(p + "self_attn.q_proj.weight", QD * H, 0.05f);
    add(p + "self_attn.k_proj.weight", KD * H, 0.05f);
    add(p + "self_attn.v_proj.weight", KD * H, 0.05f);
    add(p + "self_attn.o_proj.weight", H * QD, 0.05f);
    add(p + "self_attn.q_norm.weight", size_t(D.d), 0.1f, 1.0f);
    add(p + "self_attn.k_norm.weight", size_t(D.d), 0.1f, 1.0f);
    add(p + "mlp.gate_proj.weight", size_t(D.inter) * H, 0.05f);
    add(p + "mlp.up_proj.weight", size_t(D.inter) * H, 0.05f);
    add(p + "mlp.down_proj.weight", H * size_t(D.inter), 0.05f);
  }
  std::vector<TensorToWrite> ts;
  for (const auto& [n, v] : D.w) {
    std::vector<int64_t> shape;
    if (n.ends_with("norm.weight")) shape = {int64_t(v.size())};
    else if (n == "fc.weight") shape = {D.hidden, int64_t(D.hidden * D.ids.size())};
    else if (n.ends_with("q_proj.weight")) shape = {int64_t(QD), D.hidden};
    else if (n.ends_with("k_proj.weight") || n.ends_with("v_proj.weight")) shape = {int64_t(KD), D.hidden};
    else if (n.ends_with("o_proj.weight")) shape = {D.hidden, int64_t(QD)};
    else if (n.ends_with("gate_proj.weight") || n.ends_with("up_proj.weight")) shape = {D.inter, D.hidden};
    else if (n.ends_with("down_proj.weight")) shape = {D.hidden, D.inter};
    ts.push_back({(prefix ? "model." : "") + n, DType::F32, shape,
                  std::span(reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(float))});
  }
  write_safetensors(D.dir / "model.safetensors", ts);
  return D;
}

}  // namespace kvlm::test

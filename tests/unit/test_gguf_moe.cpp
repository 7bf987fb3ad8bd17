// Mixtures of experts from GGUF files (io/gguf_model.h): Qwen3-MoE (qwen3moe) and GPT-OSS
// (gpt-oss, MXFP4 experts) as llama.cpp's convert_hf_to_gguf.py writes them, read back as the
// Hugging Face models they came from (each expert a slice of the stacked tensors), their experts
// kept in their blocks on the CPU and as grouped codes on CUDA, and damaged files refused
// naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/model_config.h"
#include "core/device.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/gguf.h"
#include "io/gguf_model.h"
#include "io/grouped_codes.h"
#include "io/safetensors.h"
#include "model/loaded_model.h"
#include "model/rope.h"
#include "offline/generate.h"
#include "offline/score.h"
#include "../support/error_text.h"
#include "../support/ggml_blocks.h"
#include "../support/gguf_model_file.h"
#include "../support/gguf_writer.h"
#include "test_util.h"

namespace kvlm {
namespace {

using test::F32Tensor;
using test::iota_values;
using test::load_model;
using test::model_file;
using test::write_temp;
using Writer = test::GGUFWriter;

// Qwen3-MoE as llama.cpp's convert_hf_to_gguf.py writes it (arch qwen3moe): every expert's
// gate, up and down projections stacked into one [experts][rows][cols] tensor per layer, the
// router as ffn_gate_inp, and the dense layer of mlp_only_layers as a plain MLP. Metadata keys
// are the converter's; `norm` adds expert_weights_norm.
struct Qwen3MoeDims {
  int layers, hidden, heads, kv_heads, head_dim, ffn, experts, top_k, expert_ffn, vocab;
};
// The keys every mixture's file has (14): its architecture, shape, norm epsilon, RoPE base and
// experts.
struct MoeShape {
  std::string arch;
  int layers, context, hidden, ffn, heads, kv_heads, head_dim;
  float eps, rope_theta;
  int experts, top_k, expert_ffn;
};
void moe_shape_keys(Writer& w, const MoeShape& m) {
  const std::string a = m.arch + ".";
  w.key("general.architecture", GGUFType::String).str(m.arch);
  w.key(a + "block_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.layers));
  w.key(a + "context_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.context));
  w.key(a + "embedding_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.hidden));
  w.key(a + "feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.ffn));
  w.key(a + "attention.head_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.heads));
  w.key(a + "attention.head_count_kv", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.kv_heads));
  w.key(a + "attention.key_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.head_dim));
  w.key(a + "attention.value_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.head_dim));
  w.key(a + "attention.layer_norm_rms_epsilon", GGUFType::Float32).pod<float>(m.eps);
  w.key(a + "rope.freq_base", GGUFType::Float32).pod<float>(m.rope_theta);
  w.key(a + "expert_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.experts));
  w.key(a + "expert_used_count", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.top_k));
  w.key(a + "expert_feed_forward_length", GGUFType::Uint32).pod<uint32_t>(uint32_t(m.expert_ffn));
}

void qwen3moe_metadata(Writer& w, const Qwen3MoeDims& d, std::optional<bool> norm) {
  const std::string a = "qwen3moe.";
  moe_shape_keys(w, {"qwen3moe", d.layers, 512, d.hidden, d.ffn, d.heads, d.kv_heads, d.head_dim, 1e-6f, 1000000.0f,
                     d.experts, d.top_k, d.expert_ffn});
  if (norm) w.key(a + "expert_weights_norm", GGUFType::Bool).pod<uint8_t>(*norm ? 1 : 0);
  std::vector<std::string> tokens;
  for (int i = 0; i < d.vocab; ++i) tokens.push_back("t" + std::to_string(i));
  w.strings("tokenizer.ggml.tokens", tokens);
  w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(1);
  w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(2);
}
constexpr uint64_t kQwen3MoeKeys = 18;  // with expert_weights_norm

// The golden tiny Qwen3-MoE (tests/golden/models/qwen3-moe: 7 experts, top 3, a dense first
// layer, norm_topk_prob false) converted to a qwen3moe GGUF of float32 tensors: kvlm reads
// the stacked experts, the router and the dense layer back as the Hugging Face model, so its
// logits equal those it computes from the safetensors bit for bit, and its greedy tokens are
// transformers' (tests/golden/expected/qwen3-moe.json).
TEST(GGUFModel, Qwen3MoeIsTheHuggingFaceModel) {
  const std::filesystem::path golden = std::filesystem::path(KVLM_TEST_DATA) / "golden";
  const auto dir = golden / "models" / "qwen3-moe";
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  const Qwen3MoeDims d{cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
                       cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"], cfg["num_experts"],
                       cfg["num_experts_per_tok"], cfg["moe_intermediate_size"], cfg["vocab_size"]};
  ASSERT_EQ(cfg["mlp_only_layers"], nlohmann::json::array({0}));
  ASSERT_FALSE(cfg["norm_topk_prob"].get<bool>());
  SafetensorsFile st(dir / "model.safetensors");
  auto values = [&](const std::string& name) {
    const TensorInfo* t = st.find(name);
    if (!t) throw Error("golden qwen3-moe has no " + name);
    std::vector<float> v(size_t(t->numel()));
    convert_to_f32(t->dtype, st.view(*t).bytes, v);
    return v;
  };
  auto ne = [](const std::vector<int64_t>& shape) {  // ggml's order: innermost first
    return std::vector<uint64_t>(shape.rbegin(), shape.rend());
  };
  std::vector<F32Tensor> ts;
  auto plain = [&](const std::string& gg, const std::string& hf) {
    ts.push_back({gg, ne(st.find(hf)->shape), values(hf)});
  };
  plain("token_embd.weight", "model.embed_tokens.weight");
  plain("output_norm.weight", "model.norm.weight");
  plain("output.weight", "lm_head.weight");
  for (int l = 0; l < d.layers; ++l) {
    const std::string g = "blk." + std::to_string(l) + ".", f = "model.layers." + std::to_string(l) + ".";
    for (const auto& [gg, hf] : {std::pair{"attn_norm.weight", "input_layernorm.weight"},
                                 std::pair{"attn_q.weight", "self_attn.q_proj.weight"},
                                 std::pair{"attn_k.weight", "self_attn.k_proj.weight"},
                                 std::pair{"attn_v.weight", "self_attn.v_proj.weight"},
                                 std::pair{"attn_output.weight", "self_attn.o_proj.weight"},
                                 std::pair{"attn_q_norm.weight", "self_attn.q_norm.weight"},
                                 std::pair{"attn_k_norm.weight", "self_attn.k_norm.weight"},
                                 std::pair{"ffn_norm.weight", "post_attention_layernorm.weight"}})
      plain(g + gg, f + hf);
    if (l == 0) {
      plain(g + "ffn_gate.weight", f + "mlp.gate_proj.weight");
      plain(g + "ffn_up.weight", f + "mlp.up_proj.weight");
      plain(g + "ffn_down.weight", f + "mlp.down_proj.weight");
      continue;
    }
    plain(g + "ffn_gate_inp.weight", f + "mlp.gate.weight");
    for (const auto& [gg, hf] : {std::pair{"ffn_gate_exps.weight", "gate_proj.weight"},
                                 std::pair{"ffn_up_exps.weight", "up_proj.weight"},
                                 std::pair{"ffn_down_exps.weight", "down_proj.weight"}}) {
      F32Tensor t{g + gg, {}, {}};
      for (int e = 0; e < d.experts; ++e) {
        const std::string name = f + "mlp.experts." + std::to_string(e) + "." + hf;
        if (e == 0) t.ne = ne(st.find(name)->shape);
        const auto v = values(name);
        t.values.insert(t.values.end(), v.begin(), v.end());
      }
      t.ne.push_back(uint64_t(d.experts));
      ts.push_back(std::move(t));
    }
  }
  const auto path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, false); }, ts),
                               "qwen3moe");
  {
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "q.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_EQ(arch_name(c.arch), "Qwen3MoeForCausalLM");
    ASSERT_TRUE(c.moe);
    EXPECT_EQ(c.moe->num_experts, d.experts);
    EXPECT_EQ(c.moe->top_k, d.top_k);
    EXPECT_EQ(c.moe->expert_size, d.expert_ffn);
    EXPECT_FALSE(c.moe->norm_topk);
    EXPECT_EQ(c.moe_layers, (std::vector<bool>{false, true, true}));
    EXPECT_EQ(load_gguf_tensor(f, m.tensors.at("model.layers.2.mlp.experts.5.down_proj.weight")),
              values("model.layers.2.mlp.experts.5.down_proj.weight"));
  }
  auto load = [](const std::filesystem::path& p) { return load_model(p, DType::F32); };
  const nlohmann::json want = nlohmann::json::parse(std::ifstream(golden / "expected" / "qwen3-moe.json"));
  std::vector<TokenId> all = want["prompt_ids"].get<std::vector<TokenId>>();
  const auto greedy = want["greedy_ids"].get<std::vector<TokenId>>();
  all.insert(all.end(), greedy.begin(), greedy.end());
  const auto from_gguf = load(path), from_hf = load(dir);
  EXPECT_EQ(all_logits(*from_gguf, all, 7), all_logits(*from_hf, all, 7));
  GenerateRequest g;
  g.prompt = want["prompt_ids"].get<std::vector<TokenId>>();
  g.max_tokens = int(greedy.size());
  g.ignore_eos = true;
  g.sampling.temperature = 0;
  EXPECT_EQ(generate(*from_gguf, g).tokens, greedy);
  std::filesystem::remove(path);
}

// Without expert_weights_norm a qwen3moe file renormalizes the top-k weights, as llama.cpp
// does (and Qwen3-30B-A3B's norm_topk_prob); mismatched expert tensors are refused by name.
TEST(GGUFModel, Qwen3MoeMetadataAndDamage) {
  const Qwen3MoeDims d{1, 32, 2, 1, 16, 64, 3, 2, 32, 4};
  auto tensors = [&](uint64_t experts) {
    std::vector<F32Tensor> ts{{"token_embd.weight", {32, 4}, iota_values(128, 0.01f)},
                              {"output_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_q.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_k.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_v.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_output.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_q_norm.weight", {16}, std::vector<float>(16, 1.0f)},
                              {"blk.0.attn_k_norm.weight", {16}, std::vector<float>(16, 1.0f)},
                              {"blk.0.ffn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.ffn_gate_inp.weight", {32, 3}, iota_values(96, 1e-2f)},
                              {"blk.0.ffn_gate_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)},
                              {"blk.0.ffn_up_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)},
                              {"blk.0.ffn_down_exps.weight", {32, 32, experts}, iota_values(size_t(1024 * experts), 1e-4f)}};
    return ts;
  };
  {
    const auto path = write_temp(model_file(kQwen3MoeKeys - 1, [&](Writer& w) { qwen3moe_metadata(w, d, std::nullopt); },
                                            tensors(3)),
                                 "qwen3moe-norm");
    const GGUFFile f(path);
    const GGUFModel m = map_gguf_model(f.header(), "q.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    EXPECT_TRUE(c.moe->norm_topk);
    EXPECT_EQ(c.moe_layers, std::vector<bool>{true});
    EXPECT_EQ(m.tensors.at("model.layers.0.mlp.experts.2.up_proj.weight").expert, 2);
    std::filesystem::remove(path);
  }
  const auto path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, true); }, tensors(4)),
                               "qwen3moe-bad");
  const GGUFFile f(path);
  EXPECT_NE(test::error_of([&] { map_gguf_model(f.header(), "q.gguf"); })
                .find("blk.0.ffn_gate_exps.weight is not [3 experts][rows][cols]"),
            std::string::npos);
  std::filesystem::remove(path);
}

// GPT-OSS as llama.cpp's convert_hf_to_gguf.py writes it (arch gpt-oss): each layer's fused
// MXFP4 gate_up_proj split into ffn_gate_exps (the even rows) and ffn_up_exps (the odd ones),
// down_proj as ffn_down_exps, every block re-packed from the checkpoint's nibble order (values
// 2k and 2k + 1 in byte k) to ggml's (values j and j + 16 in byte j) behind its E8M0 byte,
// the biases split the same way, the router as ffn_gate_inp, the sinks as attn_sinks. Metadata
// keys are the converter's.
struct GptOssDims {
  int layers, hidden, heads, kv_heads, head_dim, experts, top_k, expert_ffn, vocab, window;
};
void gptoss_metadata(Writer& w, const GptOssDims& d, bool harmony = false) {
  const std::string a = "gpt-oss.";
  moe_shape_keys(w, {"gpt-oss", d.layers, 128, d.hidden, d.expert_ffn, d.heads, d.kv_heads, d.head_dim, 1e-5f, 150000.0f,
                     d.experts, d.top_k, d.expert_ffn});
  w.key(a + "attention.sliding_window", GGUFType::Uint32).pod<uint32_t>(uint32_t(d.window));
  w.key(a + "rope.scaling.type", GGUFType::String).str("yarn");
  w.key(a + "rope.scaling.factor", GGUFType::Float32).pod<float>(4.0f);
  w.key(a + "rope.scaling.original_context_length", GGUFType::Uint32).pod<uint32_t>(32);
  std::vector<std::string> tokens;
  for (int i = 0; i < d.vocab; ++i) tokens.push_back("t" + std::to_string(i));
  if (harmony) tokens = {"t0", "<|end|>", "<|return|>", "<|call|>"};  // a file naming <|end|> its eos
  w.strings("tokenizer.ggml.tokens", tokens);
  w.key("tokenizer.ggml.bos_token_id", GGUFType::Uint32).pod<uint32_t>(harmony ? 0 : 1);
  w.key("tokenizer.ggml.eos_token_id", GGUFType::Uint32).pod<uint32_t>(harmony ? 1 : 2);
}
constexpr uint64_t kGptOssKeys = 21;

// Rows `rows` (every other one from `first` when `step` is 2) of expert tensors in the
// checkpoint's MXFP4 layout (blocks [E][R][C/32][16], scales [E][R][C/32]) as ggml MXFP4
// blocks, experts outermost.
std::vector<uint8_t> ggml_mxfp4(std::span<const uint8_t> blocks, std::span<const uint8_t> scales, int64_t experts,
                                int64_t rows, int64_t nb, int first, int step) {
  std::vector<uint8_t> out;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = first; r < rows; r += step)
      for (int64_t b = 0; b < nb; ++b) {
        const size_t at = size_t((e * rows + r) * nb + b);
        out.push_back(scales[at]);
        const uint8_t* q = blocks.data() + at * 16;
        auto code = [&](int i) { return uint8_t((q[i / 2] >> (4 * (i % 2))) & 0xF); };
        for (int j = 0; j < 16; ++j) out.push_back(uint8_t(code(j) | (code(j + 16) << 4)));
      }
  return out;
}

// The golden tiny GPT-OSS with MXFP4 experts (tests/data/int4/mxfp4, whose experts equal their
// bf16 twin's: Int4Checkpoint.Mxfp4ExpertsEqualTheirTwin) converted as above, beside a copy of
// the safetensors model with llama.cpp's fixed swiglu_limit of 7 (the checkpoint's is 1.5).
struct GptOssPair {
  std::filesystem::path src = std::filesystem::path(KVLM_TEST_DATA) / "data" / "int4" / "mxfp4";
  nlohmann::json cfg = nlohmann::json::parse(std::ifstream(src / "config.json"));
  GptOssDims d{cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
               cfg["head_dim"], cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"],
               cfg["vocab_size"], cfg["sliding_window"]};
  std::filesystem::path gguf, hf;

  GptOssPair() {
    SafetensorsFile st(src / "model.safetensors");
    auto values = [&](const std::string& name) {
      const TensorInfo* t = st.find(name);
      if (!t) throw Error("mxfp4 gpt-oss has no " + name);
      std::vector<float> v(size_t(t->numel()));
      convert_to_f32(t->dtype, st.view(*t).bytes, v);
      return v;
    };
    auto bytes = [&](const std::string& name) { return st.view(*st.find(name)).bytes; };
    auto ne = [](const std::vector<int64_t>& shape) { return std::vector<uint64_t>(shape.rbegin(), shape.rend()); };
    std::vector<F32Tensor> ts;
    auto plain = [&](const std::string& gg, const std::string& hf) { ts.push_back({gg, ne(st.find(hf)->shape), values(hf)}); };
    plain("token_embd.weight", "model.embed_tokens.weight");
    plain("output_norm.weight", "model.norm.weight");
    plain("output.weight", "lm_head.weight");
    const int64_t E = d.experts, I = d.expert_ffn, H = d.hidden;
    for (int l = 0; l < d.layers; ++l) {
      const std::string g = "blk." + std::to_string(l) + ".", f = "model.layers." + std::to_string(l) + ".";
      for (const auto& [gg, hf] : {std::pair{"attn_norm.weight", "input_layernorm.weight"},
                                   std::pair{"post_attention_norm.weight", "post_attention_layernorm.weight"},
                                   std::pair{"attn_q.weight", "self_attn.q_proj.weight"}, std::pair{"attn_q.bias", "self_attn.q_proj.bias"},
                                   std::pair{"attn_k.weight", "self_attn.k_proj.weight"}, std::pair{"attn_k.bias", "self_attn.k_proj.bias"},
                                   std::pair{"attn_v.weight", "self_attn.v_proj.weight"}, std::pair{"attn_v.bias", "self_attn.v_proj.bias"},
                                   std::pair{"attn_output.weight", "self_attn.o_proj.weight"},
                                   std::pair{"attn_output.bias", "self_attn.o_proj.bias"},
                                   std::pair{"attn_sinks.weight", "self_attn.sinks"},
                                   std::pair{"ffn_gate_inp.weight", "mlp.router.weight"},
                                   std::pair{"ffn_gate_inp.bias", "mlp.router.bias"}})
        plain(g + gg, f + hf);
      const std::string x = f + "mlp.experts.";
      const auto gu_b = bytes(x + "gate_up_proj_blocks"), gu_s = bytes(x + "gate_up_proj_scales");
      const auto dn_b = bytes(x + "down_proj_blocks"), dn_s = bytes(x + "down_proj_scales");
      auto mx = [](const std::string& name, std::vector<uint64_t> shape, std::vector<uint8_t> raw) {
        return F32Tensor{name, std::move(shape), {}, GGMLType::MXFP4, std::move(raw)};
      };
      const auto u = [](int64_t v) { return uint64_t(v); };
      ts.push_back(mx(g + "ffn_gate_exps.weight", {u(H), u(I), u(E)}, ggml_mxfp4(gu_b, gu_s, E, 2 * I, H / 32, 0, 2)));
      ts.push_back(mx(g + "ffn_up_exps.weight", {u(H), u(I), u(E)}, ggml_mxfp4(gu_b, gu_s, E, 2 * I, H / 32, 1, 2)));
      ts.push_back(mx(g + "ffn_down_exps.weight", {u(I), u(H), u(E)}, ggml_mxfp4(dn_b, dn_s, E, H, I / 32, 0, 1)));
      const auto gu_bias = values(x + "gate_up_proj_bias");  // [E][2I], gate and up alternating
      std::vector<float> gate_bias, up_bias;
      for (size_t i = 0; i < gu_bias.size(); ++i) (i % 2 ? up_bias : gate_bias).push_back(gu_bias[i]);
      ts.push_back({g + "ffn_gate_exps.bias", {u(I), u(E)}, gate_bias});
      ts.push_back({g + "ffn_up_exps.bias", {u(I), u(E)}, up_bias});
      ts.push_back({g + "ffn_down_exps.bias", {u(H), u(E)}, values(x + "down_proj_bias")});
    }
    gguf = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d); }, ts), "gpt-oss");
    hf = std::filesystem::temp_directory_path() / ("kvlm-gpt-oss-hf-" + std::to_string(::getpid()));
    std::filesystem::create_directories(hf);
    nlohmann::json c7 = cfg;
    c7["swiglu_limit"] = 7.0;
    std::ofstream(hf / "config.json") << c7.dump();
    std::filesystem::copy_file(src / "model.safetensors", hf / "model.safetensors",
                               std::filesystem::copy_options::overwrite_existing);
  }
  ~GptOssPair() {
    std::filesystem::remove(gguf);
    std::filesystem::remove_all(hf);
  }
  std::vector<TokenId> prompt() const {  // past the 8-token window
    std::vector<TokenId> p;
    for (int i = 0; i < 40; ++i) p.push_back(TokenId((i * 37 + 11) % d.vocab));
    return p;
  }
  static GenerateResult greedy(LoadedModel& m, const std::vector<TokenId>& prompt) {
    GenerateRequest gr;
    gr.prompt = prompt;
    gr.max_tokens = 12;
    gr.ignore_eos = true;
    gr.sampling.temperature = 0;
    gr.logprobs = 2;
    return generate(m, gr);
  }
};

// kvlm reads the GGUF file back as the Hugging Face model — the MXFP4 blocks to the same
// weights, each expert's slice to its place in the fused layout, YaRN, the sinks and the
// sliding window from the metadata — so, dequantized at load, its logits equal those it
// computes from the safetensors bit for bit. Kept (as the MXFP4 blocks themselves), the
// fp32 path sums in another order (logits within 1e-4 of their range) and the int8
// activations follow the greedy tokens up to a near tie.
TEST(GGUFModel, GptOssIsTheHuggingFaceModel) {
  const GptOssPair pair;
  const auto& d = pair.d;
  const int64_t I = d.expert_ffn, H = d.hidden;
  ASSERT_EQ(pair.cfg["rope_scaling"]["factor"], 4.0);
  ASSERT_EQ(pair.cfg["rope_scaling"]["original_max_position_embeddings"], 32);
  {
    const GGUFFile f(pair.gguf);
    const GGUFModel m = map_gguf_model(f.header(), "g.gguf");
    const ModelConfig c = parse_model_config(m.config, nullptr);
    const ModelConfig want = parse_model_config(nlohmann::json::parse(std::ifstream(pair.hf / "config.json")), nullptr);
    EXPECT_EQ(arch_name(c.arch), "GptOssForCausalLM");
    ASSERT_TRUE(c.moe);
    EXPECT_TRUE(c.moe->per_expert_tensors);
    EXPECT_FALSE(want.moe->per_expert_tensors);
    EXPECT_EQ(c.moe->num_experts, d.experts);
    EXPECT_EQ(c.moe->top_k, d.top_k);
    EXPECT_EQ(c.moe->expert_size, d.expert_ffn);
    EXPECT_TRUE(c.moe->router_bias && c.moe->expert_bias && c.attention_sinks);
    EXPECT_EQ(c.moe->swiglu_limit, 7.0f);
    ASSERT_EQ(c.layers.size(), want.layers.size());
    for (size_t i = 0; i < c.layers.size(); ++i) {
      EXPECT_EQ(c.layers[i].kind, want.layers[i].kind) << i;
      EXPECT_EQ(c.layers[i].window, want.layers[i].window) << i;
    }
    EXPECT_EQ(c.layers[0].kind, AttentionKind::Sliding);
    EXPECT_EQ(c.rope.type, want.rope.type);
    EXPECT_EQ(rope_inv_freq(c.rope, c.head_dim), rope_inv_freq(want.rope, want.head_dim));
    EXPECT_EQ(c.rope.attention_factor, want.rope.attention_factor);
    // An expert's MXFP4 rows dequantize to the checkpoint's: expert 3's down_proj [H][I] and
    // up_proj [I][H] (the odd rows of the checkpoint's gate_up_proj).
    const Checkpoint q = Checkpoint::open(pair.src);
    for (const auto& [name, rows, cols] : {std::tuple{"model.layers.1.mlp.experts.3.down_proj.weight", H, I},
                                           std::tuple{"model.layers.0.mlp.experts.2.up_proj.weight", I, H}}) {
      const TensorView dv = q.view(name);
      const auto* all = reinterpret_cast<const float*>(dv.bytes.data());
      const std::vector<float> got = load_gguf_tensor(f, m.tensors.at(name));
      ASSERT_EQ(got.size(), size_t(rows * cols));
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], all[i]) << name << " " << i;
    }
  }
  const auto prompt = pair.prompt();
  const auto dequantized = load_model(pair.gguf, DType::F32, Device::Cpu, true);
  const auto from_hf = load_model(pair.hf, DType::F32, Device::Cpu, true);
  const std::vector<float> want = all_logits(*from_hf, prompt, 7);
  EXPECT_EQ(all_logits(*dequantized, prompt, 7), want);
  const GenerateResult want_greedy = GptOssPair::greedy(*from_hf, prompt);
  EXPECT_EQ(GptOssPair::greedy(*dequantized, prompt).tokens, want_greedy.tokens);
  // Kept: the experts as MXFP4 blocks, 17 bytes per 32 weights where float32 takes 128.
  const auto kept = load_model(pair.gguf, DType::F32, Device::Cpu);
  const size_t expert_weights = size_t(d.layers) * size_t(d.experts) * size_t(3 * I * H);
  EXPECT_EQ(dequantized->model().weight_bytes() - kept->model().weight_bytes(), expert_weights * 4 - expert_weights / 32 * 17);
  const std::vector<float> got = all_logits(*kept, prompt, 7);
  ASSERT_EQ(got.size(), want.size());
  float range = 0, worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    range = std::max(range, std::fabs(want[i]));
    worst = std::max(worst, std::fabs(got[i] - want[i]));
  }
  EXPECT_LT(worst, 1e-4f * range) << "kept MXFP4 experts (fp32 path) against the safetensors";
  // The safetensors' experts kept are the same blocks in the same places: the same logits.
  EXPECT_EQ(all_logits(*load_model(pair.hf, DType::F32, Device::Cpu), prompt, 7), got);
  EXPECT_EQ(GptOssPair::greedy(*kept, prompt).tokens, want_greedy.tokens);
  const auto int8 = load_model(pair.gguf, std::nullopt, Device::Cpu);
  test::expect_greedy_until_near_tie(GptOssPair::greedy(*int8, prompt), want_greedy, 0.05, 0.5, "int8 activations");
}

// On a GPU too: the per-expert tensors (dequantized to bf16 as the safetensors' MXFP4 experts
// are) hold the same bf16 weights as the fused layout, so the same kernels give the same logits.
TEST(GGUFModel, CudaGptOssIsTheHuggingFaceModel) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const GptOssPair pair;
  const auto prompt = pair.prompt();
  const auto dequantized = load_model(pair.gguf, DType::BF16, Device::Cuda, true);
  const auto from_hf = load_model(pair.hf, DType::BF16, Device::Cuda, true);
  EXPECT_EQ(dequantized->model().weight_bytes(), from_hf->model().weight_bytes());
  EXPECT_EQ(all_logits(*dequantized, prompt, 7), all_logits(*from_hf, prompt, 7));
  const GenerateResult want = GptOssPair::greedy(*from_hf, prompt);
  EXPECT_EQ(GptOssPair::greedy(*dequantized, prompt).tokens, want.tokens);
  // Kept: the experts as 4-bit E2M1 codes (half a byte per weight and a 4-byte word per 32)
  // where bf16 takes two bytes, read by the MoE kernels' integer GEMV; the same weights, other
  // kernels: the decode steps' (one row) through gemv_int_dp4a, whose activations are int8 per
  // 32 columns, held as the CPU's int8 path is (log-probabilities within 1.0, a changed token a
  // near tie of 0.25; test_int4_checkpoint.cpp says why).
  const auto kept = load_model(pair.gguf, DType::BF16, Device::Cuda);
  const auto& d = pair.d;
  const size_t expert_weights = size_t(d.layers) * size_t(d.experts) * size_t(3 * d.expert_ffn * d.hidden);
  EXPECT_EQ(dequantized->model().weight_bytes() - kept->model().weight_bytes(), expert_weights * 2 - expert_weights / 32 * 20);
  test::expect_greedy_until_near_tie(GptOssPair::greedy(*kept, prompt), want, 0.25, 1.0, "MXFP4 as E2M1 codes");
  // The safetensors' experts kept are the same codes in the same places: the same logits.
  EXPECT_EQ(all_logits(*load_model(pair.hf, DType::BF16, Device::Cuda), prompt, 7), all_logits(*kept, prompt, 7));
}

// A gpt-oss file's expert tensors must hold expert_count experts, with their biases; gate and
// up fused into one tensor (the converter's --fuse-gate-up-exps) are refused saying so.
TEST(GGUFModel, GptOssDamageIsNamed) {
  const GptOssDims d{1, 32, 2, 1, 16, 3, 2, 32, 4, 8};
  auto tensors = [&](uint64_t experts, bool biases, bool fused) {
    std::vector<F32Tensor> ts{{"token_embd.weight", {32, 4}, iota_values(128, 0.01f)},
                              {"output_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.post_attention_norm.weight", {32}, std::vector<float>(32, 1.0f)},
                              {"blk.0.attn_q.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_k.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_v.weight", {32, 16}, iota_values(16 * 32, 1e-3f)},
                              {"blk.0.attn_output.weight", {32, 32}, iota_values(32 * 32, 1e-3f)},
                              {"blk.0.attn_sinks.weight", {2}, std::vector<float>(2, 0.5f)},
                              {"blk.0.ffn_gate_inp.weight", {32, 3}, iota_values(96, 1e-2f)},
                              {"blk.0.ffn_gate_inp.bias", {3}, std::vector<float>(3, 0.0f)}};
    const std::vector<std::string> parts = fused ? std::vector<std::string>{"ffn_gate_up_exps", "ffn_down_exps"}
                                                 : std::vector<std::string>{"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    for (const std::string& p : parts) {
      const uint64_t rows = p == "ffn_gate_up_exps" ? 64 : 32;
      ts.push_back({"blk.0." + p + ".weight", {32, rows, experts}, iota_values(size_t(32 * rows * experts), 1e-4f)});
      if (biases) ts.push_back({"blk.0." + p + ".bias", {rows, experts}, iota_values(size_t(rows * experts), 1e-3f)});
    }
    return ts;
  };
  auto error = [&](uint64_t experts, bool biases, bool fused) {
    const auto path = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d); }, tensors(experts, biases, fused)),
                                 "gpt-oss-bad");
    const GGUFFile f(path);
    std::string e = test::error_of([&] { map_gguf_model(f.header(), "g.gguf"); });
    std::filesystem::remove(path);
    return e;
  };
  EXPECT_EQ(error(3, true, false), "");
  {  // harmony's replies end at <|return|> or <|call|>, never at <|end|>
    const auto path = write_temp(model_file(kGptOssKeys, [&](Writer& w) { gptoss_metadata(w, d, true); }, tensors(3, true, false)),
                                 "gpt-oss-eos");
    const GGUFFile f(path);
    EXPECT_EQ(map_gguf_model(f.header(), "g.gguf").config["eos_token_id"], nlohmann::json::array({2, 3}));
    std::filesystem::remove(path);
  }
  EXPECT_NE(error(4, true, false).find("blk.0.ffn_gate_exps.weight is not [3 experts][rows][cols]"), std::string::npos);
  EXPECT_NE(error(3, false, false).find("has no blk.0.ffn_gate_exps.bias"), std::string::npos);
  EXPECT_NE(error(3, true, true).find("--fuse-gate-up-exps"), std::string::npos);
}

// A Qwen3-MoE whose experts come in the blocks Q4_K_M files use (Q4_K gate/up and Q6_K down in
// one layer; Q4_0 and Q8_0 in the other) and Q8_0 attention: each expert's slice of the
// stacked tensors stays in its blocks, and what kvlm computes from them equals the
// dequantize-at-load path (CPU), or follows it on a GPU (grouped codes).
struct BlockQwen3Moe {
  static constexpr Qwen3MoeDims d{2, 256, 4, 2, 64, 512, 5, 2, 256, 40};
  std::filesystem::path path;
  size_t block_bytes = 0;     // the file's blocks
  size_t grouped_bytes = 0;   // the same matrices as grouped codes (io/grouped_codes.h)
  BlockQwen3Moe() {
    std::mt19937 rng(11);
    std::vector<F32Tensor> ts;
    auto blocks = [&](const std::string& name, std::vector<uint64_t> ne, GGMLType type) {
      int64_t n = 1;
      for (uint64_t x : ne) n *= int64_t(x);
      const int64_t cols = int64_t(ne[0]);
      ts.push_back(F32Tensor{name, std::move(ne), {}, type, test::random_ggml_blocks(type, n, rng)});
      block_bytes += ts.back().raw.size();
      const GroupedLayout l = *grouped_layout_of_ggml(uint32_t(type));
      grouped_bytes += size_t(n / cols) * (grouped_code_bytes(l, cols) + size_t(cols / l.group) * 4);
    };
    auto norm = [&](const std::string& name, int n) {
      ts.push_back({name, {uint64_t(n)}, std::vector<float>(size_t(n), 1.0f)});
    };
    const uint64_t H = d.hidden, E = d.experts, I = d.expert_ffn, hd = d.head_dim;
    blocks("token_embd.weight", {H, uint64_t(d.vocab)}, GGMLType::Q8_0);
    norm("output_norm.weight", d.hidden);
    const GGMLType experts[2][3] = {{GGMLType::Q4_K, GGMLType::Q4_K, GGMLType::Q6_K},
                                    {GGMLType::Q4_0, GGMLType::Q4_0, GGMLType::Q8_0}};
    for (int l = 0; l < d.layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      norm(b + "attn_norm.weight", d.hidden);
      blocks(b + "attn_q.weight", {H, d.heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_k.weight", {H, d.kv_heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_v.weight", {H, d.kv_heads * hd}, GGMLType::Q8_0);
      blocks(b + "attn_output.weight", {d.heads * hd, H}, GGMLType::Q8_0);
      norm(b + "attn_q_norm.weight", d.head_dim);
      norm(b + "attn_k_norm.weight", d.head_dim);
      norm(b + "ffn_norm.weight", d.hidden);
      // The router as llama.cpp keeps it: float32, a wide spread so that routing differs by token.
      std::normal_distribution<float> n01(0.0f, 1.0f);
      std::vector<float> router(size_t(E * H));
      for (float& x : router) x = n01(rng) * 0.2f;
      ts.push_back({b + "ffn_gate_inp.weight", {H, E}, router});
      blocks(b + "ffn_gate_exps.weight", {H, I, E}, experts[l][0]);
      blocks(b + "ffn_up_exps.weight", {H, I, E}, experts[l][1]);
      blocks(b + "ffn_down_exps.weight", {I, H, E}, experts[l][2]);
    }
    path = write_temp(model_file(kQwen3MoeKeys, [&](Writer& w) { qwen3moe_metadata(w, d, true); }, ts), "qwen3moe-blocks");
  }
  ~BlockQwen3Moe() { std::filesystem::remove(path); }
  std::unique_ptr<LoadedModel> load(bool dequantize, std::optional<DType> dtype, Device device = Device::Cpu) const {
    return load_model(path, dtype, device, dequantize);
  }
  static GenerateResult greedy(LoadedModel& m, int rows = 12) { return test::block_model_greedy(m, rows, d.vocab); }
};

TEST(GGUFModel, Qwen3MoeExpertsStayInTheirBlocks) {
  const BlockQwen3Moe f;
  const auto& d = BlockQwen3Moe::d;
  const auto dequantized = f.load(true, DType::F32), exact = f.load(false, DType::F32), fast = f.load(false, std::nullopt);
  // Kept: the file's blocks, plus the float32 routers, norms and RoPE's inverse frequencies.
  const size_t rest = size_t(d.layers * (d.experts * d.hidden + 2 * d.hidden + 2 * d.head_dim) + d.hidden + d.head_dim / 2) *
                      sizeof(float);
  EXPECT_EQ(exact->model().weight_bytes(), f.block_bytes + rest);
  EXPECT_GT(dequantized->model().weight_bytes(), 3 * exact->model().weight_bytes());
  test::expect_kept_blocks_follow(BlockQwen3Moe::greedy(*dequantized), BlockQwen3Moe::greedy(*exact),
                                  BlockQwen3Moe::greedy(*fast));
}

// On a GPU the experts' blocks become grouped codes (4-bit from Q4_K / Q4_0, 8-bit from Q6_K
// / Q8_0) for the MoE kernels' integer GEMV, and at 80 rows the dequantized runs.
TEST(GGUFModel, CudaKeepsQwen3MoeExpertsAsGroupedCodes) {
  if (cuda_devices().empty()) GTEST_SKIP() << "no CUDA device (or a build without CUDA)";
  const BlockQwen3Moe f;
  const auto dequantized = f.load(true, DType::BF16, Device::Cuda), kept = f.load(false, DType::BF16, Device::Cuda);
  // The codes, plus the bf16 routers and the fp32 norms.
  const auto& d = BlockQwen3Moe::d;
  EXPECT_EQ(kept->model().weight_bytes(),
            f.grouped_bytes + size_t(d.layers * d.experts * d.hidden) * 2 +
                size_t(d.layers * (2 * d.hidden + 2 * d.head_dim) + d.hidden) * sizeof(float));
  EXPECT_LT(kept->model().weight_bytes() * 2, dequantized->model().weight_bytes());
  for (int rows : {1, 12, 40, 80}) {
    const auto want = BlockQwen3Moe::greedy(*dequantized, rows), got = BlockQwen3Moe::greedy(*kept, rows);
    test::expect_greedy_until_near_tie(got, want, 0.1, 0.05, "grouped codes, " + std::to_string(rows) + "-token prompt");
  }
}

}  // namespace
}  // namespace kvlm

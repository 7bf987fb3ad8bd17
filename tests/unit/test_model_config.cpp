#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "kv/kv_plan.h"
#include "config/model_config.h"
#include "core/error.h"

using namespace kvlm;
using nlohmann::json;

namespace {

json llama() {
  return json{{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", 64}, {"intermediate_size", 128},
              {"num_hidden_layers", 4}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
              {"vocab_size", 100}, {"max_position_embeddings", 256}, {"rms_norm_eps", 1e-5},
              {"torch_dtype", "bfloat16"}, {"eos_token_id", 2}, {"bos_token_id", 1}};
}

std::string error_of(const json& j) {
  try {
    parse_model_config(j, nullptr);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ModelConfig, Llama) {
  const ModelConfig m = parse_model_config(llama(), nullptr);
  EXPECT_EQ(arch_name(m.arch), "LlamaForCausalLM");
  EXPECT_EQ(m.head_dim, 16);
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.declared_dtype, DType::BF16);
  EXPECT_EQ(m.rope.type, RopeType::Default);
  EXPECT_DOUBLE_EQ(m.rope.theta, 10000.0);
  EXPECT_FALSE(m.qkv_bias);
  EXPECT_FALSE(m.qk_norm);
  ASSERT_EQ(m.layers.size(), 4u);
  for (const auto& l : m.layers) EXPECT_EQ(l.kind, AttentionKind::Full);
  EXPECT_EQ(m.eos_token_ids, std::vector<TokenId>{2});
}

TEST(ModelConfig, HeadDimAndMqaAndBias) {
  json j = llama();
  j["head_dim"] = 32;
  j["num_key_value_heads"] = 1;
  j["attention_bias"] = true;
  j["tie_word_embeddings"] = true;
  const ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_EQ(m.head_dim, 32);
  EXPECT_EQ(m.num_kv_heads, 1);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_TRUE(m.o_bias);
  EXPECT_TRUE(m.tie_word_embeddings);
}

TEST(ModelConfig, RopeFreqFactorsFromAGGUFFile) {
  json j = llama();
  const ModelConfig base = parse_model_config(j, nullptr);
  const size_t half = size_t(base.head_dim / 2);
  j["rope_freq_factors"] = std::vector<double>(half, 2.0);
  EXPECT_EQ(parse_model_config(j, nullptr).rope.freq_factors, std::vector<double>(half, 2.0));
  j["rope_freq_factors"] = std::vector<double>(half + 1, 2.0);
  EXPECT_THROW(parse_model_config(j, nullptr), Error);
  j["rope_freq_factors"] = std::vector<double>(half, 0.0);
  EXPECT_THROW(parse_model_config(j, nullptr), Error);
  j["rope_freq_factors"] = "fast";
  EXPECT_THROW(parse_model_config(j, nullptr), Error);
}

TEST(ModelConfig, RopeLegacyAndTransformers5Forms) {
  json j = llama();
  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_EQ(m.rope.type, RopeType::Llama3);
  EXPECT_DOUBLE_EQ(m.rope.theta, 500000.0);
  EXPECT_DOUBLE_EQ(m.rope.factor, 8.0);
  EXPECT_EQ(m.rope.original_max_position, 8192);

  json k = llama();
  k["rope_parameters"] = {{"rope_type", "linear"}, {"rope_theta", 1000.0}, {"factor", 4.0}};
  m = parse_model_config(k, nullptr);
  EXPECT_EQ(m.rope.type, RopeType::Linear);
  EXPECT_DOUBLE_EQ(m.rope.theta, 1000.0);
  EXPECT_DOUBLE_EQ(m.rope.factor, 4.0);

  json legacy_type = llama();
  legacy_type["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_EQ(parse_model_config(legacy_type, nullptr).rope.type, RopeType::Linear);

  json yarn = llama();  // YaRN needs the length it extends (transformers 5 requires it too)
  yarn["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(error_of(yarn).find("needs original_max_position_embeddings"), std::string::npos) << error_of(yarn);
  yarn["rope_scaling"]["original_max_position_embeddings"] = 32768;
  EXPECT_EQ(parse_model_config(yarn, nullptr).rope.type, RopeType::Yarn);
  json longrope = llama();
  longrope["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
  EXPECT_NE(error_of(longrope).find("'longrope' is not supported"), std::string::npos) << error_of(longrope);
}

TEST(ModelConfig, Qwen2SlidingFollowsMaxWindowLayers) {
  json j = llama();
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["use_sliding_window"] = true;
  j["sliding_window"] = 8;
  j["max_window_layers"] = 2;
  ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_FALSE(m.o_bias);
  EXPECT_EQ(m.layers[0].kind, AttentionKind::Full);
  EXPECT_EQ(m.layers[1].kind, AttentionKind::Full);
  EXPECT_EQ(m.layers[2].kind, AttentionKind::Sliding);
  EXPECT_EQ(m.layers[3].window, 8);
  // Real Qwen2.5 configs: sliding_window set but use_sliding_window false -> all full.
  j["use_sliding_window"] = false;
  m = parse_model_config(j, nullptr);
  for (const auto& l : m.layers) EXPECT_EQ(l.kind, AttentionKind::Full);
}

TEST(ModelConfig, Qwen3LayerTypes) {
  json j = llama();
  j["architectures"] = {"Qwen3ForCausalLM"};
  j["head_dim"] = 32;
  j["use_sliding_window"] = true;
  j["sliding_window"] = 16;
  j["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  const ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_TRUE(m.qk_norm);
  EXPECT_EQ(m.layers[0].kind, AttentionKind::Sliding);
  EXPECT_EQ(m.layers[0].window, 16);
  EXPECT_EQ(m.layers[1].kind, AttentionKind::Full);
  j["layer_types"] = {"sliding_attention", "full_attention"};
  EXPECT_NE(error_of(j).find("one entry per layer"), std::string::npos);
  j["layer_types"] = {"sliding_attention", "chunked_attention", "full_attention", "full_attention"};
  EXPECT_NE(error_of(j).find("chunked_attention"), std::string::npos);
}

TEST(ModelConfig, MistralSlidingEveryLayer) {
  json j = llama();
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 4096;
  const ModelConfig m = parse_model_config(j, nullptr);
  for (const auto& l : m.layers) {
    EXPECT_EQ(l.kind, AttentionKind::Sliding);
    EXPECT_EQ(l.window, 4096);
  }
  json k = llama();
  k["sliding_window"] = 16;  // Llama has no sliding window: ignored as transformers does
  for (const auto& l : parse_model_config(k, nullptr).layers) EXPECT_EQ(l.kind, AttentionKind::Full);
}

TEST(ModelConfig, ClearErrors) {
  json j = llama();
  j["architectures"] = {"GPT2LMHeadModel"};
  EXPECT_NE(error_of(j).find("unsupported architecture 'GPT2LMHeadModel'"), std::string::npos);
  j = llama();
  j.erase("hidden_size");
  EXPECT_NE(error_of(j).find("'hidden_size' is missing"), std::string::npos);
  j = llama();
  j["num_attention_heads"] = "four";
  EXPECT_NE(error_of(j).find("'num_attention_heads' must be an integer"), std::string::npos);
  j = llama();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(j).find("not a multiple"), std::string::npos);
  j = llama();
  j["hidden_size"] = -64;
  EXPECT_NE(error_of(j).find("positive"), std::string::npos);
  j = llama();
  j["num_hidden_layers"] = 1000000000;
  EXPECT_NE(error_of(j).find("is the file corrupt?"), std::string::npos);
  j = llama();
  j["hidden_act"] = "gelu";
  EXPECT_NE(error_of(j).find("gelu"), std::string::npos);
  j = llama();
  j["torch_dtype"] = "int4";
  EXPECT_NE(error_of(j).find("int4"), std::string::npos);
  EXPECT_NE(error_of(json::array()).find("JSON object"), std::string::npos);
  j = llama();
  j["eos_token_id"] = 1000;
  EXPECT_NE(error_of(j).find("outside the vocabulary"), std::string::npos);
}

TEST(ModelConfig, KVSchemes) {
  json j = llama();
  j["quantization_config"] = {{"quant_method", "compressed-tensors"},
                              {"kv_cache_scheme", {{"num_bits", 8}, {"type", "float"}, {"strategy", "tensor"}, {"dynamic", false}}}};
  ModelConfig m = parse_model_config(j, nullptr);
  ASSERT_TRUE(m.kv_scheme.has_value());
  EXPECT_EQ(m.kv_scheme->storage, (KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}));
  EXPECT_FALSE(m.kv_scheme->per_head_scales);

  j["quantization_config"]["kv_cache_scheme"]["strategy"] = "attn_head";
  EXPECT_TRUE(parse_model_config(j, nullptr).kv_scheme->per_head_scales);

  j["quantization_config"]["kv_cache_scheme"]["type"] = "int";
  m = parse_model_config(j, nullptr);
  EXPECT_FALSE(m.kv_scheme->storage.has_value());
  EXPECT_NE(m.kv_scheme->unsupported_reason.find("type=int"), std::string::npos);

  j["quantization_config"] = {{"quant_method", "modelopt"}, {"kv_cache_quant_algo", "FP8"}};
  EXPECT_EQ(parse_model_config(j, nullptr).kv_scheme->storage, (KVStorage{DType::F8E4M3, KVQuantMode::Fp8PerTensor}));
  j["quantization_config"] = {{"quant_method", "modelopt"}, {"quantization", {{"kv_cache_quant_algo", "NVFP4"}}}};
  EXPECT_FALSE(parse_model_config(j, nullptr).kv_scheme->storage.has_value());
  j["quantization_config"] = {{"quant_method", "compressed-tensors"}, {"kv_cache_scheme", nullptr}};
  EXPECT_FALSE(parse_model_config(j, nullptr).kv_scheme.has_value());
}

TEST(ModelConfig, GenerationConfigWins) {
  json gen{{"eos_token_id", {2, 7}}, {"do_sample", true}, {"temperature", 0.6}, {"top_p", 0.9}, {"top_k", 20}};
  const ModelConfig m = parse_model_config(llama(), &gen);
  EXPECT_EQ(m.eos_token_ids, (std::vector<TokenId>{2, 7}));
  EXPECT_FLOAT_EQ(*m.default_temperature, 0.6f);
  EXPECT_FLOAT_EQ(*m.default_top_p, 0.9f);
  EXPECT_EQ(*m.default_top_k, 20);
}

namespace {

// The shape of google/gemma-3-270m's config.json (transformers 4.5x, legacy rope keys), minus
// layer_types so that the pattern derives them.
json gemma3() {
  return json{{"architectures", {"Gemma3ForCausalLM"}}, {"model_type", "gemma3_text"}, {"hidden_size", 640},
              {"intermediate_size", 2048}, {"num_hidden_layers", 18}, {"num_attention_heads", 4},
              {"num_key_value_heads", 1}, {"head_dim", 256}, {"vocab_size", 262144},
              {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6}, {"rope_theta", 1000000.0},
              {"rope_local_base_freq", 10000.0}, {"rope_scaling", nullptr}, {"sliding_window", 512},
              {"query_pre_attn_scalar", 256}, {"hidden_activation", "gelu_pytorch_tanh"},
              {"final_logit_softcapping", nullptr}, {"attn_logit_softcapping", nullptr},
              {"torch_dtype", "bfloat16"}, {"eos_token_id", json::array({1, 106})}, {"bos_token_id", 2}};
}

}  // namespace

TEST(ModelConfig, Gemma3) {
  const ModelConfig m = parse_model_config(gemma3(), nullptr);
  EXPECT_EQ(arch_name(m.arch), "Gemma3ForCausalLM");
  EXPECT_EQ(m.hidden_act, GluActivation::GeluTanh);
  EXPECT_TRUE(m.qk_norm);
  EXPECT_TRUE(m.tie_word_embeddings);  // Gemma's default
  EXPECT_DOUBLE_EQ(m.rope.theta, 1e6);
  ASSERT_TRUE(m.rope_local.has_value());
  EXPECT_DOUBLE_EQ(m.rope_local->theta, 1e4);
  EXPECT_EQ(m.rope_local->type, RopeType::Default);
  EXPECT_EQ(m.query_pre_attn_scalar, 256.0);
  ASSERT_EQ(m.layers.size(), 18u);
  for (int i = 0; i < 18; ++i) {  // the default pattern: every 6th layer global
    const bool global = (i + 1) % 6 == 0;
    EXPECT_EQ(m.layers[size_t(i)].kind, global ? AttentionKind::Full : AttentionKind::Sliding) << i;
    if (!global) EXPECT_EQ(m.layers[size_t(i)].window, 512);
  }
  EXPECT_EQ(m.eos_token_ids, (std::vector<TokenId>{1, 106}));

  json j = gemma3();
  j["sliding_window_pattern"] = 3;
  EXPECT_EQ(parse_model_config(j, nullptr).layers[2].kind, AttentionKind::Full);
  EXPECT_EQ(parse_model_config(j, nullptr).layers[3].kind, AttentionKind::Sliding);
  j = gemma3();  // explicit layer_types win
  j["layer_types"] = json::array();
  for (int i = 0; i < 18; ++i) j["layer_types"].push_back(i == 0 ? "full_attention" : "sliding_attention");
  EXPECT_EQ(parse_model_config(j, nullptr).layers[0].kind, AttentionKind::Full);
  EXPECT_EQ(parse_model_config(j, nullptr).layers[5].kind, AttentionKind::Sliding);

  // transformers 5: rope_parameters keyed by layer type; scaling on the global layers only.
  j = gemma3();
  j.erase("rope_theta");
  j.erase("rope_local_base_freq");
  j.erase("rope_scaling");
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "linear"}, {"factor", 8.0}, {"rope_theta", 1e6}}},
                          {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  const ModelConfig t5 = parse_model_config(j, nullptr);
  EXPECT_EQ(t5.rope.type, RopeType::Linear);
  EXPECT_DOUBLE_EQ(t5.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(t5.rope.theta, 1e6);
  EXPECT_EQ(t5.rope_local->type, RopeType::Default);
  EXPECT_DOUBLE_EQ(t5.rope_local->theta, 1e4);
  // The legacy form: rope_scaling applies to the global layers only.
  j = gemma3();
  j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  const ModelConfig legacy = parse_model_config(j, nullptr);
  EXPECT_EQ(legacy.rope.type, RopeType::Linear);
  EXPECT_EQ(legacy.rope_local->type, RopeType::Default);
}

TEST(ModelConfig, Gemma3Refusals) {
  json j = gemma3();
  j["final_logit_softcapping"] = 30.0;
  EXPECT_NE(error_of(j).find("final_logit_softcapping"), std::string::npos);
  j = gemma3();
  j["attn_logit_softcapping"] = 50.0;
  EXPECT_NE(error_of(j).find("soft-capping"), std::string::npos);
  j = gemma3();
  j["hidden_activation"] = "relu";
  EXPECT_NE(error_of(j).find("gelu_pytorch_tanh"), std::string::npos);
  j = gemma3();  // the multimodal wrapper without its language model's config
  j["architectures"] = {"Gemma3ForConditionalGeneration"};
  EXPECT_NE(error_of(j).find("'text_config', which is missing"), std::string::npos) << error_of(j);
}

// Gemma 3 4B-27B ship as Gemma3ForConditionalGeneration. google/gemma-3-4b-it's config.json
// (transformers 4.50): text_config names only what differs from Gemma3TextConfig, the rest is
// the class's defaults (8 heads, 4 KV heads of 256, vocabulary 262208, tied embeddings, ...).
TEST(ModelConfig, Gemma3ConditionalGenerationFillsTheTextConfigsDefaults) {
  const json j = {{"architectures", {"Gemma3ForConditionalGeneration"}},
                  {"model_type", "gemma3"},
                  {"eos_token_id", {1, 106}},
                  {"torch_dtype", "bfloat16"},
                  {"image_token_index", 262144},
                  {"mm_tokens_per_image", 256},
                  {"text_config",
                   {{"hidden_size", 2560}, {"intermediate_size", 10240}, {"model_type", "gemma3_text"},
                    {"num_hidden_layers", 34}, {"rope_scaling", {{"factor", 8.0}, {"rope_type", "linear"}}},
                    {"sliding_window", 1024}}},
                  {"vision_config", {{"hidden_size", 1152}, {"model_type", "siglip_vision_model"}}}};
  const ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_EQ(arch_name(m.arch), "Gemma3ForCausalLM");
  EXPECT_EQ(m.wrapper, "Gemma3ForConditionalGeneration");
  EXPECT_EQ(m.hidden_size, 2560);
  EXPECT_EQ(m.intermediate_size, 10240);
  EXPECT_EQ(m.num_layers, 34);
  EXPECT_EQ(m.num_heads, 8);
  EXPECT_EQ(m.num_kv_heads, 4);
  EXPECT_EQ(m.head_dim, 256);
  EXPECT_EQ(m.vocab_size, 262208);
  EXPECT_EQ(m.max_position_embeddings, 131072);
  EXPECT_TRUE(m.tie_word_embeddings);
  EXPECT_EQ(m.eos_token_ids, (std::vector<TokenId>{1, 106}));  // the wrapper's, not the class default
  EXPECT_EQ(m.query_pre_attn_scalar, 256.0);
  EXPECT_EQ(m.rope.type, RopeType::Linear);
  EXPECT_DOUBLE_EQ(m.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(m.rope.theta, 1e6);
  EXPECT_DOUBLE_EQ(m.rope_local->theta, 1e4);
  ASSERT_EQ(m.layers.size(), 34u);
  for (int i = 0; i < 34; ++i) {
    const bool global = (i + 1) % 6 == 0;
    EXPECT_EQ(m.layers[size_t(i)].kind, global ? AttentionKind::Full : AttentionKind::Sliding) << i;
    if (!global) EXPECT_EQ(m.layers[size_t(i)].window, 1024);
  }
}

namespace {

json qwen3_moe() {
  json j = llama();
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["num_experts"] = 8;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 32;
  j["norm_topk_prob"] = true;
  return j;
}

json gpt_oss() {
  json j = llama();
  j["architectures"] = {"GptOssForCausalLM"};
  j.erase("rms_norm_eps");
  j["head_dim"] = 16;
  j["num_local_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  j["rope_theta"] = 150000.0;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                       {"truncate", false}, {"original_max_position_embeddings", 4096}};
  return j;
}

}  // namespace

// Qwen3-MoE: the Hub's num_experts or transformers 5's num_local_experts; the dense layers of
// mlp_only_layers and decoder_sparse_step; Qwen3's q/k norms.
TEST(ModelConfig, Qwen3Moe) {
  ModelConfig m = parse_model_config(qwen3_moe(), nullptr);
  EXPECT_EQ(arch_name(m.arch), "Qwen3MoeForCausalLM");
  ASSERT_TRUE(m.moe.has_value());
  EXPECT_EQ(m.moe->num_experts, 8);
  EXPECT_EQ(m.moe->top_k, 2);
  EXPECT_EQ(m.moe->expert_size, 32);
  EXPECT_TRUE(m.moe->norm_topk);
  EXPECT_FALSE(m.moe->router_bias);
  EXPECT_EQ(m.moe->act, GluActivation::Silu);
  EXPECT_TRUE(m.qk_norm);
  EXPECT_EQ(m.moe_layers, std::vector<bool>(4, true));
  json j = qwen3_moe();
  j.erase("num_experts");
  j.erase("norm_topk_prob");
  j["num_local_experts"] = 6;
  j["mlp_only_layers"] = {0, 3};
  m = parse_model_config(j, nullptr);
  EXPECT_EQ(m.moe->num_experts, 6);
  EXPECT_FALSE(m.moe->norm_topk);  // transformers' default
  EXPECT_EQ(m.moe_layers, (std::vector<bool>{false, true, true, false}));
  j.erase("mlp_only_layers");
  j["decoder_sparse_step"] = 2;  // layers 1 and 3 sparse
  EXPECT_EQ(parse_model_config(j, nullptr).moe_layers, (std::vector<bool>{false, true, false, true}));
  j = qwen3_moe();
  j["num_experts_per_tok"] = 9;
  EXPECT_NE(error_of(j).find("num_experts_per_tok 9 exceeds the 8 experts"), std::string::npos) << error_of(j);
  j = qwen3_moe();
  j["mlp_only_layers"] = {4};
  EXPECT_NE(error_of(j).find("mlp_only_layers holds 4"), std::string::npos) << error_of(j);
  j = qwen3_moe();
  j.erase("moe_intermediate_size");
  EXPECT_NE(error_of(j).find("moe_intermediate_size"), std::string::npos) << error_of(j);
  j = qwen3_moe();
  j["shared_expert_intermediate_size"] = 64;
  EXPECT_NE(error_of(j).find("no shared expert"), std::string::npos) << error_of(j);
  // A dense model has no experts and every layer dense.
  EXPECT_FALSE(parse_model_config(llama(), nullptr).moe.has_value());
  EXPECT_EQ(parse_model_config(llama(), nullptr).moe_layers, std::vector<bool>(4, false));
}

// GPT-OSS: sinks, biases, alternate sliding layers by default, YaRN, the clamped SwiGLU, and
// the released MXFP4 checkpoints refused by name.
TEST(ModelConfig, GptOss) {
  ModelConfig m = parse_model_config(gpt_oss(), nullptr);
  EXPECT_EQ(arch_name(m.arch), "GptOssForCausalLM");
  EXPECT_TRUE(m.attention_sinks);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_TRUE(m.o_bias);
  EXPECT_FALSE(m.qk_norm);
  EXPECT_DOUBLE_EQ(m.rms_norm_eps, 1e-5);
  ASSERT_TRUE(m.moe.has_value());
  EXPECT_EQ(m.moe->num_experts, 4);
  EXPECT_EQ(m.moe->expert_size, 128);  // intermediate_size
  EXPECT_TRUE(m.moe->norm_topk && m.moe->router_bias && m.moe->expert_bias);
  EXPECT_EQ(m.moe->act, GluActivation::SwigluClamp);
  EXPECT_FLOAT_EQ(m.moe->swiglu_limit, 7.0f);
  EXPECT_FLOAT_EQ(m.moe->swiglu_alpha, 1.702f);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(m.layers[size_t(i)].kind, i % 2 == 0 ? AttentionKind::Sliding : AttentionKind::Full) << i;
    if (i % 2 == 0) EXPECT_EQ(m.layers[size_t(i)].window, 128);
  }
  EXPECT_EQ(m.rope.type, RopeType::Yarn);
  EXPECT_DOUBLE_EQ(m.rope.theta, 150000.0);
  EXPECT_DOUBLE_EQ(m.rope.factor, 32.0);
  EXPECT_FALSE(m.rope.truncate);
  EXPECT_EQ(m.rope.original_max_position, 4096);
  EXPECT_NEAR(m.rope.attention_factor, 0.1 * std::log(32.0) + 1.0, 1e-12);
  // transformers 5's rope_parameters, layer_types and swiglu_limit.
  json j = gpt_oss();
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 8.0}, {"rope_theta", 1e4},
                          {"original_max_position_embeddings", 512}, {"attention_factor", 1.5}};
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  j["sliding_window"] = 64;
  j["swiglu_limit"] = 3.5;
  m = parse_model_config(j, nullptr);
  EXPECT_DOUBLE_EQ(m.rope.factor, 8.0);
  EXPECT_DOUBLE_EQ(m.rope.theta, 1e4);
  EXPECT_TRUE(m.rope.truncate);
  EXPECT_DOUBLE_EQ(m.rope.attention_factor, 1.5);
  EXPECT_EQ(m.layers[1].kind, AttentionKind::Sliding);
  EXPECT_EQ(m.layers[1].window, 64);
  EXPECT_EQ(m.layers[0].kind, AttentionKind::Full);
  EXPECT_FLOAT_EQ(m.moe->swiglu_limit, 3.5f);
  j = gpt_oss();
  // MXFP4 experts (as GPT-OSS is released) are the checkpoint's to read: no FP8 scheme.
  j["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"lm_head"}}};
  EXPECT_EQ(error_of(j), "") << error_of(j);
  EXPECT_FALSE(parse_model_config(j, nullptr).weight_quant);
  j = gpt_oss();
  j["rope_scaling"].erase("original_max_position_embeddings");
  EXPECT_NE(error_of(j).find("original_max_position_embeddings"), std::string::npos) << error_of(j);
  j = gpt_oss();
  j["rope_scaling"]["factor"] = -1;
  EXPECT_NE(error_of(j).find("positive 'factor'"), std::string::npos) << error_of(j);
}

// Every architecture registers its names; model_type alone finds it, and an unknown one lists
// the architectures kvlm runs.
TEST(ModelConfig, ArchitectureRegistry) {
  for (const ArchSpec* a : architectures()) {
    EXPECT_FALSE(a->name.empty());
    EXPECT_NE(a->parse, nullptr) << a->name;
    EXPECT_TRUE(a->make != nullptr || !a->not_a_model.empty()) << a->name;
  }
  json j = qwen3_moe();
  j.erase("architectures");
  j["model_type"] = "qwen3_moe";
  EXPECT_EQ(arch_name(parse_model_config(j, nullptr).arch), "Qwen3MoeForCausalLM");
  j = llama();
  j["architectures"] = {"DeepseekV3ForCausalLM"};
  const std::string e = error_of(j);
  EXPECT_NE(e.find("unsupported architecture 'DeepseekV3ForCausalLM'"), std::string::npos) << e;
  EXPECT_NE(e.find("Qwen3MoeForCausalLM"), std::string::npos) << e;
  EXPECT_NE(e.find("GptOssForCausalLM"), std::string::npos) << e;
}

// Qwen3.5 (hybrid): which layers are Gated DeltaNet layers (layer_types, or every
// full_attention_interval-th layer full), their sizes, partial rotary from rope_parameters
// or the top level, the gated q_proj and (1 + w) q/k norms; what it refuses, by field.
TEST(ModelConfig, Qwen35Hybrid) {
  json j = llama();
  j["architectures"] = {"Qwen3_5ForCausalLM"};
  j["head_dim"] = 32;
  j["num_hidden_layers"] = 8;
  j["linear_num_key_heads"] = 2;
  j["linear_num_value_heads"] = 4;
  j["linear_key_head_dim"] = 16;
  j["linear_value_head_dim"] = 24;
  j["linear_conv_kernel_dim"] = 4;
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1e7}, {"partial_rotary_factor", 0.25},
                          {"mrope_section", {11, 11, 10}}, {"mrope_interleaved", true}};
  ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_EQ(arch_name(m.arch), "Qwen3_5ForCausalLM");
  ASSERT_TRUE(m.linear_attention.has_value());
  const LinearAttentionConfig& l = *m.linear_attention;
  EXPECT_EQ(l.conv_dim(), 2 * 2 * 16 + 4 * 24);
  EXPECT_EQ(l.in_proj_dim(), l.conv_dim() + 4 * 24 + 2 * 4);
  EXPECT_EQ(l.state_values(), size_t(3 * l.conv_dim() + 4 * 16 * 24));
  // Bytes per slot: the fp32 window, the matrices in state_dtype, rounded up to 16.
  EXPECT_EQ(l.state_dtype, DType::F32);
  EXPECT_EQ(l.state_bytes(), (l.state_values() * 4 + 15) / 16 * 16);
  LinearAttentionConfig half = l;
  half.state_dtype = DType::BF16;
  EXPECT_EQ(half.state_bytes(), (l.conv_state_values() * 4 + l.matrix_values() * 2 + 15) / 16 * 16);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(m.is_linear_layer(i), (i + 1) % 4 != 0) << i;  // full_attention_interval 4
  EXPECT_EQ(m.num_kv_layers(), 2);
  EXPECT_EQ(attention_layers(m).size(), 2u);
  EXPECT_EQ(attention_layers(m)[1].layer, 7);
  EXPECT_EQ(m.rope.rotary_dim, 8);
  EXPECT_DOUBLE_EQ(m.rope.theta, 1e7);
  EXPECT_TRUE(m.attn_output_gate && m.qk_norm);
  j["full_attention_interval"] = 2;
  EXPECT_EQ(parse_model_config(j, nullptr).num_kv_layers(), 4);
  json lt = j;
  lt["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "linear_attention",
                       "full_attention", "linear_attention", "linear_attention", "full_attention"};
  m = parse_model_config(lt, nullptr);
  EXPECT_FALSE(m.is_linear_layer(0));
  EXPECT_TRUE(m.is_linear_layer(1));
  EXPECT_EQ(m.num_kv_layers(), 3);
  // The top-level partial_rotary_factor (older configs), and the whole head.
  json top = j;
  top["rope_parameters"].erase("partial_rotary_factor");
  top["partial_rotary_factor"] = 0.5;
  EXPECT_EQ(parse_model_config(top, nullptr).rope.rotary_dim, 16);
  top["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(parse_model_config(top, nullptr).rope.rotary_dim, 0);

  auto refused = [&](json bad, const std::string& what) {
    const std::string e = error_of(bad);
    EXPECT_NE(e.find(what), std::string::npos) << e;
  };
  json bad = lt;
  bad["layer_types"][2] = "mamba";
  refused(bad, "layer_types[2] is 'mamba'");
  bad = j;
  bad["layer_types"] = json::array();
  for (int i = 0; i < 8; ++i) bad["layer_types"].push_back("linear_attention");
  refused(bad, "at least one full_attention layer");
  bad = j;
  bad["linear_num_value_heads"] = 3;
  refused(bad, "must be a multiple of linear_num_key_heads");
  bad = j;
  bad.erase("linear_key_head_dim");
  refused(bad, "linear_key_head_dim");
  bad = j;
  bad["rope_parameters"]["partial_rotary_factor"] = 0.3;
  refused(bad, "partial_rotary_factor");
  bad = j;
  bad["attention_bias"] = true;
  refused(bad, "attention_bias");
  // Neither rope_parameters nor the top level says: transformers' default for the family, 0.25.
  json none = j;
  none["rope_parameters"].erase("partial_rotary_factor");
  EXPECT_EQ(parse_model_config(none, nullptr).rope.rotary_dim, 8);
  // rope_parameters' factor wins over a stale top-level one.
  json both = j;
  both["partial_rotary_factor"] = 1.0;
  EXPECT_EQ(parse_model_config(both, nullptr).rope.rotary_dim, 8);
}

// The hybrid MoE models: Qwen3-Next's experts follow decoder_sparse_step / mlp_only_layers and
// norm_topk_prob (default true); Qwen3.5-MoE's are in every layer and always renormalized. Both
// have a shared expert, which a plain Qwen3-MoE refuses.
TEST(ModelConfig, HybridMixturesOfExperts) {
  json j = llama();
  j["architectures"] = {"Qwen3NextForCausalLM"};
  j["head_dim"] = 32;
  j["num_hidden_layers"] = 4;
  j["linear_num_key_heads"] = 2;
  j["linear_num_value_heads"] = 4;
  j["linear_key_head_dim"] = 16;
  j["linear_value_head_dim"] = 24;
  j["linear_conv_kernel_dim"] = 4;
  j["num_experts"] = 6;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 32;
  j["shared_expert_intermediate_size"] = 48;
  j["mlp_only_layers"] = {1};
  j["decoder_sparse_step"] = 1;
  ModelConfig m = parse_model_config(j, nullptr);
  EXPECT_EQ(arch_name(m.arch), "Qwen3NextForCausalLM");
  ASSERT_TRUE(m.moe && m.linear_attention);
  EXPECT_EQ(m.moe->shared_expert_size, 48);
  EXPECT_TRUE(m.moe->norm_topk);
  EXPECT_EQ(m.moe_layers, (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(m.rope.rotary_dim, 8);  // no partial_rotary_factor anywhere: 0.25
  EXPECT_EQ(m.num_kv_layers(), 1);
  j["norm_topk_prob"] = false;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = nullptr;
  m = parse_model_config(j, nullptr);
  EXPECT_FALSE(m.moe->norm_topk);
  EXPECT_EQ(m.moe_layers, (std::vector<bool>{false, true, false, true}));
  json bad = j;
  bad.erase("shared_expert_intermediate_size");
  EXPECT_NE(error_of(bad).find("shared_expert_intermediate_size"), std::string::npos) << error_of(bad);

  json q = j;
  q["architectures"] = {"Qwen3_5MoeForCausalLM"};
  q["norm_topk_prob"] = false;  // not a Qwen3.5-MoE field: its router always renormalizes
  m = parse_model_config(q, nullptr);
  EXPECT_EQ(arch_name(m.arch), "Qwen3_5MoeForCausalLM");
  EXPECT_TRUE(m.moe->norm_topk);
  EXPECT_EQ(m.moe_layers, std::vector<bool>(4, true));
  EXPECT_EQ(m.moe->shared_expert_size, 48);
  // The multimodal wrapper reads text_config.
  json w = {{"architectures", {"Qwen3_5MoeForConditionalGeneration"}}, {"text_config", q}};
  w["text_config"].erase("architectures");
  w["text_config"]["model_type"] = "qwen3_5_moe_text";
  m = parse_model_config(w, nullptr);
  EXPECT_EQ(arch_name(m.arch), "Qwen3_5MoeForCausalLM");
  EXPECT_EQ(m.wrapper, "Qwen3_5MoeForConditionalGeneration");
}

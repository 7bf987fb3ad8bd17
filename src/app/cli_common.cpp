#include <cctype>
#include "app/cli_common.h"

#include <unistd.h>

#include <charconv>

#include "core/error.h"

#ifndef KVLM_SOURCE_DIR
#define KVLM_SOURCE_DIR ""
#endif

namespace kvlm::app {

void ModelFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--model,-m", model, "Hugging Face model directory (default: the bundled kvlm-tiny model)");
  cmd.add_option("--kv-cache-dtype", kv_cache_dtype,
                 "KV cache precision: auto, float16, bfloat16, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2, "
                 "fp8_per_token_head, int8_per_token_head, int4_per_token_head")
      ->capture_default_str();
  cmd.add_option("--kv-cache-rotation", kv_cache_rotation,
                 "rotate q/K/V of quantized layers by a fixed randomized Hadamard transform before K/V are "
                 "stored (spreads outlier channels; scores are unchanged): auto (4-bit layers only), none, hadamard")
      ->capture_default_str();
  cmd.add_option("--kv-cache-keep-sink", keep_sink,
                 "quantized layers also hold the first N tokens of every sequence in the model dtype, and every "
                 "query reads them exact (attention sinks; 4 is the measured setting)")
      ->capture_default_str();
  cmd.add_option("--kv-cache-keep-recent", keep_recent,
                 "quantized layers also hold each sequence's latest W tokens in the model dtype, and every query "
                 "reads its W latest keys exact (64 is the measured setting)")
      ->capture_default_str();
  cmd.add_option("--kv-cache-dtype-skip-layers", skip_layers,
                 "layers that keep the model dtype: indices and/or 'sliding_window', e.g. 0,27,sliding_window");
  cmd.add_option("--attention-backend", attention_backend, "force an attention backend by name (see `kvlm inspect`)");
  cmd.add_option("--device", device, "auto, cpu, cuda or cuda:N (auto: the first GPU when one is usable; N: a GPU's index)")->capture_default_str();
  cmd.add_option("--dtype", dtype,
                 "model dtype: auto (the checkpoint's), float32, bfloat16, float16; an auto KV cache follows it "
                 "(the CPU backend computes in float32 either way)")
      ->capture_default_str();
  cmd.add_option("--quantization", quantization,
                 "fp8: quantize a 16-bit checkpoint's linear weights to FP8 E4M3 at load, one scale per output "
                 "channel (the embedding and LM head stay as they are); FP8 checkpoints (compressed-tensors, "
                 "modelopt, fp8) run without it");
  cmd.add_option("--block-size", block_size, "tokens per KV page (power of two, 1..256)")->capture_default_str();
  cmd.add_flag("--enforce-eager", enforce_eager, "CUDA: launch every decode step's kernels one by one, no CUDA graphs");
}

void ModelFlags::add_speculative_to(CLI::App& cmd) {
  cmd.add_option("--speculative-config", speculative_config,
                 "speculative decoding, as JSON with vLLM's keys (the output is unchanged): "
                 R"({"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":5,"prompt_lookup_min":2})"
                 " proposes what followed the last tokens' earlier occurrence; "
                 R"({"method":"dflash","model":DIR,"num_speculative_tokens":7})"
                 " drafts blocks with a DFlash drafter model (optional \"kv_cache_dtype\" for its layers); either "
                 "takes \"disable_by_batch_size\": N (no drafting while more than N sequences run)");
}

std::filesystem::path default_model_dir() {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> candidates;
  if (const char* env = std::getenv("KVLM_DEFAULT_MODEL"); env && *env) candidates.emplace_back(env);
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n > 0) {
    const fs::path exe_dir = fs::path(std::string(buf, size_t(n))).parent_path();
    candidates.push_back(exe_dir / "../models/kvlm-tiny");
    candidates.push_back(exe_dir / "../share/kvlm/models/kvlm-tiny");
  }
  if (*KVLM_SOURCE_DIR) candidates.push_back(fs::path(KVLM_SOURCE_DIR) / "models/kvlm-tiny");
  for (const auto& c : candidates)
    if (fs::exists(c / "config.json", ec)) return fs::weakly_canonical(c, ec);
  throw Error("no --model given and the bundled model (models/kvlm-tiny) was not found; pass --model DIR");
}

std::filesystem::path ModelFlags::model_dir() const { return model.empty() ? default_model_dir() : std::filesystem::path(model); }

CacheConfig ModelFlags::cache_config() const {
  CacheConfig c;
  c.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype);
  c.skip_layers = parse_skip_layers(skip_layers);
  c.rotation = parse_kv_rotation(kv_cache_rotation);
  validate_keep_tokens(keep_sink, "--kv-cache-keep-sink");
  validate_keep_tokens(keep_recent, "--kv-cache-keep-recent");
  c.keep_sink = keep_sink;
  c.keep_recent = keep_recent;
  validate_block_size(block_size);
  c.block_size = block_size;
  if (!attention_backend.empty()) c.attention_backend = attention_backend;
  return c;
}

std::vector<TokenId> parse_token_ids(std::string_view text) {
  std::vector<TokenId> out;
  auto sep = [](char c) { return c == ',' || c == '[' || c == ']' || std::isspace(static_cast<unsigned char>(c)); };
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && sep(text[i])) ++i;
    size_t j = i;
    while (j < text.size() && !sep(text[j])) ++j;
    if (j == i) break;
    const std::string_view tok = text.substr(i, j - i);
    long long v = -1;
    auto [p, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (ec != std::errc() || p != tok.data() + tok.size() || v < 0 || v > INT32_MAX)
      throw Error("invalid token id '" + std::string(tok) + "' ; expected non-negative integers like 1,2,3");
    out.push_back(TokenId(v));
    i = j;
  }
  return out;
}

ModelOptions ModelFlags::model_options() const {
  ModelOptions o;
  o.model_dir = model_dir();
  o.cache = cache_config();
  const DeviceChoice d = resolve_device(device);
  o.device = d.device;
  o.gpu = d.gpu;
  o.dtype = parse_model_dtype(dtype);
  o.enforce_eager = enforce_eager;
  o.quantization = quantization;
  if (!speculative_config.empty()) o.speculative = parse_speculative_config(speculative_config);
  return o;
}

}  // namespace kvlm::app

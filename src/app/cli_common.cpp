#include <cctype>
#include "app/cli_common.h"

#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>

#include "config/model_config.h"
#include "core/error.h"
#include "core/log.h"

#ifndef KVLM_SOURCE_DIR
#define KVLM_SOURCE_DIR ""
#endif

namespace kvlm::app {

void ModelFlags::add_to(CLI::App& cmd) {
  cmd.add_option("MODEL", model_positional,
                 "the model: a Hugging Face model directory (config.json, safetensors) or a .gguf file (default: "
                 "the bundled kvlm-tiny model); the same as --model");
  cmd.add_option("--model,-m", model, "the model, as MODEL above");
  cmd.add_option("--kv-cache-dtype", kv_cache_dtype,
                 "KV cache precision: auto, float16, bfloat16, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2, "
                 "fp8_per_token_head, int8_per_token_head, int4_per_token_head; or K and V apart: "
                 "k=DTYPE,v=DTYPE (a side left out is auto; on CUDA any two of bfloat16 and the per-token-head formats)")
      ->capture_default_str();
  cmd.add_option("--cache-type-k", cache_type_k, "K's dtype alone (llama.cpp's name; V: --cache-type-v, else auto)");
  cmd.add_option("--cache-type-v", cache_type_v, "V's dtype alone (llama.cpp's name; K: --cache-type-k, else auto)");
  cmd.add_option("--kv-cache-plan", kv_cache_plan,
                 "a KV plan file (JSON): per layer the K and V dtypes, rotation and its seed, exact sink/recent "
                 "tokens; above every other KV option for the layers and sides it names (`kvlm calibrate "
                 "--kld-budget` writes one, `kvlm inspect --write-kv-plan` too)");
  cmd.add_option("--kv-cache-rotation", kv_cache_rotation,
                 "rotate q/K/V of quantized layers by a fixed randomized Hadamard transform before K/V are "
                 "stored (spreads outlier channels; scores are unchanged): auto (4-bit layers only), none, hadamard")
      ->capture_default_str();
  cmd.add_option("--kv-cache-keep-sink", kv_cache_keep_sink,
                 "quantized layers also hold the first N tokens of every sequence in the model dtype, and every "
                 "query reads them exact (attention sinks; 4 is the measured setting)")
      ->capture_default_str();
  cmd.add_option("--kv-cache-keep-recent", kv_cache_keep_recent,
                 "quantized layers also hold each sequence's latest W tokens in the model dtype, and every query "
                 "reads its W latest keys exact (64 is the measured setting)")
      ->capture_default_str();
  cmd.add_option("--kv-cache-dtype-skip-layers", kv_cache_dtype_skip_layers,
                 "layers that keep the model dtype: indices and/or 'sliding_window', e.g. 0,27,sliding_window");
  cmd.add_option("--mamba-ssm-cache-dtype", mamba_ssm_cache_dtype,
                 "hybrid linear-attention models (Qwen3.5, Qwen3-Next): the Gated DeltaNet layers' recurrent state "
                 "in float32 (auto) or bfloat16 (half the state memory, at some accuracy), as vLLM's flag")
      ->capture_default_str();
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
  cmd.add_flag("--dequantize-weights", dequantize_weights,
               "GGUF and 4-bit (AWQ, GPTQ, compressed-tensors) checkpoints: dequantize the quantized weights at "
               "load (float32 on the CPU, the compute dtype on CUDA) instead of computing from them as stored: "
               "4-8x the memory (the reference path: AWQ / GPTQ / compressed-tensors values exact); on CUDA faster "
               "from ~24 concurrent sequences on (kept codes: 1.1x a 16-bit copy at 16, 0.8x at 32, 0.6x at 64)");
  cmd.add_option("--runner", runner,
                 "what the model runs as: generate (text), pooling (an embedding model: `kvlm serve` answers "
                 "/v1/embeddings), or auto (pooling when the model directory holds sentence-transformers' "
                 "modules.json, else generate), as vLLM's --runner")
      ->capture_default_str();
  cmd.add_option("--block-size", block_size, "tokens per KV page (power of two, 1..256)")->capture_default_str();
  cmd.add_flag("--enforce-eager", enforce_eager, "CUDA: launch every decode step's kernels one by one, no CUDA graphs");
  cmd.add_option("--tensor-parallel-size,--tp", tensor_parallel_size,
                 "split every layer over N GPUs (GPUs 0..N-1, or from --device cuda:K on), each holding 1/N of the "
                 "weights and of the KV cache, as vLLM's -tp N (which kvlm also takes); on the CPU, N threads")
      ->capture_default_str();
  cmd.add_flag("--enable-expert-parallel", enable_expert_parallel,
               "a mixture of experts under --tensor-parallel-size N: each rank holds whole experts (1/N of them) "
               "instead of 1/N of every expert's width, as vLLM's flag of that name; the experts must divide over N");
  const std::string dist = "Tensor parallelism over several processes or hosts (docs/multi-node.md)";
  cmd.add_option("--nnodes", nnodes, "processes (nodes) that share the tensor-parallel ranks (default: WORLD_SIZE, else 1)")
      ->group(dist);
  cmd.add_option("--node-rank", node_rank, "this process's index among --nnodes; node 0 runs the engine and serves, the "
                                           "others follow it (default: RANK, else 0)")
      ->group(dist);
  cmd.add_option("--distributed-init", distributed_init,
                 "tcp://HOST:PORT where node 0 listens for the other nodes (default: MASTER_ADDR, MASTER_PORT)")
      ->group(dist);
  cmd.add_option("--distributed-timeout", distributed_timeout, "seconds node 0 waits for the other nodes to connect")
      ->capture_default_str()
      ->group(dist);
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

std::string ModelFlags::model_arg() const {
  if (!model_positional.empty() && !model.empty() && model != model_positional)
    throw Error("two models given: '" + model_positional + "' and --model '" + model + "'; give one");
  return model.empty() ? model_positional : model;
}

std::filesystem::path ModelFlags::model_dir() const {
  const std::string m = model_arg();
  if (m.empty()) return default_model_dir();
  // Said first, on every command: a missing path, a Hub id or a directory without a model
  // would otherwise surface later as whatever the command looks for first (a tokenizer).
  check_model_dir(m);
  return std::filesystem::path(m);
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
  ModelOptions o = ModelArgs::model_options(model_dir(), ArgStyle::Flag);
  o.dist = resolve_dist_config(nnodes, node_rank, distributed_init, distributed_timeout);
  if (o.dist.enabled()) {
    // torchrun starts a process per GPU and tells each its GPU (LOCAL_RANK).
    const char* local = std::getenv("LOCAL_RANK");
    if (local && o.device == Device::Cuda && !device.starts_with("cuda:"))
      o.gpu = std::atoi(local) * std::max(1, o.tensor_parallel_size / o.dist.nnodes);
    if (o.dist.node_rank > 0) {
      int code = 1;
      try {
        auto e = LoadedModel::load(o);
        log::info("node " + std::to_string(o.dist.node_rank) + " of " + std::to_string(o.dist.nnodes) +
                  ": following node 0");
        code = e->follow();
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "kvlm: error: node %d: %s\n", o.dist.node_rank, ex.what());
        std::fflush(stderr);
        std::_Exit(1);
      }
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(code);
    }
  }
  return o;
}

}  // namespace kvlm::app

namespace kvlm::app {

void ServeExtraFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--chat-template", chat_template,
                 "the chat template: a file, or the Jinja template itself (default: the tokenizer's)");
  cmd.add_option("--tokenizer", tokenizer, "the directory of the tokenizer (default: the model's)");
  cmd.add_option("--generation-config", generation_config,
                 "sampling defaults: auto (the model's generation_config.json), vllm (none: vLLM's own "
                 "defaults), or a directory holding a generation_config.json")
      ->capture_default_str();
  cmd.add_option("--seed", seed,
                 "seed of the server's random generator, which seeds requests that give no seed (reproducible "
                 "runs of the same requests in the same order)");
  cmd.add_option("--uvicorn-log-level", log_level,
                 "log level: critical, error (errors only), warning (default: warnings, access log, stats), info, "
                 "debug, trace")
      ->check(CLI::IsMember({"critical", "error", "warning", "info", "debug", "trace"}));
  cmd.add_option("--allowed-origins", allowed_origins,
                 "origins a browser may call the API from (CORS), as a JSON list like '[\"*\"]' or comma-separated "
                 "(default: none)");
  cmd.add_option("--max-logprobs", max_logprobs, "the most logprobs / top_logprobs a request may ask for")
      ->capture_default_str();
  cmd.add_option("--max-seqs-per-request", max_seqs_per_request,
                 "the most sequences one request may ask for (prompts x n); the scheduler also shares the running "
                 "set fairly between requests, so a large one cannot hold up the rest")
      ->capture_default_str();
  cmd.add_option("--grammar-compile-timeout", grammar_compile_timeout,
                 "seconds a structured output (JSON schema, regex, grammar, choice) may take to compile, its first "
                 "token mask included; past it the request gets 400")
      ->capture_default_str();
  cmd.add_option("--responses-store-size", responses_store_size,
                 "/v1/responses kept in memory for previous_response_id and GET /v1/responses/{id} (the newest, "
                 "within 256 MiB); 0 keeps none (stateless)")
      ->capture_default_str();
  cmd.add_option("--tool-call-parser", tool_call_parser,
                 "the format the model writes tool calls in: hermes (Hermes, Qwen 2.5, Qwen 3), qwen3_coder (Qwen3-Coder, "
                 "Qwen3.5: XML), llama3_json (Llama 3.1, 3.2), pythonic (Llama 3.2, 4), harmony (GPT-OSS: also its "
                 "reasoning), none (default: found in the chat template)");
  cmd.add_option("--reasoning-parser", reasoning_parser,
                 "return a thinking model's reasoning as reasoning_content, apart from the answer: qwen3 or deepseek_r1 "
                 "(<think> ... </think>; where the reply starts is read from the prompt), gpt_oss (harmony, which "
                 "GPT-OSS's format does already)");
  cmd.add_flag("--enable-auto-tool-choice", enable_auto_tool_choice,
               "accepted as in vLLM: tool_choice auto works whenever the tool-call format is known");
  cmd.add_flag("--disable-log-requests", disable_log_requests, "no access-log line per request on stderr");
  cmd.add_flag("--disable-log-stats", disable_log_stats, "no periodic throughput / queue / KV cache line on stderr");
  cmd.add_option("--log-stats-interval", log_stats_interval, "seconds between stats lines (while there is activity)")
      ->capture_default_str();
  cmd.add_option("--header-timeout", header_timeout,
                 "seconds a request's headers may take from its first byte (408 and closed after)")
      ->capture_default_str();
  cmd.add_option("--read-timeout", read_timeout, "seconds a request's body may take after its headers (408 after)")
      ->capture_default_str();
  cmd.add_option("--keep-alive-timeout", keep_alive_timeout, "seconds an idle connection stays open")
      ->capture_default_str();

  const std::string group = "vLLM flags kvlm does not support (see docs/serving-flags.md)";
  auto add = [&](const std::string& names, bool takes_value, std::string why,
                 std::function<bool(const std::string&)> accept = nullptr, bool ignored = false) {
    auto r = std::make_unique<Refused>();
    r->why = std::move(why);
    r->accept = std::move(accept);
    r->ignored = ignored;
    r->opt = takes_value ? cmd.add_option(names, r->value, r->why) : cmd.add_flag(names)->description(r->why);
    r->opt->group(group);
    refused.push_back(std::move(r));
  };
  auto only = [](std::vector<std::string> ok) {
    return [ok = std::move(ok)](const std::string& v) { return std::find(ok.begin(), ok.end(), v) != ok.end(); };
  };
  const std::string one_device = "kvlm splits a model over GPUs by tensor parallelism (--tensor-parallel-size); for "
                                 "more throughput run one kvlm serve per GPU group behind a load balancer";
  add("--pipeline-parallel-size", true, one_device + " (only 1 is accepted)", only({"1"}));
  add("--data-parallel-size", true, one_device + " (only 1 is accepted)", only({"1"}));
  add("--distributed-executor-backend", true, one_device);
  auto any = [](const std::string&) { return true; };
  add("--swap-space", true,
      "kvlm's host memory for KV pages is --kv-offload-gib: the prefix cache's tier, where a preempted sequence's "
      "pages go too",
      any, true);
  add("--cpu-offload-gb", true, "kvlm keeps every weight on the device (only 0 is accepted)", only({"0"}));
  add("--download-dir", true, "kvlm does not download models: give a local directory (for example "
                              "`huggingface-cli download ORG/NAME --local-dir DIR`, then `kvlm serve DIR`)");
  add("--revision", true, "kvlm does not fetch from the Hugging Face Hub: give a local directory");
  add("--tokenizer-revision", true, "kvlm does not fetch from the Hugging Face Hub: give a local directory");
  add("--code-revision", true, "kvlm runs no code from the model repository");
  add("--load-format", true, "kvlm reads safetensors and GGUF checkpoints as they are (only auto, safetensors, gguf)",
      only({"auto", "safetensors", "gguf"}));
  add("--trust-remote-code", false, "kvlm runs no code from the model repository; the flag changes nothing", any, true);
  add("--ssl-keyfile", true, "kvlm serves plain HTTP: terminate TLS in a reverse proxy (nginx, Caddy) in front of it");
  add("--ssl-certfile", true, "kvlm serves plain HTTP: terminate TLS in a reverse proxy (nginx, Caddy) in front of it");
  add("--ssl-ca-certs", true, "kvlm serves plain HTTP: terminate TLS in a reverse proxy (nginx, Caddy) in front of it");
  add("--root-path", true, "serve kvlm behind a proxy that strips the path prefix");
  add("--response-role", true, "the role of a chat response is always 'assistant'", only({"assistant"}));
  add("--enable-lora", false, "kvlm has no LoRA adapters");
  add("--lora-modules", true, "kvlm has no LoRA adapters");
  add("--preemption-mode", true, "kvlm preempts by recomputing (only recompute is accepted)", only({"recompute"}));
  add("--limit-mm-per-prompt", true, "kvlm serves text-only models");
  add("--kv-cache-memory-bytes", true, "kvlm's flag is --kv-cache-memory (bytes, or sizes like 2GiB)");
  add("--config", true, "kvlm takes its flags on the command line only");
  add("--hf-overrides", true, "edit the model's config.json instead");
}

void ServeExtraFlags::check_refused() const {
  for (const auto& r : refused) {
    if (r->opt->count() == 0) continue;
    const std::string name = r->opt->get_name();
    if (r->accept && r->accept(r->value)) {
      if (r->ignored) log::warn(name + " is ignored: " + r->why);
      continue;
    }
    throw Error(name + (r->value.empty() ? "" : " " + r->value) + " is not supported: " + r->why);
  }
}

namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

std::string closest_flag(const CLI::App& cmd, const std::string& arg) {
  std::string want = arg.substr(0, arg.find('='));
  if (want.rfind("--", 0) != 0) return "";
  want = want.substr(2);
  std::string best;
  size_t best_d = std::string::npos;
  for (const CLI::App* app = &cmd; app; app = app->get_parent()) {
    for (const CLI::Option* o : app->get_options()) {
      for (const std::string& name : o->get_lnames()) {
        const size_t d = edit_distance(want, name);
        if (d < best_d) {
          best_d = d;
          best = "--" + name;
        }
      }
    }
  }
  // Close enough to be a typo: a few edits, fewer for short names.
  return best_d <= std::max<size_t>(1, std::min<size_t>(3, want.size() / 4)) ? best : "";
}


CLI::Option* add_output_file(CLI::App& cmd, const std::string& name, std::string& into, const std::string& help) {
  const std::string flag = name.substr(0, name.find(','));
  return cmd.add_option(name, into, help)
      ->check(CLI::Validator(
          [flag](std::string& v) -> std::string {
            if (v.starts_with("-"))
              return "takes the FILE to write (e.g. " + flag + " results.json), not '" + v + "'";  // (CLI11 prefixes the flag)
            return {};
          },
          "FILE"));
}

void check_outputs_spare_inputs(const std::vector<std::pair<std::string, std::string>>& outputs,
                                const std::vector<std::pair<std::string, std::string>>& inputs) {
  namespace fs = std::filesystem;
  auto same = [](const std::string& a, const std::string& b) {
    std::error_code ec;
    if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec);
    return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
  };
  for (const auto& [oname, out] : outputs)
    for (const auto& [iname, in] : inputs)
      if (!out.empty() && !in.empty() && same(out, in))
        throw Error(oname + " " + out + " is the " + iname + " file this command reads; writing it would overwrite "
                    "it: give " + oname + " another path");
  for (size_t i = 0; i < outputs.size(); ++i)
    for (size_t j = i + 1; j < outputs.size(); ++j)
      if (!outputs[i].second.empty() && !outputs[j].second.empty() && same(outputs[i].second, outputs[j].second))
        throw Error(outputs[i].first + " and " + outputs[j].first + " name one file (" + outputs[i].second +
                    "): give them different paths");
}

}  // namespace kvlm::app

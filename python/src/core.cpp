// kvlm._core: the engine, tokenizer and tools for the Python package (python/kvlm). A thin
// layer: the Python side (python/kvlm/__init__.py) holds vLLM's API — LLM, SamplingParams,
// RequestOutput — and drives this module's Engine step by step, so that Ctrl-C and progress
// bars live in Python while each step runs here with the GIL released.
//
// Engine: a model loaded as the CLI loads it (LoadedModel, the memory plan, LLMEngine with
// continuous batching and prefix caching), requests added with their token ids and sampling
// settings, text produced by the server's RequestStream (incremental detokenization, stop
// strings and stop tokens, exactly as `kvlm serve` does), events polled after each step.
// Options and sampling settings cross as JSON text, checked here with the CLI's messages;
// every kvlm::Error becomes kvlm.Error, a ValueError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention/backend.h"
#include "kv/cache_config.h"
#include "config/speculative_config.h"
#include "config/weight_quant.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/engine_args.h"
#include "engine/llm_engine.h"
#include "engine/memory_plan.h"
#include "io/checkpoint.h"
#include "model/loaded_model.h"
#include "model/tensor_parallel.h"
#include "offline/embed.h"
#include "offline/eval.h"
#include "server/request_stream.h"
#include "text/text_processor.h"

namespace py = pybind11;
using nlohmann::json;

namespace kvlm::python {

namespace {

template <class T>
T get_or(const json& j, const char* key, T fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const json::exception&) {
    throw Error(std::string("invalid value for ") + key + ": " + j[key].dump());
  }
}

// LLM(...)'s keywords (vLLM's names) into the engine's arguments; defaults and checks are
// engine/engine_args.h's, the same as the command line's.
ModelArgs model_args(const json& o) {
  ModelArgs a;
  a.kv_cache_dtype = get_or(o, "kv_cache_dtype", a.kv_cache_dtype);
  a.cache_type_k = get_or(o, "cache_type_k", a.cache_type_k);
  a.cache_type_v = get_or(o, "cache_type_v", a.cache_type_v);
  a.kv_cache_dtype_skip_layers = get_or(o, "kv_cache_dtype_skip_layers", a.kv_cache_dtype_skip_layers);
  a.kv_cache_rotation = get_or(o, "kv_cache_rotation", a.kv_cache_rotation);
  a.kv_cache_plan = get_or(o, "kv_cache_plan", a.kv_cache_plan);
  a.kv_cache_keep_sink = get_or(o, "kv_cache_keep_sink", a.kv_cache_keep_sink);
  a.kv_cache_keep_recent = get_or(o, "kv_cache_keep_recent", a.kv_cache_keep_recent);
  a.block_size = get_or(o, "block_size", a.block_size);
  a.attention_backend = get_or(o, "attention_backend", a.attention_backend);
  a.device = get_or(o, "device", a.device);
  a.dtype = get_or(o, "dtype", a.dtype);
  a.enforce_eager = get_or(o, "enforce_eager", a.enforce_eager);
  a.dequantize_weights = get_or(o, "dequantize_weights", a.dequantize_weights);
  a.quantization = get_or(o, "quantization", a.quantization);
  a.tensor_parallel_size = get_or(o, "tensor_parallel_size", a.tensor_parallel_size);
  a.enable_expert_parallel = get_or(o, "enable_expert_parallel", a.enable_expert_parallel);
  a.runner = get_or(o, "runner", a.runner);
  a.mamba_ssm_cache_dtype = get_or(o, "mamba_ssm_cache_dtype", a.mamba_ssm_cache_dtype);
  if (o.contains("speculative_config") && !o["speculative_config"].is_null()) a.speculative_config = o["speculative_config"].dump();
  return a;
}

ServingArgs serving_args(const json& o) {
  ServingArgs a;
  if (o.contains("kv_cache_memory") && !o["kv_cache_memory"].is_null())
    a.kv_cache_memory = o["kv_cache_memory"].is_string() ? o["kv_cache_memory"].get<std::string>()
                                                         : std::to_string(o["kv_cache_memory"].get<uint64_t>());
  a.gpu_memory_utilization = get_or(o, "gpu_memory_utilization", a.gpu_memory_utilization);
  a.max_model_len = get_or(o, "max_model_len", a.max_model_len);
  a.max_num_seqs = get_or(o, "max_num_seqs", a.max_num_seqs);
  a.max_num_batched_tokens = get_or(o, "max_num_batched_tokens", a.max_num_batched_tokens);
  a.enable_prefix_caching = get_or(o, "enable_prefix_caching", a.enable_prefix_caching);
  a.scheduling_policy = get_or(o, "scheduling_policy", a.scheduling_policy);
  a.kv_offload_gib = get_or(o, "kv_offload_gib", a.kv_offload_gib);
  a.kv_offload_dir = get_or(o, "kv_offload_dir", a.kv_offload_dir);
  a.kv_offload_disk_gib = get_or(o, "kv_offload_disk_gib", a.kv_offload_disk_gib);
  return a;
}

ModelOptions model_options(const json& o) {
  const std::string model = get_or<std::string>(o, "model", "");
  if (model.empty()) throw Error("model: give a Hugging Face model directory (or a GGUF file's directory)");
  std::error_code ec;
  if (!std::filesystem::exists(model, ec))
    throw Error("model '" + model + "' does not exist; give a local model directory (kvlm does not download from the Hub)");
  return model_args(o).model_options(model, ArgStyle::Keyword);
}

json logprobs_json(const TokenLogprobs& l) {
  json top = json::array();
  for (const auto& [t, lp] : l.top) top.push_back({t, lp});
  return {{"token", l.token}, {"logprob", l.logprob}, {"top", top}};
}

}  // namespace

class Engine {
 public:
  explicit Engine(const std::string& options_json) {
    const json o = json::parse(options_json);
    const ModelOptions mo = model_options(o);
    model_ = LoadedModel::load(mo);
    const std::string tok = get_or<std::string>(o, "tokenizer", "");
    tokenizer_dir_ = tok.empty() ? mo.model_dir.string() : tok;
    text_ = TextProcessor::load_if_usable(tokenizer_dir_);
    const ServingArgs serving = serving_args(o);
    const MemoryOptions mem = serving.memory_options(ArgStyle::Keyword);
    plan_ = plan_kv_memory(*model_, mem);
    const SchedulerConfig sc = serving.scheduler_config(plan_);
    sched_ = sc;
    engine_ = std::make_unique<LLMEngine>(*model_, sc);
    eos_ = model_->config().eos_token_ids;
    if (text_)
      if (auto e = text_->eos_id(); e && std::ranges::find(eos_, *e) == eos_.end()) eos_.push_back(*e);
  }

  // Queues request `id` (n choices of `prompt`); sampling settings as JSON (SamplingParams).
  void add(const std::string& id, const std::vector<TokenId>& prompt, const std::string& params_json) {
    if (streams_.count(id)) throw Error("request id '" + id + "' is already in use");
    const json p = json::parse(params_json);
    SamplingParams sp;
    sp.temperature = get_or<float>(p, "temperature", 1.0f);
    sp.top_k = get_or<int>(p, "top_k", 0);
    if (sp.top_k < 0) sp.top_k = 0;  // vLLM's -1: off
    sp.top_p = get_or<float>(p, "top_p", 1.0f);
    sp.min_p = get_or<float>(p, "min_p", 0.0f);
    sp.repetition_penalty = get_or<float>(p, "repetition_penalty", 1.0f);
    sp.presence_penalty = get_or<float>(p, "presence_penalty", 0.0f);
    sp.frequency_penalty = get_or<float>(p, "frequency_penalty", 0.0f);
    validate_sampling(sp);
    const int n = get_or<int>(p, "n", 1);
    if (n < 1) throw Error("n must be at least 1, got " + std::to_string(n));
    const int max_tokens = get_or<int>(p, "max_tokens", 16);
    if (max_tokens < 1) throw Error("max_tokens must be at least 1, got " + std::to_string(max_tokens));
    const bool ignore_eos = get_or<bool>(p, "ignore_eos", false);
    server::TextOptions to;
    to.stop = get_or<std::vector<std::string>>(p, "stop", {});
    to.stop_token_ids = get_or<std::vector<TokenId>>(p, "stop_token_ids", {});
    if (!ignore_eos) to.eos_token_ids = eos_;
    to.include_stop_str_in_output = get_or<bool>(p, "include_stop_str_in_output", false);
    to.skip_special_tokens = get_or<bool>(p, "skip_special_tokens", true);
    if (!to.stop.empty() && !text_) throw Error("stop strings need the model's tokenizer, and it has none");
    std::vector<TokenId> stops = to.stop_token_ids;
    if (!ignore_eos)
      for (TokenId t : eos_)
        if (std::ranges::find(stops, t) == stops.end()) stops.push_back(t);
    const auto seed = p.contains("seed") && !p["seed"].is_null() ? std::optional<uint64_t>(p["seed"].get<uint64_t>())
                                                                  : std::nullopt;
    const int logprobs = get_or<int>(p, "logprobs", -1);
    auto stream = std::make_shared<server::RequestStream>(text_ ? &text_->tokenizer() : nullptr, to, n);
    std::vector<EngineRequest> reqs;
    for (int i = 0; i < n; ++i) {
      EngineRequest er;
      er.id = id + "#" + std::to_string(i);
      er.prompt = prompt;
      er.sampling = sp;
      er.seed = seed ? *seed + uint64_t(i) : next_seed();
      er.max_tokens = max_tokens;
      er.min_tokens = get_or<int>(p, "min_tokens", 0);
      er.ignore_eos = ignore_eos;
      er.logprobs = logprobs >= 0 ? std::max(logprobs, 1) : 0;
      er.stop_token_ids = stops;
      er.on_output = [stream, i](const RequestOutput& out) { return stream->on_output(i, out); };
      eng().check_request(er);
      reqs.push_back(std::move(er));
    }
    for (auto& r : reqs) eng().add_request(std::move(r));
    streams_[id] = Live{stream, n};
  }

  // One scheduler step (GIL released by the binding); false when there was nothing to do.
  bool step() { return eng().step(); }
  bool has_work() const { return eng().has_work(); }

  // The events of request `id` since the last poll, as JSON: [{choice, text, tokens,
  // logprobs, finished, finish_reason, stop_reason, error, prompt_tokens, completion_tokens,
  // cached_tokens}]. A request whose choices have all finished is forgotten afterwards.
  std::string poll(const std::string& id) {
    auto it = streams_.find(id);
    if (it == streams_.end()) return "[]";
    std::vector<server::ChoiceEvent> evs;
    it->second.stream->wait(evs, std::chrono::milliseconds(0));
    json out = json::array();
    for (const auto& e : evs) {
      json lp = json::array();
      for (const auto& l : e.logprobs) lp.push_back(logprobs_json(l));
      json stop = nullptr;
      if (e.stop_string) stop = *e.stop_string;
      else if (e.stop_token) stop = *e.stop_token;
      out.push_back({{"choice", e.choice},
                     {"text", e.text},
                     {"tokens", e.tokens},
                     {"logprobs", lp},
                     {"finished", e.finished},
                     {"finish_reason", std::string(finish_reason_name(e.reason))},
                     {"stop_reason", stop},
                     {"error", e.error},
                     {"prompt_tokens", e.prompt_tokens},
                     {"completion_tokens", e.completion_tokens},
                     {"cached_tokens", e.cached_tokens}});
    }
    if (it->second.stream->done()) streams_.erase(it);
    return out.dump();
  }

  void abort(const std::string& id) {
    auto it = streams_.find(id);
    if (it == streams_.end()) return;
    for (int i = 0; i < it->second.n; ++i) eng().abort(id + "#" + std::to_string(i));
  }

  bool has_tokenizer() const { return text_.has_value(); }
  const std::string& tokenizer_dir() const { return tokenizer_dir_; }

  std::string info() const {
    const ModelConfig& c = model_->config();
    return json{{"architecture", std::string(arch_name(c.arch))},
                {"vocab_size", c.vocab_size},
                {"max_model_len", plan_.max_model_len},
                {"kv_bytes_per_token", model_->plan().bytes_per_token()},
                {"kv_cache_tokens", plan_.capacity_tokens},
                {"num_blocks", plan_.num_blocks},
                {"eos_token_ids", eos_},
                {"device", std::string(device_name(model_->model().device()))},
                {"tensor_parallel_size", model_->tensor_parallel_size()},
                {"default_temperature", c.default_temperature ? json(*c.default_temperature) : json(nullptr)},
                {"default_top_p", c.default_top_p ? json(*c.default_top_p) : json(nullptr)},
                {"default_top_k", c.default_top_k ? json(*c.default_top_k) : json(nullptr)},
                {"summary", plan_.summary},
                {"pooling", model_->pooling() ? json{{"type", std::string(pooling_type_name(model_->pooling()->type))},
                                                     {"normalize", model_->pooling()->normalize},
                                                     {"matryoshka", model_->pooling()->matryoshka},
                                                     {"hidden_size", c.hidden_size}}
                                              : json(nullptr)}}
        .dump();
  }

  // Embeddings of `prompts` (token ids) through this LLM's engine, as LLM.embed(); normalize:
  // -1 the model's pooling configuration, 0 no, 1 yes.
  std::vector<std::vector<float>> embed(const std::vector<std::vector<TokenId>>& prompts, int dimensions, int normalize) {
    if (!streams_.empty()) throw Error("embed() needs the LLM idle; finish or abort its requests first");
    return embed_prompts(eng(), *model_, prompts, dimensions,
                         normalize < 0 ? std::nullopt : std::optional<bool>(normalize > 0));
  }

  // Perplexity (and KL divergence against a saved run) of `tokens`, as `kvlm eval perplexity`.
  std::string perplexity(const std::vector<TokenId>& tokens, int ctx, int max_chunks, const std::string& save,
                         const std::string& base) {
    if (!streams_.empty() || eng().has_work())
      throw Error("perplexity() needs the LLM idle; finish or abort its requests first");
    PerplexityOptions po{.ctx = ctx, .max_chunks = max_chunks};
    if (!save.empty()) po.save_logits = save;
    if (!base.empty()) po.kld_base = base;
    // The scoring runs its own engine over the model, which sizes the KV pool for its windows:
    // this LLM's engine (and its pool) is rebuilt afterwards, also when the scoring fails.
    engine_.reset();
    PerplexityResult r;
    try {
      r = eval_perplexity(*model_, tokens, po);
    } catch (...) {
      engine_ = std::make_unique<LLMEngine>(*model_, sched_);
      throw;
    }
    engine_ = std::make_unique<LLMEngine>(*model_, sched_);
    json j{{"chunks", r.chunks}, {"scored_tokens", r.scored_tokens}, {"ppl", r.ppl}, {"ppl_err", r.ppl_err},
           {"kv_bytes_per_token", model_->plan().bytes_per_token()}};
    if (r.has_base)
      j.update({{"base_ppl", r.base_ppl}, {"delta_ppl", r.delta_ppl}, {"delta_ppl_ci95", r.delta_ppl_ci95},
                {"kld_mean", r.kld_mean}, {"kld_mean_err", r.kld_mean_err}, {"kld_median", r.kld_median},
                {"kld_p99", r.kld_p99}, {"kld_max", r.kld_max}, {"same_top", r.same_top}});
    return j.dump();
  }

 private:
  struct Live {
    std::shared_ptr<server::RequestStream> stream;
    int n = 1;
  };
  uint64_t next_seed() { return seed_rng_(); }
  LLMEngine& eng() const {
    if (!engine_) throw Error("this LLM's engine could not be rebuilt after perplexity(); create a new LLM");
    return *engine_;
  }

  std::unique_ptr<LoadedModel> model_;
  std::optional<TextProcessor> text_;
  std::string tokenizer_dir_;
  MemoryPlan plan_;
  SchedulerConfig sched_;
  std::unique_ptr<LLMEngine> engine_;
  std::vector<TokenId> eos_;
  std::unordered_map<std::string, Live> streams_;
  std::mt19937_64 seed_rng_{std::random_device{}()};
};

// The tokenizer alone (its own copy: holding it does not keep an engine and its KV pool alive).
class PyTokenizer {
 public:
  explicit PyTokenizer(const std::string& dir) : text_(TextProcessor::load(dir)) {}
  std::vector<TokenId> encode(const std::string& s, bool add_special_tokens) const {
    return add_special_tokens ? text_.encode_prompt(s)
                              : text_.tokenizer().encode(s, EncodeOptions{.add_special_tokens = false});
  }
  std::string decode(const std::vector<TokenId>& ids, bool skip_special_tokens) const {
    return text_.tokenizer().decode(ids, skip_special_tokens, /*skip_unknown=*/true);
  }
  std::string render_chat(const std::string& messages_json, bool add_generation_prompt, const std::string& extra_json) const {
    const auto messages = nlohmann::ordered_json::parse(messages_json);
    const auto extra = nlohmann::ordered_json::parse(extra_json);
    if (!messages.is_array()) throw Error("messages must be a list of {\"role\": ..., \"content\": ...} dicts");
    return text_.render_chat(messages, add_generation_prompt, extra);
  }

 private:
  TextProcessor text_;
};

// `kvlm inspect --json`'s per-layer plan, without loading weights.
std::string inspect(const std::string& options_json) {
  const json o = json::parse(options_json);
  const ModelOptions mo = model_options(o);
  const Checkpoint ckpt = Checkpoint::open(mo.model_dir);
  ModelPlan mp = plan_model(mo.model_dir, ckpt, mo.cache, selection_context(mo.device, mo.gpu, mo.cache), mo.dtype,
                            mo.speculative ? &*mo.speculative : nullptr, mo.quantization);
  apply_expert_parallel(mp.config, mo.expert_parallel);
  const int tp = mo.tensor_parallel_size;
  tp_layout(mp.config, tp);
  json layers = json::array();
  const KVPlan rank0 = shard_kv_plan(mp.plan, {0, tp});
  for (size_t i = 0; i < mp.plan.layers.size(); ++i) {
    json l = kv_layer_json(mp.plan.layers[i]);
    l["bytes_per_token_per_rank"] = rank0.layers[i].bytes_per_token();  // tensor parallelism: one GPU's share
    layers.push_back(std::move(l));
  }
  return layers.dump();
}

}  // namespace kvlm::python

PYBIND11_MODULE(_core, m) {
  using namespace kvlm;
  using kvlm::python::Engine;
  m.doc() = "kvlm's C++ engine (use the kvlm package: LLM, SamplingParams, inspect)";
  // kvlm::Error (a bad argument, file or request, with the CLI's message): kvlm.Error, a ValueError.
  py::register_exception<Error>(m, "Error", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const nlohmann::json::exception& e) {
      PyErr_SetString(PyExc_ValueError, (std::string("malformed options: ") + e.what()).c_str());
    }
  });
  m.def("set_log_level", [](const std::string& l) {
    log::set_level(l == "quiet" ? log::Level::Quiet : l == "info" ? log::Level::Info : l == "debug" ? log::Level::Debug
                                                                                                   : log::Level::Warn);
  });
  m.def("inspect", &kvlm::python::inspect, py::arg("options_json"));
  using kvlm::python::PyTokenizer;
  py::class_<PyTokenizer>(m, "Tokenizer")
      .def(py::init<const std::string&>(), py::arg("dir"))
      .def("encode", &PyTokenizer::encode, py::arg("text"), py::arg("add_special_tokens") = true)
      .def("decode", &PyTokenizer::decode, py::arg("ids"), py::arg("skip_special_tokens") = true)
      .def("render_chat", &PyTokenizer::render_chat);
  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&>(), py::arg("options_json"), py::call_guard<py::gil_scoped_release>())
      .def("add", &Engine::add, py::arg("id"), py::arg("prompt"), py::arg("params_json"))
      .def("step", &Engine::step, py::call_guard<py::gil_scoped_release>())
      .def("has_work", &Engine::has_work)
      .def("poll", &Engine::poll)
      .def("abort", &Engine::abort)
      .def("has_tokenizer", &Engine::has_tokenizer)
      .def("tokenizer_dir", &Engine::tokenizer_dir)
      .def("info", &Engine::info)
      .def("perplexity", &Engine::perplexity, py::call_guard<py::gil_scoped_release>())
      .def("embed", &Engine::embed, py::call_guard<py::gil_scoped_release>());
}

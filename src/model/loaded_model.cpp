#include "model/loaded_model.h"

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "attention/registry.h"
#include "attention/selector.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "model/cuda/nccl_communicator.h"
#include "model/tensor_parallel.h"
#include "model/tp_runner.h"
#ifdef KVLM_WITH_CUDA
#include "model/cuda/cuda_runner.h"
#endif

namespace kvlm {

DeviceChoice resolve_device(std::string_view flag) {
  const auto gpus = cuda_devices();
  if (flag == "cpu") return {};
  if (flag == "auto") {
    // The first GPU when a CUDA backend has code for it: at or above its minimum compute
    // capability and, where it declares tiers, inside one (a build for sm_90a only has
    // nothing a 10.0 GPU can run).
    if (gpus.empty()) return {};
    const int cc = gpus.front().compute_capability;
    for (const auto& b : builtin_backend_caps())
      if (b.device == Device::Cuda && cc >= b.min_compute_capability &&
          (b.compute_tiers.empty() || find_compute_tier(b, cc) != nullptr))
        return {Device::Cuda, 0};
    return {};
  }
  int index = 0;
  if (flag.starts_with("cuda:")) {
    const std::string_view n = flag.substr(5);
    const auto [p, ec] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (n.empty() || ec != std::errc() || p != n.data() + n.size() || index < 0)
      throw Error("invalid --device '" + std::string(flag) + "'; a GPU is named cuda:N with N its index (0, 1, ...)");
  } else if (flag != "cuda") {
    throw Error("invalid --device '" + std::string(flag) + "'; valid values are: auto, cpu, cuda, cuda:N");
  }
  const std::string name = "--device " + std::string(flag);
  if (!built_with_cuda()) throw Error(name + ": this kvlm was built without CUDA (KVLM_CUDA=OFF); use --device cpu");
  if (gpus.empty())
    throw Error(name + ": no usable CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES); use --device cpu");
  if (index >= int(gpus.size()))
    throw Error(name + ": " + std::to_string(gpus.size()) + " CUDA device(s) are visible (cuda:0 to cuda:" +
                std::to_string(gpus.size() - 1) + ")");
  return {Device::Cuda, index};
}

std::optional<DType> parse_model_dtype(std::string_view s) {
  if (s == "auto") return std::nullopt;
  if (s == "float32") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  if (s == "float16") return DType::F16;
  throw Error("invalid --dtype '" + std::string(s) + "'; valid values are: auto, float32, bfloat16, float16");
}

namespace {

// Opens the DFlash drafter of `spec`, checks it against the target of `mp`, and adds its
// layers to the plan.
void add_drafter(ModelPlan& mp, const SpeculativeConfig& spec, const CacheConfig& cache) {
  // Hybrid models (Qwen3.5, Qwen3-Next) draft with n-grams, their recurrent state rolled back
  // after a rejected draft (engine/scheduler.h); DFlash's drafter is not built for them.
  if (mp.config.linear_attention)
    throw Error(std::string(arch_name(mp.config.arch)) + ": DFlash drafting is not supported on models with Gated "
                "DeltaNet layers; use {\"method\": \"ngram\", ...} in --speculative-config, or drop it");
  const std::filesystem::path dir = spec.model;
  const std::string where = "--speculative-config model '" + spec.model + "'";
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw Error(where + " is not a directory; give the DFlash drafter's model directory");
  ModelConfig d = load_model_config(dir);
  if (!d.dflash)
    throw Error(where + " is a " + std::string(arch_name(d.arch)) +
                ", not a DFlash drafter (config.json architectures [\"DFlashDraftModel\"])");
  const ModelConfig& t = mp.config;
  if (!t.arch->dflash_target) {
    std::string targets;
    for (const ArchSpec* a : architectures())
      if (a->dflash_target) targets += (targets.empty() ? "" : ", ") + std::string(a->name);
    throw Error(where + ": DFlash drafting reads target layer outputs kvlm forms for " + targets + ", not " +
                std::string(arch_name(t.arch)));
  }
  if (d.hidden_size != t.hidden_size)
    throw Error(where + ": the drafter's hidden_size " + std::to_string(d.hidden_size) + " differs from the target's " +
                std::to_string(t.hidden_size) + "; it was trained for another model");
  if (d.vocab_size != t.vocab_size)
    throw Error(where + ": the drafter's vocab_size " + std::to_string(d.vocab_size) + " differs from the target's " +
                std::to_string(t.vocab_size) + "; it was trained for another model");
  const DFlashConfig& f = *d.dflash;
  if (f.num_target_layers > 0 && f.num_target_layers != t.num_layers)
    throw Error(where + ": the drafter was trained on a " + std::to_string(f.num_target_layers) +
                "-layer target (num_target_layers); this target has " + std::to_string(t.num_layers));
  for (int l : f.target_layer_ids)
    if (l > t.num_layers - 2)
      throw Error(where + ": dflash_config.target_layer_ids holds layer " + std::to_string(l) + "; this target's layers " +
                  "whose outputs kvlm can read are 0.." + std::to_string(t.num_layers - 2) +
                  (l < t.num_layers ? " (the last layer's output is only formed normed, at the LM head)" : ""));
  if (spec.num_speculative_tokens > f.block_size - 1)
    throw Error(where + ": num_speculative_tokens " + std::to_string(spec.num_speculative_tokens) +
                " exceeds what one block of " + std::to_string(f.block_size) + " proposes (block_size - 1 = " +
                std::to_string(f.block_size - 1) + ")");
  const Checkpoint dckpt = Checkpoint::open(dir);
  std::string prefix;
  if (dckpt.find("fc.weight")) prefix = "";
  else if (dckpt.find("model.fc.weight")) prefix = "model.";
  else throw Error(where + ": the checkpoint has no fc.weight (the drafter's feature projection); is it a DFlash drafter?");
  CacheConfig dc = cache;
  if (spec.kv_cache_dtype) {
    dc.set_kv_dtypes({*spec.kv_cache_dtype, std::nullopt});  // the drafter's own dtype, for K and V
    dc.skip_layers = {};
  } else {
    dc.skip_layers.indices.clear();  // indices name target layers
  }
  const auto layers = attention_layers(d, "draft");
  KVPlan dp = build_kv_plan(dc, layers, mp.dtype, d.kv_scheme,
                            [&](const AttentionLayerDesc& l) { return find_kv_scales(dckpt, l); });
  for (auto& l : dp.layers) mp.plan.layers.push_back(std::move(l));
  for (auto& w : dp.warnings) mp.plan.warnings.push_back("draft: " + w);
  mp.drafter = std::move(d);
  mp.drafter_dir = dir;
  mp.drafter_prefix = prefix;
}

}  // namespace

// The target's k/v scale tensors as plan_model recorded them (ModelPlan::kv_scales).
static ScaleLookup recorded_scales(const ModelPlan& mp) {
  return [&mp](const AttentionLayerDesc& l) -> std::optional<CheckpointScales> {
    for (const auto& r : mp.kv_scales)
      if (r.layer == l.layer) {
        if (!r.error.empty()) throw Error(r.error);
        return r.scales;
      }
    return std::nullopt;
  };
}

ModelPlan plan_model(const std::filesystem::path& dir, const Checkpoint& ckpt, const CacheConfig& cache,
                     const SelectionContext& ctx, std::optional<DType> dtype, const SpeculativeConfig* spec,
                     std::string_view quantization) {
  ModelPlan mp;
  mp.config = ckpt.model_config(dir);
  mp.config.weight_quant = resolve_weight_quant(mp.config.weight_quant, quantization);
  if (auto& la = mp.config.linear_attention) la->state_dtype = cache.linear_state_dtype;  // --mamba-ssm-cache-dtype
  mp.dtype = dtype ? *dtype : model_dtype(mp.config, ckpt);
  // The CUDA runner computes in bfloat16 or float16: a float32 checkpoint is converted to
  // bfloat16 (and says so); an explicit --dtype float32 cannot be honoured there.
  bool converted = false;
  if (ctx.device == Device::Cuda && mp.dtype == DType::F32) {
    if (dtype)
      throw Error("--dtype float32 is not supported with --device cuda: the CUDA runner computes in bfloat16 or "
                  "float16 (fp32 accumulation); use --dtype bfloat16 or float16, or --device cpu for float32");
    mp.dtype = DType::BF16;
    converted = true;
  }
  const auto layers = attention_layers(mp.config);
  // Each layer's scales, or why they cannot be read: an error only matters (and is thrown,
  // as before) for a layer whose plan asks for per-tensor scales.
  for (const auto& l : layers) {
    try {
      mp.kv_scales.push_back({l.layer, find_kv_scales(ckpt, l), {}});
    } catch (const Error& e) {
      mp.kv_scales.push_back({l.layer, std::nullopt, e.what()});
    }
  }
  mp.plan = build_kv_plan(cache, layers, mp.dtype, mp.config.kv_scheme, recorded_scales(mp));
  if (spec && spec->method == SpecMethod::DFlash) add_drafter(mp, *spec, cache);
  if (const auto& f = cache.plan_file) {
    for (const auto& e : f->entries)
      if (std::ranges::none_of(mp.plan.layers, [&](const KVLayerSpec& l) { return l.attn.model == e.model; }))
        throw Error("KV plan file " + f->source + " names " + e.where() + ", but " +
                    (e.model == "draft" ? std::string("no DFlash drafter is loaded (--speculative-config)")
                                        : "kvlm loads no model named '" + e.model + "' (the models are target and draft)"));
    if (f->architecture && *f->architecture != arch_name(mp.config.arch))
      mp.plan.warnings.push_back("KV plan file " + f->source + " was written for " + *f->architecture + "; this model is " +
                                 std::string(arch_name(mp.config.arch)) + " (its layers are applied by index)");
  }
  if (converted)
    mp.plan.warnings.push_back("the checkpoint is float32; on CUDA kvlm computes in bfloat16 (weights converted at load). "
                               "Pass --dtype float16 for float16, or --device cpu to compute in float32");
  assign_backends(mp.plan, builtin_backend_caps(), ctx);
  return mp;
}

SelectionContext selection_context(Device device, int gpu, const CacheConfig& cache) {
  SelectionContext c{.device = device, .compute_capability = 0, .forced = cache.attention_backend};
  if (device == Device::Cuda) {
    const auto gpus = cuda_devices();
    if (gpu < 0 || gpu >= int(gpus.size()))
      throw Error("CUDA device " + std::to_string(gpu) + " is not visible (" + std::to_string(gpus.size()) + " are)");
    c.compute_capability = gpus[size_t(gpu)].compute_capability;
  }
  return c;
}

void apply_expert_parallel(ModelConfig& config, bool enabled) {
  if (!enabled) return;
  if (!config.moe)
    throw Error("--enable-expert-parallel: " + std::string(arch_name(config.arch)) +
                " is not a mixture of experts (it has no experts to split); drop the flag");
  config.moe->expert_parallel = true;
}

void check_tensor_parallel(const ModelOptions& opts, const ModelConfig& config) {
  const int n = opts.tensor_parallel_size;
  const std::string flag = "--tensor-parallel-size " + std::to_string(n);
  if (n < 1) throw Error("--tensor-parallel-size must be at least 1, got " + std::to_string(n));
  const int nodes = opts.dist.nnodes;
  if (nodes > 1 && n % nodes != 0)
    throw Error(flag + " over --nnodes " + std::to_string(nodes) + ": every node drives the same number of ranks, so "
                "the size must be a multiple of the nodes");
  if (n == 1) return;
  if (opts.speculative && opts.speculative->method == SpecMethod::DFlash)
    throw Error(flag + ": DFlash drafting runs on one GPU for now; use --tensor-parallel-size 1 with it, or n-gram "
                "speculation (--speculative-config '{\"method\": \"ngram\", ...}'), which works with every size");
  tp_layout(config, n);  // throws with the sizes that work
  const int local = n / nodes;
  if (opts.device == Device::Cuda) {
    const int visible = int(cuda_devices().size());
    if (opts.gpu + local > visible)
      throw Error(flag + (nodes > 1 ? " over " + std::to_string(nodes) + " nodes" : std::string()) + " needs GPUs " +
                  std::to_string(opts.gpu) + ".." + std::to_string(opts.gpu + local - 1) + " on this node, but " +
                  std::to_string(visible) + " CUDA device(s) are visible (check CUDA_VISIBLE_DEVICES); use a size of at "
                  "most " + std::to_string(std::max(visible - opts.gpu, 1) * nodes));
    if (!built_with_nccl())
      throw Error(flag + " on GPUs needs NCCL, and this kvlm was built without it (nccl.h was not found next to the "
                  "CUDA toolkit when it was configured); install NCCL and rebuild, or use --tensor-parallel-size 1");
  } else if (nodes > 1 && local != 1) {
    throw Error(flag + " over --nnodes " + std::to_string(nodes) + " on the CPU: CPU nodes run one rank each "
                "(--tensor-parallel-size equal to --nnodes)");
  }
}

namespace {

// GGUF blocks stay as stored unless --dequantize-weights; --dtype float32 reads them in fp32.
CpuRunnerOptions cpu_options(const ModelOptions& opts) {
  return CpuRunnerOptions{.keep_blocks = !opts.dequantize_weights, .exact_blocks = opts.dtype == DType::F32};
}

// What every node must agree on, compared when a node joins.
std::string fingerprint(const ModelOptions& opts, const ModelPlan& mp, const KVPlan& rank_plan) {
  const ModelConfig& c = mp.config;
  return std::string(arch_name(c.arch)) + " " + std::to_string(c.num_layers) + "x" + std::to_string(c.hidden_size) +
         " vocab " + std::to_string(c.vocab_size) + ", " + std::string(dtype_name(mp.dtype)) + " on " +
         std::string(device_name(opts.device)) + ", --tensor-parallel-size " + std::to_string(opts.tensor_parallel_size) +
         (opts.expert_parallel ? " --enable-expert-parallel" : "") +
         ", KV " + std::to_string(rank_plan.bytes_per_token()) + " B/token per rank, block size " +
         std::to_string(opts.cache.block_size);
}

}  // namespace

void LoadedModel::load_tensor_parallel(const ModelOptions& opts, const Checkpoint& ckpt) {
  const int n = opts.tensor_parallel_size, nodes = opts.dist.nnodes, local = n / nodes;
  const int first = opts.dist.node_rank * local;
  for (int r = 0; r < n; ++r) rank_plans_.push_back(std::make_unique<KVPlan>(shard_kv_plan(plan_->plan, {r, n})));
  std::vector<int> devices;
  for (int i = 0; i < local; ++i) devices.push_back(opts.gpu + i);
  const bool cuda = opts.device == Device::Cuda;
  if (nodes > 1) {
    // Every node connects to node 0 before any weight loads: a mismatch or a missing node
    // fails fast. On GPUs, node 0 hands out NCCL's unique id.
    const std::string fp = fingerprint(opts, *plan_, *rank_plans_.front());
    std::vector<uint8_t> id;
    if (opts.dist.node_rank == 0) {
      if (cuda) id = NcclGroup::unique_id();
      dist_leader_ = std::make_unique<DistLeader>(dist_accept(opts.dist, fp, id));
    } else {
      dist_follower_ = std::make_unique<DistSocket>(dist_connect(opts.dist, fp, id));
    }
    if (cuda) group_ = std::make_unique<NcclGroup>(devices, n, first, id);
    else group_ = std::make_unique<TcpGroup>(dist_leader_.get(), dist_follower_.get(), first, n);
  } else if (cuda) {
    group_ = std::make_unique<NcclGroup>(devices);
  } else {
    group_ = std::make_unique<HostGroup>(n);
  }
  std::vector<Communicator*> comms;
  for (int i = 0; i < local; ++i) comms.push_back(&group_->local(i));
  const ModelPlan& mp = *plan_;
  auto make = [&](int i) -> std::unique_ptr<ModelRunner> {
    const KVPlan& rp = *rank_plans_[size_t(first + i)];
    if (cuda) {
#ifdef KVLM_WITH_CUDA
      return std::make_unique<CudaModelRunner>(
          mp.config, ckpt, rp, mp.dtype,
          CudaRunnerOptions{.device = devices[size_t(i)], .cuda_graphs = !opts.enforce_eager,
                            .keep_blocks = !opts.dequantize_weights, .comm = comms[size_t(i)]});
#endif
    }
    std::vector<const AttentionBackend*> backends;
    for (const auto& l : rp.layers) backends.push_back(&backend_by_name(l.backend));
    return std::make_unique<CpuModelRunner>(mp.config, ckpt, rp, std::move(backends), nullptr, comms[size_t(i)],
                                            cpu_options(opts));
  };
  // A GGUF checkpoint's tensors are dequantized into memory the loader frees as it goes: one
  // rank at a time there.
  auto runner = std::make_unique<TensorParallelRunner>(comms, make, /*parallel_load=*/!ckpt.embedded_config(), first);
  if (dist_leader_) {
    // The follower nodes' failures abort this node's communicators (on GPUs: a watcher thread;
    // CPU sums travel on the same connections and fail by themselves).
    dist_commands_ = std::make_unique<DistCommands>(*dist_leader_, comms, /*watch=*/cuda);
    runner->set_remote(dist_commands_.get());
  }
  model_ = std::move(runner);
  local_ranks_ = local;
  log::info("tensor parallelism: " + std::to_string(n) + (cuda ? " GPUs" : " CPU ranks") +
            (nodes > 1 ? " over " + std::to_string(nodes) + " nodes (this is node " + std::to_string(opts.dist.node_rank) + ")"
                       : std::string()) +
            ", each holding about " + std::to_string((model_->weight_bytes() / size_t(local)) >> 20) +
            " MiB of weights and " + std::to_string(rank_plans_.front()->bytes_per_token()) + " KV bytes per token");
}

int LoadedModel::follow() {
  KVLM_CHECK(dist_follower_ != nullptr, "follow() on a process that is not a follower node");
  std::vector<Communicator*> comms;
  for (int i = 0; i < group_->num_local(); ++i) comms.push_back(&group_->local(i));
  return dist_follow(*dist_follower_, *model_, comms);
}

std::optional<PoolingConfig> resolve_runner(std::string_view runner, const std::filesystem::path& dir) {
  if (runner == "generate") return std::nullopt;
  if (runner == "pooling") return resolve_pooling(dir);
  if (runner == "auto" || runner.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(dir, ec) && std::filesystem::exists(dir / "modules.json", ec)) {
      PoolingConfig pc = resolve_pooling(dir);
      pc.source = "sentence-transformers' modules.json, so --runner auto chose pooling; --runner generate to generate text";
      return pc;
    }
    return std::nullopt;
  }
  throw Error("--runner must be auto, generate or pooling, got '" + std::string(runner) + "'");
}

namespace {
// The weight files of a model (a GGUF file, or a directory's checkpoint and config files) as
// lines of name, size and modification time: a changed file changes them.
std::string weight_files_identity(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& de : fs::directory_iterator(path, ec)) {
      const std::string ext = de.path().extension().string();
      if (de.is_regular_file(ec) && (ext == ".safetensors" || ext == ".gguf" || ext == ".json" || ext == ".bin"))
        files.push_back(de.path());
    }
  } else {
    files.push_back(path);
  }
  std::ranges::sort(files);
  std::string s;
  for (const auto& f : files) {
    const auto size = fs::file_size(f, ec);
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    s += "  " + f.filename().string() + " " + std::to_string(size) + " " + std::to_string(mtime) + "\n";
  }
  return s;
}
}  // namespace

std::string LoadedModel::kv_identity() const {
  std::string s = source_identity_;
  s += "block size " + std::to_string(block_size_) + "\nKV plan:\n";
  for (const auto& l : plan_->plan.layers) {
    nlohmann::json j = kv_layer_json(l);
    j.erase("dtype_source");  // where a format came from does not change its bytes
    j.erase("v_dtype_source");
    s += "  " + j.dump() + "\n";
  }
  s += "page bytes " + std::to_string(model_->kv_page_bytes(block_size_)) + "\n";
  return s;
}

std::unique_ptr<LoadedModel> LoadedModel::load(const ModelOptions& opts) {
  validate_block_size(opts.cache.block_size);

  auto e = std::unique_ptr<LoadedModel>(new LoadedModel());
  e->pooling_ = resolve_runner(opts.runner, opts.model_dir);
  if (e->pooling_ && opts.speculative)
    throw Error("--speculative-config drafts tokens, and an embedding model (--runner pooling) generates none; "
                "drop one of them");
  const Checkpoint ckpt = Checkpoint::open(opts.model_dir);
  const SelectionContext ctx = selection_context(opts.device, opts.gpu, opts.cache);
  const SpeculativeConfig* spec = opts.speculative ? &*opts.speculative : nullptr;
  e->plan_ = std::make_unique<ModelPlan>(plan_model(opts.model_dir, ckpt, opts.cache, ctx, opts.dtype, spec,
                                                    opts.quantization));
  apply_expert_parallel(e->plan_->config, opts.expert_parallel);
  if (!e->plan_->config.tie_word_embeddings && !ckpt.find("lm_head.weight")) {
    // Embedding checkpoints (Qwen3-Embedding-4B/8B) say untied and ship no LM head: a pooling
    // runner never applies it, so the embedding stands in for it (no memory of its own).
    if (e->pooling_) e->plan_->config.tie_word_embeddings = true;
    else if (ckpt.bare_base_model())
      throw Error("the checkpoint is a bare base model with no LM head (tensors without the 'model.' prefix, as "
                  "embedding models ship); it cannot generate text: serve it with --runner pooling for /v1/embeddings");
  }
  const ModelPlan& mp = *e->plan_;
  check_tensor_parallel(opts, mp.config);
  std::optional<Checkpoint> dckpt;
  std::optional<DrafterSource> drafter;
  if (mp.drafter) {
    dckpt.emplace(Checkpoint::open(mp.drafter_dir));
    drafter = DrafterSource{.config = *mp.drafter, .checkpoint = &*dckpt, .prefix = mp.drafter_prefix};
  }
  for (const auto& w : e->plan_->plan.warnings) log::warn(w);
  if (opts.tensor_parallel_size != 1 || opts.dist.enabled()) {
    e->load_tensor_parallel(opts, ckpt);
  } else if (opts.device == Device::Cuda) {
#ifdef KVLM_WITH_CUDA
    auto gpu = std::make_unique<CudaModelRunner>(e->plan_->config, ckpt, e->plan_->plan, e->plan_->dtype,
                                                 CudaRunnerOptions{.device = opts.gpu, .cuda_graphs = !opts.enforce_eager,
                                                                   .keep_blocks = !opts.dequantize_weights},
                                                 drafter ? &*drafter : nullptr);
    if (ckpt.gguf_file() || ckpt.int4_scheme())
      log::info("weights: " + std::to_string(gpu->weight_bytes() >> 20) + " MiB on the GPU; " +
                std::to_string(gpu->block_tensors()) + (ckpt.gguf_file() ? " GGUF" : " 4-bit") +
                " tensors kept quantized (grouped codes)" +
                (opts.dequantize_weights ? " (--dequantize-weights)" : "") + ", the rest " +
                std::string(dtype_name(e->plan_->dtype)) +
                (gpu->block_tensors() > 0 ? ". Kept codes decode faster than a 16-bit copy up to ~16 sequences at "
                                            "a time (1-4 with int8 activations on DP4A, as llama.cpp's); with "
                                            "more, --dequantize-weights is faster"
                                          : ""));
    e->model_ = std::move(gpu);
#else
    throw Error("--device cuda: this kvlm was built without CUDA (KVLM_CUDA=OFF); use --device cpu");
#endif
  } else {
    std::vector<const AttentionBackend*> backends;
    for (const auto& l : e->plan_->plan.layers) backends.push_back(&backend_by_name(l.backend));
    auto cpu = std::make_unique<CpuModelRunner>(e->plan_->config, ckpt, e->plan_->plan, std::move(backends),
                                                drafter ? &*drafter : nullptr, nullptr, cpu_options(opts));
    if (ckpt.gguf_file())
      log::info("weights: " + std::to_string(cpu->weight_bytes() >> 20) + " MiB; " +
                std::to_string(cpu->block_tensors()) + " GGUF tensors kept in their quantization blocks" +
                (opts.dequantize_weights ? " (--dequantize-weights)" : "") + ", the rest float32");
    e->model_ = std::move(cpu);
  }
  if (e->pooling_) e->model_->set_pooling(true);
  e->block_size_ = opts.cache.block_size;
  e->gpu_ = opts.gpu;
  e->tp_ = opts.tensor_parallel_size;
  e->speculative_ = opts.speculative;
  // kv_identity: what the pages' bytes depend on besides the plan.
  std::string id = "kvlm KV pages, layout " + std::to_string(KVCache::kPageLayoutVersion) + "\nmodel " + opts.model_dir.filename().string() + ":\n" +
                   weight_files_identity(opts.model_dir);
  if (mp.drafter) id += "drafter:\n" + weight_files_identity(mp.drafter_dir);
  id += "dtype " + std::string(dtype_name(mp.dtype)) + ", quantization '" + opts.quantization + "'" +
        (opts.dequantize_weights ? ", dequantized weights" : "") + "\n";
  id += opts.device == Device::Cuda ? "device cuda, compute capability " + std::to_string(ctx.compute_capability)
                                    : std::string("device cpu");
  id += ", tensor parallel " + std::to_string(opts.tensor_parallel_size) + (opts.expert_parallel ? " (experts)" : "") +
        ", nodes " + std::to_string(opts.dist.enabled() ? opts.dist.nnodes : 1) + "\n";
  e->source_identity_ = std::move(id);
  return e;
}

void LoadedModel::replan_kv(const CacheConfig& cache) {
  if (tp_ != 1 || plan_->drafter)
    throw Error("the KV plan of a loaded model can change with one rank and no drafter only");
  KVPlan p = build_kv_plan(cache, attention_layers(plan_->config), plan_->dtype, plan_->config.kv_scheme,
                           recorded_scales(*plan_));
  assign_backends(p, builtin_backend_caps(), selection_context(model_->device(), gpu_, cache));
  KVLM_CHECK(p.layers.size() == plan_->plan.layers.size(), "a new KV plan with another number of layers");
  for (size_t i = 0; i < p.layers.size(); ++i)
    if (p.layers[i].backend != plan_->plan.layers[i].backend)  // the runner holds a backend per layer
      throw Error(describe_layer(p.layers[i]) + " would need attention backend '" + p.layers[i].backend +
                  "', but the model was loaded with '" + plan_->plan.layers[i].backend + "'");
  plan_->plan = std::move(p);  // the runner reads the plan through this object
  model_->kv_plan_changed();
}

}  // namespace kvlm

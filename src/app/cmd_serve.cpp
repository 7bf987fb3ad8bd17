// kvlm serve: the OpenAI-compatible server. The socket is bound first (so /health answers
// 503 while the model loads and a busy port fails at once), then the model loads, the KV
// pool is planned, and the engine thread starts. SIGINT/SIGTERM: stop taking requests,
// let those in flight finish for --drain-timeout seconds, cancel the rest, exit 0.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "config/weight_quant.h"
#include "text/chat_template.h"
#include "server/tool_calls.h"
#include "text/text_processor.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"
#include "server/connections.h"
#include "server/http_server.h"

namespace kvlm::app {

void ServingFlags::add_to(CLI::App& cmd) {
  cmd.add_option("--max-model-len", max_model_len, "longest request (prompt + output) in tokens (default: the model's context)");
  cmd.add_option("--max-num-seqs", max_num_seqs, "sequences in one engine step at most")->capture_default_str();
  cmd.add_option("--max-num-batched-tokens", max_num_batched_tokens,
                 "tokens in one engine step at most (prefill chunks + decodes)")
      ->capture_default_str();
  cmd.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", enable_prefix_caching,
               "reuse the KV pages of shared prompt prefixes (default: on)");
  cmd.add_option("--kv-cache-memory", kv_cache_memory,
                 "bytes for the KV pool, e.g. 2GiB, 512MiB (CPU default: max-num-seqs sequences of max-model-len, "
                 "kvlm serve: 16 of them, up to 4GiB; GPU default: from --gpu-memory-utilization)");
  cmd.add_option("--kv-offload-gib", kv_offload_gib,
                 "GiB of host memory for a second tier of the prefix cache: pages the KV pool evicts are kept there in "
                 "their stored format and copied back when a prompt's prefix reaches them, instead of recomputed "
                 "(default 0: none)")
      ->check(CLI::Range(0.0, 1e6));
  cmd.add_option("--kv-offload-dir", kv_offload_dir,
                 "a directory on local disk for a third tier of the prefix cache: pages the host tier lets go of are "
                 "written there and read back on a prefix hit, also after a restart with the same model and KV plan "
                 "(needs --kv-offload-gib and --kv-offload-disk-gib)");
  cmd.add_option("--kv-offload-disk-gib", kv_offload_disk_gib, "GiB of --kv-offload-dir the disk tier may fill")
      ->check(CLI::Range(0.0, 1e9));
  cmd.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                 "fraction of the GPU's memory this server may use (weights, activations, KV pool)")
      ->capture_default_str();
  cmd.add_option("--scheduling-policy", scheduling_policy,
                 "fcfs (first come, first served) or priority: requests' `priority` field orders admission, lower "
                 "first, and a worse priority is preempted first (vLLM's convention)")
      ->capture_default_str();
}

std::string kv_summary(const LoadedModel& e) {
  std::string s = describe_kv_resolution(e.plan()) + ", " + std::to_string(e.plan().bytes_per_token()) + " bytes/token";
  if (e.tensor_parallel_size() > 1)
    s += " over " + std::to_string(e.tensor_parallel_size()) + " tensor-parallel ranks (" +
         std::to_string(e.rank_plan().bytes_per_token()) + " each), " +
         std::to_string((e.model().weight_bytes() / size_t(e.tensor_parallel_size())) >> 20) + " MiB of weights each";
  return s;
}

CLI::App* add_serve(CLI::App& app, ServeFlags& f) {
  auto* cmd = app.add_subcommand("serve", "Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)");
  f.model.add_to(*cmd);
  f.model.add_speculative_to(*cmd);
  f.serving.add_to(*cmd);
  cmd->add_option("--host", f.host, "address to listen on (0.0.0.0 for every interface)")->capture_default_str();
  cmd->add_option("--port", f.port, "port to listen on (0: any free port, printed at startup)")->capture_default_str();
  cmd->add_option("--api-key", f.api_key,
                  "require 'Authorization: Bearer KEY' on /v1/* (default: the KVLM_API_KEY environment variable)")
      ->check([](const std::string& key) {
        return key.empty() ? std::string("an empty API key would let anyone in; omit --api-key to serve without one")
                           : std::string();
      });
  cmd->add_option("--served-model-name", f.served_model_name, "the model name clients use (default: the model directory's name)");
  cmd->add_option("--drain-timeout", f.drain_timeout,
                  "seconds to let requests in flight finish after SIGINT/SIGTERM before cancelling them")
      ->capture_default_str();
  cmd->add_option("--max-connections", f.max_connections,
                  "requests in progress at once (one thread each); one more waits up to 0.5 s, then gets 503 with "
                  "Retry-After (idle keep-alive "
                  "connections and connections still sending headers do not count)")
      ->capture_default_str();
  return cmd;
}

namespace {

// SIGINT and SIGTERM: the handler only writes the signal number to a pipe (async-signal
// safe; any thread may take the signal, OpenBLAS's threads exist before main); a watcher
// thread reads it. While the model loads a signal ends the process at once (nothing is in
// flight yet).
int g_signal_pipe[2] = {-1, -1};

extern "C" void on_stop_signal(int sig) {
  const int saved = errno;
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(g_signal_pipe[1], &b, 1);
  errno = saved;
}

class SignalWatcher {
 public:
  SignalWatcher() {
    if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(std::string("pipe2 failed: ") + std::strerror(errno));
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
    thread_ = std::thread([this] { run(); });
  }
  ~SignalWatcher() {
    quit_ = true;
    thread_.join();
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::close(g_signal_pipe[0]);
    ::close(g_signal_pipe[1]);
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  void set_loading(bool v) { loading_ = v; }
  int count() const {
    std::lock_guard lock(mu_);
    return count_;
  }
  // Waits until `n` signals have arrived, or `stop()` says to stop waiting (checked every
  // 200 ms); returns whether the signals came.
  bool wait(int n, const std::function<bool()>& stop = nullptr) {
    std::unique_lock lock(mu_);
    while (count_ < n) {
      if (stop && stop()) return false;
      cv_.wait_for(lock, std::chrono::milliseconds(200));
    }
    return true;
  }

 private:
  void run() {
    while (!quit_) {
      pollfd p{g_signal_pipe[0], POLLIN, 0};
      if (::poll(&p, 1, 200) <= 0) continue;
      unsigned char sig = 0;
      while (::read(g_signal_pipe[0], &sig, 1) == 1) {
        if (loading_) {
          std::fprintf(stderr, "kvlm: %s while loading the model; exiting\n", sig == SIGINT ? "interrupted" : "terminated");
          std::fflush(stderr);
          std::_Exit(0);
        }
        {
          std::lock_guard lock(mu_);
          ++count_;
        }
        cv_.notify_all();
      }
    }
  }

  struct sigaction old_int_ {}, old_term_ {};
  std::thread thread_;
  std::atomic<bool> quit_{false}, loading_{true};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int count_ = 0;
};

void say(const std::string& line) {
  if (log::level() >= log::Level::Warn) {
    std::fprintf(stderr, "kvlm: %s\n", line.c_str());
    std::fflush(stderr);
  }
}

namespace fs = std::filesystem;

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// --allowed-origins: vLLM takes a JSON list ('["*"]'); a comma-separated list is accepted too.
std::vector<std::string> parse_origins(const std::string& s) {
  std::vector<std::string> out;
  if (s.find_first_not_of(" \t") == std::string::npos) return out;
  if (s[s.find_first_not_of(" \t")] == '[') {
    const nlohmann::json j = nlohmann::json::parse(s, nullptr, false);
    if (!j.is_array()) throw Error("--allowed-origins: '" + s + "' is not a JSON list; give '[\"*\"]' or origins separated by commas");
    for (const auto& o : j) {
      if (!o.is_string() || o.get<std::string>().empty())
        throw Error("--allowed-origins: every origin must be a non-empty string, got " + o.dump());
      out.push_back(o.get<std::string>());
    }
    return out;
  }
  std::stringstream ss(s);
  for (std::string o; std::getline(ss, o, ',');) {
    o.erase(0, o.find_first_not_of(" \t"));
    o.erase(o.find_last_not_of(" \t") + 1);
    if (!o.empty()) out.push_back(o);
  }
  return out;
}

// --chat-template: a file's contents, or (as vLLM does) the argument itself when it is a template.
std::string chat_template_arg(const std::string& arg) {
  std::error_code ec;
  if (fs::is_regular_file(arg, ec)) {
    std::ifstream in(arg, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    if (!in) throw Error("--chat-template: cannot read '" + arg + "'");
    return ss.str();
  }
  if (arg.find_first_of("{}\n") != std::string::npos) return arg;
  throw Error("--chat-template: '" + arg + "' is neither a file nor a Jinja template");
}

// The tokenizer of `dir` with `tpl` as its chat template. TextProcessor takes its template from
// the directory (chat_template.jinja wins over tokenizer_config.json), so it loads from an
// overlay: links to the directory's files plus chat_template.jinja, removed once loaded.
std::optional<TextProcessor> load_text_with_template(const fs::path& dir, const std::string& tpl) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error("--chat-template needs a tokenizer directory (a GGUF model's is not supported)");
  std::string tmpl = (fs::temp_directory_path(ec) / "kvlm-chat-template-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) throw Error(std::string("--chat-template: cannot make a temporary directory: ") + std::strerror(errno));
  const fs::path overlay(tmpl);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } cleanup{overlay};
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename() != "chat_template.jinja") fs::create_symlink(fs::absolute(e.path(), ec), overlay / e.path().filename(), ec);
  {
    std::ofstream out(overlay / "chat_template.jinja", std::ios::binary);
    out << tpl;
    if (!out) throw Error("--chat-template: cannot write the template to " + overlay.string());
  }
  try {
    return TextProcessor::load(overlay);
  } catch (const Error& e) {
    std::string msg = e.what();
    for (size_t at; (at = msg.find(overlay.string())) != std::string::npos;) msg.replace(at, overlay.string().size(), "--chat-template");
    throw Error(msg);
  }
}

// Sampling defaults from DIR/generation_config.json, by the rule the model directory's follow
// (config/model_config.cpp): only when it asks for sampling (do_sample true).
void read_generation_config(const fs::path& dir, server::ModelInfo& info) {
  const fs::path path = dir / "generation_config.json";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw Error("--generation-config: '" + dir.string() + "' holds no generation_config.json (give auto, vllm or a directory)");
  std::ifstream in(path);
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
  if (!j.is_object()) throw Error("--generation-config: " + path.string() + " is not a JSON object");
  info.default_temperature.reset();
  info.default_top_p.reset();
  info.default_top_k.reset();
  info.default_min_p.reset();
  const auto sample = j.find("do_sample");
  if (sample == j.end() || !sample->is_boolean() || !sample->get<bool>()) return;
  auto number = [&](const char* key) -> std::optional<double> {
    const auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) throw Error("--generation-config: " + path.string() + ": " + key + " must be a number");
    return it->get<double>();
  };
  if (auto v = number("temperature")) info.default_temperature = float(*v);
  if (auto v = number("top_p")) info.default_top_p = float(*v);
  if (auto v = number("top_k")) info.default_top_k = int(*v);
  if (auto v = number("min_p")) info.default_min_p = float(*v);
}

// vLLM's periodic stats line: throughput since the last line, the queues, the KV cache;
// printed only while something runs or ran since the last line (an idle server is quiet).
class StatsLine {
 public:
  StatsLine(const AsyncEngine& e, double interval_s) : e_(e), interval_(interval_s) {
    thread_ = std::thread([this] { run(); });
  }
  ~StatsLine() {
    {
      std::lock_guard lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  void run() {
    EngineStats last = e_.stats();
    auto t_last = std::chrono::steady_clock::now();
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(int64_t(interval_ * 1000)), [&] { return quit_; })) {
      const EngineStats s = e_.stats();
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::max(1e-3, std::chrono::duration<double>(now - t_last).count());
      const uint64_t dp = s.prompt_tokens_total - last.prompt_tokens_total;
      const uint64_t dg = s.generation_tokens_total - last.generation_tokens_total;
      if (dp || dg || s.num_running || s.num_waiting) {
        const uint64_t dq = s.prefix_cache_queries_total - last.prefix_cache_queries_total;
        const uint64_t dh = s.prefix_cache_hits_total - last.prefix_cache_hits_total;
        char tier[256] = "";
        if (s.kv_offload_capacity > 0) {
          const double bytes = double(s.kv_offload_restored_bytes_total - last.kv_offload_restored_bytes_total);
          const double secs = s.kv_offload_restore_seconds_total - last.kv_offload_restore_seconds_total;
          std::snprintf(tier, sizeof tier, ", Host tier: %d/%d pages, %llu tokens restored", s.kv_offload_pages,
                        s.kv_offload_capacity,
                        (unsigned long long)(s.kv_offload_hit_tokens_total - last.kv_offload_hit_tokens_total));
          if (secs > 0)
            std::snprintf(tier + std::strlen(tier), sizeof tier - std::strlen(tier), " at %.1f GB/s", bytes / secs / 1e9);
          if (s.kv_offload_disk_capacity > 0)
            std::snprintf(tier + std::strlen(tier), sizeof tier - std::strlen(tier), ", Disk tier: %d/%d pages, %llu read",
                          s.kv_offload_disk_pages, s.kv_offload_disk_capacity,
                          (unsigned long long)(s.kv_offload_disk_read_total - last.kv_offload_disk_read_total));
        }
        std::fprintf(stderr,
                     "%s kvlm: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                     "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%%s\n",
                     utc_now().c_str(), double(dp) / dt, double(dg) / dt, s.num_running, s.num_waiting,
                     100.0 * s.kv_usage, dq ? 100.0 * double(dh) / double(dq) : 0.0, tier);
        std::fflush(stderr);
      }
      last = s;
      t_last = now;
    }
  }

  const AsyncEngine& e_;
  const double interval_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;
};

}  // namespace

int run_serve(const ServeFlags& f) { return run_serve(f, ServeExtraFlags{}); }

int run_serve(const ServeFlags& flags, const ServeExtraFlags& x) {
  // Everything that needs no model is checked before anything starts (the "listening" line
  // comes after every check).
  x.check_refused();
  // Parsed now, so that a wrong name fails before the model loads. (A plain value and a flag:
  // GCC 12 takes an optional enum read after the load for maybe-uninitialized.)
  const bool tool_parser_given = !x.tool_call_parser.empty();
  const server::ToolParser tool_parser =
      tool_parser_given ? server::parse_tool_parser(x.tool_call_parser) : server::ToolParser::None;
  const server::ReasoningParser reasoning_parser =
      x.reasoning_parser.empty() ? server::ReasoningParser::None : server::parse_reasoning_parser(x.reasoning_parser);
  const ServeFlags& f = flags;
  if (!x.log_level.empty()) {
    const std::string& l = x.log_level;
    log::set_level(l == "critical" || l == "error" ? log::Level::Quiet
                   : l == "warning"                ? log::Level::Warn
                   : l == "info"                   ? log::Level::Info
                                                   : log::Level::Debug);
  }
  ModelOptions opts = f.model.model_options();
  if (opts.tensor_parallel_size != 1)  // so does a size that cannot split the model
    check_tensor_parallel(opts, Checkpoint::open(opts.model_dir).model_config(opts.model_dir));
  const MemoryOptions mem = f.serving.memory_options();
  if (!(f.drain_timeout >= 0)) throw Error("--drain-timeout must be >= 0 seconds");
  if (f.max_connections < 1) throw Error("--max-connections must be at least 1");
  for (const auto& [name, v] : {std::pair{"--header-timeout", x.header_timeout}, std::pair{"--read-timeout", x.read_timeout},
                                std::pair{"--keep-alive-timeout", x.keep_alive_timeout}})
    if (v < 1) throw Error(std::string(name) + " must be at least 1 second, got " + std::to_string(v));
  if (!(x.log_stats_interval > 0)) throw Error("--log-stats-interval must be positive");
  if (x.max_logprobs < 0) throw Error("--max-logprobs must be >= 0, got " + std::to_string(x.max_logprobs));
  if (x.max_seqs_per_request < 1)
    throw Error("--max-seqs-per-request must be at least 1, got " + std::to_string(x.max_seqs_per_request));
  if (!(x.grammar_compile_timeout > 0) || x.grammar_compile_timeout > 3600)
    throw Error("--grammar-compile-timeout must be between 0 and 3600 seconds");
  const fs::path tokenizer_dir = x.tokenizer.empty() ? opts.model_dir : fs::path(x.tokenizer);
  if (!x.tokenizer.empty() && !TextProcessor::available(tokenizer_dir))
    throw Error("--tokenizer '" + x.tokenizer + "' has no tokenizer.json (nor a .gguf file)");
  const std::string chat_template = x.chat_template.empty() ? "" : chat_template_arg(x.chat_template);
  if (!chat_template.empty()) ChatTemplate::parse(chat_template, "--chat-template");  // syntax errors now, with line and column
  server::ModelInfo gen_defaults;  // --generation-config DIR's
  if (x.generation_config != "auto" && x.generation_config != "vllm") {
    std::error_code ec;
    if (!fs::is_regular_file(fs::path(x.generation_config) / "generation_config.json", ec))
      throw Error("--generation-config: '" + x.generation_config +
                  "' is not auto, vllm, or a directory holding generation_config.json");
    read_generation_config(x.generation_config, gen_defaults);
  }
  server::ServerOptions so;
  so.host = f.host;
  so.port = f.port;
  so.api_key = f.api_key;
  if (so.api_key.empty())
    if (const char* env = std::getenv("KVLM_API_KEY")) so.api_key = env;
  so.max_connections = f.max_connections;
  so.header_timeout_s = x.header_timeout;
  so.read_timeout_s = x.read_timeout;
  so.keep_alive_timeout_s = x.keep_alive_timeout;
  so.log_requests = !x.disable_log_requests;
  so.allowed_origins = parse_origins(x.allowed_origins);
  so.seed = x.seed;
  so.limits.max_logprobs = x.max_logprobs;
  so.limits.max_choices = x.max_seqs_per_request;
  so.limits.priority_scheduling = f.serving.scheduling_policy == "priority";
  so.grammar_compile_s = x.grammar_compile_timeout;
  if (x.responses_store_size < 0)
    throw Error("--responses-store-size must be >= 0, got " + std::to_string(x.responses_store_size));
  so.responses_store_size = size_t(x.responses_store_size);
  server::raise_descriptor_limit();  // one descriptor per connection: the default 1024 is few
  if (so.api_key.empty() && so.host != "127.0.0.1" && so.host != "localhost" && so.host != "::1")
    log::warn("serving on " + so.host + " without an API key: anyone who can reach the port can use the model; "
              "set --api-key (or KVLM_API_KEY), or --host 127.0.0.1 for this machine only");
  std::string name = f.served_model_name;
  if (name.empty()) {
    std::error_code ec;
    name = std::filesystem::weakly_canonical(opts.model_dir, ec).filename().string();
    if (name.empty()) name = opts.model_dir.filename().string();
  }

  // Declared before the server so they outlive its connection threads.
  std::optional<TextProcessor> text;
  std::unique_ptr<LoadedModel> engine;
  std::unique_ptr<AsyncEngine> async;
  std::unique_ptr<server::AsyncEngineClient> client;

  SignalWatcher signals;
  std::signal(SIGPIPE, SIG_IGN);  // a client that goes away is a failed write, not a killed server
  server::HttpServer http(so);
  const int port = http.bind();
  http.start();
  const std::string url = "http://" + (so.host.find(':') != std::string::npos ? "[" + so.host + "]" : so.host) + ":" +
                          std::to_string(port);
  say("listening on " + url + " (loading " + opts.model_dir.string() + "; /health answers 503 until ready)");

  if (!chat_template.empty()) text = load_text_with_template(tokenizer_dir, chat_template);
  else if (TextProcessor::available(tokenizer_dir)) text = TextProcessor::load_if_usable(tokenizer_dir);
  else log::warn("'" + opts.model_dir.string() + "' has no tokenizer.json: prompts must be token ids and responses carry token ids, not text");
  engine = LoadedModel::load(opts);
  const MemoryPlan plan = plan_kv_memory(*engine, mem);
  async = std::make_unique<AsyncEngine>(*engine, f.serving.scheduler_config(plan));
  client = std::make_unique<server::AsyncEngineClient>(*async);

  const ModelConfig& cfg = engine->config();
  server::ServedModel sm;
  sm.engine = client.get();
  sm.text = text ? &*text : nullptr;
  sm.info.name = name;
  sm.info.max_model_len = async->config().max_model_len;
  sm.info.vocab_size = cfg.vocab_size;
  sm.info.has_tokenizer = text.has_value();
  sm.info.has_chat_template = text && text->has_chat_template();
  sm.info.default_temperature = cfg.default_temperature;
  sm.info.default_top_p = cfg.default_top_p;
  sm.info.default_top_k = cfg.default_top_k;
  sm.info.default_min_p = cfg.default_min_p;
  if (x.generation_config == "vllm") {
    sm.info.default_temperature.reset();
    sm.info.default_top_p.reset();
    sm.info.default_top_k.reset();
    sm.info.default_min_p.reset();
  } else if (x.generation_config != "auto") {
    sm.info.default_temperature = gen_defaults.default_temperature;
    sm.info.default_top_p = gen_defaults.default_top_p;
    sm.info.default_top_k = gen_defaults.default_top_k;
    sm.info.default_min_p = gen_defaults.default_min_p;
  }
  // Tool calls: the flag's format, or the one the chat template writes.
  if (tool_parser_given) {
    sm.info.tool_parser = tool_parser;
  } else if (text && text->config().chat_template) {
    sm.info.tool_parser = server::detect_tool_parser(*text->config().chat_template);
    if (sm.info.tool_parser != server::ToolParser::None)
      say("tool calls: " + std::string(server::tool_parser_name(sm.info.tool_parser)) +
          " (the chat template's format; --tool-call-parser to change)");
  }
  // Reasoning: harmony splits it in its own format; <think> tags need a tokenizer and a chat.
  if (reasoning_parser == server::ReasoningParser::Harmony && sm.info.tool_parser != server::ToolParser::Harmony)
    throw Error("--reasoning-parser " + x.reasoning_parser +
                " reads GPT-OSS's harmony format, which this model's chat template does not write; for <think> "
                "tags use qwen3 or deepseek_r1");
  if (reasoning_parser == server::ReasoningParser::ThinkTags) {
    if (sm.info.tool_parser == server::ToolParser::Harmony)
      throw Error("--reasoning-parser " + x.reasoning_parser +
                  " splits <think> tags, but this model writes harmony, whose reasoning kvlm splits already: drop the "
                  "flag (or use gpt_oss)");
    sm.info.reasoning_parser = reasoning_parser;
    say("reasoning: <think> ... </think> returned as reasoning_content (--reasoning-parser " + x.reasoning_parser + ")");
  }
  sm.eos_token_ids = cfg.eos_token_ids;
  if (text)
    if (auto eos = text->eos_id(); eos && std::ranges::find(sm.eos_token_ids, *eos) == sm.eos_token_ids.end())
      sm.eos_token_ids.push_back(*eos);
  {
    server::Json layers = server::Json::array();
    for (const auto& l : engine->plan().layers) layers.push_back(server::Json(kv_layer_json(l)));
    sm.kv_plan["summary"] = kv_summary(*engine);
    sm.kv_plan["capacity_tokens"] = plan.capacity_tokens;
    sm.kv_plan["layers"] = std::move(layers);
  }
  say("model '" + name + "': " + std::string(arch_name(cfg.arch)) + ", " + std::to_string(cfg.num_layers) +
      " layers; KV cache " + kv_summary(*engine));
  if (const auto& pc = engine->pooling()) {
    sm.pooling = *pc;
    sm.hidden_size = cfg.hidden_size;
    const char* how = pc->type == PoolingType::Last ? "the last token" : pc->type == PoolingType::Mean ? "the mean over tokens" : "the first (CLS) token";
    say("embedding model (--runner pooling): /v1/embeddings pools by " + std::string(how) + (pc->normalize ? ", normalized" : "") +
        ", " + std::to_string(cfg.hidden_size) + " dimensions" + (pc->matryoshka ? " (Matryoshka: `dimensions` cuts them)" : "") +
        " [" + pc->source + "]; the generation endpoints refuse");
  }
  for (size_t start = 0; start <= plan.summary.size();) {
    const size_t nl = plan.summary.find('\n', start);
    say(plan.summary.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  http.set_ready(std::move(sm));
  signals.set_loading(false);
  say("ready: serving '" + name + "' on " + url + (so.api_key.empty() ? "" : " (API key required)"));
  using Clock = std::chrono::steady_clock;
  std::optional<StatsLine> stats_line;
  if (!x.disable_log_stats && log::level() >= log::Level::Warn) stats_line.emplace(*async, x.log_stats_interval);

  // Until SIGINT/SIGTERM, or the engine stops on its own (a device error, a tensor-parallel
  // node that died): then nothing can be served any more, and the process says why and exits 1
  // (a supervisor restarts it) instead of answering 503 forever.
  if (!signals.wait(1, [&] { return !async->failure().empty(); })) {
    const std::string why = async->failure();
    log::error("the engine failed (" + why + "); stopping the server");
    http.begin_drain();
    http.cancel_all("the engine failed: " + why);
    http.wait_idle(Clock::now() + std::chrono::seconds(5));
    stats_line.reset();
    http.stop();
    async->shutdown(false);
    return 1;
  }
  http.begin_drain();
  const auto deadline = Clock::now() + std::chrono::milliseconds(int64_t(f.drain_timeout * 1000));
  if (http.in_flight() > 0)
    say("shutting down: letting " + std::to_string(http.in_flight()) + " requests finish (up to " +
        std::to_string(int(f.drain_timeout)) + " s; a second signal cancels them)");
  while (http.in_flight() > 0 && Clock::now() < deadline && signals.count() < 2)
    http.wait_idle(std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
  if (http.in_flight() > 0) {
    say("cancelling " + std::to_string(http.in_flight()) + " requests still in flight");
    http.cancel_all("the server is shutting down");
    async->shutdown(false);
    http.wait_idle(Clock::now() + std::chrono::seconds(5));
  }
  stats_line.reset();
  http.stop();
  async->shutdown(true);
  say("stopped");
  return 0;
}

}  // namespace kvlm::app

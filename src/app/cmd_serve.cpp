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
#include <mutex>
#include <thread>

#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "text/text_processor.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"
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
                 "bytes for the KV pool, e.g. 2GiB, 512MiB (CPU default: up to 4GiB; GPU default: from "
                 "--gpu-memory-utilization)");
  cmd.add_option("--gpu-memory-utilization", gpu_memory_utilization,
                 "fraction of the GPU's memory this server may use (weights, activations, KV pool)")
      ->capture_default_str();
}

MemoryOptions ServingFlags::memory_options() const {
  MemoryOptions m;
  if (!kv_cache_memory.empty()) m.kv_cache_memory = parse_byte_size(kv_cache_memory);
  m.gpu_memory_utilization = gpu_memory_utilization;
  if (max_model_len < 0) throw Error("--max-model-len must be positive, got " + std::to_string(max_model_len));
  m.max_model_len = max_model_len;
  if (max_num_seqs < 1) throw Error("--max-num-seqs must be at least 1, got " + std::to_string(max_num_seqs));
  if (max_num_batched_tokens < 1)
    throw Error("--max-num-batched-tokens must be at least 1, got " + std::to_string(max_num_batched_tokens));
  m.max_num_seqs = max_num_seqs;
  m.max_num_batched_tokens = max_num_batched_tokens;
  return m;
}

SchedulerConfig ServingFlags::scheduler_config(const MemoryPlan& plan) const {
  SchedulerConfig c;
  c.max_num_seqs = max_num_seqs;
  c.max_num_batched_tokens = max_num_batched_tokens;
  c.max_model_len = plan.max_model_len;
  c.enable_prefix_caching = enable_prefix_caching;
  c.num_blocks = plan.num_blocks;
  return c;
}

std::string kv_summary(const LoadedModel& e) {
  const KVStorage& kv = e.plan().resolution.storage;
  std::string s = std::string(dtype_name(kv.storage));
  if (kv.mode != KVQuantMode::None) s += " " + std::string(kv_quant_mode_name(kv.mode));
  return s + ", " + std::to_string(e.plan().bytes_per_token()) + " bytes/token";
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
  cmd->add_option("--max-connections", f.max_connections, "client connections served at once (one thread each)")
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
  // Waits until `n` signals have arrived.
  void wait(int n) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return count_ >= n; });
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

}  // namespace

int run_serve(const ServeFlags& f) {
  // Everything that needs no model is checked before anything starts.
  ModelOptions opts = f.model.model_options();
  check_model_dir(opts.model_dir);
  const MemoryOptions mem = f.serving.memory_options();
  if (!(f.drain_timeout >= 0)) throw Error("--drain-timeout must be >= 0 seconds");
  if (f.max_connections < 1) throw Error("--max-connections must be at least 1");
  server::ServerOptions so;
  so.host = f.host;
  so.port = f.port;
  so.api_key = f.api_key;
  if (so.api_key.empty())
    if (const char* env = std::getenv("KVLM_API_KEY")) so.api_key = env;
  so.max_connections = f.max_connections;
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

  if (TextProcessor::available(opts.model_dir)) text = TextProcessor::load_if_usable(opts.model_dir);
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
  sm.eos_token_ids = cfg.eos_token_ids;
  if (text)
    if (auto eos = text->eos_id(); eos && std::ranges::find(sm.eos_token_ids, *eos) == sm.eos_token_ids.end())
      sm.eos_token_ids.push_back(*eos);
  sm.root = opts.model_dir.string();
  say("model '" + name + "': " + std::string(arch_name(cfg.arch)) + ", " + std::to_string(cfg.num_layers) +
      " layers; KV cache " + kv_summary(*engine));
  for (size_t start = 0; start <= plan.summary.size();) {
    const size_t nl = plan.summary.find('\n', start);
    say(plan.summary.substr(start, nl == std::string::npos ? std::string::npos : nl - start));
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  http.set_ready(std::move(sm));
  signals.set_loading(false);
  say("ready: serving '" + name + "' on " + url + (so.api_key.empty() ? "" : " (API key required)"));

  signals.wait(1);
  http.begin_drain();
  using Clock = std::chrono::steady_clock;
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
  http.stop();
  async->shutdown(true);
  say("stopped");
  return 0;
}

}  // namespace kvlm::app

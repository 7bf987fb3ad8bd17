// kvlm bench throughput: offline, the serving engine with every request submitted at once.
// kvlm bench multiturn: cmd_bench_multiturn.cpp.
// kvlm bench serve: a running server over HTTP, streaming completions at a request rate or
// concurrency, with TTFT / TPOT / ITL percentiles. Tables in the style of `vllm bench`,
// --json for the numbers.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <mutex>
#include <random>
#include <semaphore>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "app/bench_report.h"
#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "text/text_processor.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"

namespace kvlm::app {

std::string kv_summary(const LoadedModel& e);  // cmd_serve.cpp

CLI::App* add_bench(CLI::App& app, BenchFlags& f) {
  auto* bench = app.add_subcommand(
      "bench", "Benchmarks: throughput and multiturn (offline engine), serve (a running server)");
  bench->require_subcommand(1);

  BenchThroughputFlags& t = f.throughput;
  auto* tp = bench->add_subcommand("throughput", "Offline throughput: N requests submitted at once to the serving engine");
  t.model.add_to(*tp);
  t.model.add_speculative_to(*tp);
  t.serving.add_to(*tp);
  tp->add_option("--num-prompts", t.num_prompts, "requests")->capture_default_str();
  tp->add_option("--input-len", t.input_len, "prompt tokens of each synthetic request")->capture_default_str();
  tp->add_option("--output-len", t.output_len, "tokens generated per request (at most, with --no-ignore-eos)")->capture_default_str();
  tp->add_option("--dataset", t.dataset,
                 "JSONL prompts instead of synthetic ones: {\"prompt\": TEXT} or {\"prompt_token_ids\": [...]}, "
                 "optional \"output_len\"");
  tp->add_option("--seed", t.seed, "seed of the synthetic prompts and of sampling")->capture_default_str();
  tp->add_option("--temperature", t.temperature, "sampling temperature of every request (0: greedy)")
      ->capture_default_str();
  tp->add_flag("--ignore-eos,!--no-ignore-eos", t.ignore_eos,
               "generate --output-len tokens whatever the model says (default); --no-ignore-eos: stop at EOS")
      ->capture_default_str();
  tp->add_option("--num-warmups", t.num_warmups,
                 "run the first N requests once, untimed, before the timed run (first-use costs: CUDA graph "
                 "captures, kernel loading; with prefix caching on, their prompts are cached for the timed run)")
      ->capture_default_str();
  tp->add_option("--json", t.json, "write the results to this JSON file");
  f.throughput_cmd = tp;

  BenchMultiturnFlags& m = f.multiturn;
  auto* mt = bench->add_subcommand(
      "multiturn",
      "Offline multi-turn chat: conversations over one shared system prompt, each turn's prompt the whole history "
      "so far (random token ids); TTFT and TPOT of first and later turns, prefix-cache and host-tier hits");
  m.model.add_to(*mt);
  m.serving.add_to(*mt);
  mt->add_option("--conversations", m.conversations, "conversations")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  mt->add_option("--turns", m.turns, "turns per conversation")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  mt->add_option("--system-len", m.system_len, "tokens of the system prompt every conversation starts with")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 24));
  mt->add_option("--user-len", m.user_len, "tokens of each turn's user message")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  mt->add_option("--output-len", m.output_len, "tokens of each answer")->capture_default_str()->check(CLI::Range(1, 1 << 24));
  mt->add_option("--max-concurrency", m.max_concurrency,
                 "turns in flight at once (0: one per conversation); a conversation's next turn joins the back of the "
                 "queue, so the others' turns come between two of its own")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  mt->add_option("--seed", m.seed, "seed of the token ids")->capture_default_str();
  mt->add_option("--json", m.json, "write the results to this JSON file");
  f.multiturn_cmd = mt;

  BenchServeFlags& s = f.serve;
  auto* sv = bench->add_subcommand("serve", "Online serving benchmark against a running OpenAI-compatible server");
  sv->add_option("--base-url", s.base_url, "the server")->capture_default_str();
  sv->add_option("--endpoint", s.endpoint, "/v1/completions, or /v1/chat/completions (needs --dataset text prompts)")
      ->capture_default_str();
  sv->add_option("--model", s.model, "model name (default: the server's first model)");
  sv->add_option("--api-key", s.api_key, "API key (default: KVLM_API_KEY, then OPENAI_API_KEY)");
  sv->add_option("--num-prompts", s.num_prompts, "requests")->capture_default_str();
  sv->add_option("--request-rate", s.request_rate,
                 "requests per second, arrivals as a Poisson process (0 or inf: all at once)");
  sv->add_option("--max-concurrency", s.max_concurrency, "requests in flight at most (0: no limit)");
  sv->add_option("--input-len", s.input_len, "prompt tokens of each synthetic request")->capture_default_str();
  sv->add_option("--output-len", s.output_len, "max_tokens of each request")->capture_default_str();
  sv->add_option("--vocab-size", s.vocab_size, "synthetic prompts use token ids below this (default: the server's)");
  sv->add_option("--dataset", s.dataset, "JSONL prompts: {\"prompt\": TEXT} or {\"prompt_token_ids\": [...]}, optional \"output_len\"");
  sv->add_flag("--ignore-eos", s.ignore_eos, "generate --output-len tokens whatever the model says");
  sv->add_option("--seed", s.seed, "seed of the synthetic prompts and arrival times")->capture_default_str();
  sv->add_option("--timeout", s.timeout, "seconds a request may take")->capture_default_str();
  sv->add_option("--json", s.json, "write the results to this JSON file");
  f.serve_cmd = sv;
  return bench;
}

namespace {

using namespace bench;

struct DatasetEntry {
  std::optional<std::string> text;
  std::vector<TokenId> ids;
  int output_len = 0;  // 0 = the flag's
};

std::vector<DatasetEntry> read_dataset(const std::string& path, int limit) {
  std::ifstream in(path);
  if (!in) throw Error("cannot open --dataset '" + path + "'");
  std::vector<DatasetEntry> out;
  std::string line;
  int lineno = 0;
  while (int(out.size()) < limit && std::getline(in, line)) {
    ++lineno;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(where + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!j.is_object()) throw Error(where + ": each line must be a JSON object");
    DatasetEntry d;
    if (j.contains("prompt_token_ids")) {
      try {
        d.ids = j["prompt_token_ids"].get<std::vector<TokenId>>();
      } catch (const nlohmann::json::exception&) {
        throw Error(where + ": prompt_token_ids must be a list of token ids");
      }
      if (d.ids.empty()) throw Error(where + ": prompt_token_ids is empty");
    } else if (j.contains("prompt") && j["prompt"].is_string()) {
      d.text = j["prompt"].get<std::string>();
    } else {
      throw Error(where + ": needs \"prompt\" (a string) or \"prompt_token_ids\"");
    }
    for (const char* key : {"output_len", "max_tokens"})
      if (j.contains(key)) {
        if (!j[key].is_number_integer() || j[key].get<int64_t>() < 1 || j[key].get<int64_t>() > INT32_MAX)
          throw Error(where + ": " + key + " must be a positive integer");
        d.output_len = j[key].get<int>();
      }
    out.push_back(std::move(d));
  }
  if (out.empty()) throw Error("--dataset '" + path + "' holds no prompts");
  return out;
}

// --- bench throughput --------------------------------------------------------------------

int run_throughput(const BenchThroughputFlags& f) {
  if (f.num_prompts < 1) throw Error("--num-prompts must be at least 1");
  if (f.input_len < 1) throw Error("--input-len must be at least 1");
  if (f.output_len < 1) throw Error("--output-len must be at least 1");
  if (f.num_warmups < 0) throw Error("--num-warmups must be at least 0");
  if (!(f.temperature >= 0.0f) || !std::isfinite(f.temperature))
    throw Error("--temperature must be a finite number >= 0");
  ModelOptions opts = f.model.model_options();
  const MemoryOptions mem = f.serving.memory_options();
  std::vector<DatasetEntry> data;
  std::optional<TextProcessor> text;
  if (!f.dataset.empty()) {
    data = read_dataset(f.dataset, f.num_prompts);
    if (std::ranges::any_of(data, [](const DatasetEntry& d) { return d.text.has_value(); }))
      text = TextProcessor::load(opts.model_dir, "give the dataset's prompts as prompt_token_ids");
  }
  auto engine = LoadedModel::load(opts);
  const MemoryPlan plan = plan_kv_memory(*engine, mem);
  const int vocab = engine->config().vocab_size;

  // The requests: synthetic (uniform random ids, seeded) or from the dataset.
  std::mt19937_64 rng(f.seed);
  std::uniform_int_distribution<TokenId> pick(0, vocab - 1);
  struct Req {
    std::vector<TokenId> prompt;
    int max_tokens;
  };
  std::vector<Req> reqs;
  const int n = data.empty() ? f.num_prompts : int(data.size());
  for (int i = 0; i < n; ++i) {
    Req r;
    if (data.empty()) {
      r.prompt.resize(size_t(f.input_len));
      for (auto& t : r.prompt) t = pick(rng);
      r.max_tokens = f.output_len;
    } else {
      r.prompt = data[size_t(i)].text ? text->encode_prompt(*data[size_t(i)].text) : data[size_t(i)].ids;
      r.max_tokens = data[size_t(i)].output_len > 0 ? data[size_t(i)].output_len : f.output_len;
    }
    if (int64_t(r.prompt.size()) + r.max_tokens > plan.max_model_len)
      throw Error("request " + std::to_string(i) + " needs " + std::to_string(r.prompt.size() + size_t(r.max_tokens)) +
                  " tokens, more than --max-model-len " + std::to_string(plan.max_model_len) +
                  "; lower --input-len/--output-len or raise --max-model-len");
    reqs.push_back(std::move(r));
  }
  if (log::level() >= log::Level::Warn) {
    std::fprintf(stderr, "kvlm: KV cache %s\n%s\n", kv_summary(*engine).c_str(), plan.summary.c_str());
    std::fflush(stderr);
  }

  AsyncEngine ae(*engine, f.serving.scheduler_config(plan));
  std::mutex mu;
  std::condition_variable cv;
  int done = 0, failed = 0;
  int64_t prompt_tokens = 0, output_tokens = 0;
  std::string first_error;
  auto request = [&](int i, const char* prefix) {
    EngineRequest er;
    er.id = prefix + std::to_string(i);
    er.prompt = reqs[size_t(i)].prompt;
    er.max_tokens = reqs[size_t(i)].max_tokens;
    er.ignore_eos = f.ignore_eos;
    er.seed = f.seed + uint64_t(i);
    er.sampling.temperature = f.temperature;
    return er;
  };
  if (f.num_warmups > 0) {  // untimed; failures show in the timed run
    int warm_done = 0;
    const int warm = std::min(f.num_warmups, n);
    for (int i = 0; i < warm; ++i) {
      EngineRequest er = request(i, "warmup-");
      er.on_output = [&](const RequestOutput& out) {
        if (!out.finished) return true;
        std::lock_guard lock(mu);
        ++warm_done;
        cv.notify_all();
        return true;
      };
      ae.add_request(std::move(er));
    }
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return warm_done == warm; });
  }
  const EngineStats before = ae.stats();
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    EngineRequest er = request(i, "bench-");
    er.on_output = [&](const RequestOutput& out) {
      if (!out.finished) return true;
      std::lock_guard lock(mu);
      ++done;
      if (out.finish_reason == FinishReason::Error || out.finish_reason == FinishReason::Abort) {
        ++failed;
        if (first_error.empty()) first_error = out.error.empty() ? std::string(finish_reason_name(out.finish_reason)) : out.error;
      }
      prompt_tokens += out.prompt_tokens;
      output_tokens += out.completion_tokens;
      cv.notify_all();
      return true;
    };
    ae.add_request(std::move(er));
  }
  // Progress on stderr: rewritten in place on a terminal, a line every 10 s otherwise (logs).
  const bool tty = ::isatty(2) != 0, show = log::level() >= log::Level::Warn;
  const double every = tty ? 0.5 : 10.0;
  double next_report = every;
  bool reported = false;
  auto report = [&](const EngineStats& st, int finished, int64_t out_tokens, double t, bool final_line) {
    const double busy =
        st.schedule_seconds_total + st.draft_seconds_total + st.forward_seconds_total + st.sample_seconds_total;
    auto pct = [&](double x) { return busy > 0 ? 100.0 * x / busy : 0.0; };
    std::fprintf(stderr,
                 "%skvlm: bench %d/%d done, %d running, %d waiting, %.0f s, %.0f output tok/s, %llu steps "
                 "(forward %.0f%%, drafting %.0f%%, host sampling %.0f%%, scheduling %.0f%%)%s",
                 tty ? "\r" : "", finished, n, st.num_running, st.num_waiting, t, t > 0 ? double(out_tokens) / t : 0.0,
                 (unsigned long long)(st.steps_total - before.steps_total), pct(st.forward_seconds_total),
                 pct(st.draft_seconds_total), pct(st.sample_seconds_total), pct(st.schedule_seconds_total), tty && !final_line ? "  " : "\n");
    std::fflush(stderr);
    reported = true;
  };
  for (;;) {
    std::unique_lock lock(mu);
    if (cv.wait_for(lock, std::chrono::milliseconds(5), [&] { return done == n; })) break;
    const int finished = done;
    const int64_t out_tokens = output_tokens;
    lock.unlock();
    const EngineStats st = ae.stats();
    const double t = secs(Clock::now() - t0);
    if (show && t >= next_report) {
      // Tokens of finished requests only: a lower bound while requests run.
      report(st, finished, out_tokens, t, false);
      next_report = t + every;
    }
  }
  const double elapsed = secs(Clock::now() - t0);
  const EngineStats after = ae.stats();
  // The warm-ups finished before t0, so the engine's peak is this run's own.
  const int max_running = after.peak_running;
  if (show && reported) report(after, done, output_tokens, elapsed, true);
  ae.shutdown(true);
  const double t_sched = after.schedule_seconds_total - before.schedule_seconds_total;
  const double t_fwd = after.forward_seconds_total - before.forward_seconds_total;
  const double t_draft = after.draft_seconds_total - before.draft_seconds_total;
  const double t_samp = after.sample_seconds_total - before.sample_seconds_total;
  const uint64_t steps = after.steps_total - before.steps_total;

  const uint64_t preemptions = after.preemptions_total - before.preemptions_total;
  rule(" Throughput Benchmark Result ", '=');
  rowi("Successful requests:", n - failed);
  rowi("Failed requests:", failed);
  rowd("Elapsed time (s):", elapsed);
  rowi("Total input tokens:", prompt_tokens);
  rowi("Total generated tokens:", output_tokens);
  rowd("Request throughput (req/s):", double(n) / elapsed);
  rowd("Output token throughput (tok/s):", double(output_tokens) / elapsed);
  rowd("Total token throughput (tok/s):", double(prompt_tokens + output_tokens) / elapsed);
  rowi("Max concurrency reached:", max_running);
  rowd("Max concurrency possible (at max len):", plan.max_concurrency);
  rowi("Preemptions:", int64_t(preemptions));
  row("KV cache:", kv_summary(*engine) + ", " + std::to_string(plan.capacity_tokens) + " tokens");
  const uint64_t drafts = after.spec_drafts_total - before.spec_drafts_total;
  const uint64_t drafted = after.spec_draft_tokens_total - before.spec_draft_tokens_total;
  const uint64_t accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total;
  if (opts.speculative) {
    rule(" Speculative decoding ", '-');
    row("Drafter:", describe(*opts.speculative));
    rowi("Drafts:", int64_t(drafts));
    rowi("Draft tokens:", int64_t(drafted));
    rowi("Accepted tokens:", int64_t(accepted));
    rowd("Acceptance rate:", drafted ? double(accepted) / double(drafted) : 0.0);
    rowd("Mean acceptance length:", drafts ? 1.0 + double(accepted) / double(drafts) : 0.0);
  }
  rule(" Engine time ", '-');
  rowi("Steps:", int64_t(steps));
  rowd("Forward, incl. device sampling (s):", t_fwd);
  if (opts.speculative) rowd("Drafting (s):", t_draft);
  rowd("Host sampling (s):", t_samp);
  rowd("Scheduling and batch layout (s):", t_sched);
  rule("", '=');
  std::printf("Throughput: %.2f requests/s, %.2f total tokens/s, %.2f output tokens/s\n", double(n) / elapsed,
              double(prompt_tokens + output_tokens) / elapsed, double(output_tokens) / elapsed);
  std::fflush(stdout);
  if (!f.json.empty()) {
    nlohmann::json j;
    j["model"] = opts.model_dir.string();
    j["kv_cache"] = kv_summary(*engine);
    j["kv_cache_capacity_tokens"] = plan.capacity_tokens;
    j["max_model_len"] = plan.max_model_len;
    j["num_requests"] = n;
    j["failed_requests"] = failed;
    j["input_len"] = data.empty() ? f.input_len : 0;
    j["output_len"] = data.empty() ? f.output_len : 0;
    j["temperature"] = f.temperature;
    j["ignore_eos"] = f.ignore_eos;
    j["num_warmups"] = f.num_warmups;
    j["elapsed_time"] = elapsed;
    j["total_input_tokens"] = prompt_tokens;
    j["total_output_tokens"] = output_tokens;
    j["requests_per_second"] = double(n) / elapsed;
    j["tokens_per_second"] = double(prompt_tokens + output_tokens) / elapsed;
    j["output_tokens_per_second"] = double(output_tokens) / elapsed;
    j["max_concurrency"] = max_running;
    j["max_concurrency_possible"] = plan.max_concurrency;
    j["preemptions"] = preemptions;
    j["engine_steps"] = steps;
    if (opts.speculative)
      j["speculative"] = {{"method", std::string(spec_method_name(opts.speculative->method))},
                          {"num_speculative_tokens", opts.speculative->num_speculative_tokens},
                          {"drafts", drafts},
                          {"draft_tokens", drafted},
                          {"accepted_tokens", accepted},
                          {"mean_acceptance_length", drafts ? 1.0 + double(accepted) / double(drafts) : 0.0}};
    j["engine_seconds"] = {{"forward", t_fwd}, {"draft", t_draft}, {"sample", t_samp}, {"schedule", t_sched}};
    write_json(f.json, j);
  }
  if (failed) throw Error(std::to_string(failed) + " requests failed; the first: " + first_error);
  return 0;
}

struct ServerUrl {
  std::string scheme_host_port;  // http://host:port
  std::string prefix;            // a path before the endpoint, if any
};

ServerUrl split_url(const std::string& url) {
  const size_t scheme = url.find("://");
  if (scheme == std::string::npos || (url.compare(0, scheme, "http") != 0 && url.compare(0, scheme, "https") != 0))
    throw Error("--base-url must look like http://HOST:PORT, got '" + url + "'");
  const size_t path = url.find('/', scheme + 3);
  ServerUrl u;
  u.scheme_host_port = url.substr(0, path);
  if (path != std::string::npos) u.prefix = url.substr(path);
  while (!u.prefix.empty() && u.prefix.back() == '/') u.prefix.pop_back();
  return u;
}

struct Outcome {
  bool ok = false;
  std::string error;
  double ttft = 0, latency = 0;
  std::vector<double> itls;
  int64_t prompt_tokens = 0, output_tokens = 0;
};

httplib::Headers auth_headers(const std::string& key) {
  httplib::Headers h;
  if (!key.empty()) h.emplace("Authorization", "Bearer " + key);
  return h;
}

// One streaming request; chunk arrival times give TTFT and the inter-token latencies.
Outcome send_one(const ServerUrl& url, const std::string& path, const std::string& key, const nlohmann::json& body,
                 double timeout, bool chat) {
  Outcome o;
  httplib::Client cli(url.scheme_host_port);
  cli.set_connection_timeout(std::chrono::seconds(10));
  cli.set_read_timeout(std::chrono::milliseconds(int64_t(timeout * 1000)));
  cli.set_write_timeout(std::chrono::seconds(30));
  std::string buf;
  bool done = false;
  Clock::time_point last;
  const auto start = Clock::now();
  int status = 0;
  std::string error_body;
  httplib::Request req;
  req.method = "POST";
  req.path = url.prefix + path;
  req.headers = auth_headers(key);
  req.headers.emplace("Accept", "text/event-stream");
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  req.response_handler = [&](const httplib::Response& r) {
    status = r.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t len, uint64_t, uint64_t) {
    if (status != 200) {
      error_body.append(data, len);
      return error_body.size() < 65536;
    }
    buf.append(data, len);
    for (size_t end; (end = buf.find("\n\n")) != std::string::npos;) {
      std::string ev = buf.substr(0, end);
      buf.erase(0, end + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      const std::string payload = ev.substr(6);
      if (payload == "[DONE]") {
        done = true;
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
      if (j.is_discarded()) {
        o.error = "malformed event: " + payload.substr(0, 200);
        return false;
      }
      if (j.contains("error")) {
        o.error = j["error"].value("message", std::string("error event"));
        return false;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        o.prompt_tokens = j["usage"].value("prompt_tokens", int64_t(0));
        o.output_tokens = j["usage"].value("completion_tokens", int64_t(0));
      }
      if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) continue;
      const auto& c = j["choices"][0];
      std::string piece;
      if (chat) {
        if (c.contains("delta") && c["delta"].contains("content") && c["delta"]["content"].is_string())
          piece = c["delta"]["content"].get<std::string>();
      } else if (c.contains("text") && c["text"].is_string()) {
        piece = c["text"].get<std::string>();
      }
      if (piece.empty() && !(c.contains("token_ids") && !c["token_ids"].empty())) continue;
      const auto now = Clock::now();
      if (o.ttft == 0) o.ttft = secs(now - start);
      else o.itls.push_back(secs(now - last));
      last = now;
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = cli.send(req, res, err);
  o.latency = secs(Clock::now() - start);
  if (status != 0 && status != 200) {
    nlohmann::json j = nlohmann::json::parse(error_body, nullptr, false);
    o.error = "HTTP " + std::to_string(status) +
              (!j.is_discarded() && j.contains("error") ? ": " + j["error"].value("message", std::string()) : std::string());
    return o;
  }
  if (!o.error.empty()) return o;
  if (!sent) {
    o.error = "request failed: " + httplib::to_string(err);
    return o;
  }
  if (!done) {
    o.error = "the stream ended without data: [DONE]";
    return o;
  }
  o.ok = true;
  return o;
}

int run_serve_bench(const BenchServeFlags& f) {
  std::signal(SIGPIPE, SIG_IGN);  // a server that goes away is an error result, not a killed process
  if (f.num_prompts < 1) throw Error("--num-prompts must be at least 1");
  if (f.input_len < 1 || f.output_len < 1) throw Error("--input-len and --output-len must be at least 1");
  if (f.request_rate < 0 || std::isnan(f.request_rate)) throw Error("--request-rate must be >= 0 (0 or inf: all at once)");
  if (f.max_concurrency < 0) throw Error("--max-concurrency must be >= 0");
  if (!(f.timeout > 0)) throw Error("--timeout must be positive");
  const bool chat = f.endpoint.find("chat") != std::string::npos;
  const ServerUrl url = split_url(f.base_url);
  std::string key = f.api_key;
  for (const char* env : {"KVLM_API_KEY", "OPENAI_API_KEY"})
    if (key.empty())
      if (const char* v = std::getenv(env)) key = v;

  // The model (and the vocabulary size for synthetic prompts) from /v1/models.
  std::string model = f.model;
  int vocab = f.vocab_size;
  {
    httplib::Client cli(url.scheme_host_port);
    cli.set_connection_timeout(std::chrono::seconds(10));
    auto r = cli.Get(url.prefix + "/v1/models", auth_headers(key));
    if (!r) throw Error("cannot reach the server at " + f.base_url + ": " + httplib::to_string(r.error()));
    if (r->status != 200) throw Error("GET /v1/models answered HTTP " + std::to_string(r->status) + ": " + r->body.substr(0, 300));
    const nlohmann::json j = nlohmann::json::parse(r->body, nullptr, false);
    if (j.is_discarded() || !j.contains("data") || !j["data"].is_array() || j["data"].empty())
      throw Error("GET /v1/models returned no model");
    if (model.empty()) model = j["data"][0].value("id", std::string());
    if (vocab == 0) vocab = j["data"][0].value("vocab_size", 0);
  }

  std::vector<DatasetEntry> data;
  if (!f.dataset.empty()) data = read_dataset(f.dataset, f.num_prompts);
  else if (chat) throw Error("--endpoint " + f.endpoint + " needs text prompts: give --dataset with \"prompt\" strings");
  else if (vocab <= 0) throw Error("the server does not report its vocabulary size; give --vocab-size for synthetic prompts");
  const int n = data.empty() ? f.num_prompts : int(data.size());
  std::mt19937_64 rng(f.seed);
  std::vector<nlohmann::json> bodies;
  for (int i = 0; i < n; ++i) {
    nlohmann::json b;
    b["model"] = model;
    int out_len = f.output_len;
    if (data.empty()) {
      std::uniform_int_distribution<TokenId> pick(0, vocab - 1);
      std::vector<TokenId> ids(size_t(f.input_len));
      for (auto& t : ids) t = pick(rng);
      b["prompt"] = ids;
    } else {
      const DatasetEntry& d = data[size_t(i)];
      if (d.output_len > 0) out_len = d.output_len;
      if (chat) {
        if (!d.text) throw Error("--dataset line " + std::to_string(i + 1) + ": chat needs a \"prompt\" string");
        b["messages"] = nlohmann::json::array({{{"role", "user"}, {"content", *d.text}}});
      } else if (d.text) {
        b["prompt"] = *d.text;
      } else {
        b["prompt"] = d.ids;
      }
    }
    b[chat ? "max_completion_tokens" : "max_tokens"] = out_len;
    b["temperature"] = 0;
    b["stream"] = true;
    b["stream_options"] = {{"include_usage", true}};
    if (f.ignore_eos) b["ignore_eos"] = true;
    bodies.push_back(std::move(b));
  }
  // Arrival times: a Poisson process at --request-rate, or all at once.
  std::vector<double> arrival(size_t(n), 0.0);
  const bool rate_limited = f.request_rate > 0 && std::isfinite(f.request_rate);
  if (rate_limited) {
    std::exponential_distribution<double> gap(f.request_rate);
    double t = 0;
    for (auto& a : arrival) {
      a = t;
      t += gap(rng);
    }
  }
  std::printf("Benchmarking %d requests against %s%s (%s), request rate %s, max concurrency %s\n", n, f.base_url.c_str(),
              f.endpoint.c_str(), model.c_str(), rate_limited ? std::to_string(f.request_rate).c_str() : "inf",
              f.max_concurrency > 0 ? std::to_string(f.max_concurrency).c_str() : "unlimited");
  std::fflush(stdout);

  std::vector<Outcome> outcomes(static_cast<size_t>(n));
  std::counting_semaphore<> slots(f.max_concurrency > 0 ? f.max_concurrency : std::max(n, 1));
  std::vector<std::thread> threads;
  threads.reserve(size_t(n));
  std::atomic<int> in_flight{0}, peak{0};
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    std::this_thread::sleep_until(t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(arrival[size_t(i)])));
    slots.acquire();
    const int now = ++in_flight;
    for (int p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {
    }
    threads.emplace_back([&, i] {
      outcomes[size_t(i)] = send_one(url, f.endpoint, key, bodies[size_t(i)], f.timeout, chat);
      --in_flight;
      slots.release();
    });
  }
  for (auto& t : threads) t.join();
  const double duration = secs(Clock::now() - t0);

  std::vector<double> ttft, tpot, itl, e2e;
  int64_t in_tokens = 0, out_tokens = 0;
  int ok = 0;
  std::string first_error;
  for (const auto& o : outcomes) {
    if (!o.ok) {
      if (first_error.empty()) first_error = o.error;
      continue;
    }
    ++ok;
    in_tokens += o.prompt_tokens;
    out_tokens += o.output_tokens;
    ttft.push_back(o.ttft * 1000);
    e2e.push_back(o.latency * 1000);
    if (o.output_tokens > 1) tpot.push_back((o.latency - o.ttft) * 1000 / double(o.output_tokens - 1));
    for (double g : o.itls) itl.push_back(g * 1000);
  }
  rule(" Serving Benchmark Result ", '=');
  rowi("Successful requests:", ok);
  rowi("Failed requests:", n - ok);
  rowi("Maximum request concurrency:", peak.load());
  rowd("Benchmark duration (s):", duration);
  rowi("Total input tokens:", in_tokens);
  rowi("Total generated tokens:", out_tokens);
  rowd("Request throughput (req/s):", double(ok) / duration);
  rowd("Output token throughput (tok/s):", double(out_tokens) / duration);
  rowd("Total Token throughput (tok/s):", double(in_tokens + out_tokens) / duration);
  nlohmann::json j;
  auto section = [&](const char* title, const char* name, const char* key_name, const std::vector<double>& v) {
    rule(title);
    const std::string m = std::string("Mean ") + name + " (ms):", md = std::string("Median ") + name + " (ms):",
                      p90 = std::string("P90 ") + name + " (ms):", p99 = std::string("P99 ") + name + " (ms):";
    rowd(m.c_str(), mean(v));
    rowd(md.c_str(), percentile(v, 50));
    rowd(p90.c_str(), percentile(v, 90));
    rowd(p99.c_str(), percentile(v, 99));
    const std::string k = key_name;
    j["mean_" + k + "_ms"] = mean(v);
    j["median_" + k + "_ms"] = percentile(v, 50);
    j["p90_" + k + "_ms"] = percentile(v, 90);
    j["p99_" + k + "_ms"] = percentile(v, 99);
  };
  section("Time to First Token", "TTFT", "ttft", ttft);
  section("Time per Output Token (excl. 1st token)", "TPOT", "tpot", tpot);
  section("Inter-token Latency", "ITL", "itl", itl);
  section("End-to-end Latency", "E2EL", "e2el", e2e);
  rule("", '=');
  std::fflush(stdout);
  if (!f.json.empty()) {
    j["base_url"] = f.base_url;
    j["endpoint"] = f.endpoint;
    j["model"] = model;
    j["num_prompts"] = n;
    j["request_rate"] = rate_limited ? nlohmann::json(f.request_rate) : nlohmann::json("inf");
    j["max_concurrency"] = f.max_concurrency > 0 ? nlohmann::json(f.max_concurrency) : nlohmann::json(nullptr);
    j["input_len"] = data.empty() ? f.input_len : 0;
    j["output_len"] = f.output_len;
    j["duration"] = duration;
    j["completed"] = ok;
    j["failed"] = n - ok;
    j["total_input_tokens"] = in_tokens;
    j["total_output_tokens"] = out_tokens;
    j["request_throughput"] = double(ok) / duration;
    j["output_throughput"] = double(out_tokens) / duration;
    j["total_token_throughput"] = double(in_tokens + out_tokens) / duration;
    j["peak_concurrency"] = peak.load();
    write_json(f.json, j);
  }
  if (ok < n) throw Error(std::to_string(n - ok) + " of " + std::to_string(n) + " requests failed; the first: " + first_error);
  return 0;
}

}  // namespace

int run_bench(const BenchFlags& f) {
  if (f.throughput_cmd && f.throughput_cmd->parsed()) return run_throughput(f.throughput);
  if (f.multiturn_cmd && f.multiturn_cmd->parsed()) return run_bench_multiturn(f.multiturn);
  return run_serve_bench(f.serve);
}

}  // namespace kvlm::app

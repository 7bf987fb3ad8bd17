// kvlm bench multiturn: offline, conversations over a shared system prompt, turn after turn:
// each turn's prompt is the whole conversation so far. TTFT / TPOT percentiles of first and
// later turns, and what the prefix cache and its tiers (--kv-offload-gib, --kv-offload-dir) did: pages and
// bytes moved, restore bandwidth against pinned host-to-device copies measured in the same run.
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <random>

#include "app/bench_report.h"
#include "app/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"

namespace kvlm::app {

std::string kv_summary(const LoadedModel& e);  // cmd_serve.cpp

using namespace bench;

int run_bench_multiturn(const BenchMultiturnFlags& f) {
  ModelOptions opts = f.model.model_options();
  const MemoryOptions mem = f.serving.memory_options();
  auto engine = LoadedModel::load(opts);
  const MemoryPlan plan = plan_kv_memory(*engine, mem);
  const int64_t longest = int64_t(f.system_len) + int64_t(f.turns) * (f.user_len + f.output_len);
  if (longest > plan.max_model_len)
    throw Error("the last turn's conversation holds " + std::to_string(longest) +
                " tokens (--system-len + --turns x (--user-len + --output-len)), more than --max-model-len " +
                std::to_string(plan.max_model_len) + "; lower them or raise --max-model-len");
  if (log::level() >= log::Level::Warn) {
    std::fprintf(stderr, "kvlm: KV cache %s\n%s\n", kv_summary(*engine).c_str(), plan.summary.c_str());
    std::fflush(stderr);
  }
  const int vocab = engine->config().vocab_size;
  std::mt19937_64 rng(f.seed);
  std::uniform_int_distribution<TokenId> pick(0, vocab - 1);
  auto random_ids = [&](int n) {
    std::vector<TokenId> v(static_cast<size_t>(n));
    for (auto& t : v) t = pick(rng);
    return v;
  };
  const std::vector<TokenId> system = random_ids(f.system_len);
  struct Conversation {
    std::vector<TokenId> history;
    int turn = 0;  // turns finished
  };
  std::vector<Conversation> convs(size_t(f.conversations));
  for (auto& c : convs) c.history = system;
  struct Turn {
    int turn = 0;
    double ttft = -1, e2e = 0;
    int prompt_tokens = 0, cached = 0, output_tokens = 0;
    bool ok = false;
    std::string error;
  };
  std::vector<Turn> turns;  // in the order they finished
  AsyncEngine ae(*engine, f.serving.scheduler_config(plan));
  std::mutex mu;
  std::condition_variable cv;
  // Turns queue first come, first served: a conversation's next turn joins the back of the
  // queue when its answer is in, so with fewer requests in flight than conversations, the
  // others' turns come between two of its own (as users who take time to answer).
  std::deque<int> queue;  // conversations whose next turn is due
  for (int c = 0; c < f.conversations; ++c) queue.push_back(c);
  const int limit = f.max_concurrency > 0 ? std::min(f.max_concurrency, f.conversations) : f.conversations;
  int ended = 0, in_flight = 0;
  const EngineStats before = ae.stats();
  const auto t0 = Clock::now();
  while (ended < f.conversations) {
    std::vector<int> due;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return (!queue.empty() && in_flight < limit) || ended == f.conversations; });
      while (!queue.empty() && in_flight < limit) {
        due.push_back(queue.front());
        queue.pop_front();
        ++in_flight;
      }
    }
    for (int c : due) {
      Conversation& conv = convs[size_t(c)];
      const auto user = random_ids(f.user_len);
      conv.history.insert(conv.history.end(), user.begin(), user.end());
      EngineRequest er;
      er.id = "conv-" + std::to_string(c) + "-turn-" + std::to_string(conv.turn);
      er.prompt = conv.history;
      er.max_tokens = f.output_len;
      er.ignore_eos = true;
      er.sampling.temperature = 0;
      const auto sent = Clock::now();
      auto turn = std::make_shared<Turn>();
      turn->turn = conv.turn;
      turn->prompt_tokens = int(er.prompt.size());
      auto answer = std::make_shared<std::vector<TokenId>>();
      er.on_output = [&, c, sent, turn, answer](const RequestOutput& out) {
        if (turn->ttft < 0 && !out.new_tokens.empty()) turn->ttft = secs(Clock::now() - sent);
        answer->insert(answer->end(), out.new_tokens.begin(), out.new_tokens.end());
        if (!out.finished) return true;
        turn->e2e = secs(Clock::now() - sent);
        turn->cached = out.cached_prompt_tokens;
        turn->output_tokens = int(answer->size());
        turn->ok = out.finish_reason == FinishReason::Length || out.finish_reason == FinishReason::Stop;
        if (!turn->ok) turn->error = out.error.empty() ? std::string(finish_reason_name(out.finish_reason)) : out.error;
        std::lock_guard lock(mu);
        Conversation& done = convs[size_t(c)];
        done.history.insert(done.history.end(), answer->begin(), answer->end());
        turns.push_back(*turn);
        --in_flight;
        if (++done.turn < f.turns && turn->ok) queue.push_back(c);
        else ++ended;
        cv.notify_all();
        return true;
      };
      ae.add_request(std::move(er));
    }
  }
  const double elapsed = secs(Clock::now() - t0);
  const EngineStats after = ae.stats();
  ae.shutdown(true);

  std::vector<double> ttft_first, ttft_later, tpot;
  int failed = 0;
  int64_t prompt_tokens = 0, cached = 0, output_tokens = 0;
  std::string first_error;
  for (const Turn& t : turns) {
    if (!t.ok) {
      ++failed;
      if (first_error.empty()) first_error = t.error;
      continue;
    }
    (t.turn == 0 ? ttft_first : ttft_later).push_back(t.ttft * 1000);
    if (t.output_tokens > 1) tpot.push_back((t.e2e - t.ttft) * 1000 / double(t.output_tokens - 1));
    prompt_tokens += t.prompt_tokens;
    cached += t.cached;
    output_tokens += t.output_tokens;
  }
  const uint64_t restored = after.kv_offload_restored_total - before.kv_offload_restored_total;
  const uint64_t restored_bytes = after.kv_offload_restored_bytes_total - before.kv_offload_restored_bytes_total;
  const uint64_t tier_tokens = after.kv_offload_hit_tokens_total - before.kv_offload_hit_tokens_total;
  const double restore_s = after.kv_offload_restore_seconds_total - before.kv_offload_restore_seconds_total;
  const double store_s = after.kv_offload_store_seconds_total - before.kv_offload_store_seconds_total;
  const uint64_t stored_bytes = after.kv_offload_stored_bytes_total - before.kv_offload_stored_bytes_total;
  // The reference for the restores' bandwidth, on this machine now (0: the CPU, no bus between).
  const double h2d = after.kv_offload_capacity > 0 ? engine->model().measure_host_to_device_bandwidth() : 0;
  auto gbps = [](double bytes, double s) { return s > 0 ? bytes / s / 1e9 : 0.0; };
  rule(" Multi-turn Benchmark Result ", '=');
  row("Conversations x turns:", std::to_string(f.conversations) + " x " + std::to_string(f.turns));
  row("Tokens per turn:", "system " + std::to_string(f.system_len) + " (shared), user " + std::to_string(f.user_len) +
                              ", answer " + std::to_string(f.output_len));
  rowi("Successful requests:", int64_t(turns.size()) - failed);
  rowi("Failed requests:", failed);
  rowd("Elapsed time (s):", elapsed);
  rowi("Total input tokens:", prompt_tokens);
  rowi("Input tokens from the prefix cache:", cached);
  rowi("Total generated tokens:", output_tokens);
  rowi("Preemptions:", int64_t(after.preemptions_total - before.preemptions_total));
  row("KV cache:", kv_summary(*engine) + ", " + std::to_string(plan.capacity_tokens) + " tokens");
  nlohmann::json j;
  auto section = [&](const char* title, const char* key, const std::vector<double>& v) {
    rule(title);
    rowd("Mean (ms):", mean(v));
    rowd("Median (ms):", percentile(v, 50));
    rowd("P90 (ms):", percentile(v, 90));
    rowd("P99 (ms):", percentile(v, 99));
    j[key] = percentile_json(v);
  };
  section(" Time to First Token, first turns ", "ttft_first_turn", ttft_first);
  section(" Time to First Token, later turns ", "ttft_later_turns", ttft_later);
  section(" Time per Output Token (excl. 1st token) ", "tpot", tpot);
  if (after.kv_offload_capacity > 0) {
    rule(" Host tier (--kv-offload-gib) ");
    rowi("Capacity (pages):", after.kv_offload_capacity);
    rowi("Pages held at the end:", after.kv_offload_pages);
    rowi("Pages stored:", int64_t(after.kv_offload_stored_total - before.kv_offload_stored_total));
    rowi("Pages restored:", int64_t(restored));
    rowd("Restored (MiB):", double(restored_bytes) / double(1 << 20));
    rowd("Restore time (ms):", restore_s * 1e3);
    rowd("Restore bandwidth (GB/s):", gbps(double(restored_bytes), restore_s));
    if (h2d > 0) {
      rowd("Pinned host-to-device (GB/s):", h2d / 1e9);
      rowd("Restores / pinned copies (%):", 100.0 * gbps(double(restored_bytes), restore_s) * 1e9 / h2d, 1);
    }
    rowd("Stored (MiB):", double(stored_bytes) / double(1 << 20));
    rowd("Store bandwidth (GB/s):", gbps(double(stored_bytes), store_s));
    rowi("Prompt tokens from the host tier:", int64_t(tier_tokens));
    rowi("Entries replaced:", int64_t(after.kv_offload_evictions_total - before.kv_offload_evictions_total));
    rowd("Restore per page (ms):", after.kv_offload_restore_page_seconds * 1e3, 3);
    rowd("Recompute per page (ms):", after.kv_offload_recompute_page_seconds * 1e3, 3);
    if (after.kv_offload_exact_capacity > 0) {
      rowi("Exact pages (capacity):", after.kv_offload_exact_capacity);
      rowi("Exact pages stored:", int64_t(after.kv_offload_exact_stored_total - before.kv_offload_exact_stored_total));
      rowi("Exact pages restored:",
           int64_t(after.kv_offload_exact_restored_total - before.kv_offload_exact_restored_total));
    }
  }
  const uint64_t disk_written = after.kv_offload_disk_written_total - before.kv_offload_disk_written_total;
  const uint64_t disk_read = after.kv_offload_disk_read_total - before.kv_offload_disk_read_total;
  const double disk_read_s = after.kv_offload_disk_read_seconds_total - before.kv_offload_disk_read_seconds_total;
  const double disk_write_s = after.kv_offload_disk_write_seconds_total - before.kv_offload_disk_write_seconds_total;
  const double page_file = double(after.kv_offload_disk_bytes_per_page);
  const uint64_t restoring = after.kv_offload_disk_restoring_total - before.kv_offload_disk_restoring_total;
  if (after.kv_offload_disk_capacity > 0) {
    rule(" Disk tier (--kv-offload-dir) ");
    rowi("Capacity (pages):", after.kv_offload_disk_capacity);
    rowi("Pages held at the end:", after.kv_offload_disk_pages);
    rowi("Pages written:", int64_t(disk_written));
    rowd("Write bandwidth (GB/s):", gbps(double(disk_written) * page_file, disk_write_s));
    rowi("Pages read back:", int64_t(disk_read));
    rowd("Read time (ms):", disk_read_s * 1e3);
    rowd("Read bandwidth (GB/s):", gbps(double(disk_read) * page_file, disk_read_s));
    rowd("Read per page (ms):", after.kv_offload_disk_page_seconds * 1e3, 3);
    rowi("Damaged files ignored:", int64_t(after.kv_offload_disk_damaged_total));
    rowi("Turns that waited for disk reads:", int64_t(restoring));
  }
  rule("", '=');
  std::fflush(stdout);
  if (!f.json.empty()) {
    j["model"] = opts.model_dir.string();
    j["kv_cache"] = kv_summary(*engine);
    j["kv_cache_capacity_tokens"] = plan.capacity_tokens;
    j["conversations"] = f.conversations;
    j["turns"] = f.turns;
    j["system_len"] = f.system_len;
    j["user_len"] = f.user_len;
    j["output_len"] = f.output_len;
    j["max_concurrency"] = limit;
    j["elapsed_time"] = elapsed;
    j["failed_requests"] = failed;
    j["total_input_tokens"] = prompt_tokens;
    j["cached_input_tokens"] = cached;
    j["total_output_tokens"] = output_tokens;
    j["host_tier"] = {{"capacity_pages", after.kv_offload_capacity},
                      {"restored_bytes", restored_bytes},
                      {"restored_pages", restored},
                      {"restore_seconds", restore_s},
                      {"stored_bytes", stored_bytes},
                      {"store_seconds", store_s},
                      {"pinned_h2d_bytes_per_s", h2d},
                      {"hit_tokens", tier_tokens},
                      {"exact_capacity_pages", after.kv_offload_exact_capacity},
                      {"exact_restored_pages",
                       after.kv_offload_exact_restored_total - before.kv_offload_exact_restored_total}};
    if (after.kv_offload_disk_capacity > 0)
      j["disk_tier"] = {{"capacity_pages", after.kv_offload_disk_capacity},
                        {"pages", after.kv_offload_disk_pages},
                        {"written_pages", disk_written},
                        {"write_seconds", disk_write_s},
                        {"read_pages", disk_read},
                        {"read_seconds", disk_read_s},
                        {"file_bytes", after.kv_offload_disk_bytes_per_page},
                        {"damaged_files", after.kv_offload_disk_damaged_total},
                        {"restoring_turns", restoring}};
    write_json(f.json, j);
  }
  if (failed) throw Error(std::to_string(failed) + " turns failed; the first: " + first_error);
  return 0;
}

}  // namespace kvlm::app

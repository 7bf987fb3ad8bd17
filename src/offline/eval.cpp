#include "offline/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <regex>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "sampling/sampler.h"
#include "offline/score.h"
#include "text/text_output.h"
#include "engine/async_engine.h"
#include "engine/memory_plan.h"

namespace kvlm {

namespace fs = std::filesystem;

// ---------------------------------------------------------------- perplexity
namespace {

// Saved log-probs: a header, the tokens of every window (so a comparison proves it saw the
// same text through the same tokenizer), then fp32 log-softmax rows of the scored tokens.
constexpr char kMagic[8] = {'K', 'V', 'L', 'M', 'L', 'G', 'P', '1'};
struct LogitsHeader {
  char magic[8];
  uint32_t vocab, ctx, chunks, reserved;
};

void log_softmax(std::span<const float> logits, std::span<float> out) {
  const float lse = log_sum_exp(logits);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - lse;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

}  // namespace

PerplexityResult eval_perplexity(LoadedModel& engine, const std::vector<TokenId>& tokens, const PerplexityOptions& opts,
                                 const std::function<void(int, int)>& progress) {
  const int ctx = opts.ctx;
  const size_t vocab = size_t(engine.config().vocab_size);
  if (ctx < 8) throw Error("--ctx must be at least 8 tokens");
  if (ctx > engine.config().max_position_embeddings)
    throw Error("--ctx " + std::to_string(ctx) + " exceeds the model's context length of " +
                std::to_string(engine.config().max_position_embeddings));
  int chunks = int(tokens.size() / size_t(ctx));
  if (opts.max_chunks > 0) chunks = std::min(chunks, opts.max_chunks);
  if (chunks < 1)
    throw Error("the text has " + std::to_string(tokens.size()) + " tokens, fewer than one window of --ctx " +
                std::to_string(ctx) + "; use a longer text or a smaller --ctx");
  const int first = ctx / 2;  // tokens [first, ctx) of each window are scored, with >= ctx/2 context

  std::ofstream save;
  std::ifstream base;
  const auto window_tokens = std::span(tokens).first(size_t(chunks) * size_t(ctx));
  if (opts.save_logits) {
    save.open(*opts.save_logits, std::ios::binary | std::ios::trunc);
    if (!save) throw Error("cannot write --save-logits file " + opts.save_logits->string());
    LogitsHeader h{};
    std::memcpy(h.magic, kMagic, 8);
    h.vocab = uint32_t(vocab);
    h.ctx = uint32_t(ctx);
    h.chunks = uint32_t(chunks);
    save.write(reinterpret_cast<const char*>(&h), sizeof h);
    save.write(reinterpret_cast<const char*>(window_tokens.data()), std::streamsize(window_tokens.size_bytes()));
  }
  if (opts.kld_base) {
    base.open(*opts.kld_base, std::ios::binary);
    if (!base) throw Error("cannot read --kl-divergence-base file " + opts.kld_base->string());
    LogitsHeader h{};
    base.read(reinterpret_cast<char*>(&h), sizeof h);
    if (!base || std::memcmp(h.magic, kMagic, 8) != 0)
      throw Error(opts.kld_base->string() + " is not a kvlm --save-logits file");
    if (h.vocab != vocab || h.ctx != uint32_t(ctx) || h.chunks < uint32_t(chunks))
      throw Error(opts.kld_base->string() + " was saved with vocab " + std::to_string(h.vocab) + ", --ctx " +
                  std::to_string(h.ctx) + ", " + std::to_string(h.chunks) + " windows; this run has vocab " +
                  std::to_string(vocab) + ", --ctx " + std::to_string(ctx) + ", " + std::to_string(chunks) +
                  " windows: use the same model, --ctx and text");
    std::vector<TokenId> saved(size_t(h.chunks) * size_t(ctx));
    base.read(reinterpret_cast<char*>(saved.data()), std::streamsize(saved.size() * sizeof(TokenId)));
    if (!base) throw Error(opts.kld_base->string() + " is truncated");
    if (!std::equal(window_tokens.begin(), window_tokens.end(), saved.begin()))
      throw Error(opts.kld_base->string() + " was saved for a different text or tokenizer (the token ids differ)");
    // Windows beyond this run's are skipped: rows of window c start after c full windows.
  }

  PerplexityResult r;
  r.chunks = chunks;
  r.has_base = bool(opts.kld_base);
  std::vector<double> nll, base_nll, kld;
  // Rows are scored as they arrive, so no window's [ctx][vocab] logits are held at once;
  // steps of up to 256 MiB of logits, scored in groups of kGroup rows across threads.
  const int step = int(std::clamp<size_t>((size_t(256) << 20) / (vocab * sizeof(float)), 16, size_t(ctx)));
  constexpr int kGroup = 16;
  std::vector<float> lp(kGroup * vocab), blp(r.has_base ? kGroup * vocab : 0);
  struct RowScore {
    double nll = 0, base_nll = 0, kld = 0;
    bool same = false;
  };
  std::vector<RowScore> scores(kGroup);
  int same = 0;
  for (int c = 0; c < chunks; ++c) {
    const auto win = window_tokens.subspan(size_t(c) * size_t(ctx), size_t(ctx));
    const size_t kld_before = kld.size();
    // Row j: next-token logits after token j; token i = j + 1 is scored by it. Rows before
    // first - 1 need no logits.
    auto score_rows = [&](int row0, std::span<const float> rows) {
      const int j0 = std::max(row0, first - 1), j1 = std::min(row0 + int(rows.size() / vocab), ctx - 1);
      for (int g0 = j0; g0 < j1; g0 += kGroup) {
        const int g = std::min(kGroup, j1 - g0);
        if (r.has_base) {
          base.read(reinterpret_cast<char*>(blp.data()), std::streamsize(size_t(g) * vocab * sizeof(float)));
          if (!base) throw Error(opts.kld_base->string() + " is truncated");
        }
#pragma omp parallel for schedule(static)
        for (int q = 0; q < g; ++q) {
          const std::span<float> out = std::span(lp).subspan(size_t(q) * vocab, vocab);
          log_softmax(rows.subspan(size_t(g0 + q - row0) * vocab, vocab), out);
          const size_t t = size_t(win[size_t(g0 + q + 1)]);
          RowScore& sc = scores[size_t(q)];
          sc.nll = -double(out[t]);
          if (!r.has_base) continue;
          const std::span<const float> b = std::span(blp).subspan(size_t(q) * vocab, vocab);
          double k = 0;
          size_t top = 0, btop = 0;
          for (size_t v = 0; v < vocab; ++v) {
            k += double(std::exp(b[v])) * (double(b[v]) - double(out[v]));
            if (out[v] > out[top]) top = v;
            if (b[v] > b[btop]) btop = v;
          }
          sc.kld = std::max(k, 0.0);
          sc.same = top == btop;
          sc.base_nll = -double(b[t]);
        }
        for (int q = 0; q < g; ++q) {
          nll.push_back(scores[size_t(q)].nll);
          if (!r.has_base) continue;
          kld.push_back(scores[size_t(q)].kld);
          base_nll.push_back(scores[size_t(q)].base_nll);
          same += scores[size_t(q)].same;
        }
        if (save.is_open())
          save.write(reinterpret_cast<const char*>(lp.data()), std::streamsize(size_t(g) * vocab * sizeof(float)));
      }
    };
    score_tokens(engine, win, step, score_rows, first - 1, opts.decode_steps ? 1 : 0);
    if (r.has_base) {
      double w = 0;
      for (size_t i = kld_before; i < kld.size(); ++i) w += kld[i];
      r.kld_windows.push_back(w / double(kld.size() - kld_before));
    }
    if (progress) progress(c + 1, chunks);
  }
  if (save.is_open() && !save.flush()) throw Error("cannot write --save-logits file " + opts.save_logits->string());

  const double n = double(nll.size());
  r.scored_tokens = int64_t(nll.size());
  auto mean_sd = [](const std::vector<double>& v) {
    double m = 0;
    for (double x : v) m += x;
    m /= double(v.size());
    double s = 0;
    for (double x : v) s += (x - m) * (x - m);
    return std::pair{m, v.size() > 1 ? std::sqrt(s / double(v.size() - 1)) : 0.0};
  };
  const auto [m, sd] = mean_sd(nll);
  r.ppl = std::exp(m);
  r.ppl_err = r.ppl * sd / std::sqrt(n);
  if (r.has_base) {
    const auto [bm, bsd] = mean_sd(base_nll);
    (void)bsd;
    r.base_ppl = std::exp(bm);
    std::vector<double> d(nll.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = nll[i] - base_nll[i];
    const auto [dm, dsd] = mean_sd(d);
    // PPL / base PPL = exp(mean d); the per-token differences give its standard error.
    r.delta_ppl = r.ppl - r.base_ppl;
    r.delta_ppl_ci95 = 1.96 * r.base_ppl * std::exp(dm) * dsd / std::sqrt(n);
    const auto [km, ksd] = mean_sd(kld);
    r.kld_mean = km;
    r.kld_mean_err = ksd / std::sqrt(n);
    r.kld_median = percentile(kld, 0.5);
    r.kld_p99 = percentile(kld, 0.99);
    r.kld_max = *std::max_element(kld.begin(), kld.end());
    r.same_top = double(same) / n;
  }
  return r;
}

// ---------------------------------------------------------------- tasks
std::vector<TaskItem> load_task_file(const fs::path& path) {
  std::ifstream f(path);
  if (!f) throw Error("cannot read task file " + path.string());
  std::vector<TaskItem> items;
  std::string line;
  for (int lineno = 1; std::getline(f, line); ++lineno) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path.string() + ":" + std::to_string(lineno);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw Error(where + ": not valid JSON (" + std::string(e.what()) + ")");
    }
    if (!j.is_object()) throw Error(where + ": each line must be a JSON object with \"prompt\" and \"answer\"");
    TaskItem it;
    if (!j.contains("prompt") || !j["prompt"].is_string()) throw Error(where + ": \"prompt\" must be a string");
    it.prompt = j["prompt"].get<std::string>();
    if (!j.contains("answer")) throw Error(where + ": \"answer\" is missing");
    if (j["answer"].is_string()) it.answer = j["answer"].get<std::string>();
    else if (j["answer"].is_number()) it.answer = j["answer"].dump();
    else throw Error(where + ": \"answer\" must be a string or a number");
    if (j.contains("regex")) {
      if (!j["regex"].is_string()) throw Error(where + ": \"regex\" must be a string");
      it.regex = j["regex"].get<std::string>();
      try {
        std::regex check(it.regex);
      } catch (const std::regex_error& e) {
        throw Error(where + ": \"regex\" is not a valid regular expression (" + std::string(e.what()) + ")");
      }
    }
    if (j.contains("stop")) {
      const auto& s = j["stop"];
      if (s.is_string()) it.stop.push_back(s.get<std::string>());
      else if (s.is_array() && std::all_of(s.begin(), s.end(), [](const auto& x) { return x.is_string(); }))
        for (const auto& x : s) it.stop.push_back(x.get<std::string>());
      else throw Error(where + ": \"stop\" must be a string or a list of strings");
    }
    items.push_back(std::move(it));
  }
  if (items.empty()) throw Error(path.string() + " has no items");
  return items;
}

namespace {
std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}
}  // namespace

std::optional<std::string> extract_answer(const std::string& completion, const std::string& regex) {
  if (regex.empty()) return trim(completion);
  std::smatch m;
  const std::regex re(regex);
  if (!std::regex_search(completion, m, re)) return std::nullopt;
  return trim(m.size() > 1 && m[1].matched ? m[1].str() : m[0].str());
}

TaskResult eval_task(LoadedModel& engine, const TextProcessor& text, const std::vector<TaskItem>& all_items,
                     const TaskOptions& opts, const std::function<void(int, int)>& progress) {
  const size_t n = opts.limit > 0 ? std::min(all_items.size(), size_t(opts.limit)) : all_items.size();
  std::vector<std::vector<TokenId>> prompts(n);
  int longest = 0;
  for (size_t i = 0; i < n; ++i) {
    prompts[i] = text.encode_prompt(all_items[i].prompt);
    longest = std::max(longest, int(prompts[i].size()));
  }
  const int ctx = engine.config().max_position_embeddings;
  const int max_len = std::min(ctx, longest + opts.max_tokens);
  MemoryOptions mo;
  mo.max_model_len = max_len;
  mo.max_num_seqs = opts.max_num_seqs;
  mo.max_num_batched_tokens = opts.max_num_batched_tokens;
  const MemoryPlan mp = plan_kv_memory(engine, mo);

  TaskResult r;
  r.outcomes.resize(n);
  std::vector<std::unique_ptr<TextOutput>> live(n);
  std::mutex mu;
  std::condition_variable cv;
  size_t done = 0;
  std::vector<std::string> errors;
  const auto t0 = std::chrono::steady_clock::now();
  {
    AsyncEngine ae(engine, SchedulerConfig{.max_num_seqs = opts.max_num_seqs,
                                           .max_num_batched_tokens = opts.max_num_batched_tokens,
                                           .max_model_len = max_len,
                                           .enable_prefix_caching = true,
                                           .num_blocks = mp.num_blocks,
                                           .state_snapshots = mp.state_snapshots});
    for (size_t i = 0; i < n; ++i) {
      live[i] = std::make_unique<TextOutput>(text.tokenizer(), all_items[i].stop);
      EngineRequest req;
      req.id = "task-" + std::to_string(i);
      req.prompt = prompts[i];
      req.sampling.temperature = 0;
      req.max_tokens = std::min(opts.max_tokens, max_len - int(prompts[i].size()));
      if (req.max_tokens < 1)
        throw Error("item " + std::to_string(i + 1) + "'s prompt (" + std::to_string(prompts[i].size()) +
                    " tokens) fills the model's context of " + std::to_string(ctx) + " tokens");
      req.on_output = [&, i](const RequestOutput& o) {
        TaskOutcome& out = r.outcomes[i];
        TextOutput& l = *live[i];
        for (TokenId t : o.new_tokens) out.completion += l.push(t);
        const bool keep = !l.stopped();
        if (o.finished) {
          out.completion += l.finish();
          out.prompt_tokens = o.prompt_tokens;
          out.completion_tokens = o.completion_tokens;
          std::lock_guard lock(mu);
          if (o.finish_reason == FinishReason::Error) errors.push_back(o.error);
          ++done;
          cv.notify_all();
        }
        return keep;
      };
      ae.add_request(std::move(req));
    }
    std::unique_lock lock(mu);
    while (done < n) {
      cv.wait_for(lock, std::chrono::milliseconds(200));
      if (progress) {
        const int d = int(done);
        lock.unlock();
        progress(d, int(n));
        lock.lock();
      }
    }
  }
  if (!errors.empty()) throw Error("the engine failed on " + std::to_string(errors.size()) + " items: " + errors.front());
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (size_t i = 0; i < n; ++i) {
    TaskOutcome& o = r.outcomes[i];
    o.extracted = extract_answer(o.completion, all_items[i].regex);
    o.correct = o.extracted && *o.extracted == trim(all_items[i].answer);
    r.correct += o.correct;
    r.prompt_tokens += o.prompt_tokens;
    r.completion_tokens += o.completion_tokens;
  }
  r.accuracy = n ? double(r.correct) / double(n) : 0;
  return r;
}

}  // namespace kvlm

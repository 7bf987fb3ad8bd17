#include "server/grammar_cache.h"

#include <algorithm>
#include <system_error>

#include "core/error.h"
#include "text/tokenizer/tokenizer.h"

namespace kvlm::server {

using Clock = std::chrono::steady_clock;

struct GrammarCache::Job {
  std::shared_ptr<const grammar::Grammar> g;
  std::shared_ptr<const grammar::TokenVocab> vocab;
  std::string key;
  Clock::time_point deadline;
  std::promise<Compiled> done;
};

GrammarCache::GrammarCache(GrammarCacheLimits lim) : lim_(lim) {
  if (lim_.threads <= 0) lim_.threads = int(std::max(2u, std::thread::hardware_concurrency() / 8));
}

GrammarCache::~GrammarCache() {
  std::deque<std::shared_ptr<Job>> left;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    left.swap(queue_);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  for (auto& job : left) job->done.set_exception(std::make_exception_ptr(GrammarCacheBusy("the server is stopping")));
}

size_t GrammarCache::size() const {
  std::lock_guard lock(mu_);
  return compiled_.size();
}

size_t GrammarCache::bytes() const {
  std::lock_guard lock(mu_);
  return bytes_locked();
}

size_t GrammarCache::entry_bytes(const Compiled& cg) { return cg->table_bytes() + cg->cached_bytes(); }

size_t GrammarCache::bytes_locked() const {
  size_t b = 0;
  for (const auto& [_, e] : compiled_) b += entry_bytes(e.cg);
  return b;
}

std::shared_ptr<const grammar::CompiledGrammar> GrammarCache::get(const Tokenizer& tok, int vocab_size,
                                                                  std::shared_ptr<const grammar::Grammar> g,
                                                                  const std::string& key) {
  const auto budget = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(lim_.compile_seconds));
  std::shared_future<Compiled> fut;
  {
    std::lock_guard lock(mu_);
    if (auto it = compiled_.find(key); it != compiled_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.pos);
      return it->second.cg;
    }
  }
  std::shared_ptr<const grammar::TokenVocab> vocab;
  {
    std::lock_guard lock(vocab_mu_);  // (a 150k vocabulary takes a moment; built once)
    if (!vocab_) vocab_ = std::make_shared<const grammar::TokenVocab>(tok, vocab_size);
    vocab = vocab_;
  }
  {
    std::lock_guard lock(mu_);
    if (auto it = compiled_.find(key); it != compiled_.end()) return it->second.cg;
    if (auto it = pending_.find(key); it != pending_.end()) {
      fut = it->second;  // the same grammar, being compiled for another request
    } else {
      // Each waiting request holds an HTTP worker: past a few queued compiles, new ones are
      // turned away at once (503) rather than piling up behind a client's heavy grammars.
      if (queue_.size() >= lim_.max_queued)
        throw GrammarCacheBusy("the server is compiling " + std::to_string(queue_.size()) +
                               " output constraints already; retry shortly");
      // A thread per queued job, up to the limit; they stay for the next ones. Started first,
      // so that a job is never queued with no thread to run it.
      if (threads_.size() < size_t(lim_.threads)) {
        try {
          threads_.emplace_back([this] { work(); });
        } catch (const std::system_error&) {
          if (threads_.empty()) throw GrammarCacheBusy("no thread could be started to compile the output constraint");
        }
      }
      auto job = std::make_shared<Job>();
      job->g = std::move(g);
      job->vocab = std::move(vocab);
      job->key = key;
      job->deadline = Clock::now() + budget;
      fut = job->done.get_future().share();
      pending_.emplace(key, fut);
      queue_.push_back(job);
    }
  }
  cv_.notify_one();
  // The job enforces the budget; the wait has a margin in case its thread is starved.
  if (fut.wait_for(budget + std::chrono::seconds(5)) != std::future_status::ready)
    throw Error("compiling the output constraint took longer than this server's budget of " +
                std::to_string(int(lim_.compile_seconds)) + " s; simplify the schema or grammar");
  return fut.get();  // rethrows the compile's kvlm::Error
}

void GrammarCache::work() {
  grammar::lower_thread_priority();
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    std::shared_ptr<Job> job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    Compiled cg;
    std::exception_ptr failed;
    try {
      cg = compile(*job);
    } catch (...) {
      failed = std::current_exception();
    }
    lock.lock();
    pending_.erase(job->key);
    if (cg) keep(job->key, cg);  // a failed compile is not kept
    if (failed) job->done.set_exception(failed);
    else job->done.set_value(cg);
  }
}

GrammarCache::Compiled GrammarCache::compile(const Job& job) {
  const std::string over = "compiling the output constraint took longer than this server's budget of " +
                           std::to_string(int(lim_.compile_seconds)) + " s";
  if (Clock::now() > job.deadline) throw Error(over + " (it waited behind other grammars being compiled; retry)");
  auto cg = std::make_shared<grammar::CompiledGrammar>(*job.g, job.vocab);
  // The initial state (an ambiguous grammar fails here) and its mask, so that the engine
  // never waits on a grammar that cannot start.
  cg->set_deadline(job.deadline);
  try {
    const grammar::CompiledGrammar::State s0 = cg->initial();
    if (cg->mask(s0)->count() == 0 && !grammar::CompiledGrammar::accepting(s0))
      throw Error("no token of the model's vocabulary can begin the output this constraint requires");
  } catch (const grammar::GrammarTimeout&) {
    throw Error(over + "; simplify the schema or grammar");
  }
  cg->set_deadline(std::nullopt);
  if (Clock::now() > job.deadline) throw Error(over + "; simplify the schema or grammar");
  return cg;
}

void GrammarCache::keep(const std::string& key, const Compiled& cg) {
  if (compiled_.count(key)) return;
  lru_.push_front(key);
  compiled_.emplace(key, Entry{cg, lru_.begin()});
  size_t bytes = bytes_locked();  // masks are cached as they are used: counted afresh
  while (!lru_.empty() && (compiled_.size() > lim_.max_grammars || bytes > lim_.max_bytes)) {
    auto it = compiled_.find(lru_.back());
    bytes -= std::min(bytes, entry_bytes(it->second.cg));
    compiled_.erase(it);
    lru_.pop_back();
  }
}

}  // namespace kvlm::server

// The server's compiled grammars for structured outputs: the model's vocabulary as the
// matcher sees it (built once, on the first constrained request), and the grammars compiled
// recently, by request key, so that requests with the same schema share their cached masks.
//
// A grammar is the client's text, so compiling one is bounded like any other work a request
// asks for: the front ends cap its size (grammar.h's limits); the compile runs on the cache's
// own threads at a lower scheduling priority (it never takes a core from the engine's step);
// and it must finish — tables, initial state (where an ambiguous grammar fails) and first
// mask — within a time budget counted from when it is asked for (waiting behind other compiles
// included), or the request gets a 400
// before it reaches the engine. A failed compile is not kept. The cache holds grammars up to
// a count and a byte budget that counts each grammar's tables and cached masks, evicting the
// least recently used (grammars in use live on with their requests).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "text/grammar/matcher.h"

namespace kvlm {
class Tokenizer;
}

namespace kvlm::server {

// The cache cannot take a compile now (too many queued, or stopping): a 503, not the
// request's fault.
class GrammarCacheBusy : public Error {
 public:
  using Error::Error;
};

struct GrammarCacheLimits {
  double compile_seconds = 10;           // a compile's budget, from the request's arrival
  size_t max_grammars = 64;              // kept for reuse
  size_t max_bytes = size_t(256) << 20;  // kept for reuse: tables and cached masks
  int threads = 0;                       // compile threads; 0: max(2, cores / 8)
  size_t max_queued = 16;                // compiles waiting for a thread; more get GrammarCacheBusy
};

class GrammarCache {
 public:
  explicit GrammarCache(GrammarCacheLimits lim = {});
  ~GrammarCache();
  GrammarCache(const GrammarCache&) = delete;
  GrammarCache& operator=(const GrammarCache&) = delete;

  // The compiled grammar for `key` (compiled now, or found). Throws kvlm::Error when the
  // grammar cannot be compiled or the budget runs out.
  std::shared_ptr<const grammar::CompiledGrammar> get(const Tokenizer& tok, int vocab_size,
                                                      std::shared_ptr<const grammar::Grammar> g, const std::string& key);

  // For tests and /metrics.
  size_t size() const;
  size_t bytes() const;
  const GrammarCacheLimits& limits() const { return lim_; }

 private:
  using Compiled = std::shared_ptr<const grammar::CompiledGrammar>;
  struct Job;
  void work();
  Compiled compile(const Job& job);
  void keep(const std::string& key, const Compiled& cg);  // under mu_
  static size_t entry_bytes(const Compiled& cg);          // its tables and cached masks
  size_t bytes_locked() const;                            // under mu_

  GrammarCacheLimits lim_;
  std::mutex vocab_mu_;
  std::shared_ptr<const grammar::TokenVocab> vocab_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::list<std::string> lru_;  // most recently used first
  struct Entry {
    Compiled cg;
    std::list<std::string>::iterator pos;
  };
  std::unordered_map<std::string, Entry> compiled_;
  std::unordered_map<std::string, std::shared_future<Compiled>> pending_;  // being compiled, by key
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

}  // namespace kvlm::server

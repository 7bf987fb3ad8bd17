// The serving engine: continuous batching on a thread of its own.
//
// add_request() validates and queues; the engine thread runs scheduler steps (chunked
// prefill of new requests alongside decode of running ones, preemption by recompute when
// the KV pool is full, prefix caching) and delivers each request's output through its
// callback. Thread-safe: any thread may add, abort or read stats.
#pragma once

#include <memory>
#include <string>

#include "core/error.h"
#include "model/loaded_model.h"
#include "engine/metrics.h"
#include "engine/request.h"
#include "engine/scheduler.h"  // SchedulerConfig

namespace kvlm {


// What add_request throws once shutdown has begun: the request was fine, the engine is
// going away (a server answers 503, not 400).
class EngineShutDown : public Error {
 public:
  EngineShutDown() : Error("the server is shutting down and accepts no new requests") {}
};

class AsyncEngine {
 public:
  // Allocates the model runner's KV pool (cfg.num_blocks pages) and starts the engine thread.
  AsyncEngine(LoadedModel& model, SchedulerConfig cfg);
  ~AsyncEngine();  // shutdown(false)
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Throws kvlm::Error (a message for the client, HTTP 400) when the request is invalid:
  // empty prompt, token ids outside the vocabulary, prompt + max_tokens over max_model_len,
  // bad sampling values, a duplicate live id; EngineShutDown after shutdown began.
  void add_request(EngineRequest req);
  // Finishes a live request with FinishReason::Abort (its callback hears it); frees its
  // pages before the next step. Unknown or finished ids are ignored.
  void abort(const std::string& id);
  EngineStats stats() const;
  // Why the engine thread stopped on its own (a step threw: a broken invariant, a device
  // error, a tensor-parallel node that failed), or empty while it runs.
  std::string failure() const;
  // Stops accepting requests; drain = let in-flight requests finish, else abort them.
  // Returns when the engine thread has exited.
  void shutdown(bool drain);

  const SchedulerConfig& config() const;
  int block_size() const;
  LoadedModel& model();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvlm

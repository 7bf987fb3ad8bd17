#include "engine/async_engine.h"

#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "engine/llm_engine.h"

namespace kvlm {

struct AsyncEngine::Impl {
  LLMEngine core;
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<EngineRequest> incoming;  // accepted, not yet handed to the core
  std::vector<std::string> aborts;
  std::unordered_set<std::string> live;  // ids accepted and not yet finished
  EngineStats snapshot;
  bool accepting = true;
  bool stopping = false;
  std::string failure;  // set when a step threw
  bool drain = true;
  std::thread thread;

  Impl(LoadedModel& e, SchedulerConfig cfg) : core(e, cfg) {
    snapshot = core.stats();
    core.set_stats_listener([this](const EngineStats& st) {
      std::lock_guard lock(mu);
      snapshot = st;
    });
  }

  void run() {
    std::vector<EngineRequest> batch;
    std::vector<std::string> cancel;
    for (;;) {
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return !incoming.empty() || !aborts.empty() || core.has_work() || stopping; });
        batch.swap(incoming);
        cancel.swap(aborts);
        if (stopping && !drain)
          for (const auto& id : live) cancel.push_back(id);
        if (stopping && batch.empty() && cancel.empty() && !core.has_work()) break;
      }
      for (auto& r : batch) {
        const std::string id = r.id;
        OutputCallback cb = r.on_output;
        try {
          core.add_request(std::move(r));
        } catch (const std::exception& e) {
          // Validated on the caller's thread already; this is a limit reached meanwhile.
          RequestOutput out;
          out.id = id;
          out.finished = true;
          out.finish_reason = FinishReason::Error;
          out.error = e.what();
          if (cb) cb(out);
          std::lock_guard lock(mu);
          live.erase(id);
        }
      }
      batch.clear();
      for (const auto& id : cancel) core.abort(id);
      cancel.clear();
      try {
        core.step();
      } catch (const std::exception& e) {
        // An invariant broke inside the scheduler: nothing can be trusted any more.
        log::error(std::string("serving engine stopped: ") + e.what());
        std::lock_guard lock(mu);
        failure = e.what();
        accepting = false;
        stopping = true;
        drain = false;
        break;
      }
      std::lock_guard lock(mu);
      snapshot = core.stats();
    }
  }
};

AsyncEngine::AsyncEngine(LoadedModel& engine, SchedulerConfig cfg) : impl_(std::make_unique<Impl>(engine, cfg)) {
  impl_->thread = std::thread([this] { impl_->run(); });
}

AsyncEngine::~AsyncEngine() { shutdown(false); }

std::string AsyncEngine::failure() const {
  std::lock_guard lock(impl_->mu);
  return impl_->failure;
}

void AsyncEngine::add_request(EngineRequest req) {
  // The checks that need no engine state run here, so the caller gets the error at once.
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->accepting) throw EngineShutDown();
    if (impl_->live.count(req.id)) throw Error("request id '" + req.id + "' is already in use");
  }
  impl_->core.check_request(req);
  // Wrap the callback so the id leaves `live` when its request finishes.
  OutputCallback user = std::move(req.on_output);
  Impl* impl = impl_.get();
  req.on_output = [impl, user = std::move(user)](const RequestOutput& out) {
    bool keep = true;
    if (user) keep = user(out);
    if (out.finished) {
      std::lock_guard lock(impl->mu);
      impl->live.erase(out.id);
    }
    return keep;
  };
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->accepting) throw EngineShutDown();
    if (!impl_->live.insert(req.id).second) throw Error("request id '" + req.id + "' is already in use");
    impl_->incoming.push_back(std::move(req));
  }
  impl_->cv.notify_one();
}

void AsyncEngine::abort(const std::string& id) {
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->live.count(id)) return;
    impl_->aborts.push_back(id);
  }
  impl_->cv.notify_one();
}

EngineStats AsyncEngine::stats() const {
  std::lock_guard lock(impl_->mu);
  EngineStats s = impl_->snapshot;
  s.num_waiting += int(impl_->incoming.size());
  return s;
}

void AsyncEngine::shutdown(bool drain) {
  {
    std::lock_guard lock(impl_->mu);
    impl_->accepting = false;
    if (!impl_->stopping) impl_->drain = drain;
    else if (!drain) impl_->drain = false;
    impl_->stopping = true;
  }
  impl_->cv.notify_one();
  if (impl_->thread.joinable()) impl_->thread.join();
}

const SchedulerConfig& AsyncEngine::config() const { return impl_->core.config(); }
int AsyncEngine::block_size() const { return impl_->core.blocks().block_size(); }
LoadedModel& AsyncEngine::model() { return impl_->core.model(); }

}  // namespace kvlm

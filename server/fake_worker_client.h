// A WorkerClient for unit tests of the coordinator's parts: it records what
// reaches "the worker" and leaves each step pending until the test fires
// its callback (CompleteRun), the way a real worker answers later, on
// another thread. Frees complete at once.
//
// `on_call`, when set, runs on another thread inside every Run and Free,
// and must finish within a few seconds: a test points it at a coordinator
// method that takes the coordinator's locks, so a call made under one of
// them is caught (the hook times out) rather than deadlocking.
#pragma once

#include <chrono>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "server/worker_client.h"

namespace tessel::server {

class FakeWorkerClient final : public WorkerClient {
 public:
  struct Message {
    bool run = false;  // else a free
    v1::RunRequest run_request;
    v1::FreeRequest free_request;
    uint64_t seq() const { return run ? run_request.seq() : free_request.seq(); }
    uint64_t queue_epoch() const {
      return run ? run_request.queue_epoch() : free_request.queue_epoch();
    }
  };

  explicit FakeWorkerClient(std::string address) : address_(std::move(address)) {}

  absl::Status LoadProgram(const v1::Program& program, uint64_t) override {
    CheckNotUnderLock();
    absl::MutexLock l(&mu_);
    loads_.push_back(program);
    return load_error_;
  }
  void Run(const v1::RunRequest& r, RunDone done) override {
    CheckNotUnderLock();
    {
      absl::MutexLock l(&mu_);
      if (!cancelled_) {
        messages_.push_back(Message{true, r, {}});
        pending_.push_back(std::move(done));
        return;
      }
    }
    done(absl::UnavailableError("cancelled"));
  }
  void Free(const v1::FreeRequest& r, Done done) override {
    CheckNotUnderLock();
    {
      absl::MutexLock l(&mu_);
      messages_.push_back(Message{false, {}, r});
    }
    done(absl::OkStatus());
  }
  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(const v1::PutShardRequest::Header&) override {
    return absl::UnimplementedError("fake worker: no puts");
  }
  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest&) override { return nullptr; }
  absl::StatusOr<v1::WorkerStatsResponse> GetStats(const v1::WorkerStatsRequest& r) override {
    v1::WorkerStatsResponse resp;
    absl::MutexLock l(&mu_);
    if (r.with_buffers()) *resp.mutable_buffers() = held_;
    return resp;
  }
  void CancelAll() override {
    std::vector<RunDone> pending;
    {
      absl::MutexLock l(&mu_);
      cancelled_ = true;
      pending.swap(pending_);
    }
    for (auto& d : pending) {
      if (d) d(absl::UnavailableError("cancelled"));
    }
  }
  void SetStepsLostCallback(std::function<void()> f) override {
    absl::MutexLock l(&mu_);
    on_lost_ = std::move(f);
  }

  // Test side.
  void set_on_call(std::function<void()> f) {
    absl::MutexLock l(&mu_);
    on_call_ = std::move(f);
  }
  void set_load_error(absl::Status s) {
    absl::MutexLock l(&mu_);
    load_error_ = std::move(s);
  }
  // What GetStats(with_buffers) lists as held.
  void set_held(std::vector<v1::StoredBuffer> held) {
    absl::MutexLock l(&mu_);
    held_.Clear();
    for (auto& b : held) *held_.Add() = std::move(b);
  }
  // Fires the callback of the i-th Run (in arrival order).
  void CompleteRun(size_t i, absl::StatusOr<v1::RunResponse> result) {
    RunDone done;
    {
      absl::MutexLock l(&mu_);
      if (i >= pending_.size() || !pending_[i]) return;
      done = std::move(pending_[i]);
      pending_[i] = nullptr;
    }
    done(std::move(result));
  }
  void LoseSteps() {
    std::function<void()> f;
    {
      absl::MutexLock l(&mu_);
      f = on_lost_;
    }
    if (f) f();
  }
  std::vector<Message> messages() const {
    absl::MutexLock l(&mu_);
    return messages_;
  }
  std::vector<v1::RunRequest> runs() const {
    std::vector<v1::RunRequest> out;
    for (const Message& m : messages()) {
      if (m.run) out.push_back(m.run_request);
    }
    return out;
  }
  size_t loads() const {
    absl::MutexLock l(&mu_);
    return loads_.size();
  }
  bool cancelled() const {
    absl::MutexLock l(&mu_);
    return cancelled_;
  }
  int calls_under_lock() const {
    absl::MutexLock l(&mu_);
    return calls_under_lock_;
  }
  const std::string& address() const { return address_; }

 private:
  void CheckNotUnderLock() {
    std::function<void()> hook;
    {
      absl::MutexLock l(&mu_);
      hook = on_call_;
    }
    if (!hook) return;
    auto f = std::async(std::launch::async, hook);
    if (f.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      absl::MutexLock l(&mu_);
      ++calls_under_lock_;
      stuck_.push_back(std::move(f));  // finishes once the caller lets go of its lock
    }
  }

  const std::string address_;
  mutable absl::Mutex mu_;
  std::vector<Message> messages_ ABSL_GUARDED_BY(mu_);
  std::vector<RunDone> pending_ ABSL_GUARDED_BY(mu_);
  std::vector<v1::Program> loads_ ABSL_GUARDED_BY(mu_);
  absl::Status load_error_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  int calls_under_lock_ ABSL_GUARDED_BY(mu_) = 0;
  std::function<void()> on_call_ ABSL_GUARDED_BY(mu_);
  std::vector<std::future<void>> stuck_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_lost_ ABSL_GUARDED_BY(mu_);
  google::protobuf::RepeatedPtrField<v1::StoredBuffer> held_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessel::server

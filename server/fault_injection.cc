#include "server/fault_injection.h"

#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace tessel::server {
namespace {

class FaultInjectingWorkerClient final : public WorkerClient {
 public:
  FaultInjectingWorkerClient(std::shared_ptr<WorkerClient> inner, FaultPlan plan, std::string name)
      : inner_(std::move(inner)),
        plan_(plan),
        name_(std::move(name)),
        rng_(plan.seed ^ std::hash<std::string>{}(name_)) {
    inner_->SetStepsLostCallback([this] { StepsLost(); });
    sender_ = std::thread([this] { SendLoop(); });
  }
  ~FaultInjectingWorkerClient() override {
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    sender_.join();
  }

  absl::Status LoadProgram(const v1::Program& program, uint64_t generation) override {
    if (Roll(plan_.fail_load)) {
      return absl::UnavailableError(
          absl::StrCat("worker ", name_, " unavailable: injected fault: program load failed"));
    }
    return inner_->LoadProgram(program, generation);
  }

  void Run(const v1::RunRequest& request, RunDone done) override {
    Step(
        request.execution_id(),
        [this, request, done]() mutable { inner_->Run(request, std::move(done)); },
        [done](absl::Status s) { done(std::move(s)); });
  }

  void Free(const v1::FreeRequest& request, Done done) override {
    Step(
        0, [this, request, done]() mutable { inner_->Free(request, std::move(done)); }, done);
  }

  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(
      const v1::PutShardRequest::Header& header) override {
    return inner_->BeginPut(header);
  }
  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest& request) override {
    return inner_->BeginFetch(request);
  }
  absl::StatusOr<v1::WorkerStatsResponse> GetStats(const v1::WorkerStatsRequest& request) override {
    return inner_->GetStats(request);
  }
  absl::Status OpenWrites(const v1::OpenWritesRequest& request) override {
    return inner_->OpenWrites(request);
  }
  absl::StatusOr<v1::TraceResponse> Trace(const v1::TraceRequest& request) override {
    return inner_->Trace(request);
  }
  void CancelAll() override { inner_->CancelAll(); }

  void SetStepsLostCallback(std::function<void()> on_lost) override {
    absl::MutexLock l(&mu_);
    on_lost_ = std::move(on_lost);
  }

 private:
  bool Roll(double p) {
    if (p <= 0) return false;
    absl::MutexLock l(&mu_);
    return std::uniform_real_distribution<double>(0, 1)(rng_) < p;
  }

  void StepsLost() {
    std::function<void()> f;
    {
      absl::MutexLock l(&mu_);
      f = on_lost_;
    }
    if (f) f();
  }

  void Step(int64_t execution, std::function<void()> send, std::function<void(absl::Status)> fail) {
    if (Roll(plan_.drop_step)) {
      fail(absl::UnavailableError(absl::StrCat(
          "worker ", name_, " unavailable: injected fault: step",
          execution ? absl::StrCat(" of execution ", execution) : "", " lost in transit")));
      StepsLost();
      return;
    }
    absl::MutexLock l(&mu_);
    if (plan_.delay_step > 0 &&
        std::uniform_real_distribution<double>(0, 1)(rng_) < plan_.delay_step) {
      const absl::Duration d = plan_.max_delay * std::uniform_real_distribution<double>(0, 1)(rng_);
      held_.emplace(absl::Now() + d, std::move(send));
      return;
    }
    // Later steps are not kept behind held ones: the worker sees them out of
    // order, as a reordering transport would deliver them.
    mu_.Unlock();
    send();
    mu_.Lock();
  }

  void SendLoop() {
    absl::MutexLock l(&mu_);
    while (true) {
      auto due = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || (!held_.empty() && held_.begin()->first <= absl::Now());
      };
      mu_.AwaitWithTimeout(absl::Condition(&due), absl::Milliseconds(2));
      if (stop_ && held_.empty()) return;
      std::vector<std::function<void()>> ready;
      while (!held_.empty() && (stop_ || held_.begin()->first <= absl::Now())) {
        ready.push_back(std::move(held_.begin()->second));
        held_.erase(held_.begin());
      }
      mu_.Unlock();
      for (auto& f : ready) f();
      mu_.Lock();
    }
  }

  const std::shared_ptr<WorkerClient> inner_;
  const FaultPlan plan_;
  const std::string name_;
  absl::Mutex mu_;
  std::mt19937_64 rng_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, std::function<void()>> held_ ABSL_GUARDED_BY(mu_);
  std::function<void()> on_lost_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sender_;
};

}  // namespace

absl::StatusOr<FaultPlan> FaultPlan::Parse(absl::string_view spec) {
  FaultPlan plan;
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(item, absl::MaxSplits('=', 1));
    double v = 0;
    if (!absl::SimpleAtod(kv.second, &v)) {
      return absl::InvalidArgumentError(absl::StrCat("fault plan '", spec, "': '", kv.first,
                                                     "' expects a number, got '", kv.second, "'"));
    }
    auto probability = [&](double* field) -> absl::Status {
      if (v < 0 || v > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "fault plan '", spec, "': ", kv.first, " expects a probability in [0, 1], got ", v));
      }
      *field = v;
      return absl::OkStatus();
    };
    absl::Status s;
    if (kv.first == "drop_step") {
      s = probability(&plan.drop_step);
    } else if (kv.first == "delay_step") {
      s = probability(&plan.delay_step);
    } else if (kv.first == "fail_load") {
      s = probability(&plan.fail_load);
    } else if (kv.first == "max_delay_ms") {
      plan.max_delay = absl::Milliseconds(v);
    } else if (kv.first == "seed") {
      plan.seed = uint64_t(v);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("fault plan '", spec, "': unknown key '", kv.first,
                       "' (expected drop_step, delay_step, fail_load, max_delay_ms, seed)"));
    }
    if (!s.ok()) return s;
  }
  return plan;
}

std::shared_ptr<WorkerClient> WithFaults(std::shared_ptr<WorkerClient> inner, FaultPlan plan,
                                         std::string name) {
  return std::make_shared<FaultInjectingWorkerClient>(std::move(inner), plan, std::move(name));
}

}  // namespace tessel::server

// The fault-injecting WorkerClient over a fake one whose calls the test
// completes: what is lost never reaches the worker and says so, what is held
// back arrives later and out of order, and a bad plan is a clear error.
#include "server/fault_injection.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace tessel::server {
namespace {

// Records the steps that reach "the worker"; completes each at once.
class FakeWorkerClient final : public WorkerClient {
 public:
  absl::Status LoadProgram(const v1::Program&, uint64_t) override {
    absl::MutexLock l(&mu_);
    ++loads_;
    return absl::OkStatus();
  }
  void Run(const v1::RunRequest& r, RunDone done) override {
    {
      absl::MutexLock l(&mu_);
      seqs_.push_back(r.seq());
    }
    done(v1::RunResponse());
  }
  void Free(const v1::FreeRequest& r, Done done) override {
    {
      absl::MutexLock l(&mu_);
      seqs_.push_back(r.seq());
    }
    done(absl::OkStatus());
  }
  absl::StatusOr<std::unique_ptr<PutStream>> BeginPut(const v1::PutShardRequest::Header&) override {
    return absl::UnimplementedError("fake");
  }
  std::unique_ptr<FetchStream> BeginFetch(const v1::FetchShardRequest&) override { return nullptr; }
  absl::StatusOr<v1::WorkerStatsResponse> GetStats(const v1::WorkerStatsRequest&) override {
    return v1::WorkerStatsResponse();
  }
  void CancelAll() override {}
  void SetStepsLostCallback(std::function<void()> f) override {}

  std::vector<uint64_t> seqs() {
    absl::MutexLock l(&mu_);
    return seqs_;
  }
  int loads() {
    absl::MutexLock l(&mu_);
    return loads_;
  }

 private:
  absl::Mutex mu_;
  std::vector<uint64_t> seqs_ ABSL_GUARDED_BY(mu_);
  int loads_ ABSL_GUARDED_BY(mu_) = 0;
};

v1::RunRequest Step(uint64_t seq) {
  v1::RunRequest r;
  r.set_seq(seq);
  r.set_execution_id(100 + seq);
  return r;
}

TEST(FaultInjection, ALostStepNeverReachesTheWorkerAndSaysSo) {
  auto fake = std::make_shared<FakeWorkerClient>();
  auto client = WithFaults(fake, FaultPlan{.drop_step = 1}, "127.0.0.1:9");
  int lost = 0;
  client->SetStepsLostCallback([&] { ++lost; });
  absl::Status got;
  client->Run(Step(3), [&](absl::StatusOr<v1::RunResponse> r) { got = r.status(); });
  EXPECT_EQ(got.code(), absl::StatusCode::kUnavailable) << got;
  EXPECT_NE(got.message().find("execution 103 lost in transit"), absl::string_view::npos) << got;
  EXPECT_NE(got.message().find("127.0.0.1:9"), absl::string_view::npos) << got;
  EXPECT_EQ(lost, 1);
  EXPECT_TRUE(fake->seqs().empty());
}

TEST(FaultInjection, HeldBackStepsArriveLaterAndOutOfOrder) {
  auto fake = std::make_shared<FakeWorkerClient>();
  FaultPlan plan{.delay_step = 0.5, .max_delay = absl::Milliseconds(30), .seed = 3};
  auto client = WithFaults(fake, plan, "w");
  constexpr int kSteps = 40;
  for (int i = 0; i < kSteps; ++i) client->Run(Step(i), [](absl::StatusOr<v1::RunResponse>) {});
  for (int i = 0; i < 200 && fake->seqs().size() < kSteps; ++i)
    absl::SleepFor(absl::Milliseconds(5));
  std::vector<uint64_t> seqs = fake->seqs();
  ASSERT_EQ(seqs.size(), size_t(kSteps)) << "held steps never arrived";
  EXPECT_FALSE(std::is_sorted(seqs.begin(), seqs.end())) << "nothing was reordered";
  std::sort(seqs.begin(), seqs.end());
  for (int i = 0; i < kSteps; ++i) EXPECT_EQ(seqs[i], uint64_t(i));  // each exactly once
}

TEST(FaultInjection, FailedLoadsNeverReachTheWorker) {
  auto fake = std::make_shared<FakeWorkerClient>();
  auto client = WithFaults(fake, FaultPlan{.fail_load = 1}, "w");
  absl::Status s = client->LoadProgram(v1::Program(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(fake->loads(), 0);
}

TEST(FaultInjection, PlansParseAndBadOnesNameTheKey) {
  auto p = FaultPlan::Parse("drop_step=0.01,delay_step=0.5,fail_load=0.25,max_delay_ms=7,seed=9");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->drop_step, 0.01);
  EXPECT_EQ(p->delay_step, 0.5);
  EXPECT_EQ(p->fail_load, 0.25);
  EXPECT_EQ(p->max_delay, absl::Milliseconds(7));
  EXPECT_EQ(p->seed, 9u);
  EXPECT_TRUE(FaultPlan::Parse("").ok());
  for (const char* bad : {"drop_step=2", "drop=0.1", "seed=x"}) {
    auto b = FaultPlan::Parse(bad);
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find(std::string(bad).substr(0, 4)), absl::string_view::npos)
        << b.status();
  }
}

}  // namespace
}  // namespace tessel::server

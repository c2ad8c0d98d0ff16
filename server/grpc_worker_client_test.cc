// The gRPC worker client's step stream against a worker that records how
// the steps arrive: what a thread's HeldSteps holds goes out as one batch
// when it ends, no more than kMaxHeld wait for one worker, and Release()
// sends at once while the scope holds on.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/worker_client.h"
#include "tessel/v1/worker.grpc.pb.h"

namespace tessel::server {
namespace {

// Answers every step of a batch with success, in one write, and records
// each batch's size. Reads and writes alternate: one op in flight at a time.
class RecordingWorker final : public v1::Worker::CallbackService {
 public:
  grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults>* Steps(
      grpc::CallbackServerContext*) override {
    return new Reactor(this);
  }

  std::vector<int> batches() {
    absl::MutexLock l(&mu_);
    return batches_;
  }

 private:
  class Reactor final : public grpc::ServerBidiReactor<v1::StepBatch, v1::StepResults> {
   public:
    explicit Reactor(RecordingWorker* w) : w_(w) { StartRead(&in_); }
    void OnReadDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      {
        absl::MutexLock l(&w_->mu_);
        w_->batches_.push_back(in_.steps_size());
      }
      out_.Clear();
      for (const v1::StepRequest& s : in_.steps()) {
        v1::StepResult* r = out_.add_results();
        r->set_device(s.run().device());
        r->set_queue_epoch(s.run().queue_epoch());
        r->set_seq(s.run().seq());
      }
      StartWrite(&out_);
    }
    void OnWriteDone(bool ok) override {
      if (!ok) return Finish(grpc::Status::OK);
      StartRead(&in_);
    }
    void OnDone() override { delete this; }

   private:
    RecordingWorker* const w_;
    v1::StepBatch in_;
    v1::StepResults out_;
  };

  absl::Mutex mu_;
  std::vector<int> batches_ ABSL_GUARDED_BY(mu_);
};

class HeldStepsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&worker_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    client_ = NewGrpcWorkerClient(absl::StrCat("127.0.0.1:", port), "secret");
  }
  void TearDown() override {
    client_.reset();
    server_->Shutdown();
  }

  // Sends steps [from, to) of device 0; their answers are counted by seq.
  void Run(int from, int to) {
    for (int seq = from; seq < to; ++seq) {
      v1::RunRequest r;
      r.set_device(0);
      r.set_seq(seq);
      client_->Run(r, [this, seq](absl::StatusOr<v1::RunResponse> resp) {
        absl::MutexLock l(&mu_);
        if (resp.ok())
          ++answered_[seq];
        else
          errors_.push_back(resp.status());
      });
    }
  }
  // Waits until steps [0, n) have each been answered; false after 10 s.
  bool AwaitAnswered(int n) {
    absl::MutexLock l(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return int(answered_.size()) >= n || !errors_.empty();
    };
    mu_.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(10));
    EXPECT_TRUE(errors_.empty()) << errors_.front();
    for (int seq = 0; seq < n; ++seq) {
      if (answered_[seq] != 1) {
        ADD_FAILURE() << "step " << seq << " answered " << answered_[seq] << " times";
        return false;
      }
    }
    return true;
  }

  RecordingWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<WorkerClient> client_;
  absl::Mutex mu_;
  std::map<int, int> answered_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> errors_ ABSL_GUARDED_BY(mu_);
};

TEST_F(HeldStepsTest, AScopesStepsReachTheWorkerAsOneBatchWhenItEnds) {
  EXPECT_FALSE(HeldSteps::AnyHeld());
  {
    HeldSteps hold;
    Run(0, 50);
    EXPECT_TRUE(HeldSteps::AnyHeld());
    {
      HeldSteps inner;  // nested: only the outermost sends
    }
    EXPECT_TRUE(HeldSteps::AnyHeld());
  }
  EXPECT_FALSE(HeldSteps::AnyHeld());
  ASSERT_TRUE(AwaitAnswered(50));
  Run(50, 51);  // not held: it goes at once
  ASSERT_TRUE(AwaitAnswered(51));
  EXPECT_EQ(worker_.batches(), (std::vector<int>{50, 1}));
}

TEST_F(HeldStepsTest, NoMoreThankMaxHeldWaitForOneWorker) {
  constexpr int kSteps = 2 * HeldSteps::kMaxHeld + 44;
  {
    HeldSteps hold;
    Run(0, kSteps);
  }
  ASSERT_TRUE(AwaitAnswered(kSteps));
  std::vector<int> batches = worker_.batches();
  ASSERT_FALSE(batches.empty());
  EXPECT_EQ(batches[0],
            HeldSteps::kMaxHeld);  // the write started on the 128th step, inside the scope
  int total = 0;
  for (int n : batches) total += n;
  EXPECT_EQ(total, kSteps);
}

TEST_F(HeldStepsTest, ReleaseSendsWhatIsHeldAndTheScopeHoldsOn) {
  {
    HeldSteps hold;
    Run(0, 10);
    HeldSteps::Release();
    EXPECT_FALSE(HeldSteps::AnyHeld());
    ASSERT_TRUE(AwaitAnswered(10));  // answered while the scope still lives: they were sent
    Run(10, 20);
    EXPECT_TRUE(HeldSteps::AnyHeld());
  }
  ASSERT_TRUE(AwaitAnswered(20));
  // The first write's completion may take some of the next ten with it.
  std::vector<int> batches = worker_.batches();
  ASSERT_FALSE(batches.empty());
  EXPECT_EQ(batches[0], 10);
  int total = 0;
  for (int n : batches) total += n;
  EXPECT_EQ(total, 20);
}

}  // namespace
}  // namespace tessel::server

#include "worker/step_queue.h"

#include <gtest/gtest.h>

#include <vector>

#include "absl/synchronization/notification.h"

namespace tessel::worker {
namespace {

TEST(StepQueue, RunsInSequenceOrderWhateverTheSubmissionOrder) {
  StepQueue q("test");
  absl::Mutex mu;
  std::vector<int> order;
  absl::Notification done;
  for (int seq : {3, 1, 0, 2}) {
    q.Submit(seq, [&, seq] {
      absl::MutexLock l(&mu);
      order.push_back(seq);
      if (order.size() == 4) done.Notify();
    }, [] { FAIL() << "rejected"; });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(StepQueue, RejectsReusedSequenceNumbers) {
  StepQueue q("test");
  absl::Notification ran, rejected;
  q.Submit(0, [&] { ran.Notify(); }, [] {});
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  while (q.completed() < 1) absl::SleepFor(absl::Milliseconds(1));
  q.Submit(0, [] { FAIL() << "ran twice"; }, [&] { rejected.Notify(); });
  EXPECT_TRUE(rejected.HasBeenNotified());
}

}  // namespace
}  // namespace tessel::worker

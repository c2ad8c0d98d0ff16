#include "worker/step_queue.h"

#include <gtest/gtest.h>

#include <thread>
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
    q.Submit(
        seq,
        [&, seq] {
          absl::MutexLock l(&mu);
          order.push_back(seq);
          if (order.size() == 4) done.Notify();
        },
        [](absl::Status) { FAIL() << "rejected"; });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 3}));
}

TEST(StepQueue, RejectsReusedSequenceNumbers) {
  StepQueue q("test");
  absl::Notification ran, rejected;
  q.Submit(
      0, [&] { ran.Notify(); }, [](absl::Status) {});
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  while (q.completed() < 1) absl::SleepFor(absl::Milliseconds(1));
  absl::Status why;
  q.Submit(
      0, [] { FAIL() << "ran twice"; },
      [&](absl::Status s) {
        why = s;
        rejected.Notify();
      });
  ASSERT_TRUE(rejected.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(why.message().find("step sequence number 0 was already used"), absl::string_view::npos)
      << why;
}

// A worker that registers again starts numbering at 0 in a new epoch: what
// waited from the old registration is refused, and so is anything of it
// that arrives later; the new epoch's steps run from 0.
TEST(StepQueue, ANewEpochStartsNumberingAgainAndVoidsTheOldOne) {
  StepQueue q("cpu:0");
  absl::Notification first;
  q.Submit(
      7, 0, [&] { first.Notify(); }, [](absl::Status s) { FAIL() << s; });
  ASSERT_TRUE(first.WaitForNotificationWithTimeout(absl::Seconds(10)));
  while (q.completed() < 1) absl::SleepFor(absl::Milliseconds(1));
  // Step 2 of epoch 7 waits for step 1, which never comes.
  absl::Status waiting;
  absl::Notification refused;
  q.Submit(
      7, 2, [] { FAIL() << "ran after its epoch ended"; },
      [&](absl::Status s) {
        waiting = s;
        refused.Notify();
      });
  absl::Notification ran;
  q.Submit(
      9, 0, [&] { ran.Notify(); }, [](absl::Status s) { FAIL() << s; });
  ASSERT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(refused.HasBeenNotified());  // refusals run before the next item
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable) << waiting;
  absl::Status late;
  absl::Notification late_refused;
  q.Submit(
      7, 1, [] { FAIL() << "ran after its epoch ended"; },
      [&](absl::Status s) {
        late = s;
        late_refused.Notify();
      });
  ASSERT_TRUE(late_refused.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(late.code(), absl::StatusCode::kFailedPrecondition) << late;
  EXPECT_NE(late.message().find("which the queue has left"), absl::string_view::npos) << late;
  // StartEpoch to the current epoch changes nothing.
  q.StartEpoch(9);
  absl::Notification next;
  q.Submit(
      9, 1, [&] { next.Notify(); }, [](absl::Status s) { FAIL() << s; });
  EXPECT_TRUE(next.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

// A refused step abandons its collectives, which can wait out a peer. The
// refusal runs on the queue's thread, so the submitter (the thread reading
// the worker's step stream) goes on at once, and the new epoch's first step
// runs once the refusal has.
TEST(StepQueue, ARefusalThatBlocksNeverHoldsUpTheSubmitter) {
  StepQueue q("cpu:0");
  absl::Notification release, refusing, ran;
  std::thread::id refused_on;
  q.Submit(
      7, 1, [] { FAIL() << "ran after its epoch ended"; },
      [&](absl::Status) {
        refused_on = std::this_thread::get_id();
        refusing.Notify();
        release.WaitForNotification();
      });
  q.Submit(
      9, 0, [&] { ran.Notify(); },
      [](absl::Status s) { FAIL() << s; });  // refuses step 1 of epoch 7
  ASSERT_TRUE(refusing.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_NE(refused_on, std::this_thread::get_id());
  // Another late step of the left epoch is refused behind it, and the submitter still goes on.
  absl::Notification late;
  q.Submit(
      7, 2, [] { FAIL() << "ran after its epoch ended"; }, [&](absl::Status) { late.Notify(); });
  EXPECT_FALSE(ran.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  EXPECT_FALSE(late.HasBeenNotified());
  release.Notify();
  EXPECT_TRUE(late.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_TRUE(ran.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

}  // namespace
}  // namespace tessel::worker

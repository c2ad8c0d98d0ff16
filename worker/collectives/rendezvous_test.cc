// The local rendezvous on its own: threads meet under keys, the last runs
// the meeting, every participant takes its part before any leaves, a
// missing participant times out (and finds the same result when it comes
// late), and one that arrives twice is refused.
#include "worker/collectives/rendezvous.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace tessel::worker {
namespace {

using Meeting = LocalRendezvous<int, int>;

absl::Status TimedOut(const std::vector<int>& missing, const int&) {
  return absl::DeadlineExceededError(absl::StrCat("missing ", absl::StrJoin(missing, ",")));
}
absl::Status Twice() { return absl::FailedPreconditionError("twice"); }

TEST(LocalRendezvous, TheLastToArriveRunsOnceAndEveryoneTakesItsPartBeforeAnyLeaves) {
  constexpr int kN = 4, kRounds = 50;
  Meeting meet(kN, absl::Seconds(10));
  std::atomic<int> runs{0}, parts{0};
  std::vector<std::vector<int>> sums(kN, std::vector<int>(kRounds));
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      for (int round = 0; round < kRounds; ++round) {
        int total = 0;
        const absl::Status s = meet.Meet(
            round, i, 10 * round + i,
            [&](absl::Span<const int> values) {
              ++runs;
              for (int v : values) total += v;  // only the runner's `total` is written
              return absl::OkStatus();
            },
            TimedOut, Twice,
            [&](absl::Span<const int> values) {
              int sum = 0;
              for (int v : values) sum += v;
              sums[i][round] = sum;
              ++parts;
            });
        EXPECT_TRUE(s.ok()) << s;
        // Nobody leaves before every part of this round is taken.
        EXPECT_GE(parts.load(), kN * (round + 1));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(runs.load(), kRounds);
  for (int i = 0; i < kN; ++i) {
    for (int round = 0; round < kRounds; ++round)
      EXPECT_EQ(sums[i][round], 40 * round + 6) << i << " " << round;
  }
  EXPECT_EQ(meet.meetings(), 0u);
}

TEST(LocalRendezvous, ARunThatFailsIsEveryonesResultAndNoPartIsTaken) {
  Meeting meet(2, absl::Seconds(10));
  std::atomic<int> parts{0};
  std::vector<absl::Status> got(2);
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      got[i] = meet.Meet(
          1, i, i, [](absl::Span<const int>) { return absl::InternalError("broken"); }, TimedOut,
          Twice, [&](absl::Span<const int>) { ++parts; });
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : got) EXPECT_EQ(s, absl::InternalError("broken"));
  EXPECT_EQ(parts.load(), 0);
}

TEST(LocalRendezvous, AMissingParticipantTimesOutAndFindsTheSameResultWhenItComesLate) {
  Meeting meet(3, absl::Milliseconds(200));
  bool ran = false;
  auto run = [&](absl::Span<const int>) {
    ran = true;
    return absl::OkStatus();
  };
  auto part = [](absl::Span<const int>) {};
  std::vector<absl::Status> got(2);
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] { got[i] = meet.Meet(5, i, i, run, TimedOut, Twice, part); });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  for (const absl::Status& s : got) EXPECT_EQ(s, absl::DeadlineExceededError("missing 2"));
  // The latecomer gets the same verdict at once, and nothing runs.
  EXPECT_EQ(meet.Meet(5, 2, 2, run, TimedOut, Twice, part),
            absl::DeadlineExceededError("missing 2"));
  EXPECT_FALSE(ran);
  EXPECT_EQ(meet.meetings(), 0u);
}

TEST(LocalRendezvous, AParticipantArrivingTwiceIsRefusedAndTheMeetingGoesOn) {
  Meeting meet(2, absl::Seconds(10));
  auto run = [](absl::Span<const int> v) {
    return v[0] + v[1] == 3 ? absl::OkStatus() : absl::InternalError("wrong values");
  };
  auto part = [](absl::Span<const int>) {};
  absl::Status first;
  std::thread t([&] { first = meet.Meet(9, 0, 1, run, TimedOut, Twice, part); });
  // Wait until participant 0 is in, then arrive as 0 again.
  while (meet.meetings() == 0) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_EQ(meet.Meet(9, 0, 1, run, TimedOut, Twice, part), absl::FailedPreconditionError("twice"));
  EXPECT_TRUE(meet.Meet(9, 1, 2, run, TimedOut, Twice, part).ok());
  t.join();
  EXPECT_TRUE(first.ok()) << first;
}

}  // namespace
}  // namespace tessel::worker

// Call agreement: the verdicts the headers give, the same on every
// participant, and the descriptions the errors use.
#include "worker/collectives/agreement.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tessel::worker {
namespace {

const CollectiveId kId{7, 3, 0};

std::string Name(int i) { return absl::StrCat("worker ", i); }

// Every participant judges the same headers: one verdict for all.
absl::Status Judge(const std::vector<CallHeader>& headers) {
  return JudgeHeaders(
      kId, headers, [] { return std::string("group 'g'"); }, Name);
}

TEST(CallAgreement, TheSameCallEverywhereRuns) {
  const CollectiveCall c{CollectiveKind::kAllReduce, 1024, v1::F32, ReduceOp::kSum};
  const CallHeader h = MakeHeader(kId, c, absl::OkStatus());
  EXPECT_TRUE(Judge({h, h, h}).ok());
  EXPECT_EQ(DescribeHeader(h), "all_reduce(f32[1024], sum)");
  EXPECT_EQ(DescribeHeader(h), DescribeCall(c));
}

TEST(CallAgreement, DifferentArgumentsFailNamingTheFirstParticipantAndTheOneThatDiffers) {
  const CallHeader a =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAllReduce, 4, v1::F32, ReduceOp::kSum},
                 absl::OkStatus());
  const CallHeader b =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAllGather, 4, v1::F32}, absl::OkStatus());
  const CallHeader max =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAllReduce, 4, v1::F32, ReduceOp::kMax},
                 absl::OkStatus());
  const absl::Status s = Judge({a, a, b});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "group 'g': the ranks disagree on the call: worker 0 calls all_reduce(f32[4], sum), "
            "worker 2 calls all_gather(f32[4])");
  EXPECT_NE(Judge({a, max}).message().find("all_reduce(f32[4], max)"), std::string::npos);
  // The reduction of a call that does not reduce is not compared.
  const CallHeader g1 =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAllGather, 4, v1::F32, ReduceOp::kSum},
                 absl::OkStatus());
  const CallHeader g2 =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAllGather, 4, v1::F32, ReduceOp::kMin},
                 absl::OkStatus());
  EXPECT_TRUE(Judge({g1, g2}).ok());
}

TEST(CallAgreement, PermutesWithOtherPairsDisagree) {
  const std::vector<std::pair<int, int>> p1 = {{0, 1}, {1, 0}}, p2 = {{0, 1}};
  const CollectiveCall c1{CollectiveKind::kPermute, 2, v1::S32, ReduceOp::kSum, &p1};
  const CollectiveCall c2{CollectiveKind::kPermute, 2, v1::S32, ReduceOp::kSum, &p2};
  EXPECT_FALSE(SameCall(c1, c2));
  EXPECT_TRUE(SameCall(c1, c1));
  EXPECT_NE(PairsDigest(c1), PairsDigest(c2));
  EXPECT_EQ(
      Judge({MakeHeader(kId, c1, absl::OkStatus()), MakeHeader(kId, c2, absl::OkStatus())}).code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(CallAgreement, AParticipantThatCannotTakePartFailsTheCallWithItsReason) {
  const CollectiveCall c{CollectiveKind::kAllReduce, 4, v1::F32, ReduceOp::kSum};
  const CallHeader ok = MakeHeader(kId, c, absl::OkStatus());
  const CallHeader failed =
      MakeHeader(kId, CollectiveCall{CollectiveKind::kAbandoned},
                 absl::AbortedError("device 3 did not reach this collective: out of memory"));
  // The reason outranks the disagreement of the abandoned call's arguments.
  const absl::Status s = Judge({ok, failed});
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(), "device 3 did not reach this collective: out of memory");
  // A long reason is cut to the header's room, never overrun.
  const CallHeader long_reason = MakeHeader(kId, c, absl::AbortedError(std::string(1000, 'x')));
  EXPECT_EQ(Judge({long_reason}).message(), std::string(sizeof(CallHeader::message), 'x'));
}

TEST(CallAgreement, AHeaderOfAnotherCollectiveMeansTheGroupIsOutOfStep) {
  const CollectiveCall c{CollectiveKind::kAllReduce, 4, v1::F32, ReduceOp::kSum};
  const CallHeader here = MakeHeader(kId, c, absl::OkStatus());
  const CallHeader later = MakeHeader(CollectiveId{8, 3, 5}, c, absl::OkStatus());
  const absl::Status s = Judge({here, later});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("workers out of step: worker 1 is at execution 8, op 3, scope 5; "
                             "this device is at execution 7, op 3"),
            std::string::npos)
      << s;
  CallHeader garbage = here;
  garbage.magic = 0;
  EXPECT_EQ(Judge({here, garbage}).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tessel::worker

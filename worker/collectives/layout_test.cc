// Group layouts, worked out by hand for the interesting shapes: workers
// holding interleaved ranks, one worker holding everything, and the specs
// a worker must refuse. Also the epoch keys the registry reads.
#include "worker/collectives/layout.h"

#include <gtest/gtest.h>

#include "worker/collectives/registry.h"

namespace tessel::worker {
namespace {

TEST(GroupLayout, InterleavedWorkersListBlocksWorkerByWorker) {
  // Ranks 0..3 on workers a, b, a, b: Gloo gathers a's ranks (0, 2) then b's (1, 3).
  auto l = MakeLayout(GroupSpec{"g", {"a", "b", "a", "b"}, {10, 11, 12, 13}}, "b");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->workers, (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(l->self_worker, 1);
  EXPECT_EQ(l->worker_of_rank, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(l->worker_ranks, (std::vector<std::vector<int>>{{0, 2}, {1, 3}}));
  EXPECT_EQ(l->local_ranks, (std::vector<int>{1, 3}));
  EXPECT_EQ(l->local_index, (std::vector<int>{-1, 0, -1, 1}));
  EXPECT_EQ(l->grouped_pos, (std::vector<int>{0, 2, 1, 3}));
  EXPECT_FALSE(l->worker_major);
  EXPECT_EQ(l->RankName(2), "device 12");
  EXPECT_EQ(l->WorkerDevices(0), "worker 'a' (device 10, device 12)");
  std::vector<std::pair<int, int>> pairs = {{0, 1}, {1, 0}};
  EXPECT_EQ(
      l->Describe(CollectiveCall{CollectiveKind::kPermute, 8, v1::S32, ReduceOp::kSum, &pairs}),
      "group 'g' collective_permute(s32[8], 2 pairs)");
}

TEST(GroupLayout, ContiguousWorkersAreWorkerMajorAndRanksWithoutDevicesAreNamedAsRanks) {
  auto l = MakeLayout(GroupSpec{"g", {"a", "a", "b"}}, "a");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_TRUE(l->worker_major);
  EXPECT_EQ(l->num_local(), 2);
  EXPECT_EQ(l->num_workers(), 2);
  EXPECT_EQ(l->RankNames({0, 2}), "rank 0, rank 2");
  EXPECT_EQ(l->Describe(CollectiveCall{CollectiveKind::kAllReduce, 4, v1::F32, ReduceOp::kMax}),
            "group 'g' all_reduce(f32[4], max)");
}

TEST(GroupLayout, AWorkerWithoutRanksAnEmptyKeyAndNoRanksAreRefused) {
  auto none = MakeLayout(GroupSpec{"g", {"a", "b"}}, "c");
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(
      none.status().message().find("worker 'c' holds none of its ranks (rank workers: [a, b])"),
      std::string::npos)
      << none.status();
  EXPECT_EQ(MakeLayout(GroupSpec{"", {"a"}}, "a").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_NE(MakeLayout(GroupSpec{"g", {}}, "a").status().message().find("no ranks"),
            std::string::npos);
}

TEST(EpochKeys, DevicesIncarnationAndEpochAreReadAndOtherKeysAreNotEpochKeys) {
  const EpochKey k = ParseEpochKey("devices:0,1@ab12.7");
  EXPECT_TRUE(k.valid);
  EXPECT_EQ(k.devices, "devices:0,1");
  EXPECT_EQ(k.incarnation, "ab12");
  EXPECT_EQ(k.epoch, 7);
  EXPECT_FALSE(ParseEpochKey("across").valid);
  EXPECT_FALSE(ParseEpochKey("a.b@c").valid);        // the dot comes before the '@'
  EXPECT_FALSE(ParseEpochKey("d@inc.seven").valid);  // not a number
}

}  // namespace
}  // namespace tessel::worker

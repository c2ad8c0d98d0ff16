#include "worker/cpu/allocator.h"

#include <gtest/gtest.h>

namespace tessel::cpu {
namespace {

TEST(HostAllocator, ReusesFreedBlocksAndTracksStats) {
  HostAllocator a({"cpu:0", 0});
  auto p = a.Allocate(3 << 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(a.stats().num_buffers, 1);
  EXPECT_EQ(a.stats().bytes_in_use, HostAllocator::RoundUp(3 << 20));
  a.Free(*p, 3 << 20);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_GT(a.stats().bytes_cached, 0);
  EXPECT_EQ(a.stats().largest_free_block, HostAllocator::RoundUp(3 << 20));
  auto q = a.Allocate((3 << 20) - 100);  // same size class
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, *p);
  EXPECT_EQ(a.stats().peak_bytes_in_use, HostAllocator::RoundUp(3 << 20));
  a.Free(*q, (3 << 20) - 100);
}

TEST(HostAllocator, OverLimitIsResourceExhaustedNamingTheDevice) {
  HostAllocator a({"cpu:3", 1 << 20});
  auto p = a.Allocate(2 << 20);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("cpu:3"), absl::string_view::npos);
  EXPECT_NE(p.status().message().find("2097152"), absl::string_view::npos);
}

TEST(HostAllocator, SizeClassesCoverTheRequest) {
  for (int64_t b : {1, 63, 64, 65, 1000, 4097, 100000, (1 << 20) - 1, 1 << 20, (5 << 20) + 1}) {
    EXPECT_GE(HostAllocator::RoundUp(b), b);
    EXPECT_LE(HostAllocator::RoundUp(b), std::max<int64_t>(64, b * 2));
  }
}

}  // namespace
}  // namespace tessel::cpu

#include "worker/caching_allocator.h"

#include <gtest/gtest.h>

#include <new>
#include <vector>

namespace tessel::worker {
namespace {

TEST(CachingAllocator, ReusesFreedBlocksAndTracksStats) {
  CachingAllocator a({"cpu:0", 0}, std::make_unique<HostMemory>());
  auto p = a.Allocate(3 << 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(a.stats().num_buffers, 1);
  EXPECT_EQ(a.stats().bytes_in_use, CachingAllocator::RoundUp(3 << 20));
  a.Free(*p, 3 << 20);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_GT(a.stats().bytes_cached, 0);
  EXPECT_EQ(a.stats().largest_free_block, CachingAllocator::RoundUp(3 << 20));
  auto q = a.Allocate((3 << 20) - 100);  // same size class
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(*q, *p);
  EXPECT_EQ(a.stats().peak_bytes_in_use, CachingAllocator::RoundUp(3 << 20));
  a.Free(*q, (3 << 20) - 100);
}

TEST(CachingAllocator, OverLimitIsResourceExhaustedNamingTheDevice) {
  CachingAllocator a({"cpu:3", 1 << 20}, std::make_unique<HostMemory>());
  auto p = a.Allocate(2 << 20);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(p.status().message().find("cpu:3"), absl::string_view::npos);
  EXPECT_NE(p.status().message().find("2097152"), absl::string_view::npos);
}

TEST(CachingAllocator, SizeClassesCoverTheRequest) {
  for (int64_t b : {1, 63, 64, 65, 1000, 4097, 100000, (1 << 20) - 1, 1 << 20, (5 << 20) + 1}) {
    EXPECT_GE(CachingAllocator::RoundUp(b), b);
    EXPECT_LE(CachingAllocator::RoundUp(b), std::max<int64_t>(64, b * 2));
  }
}

// A source with a fixed capacity that counts its calls, as a GPU's would be.
class CountingMemory final : public MemorySource {
 public:
  explicit CountingMemory(int64_t capacity) : capacity_(capacity) {}
  void* Map(int64_t size) override {
    ++maps;
    if (mapped + size > capacity_) return nullptr;
    mapped += size;
    return ::operator new(size, std::align_val_t(64));
  }
  void Unmap(void* p, int64_t size) override {
    ++unmaps;
    mapped -= size;
    ::operator delete(p, std::align_val_t(64));
  }
  int maps = 0, unmaps = 0;
  int64_t mapped = 0;

 private:
  const int64_t capacity_;
};

TEST(CachingAllocator, SteadyStateStepLoopNeverCallsTheSource) {
  auto source = std::make_unique<CountingMemory>(int64_t{1} << 30);
  CountingMemory* mem = source.get();
  CachingAllocator a({"cuda:0", 0}, std::move(source));
  auto step = [&] {  // a step's buffers: allocate, then free in another order
    std::vector<std::pair<void*, int64_t>> live;
    for (int64_t bytes : {4096, 3 << 20, 100, 3 << 20, 70000})
      live.emplace_back(*a.Allocate(bytes), bytes);
    for (int i : {2, 0, 4, 1, 3}) a.Free(live[i].first, live[i].second);
  };
  step();
  const int maps_after_first = mem->maps;
  for (int i = 0; i < 100; ++i) step();
  EXPECT_EQ(mem->maps, maps_after_first);
  EXPECT_EQ(mem->unmaps, 0);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_EQ(a.stats().bytes_cached, mem->mapped);
}

TEST(CachingAllocator, SourceOutOfMemoryReturnsTheCacheAndRetriesThenFailsClearly) {
  auto source = std::make_unique<CountingMemory>(int64_t{8} << 20);
  CountingMemory* mem = source.get();
  CachingAllocator a({"cuda:1", 0}, std::move(source));
  // Fill the source with cached 2 MiB blocks, then ask for 6 MiB: the cache goes back, the retry
  // fits.
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(*a.Allocate(2 << 20));
  for (void* b : blocks) a.Free(b, 2 << 20);
  EXPECT_EQ(mem->mapped, 8 << 20);
  auto big = a.Allocate(6 << 20);
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(mem->unmaps, 4);
  // Nothing more fits: RESOURCE_EXHAUSTED naming the device, the request and what is in use.
  auto more = a.Allocate(4 << 20);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(more.status().message().find("cuda:1"), absl::string_view::npos) << more.status();
  EXPECT_NE(more.status().message().find("4194304"), absl::string_view::npos) << more.status();
  EXPECT_NE(more.status().message().find("6291456"), absl::string_view::npos) << more.status();
  a.Free(*big, 6 << 20);
}

}  // namespace
}  // namespace tessel::worker

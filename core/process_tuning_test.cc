// ProcessMemoryBudget over cgroup trees laid out in a temporary directory
// as the kernel lays them out (v2 unified, v1 with the memory controller).
#include "core/process_tuning.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace tessel {
namespace {

namespace fs = std::filesystem;

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tessel-cgroup-test-" + std::to_string(getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void Write(const std::string& rel, const std::string& text) {
    fs::create_directories((root_ / rel).parent_path());
    std::ofstream(root_ / rel) << text;
  }
  std::string Root() const { return (root_ / "sys").string(); }
  std::string Proc() const { return (root_ / "cgroup").string(); }
  static int64_t Physical() { return int64_t(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE); }
  fs::path root_;
};

TEST_F(CgroupTree, V2TakesTheSmallestLimitOnThePathToTheRoot) {
  Write("cgroup", "0::/system.slice/tessel-worker.service\n");
  Write("sys/memory.max", "max\n");
  Write("sys/system.slice/memory.max", "1073741824\n");
  Write("sys/system.slice/tessel-worker.service/memory.max", "max\n");
  MemoryBudget b = ProcessMemoryBudget(Root(), Proc());
  EXPECT_EQ(b.bytes, std::min<int64_t>(Physical(), 1073741824));
  if (Physical() > 1073741824) {
    EXPECT_EQ(b.source, Root() + "/system.slice/memory.max");
  }

  Write("sys/system.slice/tessel-worker.service/memory.max", "536870912\n");
  b = ProcessMemoryBudget(Root(), Proc());
  EXPECT_EQ(b.bytes, std::min<int64_t>(Physical(), 536870912));
  if (Physical() > 536870912) {
    EXPECT_EQ(b.source, Root() + "/system.slice/tessel-worker.service/memory.max");
  }
}

TEST_F(CgroupTree, V1ReadsTheMemoryControllerEvenWhenANamespaceHidesThePath) {
  Write("cgroup", "4:memory:/kubepods/pod1/c1\n3:cpu,cpuacct:/kubepods/pod1/c1\n0::/\n");
  // The container's own cgroup is the mount's root: the path is not there.
  Write("sys/memory/memory.limit_in_bytes", "268435456\n");
  MemoryBudget b = ProcessMemoryBudget(Root(), Proc());
  EXPECT_EQ(b.bytes, std::min<int64_t>(Physical(), 268435456));
  EXPECT_EQ(b.source, Root() + "/memory/memory.limit_in_bytes");
  // A cgroup below it, named by its full path: the tail that exists counts.
  Write("cgroup", "4:memory:/kubepods/pod1/c1/job\n");
  Write("sys/memory/job/memory.limit_in_bytes", "134217728\n");
  b = ProcessMemoryBudget(Root(), Proc());
  EXPECT_EQ(b.bytes, std::min<int64_t>(Physical(), 134217728));
  EXPECT_EQ(b.source, Root() + "/memory/job/memory.limit_in_bytes");
}

TEST_F(CgroupTree, NoLimitLeavesPhysicalMemory) {
  Write("cgroup", "4:memory:/\n0::/\n");
  Write("sys/memory/memory.limit_in_bytes", "9223372036854771712\n");  // v1's "unlimited"
  Write("sys/memory.max", "max\n");
  MemoryBudget b = ProcessMemoryBudget(Root(), Proc());
  EXPECT_EQ(b.bytes, Physical());
  EXPECT_EQ(b.source, "physical memory");
  // And nothing to read at all.
  b = ProcessMemoryBudget(Root() + "/absent", Proc() + ".absent");
  EXPECT_EQ(b.bytes, Physical());
}

}  // namespace
}  // namespace tessel

// CheckpointIO against references of its own parts: CRC32C's published
// check value, a naive element loop for the box copies, and the array's
// row-major bytes for a block read back across chunks.
#include "worker/checkpoint_io.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/zarr.h"
#include "worker/cpu/cpu_device.h"

namespace tessel::worker {
namespace {

namespace fs = std::filesystem;

TEST(Crc32cTest, MatchesTheCheckValueAndContinues) {
  const char digits[] = "123456789";
  EXPECT_EQ(Crc32c(digits, 9), 0xE3069283u);  // RFC 3720's CRC32C check value
  EXPECT_EQ(Crc32c(digits + 4, 5, Crc32c(digits, 4)), 0xE3069283u);
  EXPECT_EQ(Crc32c(digits, 0), 0u);
}

TEST(CopyBoxTest, MatchesANaiveLoop) {
  std::mt19937 rng(3);
  const std::vector<int64_t> from_dims = {5, 7, 6}, to_dims = {4, 3, 9};
  std::vector<int32_t> src(5 * 7 * 6);
  std::iota(src.begin(), src.end(), 0);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> sizes(3), from(3), to(3);
    for (int d = 0; d < 3; ++d) {
      sizes[d] = 1 + rng() % std::min(from_dims[d], to_dims[d]);
      from[d] = rng() % (from_dims[d] - sizes[d] + 1);
      to[d] = rng() % (to_dims[d] - sizes[d] + 1);
    }
    std::vector<int32_t> got(4 * 3 * 9, -1), want(4 * 3 * 9, -1);
    CopyBox(reinterpret_cast<const char*>(src.data()), from_dims, from,
            reinterpret_cast<char*>(got.data()), to_dims, to, sizes, 4);
    for (int64_t i = 0; i < sizes[0]; ++i)
      for (int64_t j = 0; j < sizes[1]; ++j)
        for (int64_t k = 0; k < sizes[2]; ++k)
          want[((to[0] + i) * 3 + to[1] + j) * 9 + to[2] + k] =
              src[((from[0] + i) * 7 + from[1] + j) * 6 + from[2] + k];
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

TEST(CheckpointPathTest, RefusesRelativeDotsAndPathsOutsideTheRoot) {
  EXPECT_TRUE(CheckCheckpointPath("/", "/data/ckpt/1").ok());
  EXPECT_TRUE(CheckCheckpointPath("/data/", "/data/ckpt/1").ok());
  EXPECT_EQ(CheckCheckpointPath("/", "ckpt/1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCheckpointPath("/", "/data/../etc").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckCheckpointPath("/data", "/database/x").code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(CheckArrayName("params.dense_0.kernel").ok());
  EXPECT_FALSE(CheckArrayName("../x").ok());
  EXPECT_FALSE(CheckArrayName("tessel.json").ok());
}

class CheckpointIOTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           absl::StrCat("tessel_ckpt_", ::getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  v1::CheckpointFilesResponse Files(v1::CheckpointFilesRequest::Action action,
                                    const std::string& path, const std::string& final_path = "") {
    v1::CheckpointFilesRequest r;
    r.set_action(action);
    r.set_path(path);
    r.set_final_path(final_path);
    r.set_checkpoint("c1");
    r.set_token("t");
    auto got = io_.Files(r);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *got : v1::CheckpointFilesResponse();
  }

  fs::path dir_;
  cpu::CpuDevice device_{cpu::CpuDevice::Options{}};
  CheckpointIO io_{CheckpointIO::Options{.staging_bytes = 64}};
};

// A 6x8 f32 array saved in 3x4 chunks, read back as a block straddling all four.
TEST_F(CheckpointIOTest, ABlockReadBackAcrossChunksIsTheArraysBox) {
  const std::string temp = (dir_ / "c.tmp").string(), path = (dir_ / "c").string();
  std::vector<float> array(48);
  std::iota(array.begin(), array.end(), 0.5f);
  v1::TensorType global = MakeType(v1::F32, {6, 8});
  Files(v1::CheckpointFilesRequest::PREPARE, temp, path);
  for (int64_t bi = 0; bi < 2; ++bi) {
    for (int64_t bj = 0; bj < 2; ++bj) {
      auto buf = device_.Allocate(48);
      ASSERT_TRUE(buf.ok());
      std::vector<float> block(12);
      CopyBox(reinterpret_cast<const char*>(array.data()), {6, 8}, {3 * bi, 4 * bj},
              reinterpret_cast<char*>(block.data()), {3, 4}, {0, 0}, {3, 4}, 4);
      std::memcpy((*buf)->opaque(), block.data(), 48);
      v1::CheckpointChunk c;
      c.set_path(temp);
      c.set_array_dir("w");
      c.set_checkpoint("c1");
      *c.mutable_global() = global;
      c.add_chunk_shape(3);
      c.add_chunk_shape(4);
      c.mutable_block()->add_starts(3 * bi);
      c.mutable_block()->add_starts(4 * bj);
      // 48 bytes a chunk against a 64-byte bound: each waits for the one before.
      ASSERT_TRUE(io_.WriteChunk(c, device_, *buf).ok());
      EXPECT_LE(io_.staged_bytes(), 64);
    }
  }
  EXPECT_EQ(Files(v1::CheckpointFilesRequest::FINISH, temp).bytes_written(), 4 * 48);
  EXPECT_EQ(io_.staged_bytes(), 0);
  {
    v1::CheckpointFilesRequest w;
    w.set_action(v1::CheckpointFilesRequest::WRITE);
    w.set_path(temp);
    auto* f = w.add_files();
    f->set_name("w/zarr.json");
    f->set_contents(ZarrArrayJson(global, {3, 4}));
    ASSERT_TRUE(io_.Files(w).ok());
  }
  Files(v1::CheckpointFilesRequest::COMMIT, temp, path);
  ASSERT_TRUE(fs::exists(dir_ / "c" / kCommitMarker));
  ASSERT_FALSE(fs::exists(temp));
  EXPECT_EQ(fs::file_size(dir_ / "c" / "w" / "c" / "1" / "0"), 48u + 4u);

  v1::CheckpointChunk r;
  r.set_restore(true);
  r.set_path(path);
  r.set_array_dir("w");
  *r.mutable_global() = global;
  r.add_chunk_shape(3);
  r.add_chunk_shape(4);
  for (int64_t x : {1, 2}) r.mutable_block()->add_starts(x);
  for (int64_t x : {4, 5}) r.mutable_block()->add_sizes(x);
  auto got = io_.ReadBlock(r, device_, MakeType(v1::F32, {4, 5}));
  ASSERT_TRUE(got.ok()) << got.status();
  const float* v = static_cast<const float*>((*got)->opaque());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j)
      EXPECT_EQ(v[i * 5 + j], array[(1 + i) * 8 + 2 + j]) << i << "," << j;

  // Another shape than the one saved is refused, naming both.
  *r.mutable_global() = MakeType(v1::F32, {6, 9});
  auto wrong = io_.ReadBlock(r, device_, MakeType(v1::F32, {4, 5}));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("float32[6,8]; expected float32[6,9]"), std::string::npos)
      << wrong.status();
}

TEST_F(CheckpointIOTest, RemoveTouchesOnlyCheckpoints) {
  fs::create_directories(dir_ / "precious");
  std::ofstream(dir_ / "precious" / "data") << "keep";
  v1::CheckpointFilesRequest r;
  r.set_action(v1::CheckpointFilesRequest::REMOVE);
  r.set_path((dir_ / "precious").string());
  EXPECT_EQ(io_.Files(r).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(fs::exists(dir_ / "precious" / "data"));
}

}  // namespace
}  // namespace tessel::worker

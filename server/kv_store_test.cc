#include "server/kv_store.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "absl/time/clock.h"

namespace tessel::server {
namespace {

TEST(KvStore, SetThenGet) {
  KvStore kv;
  ASSERT_TRUE(kv.Set("group/a/0", std::string("\0\1addr", 6)).ok());
  auto v = kv.Get("group/a/0", absl::ZeroDuration());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, std::string("\0\1addr", 6));
  ASSERT_TRUE(kv.Set("group/a/0", "again").ok());
  EXPECT_EQ(*kv.Get("group/a/0", absl::ZeroDuration()), "again");
  EXPECT_EQ(kv.num_keys(), 1);
}

TEST(KvStore, GetWaitsForALaterSet) {
  KvStore kv;
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    ASSERT_TRUE(kv.Set("late", "value").ok());
  });
  const absl::Time start = absl::Now();
  auto v = kv.Get("late", absl::Seconds(30));
  setter.join();
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "value");
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(KvStore, GetTimesOutNamingTheKey) {
  KvStore kv;
  const absl::Time start = absl::Now();
  auto v = kv.Get("never/set", absl::Milliseconds(100));
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(90));
  ASSERT_EQ(v.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(v.status().message().find("'never/set'"), absl::string_view::npos) << v.status();
  EXPECT_EQ(kv.Get("never/set", absl::ZeroDuration()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST(KvStore, EnforcesSizeLimits) {
  KvStore kv;
  EXPECT_EQ(kv.Set("", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.Get("", absl::ZeroDuration()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(kv.Set(std::string(1024, 'k'), "v").ok());
  absl::Status long_key = kv.Set(std::string(1025, 'k'), "v");
  EXPECT_EQ(long_key.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(long_key.message().find("1025 bytes"), absl::string_view::npos) << long_key;
  EXPECT_TRUE(kv.Set("big", std::string(1 << 20, 'v')).ok());
  absl::Status big = kv.Set("too-big", std::string((1 << 20) + 1, 'v'));
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("'too-big'"), absl::string_view::npos) << big;
}

TEST(KvStore, EnforcesKeyAndByteCounts) {
  KvStore kv(KvStore::Limits{.max_keys = 2, .max_total_bytes = 100});
  ASSERT_TRUE(kv.Set("a", "1").ok());
  ASSERT_TRUE(kv.Set("b", "2").ok());
  EXPECT_TRUE(kv.Set("a", "replacing is not adding").ok());
  absl::Status third = kv.Set("c", "3");
  EXPECT_EQ(third.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(third.message().find("2 keys"), absl::string_view::npos) << third;
  absl::Status full = kv.Set("b", std::string(100, 'x'));
  EXPECT_EQ(full.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*kv.Get("b", absl::ZeroDuration()), "2");
}

}  // namespace
}  // namespace tessel::server

// The Gloo exchange between workers on its own, with no local ranks: each
// worker is a thread with its own exchange, all meeting through one
// in-memory store over real TCP on 127.0.0.1. Results are checked against
// sums and layouts computed here.
#include "worker/collectives/exchange.h"

#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/attr.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "spdlog/sinks/null_sink.h"

namespace tessel::worker {
namespace {

// Runs body(worker, exchange) for `n` workers of group `key`, one thread each.
void OnWorkers(int n, const std::string& key,
               const std::function<void(int, GlooExchange&, const GroupLayout&)>& body) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  auto log =
      std::make_shared<spdlog::logger>("exchange", std::make_shared<spdlog::sinks::null_sink_mt>());
  std::vector<std::string> workers;
  for (int w = 0; w < n; ++w) workers.push_back(absl::StrCat("w", w));
  std::vector<std::thread> threads;
  for (int w = 0; w < n; ++w) {
    threads.emplace_back([&, w] {
      auto layout = MakeLayout(GroupSpec{key, workers}, workers[w]);
      ASSERT_TRUE(layout.ok()) << layout.status();
      gloo::transport::tcp::attr attr;
      attr.hostname = "127.0.0.1";
      auto endpoint = std::make_shared<GlooEndpoint>(store, attr);
      GlooExchange exchange(*layout, endpoint, absl::Seconds(20), log);
      body(w, exchange, *layout);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(GlooExchange, HeadersReachEveryWorkerAndAllReduceSumsAcrossThem) {
  for (int n : {2, 3}) {  // two workers: the paired exchange; three: Gloo's ring
    OnWorkers(n, absl::StrCat("sum", n), [&](int w, GlooExchange& x, const GroupLayout& l) {
      const CollectiveCall c{CollectiveKind::kAllReduce, 5, v1::S32, ReduceOp::kSum};
      ASSERT_TRUE(x.Connect(c).ok());
      const CollectiveId id{1, 2, 0};
      GlooExchange::Headers h;
      ASSERT_TRUE(x.PostHeaders(MakeHeader(id, c, absl::OkStatus()), c, h).ok());
      ASSERT_TRUE(x.AwaitHeaders(c, h).ok());
      ASSERT_EQ(h.all.size(), size_t(n));
      for (const CallHeader& other : h.all) {
        EXPECT_EQ(other.execution, 1);
        EXPECT_EQ(DescribeHeader(other), "all_reduce(s32[5], sum)");
      }
      std::vector<int32_t> data(5);
      for (int i = 0; i < 5; ++i) data[i] = 100 * w + i;
      ASSERT_TRUE(x.AllReduce(c, data.data(), data.size()).ok());
      for (int i = 0; i < 5; ++i) EXPECT_EQ(data[i], 100 * n * (n - 1) / 2 + n * i) << l.key;
    });
  }
}

TEST(GlooExchange, AllGatherAndPermuteMoveEachWorkersBlock) {
  OnWorkers(3, "move", [&](int w, GlooExchange& x, const GroupLayout&) {
    const CollectiveCall gather{CollectiveKind::kAllGather, 2, v1::F32};
    ASSERT_TRUE(x.Connect(gather).ok());
    std::vector<float> all(6, -1);
    all[2 * w] = float(w);
    all[2 * w + 1] = float(w) + 0.5f;
    ASSERT_TRUE(x.AllGather(gather, reinterpret_cast<char*>(all.data())).ok());
    EXPECT_EQ(all, (std::vector<float>{0, 0.5f, 1, 1.5f, 2, 2.5f}));
    // A ring: worker w sends to w+1.
    const std::vector<std::pair<int, int>> pairs = {{0, 1}, {1, 2}, {2, 0}};
    const CollectiveCall permute{CollectiveKind::kPermute, 2, v1::F32, ReduceOp::kSum, &pairs};
    std::vector<float> in = {float(w), float(10 * w)}, out(2, -1);
    const int to = (w + 1) % 3, from = (w + 2) % 3;
    ASSERT_TRUE(
        x.Permute(permute, {{size_t(w), to, in.data()}}, {{size_t(from), from, out.data()}}).ok());
    EXPECT_EQ(out, (std::vector<float>{float(from), float(10 * from)}));
  });
}

TEST(GlooExchange, AWorkerWithoutAStoreCannotConnect) {
  auto layout = MakeLayout(GroupSpec{"nostore", {"a", "b"}}, "a");
  ASSERT_TRUE(layout.ok());
  auto log =
      std::make_shared<spdlog::logger>("exchange", std::make_shared<spdlog::sinks::null_sink_mt>());
  GlooExchange x(*layout, nullptr, absl::Seconds(1), log);
  const absl::Status s = x.Connect(CollectiveCall{CollectiveKind::kAllGather, 1, v1::F32});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("spans workers [a, b] but this worker has no rendezvous store"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace tessel::worker

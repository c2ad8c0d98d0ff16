// NcclGroups' bookkeeping without a GPU: the NCCL and CUDA calls are
// recording fakes, everything else is real. The host communicators are the
// worker's own (worker/collectives.h): in memory between the ranks of one
// registry, Gloo over loopback TCP between two registries; the unique id
// travels through a gloo::rendezvous::HashStore, as the coordinator's
// key-value store serves it to workers. Ranks run on their own threads.
// The collectives' data paths run on a GPU in cuda_device_test.
#include "worker/cuda/nccl_communicator.h"

#include <gloo/rendezvous/hash_store.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "worker/collectives.h"

namespace tessel::cuda {
namespace {

using worker::CollectiveId;
using worker::ResolvedGroup;

// What the fakes saw, and how they behave. Comms are rank + 1 cast to a
// pointer; events carry whether they mark a call's start or its end.
struct Fake {
  absl::Mutex mu;
  std::vector<std::string> calls ABSL_GUARDED_BY(mu);
  std::map<int, std::string> init_ids ABSL_GUARDED_BY(mu);  // rank -> the unique id it joined with
  int unique_ids ABSL_GUARDED_BY(mu) = 0;
  std::vector<int> aborted ABSL_GUARDED_BY(mu);
  std::vector<int> destroyed ABSL_GUARDED_BY(mu);
  bool stall ABSL_GUARDED_BY(mu) = false;  // calls start but never finish until aborted
  ncclResult_t async_error ABSL_GUARDED_BY(mu) = ncclSuccess;

  void Reset() {
    absl::MutexLock l(&mu);
    calls.clear();
    init_ids.clear();
    unique_ids = 0;
    aborted.clear();
    destroyed.clear();
    stall = false;
    async_error = ncclSuccess;
  }
  std::vector<std::string> Calls() {
    absl::MutexLock l(&mu);
    return calls;
  }
};
Fake& F() {
  static Fake* f = new Fake;
  return *f;
}
int RankOf(ncclComm_t c) { return int(reinterpret_cast<intptr_t>(c)) - 1; }
void Record(std::string s) {
  absl::MutexLock l(&F().mu);
  F().calls.push_back(std::move(s));
}

struct FakeEvent {
  bool end = false;
};
thread_local int events_made = 0;  // per call: the start marker, then the end marker

NcclApi FakeApi() {
  NcclApi a;
  a.get_unique_id = [](ncclUniqueId* id) {
    absl::MutexLock l(&F().mu);
    std::memset(id->internal, 0, sizeof(id->internal));
    std::snprintf(id->internal, sizeof(id->internal), "uid-%d", ++F().unique_ids);
    return ncclSuccess;
  };
  a.comm_init_rank = [](ncclComm_t* c, int n, ncclUniqueId id, int rank) {
    *c = reinterpret_cast<ncclComm_t>(intptr_t(rank + 1));
    absl::MutexLock l(&F().mu);
    F().init_ids[rank] = absl::StrCat(id.internal, " of ", n);
    return ncclSuccess;
  };
  a.comm_abort = [](ncclComm_t c) {
    absl::MutexLock l(&F().mu);
    F().aborted.push_back(RankOf(c));
    return ncclSuccess;
  };
  a.comm_destroy = [](ncclComm_t c) {
    absl::MutexLock l(&F().mu);
    F().destroyed.push_back(RankOf(c));
    return ncclSuccess;
  };
  a.comm_get_async_error = [](ncclComm_t, ncclResult_t* r) {
    absl::MutexLock l(&F().mu);
    *r = F().async_error;
    return ncclSuccess;
  };
  a.all_reduce = [](const void*, void*, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c,
                    cudaStream_t) {
    Record(absl::StrCat("rank ", RankOf(c), ": all_reduce ", n, " type ", int(t), " op ", int(op)));
    return ncclSuccess;
  };
  a.all_gather = [](const void*, void*, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t) {
    Record(absl::StrCat("rank ", RankOf(c), ": all_gather ", n, " type ", int(t)));
    return ncclSuccess;
  };
  a.reduce_scatter = [](const void*, void*, size_t n, ncclDataType_t t, ncclRedOp_t op,
                        ncclComm_t c, cudaStream_t) {
    Record(absl::StrCat("rank ", RankOf(c), ": reduce_scatter ", n, " type ", int(t), " op ",
                        int(op)));
    return ncclSuccess;
  };
  a.send = [](const void* p, size_t n, ncclDataType_t, int peer, ncclComm_t c, cudaStream_t) {
    Record(absl::StrCat("rank ", RankOf(c), ": send ", n, " from +",
                        reinterpret_cast<intptr_t>(p) % 4096, " to ", peer));
    return ncclSuccess;
  };
  a.recv = [](void* p, size_t n, ncclDataType_t, int peer, ncclComm_t c, cudaStream_t) {
    Record(absl::StrCat("rank ", RankOf(c), ": recv ", n, " into +",
                        reinterpret_cast<intptr_t>(p) % 4096, " from ", peer));
    return ncclSuccess;
  };
  a.group_start = [] { return ncclSuccess; };
  a.group_end = [] { return ncclSuccess; };
  a.error_string = [](ncclResult_t r) {
    return r == ncclRemoteError ? "remote process exited" : "fake error";
  };
  a.set_device = [](int) { return cudaSuccess; };
  a.memset_async = [](void* p, int, size_t n, cudaStream_t s) {
    Record(absl::StrCat("stream ", reinterpret_cast<intptr_t>(s), ": zero ", n));
    return cudaSuccess;
  };
  a.memcpy_async = [](void*, const void*, size_t n, cudaMemcpyKind, cudaStream_t s) {
    Record(absl::StrCat("stream ", reinterpret_cast<intptr_t>(s), ": copy ", n));
    return cudaSuccess;
  };
  a.event_create = [](cudaEvent_t* e, unsigned) {
    *e = reinterpret_cast<cudaEvent_t>(new FakeEvent{(events_made++ % 2) == 1});
    return cudaSuccess;
  };
  a.event_record = [](cudaEvent_t, cudaStream_t) { return cudaSuccess; };
  a.event_query = [](cudaEvent_t e) {
    absl::MutexLock l(&F().mu);
    const bool end = reinterpret_cast<FakeEvent*>(e)->end;
    // A stalled call's end passes once it was aborted (its kernels return).
    return !end || !F().stall || !F().aborted.empty() ? cudaSuccess : cudaErrorNotReady;
  };
  a.event_destroy = [](cudaEvent_t e) {
    delete reinterpret_cast<FakeEvent*>(e);
    return cudaSuccess;
  };
  return a;
}

// Ranks 0..n-1 of one group, on one or two workers ("a", "b").
class NcclGroupsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    F().Reset();
    events_made = 0;
    store_ = std::make_shared<gloo::rendezvous::HashStore>();
  }

  // Host registries for `workers` (one per distinct name).
  void MakeHosts(const std::vector<std::string>& rank_workers) {
    rank_workers_ = rank_workers;
    for (const std::string& w : rank_workers) {
      if (hosts_.count(w)) continue;
      auto r = worker::NewCommunicatorRegistry(
          {.self = w, .store = store_, .hostname = "127.0.0.1", .timeout = absl::Seconds(5)});
      ASSERT_TRUE(r.ok()) << r.status();
      hosts_[w] = std::move(*r);
    }
  }

  ResolvedGroup Group(int rank, const std::string& key) {
    worker::GroupSpec spec{key, rank_workers_, {}};
    for (size_t i = 0; i < rank_workers_.size(); ++i) spec.rank_devices.push_back(int(i));
    ResolvedGroup g;
    g.comm = *hosts_.at(rank_workers_[rank])->Get(spec);
    g.rank = rank;
    g.size = int(rank_workers_.size());
    g.spec = spec;
    return g;
  }

  static NcclDevice Device(int rank) {
    NcclDevice d;
    d.ordinal = rank;
    d.stream = reinterpret_cast<cudaStream_t>(intptr_t(100 + rank));
    d.uuid[0] = uint8_t(rank + 1);
    return d;
  }

  // Each rank runs calls[rank] on its own thread; results by rank.
  std::vector<absl::StatusOr<NcclGroups::Check>> RunAll(NcclGroups& groups, const std::string& key,
                                                        const std::vector<NcclCall>& calls,
                                                        CollectiveId id,
                                                        std::vector<NcclDevice> devices = {}) {
    const int n = int(calls.size());
    if (devices.empty()) {
      for (int r = 0; r < n; ++r) devices.push_back(Device(r));
    }
    std::vector<absl::StatusOr<NcclGroups::Check>> out(n, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back(
          [&, r] { out[r] = groups.Run(Group(r, key), id, calls[r], devices[r], store_.get()); });
    }
    for (auto& t : threads) t.join();
    return out;
  }

  static NcclGroups::Options Options(absl::Duration timeout = absl::Seconds(5)) {
    return {.api = FakeApi(), .timeout = timeout, .poll = absl::Milliseconds(1)};
  }

  std::shared_ptr<gloo::rendezvous::HashStore> store_;
  std::map<std::string, std::unique_ptr<worker::CommunicatorRegistry>> hosts_;
  std::vector<std::string> rank_workers_;
};

NcclCall Call(NcclCall::Kind kind, int64_t count, v1::DType dtype = v1::F32) {
  alignas(4096) static char buffers[2][4096];
  NcclCall c;
  c.kind = kind;
  c.in = buffers[0];
  c.out = buffers[1];
  c.count = count;
  c.dtype = dtype;
  return c;
}

bool Has(const std::vector<std::string>& calls, const std::string& s) {
  return std::find(calls.begin(), calls.end(), s) != calls.end();
}

TEST_F(NcclGroupsTest, RanksOnTwoWorkersShareTheUniqueIdFromTheStoreAndQueueEachCollective) {
  MakeHosts({"a", "b"});
  NcclGroups groups(Options());
  const std::string key = "devices:0,1@1.1";
  const auto all_reduce = Call(NcclCall::Kind::kAllReduce, 256);
  for (auto& r : RunAll(groups, key, {all_reduce, all_reduce}, {7, 3, 0})) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE((*r)().ok());
  }
  {
    absl::MutexLock l(&F().mu);
    EXPECT_EQ(F().unique_ids, 1);  // drawn once, by rank 0's worker
    EXPECT_EQ(F().init_ids[0], "uid-1 of 2");
    EXPECT_EQ(F().init_ids[1], "uid-1 of 2");
  }
  const std::vector<char> published = store_->get(key + "/nccl-unique-id");
  EXPECT_EQ(std::string(published.data()), "uid-1");
  std::vector<std::string> calls = F().Calls();
  std::sort(calls.begin(), calls.end());
  EXPECT_EQ(calls, (std::vector<std::string>{"rank 0: all_reduce 256 type 7 op 0",
                                             "rank 1: all_reduce 256 type 7 op 0"}));

  // all_to_all: block r (16 f32 = 64 bytes) to and from rank r, grouped.
  F().Reset();
  const auto a2a = Call(NcclCall::Kind::kAllToAll, 16);
  for (auto& r : RunAll(groups, key, {a2a, a2a}, {7, 4, 0})) ASSERT_TRUE(r.ok()) << r.status();
  calls = F().Calls();
  {
    absl::MutexLock l(&F().mu);
    EXPECT_EQ(F().unique_ids, 0);  // the group is joined already
  }
  for (int r = 0; r < 2; ++r) {
    for (int peer = 0; peer < 2; ++peer) {
      EXPECT_TRUE(Has(calls, absl::StrCat("rank ", r, ": send 16 from +", peer * 64, " to ", peer)))
          << r << peer;
      EXPECT_TRUE(
          Has(calls, absl::StrCat("rank ", r, ": recv 16 into +", peer * 64, " from ", peer)))
          << r << peer;
    }
  }

  // collective_permute 0 -> 1: rank 0 sends, rank 1 receives, rank 0 (no
  // source) is zeroed on its own stream.
  F().Reset();
  auto perm = Call(NcclCall::Kind::kPermute, 8, v1::S16);
  perm.pairs = {{0, 1}};
  for (auto& r : RunAll(groups, key, {perm, perm}, {7, 5, 0})) ASSERT_TRUE(r.ok()) << r.status();
  calls = F().Calls();
  EXPECT_EQ(calls.size(), 3u);
  EXPECT_TRUE(Has(calls, "rank 0: send 16 from +0 to 1"));  // s16 moves as bytes
  EXPECT_TRUE(Has(calls, "rank 1: recv 16 into +0 from 0"));
  EXPECT_TRUE(Has(calls, "stream 100: zero 16"));
}

TEST_F(NcclGroupsTest, RanksThatDisagreeQueueNothingAndBothSayWhy) {
  MakeHosts({"a", "a"});
  NcclGroups groups(Options());
  auto results =
      RunAll(groups, "devices:0,1@1.1",
             {Call(NcclCall::Kind::kAllReduce, 4), Call(NcclCall::Kind::kAllGather, 4)}, {9, 1, 0});
  for (auto& r : results) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(
                  "device 0 calls all_reduce(f32[4], sum), device 1 calls all_gather(f32[4])"),
              std::string::npos)
        << r.status();
  }
  EXPECT_TRUE(F().Calls().empty());
  absl::MutexLock l(&F().mu);
  EXPECT_TRUE(F().init_ids.empty());  // not even a communicator
}

TEST_F(NcclGroupsTest, TwoRanksOnOneGpuAreRefusedBeforeNcclIsAsked) {
  MakeHosts({"a", "b"});
  NcclGroups groups(Options());
  NcclDevice same = Device(0);
  const auto c = Call(NcclCall::Kind::kAllReduce, 4);
  for (auto& r : RunAll(groups, "devices:0,1@1.1", {c, c}, {9, 1, 0}, {same, same})) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
    EXPECT_NE(r.status().message().find("device 0 and device 1 are the same GPU"),
              std::string::npos)
        << r.status();
  }
  absl::MutexLock l(&F().mu);
  EXPECT_TRUE(F().init_ids.empty());
}

TEST_F(NcclGroupsTest, APeerThatAbandonsFailsTheCallBeforeAnythingIsQueued) {
  MakeHosts({"a", "b"});
  NcclGroups groups(Options());
  const std::string key = "devices:0,1@1.1";
  const CollectiveId id{11, 2, 0};
  absl::StatusOr<NcclGroups::Check> r0 = absl::UnknownError("not run");
  std::thread t([&] {
    r0 =
        groups.Run(Group(0, key), id, Call(NcclCall::Kind::kAllReduce, 4), Device(0), store_.get());
  });
  const absl::Status abandoned =
      Group(1, key).comm->Abandon(1, id, absl::InternalError("kernel failed on purpose"));
  EXPECT_EQ(abandoned.code(), absl::StatusCode::kAborted) << abandoned;  // the round it left
  t.join();
  ASSERT_FALSE(r0.ok());
  EXPECT_EQ(r0.status().code(), absl::StatusCode::kAborted) << r0.status();
  EXPECT_NE(r0.status().message().find("kernel failed on purpose"), std::string::npos)
      << r0.status();
  EXPECT_TRUE(F().Calls().empty());
}

TEST_F(NcclGroupsTest, ACallThatStallsOnTheGpuIsAbortedAndBreaksItsGroup) {
  MakeHosts({"a", "b"});
  NcclGroups groups(Options(absl::Milliseconds(200)));
  const std::string key = "devices:0,1@1.1";
  {
    absl::MutexLock l(&F().mu);
    F().stall = true;
  }
  const auto c = Call(NcclCall::Kind::kAllGather, 4);
  for (auto& r : RunAll(groups, key, {c, c}, {12, 0, 0})) {
    ASSERT_TRUE(r.ok()) << r.status();  // queued: the stall shows on the GPU
    const absl::Status verdict = (*r)();
    EXPECT_EQ(verdict.code(), absl::StatusCode::kDeadlineExceeded) << verdict;
    EXPECT_NE(verdict.message().find("not finished 200ms after it started on the GPU"),
              std::string::npos)
        << verdict;
    EXPECT_TRUE(verdict.GetPayload(kGroupBrokenPayload).has_value());
  }
  {
    absl::MutexLock l(&F().mu);
    EXPECT_EQ(F().aborted.size(), 2u);  // both ranks' communicators
  }
  // The group stays broken: the next call fails at once, without NCCL.
  F().Reset();
  for (auto& r : RunAll(groups, key, {c, c}, {13, 0, 0})) {
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("not finished"), std::string::npos) << r.status();
  }
  EXPECT_TRUE(F().Calls().empty());
}

TEST_F(NcclGroupsTest, AnAsynchronousNcclErrorFailsTheCallNamingTheRank) {
  MakeHosts({"a", "b"});
  NcclGroups groups(Options());
  {
    absl::MutexLock l(&F().mu);
    F().stall = true;
    F().async_error = ncclRemoteError;
  }
  const auto c = Call(NcclCall::Kind::kReduceScatter, 4, v1::BF16);
  for (auto& r : RunAll(groups, "devices:0,1@1.1", {c, c}, {14, 0, 0})) {
    // Each rank learns it when queueing (the group broke first) or from its verdict.
    const absl::Status verdict = r.ok() ? (*r)() : r.status();
    EXPECT_EQ(verdict.code(), absl::StatusCode::kUnavailable) << verdict;
    EXPECT_NE(verdict.message().find("NCCL error 6 (remote process exited)"), std::string::npos)
        << verdict;
    EXPECT_NE(verdict.message().find("of 2 in group devices:0,1@1.1"), std::string::npos)
        << verdict;
  }
}

TEST_F(NcclGroupsTest, AGroupOfANewEpochSupersedesTheOldOne) {
  MakeHosts({"a", "a"});
  NcclGroups groups(Options());
  const auto c = Call(NcclCall::Kind::kAllReduce, 4);
  for (auto& r : RunAll(groups, "devices:0,1@1.1", {c, c}, {1, 0, 0}))
    ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(groups.num_groups(), 1);
  for (auto& r : RunAll(groups, "devices:0,1@1.2", {c, c}, {2, 0, 0}))
    ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(groups.num_groups(), 1);
  absl::MutexLock l(&F().mu);
  EXPECT_EQ(F().aborted.size(), 2u);  // the old epoch's communicators
  EXPECT_EQ(F().unique_ids, 2);       // the new epoch drew its own id
  EXPECT_EQ(F().init_ids[0], "uid-2 of 2");
}

TEST(NcclType, SixteenBitIntegersMoveAsBytesButDoNotReduce) {
  auto moved = NcclType(v1::U16, /*reduce=*/false, 10);
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(moved->first, ncclUint8);
  EXPECT_EQ(moved->second, 20);
  auto reduced = NcclType(v1::S16, /*reduce=*/true, 10);
  EXPECT_EQ(reduced.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(reduced.status().message().find("s16"), std::string::npos) << reduced.status();
  EXPECT_EQ(NcclType(v1::BF16, true, 3)->first, ncclBfloat16);
  EXPECT_EQ(NcclType(v1::PRED, true, 3)->first, ncclUint8);
}

}  // namespace
}  // namespace tessel::cuda

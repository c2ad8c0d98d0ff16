// The coordinator's parts, each tested alone: the WorkerRegistry, the
// ArrayRegistry, the CompileCache and the ExecutePlanner; then the façade
// over a fake WorkerClient whose step callbacks the test fires.
#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "core/version.h"
#include "server/array_registry.h"
#include "server/compile_cache.h"
#include "server/coordinator.h"
#include "server/execute_planner.h"
#include "server/fake_worker_client.h"
#include "server/tenants.h"
#include "server/worker_registry.h"
#include "spdlog/sinks/null_sink.h"
#include "spdlog/spdlog.h"

namespace tessel::server {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<spdlog::logger> NullLogger() {
  return std::make_shared<spdlog::logger>("test", std::make_shared<spdlog::sinks::null_sink_mt>());
}

v1::RegisterWorkerRequest Registration(const std::string& address, int devices) {
  v1::RegisterWorkerRequest r;
  r.set_address(address);
  r.set_num_devices(devices);
  r.set_protocol_version(kProtocolVersionMax);
  r.set_worker_secret("secret-of-" + address + "-0123456789");
  return r;
}

v1::Graph Parse(const std::string& text) {
  v1::Graph g;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &g)) << text;
  return g;
}

// z = x + y over f32[4].
constexpr char kAdd[] = R"pb(
  name: "add"
  nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
  nodes { name: "y" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 4 } }
  nodes { name: "z" op: ADD operands: ["x", "y"] }
  outputs: "z"
)pb";

// No parameters: an iota, so an Execute needs no put.
constexpr char kIota[] = R"pb(
  name: "iota"
  nodes { name: "i" op: CONSTANT constant { iota { dimension: 0 } } type { dtype: F32 dims: 8 } }
  nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: 8 } }
  nodes { name: "z" op: MUL operands: ["i", "two"] }
  outputs: "z"
)pb";

// ----------------------------------------------------------- WorkerRegistry

TEST(WorkerRegistry, RejectsBadRegistrationsNamingTheWorker) {
  auto r = Registration("10.0.0.1:5000", 2);
  r.set_protocol_version(kProtocolVersionMax + 1);
  EXPECT_THAT(WorkerRegistry::Validate(r).message(), HasSubstr("10.0.0.1:5000 speaks protocol"));
  r = Registration("10.0.0.1:5000", 0);
  EXPECT_THAT(WorkerRegistry::Validate(r).message(),
              HasSubstr("num_devices expected 1..1024, got 0"));
  r = Registration("", 1);
  EXPECT_EQ(WorkerRegistry::Validate(r).code(), absl::StatusCode::kInvalidArgument);
  r = Registration("h:1", 2);
  r.add_device_kinds("cpu");
  EXPECT_THAT(WorkerRegistry::Validate(r).message(), HasSubstr("1 device kinds for 2 devices"));
  EXPECT_TRUE(WorkerRegistry::Validate(Registration("h:1", 2)).ok());
}

TEST(WorkerRegistry, GlobalIdsFollowRegistrationOrder) {
  WorkerRegistry reg(NullLogger());
  auto a = reg.Register(Registration("a:1", 2), std::make_shared<FakeWorkerClient>("a:1"),
                        absl::Seconds(1), 7);
  auto b = reg.Register(Registration("b:1", 3), std::make_shared<FakeWorkerClient>("b:1"),
                        absl::Seconds(1), 9);
  EXPECT_NE(a.worker_id(), b.worker_id());
  EXPECT_EQ(a.queue_epoch(), 7u);
  EXPECT_EQ(reg.num_devices(), 5);
  std::vector<DeviceRoute> routes = reg.Routes();
  ASSERT_EQ(routes.size(), 5u);
  EXPECT_EQ(routes[1].worker_id, a.worker_id());
  EXPECT_EQ(routes[1].local_index, 1);
  EXPECT_EQ(routes[2].worker_id, b.worker_id());
  EXPECT_EQ(routes[2].local_index, 0);
  EXPECT_EQ(routes[4].address, "b:1");
}

TEST(WorkerRegistry, ReservationsNumberEachDeviceInOneOrder) {
  // Two threads reserve steps over the same two devices; on both devices
  // the reservations must come in the same order, or two partitioned steps
  // would wait on each other.
  WorkerRegistry reg(NullLogger());
  reg.Register(Registration("a:1", 2), std::make_shared<FakeWorkerClient>("a:1"), absl::Seconds(1),
               1);
  constexpr int kEach = 2000;
  std::vector<std::pair<uint64_t, uint64_t>> got[2];
  auto work = [&](int t) {
    for (int i = 0; i < kEach; ++i) {
      auto slots = reg.Reserve(t == 0 ? std::vector<int>{0, 1} : std::vector<int>{1, 0}, {1, 1});
      got[t].emplace_back(slots[t == 0 ? 0 : 1].first_seq, slots[t == 0 ? 1 : 0].first_seq);
    }
  };
  std::thread t0(work, 0), t1(work, 1);
  t0.join();
  t1.join();
  std::vector<std::pair<uint64_t, uint64_t>> all = got[0];
  all.insert(all.end(), got[1].begin(), got[1].end());
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i < all.size(); ++i) {
    EXPECT_EQ(all[i].first, i);
    EXPECT_EQ(all[i].second, i) << "device 1 numbered reservation " << i
                                << " differently from device 0";
  }
  // Counts above one take consecutive numbers.
  auto slots = reg.Reserve({0}, {2});
  EXPECT_EQ(slots[0].first_seq, 2u * kEach);
  EXPECT_EQ(reg.Reserve({0}, {1})[0].first_seq, 2u * kEach + 2);
}

TEST(WorkerRegistry, RestartedQueuesStartOverAndAreOpenedOnce) {
  WorkerRegistry reg(NullLogger());
  auto fake = std::make_shared<FakeWorkerClient>("a:1");
  auto w = reg.Register(Registration("a:1", 2), fake, absl::Seconds(1), 5);
  reg.Reserve({0, 1}, {3, 1});
  EXPECT_FALSE(reg.RestartQueues("nobody", 77));
  ASSERT_TRUE(reg.RestartQueues(w.worker_id(), 77));
  // A step goes to device 1 first: only device 0 needs an opener.
  auto slot = reg.Reserve({1}, {1});
  EXPECT_EQ(slot[0].first_seq, 0u);
  EXPECT_EQ(slot[0].queue_epoch, 77u);
  std::vector<PendingFree> openers = reg.TakeOpeners();
  ASSERT_EQ(openers.size(), 1u);
  EXPECT_EQ(openers[0].device, 0);
  EXPECT_EQ(openers[0].request.seq(), 0u);
  EXPECT_EQ(openers[0].request.queue_epoch(), 77u);
  EXPECT_EQ(openers[0].request.buffers_size(), 0);
  EXPECT_TRUE(reg.TakeOpeners().empty());
  EXPECT_EQ(reg.Reserve({0}, {1})[0].first_seq, 1u);
}

TEST(WorkerRegistry, ARestartedOrDisplacedWorkerSupersedesTheOldRecord) {
  WorkerRegistry reg(NullLogger());
  auto named = [](const std::string& address, const std::string& name,
                  const std::string& incarnation) {
    auto r = Registration(address, 1);
    r.set_worker_name(name);
    r.set_worker_incarnation(incarnation);
    return r;
  };
  auto a = reg.Register(named("h:1", "node-a", "i1"), std::make_shared<FakeWorkerClient>("h:1"),
                        absl::Seconds(1), 1);
  auto b = reg.Register(named("h:2", "node-b", "j1"), std::make_shared<FakeWorkerClient>("h:2"),
                        absl::Seconds(1), 2);
  const absl::Time now = absl::Now();
  // The same incarnation registering again (after the coordinator forgot
  // it) replaces nobody.
  EXPECT_TRUE(reg.Supersede(named("h:1", "node-a", "i1"), now).empty());
  // node-a restarted, on another port: its old record dies, node-b stays.
  auto gone = reg.Supersede(named("h:9", "node-a", "i2"), now);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].id, a.worker_id());
  EXPECT_EQ(gone[0].name, "node-a");
  EXPECT_EQ(reg.CheckAlive({0}).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(reg.CheckAlive({1}).ok());
  // Another name at node-b's address displaces it.
  gone = reg.Supersede(named("h:2", "node-c", "k1"), now);
  ASSERT_EQ(gone.size(), 1u);
  EXPECT_EQ(gone[0].id, b.worker_id());
}

TEST(WorkerRegistry, SilentWorkersDieAndSayWhere) {
  WorkerRegistry reg(NullLogger());
  auto a = reg.Register(Registration("a:1", 1), std::make_shared<FakeWorkerClient>("a:1"),
                        absl::Seconds(1), 1);
  auto b = reg.Register(Registration("b:1", 1), std::make_shared<FakeWorkerClient>("b:1"),
                        absl::Seconds(1), 2);
  const absl::Time now = absl::Now();
  EXPECT_TRUE(*reg.Heartbeat(b.worker_id(), "secret-of-b:1-0123456789", now + absl::Seconds(10)));
  // Only the worker's own secret keeps it alive.
  EXPECT_EQ(reg.Heartbeat(a.worker_id(), "secret-of-b:1-0123456789", now + absl::Seconds(10))
                .status()
                .code(),
            absl::StatusCode::kPermissionDenied);
  auto expired = reg.ExpireSilent(now + absl::Seconds(11), absl::Seconds(5));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].id, a.worker_id());
  EXPECT_EQ(expired[0].devices, std::vector<int>{0});
  EXPECT_FALSE(
      *reg.Heartbeat(a.worker_id(), "secret-of-a:1-0123456789", now));  // must register again
  absl::Status s = reg.CheckAlive({1, 0});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(),
              HasSubstr("device 0 is on worker " + a.worker_id() + " (a:1), which is dead"));
  v1::Placement p;
  p.set_device(0);
  EXPECT_EQ(reg.ResolvePlacement(p).status().code(), absl::StatusCode::kUnavailable);
  p.set_device(9);
  EXPECT_THAT(reg.ResolvePlacement(p).status().message(), HasSubstr("device 9 does not exist"));
  p.set_replicated(true);
  EXPECT_EQ(*reg.ResolvePlacement(p), std::vector<int>{1});
  // A dead device gets no client and no number; frees to it are dropped.
  EXPECT_EQ(reg.Reserve({0}, {1})[0].client, nullptr);
  absl::flat_hash_map<int, v1::FreeRequest> frees;
  frees[0].add_buffers(1);
  frees[1].add_buffers(2);
  auto sent = reg.SequenceFrees(frees);
  ASSERT_EQ(sent.size(), 1u);
  EXPECT_EQ(sent[0].device, 1);
  EXPECT_EQ(sent[0].request.device(), 0);  // worker-local index
}

TEST(WorkerRegistry, LoadsAreRememberedPerWorkerUntilOneFails) {
  WorkerRegistry reg(NullLogger());
  auto fake = std::make_shared<FakeWorkerClient>("a:1");
  reg.Register(Registration("a:1", 2), fake, absl::Seconds(1), 1);
  const std::string e1 = "e1";
  auto slots = reg.Reserve({0, 1}, {1, 1}, &e1);
  EXPECT_TRUE(slots[0].needs_load);
  EXPECT_FALSE(slots[1].needs_load);  // same worker
  EXPECT_FALSE(reg.Reserve({1}, {1}, &e1)[0].needs_load);
  EXPECT_FALSE(reg.Reserve({1}, {1})[0].needs_load);  // no executable named
  reg.ForgetLoaded(fake.get(), "e1");
  EXPECT_TRUE(reg.Reserve({1}, {1}, &e1)[0].needs_load);
}

// ------------------------------------------------------------ ArrayRegistry

ArrayRecord Array(std::vector<int> devices, int pending) {
  ArrayRecord a;
  a.type.set_dtype(v1::F32);
  a.type.add_dims(4);
  a.devices = std::move(devices);
  a.state = v1::PENDING;
  a.pending = pending;
  return a;
}

TEST(ArrayRegistry, RetiredArraysSayWhatBecameOfThem) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s1", "test", {}).ok());
  ASSERT_TRUE(reg.OpenSession("s2", "test", {}).ok());
  ArrayRegistry::Transaction l(reg);
  reg.AddLocked("s1", 0x10, Array({0}, 1));
  reg.AddLocked("s1", 0x11, Array({0}, 1));
  EXPECT_EQ(reg.SessionLocked("s1").live_bytes, 32);
  EXPECT_TRUE(reg.OwnedLocked("s1", 0x10).ok());
  EXPECT_EQ(reg.OwnedLocked("s2", 0x10).status().code(), absl::StatusCode::kPermissionDenied);
  reg.RetireLocked(0x10, v1::DONATED, 42, "train_step", absl::Now());
  absl::Status s = reg.OwnedLocked("s1", 0x10).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("array 0x10 was donated to execution 42 ('train_step')"));
  auto frees = reg.RetireDeletedLocked({0x11, 0x99});
  ASSERT_EQ(frees.size(), 1u);
  EXPECT_EQ(frees[0].buffers_size(), 1);
  EXPECT_THAT(reg.OwnedLocked("s1", 0x11).status().message(),
              HasSubstr("array 0x11 was deleted at"));
  EXPECT_THAT(reg.OwnedLocked("s1", 0x99).status().message(), HasSubstr("does not exist"));
  EXPECT_EQ(reg.SessionLocked("s1").live_bytes, 0);
  EXPECT_EQ(reg.SessionLocked("s1").arrays.size(), 0u);
  EXPECT_THAT(reg.CheckSessionLocked("s3").message(), HasSubstr("session 's3' does not exist"));
}

TEST(ArrayRegistry, AnExecutionIsCommittedAsOneChange) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  ArrayRegistry::Transaction l(reg);
  reg.AddLocked("s", 0x10, Array({0, 1}, 0));  // donated; a copy on device 1, where nothing runs
  reg.AddLocked("s", 0x11, Array({0}, 0));     // read, kept
  ArrayRegistry::ExecutionChanges changes{.execution = 7, .executable = "step", .devices = {0}};
  changes.donated = {0x10};
  changes.outputs.emplace_back(0x20, Array({0}, 1));
  auto elsewhere = reg.CommitExecutionLocked("s", std::move(changes));
  ASSERT_EQ(elsewhere.size(), 1u);
  ASSERT_TRUE(elsewhere.contains(1));
  EXPECT_EQ(elsewhere[1].buffers(0), 0x10u);
  const SessionRecord& s = reg.SessionLocked("s");
  EXPECT_EQ(s.executions, 1);
  EXPECT_EQ(s.donations, 1);
  EXPECT_EQ(s.arrays.size(), 2u);  // 0x11 and the output
  EXPECT_EQ(s.live_bytes, 32);
  EXPECT_EQ(reg.FindLocked(0x20)->producer, 7);
  EXPECT_EQ(reg.FindLocked(0x20)->session, "s");
  EXPECT_THAT(reg.OwnedLocked("s", 0x10).status().message(),
              HasSubstr("array 0x10 was donated to execution 7 ('step')"));
}

TEST(ArrayRegistry, ARejectedCallsOutputsCarryItsErrorAndKnownHandlesStay) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  {
    ArrayRegistry::Transaction l(reg);
    reg.AddLocked("s", 0x10, Array({0}, 0));
  }
  reg.AddFailed("s", {0, 0x10, 0x11}, absl::InvalidArgumentError("bad argument"), "rejected");
  reg.AddFailed("gone", {0x12}, absl::InvalidArgumentError("bad argument"), "rejected");
  ArrayRegistry::Transaction l(reg);
  EXPECT_EQ(reg.FindLocked(0x10)->state, v1::PENDING);  // not overwritten
  ASSERT_NE(reg.FindLocked(0x11), nullptr);
  EXPECT_EQ(reg.FindLocked(0x11)->state, v1::ERROR);
  EXPECT_EQ(reg.FindLocked(0x11)->error.message(), "bad argument");
  EXPECT_EQ(reg.FindLocked(0x12), nullptr);
  EXPECT_FALSE(reg.ContainsLocked(0));
}

TEST(ArrayRegistry, ASessionViewRenewsTheLeaseAndNamesAMissingSession) {
  ArrayRegistry reg;
  v1::SessionOptions options;
  options.set_forbid_compiles(true);
  ASSERT_TRUE(reg.OpenSession("s", "test", options, "team-a").ok());
  const absl::Time later = absl::Now() + absl::Hours(1);
  EXPECT_EQ(reg.IdleSessions(later, absl::Minutes(30)), std::vector<std::string>{"s"});
  auto view = reg.ViewSession("s");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->tenant, "team-a");
  EXPECT_TRUE(view->options.forbid_compiles());
  EXPECT_THAT(reg.ViewSession("t").status().message(), HasSubstr("session 't' does not exist"));
  EXPECT_TRUE(reg.IdleSessions(absl::Now(), absl::Minutes(30)).empty());
}

TEST(ArrayRegistry, TombstonesAreBounded) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  ArrayRegistry::Transaction l(reg);
  const uint64_t n = ArrayRegistry::kMaxTombstones + 10;
  for (uint64_t h = 1; h <= n; ++h) {
    reg.AddLocked("s", h, Array({0}, 0));
    reg.RetireLocked(h, v1::DELETED, 0, "", absl::Now());
  }
  EXPECT_EQ(reg.SessionLocked("s").tombstones.size(), ArrayRegistry::kMaxTombstones);
  EXPECT_EQ(reg.FindTombstoneLocked("s", 1), nullptr);  // the oldest went first
  EXPECT_NE(reg.FindTombstoneLocked("s", n), nullptr);
}

TEST(TombstoneRing, KeepsTheNewestAndFindsTheLatestOfAHandle) {
  TombstoneRing ring(4);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  for (uint64_t h = 1; h <= 3; ++h) ring.Add(h, v1::DELETED, 0, "", t0 + absl::Seconds(h));
  ring.Add(2, v1::DONATED, 7, "step",
           t0 + absl::Seconds(4));  // the same handle again: the newer answers
  ASSERT_NE(ring.Find(2), nullptr);
  EXPECT_EQ(ring.Find(2)->state, v1::DONATED);
  EXPECT_EQ(ring.Find(2)->execution, 7);
  EXPECT_EQ(ring.Find(2)->executable, "step");
  // Full: each add overwrites the oldest, so 1 goes, then the first 2.
  ring.Add(5, v1::DELETED, 0, "", t0 + absl::Seconds(5));
  EXPECT_EQ(ring.Find(1), nullptr);
  EXPECT_EQ(ring.Find(2)->state, v1::DONATED);
  ring.Add(6, v1::DONATED, 9, "a name longer than a short string's inline storage",
           t0 + absl::Seconds(6));
  EXPECT_EQ(ring.Find(2)->execution, 7);  // the newer 2 is still there
  EXPECT_EQ(ring.Find(6)->executable, "a name longer than a short string's inline storage");
  EXPECT_EQ(ring.Find(6)->when, t0 + absl::Seconds(6));
  EXPECT_EQ(ring.Find(3)->when, t0 + absl::Seconds(3));
  ring.Add(7, v1::DELETED, 0, "", t0);
  ring.Add(8, v1::DELETED, 0, "", t0);
  EXPECT_EQ(ring.Find(3), nullptr);
  EXPECT_EQ(ring.Find(2), nullptr);  // both of its tombstones overwritten
  EXPECT_EQ(ring.Find(6)->executable, "a name longer than a short string's inline storage");
  EXPECT_EQ(ring.Find(6)->execution, 9);
  EXPECT_EQ(ring.size(), 4u);
  EXPECT_EQ(ring.Find(99), nullptr);
}

TEST(ArrayRegistry, QuotaNamesTheSessionAndWhatItHolds) {
  ArrayRegistry reg;
  v1::SessionOptions o;
  o.set_memory_quota_bytes(40);
  ASSERT_TRUE(reg.OpenSession("s", "test", o).ok());
  ArrayRegistry::Transaction l(reg);
  reg.AddLocked("s", 1, Array({0}, 0));
  EXPECT_TRUE(reg.CheckQuotaLocked("s", 24, "x").ok());
  absl::Status s = reg.CheckQuotaLocked("s", 25, "execution of 'f'");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(
      s.message(),
      HasSubstr("execution of 'f' needs 25 more bytes; the session holds 16 bytes in 1 live "
                "arrays, quota 40"));
}

TEST(ArrayRegistry, AnArrayIsReadyWhenEveryDeviceReportedAndAFailureSticks) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  {
    ArrayRegistry::Transaction l(reg);
    reg.AddLocked("s", 1, Array({0, 1}, 2));
    reg.AddLocked("s", 2, Array({0, 1}, 2));
  }
  reg.StepDone("s", {1}, absl::OkStatus(), 0);
  {
    ArrayRegistry::Transaction l(reg);
    EXPECT_EQ(reg.FindLocked(1)->state, v1::PENDING);
  }
  reg.StepDone("s", {1}, absl::OkStatus(), 1);
  auto failed = reg.StepDone("s", {2}, absl::InternalError("device 1 ran out of memory"), 0);
  EXPECT_EQ(failed, std::vector<uint64_t>{2});
  reg.StepDone("s", {2}, absl::OkStatus(), 0);  // the other device's success does not undo it
  ArrayRegistry::Transaction l(reg);
  EXPECT_EQ(reg.FindLocked(1)->state, v1::READY);
  EXPECT_EQ(reg.FindLocked(2)->state, v1::ERROR);
  EXPECT_THAT(reg.FindLocked(2)->error.message(), HasSubstr("out of memory"));
  EXPECT_EQ(reg.SessionLocked("s").donations_reused, 1);
}

TEST(ArrayRegistry, AwaitWakesWhenAnotherThreadFinishesTheStep) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  {
    ArrayRegistry::Transaction l(reg);
    reg.AddLocked("s", 1, Array({0}, 1));
    EXPECT_FALSE(reg.AwaitNotPendingLocked({1}, absl::Milliseconds(20)));
  }
  std::thread t([&] {
    absl::SleepFor(absl::Milliseconds(50));
    reg.StepDone("s", {1}, absl::OkStatus(), 0);
  });
  {
    ArrayRegistry::Transaction l(reg);
    EXPECT_TRUE(reg.AwaitNotPendingLocked({1}, absl::Seconds(30)));
    EXPECT_EQ(reg.FindLocked(1)->state, v1::READY);
  }
  t.join();
}

TEST(ArrayRegistry, ArraysOnADeadWorkerAreLostNotFailedOnesAgain) {
  ArrayRegistry reg;
  ASSERT_TRUE(reg.OpenSession("s", "test", {}).ok());
  {
    ArrayRegistry::Transaction l(reg);
    reg.AddLocked("s", 1, Array({0, 1}, 2));
    reg.AddLocked("s", 2, Array({2}, 1));
    ArrayRecord failed = Array({1}, 0);
    failed.state = v1::ERROR;
    failed.error = absl::InternalError("earlier");
    reg.AddLocked("s", 3, failed);
  }
  EXPECT_EQ(
      reg.LoseOn({1}, absl::UnavailableError("was on worker w0 (a:1), which stopped heartbeating")),
      1);
  ArrayRegistry::Transaction l(reg);
  EXPECT_EQ(reg.FindLocked(1)->state, v1::LOST);
  EXPECT_EQ(reg.FindLocked(1)->error.message(),
            "array 0x1 was on worker w0 (a:1), which stopped heartbeating");
  EXPECT_EQ(reg.FindLocked(2)->state, v1::PENDING);
  EXPECT_EQ(reg.FindLocked(3)->state, v1::ERROR);
}

// ------------------------------------------------------------- CompileCache

// A compile of graph `g` under executable id `id` (the cache keys by the
// compiled program's id).
scheduler::CompiledProgram CompiledAs(const v1::Graph& g, const std::string& id) {
  auto c = scheduler::Compile(g, {});
  EXPECT_TRUE(c.ok()) << c.status();
  c->fingerprint = id;
  return *c;
}

TEST(CompileCache, CountsHitsAndExplainsMisses) {
  CompileCache cache;
  const v1::Graph g = Parse(kAdd);
  EXPECT_EQ(cache.Lookup("a", "k1"), nullptr);
  EXPECT_THAT(cache.ExplainMiss("a", g, {}),
              HasSubstr("no executable of graph 'add' was compiled before (0 executables"));
  auto first = cache.Insert("a", CompiledAs(g, "k1"), g);
  EXPECT_EQ(cache.Insert("a", CompiledAs(g, "k1"), g),
            first);  // a racing second compile keeps the first entry
  EXPECT_EQ(cache.compiles(), 2);
  EXPECT_EQ(cache.Lookup("a", "k1"), first);
  EXPECT_EQ(cache.FindAnyTenant("k1"), first);
  EXPECT_EQ(cache.hits(), 1);
  EXPECT_EQ(cache.size(), 1);

  v1::Graph dtype = g;
  dtype.mutable_nodes(1)->mutable_type()->set_dtype(v1::F64);
  EXPECT_THAT(cache.ExplainMiss("a", dtype, {}),
              HasSubstr("parameter 1 'y': f64[4] here, f32[4] in the cached one (dtype)"));
  v1::Graph shape = g;
  shape.mutable_nodes(0)->mutable_type()->set_dims(0, 5);
  EXPECT_THAT(cache.ExplainMiss("a", shape, {}),
              HasSubstr("parameter 0 'x': f32[5] here, f32[4] in the cached one (shape)"));
  EXPECT_THAT(cache.ExplainMiss("a", g, {1}),
              HasSubstr("donated parameters [1] here, [] in the cached one"));
  v1::Graph op = g;
  op.mutable_nodes(2)->set_op(v1::SUB);
  EXPECT_THAT(cache.ExplainMiss("a", op, {}), HasSubstr("node 2 'z' (sub) differs"));
}

// A miss for the same graph laid out otherwise names the layout that
// differs: a parameter's sharding, an output's, or the mesh.
TEST(CompileCache, ExplainsAMissByTheLayoutsAskedFor) {
  CompileCache cache;
  const v1::Graph g = Parse(kAdd);
  scheduler::CompileOptions options;
  options.mesh.add_axis_names("data");
  options.mesh.add_axis_sizes(2);
  v1::Sharding split, whole;
  split.add_dims()->add_axes("data");
  whole.add_dims();
  options.parameter_shardings = {split, whole};
  auto c = scheduler::Compile(g, options);
  ASSERT_TRUE(c.ok()) << c.status();
  c->fingerprint = "k1";
  cache.Insert("a", *c, g);
  EXPECT_THAT(cache.ExplainMiss("a", g, {}, &options),
              HasSubstr("they differ only in attributes outside nodes and parameters"));
  scheduler::CompileOptions swapped = options;
  swapped.parameter_shardings = {whole, split};
  const std::string why = cache.ExplainMiss("a", g, {}, &swapped);
  EXPECT_THAT(why,
              HasSubstr("parameter 0 'x': laid out P(None,) here, P('data',) in the cached one"));
  EXPECT_THAT(why,
              HasSubstr("parameter 1 'y': laid out P('data',) here, P(None,) in the cached one"));
  scheduler::CompileOptions out = options;
  out.output_shardings = {whole};
  EXPECT_THAT(cache.ExplainMiss("a", g, {}, &out), HasSubstr("output 0: laid out P(None,) here"));
  scheduler::CompileOptions other = options;
  other.mesh.set_axis_sizes(0, 4);
  EXPECT_THAT(cache.ExplainMiss("a", g, {}, &other),
              HasSubstr("mesh {data: 4} here, mesh {data: 2} over devices 0,1 in the cached one"));
}

// Tenants see only their own entries: another tenant's id is not found,
// and a miss is never explained against another tenant's graph.
TEST(CompileCache, EachTenantSeesOnlyItsOwnEntries) {
  CompileCache cache;
  const v1::Graph g = Parse(kAdd);
  cache.Insert("a", CompiledAs(g, "k1"), g);
  EXPECT_EQ(cache.Lookup("b", "k1"), nullptr);
  ASSERT_NE(cache.FindAnyTenant("k1"), nullptr);  // for a caller that checks whose it is
  EXPECT_EQ(cache.FindAnyTenant("k1")->tenant, "a");
  EXPECT_FALSE(cache.EvictedSource("b", "k1").has_value());
  EXPECT_FALSE(cache.WasEvicted("b", "k1"));
  v1::Graph shape = g;
  shape.mutable_nodes(0)->mutable_type()->set_dims(0, 5);
  const std::string why = cache.ExplainMiss("b", shape, {});
  EXPECT_THAT(
      why,
      HasSubstr("no executable of graph 'add' was compiled before (0 executables of this tenant"));
  EXPECT_THAT(why, Not(HasSubstr("f32[4]")));
  EXPECT_EQ(cache.counts("a").compiles, 1);
  EXPECT_EQ(cache.counts("b").compiles, 0);
  EXPECT_EQ(cache.counts("b").size, 0);
}

// A miss is explained against the most recently used executables of its
// name, not every one: a name compiled for many shapes costs a bounded diff.
TEST(CompileCache, ExplainsAMissAgainstTheMostRecentlyUsedOfItsName) {
  CompileCache cache;
  auto of_size = [](int n) {
    v1::Graph g = Parse(kAdd);
    g.mutable_nodes(0)->mutable_type()->set_dims(0, n);
    g.mutable_nodes(1)->mutable_type()->set_dims(0, n);
    return g;
  };
  const int n = int(CompileCache::kMissCandidates) + 4;
  for (int i = 1; i <= n; ++i)
    cache.Insert("a", CompiledAs(of_size(i), absl::StrCat("k", i)), of_size(i));
  // y as f64[2]: the f32[2] executable differs by one parameter's dtype,
  // but it is among the oldest, so another one is nearest of those compared.
  v1::Graph miss = of_size(2);
  miss.mutable_nodes(1)->mutable_type()->set_dtype(v1::F64);
  const std::string before = cache.ExplainMiss("a", miss, {});
  EXPECT_THAT(before, HasSubstr(absl::StrCat("one of ", n, "; the ", CompileCache::kMissCandidates,
                                             " most recently used compared")));
  EXPECT_THAT(before, Not(HasSubstr("f64[2] here, f32[2] in the cached one")));
  ASSERT_NE(cache.Lookup("a", "k2"), nullptr);  // used again: now the most recent
  EXPECT_THAT(cache.ExplainMiss("a", miss, {}),
              HasSubstr("): parameter 1 'y': f64[2] here, f32[2] in the cached one (dtype)"));
}

TEST(CompileCache, EvictsProgramsLeastRecentlyUsedFirstThenSources) {
  const v1::Graph g = Parse(kAdd);
  CompileCache probe;
  probe.Insert("a", CompiledAs(g, "k"), g);
  const int64_t one = probe.bytes();
  ASSERT_GT(one, 0);
  const int64_t source = int64_t(g.ByteSizeLong());
  ASSERT_LT(source, one);
  // Room for two compiled entries and one source, not three compiled.
  CompileCache cache(2 * one + source + source / 2);
  auto held = cache.Insert("a", CompiledAs(g, "k1"), g);
  cache.Insert("a", CompiledAs(g, "k2"), g);
  ASSERT_NE(cache.Lookup("a", "k1"), nullptr);  // k1 is now the most recently used
  cache.Insert("a", CompiledAs(g, "k3"), g);
  EXPECT_EQ(cache.size(), 2);
  EXPECT_EQ(cache.bytes(), 2 * one + source);
  EXPECT_EQ(cache.evictions(), 1);
  EXPECT_EQ(cache.FindAnyTenant("k2"), nullptr);
  ASSERT_TRUE(cache.EvictedSource("a", "k2").has_value());  // compiled again from it when called
  EXPECT_EQ(cache.EvictedSource("a", "k2")->graph.name(), "add");
  EXPECT_FALSE(cache.WasEvicted("a", "k2"));
  // One more: the compiled entries lose their programs, least recently used
  // first (k1, then k3), before any source goes.
  cache.Insert("a", CompiledAs(g, "k4"), g);
  EXPECT_EQ(cache.FindAnyTenant("k1"), nullptr);
  EXPECT_EQ(cache.FindAnyTenant("k3"), nullptr);
  EXPECT_NE(cache.FindAnyTenant("k4"), nullptr);
  for (const char* id : {"k1", "k2", "k3"})
    EXPECT_TRUE(cache.EvictedSource("a", id).has_value()) << id;
  EXPECT_EQ(cache.evictions(), 3);
  // Past its bound with no program left to drop, a tenant's least recently
  // used source goes whole: its id is then only remembered as evicted.
  cache.Insert("b", CompiledAs(g, "b1"), g, {}, one + source / 2);
  cache.Insert("b", CompiledAs(g, "b2"), g, {}, one + source / 2);
  EXPECT_FALSE(cache.EvictedSource("b", "b1").has_value());
  EXPECT_TRUE(cache.WasEvicted("b", "b1"));
  EXPECT_FALSE(cache.WasEvicted("a", "b1"));
  EXPECT_NE(cache.FindAnyTenant("b2"), nullptr);
  // An entry larger than the whole bound still stays while it is the newest.
  CompileCache tiny(1);
  tiny.Insert("a", CompiledAs(g, "a"), g);
  EXPECT_EQ(tiny.size(), 1);
  tiny.Insert("a", CompiledAs(g, "b"), g);
  EXPECT_EQ(tiny.size(), 1);
  EXPECT_NE(tiny.FindAnyTenant("b"), nullptr);
  EXPECT_EQ(held->graph.name(), "add");  // a held entry outlives its eviction
}

// A tenant's compiles evict its own entries past its bound, never another's;
// only the whole cache's bound reaches other tenants.
TEST(CompileCache, ATenantsCompilesEvictOnlyItsOwnEntries) {
  const v1::Graph g = Parse(kAdd);
  CompileCache probe;
  probe.Insert("a", CompiledAs(g, "k"), g);
  const int64_t one = probe.bytes();
  CompileCache cache(int64_t{1} << 30);
  cache.Insert("victim", CompiledAs(g, "v"), g, {}, 2 * one);
  for (int i = 0; i < 40; ++i)
    cache.Insert("flood", CompiledAs(g, absl::StrCat("f", i)), g, {}, 2 * one);
  EXPECT_NE(cache.FindAnyTenant("v"), nullptr);
  EXPECT_EQ(cache.counts("victim").evictions, 0);
  EXPECT_GT(cache.counts("flood").evictions, 30);
  EXPECT_LE(cache.counts("flood").bytes, 2 * one);
  // Over the whole bound, the flooding tenant's own entries go first.
  CompileCache small(3 * one);
  small.Insert("victim", CompiledAs(g, "v"), g);
  small.Insert("flood", CompiledAs(g, "f0"), g);
  small.Insert("flood", CompiledAs(g, "f1"), g);
  small.Insert("flood", CompiledAs(g, "f2"), g);
  EXPECT_NE(small.FindAnyTenant("v"), nullptr);
  EXPECT_EQ(small.FindAnyTenant("f0"), nullptr);
}

// ----------------------------------------------------------- ExecutePlanner

class PlannerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto c = scheduler::Compile(Parse(kAdd), {});
    ASSERT_TRUE(c.ok()) << c.status();
    exe_.compiled = std::move(*c);
    exe_.graph = Parse(kAdd);
    for (int d = 0; d < 3; ++d) {
      routes_.push_back(DeviceRoute{d, d, "w0", "a:1", d != 2, nullptr});
    }
    x_ = Array({0}, 0);
    x_.state = v1::READY;
    y_ = x_;
    req_.set_executable_id(exe_.compiled.fingerprint);
    req_.add_arguments(0x1);
    req_.add_arguments(0x2);
    req_.add_outputs(0x3);
  }
  absl::StatusOr<ExecutePlan> Plan(std::vector<int> placement = {0}) {
    ExecuteInput in;
    in.request = &req_;
    in.executable = &exe_;
    in.placement = std::move(placement);
    in.arguments = {&x_, &y_};
    in.arguments.resize(req_.arguments_size(), &x_);
    in.routes = &routes_;
    in.strict_donation = strict_;
    in.handle_in_use = [this](uint64_t h) { return h == in_use_; };
    in.fresh_handle = [this] { return ++next_handle_; };
    return PlanExecute(in);
  }

  CachedExecutable exe_;
  std::vector<DeviceRoute> routes_;
  ArrayRecord x_, y_;
  v1::ExecuteRequest req_;
  bool strict_ = false;
  uint64_t in_use_ = 0;
  uint64_t next_handle_ = 0x1000;
};

TEST_F(PlannerTest, PlansOneStepPerDevice) {
  auto plan = Plan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->steps.size(), 1u);
  const v1::RunRequest& run = plan->steps[0].run;
  EXPECT_EQ(run.arguments_size(), 2);
  EXPECT_EQ(run.arguments(1), 0x2u);
  EXPECT_EQ(run.outputs(0), 0x3u);
  EXPECT_EQ(plan->outputs.size(), 1u);
  EXPECT_EQ(plan->outputs[0].state, v1::PENDING);
  EXPECT_EQ(plan->outputs[0].pending, 1);
  EXPECT_EQ(plan->output_bytes, 16);
  EXPECT_TRUE(plan->moves.empty());
}

TEST_F(PlannerTest, NamesWhatIsWrongWithTheCall) {
  req_.add_arguments(0x9);
  EXPECT_THAT(
      Plan().status().message(),
      HasSubstr("executable 'add' (" + exe_.compiled.fingerprint + ") takes 2 arguments, got 3"));
  req_.mutable_arguments()->RemoveLast();
  y_.type.set_dtype(v1::S32);
  absl::Status s = Plan().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      s.message(),
      HasSubstr("argument 1 'y' (array 0x2) does not match the signature of executable 'add': "
                "expected f32[4], got s32[4] (dtype differs)"));
  y_ = x_;
  req_.add_donate(5);
  EXPECT_THAT(Plan().status().message(), HasSubstr("donate: argument 5 does not exist"));
  req_.clear_donate();
  req_.set_arguments(1, 0x1);
  req_.add_donate(0);
  EXPECT_THAT(Plan().status().message(),
              HasSubstr("argument 0 'x' donates array 0x1, which is also argument 1"));
  req_.clear_donate();
  req_.set_arguments(1, 0x2);
  req_.set_outputs(0, 0);
  EXPECT_THAT(Plan().status().message(), HasSubstr("output handle 0 is 0"));
  req_.set_outputs(0, 0x7);
  in_use_ = 0x7;
  EXPECT_EQ(Plan().status().code(), absl::StatusCode::kAlreadyExists);
}

TEST_F(PlannerTest, AnArgumentElsewhereIsMovedUnlessDonated) {
  y_.devices = {1};
  auto plan = Plan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->moves.size(), 1u);
  const PlannedMove& m = plan->moves[0];
  EXPECT_EQ(m.argument, 1);
  EXPECT_EQ(m.from_device, 1);
  EXPECT_EQ(m.to_device, 0);
  EXPECT_EQ(m.temp_handle, 0x1001u);
  EXPECT_EQ(plan->steps[0].run.arguments(1), 0x1001u);  // the step reads the copy
  ASSERT_TRUE(plan->steps[0].free_after.has_value());
  EXPECT_EQ(plan->steps[0].free_after->buffers(0), 0x1001u);
  EXPECT_THAT(m.what, HasSubstr("argument 1 'y' (array 0x2, f32[4]) from device 1 to device 0"));
  // Only a dead device holds it.
  y_.devices = {2};
  EXPECT_EQ(Plan().status().code(), absl::StatusCode::kUnavailable);
  y_.devices = {1};
  req_.add_donate(1);
  EXPECT_THAT(
      Plan().status().message(),
      HasSubstr("argument 1 'y' (array 0x2) is donated but lives on device 1, not on device 0"));
}

TEST_F(PlannerTest, UpstreamErrorsAndLostArguments) {
  y_.state = v1::ERROR;
  y_.error = absl::InternalError("boom");
  auto plan = Plan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->outputs[0].state, v1::ERROR);
  EXPECT_THAT(plan->outputs[0].error.message(),
              HasSubstr("argument 1 'y' (array 0x2) failed earlier; dependent step 1 to fail from "
                        "this cause: boom"));
  EXPECT_EQ(plan->steps.size(), 1u);  // it still runs, to consume donated buffers
  y_.state = v1::LOST;
  y_.error = absl::UnavailableError("array 0x2 was on worker w0");
  absl::Status s = Plan().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("argument 1 'y': array 0x2 was on worker w0"));
}

TEST_F(PlannerTest, DonationAliasesAndStrictDonation) {
  req_.add_donate(0);
  auto plan = Plan();
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->donated, std::vector<int>{0});
  EXPECT_EQ(plan->donated_bytes, 16);
  ASSERT_EQ(plan->aliases.size(), 1u);
  EXPECT_EQ(plan->aliases[0].output, 0);
  ASSERT_EQ(plan->steps[0].run.aliases_size(), 1);
  EXPECT_EQ(plan->steps[0].run.donated(0), 0);
  // Both donated: one output to take a buffer, so strict donation refuses.
  req_.add_donate(1);
  strict_ = true;
  absl::Status s = Plan().status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(),
              HasSubstr("strict donation: argument 1 'y' (array 0x2) cannot give its buffer"));
}

TEST_F(PlannerTest, AReplicatedStepRunsEverywhereTheArgumentsAre) {
  x_.devices = y_.devices = {0, 1};
  auto plan = Plan({0, 1});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->steps.size(), 2u);
  EXPECT_EQ(plan->steps[1].device, 1);
  EXPECT_EQ(plan->steps[1].run.mesh_position(), 1);
  EXPECT_EQ(plan->outputs[0].pending, 2);
  EXPECT_EQ(plan->output_bytes, 32);
}

// --------------------------------------------------- the façade, over fakes

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Coordinator::Options o;
    o.logger = NullLogger();
    o.heartbeat_interval = absl::Milliseconds(20);
    o.heartbeat_timeout = absl::Seconds(600);
    o.connect = [this](const std::string& address, const std::string&) {
      auto f = std::make_shared<FakeWorkerClient>(address);
      absl::MutexLock l(&mu_);
      fakes_.push_back(f);
      return f;
    };
    options_ = o;
  }
  void Start(int workers, int devices_each) {
    auto c = Coordinator::Create(options_);
    ASSERT_TRUE(c.ok()) << c.status();
    c_ = std::move(*c);
    for (int w = 0; w < workers; ++w) {
      auto r = c_->RegisterWorker(
          Registration("10.0.0." + std::to_string(w + 1) + ":7000", devices_each));
      ASSERT_TRUE(r.ok()) << r.status();
      worker_ids_.push_back(r->worker_id());
    }
    v1::OpenSessionRequest open;
    open.set_client("test");
    session_ = c_->OpenSession(open)->session_id();
  }
  FakeWorkerClient& fake(int i) {
    absl::MutexLock l(&mu_);
    return *fakes_.at(i);
  }
  std::string CompileIota(bool sharded) {
    v1::CompileRequest req;
    req.set_session_id(session_);
    *req.mutable_graph() = Parse(kIota);
    if (sharded) {
      v1::Mesh* m = req.mutable_mesh();
      m->add_axis_names("d");
      m->add_axis_sizes(2);
      m->add_devices(0);
      m->add_devices(1);
      v1::Sharding* out = req.add_output_shardings();
      out->add_dims()->add_axes("d");
    }
    auto r = c_->Compile(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->executable_id() : "";
  }
  absl::StatusOr<v1::ExecuteResponse> Execute(const std::string& exe, uint64_t out,
                                              int device = 0) {
    v1::ExecuteRequest req;
    req.set_session_id(session_);
    req.set_executable_id(exe);
    req.add_outputs(out);
    req.mutable_placement()->set_device(device);
    return c_->Execute(req);
  }
  v1::ArrayState State(uint64_t h) {
    v1::ArrayInfoRequest req;
    req.set_session_id(session_);
    req.set_handle(h);
    auto r = c_->ArrayInfo(req);
    return r.ok() ? r->state() : v1::DELETED;
  }

  Coordinator::Options options_;
  std::unique_ptr<Coordinator> c_;
  std::vector<std::string> worker_ids_;
  std::string session_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<FakeWorkerClient>> fakes_ ABSL_GUARDED_BY(mu_);
};

TEST_F(CoordinatorTest, AStepIsPendingUntilItsWorkerAnswers) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  auto r = Execute(exe, 0x10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(fake(0).loads(), 1u);
  auto runs = fake(0).runs();
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].seq(), 0u);
  EXPECT_EQ(runs[0].execution_id(), r->execution_id());
  EXPECT_EQ(State(0x10), v1::PENDING);
  fake(0).CompleteRun(0, v1::RunResponse());
  EXPECT_EQ(State(0x10), v1::READY);
  // The second step is numbered after the first and loads nothing.
  ASSERT_TRUE(Execute(exe, 0x11).ok());
  EXPECT_EQ(fake(0).loads(), 1u);
  EXPECT_EQ(fake(0).runs().at(1).seq(), 1u);
}

v1::StoredBuffer Held(int device, uint64_t handle, int64_t bytes) {
  v1::StoredBuffer b;
  b.set_device(device);
  b.set_handle(handle);
  b.set_bytes(bytes);
  return b;
}

// A buffer no array owns is reported, and freed (through the device's
// queue) only when the next reconciliation finds it unowned again.
TEST_F(CoordinatorTest, ReconciliationFreesABufferUnownedTwiceInARow) {
  options_.reconcile_interval = absl::ZeroDuration();
  Start(1, 2);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10, /*device=*/1).ok());
  fake(0).CompleteRun(0, v1::RunResponse());
  fake(0).set_held({Held(1, 0x10, 16), Held(0, 0x99, 4096)});
  v1::ReconcileResponse first = c_->Reconcile();
  EXPECT_EQ(first.buffers_checked(), 2);
  ASSERT_EQ(first.unowned_size(), 1);
  EXPECT_EQ(first.unowned(0).device(), 0);
  EXPECT_EQ(first.unowned(0).handle(), 0x99u);
  EXPECT_EQ(first.unowned(0).bytes(), 4096);
  EXPECT_EQ(first.freed(), 0);
  for (const auto& m : fake(0).messages()) EXPECT_TRUE(m.run);  // nothing freed yet
  v1::ReconcileResponse second = c_->Reconcile();
  EXPECT_EQ(second.freed(), 1);
  std::vector<v1::FreeRequest> frees;
  for (const auto& m : fake(0).messages()) {
    if (!m.run) frees.push_back(m.free_request);
  }
  ASSERT_EQ(frees.size(), 1u);
  EXPECT_EQ(frees[0].device(), 0);
  ASSERT_EQ(frees[0].buffers_size(), 1);
  EXPECT_EQ(frees[0].buffers(0), 0x99u);
  EXPECT_EQ(c_->GetCluster(v1::GetClusterRequest()).unowned_buffers_freed(), 1);
  // The live array's buffer was never in question; gone, nothing is unowned.
  fake(0).set_held({Held(1, 0x10, 16)});
  EXPECT_EQ(c_->Reconcile().unowned_size(), 0);
}

// Executables belong to a tenant: another tenant's session cannot run one,
// and is told what it would be told of an id never compiled.
TEST_F(CoordinatorTest, AnotherTenantsExecutableIsNotFoundAsIfNeverCompiled) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  v1::OpenSessionRequest open;
  open.set_client("other");
  const std::string other = c_->OpenSession(open, "mallory")->session_id();
  v1::ExecuteRequest req;
  req.set_session_id(other);
  req.set_executable_id(exe);
  req.add_outputs(0x20);
  req.mutable_placement()->set_device(0);
  auto theirs = c_->Execute(req);
  req.set_executable_id("0123456789abcdef0123456789abcdef");
  auto never = c_->Execute(req);
  ASSERT_EQ(theirs.status().code(), absl::StatusCode::kNotFound);
  ASSERT_EQ(never.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(
      absl::StrReplaceAll(theirs.status().message(), {{exe, "ID"}}),
      absl::StrReplaceAll(never.status().message(), {{"0123456789abcdef0123456789abcdef", "ID"}}));
  EXPECT_TRUE(fake(0).runs().empty());
  // The same graph compiled by the other tenant is its own executable.
  v1::CompileRequest compile;
  compile.set_session_id(other);
  *compile.mutable_graph() = Parse(kIota);
  auto mine = c_->Compile(compile);
  ASSERT_TRUE(mine.ok()) << mine.status();
  EXPECT_FALSE(mine->cache_hit());
  EXPECT_NE(mine->executable_id(), exe);
}

// An executable evicted past its tenant's bound is compiled again from its
// source when called: counted as the session's compile, refused under
// forbid_compiles.
TEST_F(CoordinatorTest, AnEvictedExecutableIsCompiledAgainWhenCalled) {
  CompileCache probe;
  {
    auto c = scheduler::Compile(Parse(kIota), {.owner = "default"});
    ASSERT_TRUE(c.ok()) << c.status();
    probe.Insert("default", *c, Parse(kIota));
  }
  options_.tenants =
      Tenants(TenantLimits{0, 0, probe.bytes() * 3 / 2});  // room for one compiled entry
  Start(1, 1);
  auto compile = [&](int n) {
    v1::CompileRequest req;
    req.set_session_id(session_);
    v1::Graph g = Parse(kIota);
    for (int i = 0; i < 2; ++i) g.mutable_nodes(i)->mutable_type()->set_dims(0, n);
    *req.mutable_graph() = g;
    auto r = c_->Compile(req);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->executable_id() : "";
  };
  auto compiles = [&] {
    v1::StatsRequest req;
    req.set_session_id(session_);
    return c_->Stats(req)->session_compiles();
  };
  const std::string first = compile(8);
  compile(16);  // evicts the first's program
  EXPECT_EQ(compiles(), 2);
  auto r = Execute(first, 0x10);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(compiles(), 3);
  fake(0).CompleteRun(0, v1::RunResponse());
  EXPECT_EQ(State(0x10), v1::READY);
  compile(32);  // and again
  v1::SetSessionOptionsRequest forbid;
  forbid.set_session_id(session_);
  forbid.mutable_options()->set_forbid_compiles(true);
  ASSERT_TRUE(c_->SetSessionOptions(forbid).ok());
  auto refused = Execute(first, 0x11);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("forbids new compiles"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("of graph 'iota' was evicted from the compile cache"));
  EXPECT_EQ(compiles(), 4);
}

TEST_F(CoordinatorTest, AFailedStepFailsItsOutputsNamingTheGlobalDevice) {
  Start(2, 1);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10, /*device=*/1).ok());
  EXPECT_EQ(fake(1).runs().at(0).device(), 0);  // worker-local
  fake(1).CompleteRun(0, absl::ResourceExhaustedError("out of memory"));
  v1::AwaitRequest await;
  await.set_session_id(session_);
  await.add_handles(0x10);
  auto done = c_->Await(await);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->states(0), v1::ERROR);
  EXPECT_THAT(done->errors(0), HasSubstr("on device 1: out of memory"));
}

TEST_F(CoordinatorTest, AFailedLoadFailsTheStepWithTheLoadsErrorAndIsTriedAgain) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  fake(0).set_load_error(absl::UnimplementedError("loading on cuda:0: op FOO is not supported"));
  ASSERT_TRUE(Execute(exe, 0x10).ok());
  ASSERT_EQ(fake(0).runs().size(), 1u);  // the sequence number is consumed all the same
  fake(0).CompleteRun(0, absl::FailedPreconditionError("program is not loaded"));
  v1::AwaitRequest await;
  await.set_session_id(session_);
  await.add_handles(0x10);
  auto done = c_->Await(await);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->states(0), v1::ERROR);
  EXPECT_EQ(done->codes(0), int(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(done->errors(0),
              HasSubstr("on device 0: loading on cuda:0: op FOO is not supported"));
  // The next step loads again, and runs once the load succeeds.
  fake(0).set_load_error(absl::OkStatus());
  ASSERT_TRUE(Execute(exe, 0x11).ok());
  EXPECT_EQ(fake(0).loads(), 2u);
  fake(0).CompleteRun(1, v1::RunResponse());
  EXPECT_EQ(State(0x11), v1::READY);
}

TEST_F(CoordinatorTest, ABrokenGroupMovesLaterStepsToANewEpoch) {
  Start(1, 2);
  const std::string exe = CompileIota(true);
  ASSERT_TRUE(Execute(exe, 0x10).ok());
  ASSERT_TRUE(Execute(exe, 0x11).ok());
  auto runs = fake(0).runs();
  ASSERT_EQ(runs.size(), 4u);
  const std::string epoch0 = runs[0].collective_epoch();
  EXPECT_FALSE(epoch0.empty());
  EXPECT_EQ(runs[2].collective_epoch(), epoch0);
  absl::Status broken = absl::UnavailableError("peer lost");
  broken.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
  fake(0).CompleteRun(0, broken);
  fake(0).CompleteRun(2, broken);  // a second report of the same epoch bumps nothing
  ASSERT_TRUE(Execute(exe, 0x12).ok());
  runs = fake(0).runs();
  ASSERT_EQ(runs.size(), 6u);
  EXPECT_NE(runs[4].collective_epoch(), epoch0);
  EXPECT_EQ(runs[4].collective_epoch(), runs[5].collective_epoch());
  EXPECT_EQ(runs[4].collective_epoch().substr(0, 17),
            epoch0.substr(0, 17));  // same coordinator incarnation
  EXPECT_TRUE(absl::EndsWith(runs[4].collective_epoch(), ".1")) << runs[4].collective_epoch();
  // A partitioned step's devices get their numbers together.
  EXPECT_EQ(runs[4].seq(), runs[5].seq());
  EXPECT_EQ(runs[4].execution_id(), runs[5].execution_id());
}

TEST_F(CoordinatorTest, AFreeIsNumberedAfterTheStepThatMakesItsArray) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10).ok());
  v1::DeleteRequest del;
  del.set_session_id(session_);
  del.add_handles(0x10);
  ASSERT_TRUE(c_->Delete(del).ok());
  auto msgs = fake(0).messages();
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_TRUE(msgs[0].run);
  EXPECT_FALSE(msgs[1].run);
  EXPECT_EQ(msgs[1].free_request.buffers(0), 0x10u);
  EXPECT_GT(msgs[1].seq(), msgs[0].seq());
  EXPECT_EQ(msgs[1].queue_epoch(), msgs[0].queue_epoch());
  // The step's late answer finds its output gone and changes nothing.
  fake(0).CompleteRun(0, v1::RunResponse());
  v1::ArrayInfoRequest info;
  info.set_session_id(session_);
  info.set_handle(0x10);
  auto r = c_->ArrayInfo(info);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->state(), v1::DELETED);
}

TEST_F(CoordinatorTest, ACallsReleaseDeletesTheSessionsOwnArraysBeforeItsStep) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10).ok());
  // Another session's array, in the same tenant: a release naming it is
  // passed over, as are a handle nobody has and one already deleted.
  v1::OpenSessionRequest open;
  open.set_client("other");
  const std::string other = c_->OpenSession(open)->session_id();
  v1::ExecuteRequest theirs;
  theirs.set_session_id(other);
  theirs.set_executable_id(exe);
  theirs.add_outputs(0x20);
  ASSERT_TRUE(c_->Execute(theirs).ok());
  v1::ExecuteRequest req;
  req.set_session_id(session_);
  req.set_executable_id(exe);
  req.add_outputs(0x11);
  for (uint64_t h : {uint64_t{0x10}, uint64_t{0x20}, uint64_t{0x99}, uint64_t{0x10}})
    req.add_release(h);
  ASSERT_TRUE(c_->Execute(req).ok());
  EXPECT_EQ(State(0x10), v1::DELETED);
  EXPECT_NE(State(0x11), v1::DELETED);
  v1::ArrayInfoRequest info;
  info.set_session_id(other);
  info.set_handle(0x20);
  auto kept = c_->ArrayInfo(info);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_NE(kept->state(), v1::DELETED);
  // On the device: the first run, the other session's, then 0x10's free
  // (once), then the releasing call's own step.
  auto msgs = fake(0).messages();
  ASSERT_EQ(msgs.size(), 4u);
  EXPECT_TRUE(msgs[0].run && msgs[1].run);
  EXPECT_FALSE(msgs[2].run);
  ASSERT_EQ(msgs[2].free_request.buffers_size(), 1);
  EXPECT_EQ(msgs[2].free_request.buffers(0), 0x10u);
  EXPECT_TRUE(msgs[3].run);
  EXPECT_LT(msgs[2].seq(), msgs[3].seq());
}

TEST_F(CoordinatorTest, NoWorkerCallIsMadeUnderALock) {
  Start(1, 2);
  // Every Run, Free and load asks the coordinator for its stats and cluster
  // view (which take every lock) from another thread; one made under a
  // lock would wait, and is counted.
  fake(0).set_on_call([this] {
    v1::StatsRequest s;
    s.set_session_id(session_);
    (void)c_->Stats(s);
    (void)c_->GetCluster(v1::GetClusterRequest());
  });
  const std::string plain = CompileIota(false);
  const std::string sharded = CompileIota(true);
  ASSERT_TRUE(Execute(plain, 0x10).ok());
  ASSERT_TRUE(Execute(sharded, 0x11).ok());
  v1::DeleteRequest del;
  del.set_session_id(session_);
  del.add_handles(0x10);
  del.add_handles(0x11);
  ASSERT_TRUE(c_->Delete(del).ok());
  v1::CloseSessionRequest close;
  close.set_session_id(session_);
  ASSERT_TRUE(c_->CloseSession(close).ok());
  EXPECT_EQ(fake(0).calls_under_lock(), 0);
  EXPECT_EQ(fake(0).messages().size(), 5u);  // 3 runs; one free on each of the 2 devices
}

TEST_F(CoordinatorTest, LostStepsRestartTheQueuesAndTheMonitorOpensThem) {
  Start(1, 1);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10).ok());
  const uint64_t old_epoch = fake(0).runs().at(0).queue_epoch();
  fake(0).LoseSteps();
  // The monitor sends one empty free that opens the new epoch at 0.
  for (int i = 0; i < 500 && fake(0).messages().size() < 2; ++i)
    absl::SleepFor(absl::Milliseconds(10));
  auto msgs = fake(0).messages();
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_FALSE(msgs[1].run);
  EXPECT_EQ(msgs[1].seq(), 0u);
  EXPECT_NE(msgs[1].queue_epoch(), old_epoch);
  EXPECT_EQ(msgs[1].free_request.buffers_size(), 0);
  ASSERT_TRUE(Execute(exe, 0x11).ok());
  const v1::RunRequest next = fake(0).runs().at(1);
  EXPECT_EQ(next.seq(), 1u);
  EXPECT_EQ(next.queue_epoch(), msgs[1].queue_epoch());
}

TEST_F(CoordinatorTest, ASilentWorkerIsDeclaredDeadAndItsArraysLost) {
  options_.heartbeat_timeout = absl::Milliseconds(100);
  Start(2, 1);
  const std::string exe = CompileIota(false);
  ASSERT_TRUE(Execute(exe, 0x10, 0).ok());
  // Worker 1 keeps heartbeating; worker 0 falls silent.
  for (int i = 0; i < 100 && !fake(0).cancelled(); ++i) {
    ASSERT_TRUE(c_->Heartbeat(worker_ids_[1], "secret-of-10.0.0.2:7000-0123456789").ok());
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(fake(0).cancelled());
  EXPECT_FALSE(fake(1).cancelled());
  // Its step in flight was failed by the cancel; the array is lost or failed.
  const v1::ArrayState s = State(0x10);
  EXPECT_TRUE(s == v1::LOST || s == v1::ERROR) << v1::ArrayState_Name(s);
  auto r = Execute(exe, 0x11, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(r.status().message(),
              HasSubstr("device 0 is on worker " + worker_ids_[0] + " (10.0.0.1:7000)"));
  EXPECT_TRUE(Execute(exe, 0x12, 1).ok());
}

}  // namespace
// The operator's tokens file, replaced while the coordinator runs: the next
// call is checked against it, and a tenant's new limits bind at once.
TEST_F(CoordinatorTest, ReplacedTenantsAnswerTheNextCallAndTheirLimitsBindAtOnce) {
  auto first = Tenants::Parse("a-token a max_sessions=1\n", "tokens", {});
  ASSERT_TRUE(first.ok()) << first.status();
  options_.tenants = *first;
  Start(1, 1);
  v1::OpenSessionRequest open;
  open.set_client("test");
  ASSERT_TRUE(c_->OpenSession(open, "a").ok());
  EXPECT_EQ(c_->OpenSession(open, "a").status().code(), absl::StatusCode::kResourceExhausted);
  c_->ReplaceTenants(*Tenants::Parse("a-token a max_sessions=2\nb-token b\n", "tokens", {}));
  EXPECT_TRUE(c_->OpenSession(open, "a").ok());
  EXPECT_EQ(c_->OpenSession(open, "a").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(c_->tenants()->Authenticate("b-token")->tenant, "b");
  c_->ReplaceTenants(*Tenants::Parse("b-token b\n", "tokens", {}));
  EXPECT_EQ(c_->tenants()->Authenticate("a-token").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE(c_->tenants()->Authenticate("b-token").ok());
}

TEST(TokensFileWatcher, AppliesAChangedFileAndKeepsThePreviousOneWhenTheNewOneIsBad) {
  const std::string path = ::testing::TempDir() + "/tokens-watch";
  auto write = [&path](const std::string& text) {
    const std::string tmp = path + ".tmp";
    std::ofstream(tmp) << text;
    std::rename(tmp.c_str(), path.c_str());  // a new inode, as a Secret's update
  };
  write("a-token a\n");
  absl::Mutex mu;
  std::vector<std::string> applied, errors;
  TokensFileWatcher w(
      path, {}, absl::Milliseconds(10),
      [&](Tenants t) {
        absl::MutexLock l(&mu);
        applied.push_back(t.Authenticate("b-token").ok() ? "b" : "?");
      },
      [&](const absl::Status& s) {
        absl::MutexLock l(&mu);
        errors.push_back(std::string(s.message()));
      });
  absl::SleepFor(absl::Milliseconds(50));
  {
    absl::MutexLock l(&mu);
    EXPECT_TRUE(applied.empty());  // unchanged since start-up
  }
  write("b-token b\n");
  auto until = [&](auto done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    absl::MutexLock l(&mu);
    while (!done() && absl::Now() < deadline) {
      mu.Unlock();
      absl::SleepFor(absl::Milliseconds(5));
      mu.Lock();
    }
  };
  until([&] { return !applied.empty(); });
  {
    absl::MutexLock l(&mu);
    EXPECT_EQ(applied, std::vector<std::string>{"b"});
  }
  write("b-token b memory_quota=lots\n");
  until([&] { return !errors.empty(); });
  absl::MutexLock l(&mu);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_THAT(errors[0], HasSubstr("tokens-watch"));
  EXPECT_THAT(errors[0], HasSubstr("memory_quota"));
  EXPECT_EQ(applied.size(), 1u);
}

TEST(Version, ABareRequestAsksWhatTheServerSpeaksAndDisjointRangesAreNamed) {
  EXPECT_EQ(*NegotiateVersion(0, 0), kProtocolVersionMax);
  EXPECT_EQ(*NegotiateVersion(kProtocolVersionMin, kProtocolVersionMax + 5), kProtocolVersionMax);
  auto too_new = NegotiateVersion(kProtocolVersionMax + 1, kProtocolVersionMax + 2);
  ASSERT_FALSE(too_new.ok());
  EXPECT_EQ(too_new.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(too_new.status().message().find("server speaks ["), std::string::npos)
      << too_new.status();
}

}  // namespace tessel::server

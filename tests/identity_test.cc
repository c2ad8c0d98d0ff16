// Results you can trust, on real daemons: a step that fails on one device
// never lets the next steps' collectives pair with the wrong peers. One
// worker with two devices (they meet in memory) and two workers with one
// device each (they meet over Gloo); a program with one all_reduce over
// {d: 2}; step B runs out of memory on device 0 before its collective while
// device 1 waits in it; steps C..F follow pipelined, as a training loop
// issues them. Every step ends with the right value or an error naming its
// cause, never a wrong value marked ready.
#include <gtest/gtest.h>

#include <csignal>
#include <vector>

#include "absl/time/clock.h"

#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"

namespace tessel {
namespace {

constexpr int64_t kCols = 16384;           // a 64 KiB block per device
constexpr int64_t kDeviceBytes = 1 << 20;  // each device's memory limit
constexpr int kSteps = 6;                  // A..F
// With the inputs of every step and A's output in place, leaves one block
// free, where a step needs two (its product and its all_reduce's result):
// 512 KiB, a size the allocator does not round up.
constexpr int64_t kFillerFloats = (kDeviceBytes - (kSteps + 2) * kCols * 4) / 4;

struct Cluster {
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Session> session;
};

Cluster Start(int workers, int devices_per_worker, int collective_timeout_s = 20,
              int heartbeat_timeout_ms = 2000) {
  LocalCluster::Options o;
  o.workers = workers;
  o.devices_per_worker = devices_per_worker;
  o.heartbeat_timeout_ms = heartbeat_timeout_ms;
  o.worker_flags = {"--device_memory_bytes=" + std::to_string(kDeviceBytes),
                    "--collective_timeout_s=" + std::to_string(collective_timeout_s)};
  auto c = LocalCluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return {};
  auto s = Session::Connect((*c)->address());
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return {};
  return {std::move(*c), std::move(*s)};
}

HostArray Block(float device0, float device1) {
  HostArray a(ArrayType{DType::kF32, {2, kCols}});
  auto v = a.as_mutable<float>();
  for (int64_t j = 0; j < kCols; ++j) {
    v[j] = device0 + j % 7;
    v[kCols + j] = device1 - j % 7;
  }
  return a;
}

void ExpectFailedStepNeverPoisonsTheNextOnes(int workers, int devices_per_worker) {
  Cluster c = Start(workers, devices_per_worker);
  ASSERT_NE(c.session, nullptr);
  Session& session = *c.session;
  const Mesh mesh({{"d", 2}});
  const Sharding rows = Sharding::Split({"d", ""});
  GraphBuilder g("twice_psum");
  Value x = g.Parameter({DType::kF32, {2, kCols}}, "x");
  Value r =
      g.ManualRegion(mesh, {x}, {rows}, rows, [](GraphBuilder& b, const std::vector<Value>& in) {
        Value twice = b.Mul(in[0], b.Broadcast(b.Scalar(DType::kF32, 2), {1, kCols}));
        return b.AllReduce(twice, {"d"});
      });
  auto graph = g.Build({r});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session.Compile(
      *graph, {.mesh = mesh, .parameter_shardings = {rows}, .output_shardings = {rows}});
  ASSERT_TRUE(exe.ok()) << exe.status();

  std::vector<Array> inputs;
  for (int k = 0; k < kSteps; ++k) {
    auto a = session.Put(Block(k + 1, 10 * (k + 1)), Placement::Sharded(mesh, rows));
    ASSERT_TRUE(a.ok()) << a.status();
    inputs.push_back(*a);
  }
  std::vector<Array> outs(kSteps);
  auto run = [&](int k) {
    auto o = session.Execute(*exe, {inputs[k]});
    ASSERT_TRUE(o.ok()) << o.status();
    outs[k] = (*o)[0];
  };
  run(0);
  ASSERT_TRUE(session.Await({outs[0]}).ok());
  // Device 0 is nearly full from here until step B has run there.
  HostArray filler(ArrayType{DType::kF32, {kFillerFloats}});
  auto fill = session.Put(filler, Placement::Device(0));
  ASSERT_TRUE(fill.ok()) << fill.status();
  run(1);
  ASSERT_TRUE(session.Delete({*fill}).ok());
  for (int k = 2; k < kSteps; ++k) run(k);

  for (int k = 0; k < kSteps; ++k) {
    auto got = session.Fetch(outs[k]);
    if (k == 1) {
      ASSERT_FALSE(got.ok()) << "step B ran out of memory on device 0, yet its result came back";
      const std::string m(got.status().message());
      EXPECT_TRUE(got.status().code() == absl::StatusCode::kResourceExhausted ||
                  got.status().code() == absl::StatusCode::kAborted)
          << got.status();
      EXPECT_NE(m.find("device 0"), std::string::npos) << got.status();
      continue;
    }
    ASSERT_TRUE(got.ok()) << "step " << char('A' + k) << ": " << got.status();
    const auto v = got->as<float>();
    for (int64_t j = 0; j < kCols; j += 997) {
      // Both rows hold 2 * (row 0 + row 1) of this step's input.
      const float want = 2 * ((k + 1 + j % 7) + (10 * (k + 1) - j % 7));
      ASSERT_EQ(v[j], want) << "step " << char('A' + k) << " column " << j;
      ASSERT_EQ(v[kCols + j], want) << "step " << char('A' + k) << " column " << j;
    }
  }
  // The group goes on serving: one more step, awaited on its own.
  run(0);
  auto again = session.Fetch(outs[0]);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->as<float>()[0], 2 * (1 + 10));
}

// A worker paused past the collective timeout: its peer's all_reduce fails
// naming the device that stalled, and once it resumes the group recovers
// (a new epoch), where it used to stay broken for the life of the process.
TEST(Identity, ACollectiveTimeoutNamesTheStalledDeviceAndTheGroupRecovers) {
  Cluster c = Start(2, 1, /*collective_timeout_s=*/1, /*heartbeat_timeout_ms=*/30000);
  ASSERT_NE(c.session, nullptr);
  Session& session = *c.session;
  const Mesh mesh({{"d", 2}});
  const Sharding rows = Sharding::Split({"d", ""});
  GraphBuilder g("psum");
  Value x = g.Parameter({DType::kF32, {2, 4}}, "x");
  Value r = g.ManualRegion(
      mesh, {x}, {rows}, rows,
      [](GraphBuilder& b, const std::vector<Value>& in) { return b.AllReduce(in[0], {"d"}); });
  auto graph = g.Build({r});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session.Compile(
      *graph, {.mesh = mesh, .parameter_shardings = {rows}, .output_shardings = {rows}});
  ASSERT_TRUE(exe.ok()) << exe.status();
  HostArray hx(ArrayType{DType::kF32, {2, 4}});
  for (int i = 0; i < 8; ++i) hx.as_mutable<float>()[i] = i;
  auto a = session.Put(hx, Placement::Sharded(mesh, rows));
  ASSERT_TRUE(a.ok()) << a.status();
  auto step = [&]() -> absl::StatusOr<HostArray> {
    auto o = session.Execute(*exe, {*a});
    if (!o.ok()) return o.status();
    return session.Fetch((*o)[0]);
  };
  ASSERT_TRUE(step().ok());
  ASSERT_TRUE(c.cluster->SignalWorker(1, SIGSTOP).ok());
  auto stalled = step();
  ASSERT_TRUE(c.cluster->SignalWorker(1, SIGCONT).ok());
  ASSERT_FALSE(stalled.ok());
  EXPECT_EQ(stalled.status().code(), absl::StatusCode::kDeadlineExceeded) << stalled.status();
  EXPECT_NE(stalled.status().message().find("(device 1)"), std::string::npos) << stalled.status();
  for (int k = 0; k < 3; ++k) {
    auto got = step();
    ASSERT_TRUE(got.ok()) << "step " << k << " after the peer resumed: " << got.status();
    EXPECT_EQ(got->as<float>()[1], 1 + 5);
  }
}

// A worker paused past the heartbeat timeout is marked dead; when it comes
// back it registers again and its devices take new ids. Steps on them run
// from a fresh numbering, where every one used to be refused.
TEST(Identity, AWorkerThatRegistersAgainRunsStepsFromAFreshQueue) {
  Cluster c = Start(1, 1, 20, /*heartbeat_timeout_ms=*/1000);
  ASSERT_NE(c.session, nullptr);
  Session& session = *c.session;
  GraphBuilder g("inc");
  Value x = g.Parameter({DType::kF32, {4}}, "x");
  auto graph = g.Build({g.Add(x, g.Broadcast(g.Scalar(DType::kF32, 1), {4}))});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session.Compile(*graph);
  ASSERT_TRUE(exe.ok()) << exe.status();
  HostArray hx(ArrayType{DType::kF32, {4}});
  auto run_on = [&](int device, int steps) -> absl::Status {
    auto a = session.Put(hx, Placement::Device(device));
    if (!a.ok()) return a.status();
    Array cur = *a;
    for (int i = 0; i < steps; ++i) {
      auto o = session.Execute(*exe, {cur}, {.placement = Placement::Device(device)});
      if (!o.ok()) return o.status();
      cur = (*o)[0];
    }
    auto got = session.Fetch(cur);
    if (!got.ok()) return got.status();
    if (got->as<float>()[0] != steps) return absl::InternalError("wrong value");
    return absl::OkStatus();
  };
  ASSERT_TRUE(run_on(0, 5).ok());
  ASSERT_TRUE(c.cluster->SignalWorker(0, SIGSTOP).ok());
  absl::SleepFor(
      absl::Seconds(2.5));  // the process is stopped: only wall time makes it miss heartbeats
  ASSERT_TRUE(c.cluster->SignalWorker(0, SIGCONT).ok());
  int device = -1;
  for (int i = 0; i < 100 && device < 0; ++i) {
    auto cs = session.Cluster();
    ASSERT_TRUE(cs.ok()) << cs.status();
    for (const WorkerStatus& w : cs->workers) {
      if (w.alive && !w.devices.empty() && w.devices[0] != 0) device = w.devices[0];
    }
    if (device < 0) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_GE(device, 0) << "the worker never registered again";
  absl::Status s = run_on(device, 5);
  EXPECT_TRUE(s.ok()) << s;
}

TEST(Identity, FailedStepNeverPoisonsTheNextOnesWithinAWorker) {
  ExpectFailedStepNeverPoisonsTheNextOnes(1, 2);
}

TEST(Identity, FailedStepNeverPoisonsTheNextOnesAcrossWorkers) {
  ExpectFailedStepNeverPoisonsTheNextOnes(2, 1);
}

}  // namespace
}  // namespace tessel

// Array lifetimes on a real cluster: pipelined dispatch, donation with
// receipts, the transfer guard, the recompilation guard and memory
// accounting — and the host-side loop of seed 000, with and without the
// mistakes it must catch.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "absl/strings/str_format.h"

#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tests/cluster_fixture.h"

namespace tessel {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kN = 1024;

// f1(state, count) = (state * 0.5 + 1, count); f2(state, count) = (tanh(state) + 1, count + 1).
Graph StepGraph(const std::string& name, bool second) {
  GraphBuilder g(name);
  Value s = g.Parameter({DType::kF32, {kN}}, "state");
  Value c = g.Parameter({DType::kS32, {}}, "count");
  Value one = g.Broadcast(g.Scalar(DType::kF32, 1.0), {kN});
  if (!second)
    return *g.Build({g.Add(g.Mul(s, g.Broadcast(g.Scalar(DType::kF32, 0.5), {kN})), one), c});
  return *g.Build({g.Add(g.Tanh(s), one), g.Add(c, g.Scalar(DType::kS32, 1))});
}

class LifetimeTest : public ClusterFixture<2, 1> {
 protected:
  std::vector<float> Initial() {
    std::vector<float> v(kN);
    for (int64_t i = 0; i < kN; ++i) v[i] = std::sin(0.01f * i) * 3;
    return v;
  }
};

// The seed loop: 1,000 pairs of steps, state donated every step, every
// transfer direction disallowed, compiles forbidden after the first two.
TEST_F(LifetimeTest, SeedLoopMovesNothingRecompilesNothingAndKeepsMemoryFlat) {
  auto f1 = session_->Compile(StepGraph("f1", false), {.donate = {0, 1}, .strict_donation = true});
  auto f2 = session_->Compile(StepGraph("f2", true), {.donate = {0, 1}, .strict_donation = true});
  ASSERT_TRUE(f1.ok()) << f1.status();
  ASSERT_TRUE(f2.ok()) << f2.status();
  EXPECT_THAT(f1->plan(), HasSubstr("donate %state -> output 0"));
  std::vector<float> init = Initial();
  auto s0 = session_->Put(HostArray::From<float>({kN}, init), Placement::Replicated());
  auto c0 = session_->Put(HostArray::From<int32_t>({}, {0}), Placement::Replicated());
  ASSERT_TRUE(s0.ok() && c0.ok());
  ASSERT_TRUE(session_->Await({*s0, *c0}).ok());
  SessionOptions guarded;
  guarded.transfer_guard = TransferGuard::All(TransferLevel::kDisallow);
  guarded.forbid_compiles = true;
  guarded.strict_donation = true;
  ASSERT_TRUE(session_->SetOptions(guarded).ok());
  auto before = session_->Stats();
  ASSERT_TRUE(before.ok());

  const ExecuteOptions everywhere{.placement = Placement::Replicated()};
  std::vector<Array> state{*s0, *c0};
  std::optional<MemoryCheck> check;
  ExecuteReceipt receipt;
  for (int step = 0; step < 1000; ++step) {
    ExecuteOptions first = everywhere;
    if (step == 0) first.receipt = &receipt;
    auto a = session_->Execute(*f1, state, first);
    ASSERT_TRUE(a.ok()) << a.status();
    if (step == 0) {
      ASSERT_EQ(receipt.donations.size(), 2u);
      for (const DonationReceipt& r : receipt.donations) {
        EXPECT_TRUE(r.reused) << r.reason;
        EXPECT_EQ(r.output_handle, (*a)[r.output].handle());
      }
    }
    auto b = session_->Execute(*f2, *a, everywhere);
    ASSERT_TRUE(b.ok()) << b.status();
    state = *b;
    if (step == 0) {
      ASSERT_TRUE(session_->Await(state).ok());
      auto m = MemoryCheck::Begin(*session_);
      ASSERT_TRUE(m.ok()) << m.status();
      check.emplace(std::move(*m));
    }
  }
  ASSERT_TRUE(session_->Await(state).ok());
  ASSERT_TRUE(check->Verify().ok()) << check->Verify();
  auto after = session_->Stats();
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->bytes_device_to_host, 0);
  EXPECT_EQ(after->bytes_host_to_device, before->bytes_host_to_device);
  EXPECT_EQ(after->bytes_device_to_device, 0);
  EXPECT_EQ(after->session_compiles, 2);
  EXPECT_EQ(after->executions - before->executions, 2000);
  // Two donated arrays, 2,000 steps, each on both devices: all reused in place.
  EXPECT_EQ(after->donations - before->donations, 2 * 2000 * 2);
  EXPECT_EQ(after->donations_reused - before->donations_reused, 2 * 2000 * 2);
  EXPECT_EQ(after->live_arrays, 2);

  // The final, explicit fetch is the only transfer to the host.
  auto out = session_->Fetch(state[0]);
  auto count = session_->Fetch(state[1]);
  ASSERT_TRUE(out.ok() && count.ok()) << out.status() << count.status();
  EXPECT_EQ(count->as<int32_t>()[0], 1000);
  std::vector<float> ref = init;
  for (int step = 0; step < 1000; ++step) {
    for (float& v : ref) v = std::tanh(v * 0.5f + 1.0f) + 1.0f;
  }
  for (int64_t i = 0; i < kN; ++i) ASSERT_NEAR(out->as<float>()[i], ref[i], 1e-5) << i;
  auto final_stats = session_->Stats();
  EXPECT_EQ(final_stats->bytes_device_to_host, (kN * 4 + 4));
}

// The same loop with one mistake each; every one is caught with the error a
// user needs.
TEST_F(LifetimeTest, SeedLoopMistakesAreCaught) {
  auto f1 = session_->Compile(StepGraph("f1", false), {.donate = {0, 1}});
  auto f2 = session_->Compile(StepGraph("f2", true), {.donate = {0, 1}});
  auto f1_keeps = session_->Compile(StepGraph("f1", false));  // forgot to donate
  ASSERT_TRUE(f1.ok() && f2.ok() && f1_keeps.ok());
  auto s0 = session_->Put(HostArray::From<float>({kN}, Initial()));
  auto c0 = session_->Put(HostArray::From<int32_t>({}, {0}));
  ASSERT_TRUE(s0.ok() && c0.ok());
  SessionOptions guarded;
  guarded.transfer_guard = TransferGuard::All(TransferLevel::kDisallow);
  guarded.forbid_compiles = true;
  ASSERT_TRUE(session_->SetOptions(guarded).ok());
  std::vector<Array> state{*s0, *c0};
  auto run = [&](const Executable& a, const Executable& b) {
    auto x = session_->Execute(a, state);
    auto y = x.ok() ? session_->Execute(b, *x) : x;
    if (y.ok()) state = *y;
    return y.ok() ? session_->Await(state) : y.status();
  };
  absl::Status first = run(*f1, *f2);
  ASSERT_TRUE(first.ok()) << first;
  auto check = MemoryCheck::Begin(*session_);
  ASSERT_TRUE(check.ok());

  // 1. A step that does not donate, its input kept alive by the loop: memory
  //    grows, and the check names the arrays and the steps that made them.
  std::vector<Array> history;
  for (int i = 0; i < 3; ++i) {
    history.push_back(state[0]);
    ASSERT_TRUE(run(*f1_keeps, *f2).ok());
  }
  absl::Status grew = check->Verify();
  EXPECT_EQ(grew.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(grew.message()), HasSubstr("memory grew"));
  EXPECT_THAT(std::string(grew.message()),
              HasSubstr("f32[1024] (4096 bytes, made by f2 in execution"));
  ASSERT_TRUE(session_->Delete(history).ok());

  // 2. A signature change: the state made s32 by mistake. Execute refuses,
  //    and the compile it would need is refused, saying what differs.
  auto wrong = session_->Put(HostArray::From<int32_t>({kN}, std::vector<int32_t>(kN, 1)));
  ASSERT_TRUE(wrong.ok());
  auto bad = session_->Execute(*f1, {*wrong, state[1]}, {.wait = true});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("argument 0 'state' (array 0x"));
  EXPECT_THAT(bad.status().message(),
              HasSubstr("expected f32[1024], got s32[1024] (dtype differs)"));
  GraphBuilder g("f1");
  Value s = g.Parameter({DType::kS32, {kN}}, "state");
  Value c = g.Parameter({DType::kS32, {}}, "count");
  auto recompile = session_->Compile(*g.Build({g.Add(s, s), c}), {.donate = {0, 1}});
  ASSERT_FALSE(recompile.ok());
  EXPECT_EQ(recompile.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(recompile.status().message(), HasSubstr("forbids new compiles"));
  EXPECT_THAT(
      recompile.status().message(),
      HasSubstr("parameter 0 'state': s32[1024] here, f32[1024] in the cached one (dtype)"));

  // 3. A stray fetch inside the loop (an implicit one, like printing the
  //    state): refused, naming the array, the bytes and the direction.
  auto stray = session_->Fetch(state[0], {.implicit = true});
  ASSERT_FALSE(stray.ok());
  EXPECT_EQ(stray.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(stray.status().message(), HasSubstr("implicit device->host transfer of array"));
  EXPECT_THAT(stray.status().message(),
              HasSubstr("f32[1024]) (4096 bytes) is disallowed (disallow set by the session)"));
  // Under disallow_explicit even an explicit fetch is refused.
  auto strict = session_->Fetch(
      state[0], {.transfer_guard = TransferGuard::All(TransferLevel::kDisallowExplicit)});
  ASSERT_FALSE(strict.ok());
  EXPECT_THAT(strict.status().message(), HasSubstr("explicit device->host transfer"));
  auto stats = session_->Stats();
  EXPECT_EQ(stats->bytes_device_to_host, 0);
  ASSERT_TRUE(session_->Fetch(state[0]).ok());  // explicit: allowed under disallow
}

TEST_F(LifetimeTest, DonatedArraysAreGoneWithAReceiptAndATombstone) {
  GraphBuilder g("double");
  Value x = g.Parameter({DType::kF32, {4}}, "x");
  auto exe = session_->Compile(*g.Build({g.Mul(x, x)}));
  ASSERT_TRUE(exe.ok());
  auto a = session_->Put(HostArray::From<float>({4}, {1, 2, 3, 4}));
  ASSERT_TRUE(a.ok());
  ExecuteReceipt receipt;
  auto out = session_->Execute(*exe, {*a}, {.donate = {0}, .receipt = &receipt});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(receipt.donations.size(), 1u);
  EXPECT_TRUE(receipt.donations[0].reused);
  EXPECT_EQ(receipt.donations[0].handle, a->handle());
  // Using it again: FAILED_PRECONDITION naming the array, the execution and when.
  auto again = session_->Execute(*exe, {*a}, {.wait = true});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(again.status().message(),
              HasSubstr(absl::StrFormat("array %#x was donated to execution %d ('double') at ",
                                        a->handle(), receipt.execution_id)));
  EXPECT_THAT(again.status().message(), HasSubstr(" ago)"));
  auto info = session_->Info(*a);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, ArrayState::kDonated);
  auto fetched = session_->Fetch((*out)[0]);
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ(fetched->as<float>()[3], 16.f);

  // Donating one array twice in a call is refused, nothing consumed.
  GraphBuilder h("add");
  Value p = h.Parameter({DType::kF32, {4}}, "p");
  Value q = h.Parameter({DType::kF32, {4}}, "q");
  auto add = session_->Compile(*h.Build({h.Add(p, q)}));
  ASSERT_TRUE(add.ok());
  auto twice = session_->Execute(*add, {(*out)[0], (*out)[0]}, {.wait = true, .donate = {0}});
  ASSERT_FALSE(twice.ok());
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(twice.status().message(), HasSubstr("cannot be donated and read in the same call"));
  EXPECT_TRUE(session_->Fetch((*out)[0]).ok());

  // A donation no output can take: the receipt says why; strict refuses it.
  GraphBuilder r("total");
  Value v = r.Parameter({DType::kF32, {4}}, "v");
  auto total = session_->Compile(*r.Build({r.Reduce(v, ReduceKind::kSum, {0})}));
  ASSERT_TRUE(total.ok());
  auto keep = session_->Put(HostArray::From<float>({4}, {1, 1, 1, 1}));
  auto refused =
      session_->Execute(*total, {*keep}, {.wait = true, .donate = {0}, .strict_donation = true});
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("strict donation: argument 0 'v'"));
  EXPECT_THAT(refused.status().message(),
              HasSubstr("no output has its type f32[4] (outputs: f32[])"));
  EXPECT_TRUE(session_->Fetch(*keep).ok());  // a refused call consumes nothing
  auto plain = session_->Execute(*total, {*keep}, {.donate = {0}, .receipt = &receipt});
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(receipt.donations[0].reused);
  EXPECT_THAT(receipt.donations[0].reason, HasSubstr("no output has its type"));
  auto sum = session_->Fetch((*plain)[0]);
  ASSERT_TRUE(sum.ok());
  EXPECT_EQ(sum->as<float>()[0], 4.f);
}

TEST_F(LifetimeTest, DonatingAnArrayStillReadByAPendingStepWaitsForIt) {
  // A slow reader (a large dot) then, pipelined right behind it, a step that
  // donates the same array and overwrites it in place.
  const int64_t n = 512;
  GraphBuilder g("slow_sum");
  Value x = g.Parameter({DType::kF32, {n, n}}, "x");
  Value sq = g.MatMul(x, x);
  auto slow = session_->Compile(*g.Build({g.Reduce(sq, ReduceKind::kSum, {0, 1})}));
  GraphBuilder h("scale");
  Value y = h.Parameter({DType::kF32, {n, n}}, "y");
  auto scale =
      session_->Compile(*h.Build({h.Mul(y, h.Broadcast(h.Scalar(DType::kF32, 0.0), {n, n}))}));
  ASSERT_TRUE(slow.ok() && scale.ok());
  std::vector<float> ones(n * n, 1.0f);
  auto a = session_->Put(HostArray::From<float>({n, n}, ones));
  ASSERT_TRUE(a.ok());
  auto total = session_->Execute(*slow, {*a});
  ExecuteReceipt receipt;
  auto zeroed = session_->Execute(*scale, {*a}, {.donate = {0}, .receipt = &receipt});
  ASSERT_TRUE(total.ok() && zeroed.ok());
  EXPECT_TRUE(receipt.donations[0].reused);
  auto t = session_->Fetch((*total)[0]);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->as<float>()[0], float(n) * n * n);  // read before the overwrite
  auto z = session_->Fetch((*zeroed)[0]);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ(z->as<float>()[n * n - 1], 0.f);
}

TEST_F(LifetimeTest, TransferGuardLevelsOverridesAndCounters) {
  const HostArray data = HostArray::From<float>({256}, std::vector<float>(256, 2.f));
  SessionOptions o;
  o.transfer_guard = TransferGuard::All(TransferLevel::kDisallow);
  ASSERT_TRUE(session_->SetOptions(o).ok());
  // Explicit put: allowed under disallow. Implicit: refused.
  auto a = session_->Put(data, Placement::Device(1));
  ASSERT_TRUE(a.ok()) << a.status();
  auto implicit = session_->Put(data, Placement::Device(0), {.implicit = true});
  ASSERT_FALSE(implicit.ok());
  EXPECT_THAT(implicit.status().message(),
              HasSubstr("transfer guard: implicit host->device transfer of array"));
  EXPECT_THAT(implicit.status().message(),
              HasSubstr("(f32[256]) to device 0 (1024 bytes) is disallowed"));
  // The call may override the session.
  auto allowed =
      session_->Put(data, Placement::Device(0),
                    {.implicit = true, .transfer_guard = TransferGuard::All(TransferLevel::kLog)});
  ASSERT_TRUE(allowed.ok()) << allowed.status();
  // Moving an argument between devices is an implicit device->device transfer.
  GraphBuilder g("neg");
  Value x = g.Parameter({DType::kF32, {256}}, "x");
  auto exe = session_->Compile(*g.Build({g.Neg(x)}));
  ASSERT_TRUE(exe.ok());
  auto moved = session_->Execute(*exe, {*a}, {.placement = Placement::Device(0), .wait = true});
  ASSERT_FALSE(moved.ok());
  EXPECT_THAT(moved.status().message(),
              HasSubstr("implicit device->device transfer of argument 0 'x'"));
  EXPECT_THAT(moved.status().message(),
              HasSubstr("from device 1 to device 0 (1024 bytes) is disallowed"));
  // Explicit fetch allowed, and refused under disallow_explicit.
  o.transfer_guard.device_to_host = TransferLevel::kDisallowExplicit;
  ASSERT_TRUE(session_->SetOptions(o).ok());
  EXPECT_FALSE(session_->Fetch(*a).ok());
  auto fetched = session_->Fetch(*a, {.transfer_guard = TransferGuard::All(TransferLevel::kAllow)});
  ASSERT_TRUE(fetched.ok()) << fetched.status();
  // Counters per direction, per device.
  auto st = session_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->bytes_host_to_device, 2048);
  EXPECT_EQ(st->bytes_device_to_host, 1024);
  ASSERT_EQ(st->device_transfers.size(), 2u);
  EXPECT_EQ(st->device_transfers[0].device, 0);
  EXPECT_EQ(st->device_transfers[0].host_to_device, 1024);
  EXPECT_EQ(st->device_transfers[1].device_to_host, 1024);
}

TEST_F(LifetimeTest, QuotaCacheMissesAndMemoryStats) {
  SessionOptions o;
  o.memory_quota_bytes = 6000;
  ASSERT_TRUE(session_->SetOptions(o).ok());
  auto a = session_->Put(HostArray::From<float>({1024}, std::vector<float>(1024, 1.f)));
  ASSERT_TRUE(a.ok());
  auto b = session_->Put(HostArray::From<float>({1024}, std::vector<float>(1024, 1.f)));
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(),
              HasSubstr("needs 4096 more bytes; the session holds 4096 bytes in 1 live arrays, "
                        "quota 6000"));
  GraphBuilder g("twice");
  Value x = g.Parameter({DType::kF32, {1024}}, "x");
  auto exe = session_->Compile(*g.Build({g.Add(x, x)}));
  ASSERT_TRUE(exe.ok());
  EXPECT_FALSE(exe->cache_hit());
  auto over = session_->Execute(*exe, {*a}, {.wait = true});
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  // Donating the input makes room: the output takes its buffer.
  auto in_place = session_->Execute(*exe, {*a}, {.wait = true, .donate = {0}});
  ASSERT_TRUE(in_place.ok()) << in_place.status();
  // A cache miss says what differs from the nearest cached executable.
  GraphBuilder h("twice");
  Value y = h.Parameter({DType::kF32, {2048}}, "x");
  auto other = session_->Compile(*h.Build({h.Add(y, y)}));
  ASSERT_TRUE(other.ok());
  EXPECT_THAT(other->cache_miss_reason(),
              HasSubstr("parameter 0 'x': f32[2048] here, f32[1024] in the cached one"));
  auto st = session_->Stats(/*with_arrays=*/true);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->session_cache_misses, 2);
  EXPECT_EQ(st->live_arrays, 1);
  EXPECT_EQ(st->live_bytes, 4096);
  ASSERT_EQ(st->arrays.size(), 1u);
  EXPECT_EQ(st->arrays[0].producer, "twice");
  ASSERT_EQ(st->devices.size(), 2u);
  EXPECT_GE(st->devices[0].bytes_in_use, 4096);
  EXPECT_GE(st->devices[0].peak_bytes_in_use, st->devices[0].bytes_in_use);
  EXPECT_GE(st->devices[0].num_buffers, 1);
}

}  // namespace
}  // namespace tessel

// The C++ SDK's partitioned API on a real cluster: 2 worker processes with 2
// CPU devices each, mesh {data: 2, model: 2}. Results are checked against
// naive loops; plans are checked by counting their collectives.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>

#include "absl/strings/str_cat.h"
#include "tessel/checkpoint_manager.h"
#include "tessel/graph.h"
#include "tessel/local_cluster.h"
#include "tessel/session.h"
#include "tests/cluster_fixture.h"

namespace tessel {
namespace {

TEST(ShardingText, ParsesWhatItPrints) {
  for (const std::string text :
       {"P('data', None)", "P(None, 'model')", "P(('data', 'model'),)", "P()",
        "P('data',) partial(sum: model)", "P(None, None) partial(max: data, model)"}) {
    auto s = Sharding::Parse(text);
    ASSERT_TRUE(s.ok()) << text << ": " << s.status();
    auto again = Sharding::Parse(s->ToString());
    ASSERT_TRUE(again.ok()) << s->ToString();
    EXPECT_EQ(*s, *again) << text << " vs " << s->ToString();
  }
  auto s = Sharding::Parse("P(data, (a, b), unreduced=(model,))");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->dims, (std::vector<std::vector<std::string>>{{"data"}, {"a", "b"}}));
  EXPECT_EQ(s->partial, std::vector<std::string>{"model"});
  EXPECT_EQ(Sharding::Split({"data", ""}).ToString(), "P('data', None)");
  EXPECT_EQ(Sharding::Split({"", "model"}).Unreduced({"data"}).ToString(),
            "P(None, 'model') partial(sum: data)");
  for (const std::string bad :
       {"Q('data')", "P('data'", "P(('data'),", "P('a') partial(avg: b)", "P('a') extra"}) {
    auto r = Sharding::Parse(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos) << r.status();
  }
  auto m = Mesh::Parse("data=2, model=3");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->size(), 6);
  EXPECT_EQ(m->ToString(), "{data: 2, model: 3}");
  EXPECT_EQ(Mesh::Parse("data=0").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Mesh::Parse("data").status().code(), absl::StatusCode::kInvalidArgument);
}

class ShardingTest : public ClusterFixture<2, 2> {
 protected:
  static HostArray Random(std::vector<int64_t> dims, int seed) {
    HostArray a(ArrayType{DType::kF32, std::move(dims)});
    std::mt19937 rng(seed);
    std::normal_distribution<float> n;
    for (float& v : a.as_mutable<float>()) v = n(rng);
    return a;
  }
  const Mesh mesh_{{{"data", 2}, {"model", 2}}};
};

TEST_F(ShardingTest, PutSendsEachDeviceItsBlockAndFetchReassembles) {
  HostArray x = Random({8, 6}, 1);
  const Sharding rows = Sharding::Split({"data", ""});
  auto before = session_->Stats();
  auto a = session_->Put(x, Placement::Sharded(mesh_, rows));
  ASSERT_TRUE(a.ok()) << a.status();
  auto after = session_->Stats();
  // Two row blocks, each copied over `model`: 4 blocks of 24 floats.
  EXPECT_EQ(after->bytes_host_to_device - before->bytes_host_to_device, 4 * 24 * 4);
  auto info = session_->Info(*a);
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(info->sharding.has_value());
  EXPECT_EQ(info->sharding->spec, rows);
  EXPECT_EQ(info->sharding->mesh.size(), 4);
  EXPECT_EQ(info->devices, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(info->device_bytes, (std::vector<int64_t>{96, 96, 96, 96}));
  auto back = session_->Fetch(*a);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->bytes(), x.bytes());
}

TEST_F(ShardingTest, ContractionOverASplitDimensionIsOneAllReduceWithItsReason) {
  // h = tanh(x @ w) with the contraction split over `model`.
  GraphBuilder g("dense");
  Value x = g.Parameter({DType::kF32, {8, 4}}, "x");
  Value w = g.Parameter({DType::kF32, {4, 6}}, "w");
  Value h = g.Tanh(g.MatMul(x, w));
  auto graph = g.Build({h});
  ASSERT_TRUE(graph.ok()) << graph.status();
  CompileOptions o;
  o.mesh = mesh_;
  o.parameter_shardings = {Sharding::Split({"data", "model"}), Sharding::Split({"model", ""})};
  auto exe = session_->Compile(*graph, o);
  ASSERT_TRUE(exe.ok()) << exe.status();
  ASSERT_TRUE(exe->partitioned());
  ASSERT_EQ(exe->collectives().size(), 1u) << exe->plan();
  const PlannedCollective& c = exe->collectives()[0];
  EXPECT_EQ(c.op, "all_reduce");
  EXPECT_EQ(c.axes, std::vector<std::string>{"model"});
  EXPECT_EQ(c.bytes_per_device, 4 * 6 * 4);  // this device's [4,6] block
  EXPECT_NE(c.reason.find("partial"), std::string::npos) << c.reason;
  EXPECT_EQ(exe->output_shardings()[0], Sharding::Split({"data", ""}));

  HostArray hx = Random({8, 4}, 2), hw = Random({4, 6}, 3);
  auto ax = session_->Put(hx, Placement::Sharded(mesh_, o.parameter_shardings[0]));
  auto aw = session_->Put(hw, Placement::Sharded(mesh_, o.parameter_shardings[1]));
  ASSERT_TRUE(ax.ok() && aw.ok());
  auto outs = session_->Execute(*exe, {*ax, *aw});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto got = session_->Fetch((*outs)[0]);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 6; ++j) {
      double acc = 0;
      for (int k = 0; k < 4; ++k)
        acc += double(hx.as<float>()[i * 4 + k]) * hw.as<float>()[k * 6 + j];
      EXPECT_NEAR(got->as<float>()[i * 6 + j], std::tanh(acc), 1e-5) << i << "," << j;
    }
  }

  // Wanting the result split over `model` too turns it into a reduce_scatter;
  // leaving it unreduced needs nothing.
  o.output_shardings = {Sharding::Split({"data", "model"})};
  GraphBuilder g2("dense_linear");
  Value x2 = g2.Parameter({DType::kF32, {8, 4}}, "x");
  Value w2 = g2.Parameter({DType::kF32, {4, 6}}, "w");
  auto linear = g2.Build({g2.MatMul(x2, w2)});
  ASSERT_TRUE(linear.ok());
  auto scattered = session_->Compile(*linear, o);
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  ASSERT_EQ(scattered->collectives().size(), 1u) << scattered->plan();
  EXPECT_EQ(scattered->collectives()[0].op, "reduce_scatter");
  o.output_shardings = {Sharding::Split({"data", ""}).Unreduced({"model"})};
  auto partial = session_->Compile(*linear, o);
  ASSERT_TRUE(partial.ok()) << partial.status();
  EXPECT_TRUE(partial->collectives().empty()) << partial->plan();
}

TEST_F(ShardingTest, ManualRegionCollectivesMatchNaiveReferences) {
  // Each device's [2,3] block of x: psum over data, all_gather over model
  // along dimension 1, plus the device's index along data.
  GraphBuilder g("region");
  Value x = g.Parameter({DType::kF32, {4, 6}}, "x");
  const Sharding both = Sharding::Split({"data", "model"});
  Value y = g.ManualRegion(
      mesh_, {x}, {both}, Sharding::Replicated(),
      [](GraphBuilder& b, const std::vector<Value>& in) {
        Value s = b.AllReduce(in[0], {"data"});
        Value gathered = b.AllGather(s, {"model"}, 1);
        Value idx = b.Convert(b.AxisIndex({"data"}), DType::kF32);
        Value gathered_all = b.AllGather(b.Add(gathered, b.Broadcast(idx, {2, 6})), {"data"}, 0);
        return gathered_all;
      });
  auto graph = g.Build({y});
  ASSERT_TRUE(graph.ok()) << graph.status();
  ASSERT_EQ(y.type().dims, (std::vector<int64_t>{4, 6}));
  CompileOptions o;
  o.mesh = mesh_;
  o.parameter_shardings = {both};
  auto exe = session_->Compile(*graph, o);
  ASSERT_TRUE(exe.ok()) << exe.status();
  EXPECT_EQ(exe->collectives().size(), 3u) << exe->plan();
  HostArray hx = Random({4, 6}, 4);
  auto ax = session_->Put(hx, Placement::Sharded(mesh_, both));
  ASSERT_TRUE(ax.ok()) << ax.status();
  auto outs = session_->Execute(*exe, {*ax});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto got = session_->Fetch((*outs)[0]);
  ASSERT_TRUE(got.ok()) << got.status();
  // Row block r of the result is data index r's: x[r-block rows summed over
  // the two data blocks] + r.
  const auto xs = hx.as<float>();
  for (int r = 0; r < 2; ++r) {
    for (int i = 0; i < 2; ++i) {
      for (int j = 0; j < 6; ++j) {
        const float want = xs[i * 6 + j] + xs[(2 + i) * 6 + j] + r;
        EXPECT_NEAR(got->as<float>()[(r * 2 + i) * 6 + j], want, 1e-5) << r << "," << i << "," << j;
      }
    }
  }
}

TEST_F(ShardingTest, DonatedAllReduceRunsInPlace) {
  const Mesh pair({{"data", 2}, {"model", 2}});
  const Sharding rows = Sharding::Split({"data", "model"});
  GraphBuilder g("psum");
  Value a = g.Parameter({DType::kF32, {4, 6}}, "a");
  Value r = g.ManualRegion(
      pair, {a}, {rows}, rows,
      [](GraphBuilder& b, const std::vector<Value>& in) { return b.AllReduce(in[0], {"data"}); });
  auto graph = g.Build({r});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session_->Compile(*graph, {.donate = {0},
                                        .strict_donation = true,
                                        .mesh = pair,
                                        .parameter_shardings = {rows},
                                        .output_shardings = {rows}});
  ASSERT_TRUE(exe.ok()) << exe.status();
  HostArray hx = Random({4, 6}, 10);
  auto x = session_->Put(hx, Placement::Sharded(pair, rows));
  ASSERT_TRUE(x.ok());
  ExecuteReceipt receipt;
  auto outs = session_->Execute(*exe, {*x}, {.receipt = &receipt});
  ASSERT_TRUE(outs.ok()) << outs.status();
  ASSERT_EQ(receipt.donations.size(), 1u);
  EXPECT_TRUE(receipt.donations[0].reused) << receipt.donations[0].reason;
  auto got = session_->Fetch((*outs)[0]);
  ASSERT_TRUE(got.ok()) << got.status();
  const auto xs = hx.as<float>();
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 6; ++j) {
      // Rows i and i +- 2 lie in the two `data` blocks: both hold their sum.
      EXPECT_NEAR(got->as<float>()[i * 6 + j], xs[(i % 2) * 6 + j] + xs[(i % 2 + 2) * 6 + j], 1e-5)
          << i << "," << j;
    }
  }
  auto info = session_->Info(*x);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state, ArrayState::kDonated);
}

TEST_F(ShardingTest, CustomKernelRuleDecidesWhetherAnAllReduceIsNeeded) {
  // Seed 002's shape: a copy kernel inside a region over {data, model} with
  // in and out spec P('data', None).
  auto build = [&](ReplicationRule rule, Sharding out_spec) {
    GraphBuilder g("copy_kernel");
    Value x = g.Parameter({DType::kF32, {8, 4}}, "x");
    const Sharding rows = Sharding::Split({"data", ""});
    Value y = g.ManualRegion(
        mesh_, {x}, {rows}, out_spec, [&](GraphBuilder& b, const std::vector<Value>& in) {
          return b.CustomKernel(
              "copy", {in[0]},
              [](GraphBuilder& k, const std::vector<Value>& a) { return k.Neg(k.Neg(a[0])); }, rule,
              "extern \"C\" __global__ void copy() {}");
        });
    return g.Build({y});
  };
  CompileOptions o;
  o.mesh = mesh_;
  o.parameter_shardings = {Sharding::Split({"data", ""})};
  auto follow = build(ReplicationRule::Follow(0), Sharding::Split({"data", ""}));
  ASSERT_TRUE(follow.ok()) << follow.status();
  auto exe = session_->Compile(*follow, o);
  ASSERT_TRUE(exe.ok()) << exe.status();
  EXPECT_TRUE(exe->collectives().empty()) << exe->plan();

  auto varying = build(ReplicationRule::Explicit({"data", "model"}), Sharding::Split({"data", ""}));
  ASSERT_TRUE(varying.ok()) << varying.status();
  auto bad = session_->Compile(*varying, o);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("model"), std::string::npos) << bad.status();
  EXPECT_NE(bad.status().message().find("copy"), std::string::npos) << bad.status();

  auto unreduced = build(ReplicationRule::Explicit({"data", "model"}),
                         Sharding::Split({"data", ""}).Unreduced({"model"}));
  ASSERT_TRUE(unreduced.ok());
  o.output_shardings = {Sharding::Split({"data", ""})};
  auto one = session_->Compile(*unreduced, o);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_EQ(one->collectives().size(), 1u) << one->plan();
  EXPECT_EQ(one->collectives()[0].axes, std::vector<std::string>{"model"});
}

TEST_F(ShardingTest, BadInputIsAClearErrorAndTheClusterKeepsServing) {
  GraphBuilder outside("outside");
  Value x = outside.Parameter({DType::kF32, {4}}, "x");
  outside.AllReduce(x, {"data"});
  EXPECT_NE(outside.status().message().find("only inside a manual region"), std::string::npos)
      << outside.status();

  GraphBuilder g("neg");
  Value p = g.Parameter({DType::kF32, {6, 4}}, "p");
  auto graph = g.Build({g.Neg(p)});
  ASSERT_TRUE(graph.ok());
  CompileOptions o;
  o.parameter_shardings = {Sharding::Split({"data"})};
  EXPECT_NE(session_->Compile(*graph, o).status().message().find("without a mesh"),
            std::string::npos);
  o.mesh = mesh_;
  o.parameter_shardings = {Sharding::Split({"data", "data"})};
  auto twice = session_->Compile(*graph, o);
  EXPECT_NE(twice.status().message().find("used twice"), std::string::npos) << twice.status();
  auto uneven =
      session_->Put(Random({6, 3}, 5), Placement::Sharded(mesh_, Sharding::Split({"", "model"})));
  EXPECT_EQ(uneven.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(uneven.status().message().find("does not split evenly"), std::string::npos)
      << uneven.status();
  // An argument laid out differently from the compiled layout is refused, not moved.
  o.parameter_shardings = {Sharding::Split({"data", ""})};
  auto exe = session_->Compile(*graph, o);
  ASSERT_TRUE(exe.ok()) << exe.status();
  auto cols =
      session_->Put(Random({6, 4}, 6), Placement::Sharded(mesh_, Sharding::Split({"", "model"})));
  ASSERT_TRUE(cols.ok()) << cols.status();
  auto outs = session_->Execute(*exe, {*cols}, {.wait = true});
  EXPECT_EQ(outs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outs.status().message().find("P(None, 'model')"), std::string::npos) << outs.status();
  auto st = session_->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->live_arrays, 1);  // `cols`; nothing half-made
  auto rows =
      session_->Put(Random({6, 4}, 7), Placement::Sharded(mesh_, Sharding::Split({"data", ""})));
  ASSERT_TRUE(rows.ok());
  auto good = session_->Execute(*exe, {*rows}, {.wait = true});
  EXPECT_TRUE(good.ok()) << good.status();
}

// Per-device bytes received from other devices, by this session so far.
std::map<int, int64_t> Received(Session& s) {
  std::map<int, int64_t> out;
  auto st = s.Stats();
  if (!st.ok()) return out;
  for (const DeviceTransfers& t : st->device_transfers) out[t.device] = t.device_to_device;
  return out;
}

// Every reshard below is checked against the host array it came from: the
// fetched copy must be the same bytes, and the receipt must move exactly the
// bytes of each target block that its own device did not already hold.
TEST_F(ShardingTest, ReshardToAnotherMeshMovesEachBlockWorkerToWorker) {
  const Mesh a({{"x", 2}}, {0, 1}), b({{"x", 2}}, {2, 3});  // one worker each
  HostArray hx = Random({8, 6}, 21);
  auto x = session_->Put(hx, Placement::Sharded(a, Sharding::Split({"x", ""})));
  ASSERT_TRUE(x.ok()) << x.status();
  auto before = Received(*session_);
  ReshardReceipt r;
  auto y = session_->Reshard(*x, Placement::Sharded(b, Sharding::Split({"x", ""})), {}, &r);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(r.bytes_moved, 8 * 6 * 4);
  EXPECT_EQ(r.bytes_copied, 0);
  ASSERT_EQ(r.pieces.size(), 2u);
  EXPECT_EQ(r.pieces[0], "device 0 -> device 2: [0:4, 0:6] of f32[8,6] (96 bytes)");
  auto got = session_->Fetch(*y);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes(), hx.bytes());
  auto after = Received(*session_);
  EXPECT_EQ(after[2] - before[2], 96);
  EXPECT_EQ(after[3] - before[3], 96);
  EXPECT_EQ(after[0] - before[0], 0);
  auto info = session_->Info(*y);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->devices, (std::vector<int>{2, 3}));
  EXPECT_EQ(info->producer, "reshard");
  // The source stays where it was, intact.
  auto again = session_->Fetch(*x);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->bytes(), hx.bytes());
}

TEST_F(ShardingTest, ReshardBetweenShardingsCutsBlocksAndCopiesWhatIsAlreadyThere) {
  // Rows over devices {0, 1} to columns over devices {1, 2}: device 1 keeps
  // the quarter it holds; the other three quarters cross devices, device 0
  // sending a different strided region to each of 1 and 2.
  const Mesh a({{"x", 2}}, {0, 1}), b({{"x", 2}}, {1, 2});
  HostArray hx = Random({8, 6}, 22);
  auto x = session_->Put(hx, Placement::Sharded(a, Sharding::Split({"x", ""})));
  ASSERT_TRUE(x.ok()) << x.status();
  auto before = Received(*session_);
  ReshardReceipt r;
  auto y = session_->Reshard(*x, Placement::Sharded(b, Sharding::Split({"", "x"})), {}, &r);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(r.bytes_copied, 4 * 3 * 4);
  EXPECT_EQ(r.bytes_moved, 3 * 4 * 3 * 4);
  auto got = session_->Fetch(*y);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes(), hx.bytes());
  auto after = Received(*session_);
  EXPECT_EQ(after[1] - before[1], 48);
  EXPECT_EQ(after[2] - before[2], 96);

  // One device, and every device: the whole array on each, cut from both blocks.
  ReshardReceipt one;
  auto on3 = session_->Reshard(*y, Placement::Device(3), {}, &one);
  ASSERT_TRUE(on3.ok()) << on3.status();
  EXPECT_EQ(one.bytes_moved, 8 * 6 * 4);
  auto whole = session_->Fetch(*on3);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->bytes(), hx.bytes());
  ReshardReceipt all;
  auto everywhere = session_->Reshard(*x, Placement::Replicated(), {}, &all);
  ASSERT_TRUE(everywhere.ok()) << everywhere.status();
  EXPECT_EQ(all.bytes_copied, 2 * 96);           // devices 0 and 1 keep their own rows
  EXPECT_EQ(all.bytes_moved, 4 * 192 - 2 * 96);  // the rest of four whole copies
  auto info = session_->Info(*everywhere);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->devices, (std::vector<int>{0, 1, 2, 3}));
  auto rep = session_->Fetch(*everywhere);
  ASSERT_TRUE(rep.ok()) << rep.status();
  EXPECT_EQ(rep->bytes(), hx.bytes());
}

TEST_F(ShardingTest, ReshardIsOrderedAfterTheStepThatMakesItsSource) {
  // y = -x on mesh A, resharded at once (not awaited), many times over:
  // each copy must see its step's result, never what the buffer held before.
  const Mesh a({{"x", 2}}, {0, 1}), b({{"x", 2}}, {3, 2});
  const Sharding rows = Sharding::Split({"x", ""});
  GraphBuilder g("neg");
  Value p = g.Parameter({DType::kF32, {8, 6}}, "p");
  auto graph = g.Build({g.Neg(p)});
  ASSERT_TRUE(graph.ok());
  auto exe = session_->Compile(
      *graph, {.mesh = a, .parameter_shardings = {rows}, .output_shardings = {rows}});
  ASSERT_TRUE(exe.ok()) << exe.status();
  HostArray hx = Random({8, 6}, 23);
  auto x = session_->Put(hx, Placement::Sharded(a, rows));
  ASSERT_TRUE(x.ok());
  std::vector<Array> copies;
  Array cur = *x;
  for (int i = 0; i < 6; ++i) {
    auto out = session_->Execute(*exe, {cur}, {});
    ASSERT_TRUE(out.ok()) << out.status();
    auto c = session_->Reshard((*out)[0], Placement::Sharded(b, rows));
    ASSERT_TRUE(c.ok()) << c.status();
    copies.push_back(*c);
    cur = (*out)[0];
  }
  for (int i = 0; i < 6; ++i) {
    auto got = session_->Fetch(copies[i]);
    ASSERT_TRUE(got.ok()) << got.status();
    const float sign = i % 2 == 0 ? -1.f : 1.f;
    for (int k = 0; k < 48; ++k)
      ASSERT_EQ(got->as<float>()[k], sign * hx.as<float>()[k]) << i << ", " << k;
  }
}

TEST_F(ShardingTest, ReshardIsJudgedByTheGuardAndRefusesBadInputClearly) {
  const Mesh a({{"x", 2}}, {0, 1}), b({{"x", 2}}, {2, 3});
  const Sharding rows = Sharding::Split({"x", ""});
  auto x = session_->Put(Random({8, 6}, 24), Placement::Sharded(a, rows));
  ASSERT_TRUE(x.ok());
  TransferOptions strict;
  strict.transfer_guard =
      TransferGuard{TransferLevel::kUnset, TransferLevel::kUnset, TransferLevel::kDisallowExplicit};
  auto refused = session_->Reshard(*x, Placement::Sharded(b, rows), strict);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("explicit device->device transfer"), std::string::npos)
      << refused.status();
  // Implicit-only guards let an explicit reshard through.
  TransferOptions implicit_only;
  implicit_only.transfer_guard = TransferGuard::All(TransferLevel::kDisallow);
  EXPECT_TRUE(session_->Reshard(*x, Placement::Sharded(b, rows), implicit_only).ok());

  auto partial =
      session_->Reshard(*x, Placement::Sharded(b, Sharding::Split({"x", ""}).Unreduced({"x"})));
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument) << partial.status();
  auto uneven =
      session_->Reshard(*x, Placement::Sharded(Mesh({{"x", 4}}), Sharding::Split({"", "x"})));
  EXPECT_NE(uneven.status().message().find("does not split evenly"), std::string::npos)
      << uneven.status();
  auto nowhere = session_->Reshard(*x, Placement::Device(9));
  EXPECT_EQ(nowhere.status().code(), absl::StatusCode::kInvalidArgument) << nowhere.status();
  EXPECT_NE(nowhere.status().message().find("9"), std::string::npos) << nowhere.status();
  // Still serving.
  auto ok = session_->Reshard(*x, Placement::Device(1));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE(session_->Fetch(*ok).ok());
}

// MPMD from the C++ SDK: two dependent regions on {0, 1} and {2, 3} and an
// unrelated one, checked against naive loops; the plan lists the one value
// that crosses, with its bytes.
TEST_F(ShardingTest, MeshRegionsFormOneMpmdProgram) {
  const Mesh a({{"d", 2}}, {0, 1}), b({{"d", 2}}, {2, 3});
  const Sharding rows = Sharding::Split({"d", ""}), whole = Sharding::Split({});
  GraphBuilder g("mpmd");
  Value x = g.Parameter({DType::kF32, {8, 4}}, "x");
  Value z = g.Parameter({DType::kF32, {6}}, "z");
  auto h = g.MeshRegion(
      a, {x}, {rows}, {rows},
      [](GraphBuilder& r, const std::vector<Value>& in) {
        return std::vector<Value>{r.Tanh(in[0])};
      },
      "stage0");
  ASSERT_EQ(h.size(), 1u) << g.status();
  auto y = g.MeshRegion(
      b, {h[0]}, {rows}, {rows},
      [](GraphBuilder& r, const std::vector<Value>& in) {
        return std::vector<Value>{r.Mul(in[0], in[0])};
      },
      "stage1");
  auto u = g.MeshRegion(
      b, {z}, {whole}, {whole},
      [](GraphBuilder& r, const std::vector<Value>& in) {
        return std::vector<Value>{r.Neg(in[0])};
      },
      "apart");
  auto graph = g.Build({y[0], u[0]});
  ASSERT_TRUE(graph.ok()) << graph.status();
  auto exe = session_->Compile(*graph);
  ASSERT_TRUE(exe.ok()) << exe.status();
  EXPECT_NE(exe->plan().find("part 0 'stage0' on {d: 2} over devices 0,1"), std::string::npos)
      << exe->plan();
  EXPECT_NE(exe->plan().find("f32[8,4], 128 bytes cross devices: result 0 of part 0 'stage0'"),
            std::string::npos)
      << exe->plan();
  HostArray hx = Random({8, 4}, 31), hz = Random({6}, 32);
  auto xa = session_->Put(hx, Placement::Sharded(a, rows));
  auto za = session_->Put(hz, Placement::Sharded(b, whole));
  ASSERT_TRUE(xa.ok() && za.ok());
  auto outs = session_->Execute(*exe, {*xa, *za}, {.wait = true});
  ASSERT_TRUE(outs.ok()) << outs.status();
  auto got = session_->Fetch((*outs)[0]);
  auto neg = session_->Fetch((*outs)[1]);
  ASSERT_TRUE(got.ok() && neg.ok());
  for (int i = 0; i < 32; ++i) {
    const float t = std::tanh(hx.as<float>()[i]);
    EXPECT_NEAR(got->as<float>()[i], t * t, 1e-6) << i;
  }
  for (int i = 0; i < 6; ++i) EXPECT_EQ(neg->as<float>()[i], -hz.as<float>()[i]);
  auto info = session_->Info((*outs)[0]);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->devices, (std::vector<int>{2, 3}));

  // Anything outside a region is refused, naming it.
  GraphBuilder bad("mpmd_bad");
  Value p = bad.Parameter({DType::kF32, {8, 4}}, "p");
  auto r = bad.MeshRegion(
      a, {p}, {rows}, {rows},
      [](GraphBuilder& q, const std::vector<Value>& in) {
        return std::vector<Value>{q.Neg(in[0])};
      },
      "only");
  auto outside = bad.Build({bad.Neg(r[0])});
  ASSERT_TRUE(outside.ok()) << outside.status();
  auto refused = session_->Compile(*outside);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("stands outside every mesh region"), std::string::npos)
      << refused.status();
}

std::string RunCommand(const std::string& cmd, int* rc) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  std::string out;
  if (f == nullptr) return out;
  char buf[512];
  while (fgets(buf, sizeof buf, f)) out += buf;
  *rc = pclose(f);
  return out;
}

TEST_F(ShardingTest, CliCompilesAndRunsPartitioned) {
  const std::string graph = std::string(TESSEL_SOURCE_DIR) + "/examples/graphs/dense.textproto";
  const std::string tessel =
      "TESSEL_COORDINATOR=" + cluster_->address() + " " + TESSEL_BIN_DIR + "/tessel";
  const std::string flags =
      " --mesh data=2,model=2 --shard x=\"P('data', 'model')\" --shard w=\"P('model', None)\"";
  int rc = -1;
  std::string out = RunCommand(tessel + " compile " + graph + flags, &rc);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("collectives: 2, 100 bytes received per device"), std::string::npos) << out;
  EXPECT_NE(out.find("all_reduce over model"), std::string::npos) << out;
  EXPECT_NE(out.find("the partial result over model must be complete"), std::string::npos) << out;

  const std::string dir = ::testing::TempDir();
  HostArray hx = Random({8, 4}, 8), hw = Random({4, 6}, 9);
  ASSERT_TRUE(WriteNpy(dir + "/x.npy", hx).ok());
  ASSERT_TRUE(WriteNpy(dir + "/w.npy", hw).ok());
  out = RunCommand(tessel + " run " + graph + flags + " --input x=" + dir +
                       "/x.npy --input w=" + dir + "/w.npy --fetch s=" + dir + "/s.npy",
                   &rc);
  ASSERT_EQ(rc, 0) << out;
  auto s = ReadNpy(dir + "/s.npy");
  ASSERT_TRUE(s.ok()) << s.status();
  double want = 0;
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 6; ++j) {
      double acc = 0;
      for (int k = 0; k < 4; ++k)
        acc += double(hx.as<float>()[i * 4 + k]) * hw.as<float>()[k * 6 + j];
      want += std::tanh(acc);
    }
  }
  EXPECT_NEAR(s->as<float>()[0], want, 1e-4);

  out = RunCommand(
      tessel + " compile " + graph + " --mesh data=2,model=2 --shard x=\"P('data', 'modl')\"", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("unknown mesh axis 'modl'"), std::string::npos) << out;
}

TEST_F(ShardingTest, CheckpointWrittenByTheWorkersRestoresOntoAnotherPlacement) {
  const Mesh mesh({{"data", 2}, {"model", 2}});
  HostArray hx = Random({8, 6}, 31);
  auto x = session_->Put(hx, Placement::Sharded(mesh, Sharding::Split({"data", "model"})));
  ASSERT_TRUE(x.ok()) << x.status();
  const std::string dir =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/tessel_cpp_ckpt_", getpid());
  std::filesystem::remove_all(dir);
  auto save = session_->SaveCheckpoint(dir + "/1", {{"x", *x}}, R"({"step": 1})");
  ASSERT_TRUE(save.ok()) << save.status();
  EXPECT_EQ(save->chunks, 4);
  EXPECT_EQ(save->bytes, 8 * 6 * 4);
  ASSERT_TRUE(session_->CommitCheckpoint(*save).ok());
  // Chunk (1, 0) is rows 4..7, columns 0..2 of the array, little-endian,
  // then 4 bytes of CRC32C.
  std::ifstream in(dir + "/1/x/c/1/0", std::ios::binary);
  std::vector<float> chunk(12);
  in.read(reinterpret_cast<char*>(chunk.data()), 48);
  ASSERT_TRUE(in);
  EXPECT_EQ(std::filesystem::file_size(dir + "/1/x/c/1/0"), 52u);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(chunk[i * 3 + j], hx.as<float>()[(4 + i) * 6 + j]);
  // Onto one device of the other worker, and onto a row split over two.
  const Mesh rows({{"x", 2}}, {2, 1});
  for (const Placement& p :
       {Placement::Device(3), Placement::Sharded(rows, Sharding::Split({"x", ""}))}) {
    auto back = session_->RestoreCheckpoint(dir + "/1", {{"x", hx.type(), p}});
    ASSERT_TRUE(back.ok()) << back.status();
    auto got = session_->Fetch((*back)[0]);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bytes(), hx.bytes());
    ASSERT_TRUE(session_->Delete(*back).ok());
  }
  auto wrong = session_->RestoreCheckpoint(
      dir + "/1", {{"x", ArrayType{DType::kF32, {8, 7}}, Placement::Device(0)}});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.status().message().find("saved as float32[8,6]; the target is float32[8,7]"),
            std::string::npos)
      << wrong.status();
  ASSERT_TRUE(session_->Delete({*x}).ok());
  std::filesystem::remove_all(dir);
}

// Orbax's manager semantics, in C++: every second step saved, the two
// latest kept and every fourth; the latest restored by default, any step by
// number; another session's manager on the directory refused while the
// first lives.
TEST_F(ShardingTest, CheckpointManagerSavesKeepsAndRestoresSteps) {
  const std::string dir =
      absl::StrCat(std::filesystem::temp_directory_path().string(), "/tessel_cpp_mgr_", getpid());
  std::filesystem::remove_all(dir);
  const Placement split = Placement::Sharded(mesh_, Sharding::Split({"data", "model"}));
  std::vector<HostArray> states;
  {
    auto manager = CheckpointManager::Open(
        *session_, dir, {.max_to_keep = 2, .save_interval_steps = 2, .keep_period = 4});
    ASSERT_TRUE(manager.ok()) << manager.status();
    auto other = Session::Connect(cluster_->address());
    ASSERT_TRUE(other.ok()) << other.status();
    auto second = CheckpointManager::Open(**other, dir);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition) << second.status();
    for (int step = 0; step <= 8; ++step) {
      states.push_back(Random({8, 6}, 100 + step));
      auto x = session_->Put(states.back(), split);
      ASSERT_TRUE(x.ok()) << x.status();
      auto saved = (*manager)->Save(step, {{"x", *x}});
      ASSERT_TRUE(saved.ok()) << saved.status();
      EXPECT_EQ(*saved, step % 2 == 0) << step;
      ASSERT_TRUE(session_->Delete({*x}).ok());  // the snapshot is taken: the array may go
    }
    ASSERT_TRUE((*manager)->WaitUntilFinished().ok());
    auto steps = (*manager)->AllSteps();
    ASSERT_TRUE(steps.ok()) << steps.status();
    EXPECT_EQ(*steps, (std::vector<int64_t>{0, 4, 6, 8}));  // 2 pruned; 0 and 4 kept by the period
    auto again = (*manager)->Save(8, {});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_FALSE(*again);  // saved already
    const Placement one = Placement::Device(3);
    for (std::optional<int64_t> step : {std::optional<int64_t>{}, std::optional<int64_t>{4}}) {
      auto back = (*manager)->Restore(step, {{"x", states[0].type(), one}});
      ASSERT_TRUE(back.ok()) << back.status();
      auto got = session_->Fetch((*back)[0]);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->bytes(), states[step.value_or(8)].bytes());
      ASSERT_TRUE(session_->Delete(*back).ok());
    }
    // The manifest is the Python SDK's: its step and its leaves by name.
    std::ifstream in(dir + "/8/tessel.json");
    const std::string manifest((std::istreambuf_iterator<char>(in)),
                               std::istreambuf_iterator<char>());
    EXPECT_NE(manifest.find("\"step\": 8"), std::string::npos) << manifest;
    EXPECT_NE(manifest.find("\"keys\": [\"x\"]"), std::string::npos) << manifest;
  }
  // Released with the first: another manager opens and sees the same steps.
  auto reopened = CheckpointManager::Open(*session_, dir);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto latest = (*reopened)->LatestStep();
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, 8);
  auto relative = CheckpointManager::Open(*session_, "ckpts");
  EXPECT_EQ(relative.status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessel

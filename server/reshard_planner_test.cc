// PlanReshard checked by carrying its plan out element by element: every
// device starts with its source block (cut from a global array of distinct
// values by an index loop here), local copies and rounds run as the
// workers would, and each target block must then equal its slice of the
// global array. Rounds are checked to be what one Permute can do.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/dtype.h"
#include "core/sharding.h"
#include "server/reshard_planner.h"

namespace tessel::server {
namespace {

v1::Mesh MakeMesh(std::vector<std::pair<std::string, int>> axes, std::vector<int> devices) {
  v1::Mesh m;
  for (auto& [n, s] : axes) m.add_axis_names(n), m.add_axis_sizes(s);
  for (int d : devices) m.add_devices(d);
  return m;
}

v1::TensorType F32(std::vector<int64_t> dims) {
  v1::TensorType t;
  t.set_dtype(v1::F32);
  for (int64_t d : dims) t.add_dims(d);
  return t;
}

ArrayRecord Sharded(const v1::TensorType& type, const v1::Mesh& mesh,
                    std::vector<std::vector<std::string>> dims) {
  ArrayRecord r;
  r.type = type;
  r.sharded = true;
  r.mesh = mesh;
  for (auto& axes : dims) {
    auto* d = r.sharding.add_dims();
    for (auto& a : axes) d->add_axes(a);
  }
  r.sharding = NormalizeSharding(r.sharding, type.dims_size());
  r.block_type = LocalType(type, r.sharding, mesh);
  r.devices.assign(mesh.devices().begin(), mesh.devices().end());
  return r;
}

ArrayRecord Whole(const v1::TensorType& type, std::vector<int> devices) {
  ArrayRecord r;
  r.type = type;
  r.devices = std::move(devices);
  return r;
}

// Block origin of device `d` in `r`, in global coordinates.
std::vector<int64_t> OriginOf(const ArrayRecord& r, int d) {
  if (!r.sharded) return std::vector<int64_t>(r.type.dims_size(), 0);
  for (int pos = 0; pos < r.mesh.devices_size(); ++pos) {
    if (r.mesh.devices(pos) != d) continue;
    auto idx = BlockIndex(r.sharding, r.mesh, pos);
    for (size_t i = 0; i < idx.size(); ++i) idx[i] *= r.block_type.dims(i);
    return idx;
  }
  return {};
}

// Linear index of `at` (within `dims`).
int64_t Linear(const std::vector<int64_t>& at, const v1::TensorType& t) {
  int64_t k = 0;
  for (int i = 0; i < t.dims_size(); ++i) k = k * t.dims(i) + at[i];
  return k;
}

// Every index of `region`, row-major.
std::vector<std::vector<int64_t>> Indices(const v1::Region& region) {
  std::vector<std::vector<int64_t>> out;
  std::vector<int64_t> at(region.starts().begin(), region.starts().end());
  const int n = region.starts_size();
  for (int i = 0; i < n; ++i) {
    if (region.sizes(i) == 0) return out;
  }
  while (true) {
    out.push_back(at);
    int i = n - 1;
    while (i >= 0 && ++at[i] == region.starts(i) + region.sizes(i)) at[i] = region.starts(i), --i;
    if (i < 0) return out;
  }
}

void CheckCarriedOut(const ArrayRecord& from, const ArrayRecord& to, int64_t want_moved,
                     int64_t want_copied) {
  // Devices 0, 1 on worker a; 2, 3 on worker b.
  auto worker_of = [](int d) { return d < 2 ? std::string("a") : std::string("b"); };
  auto plan = PlanReshard(from, to, worker_of);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const v1::TensorType sb = from.sharded ? from.block_type : from.type,
                       tb = to.sharded ? to.block_type : to.type;
  auto global_value = [&](const std::vector<int64_t>& at) {
    return float(Linear(at, from.type) + 1);
  };
  // Source blocks, by device.
  std::map<int, std::vector<float>> src, dst;
  for (int d : from.devices) {
    std::vector<float>& b = src[d];
    b.resize(ByteSizeUnchecked(sb) / 4);
    const auto o = OriginOf(from, d);
    v1::Region whole;
    for (int i = 0; i < sb.dims_size(); ++i) whole.add_starts(0), whole.add_sizes(sb.dims(i));
    for (auto at : Indices(whole)) {
      const int64_t k = Linear(at, sb);
      for (size_t i = 0; i < at.size(); ++i) at[i] += o[i];
      b[k] = global_value(at);
    }
  }
  std::map<int, const v1::Transfer*> by_device;
  for (const auto& st : plan->steps) {
    by_device[st.device] = &st.transfer;
    if (st.makes_target) dst[st.device].assign(ByteSizeUnchecked(tb) / 4, -1.f);
    if (st.reads_source) {
      EXPECT_TRUE(src.contains(st.device)) << st.device;
    }
  }
  auto copy = [&](int s, const v1::Region& f, int t, const v1::Region& r) {
    auto a = Indices(f), b = Indices(r);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      dst.at(t).at(Linear(b[i], tb)) = src.at(s).at(Linear(a[i], sb));
  };
  int64_t moved = 0, copied = 0;
  std::optional<int> rounds;
  for (const auto& [d, tr] : by_device) {
    for (const auto& p : tr->pieces()) {
      if (p.round() >= 0) continue;
      copy(d, p.from(), d, p.to());
      copied += Indices(p.to()).size() * 4;
    }
    if (tr->rank() < 0) continue;
    // Every rank carries the same rounds.
    if (!rounds) rounds = tr->rounds();
    EXPECT_EQ(*rounds, tr->rounds());
  }
  // Rounds, from any rank's copy of the plan.
  for (const auto& [d, tr] : by_device) {
    if (tr->rank() < 0) continue;
    for (int r = 0; r < tr->rounds(); ++r) {
      std::set<int> targets;
      std::map<int, std::string> sends;
      int64_t size = -1;
      for (const auto& p : tr->pieces()) {
        if (p.round() != r) continue;
        EXPECT_TRUE(targets.insert(p.target()).second)
            << "round " << r << " targets rank " << p.target() << " twice";
        auto [it, fresh] = sends.try_emplace(p.source(), p.from().ShortDebugString());
        EXPECT_EQ(it->second, p.from().ShortDebugString())
            << "rank " << p.source() << " sends two regions";
        const int64_t n = Indices(p.from()).size();
        if (size >= 0) {
          EXPECT_EQ(size, n);
        }
        size = n;
        copy(tr->rank_devices(p.source()), p.from(), tr->rank_devices(p.target()), p.to());
        moved += n * 4;
      }
    }
    break;
  }
  EXPECT_EQ(moved, plan->bytes_moved);
  EXPECT_EQ(copied, plan->bytes_copied);
  EXPECT_EQ(moved, want_moved);
  EXPECT_EQ(copied, want_copied);
  for (int d : to.devices) {
    const auto o = OriginOf(to, d);
    v1::Region whole;
    for (int i = 0; i < tb.dims_size(); ++i) whole.add_starts(0), whole.add_sizes(tb.dims(i));
    for (auto at : Indices(whole)) {
      const float got = dst.at(d).at(Linear(at, tb));
      for (size_t i = 0; i < at.size(); ++i) at[i] += o[i];
      ASSERT_EQ(got, global_value(at)) << "device " << d;
    }
  }
}

TEST(PlanReshard, SameBlocksOnOtherDevicesMoveWhole) {
  const auto t = F32({8, 6});
  CheckCarriedOut(Sharded(t, MakeMesh({{"x", 2}}, {0, 1}), {{"x"}}),
                  Sharded(t, MakeMesh({{"x", 2}}, {2, 3}), {{"x"}}), 192, 0);
}

TEST(PlanReshard, RowsToColumnsCutStridedPiecesAndKeepWhatIsLocal) {
  const auto t = F32({8, 6});
  CheckCarriedOut(Sharded(t, MakeMesh({{"x", 2}}, {0, 1}), {{"x"}}),
                  Sharded(t, MakeMesh({{"x", 2}}, {1, 2}), {{}, {"x"}}), 144, 48);
}

TEST(PlanReshard, TwoDimensionalMeshesWithCopiesAndOtherDeviceOrders) {
  const auto t = F32({4, 8, 2});
  const auto grid = MakeMesh({{"data", 2}, {"model", 2}}, {0, 1, 2, 3});
  const auto flipped = MakeMesh({{"data", 2}, {"model", 2}}, {3, 2, 1, 0});
  // P('data') holds copies over model; to P(None, ('model', 'data')).
  CheckCarriedOut(Sharded(t, grid, {{"data"}}), Sharded(t, flipped, {{}, {"model", "data"}}), 128,
                  128);
  CheckCarriedOut(Sharded(t, flipped, {{"model"}, {"data"}}), Whole(t, {1}), 3 * 64, 64);
  CheckCarriedOut(Whole(t, {2}), Sharded(t, grid, {{"data"}, {"model"}}), 3 * 64, 64);
  CheckCarriedOut(Sharded(t, grid, {{"data"}, {"model"}}), Whole(t, {0, 1, 2, 3}), 4 * 192, 4 * 64);
}

// One-way: every device only sends or only receives (a pipeline's stages on
// disjoint sub-meshes); its steps say so, so senders can go ahead.
TEST(PlanReshard, MovesBetweenDisjointDevicesAreOneWayAndOnlyThose) {
  const auto t = F32({8, 6});
  auto worker_of = [](int d) { return "w" + std::to_string(d / 2); };
  auto plan = PlanReshard(Sharded(t, MakeMesh({{"x", 2}}, {0, 1}), {{"x"}}),
                          Sharded(t, MakeMesh({{"x", 2}}, {2, 3}), {{}, {"x"}}), worker_of);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->one_way);
  for (const auto& st : plan->steps) {
    EXPECT_NE(st.reads_source, st.makes_target) << "device " << st.device;
    EXPECT_TRUE(st.transfer.one_way()) << "device " << st.device;
  }
  // Devices 0 and 1 swap their blocks: each sends and receives.
  plan = PlanReshard(Sharded(t, MakeMesh({{"x", 2}}, {0, 1}), {{"x"}}),
                     Sharded(t, MakeMesh({{"x", 2}}, {1, 0}), {{"x"}}), worker_of);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->one_way);
  for (const auto& st : plan->steps) EXPECT_FALSE(st.transfer.one_way()) << "device " << st.device;
  // Nothing crosses devices: nothing to send ahead.
  plan = PlanReshard(Whole(t, {0}), Whole(t, {0}), worker_of);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->one_way);
}

TEST(PlanReshard, RefusesPartialShardingsAndOtherTypes) {
  const auto t = F32({8, 6});
  auto p = Sharded(t, MakeMesh({{"x", 2}}, {0, 1}), {{"x"}});
  p.sharding.add_partial("x");
  auto worker_of = [](int) { return std::string("a"); };
  EXPECT_EQ(PlanReshard(p, Whole(t, {0}), worker_of).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto other = PlanReshard(Whole(t, {0}), Whole(F32({6, 8}), {1}), worker_of);
  EXPECT_NE(other.status().message().find("f32[6,8]"), std::string::npos) << other.status();
}

}  // namespace
}  // namespace tessel::server

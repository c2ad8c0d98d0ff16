#include "server/reshard_planner.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"

namespace tessel::server {

namespace {

struct Block {
  std::vector<int64_t> origin, sizes;  // in the global array
};

// The block each of the record's devices holds.
std::vector<std::pair<int, Block>> BlocksOf(const ArrayRecord& r) {
  std::vector<std::pair<int, Block>> out;
  if (!r.sharded) {
    Block whole{std::vector<int64_t>(r.type.dims_size(), 0),
                {r.type.dims().begin(), r.type.dims().end()}};
    for (int d : r.devices) out.emplace_back(d, whole);
    return out;
  }
  for (int pos = 0; pos < r.mesh.devices_size(); ++pos) {
    const std::vector<int64_t> idx = BlockIndex(r.sharding, r.mesh, pos);
    Block b;
    for (int i = 0; i < r.block_type.dims_size(); ++i) {
      b.sizes.push_back(r.block_type.dims(i));
      b.origin.push_back(idx[i] * r.block_type.dims(i));
    }
    out.emplace_back(r.mesh.devices(pos), std::move(b));
  }
  return out;
}

v1::TensorType BlockTypeOf(const ArrayRecord& r) { return r.sharded ? r.block_type : r.type; }

struct Piece {
  int source_device = 0, target_device = 0;
  std::vector<int64_t> origin, sizes;  // of the overlap, in the global array
  v1::Region from, to;
  int64_t bytes = 0;
  int round = -1;
};

v1::Region RegionWithin(const Piece& p, const Block& b) {
  v1::Region r;
  for (size_t i = 0; i < p.origin.size(); ++i) {
    r.add_starts(p.origin[i] - b.origin[i]);
    r.add_sizes(p.sizes[i]);
  }
  return r;
}

}  // namespace

absl::StatusOr<ReshardPlan> PlanReshard(const ArrayRecord& from, const ArrayRecord& to,
                                        const std::function<std::string(int)>& worker_of) {
  if (!SameType(from.type, to.type)) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: the target is ", TypeString(to.type),
                                                   ", the source ", TypeString(from.type)));
  }
  if ((from.sharded && IsPartial(from.sharding)) || (to.sharded && IsPartial(to.sharding))) {
    return absl::InvalidArgumentError(
        "reshard: a partial sharding holds unreduced values; reduce it first");
  }
  const int64_t esize = DTypeSize(from.type.dtype());
  const std::vector<std::pair<int, Block>> sources = BlocksOf(from), targets = BlocksOf(to);
  // Source regions, each with every device holding it.
  std::map<std::vector<int64_t>, std::pair<Block, std::vector<int>>> source_regions;
  for (const auto& [d, b] : sources) {
    auto& entry = source_regions[b.origin];
    entry.first = b;
    entry.second.push_back(d);
  }

  ReshardPlan plan;
  std::vector<Piece> pieces;
  absl::flat_hash_map<int, int64_t> sending;  // device -> bytes it sends so far
  for (const auto& [t, tb] : targets) {
    for (const auto& [origin, entry] : source_regions) {
      const Block& sb = entry.first;
      Piece p;
      p.target_device = t;
      p.bytes = esize;
      for (size_t i = 0; i < tb.origin.size(); ++i) {
        const int64_t lo = std::max(tb.origin[i], sb.origin[i]);
        const int64_t hi = std::min(tb.origin[i] + tb.sizes[i], sb.origin[i] + sb.sizes[i]);
        p.origin.push_back(lo);
        p.sizes.push_back(std::max<int64_t>(hi - lo, 0));
        p.bytes *= p.sizes.back();
      }
      if (p.bytes == 0) continue;
      const std::vector<int>& holders = entry.second;
      int pick = -1;
      if (std::find(holders.begin(), holders.end(), t) != holders.end()) {
        pick = t;
      } else {
        for (int h : holders) {
          if (worker_of(h) == worker_of(t) && (pick < 0 || sending[h] < sending[pick])) pick = h;
        }
        if (pick < 0) {
          for (int h : holders) {
            if (pick < 0 || sending[h] < sending[pick]) pick = h;
          }
        }
        sending[pick] += p.bytes;
      }
      p.source_device = pick;
      p.from = RegionWithin(p, sb);
      p.to = RegionWithin(p, tb);
      pieces.push_back(std::move(p));
    }
  }
  // The group: every device a piece crosses from or to, by id.
  std::set<int> members;
  for (const Piece& p : pieces) {
    if (p.source_device != p.target_device)
      members.insert(p.source_device), members.insert(p.target_device);
  }
  const std::vector<int> ranks(members.begin(), members.end());
  auto rank_of = [&](int d) {
    return int(std::lower_bound(ranks.begin(), ranks.end(), d) - ranks.begin());
  };
  // Rounds: a piece joins the first round of its size where its target
  // receives nothing yet and its source sends nothing or the same region.
  struct Round {
    int64_t bytes;
    std::set<int> targets;
    std::map<int, std::vector<int64_t>> sends;  // source device -> the global origin it sends
  };
  std::vector<Round> rounds;
  for (Piece& p : pieces) {
    if (p.source_device == p.target_device) continue;
    for (size_t r = 0; r <= rounds.size() && p.round < 0; ++r) {
      if (r == rounds.size()) rounds.push_back(Round{p.bytes, {}, {}});
      Round& rd = rounds[r];
      auto s = rd.sends.find(p.source_device);
      if (rd.bytes != p.bytes || rd.targets.contains(p.target_device) ||
          (s != rd.sends.end() && s->second != p.origin)) {
        continue;
      }
      rd.targets.insert(p.target_device);
      rd.sends[p.source_device] = p.origin;
      p.round = int(r);
    }
  }
  // One step per device that reads a source block for a piece (a piece's
  // source is always a holder) or makes a target block.
  std::set<int> readers, makers;
  for (const Piece& p : pieces) readers.insert(p.source_device);
  for (const auto& [d, b] : targets) makers.insert(d);
  std::set<int> step_devices = readers;
  step_devices.insert(makers.begin(), makers.end());
  for (int d : step_devices) {
    ReshardPlan::Step st;
    st.device = d;
    st.reads_source = readers.contains(d);
    st.makes_target = makers.contains(d);
    v1::Transfer& tr = st.transfer;
    *tr.mutable_source_block() = BlockTypeOf(from);
    *tr.mutable_target_block() = BlockTypeOf(to);
    tr.set_rank(members.contains(d) ? rank_of(d) : -1);
    tr.set_rounds(members.contains(d) ? int(rounds.size()) : 0);
    if (members.contains(d)) {
      for (int m : ranks) {
        tr.add_rank_devices(m);
        tr.add_rank_workers(worker_of(m));
      }
    }
    for (const Piece& p : pieces) {
      const bool local = p.source_device == p.target_device;
      if (local ? p.target_device != d : !members.contains(d)) continue;
      v1::TransferPiece* tp = tr.add_pieces();
      tp->set_round(p.round);
      if (!local) {
        tp->set_source(rank_of(p.source_device));
        tp->set_target(rank_of(p.target_device));
      }
      *tp->mutable_from() = p.from;
      *tp->mutable_to() = p.to;
    }
    plan.steps.push_back(std::move(st));
  }
  plan.one_way = !rounds.empty() && !plan.steps.empty();
  for (const ReshardPlan::Step& st : plan.steps) {
    if (st.reads_source == st.makes_target) plan.one_way = false;
  }
  if (plan.one_way) {
    for (ReshardPlan::Step& st : plan.steps) st.transfer.set_one_way(true);
  }
  for (const Piece& p : pieces) {
    if (p.source_device == p.target_device) {
      plan.bytes_copied += p.bytes;
      continue;
    }
    plan.bytes_moved += p.bytes;
    plan.received[p.target_device] += p.bytes;
    std::vector<std::string> dims;
    for (size_t i = 0; i < p.origin.size(); ++i)
      dims.push_back(absl::StrCat(p.origin[i], ":", p.origin[i] + p.sizes[i]));
    plan.pieces.push_back(absl::StrCat("device ", p.source_device, " -> device ", p.target_device,
                                       ": [", absl::StrJoin(dims, ", "), "] of ",
                                       TypeString(from.type), " (", p.bytes, " bytes)"));
  }
  return plan;
}

}  // namespace tessel::server

#include "scheduler/combine_collectives.h"

#include <algorithm>
#include <queue>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"

namespace tessel::scheduler {
namespace {

using absl::StrCat;

struct Group {
  std::string key;             // axes, reduction, dtype
  std::vector<int> members;    // node positions, in order
  std::vector<uint64_t> bits;  // the members, as candidate bits
  int64_t bytes = 0;
  bool open = true;
};

bool Intersects(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  for (size_t w = 0; w < a.size(); ++w)
    if (a[w] & b[w]) return true;
  return false;
}

v1::TensorType Flat(v1::DType dt, int64_t n) {
  v1::TensorType t;
  t.set_dtype(dt);
  t.add_dims(n);
  return t;
}

}  // namespace

int CombineAllReduces(v1::Graph& local, std::vector<PlannedCollective>& collectives,
                      const v1::Mesh& mesh, int64_t max_bytes) {
  absl::flat_hash_map<std::string, int> record_of;
  for (size_t i = 0; i < collectives.size(); ++i) {
    if (collectives[i].op == v1::ALL_REDUCE) record_of[collectives[i].value] = int(i);
  }
  const int n = local.nodes_size();
  absl::flat_hash_map<std::string, int> pos;
  std::vector<int> candidate(n, -1);
  int count = 0;
  for (int p = 0; p < n; ++p) {
    const v1::Node& node = local.nodes(p);
    pos[node.name()] = p;
    if (node.op() == v1::ALL_REDUCE && record_of.contains(node.name()) &&
        node.operands_size() == 1) {
      candidate[p] = count++;
    }
  }
  if (count < 2) return 0;
  // Which candidates each node needs, itself included: a group never holds
  // one that needs another, and a candidate that needs a group's member
  // closes that group (so the combined all_reduces stay in a partial
  // order: each needs only groups closed before it).
  const size_t words = (count + 63) / 64;
  std::vector<std::vector<uint64_t>> needs(n, std::vector<uint64_t>(words, 0));
  std::vector<Group> groups;
  for (int p = 0; p < n; ++p) {
    const v1::Node& node = local.nodes(p);
    for (const std::string& o : node.operands()) {
      auto it = pos.find(o);
      if (it == pos.end() || it->second >= p) continue;
      for (size_t w = 0; w < words; ++w) needs[p][w] |= needs[it->second][w];
    }
    const int c = candidate[p];
    if (c < 0) continue;
    for (Group& g : groups) g.open = g.open && !Intersects(needs[p], g.bits);
    needs[p][c / 64] |= uint64_t{1} << (c % 64);
    const int64_t bytes = ByteSizeUnchecked(node.type());
    std::string key = StrCat(absl::StrJoin(node.collective().axes(), ","), "|",
                             int(node.collective().kind()), "|", int(node.type().dtype()));
    auto g = std::find_if(groups.begin(), groups.end(), [&](const Group& g) {
      return g.open && g.key == key && g.bytes + bytes <= max_bytes;
    });
    if (g == groups.end()) {
      groups.push_back({std::move(key), {}, std::vector<uint64_t>(words, 0), 0, true});
      g = groups.end() - 1;
    }
    g->members.push_back(p);
    g->bits[c / 64] |= uint64_t{1} << (c % 64);
    g->bytes += bytes;
  }

  // Rewrite: each member of a group becomes a reshape of its slice of the
  // combined result, under its own name; the new nodes go after the
  // group's last member, and a stable topological sort puts every
  // consumer after what it reads.
  absl::flat_hash_set<std::string> used;
  for (const v1::Node& node : local.nodes()) used.insert(node.name());
  auto fresh = [&](const std::string& base) {
    std::string name = base;
    for (int k = 1; !used.insert(name).second; ++k) name = StrCat(base, ".", k);
    return name;
  };
  std::vector<v1::Node> nodes(local.nodes().begin(), local.nodes().end());
  std::vector<std::pair<int, int>> order(n);  // sort keys: (position, sequence)
  for (int p = 0; p < n; ++p) order[p] = {p, 0};
  absl::flat_hash_set<std::string> combined_away;
  std::vector<std::pair<int, PlannedCollective>> records;  // (first member's record, combined)
  int removed = 0;
  for (const Group& g : groups) {
    if (g.members.size() < 2) continue;
    const int last = g.members.back();
    int seq = 0;
    auto add = [&](v1::Node node) {
      nodes.push_back(std::move(node));
      order.push_back({last, ++seq});
      return nodes.back().name();
    };
    const v1::Node& first = local.nodes(g.members.front());
    const v1::DType dt = first.type().dtype();
    v1::Node concat;
    concat.set_name(fresh(StrCat(first.name(), ".combined_operands")));
    concat.set_op(v1::CONCATENATE);
    concat.mutable_concatenate()->set_dimension(0);
    std::vector<int64_t> sizes;
    int64_t total = 0;
    std::vector<std::string> names;
    for (int m : g.members) {
      const v1::Node& member = local.nodes(m);
      const int64_t size = NumElementsUnchecked(member.type());
      v1::Node flat;
      flat.set_name(fresh(StrCat(member.name(), ".flat")));
      flat.set_op(v1::RESHAPE);
      flat.mutable_reshape()->add_dims(size);
      flat.add_operands(member.operands(0));
      *flat.mutable_type() = Flat(dt, size);
      concat.add_operands(add(std::move(flat)));
      sizes.push_back(size);
      total += size;
      names.push_back(member.name());
    }
    *concat.mutable_type() = Flat(dt, total);
    const std::string operands = add(std::move(concat));
    v1::Node reduce = first;
    reduce.set_name(fresh(StrCat(first.name(), ".combined")));
    reduce.clear_operands();
    reduce.add_operands(operands);
    *reduce.mutable_type() = Flat(dt, total);
    const std::string listed = names.size() <= 4
                                   ? absl::StrJoin(names, "', '")
                                   : StrCat(absl::StrJoin(names.begin(), names.begin() + 3, "', '"),
                                            "', ... '", names.back());
    const std::string why =
        StrCat("one all_reduce for ", names.size(), " values ('", listed,
               "'), each of which needed one: ", collectives[record_of.at(first.name())].reason);
    reduce.mutable_collective()->set_reason(why);
    const std::string combined = add(reduce);
    int64_t offset = 0;
    for (size_t k = 0; k < g.members.size(); ++k) {
      v1::Node slice;
      slice.set_name(fresh(StrCat(names[k], ".part")));
      slice.set_op(v1::SLICE);
      slice.mutable_slice()->add_start(offset);
      slice.mutable_slice()->add_limit(offset + sizes[k]);
      slice.mutable_slice()->add_strides(1);
      slice.add_operands(combined);
      *slice.mutable_type() = Flat(dt, sizes[k]);
      offset += sizes[k];
      const std::string part = add(std::move(slice));
      v1::Node& member = nodes[g.members[k]];  // keeps its name and type
      const v1::TensorType type = member.type();
      member.Clear();
      member.set_name(names[k]);
      member.set_op(v1::RESHAPE);
      member.mutable_reshape();  // a scalar's has no dims
      for (int64_t d : type.dims()) member.mutable_reshape()->add_dims(d);
      member.add_operands(part);
      *member.mutable_type() = type;
      combined_away.insert(names[k]);
    }
    records.emplace_back(
        record_of.at(first.name()),
        PlanCollective(mesh, combined, v1::ALL_REDUCE,
                       {first.collective().axes().begin(), first.collective().axes().end()},
                       Flat(dt, total), Flat(dt, total), why));
    removed += int(g.members.size()) - 1;
  }
  if (removed == 0) return 0;

  // Stable topological sort by (position, sequence).
  absl::flat_hash_map<std::string, int> index;
  for (size_t i = 0; i < nodes.size(); ++i) index[nodes[i].name()] = int(i);
  std::vector<std::vector<int>> users(nodes.size());
  std::vector<int> waiting(nodes.size(), 0);
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const std::string& o : nodes[i].operands()) {
      auto it = index.find(o);
      if (it == index.end()) continue;
      users[it->second].push_back(int(i));
      ++waiting[i];
    }
  }
  using Key = std::tuple<int, int, int>;
  std::priority_queue<Key, std::vector<Key>, std::greater<Key>> ready;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (waiting[i] == 0) ready.push({order[i].first, order[i].second, int(i)});
  }
  google::protobuf::RepeatedPtrField<v1::Node> sorted;
  while (!ready.empty()) {
    const int i = std::get<2>(ready.top());
    ready.pop();
    *sorted.Add() = nodes[i];
    for (int u : users[i]) {
      if (--waiting[u] == 0) ready.push({order[u].first, order[u].second, u});
    }
  }
  if (sorted.size() != int(nodes.size()))
    return 0;  // a cycle: cannot happen (see above); keep the graph
  *local.mutable_nodes() = std::move(sorted);

  // The plan's records: each group's members' records give way to one.
  std::vector<PlannedCollective> kept;
  for (size_t i = 0; i < collectives.size(); ++i) {
    for (auto& [at, r] : records) {
      if (at == int(i)) kept.push_back(r);
    }
    if (collectives[i].op == v1::ALL_REDUCE && combined_away.contains(collectives[i].value))
      continue;
    kept.push_back(std::move(collectives[i]));
  }
  collectives = std::move(kept);
  return removed;
}

}  // namespace tessel::scheduler

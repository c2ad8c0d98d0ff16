#include "worker/collectives/layout.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessel::worker {

std::string GroupLayout::RankName(int rank) const {
  if (rank >= 0 && rank < int(rank_devices.size()))
    return absl::StrCat("device ", rank_devices[rank]);
  return absl::StrCat("rank ", rank);
}

std::string GroupLayout::RankNames(const std::vector<int>& ranks) const {
  return absl::StrJoin(ranks, ", ", [&](std::string* out, int r) { out->append(RankName(r)); });
}

std::string GroupLayout::WorkerDevices(int worker) const {
  return absl::StrCat("worker '", workers[worker], "' (", RankNames(worker_ranks[worker]), ")");
}

std::string GroupLayout::Describe(const CollectiveCall& c) const {
  return absl::StrCat("group '", key, "' ", DescribeCall(c));
}

absl::StatusOr<GroupLayout> MakeLayout(const GroupSpec& spec, const std::string& self) {
  GroupLayout l;
  l.key = spec.key;
  l.rank_workers = spec.rank_workers;
  if (spec.rank_devices.size() == spec.rank_workers.size()) l.rank_devices = spec.rank_devices;
  if (spec.key.empty()) return absl::InvalidArgumentError("collective group: empty key");
  if (spec.rank_workers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("collective group '", spec.key, "': no ranks"));
  }
  absl::flat_hash_map<std::string, int> index;
  for (int r = 0; r < l.size(); ++r) {
    auto [it, added] = index.try_emplace(spec.rank_workers[r], l.workers.size());
    if (added) {
      l.workers.push_back(spec.rank_workers[r]);
      l.worker_ranks.emplace_back();
    }
    l.worker_of_rank.push_back(it->second);
    l.worker_ranks[it->second].push_back(r);
  }
  auto self_it = index.find(self);
  if (self_it == index.end()) {
    return absl::InvalidArgumentError(absl::StrCat("collective group '", spec.key, "': worker '",
                                                   self,
                                                   "' holds none of its ranks (rank workers: [",
                                                   absl::StrJoin(spec.rank_workers, ", "), "])"));
  }
  l.self_worker = self_it->second;
  l.local_ranks = l.worker_ranks[l.self_worker];
  l.local_index.assign(l.size(), -1);
  for (int i = 0; i < l.num_local(); ++i) l.local_index[l.local_ranks[i]] = i;
  l.grouped_pos.resize(l.size());
  int pos = 0;
  for (const auto& ranks : l.worker_ranks) {
    for (int r : ranks) {
      l.grouped_pos[r] = pos;
      if (r != pos) l.worker_major = false;
      ++pos;
    }
  }
  return l;
}

}  // namespace tessel::worker

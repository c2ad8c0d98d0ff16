// A group's ranks as one worker sees them: which worker holds each rank,
// which ranks are local, and where each rank's block sits when blocks are
// listed worker by worker. Also how the group names its ranks, workers and
// calls in errors.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/collectives/call.h"
#include "worker/communicator.h"

namespace tessel::worker {

// Constant after MakeLayout.
struct GroupLayout {
  std::string key;
  std::vector<std::string> rank_workers;
  std::vector<int> rank_devices;               // empty, or one cluster-wide device id per rank
  std::vector<std::string> workers;            // distinct, by first appearance
  int self_worker = -1;                        // index into `workers`
  std::vector<int> worker_of_rank;             // rank -> index into `workers`
  std::vector<std::vector<int>> worker_ranks;  // worker -> its ranks, ascending
  std::vector<int> local_ranks;                // == worker_ranks[self_worker]
  std::vector<int> local_index;                // rank -> index into local_ranks, or -1
  // Position of each rank when the ranks are listed worker by worker (the
  // order of Gloo's allgatherv); `worker_major` when that is rank order.
  std::vector<int> grouped_pos;
  bool worker_major = true;

  int size() const { return rank_workers.size(); }
  int num_workers() const { return workers.size(); }
  int num_local() const { return local_ranks.size(); }

  // "device 3" when the group knows its devices, else "rank 1".
  std::string RankName(int rank) const;
  // "device 3, device 4".
  std::string RankNames(const std::vector<int>& ranks) const;
  // "worker 'host:1' (device 0, device 1)".
  std::string WorkerDevices(int worker) const;
  // "group 'key' all_reduce(f32[4], sum)".
  std::string Describe(const CollectiveCall& c) const;
};

// The layout of `spec` as worker `self` sees it; INVALID_ARGUMENT for an
// empty key, no ranks, or a worker that holds none of the ranks.
absl::StatusOr<GroupLayout> MakeLayout(const GroupSpec& spec, const std::string& self);

}  // namespace tessel::worker

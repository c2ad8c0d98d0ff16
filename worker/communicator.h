// The collective seam: how the devices of a mesh exchange data. Programs call
// collectives as steps ordered with their kernels.
//
// A Communicator serves one group of devices, ranks 0..size()-1. Several
// ranks may live in this process (devices of one worker exchange through
// memory); the rest are reached through a backend (Gloo over TCP between
// worker processes; NCCL on GPUs). Each local rank calls every collective
// once, from its own device's thread, and all ranks of the group call the
// same collectives in the same order. A call returns when this rank's
// result is complete. A peer that never arrives is an error after the
// group's timeout (DEADLINE_EXCEEDED), never a hang.
//
// Identity: every call names the collective it is (CollectiveId: the
// execution and the op within its program). Ranks meet only under the same
// id, so a rank can never pair with another step's collective. A rank whose
// step failed before one of its collectives calls Abandon for it (and for
// every later collective of that step): its peers then fail that collective
// promptly (ABORTED, naming the execution, the op and the failed device)
// instead of waiting, and the group stays usable for the next step.
//
// Layouts: `count` is elements per rank-block; blocks are rank-major.
// Apart from AllReduce (in place), `in` and `out` must not overlap.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/status.h"
#include "tessel/v1/ir.pb.h"

namespace gloo::rendezvous {
class Store;
}

namespace tessel::worker {

enum class ReduceOp { kSum, kProd, kMax, kMin };

inline const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

// Which collective of which step: the key the ranks of a group meet under.
struct CollectiveId {
  int64_t execution = 0;  // the coordinator's execution id
  int32_t op = 0;         // the collective's instruction index in its program
  uint64_t scope = 0;     // 0, or the function call and loop iteration it runs in

  friend bool operator==(const CollectiveId&, const CollectiveId&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const CollectiveId& id) {
    return H::combine(std::move(h), id.execution, id.op, id.scope);
  }
  std::string ToString() const {
    return "execution " + std::to_string(execution) + ", op " + std::to_string(op) +
           (scope == 0 ? "" : ", scope " + std::to_string(scope));
  }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int size() const = 0;
  // Ranks of this group that live in this process, ascending.
  virtual const std::vector<int>& local_ranks() const = 0;

  // In place over `count` elements.
  virtual absl::Status AllReduce(int rank, const CollectiveId& id, void* data, int64_t count,
                                 v1::DType dtype, ReduceOp op) = 0;
  // `in`: count elements; `out`: size()*count, block r from rank r.
  virtual absl::Status AllGather(int rank, const CollectiveId& id, const void* in, void* out,
                                 int64_t count, v1::DType dtype) = 0;
  // `in`: size()*count; `out`: count, the reduction of block `rank` over all ranks.
  virtual absl::Status ReduceScatter(int rank, const CollectiveId& id, const void* in, void* out,
                                     int64_t count, v1::DType dtype, ReduceOp op) = 0;
  // `in`: size()*count, block j goes to rank j; `out`: size()*count, block i came from rank i.
  virtual absl::Status AllToAll(int rank, const CollectiveId& id, const void* in, void* out,
                                int64_t count, v1::DType dtype) = 0;
  // Each (source, target) pair sends source's `in` (count elements) to target's `out`.
  // Targets appear at most once; a rank no pair targets gets zeros. `in`
  // may be null on a rank that is no pair's source, `out` on one no pair
  // targets.
  virtual absl::Status Permute(int rank, const CollectiveId& id, const void* in, void* out,
                               int64_t count, v1::DType dtype,
                               const std::vector<std::pair<int, int>>& pairs) = 0;
  // This rank will not take part in collective `id`: its step failed with
  // `cause` before reaching it. Returns once the group has learnt so.
  virtual absl::Status Abandon(int rank, const CollectiveId& id, const absl::Status& cause) = 0;
};

// A group: for each rank, the address of the worker process that holds it.
// `key` names the group uniquely in the cluster (the same on every worker);
// it scopes the rendezvous keys, and carries the group's epoch, so a group
// broken by a failure is replaced by a fresh one under a new key.
struct GroupSpec {
  std::string key;
  std::vector<std::string> rank_workers;
  // The cluster-wide device id of each rank, for error messages. Default:
  // empty (errors then speak of ranks).
  std::vector<int> rank_devices;
};

// Communicators of one worker process, created on first use and kept while
// their epoch is current. A key "<devices>@<incarnation>.<epoch>" (as
// ResolveGroup makes them) supersedes the groups of the same devices under
// an earlier epoch of that coordinator incarnation, or under another
// incarnation: those are dropped (a caller still holding one keeps it alive
// until it lets go), and asking for one again is FAILED_PRECONDITION naming
// both epochs, so a stale step never rebuilds a group the cluster has left.
// Thread-safe: local ranks of a new group may ask for it at the same time.
class CommunicatorRegistry {
 public:
  virtual ~CommunicatorRegistry() = default;
  virtual absl::StatusOr<std::shared_ptr<Communicator>> Get(const GroupSpec& spec) = 0;
  // Groups held, for tests and stats.
  virtual int num_groups() const = 0;
  // The store groups rendezvous through (the coordinator's key-value store),
  // for backends that bootstrap their own communicators for the same groups
  // (NCCL's unique id). Default: none.
  virtual gloo::rendezvous::Store* rendezvous_store() const { return nullptr; }
  // Whether the transport between workers is open (Gloo's TCP device, whose
  // event loop then runs): only once a group spanning workers connected.
  virtual bool transport_open() const { return false; }
};

}  // namespace tessel::worker

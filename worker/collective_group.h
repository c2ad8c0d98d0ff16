// Where a program's collective runs: the group of devices a collective node
// spans, from the device's position in the program's mesh, and what a
// device does with the collectives of a step that failed. Shared by every
// backend, so they meet their peers under the same keys and ids.
//
// Thread-safety: free functions; each device's step thread calls them for
// its own step.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "tessel/v1/program.pb.h"
#include "worker/device.h"

namespace tessel::worker {

// Ops that exchange data between the devices of a group.
bool IsCollective(v1::Op op);

// The reduction a collective's ReduceKind names.
ReduceOp ReduceOpOf(v1::ReduceKind kind);

// `t` viewed as [outer, extent, inner] around dimension `d`, in elements:
// how a collective along `d` finds its blocks (rank-major only when outer
// is 1). Every backend lays them out alike.
struct AxisSplit {
  int64_t outer = 1, extent = 1, inner = 1;
};
AxisSplit SplitAround(const v1::TensorType& t, int64_t d);

struct ResolvedGroup {
  std::shared_ptr<Communicator> comm;  // null for a group of one
  int rank = 0;
  int size = 1;
  GroupSpec spec;  // set for a group of several
};

// The group of the collective `node` (instruction `op_index` of `program`)
// for the device at ctx.mesh_position. Its key names the devices and the
// step's collective epoch. `what` prefixes errors.
absl::StatusOr<ResolvedGroup> ResolveGroup(const v1::Program& program, const v1::Node& node,
                                           const StepContext& ctx, absl::string_view what);

// The identity of instruction `op_index` in this step.
CollectiveId IdOf(const StepContext& ctx, int op_index);

// After this device's step failed with `cause`: abandons every collective
// of `program` after instruction *ctx.last_collective (all of them when
// that is -1 or unset), so the peers waiting in them fail at once with the
// cause instead of pairing with a later step. Errors are ignored (the
// step has already failed).
void AbandonCollectives(const v1::Program& program, const StepContext& ctx,
                        const absl::Status& cause);

}  // namespace tessel::worker

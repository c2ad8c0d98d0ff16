// The ops only partitioned programs have, on host-addressable buffers:
// collectives through the group's Communicator, shard_slice, axis_index and
// split iotas. Each device's step thread calls these for its own position
// in the program's mesh; a collective blocks until its group has met.
#pragma once

#include "absl/status/status.h"
#include "tessel/v1/program.pb.h"
#include "worker/device.h"

namespace tessel::cpu {

// Runs `n` (a collective, shard_slice or axis_index node of `program`, its
// instruction `op_index`) for the device at `ctx.mesh_position`: reads `in`
// (of `in_type`; null for axis_index) and writes `out` (of n.type()).
absl::Status RunSpmdOp(const v1::Node& n, int op_index, const v1::Program& program,
                       const v1::TensorType& in_type, const void* in, void* out,
                       const worker::StepContext& ctx);

// An iota whose dimension is split over mesh axes: this device's block.
absl::Status SplitIota(const v1::Node& n, const v1::Program& program, void* out,
                       const worker::StepContext& ctx);

}  // namespace tessel::cpu

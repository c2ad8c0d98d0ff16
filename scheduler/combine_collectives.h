// One all_reduce for many: the per-device graph's all_reduces over the same
// mesh axes, of the same reduction and dtype, none of which needs another's
// result, become one all_reduce of their operands flattened and
// concatenated, then sliced back apart. A data-parallel step's gradients
// then cross the network once, paying one latency, not one each.
#pragma once

#include <vector>

#include "scheduler/partitioner.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// Rewrites `local` (a partitioned per-device graph, its nodes in order)
// and `collectives` (the plan's records: each combined all_reduce's record
// is replaced by the combined one's, which names what it combines). Groups
// of at most `max_bytes` per device. Returns the number of all_reduces
// removed.
int CombineAllReduces(v1::Graph& local, std::vector<PlannedCollective>& collectives,
                      const v1::Mesh& mesh, int64_t max_bytes = int64_t{64} << 20);

}  // namespace tessel::scheduler

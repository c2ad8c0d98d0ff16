// FusionPlanner: groups elementwise work into fusions evaluated in one pass
// over memory. A fusion is a contiguous run (in topological order) of nodes
// that produce the same shape element by element: elementwise ops, fill and
// iota constants of that shape, scalar constants, and broadcasts of a
// one-element value. Runs are contiguous so grouping can never form a cycle.
#pragma once

#include <vector>

#include "scheduler/validator.h"
#include "tessel/v1/program.pb.h"

namespace tessel::scheduler {

// Emits the instruction list for `g`: one Instruction per non-fusible node
// (parameters excluded), one per fusion. `release` is left empty.
std::vector<v1::Instruction> PlanFusions(const TypedGraph& g);

// True where `n` can be evaluated element by element within a fusion
// producing `dims`.
bool FusibleInto(const v1::Node& n, const TypedGraph& g,
                 const google::protobuf::RepeatedField<int64_t>& dims);

}  // namespace tessel::scheduler

// vmap as a graph-to-graph transformation: the batching rules of jax.vmap,
// applied to the nodes of a function before partitioning, so that every SDK
// and the CLI map functions through this one implementation. Pure; any
// thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/graph_emitter.h"
#include "scheduler/validator.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// The nodes of `f` (validated; no VJP, JVP or VMAP node left in it) emitted
// through `e` over a batch: `node` is the VMAP node (its batch attrs), `args`
// the values of its operands in the graph `e` appends to. Returns the values
// of the node's results, each with the batch at its out_axes.
//
// Values that do not depend on the batch stay unbatched and are computed
// once, as in JAX; a batched value carries the batch as its first
// dimension until a result moves it to its out_axes (an unbatched result is
// broadcast there). Every op of one result has a rule except control flow,
// collectives, manual regions, custom kernels and sharding constraints:
// meeting a batched operand they are UNIMPLEMENTED naming the node, its op
// and the function. A result with out_axes -1 that depends on the batch is
// INVALID_ARGUMENT (jax.vmap's out_axes=None).
// Control flow over batched values runs batched copies of its functions,
// added to `functions` (the graph's).
absl::StatusOr<std::vector<std::string>> EmitBatched(
    Emitter& e, const v1::Node& node, const TypedGraph& f, const std::vector<std::string>& args,
    google::protobuf::RepeatedPtrField<v1::Graph>* functions);

}  // namespace tessel::scheduler

// Autodiff as a graph-to-graph transformation: every VJP node of a graph
// becomes the forward nodes of its function followed by the backward pass
// that transposes them, before partitioning, so that every SDK and the CLI
// get gradients from this one implementation. Pure; any thread.
#pragma once

#include "absl/status/statusor.h"
#include "scheduler/validator.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// The graph with each VJP node expanded (and the TUPLE_ELEMENT nodes that
// read it renamed to the values it gives); unchanged when it has none.
// `g` must be validated. INVALID_ARGUMENT or UNIMPLEMENTED naming the node,
// its op and the function where a cotangent meets an op without a
// transposition rule (a while loop: reverse mode needs a trip count known
// at compile time, as in JAX).
// `mesh` (normalized; no axes when the program is not partitioned) is what
// manual regions run over: their backward passes are manual regions too,
// whose collectives transpose as shard_map's do (psum <-> pbroadcast,
// all_gather <-> psum_scatter, ppermute <-> its inverse, all_to_all <-> its
// reverse), and whose cotangents are summed over the devices of an axis
// exactly where the value they belong to is replicated over it and the
// uses of it vary (varying-axis tracking, see varying.h). Each such sum is
// an all_reduce with its reason.
absl::StatusOr<v1::Graph> ExpandAutodiff(const TypedGraph& g, const v1::Mesh& mesh = {});

// Whether `g` (or a function of it, or a manual region's body) holds a VJP,
// JVP, CUSTOM_VJP, CUSTOM_JVP or VMAP node. ExpandAutodiff expands the VMAP
// nodes too (scheduler/batching.h), in the same rounds: a derivative of a
// mapped function, or a map of a derivative, expands the inner one first.
bool HasAutodiff(const v1::Graph& g);

// `with_functions` (a function, the top-level graph's functions beside it)
// validated; over `mesh`'s axes where it runs a collective, itself or
// through what it calls, as a manual region's body does.
absl::StatusOr<TypedGraph> ValidateFunction(const v1::Graph& with_functions, const v1::Mesh& mesh);

}  // namespace tessel::scheduler

// The ops that apply a function of the graph to scalars: REDUCE_WITH_BODY
// (StableHLO's variadic reduce) and SORT_WITH_COMPARATOR (its sort). The
// validator types them here. Before differentiation, batching and
// partitioning, the compiler lowers each into the body's own elementwise
// nodes, inlined over arrays, between slices: a reduction as a pairwise
// tree (log2 of the reduced extent steps, each over half the elements of
// the last), a sort as a bitonic network of compare-exchanges (its
// comparator applied twice per step, ties broken by position, so stable).
// Every later pass and both backends then see only ops they have rules and
// kernels for: gradients, vmap and layouts follow from those. Pure; any
// thread.
#pragma once

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "scheduler/validator.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// The results of a REDUCE_WITH_BODY or SORT_WITH_COMPARATOR node, its body
// checked against its operands; INVALID_ARGUMENT naming the operand or the
// function, the expected and the actual.
absl::StatusOr<std::vector<v1::TensorType>> InferBodyResults(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops, FunctionTable& table,
    const ValidateOptions& options);

// Whether `g`, one of its functions or a manual region's body holds such a node.
bool HasBodies(const v1::Graph& g);

// `g` (validated) with each such node lowered, everywhere HasBodies looks;
// `mesh` as ExpandAutodiff's. A body that holds more than elementwise ops
// and scalar constants is INVALID_ARGUMENT naming the node and its op.
absl::StatusOr<v1::Graph> LowerBodies(const TypedGraph& g, const v1::Mesh& mesh = {});

}  // namespace tessel::scheduler

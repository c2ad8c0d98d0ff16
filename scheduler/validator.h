// GraphValidator: checks a client's graph and infers every value's type.
// Stateless; any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// A validated graph: every node has its type filled in.
struct TypedGraph {
  v1::Graph graph;
  absl::flat_hash_map<std::string, int> index_of;  // node name -> position
  std::vector<int> parameters;                     // node positions, by parameter index
  std::vector<int> outputs;                        // node positions, in result order
};

// INVALID_ARGUMENT naming the node, the op, the expected and the actual on
// the first problem: unknown op, wrong arity, type mismatch, bad dimensions,
// duplicate or empty names, a dangling operand or one defined later (a
// cycle), parameters not numbered 0..n-1, outputs that name nothing.
absl::StatusOr<TypedGraph> ValidateGraph(const v1::Graph& graph);

}  // namespace tessel::scheduler

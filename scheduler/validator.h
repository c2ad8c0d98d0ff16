// GraphValidator: checks a client's graph and infers every value's type.
// Stateless; any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// A validated graph: every node has its type filled in.
struct TypedGraph {
  v1::Graph graph;
  absl::flat_hash_map<std::string, int> index_of;  // node name -> position
  std::vector<int> parameters;                     // node positions, by parameter index
  std::vector<int> outputs;                        // node positions, in result order
};

struct FunctionTable;

struct ValidateOptions {
  // Set when validating the body of a manual region: collectives are
  // allowed and typed over this mesh. Default: none (a collective is an
  // error: outside manual regions the partitioner inserts them).
  const v1::Mesh* manual_mesh = nullptr;
  // A partitioned (per-device) graph: shard_slice is allowed too.
  bool partitioned = false;
  // The functions control-flow nodes may name. Default: the validated
  // graph's own `functions` (a top-level graph).
  FunctionTable* functions = nullptr;
};

// A function's signature, once validated.
struct FunctionSignature {
  std::vector<v1::TensorType> parameters, results;
};

// The functions of a top-level graph by name, with the signatures of those
// validated so far. Not thread-safe; one per validation.
struct FunctionTable {
  explicit FunctionTable(const v1::Graph& top);
  // The validated signature of `name`; `options` as at the call site.
  absl::StatusOr<const FunctionSignature*> Signature(const std::string& name,
                                                     const ValidateOptions& options);

  absl::flat_hash_map<std::string, const v1::Graph*> graphs;
  absl::node_hash_map<std::string, FunctionSignature>
      signatures;                   // key: name, "|manual" inside manual regions (stable pointers)
  std::vector<std::string> active;  // being validated (recursion is an error)
};

// OK where `fn`'s list `got` (its parameters or results, as `what` says) is
// `want`; else an error naming the function, the position and both types.
absl::Status CheckTypes(const std::string& what, const std::string& fn,
                        absl::Span<const v1::TensorType> got, absl::Span<const v1::TensorType> want,
                        const std::string& want_what);

// `t` with a dimension of `size` inserted at `axis` (a VMAP's batch).
v1::TensorType WithBatch(v1::TensorType t, int64_t axis, int64_t size);

// True for WHILE, CONDITIONAL and SCAN.
bool IsControlFlow(v1::Op op);
// True for the ops of several results (read with TUPLE_ELEMENT): control
// flow, the transforms (VJP, JVP, CUSTOM_VJP, CUSTOM_JVP, VMAP) and the ops
// with a body (REDUCE_WITH_BODY, SORT_WITH_COMPARATOR).
bool IsMultiResult(v1::Op op);
// IsMultiResult(n.op()), or a manual region with `out_specs`.
bool IsMultiResult(const v1::Node& n);
// The functions a control-flow node runs, in the order of its attrs.
std::vector<std::string> CalledFunctions(const v1::Node& n);

// INVALID_ARGUMENT naming the node, the op, the expected and the actual on
// the first problem: unknown op, wrong arity, type mismatch, bad dimensions,
// duplicate or empty names, a dangling operand or one defined later (a
// cycle), parameters not numbered 0..n-1, outputs that name nothing, a
// collective outside a manual region, a custom kernel whose decomposition
// does not fit its operands. Manual region bodies are checked by the
// partitioner, which knows the mesh.
absl::StatusOr<TypedGraph> ValidateGraph(const v1::Graph& graph,
                                         const ValidateOptions& options = {});
// The same, taking the graph rather than copying it.
absl::StatusOr<TypedGraph> ValidateGraph(v1::Graph&& graph, const ValidateOptions& options = {});

// True for the ops only a manual region may hold explicitly.
bool IsCollective(v1::Op op);

}  // namespace tessel::scheduler

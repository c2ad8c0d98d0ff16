// Partitioner: a typed graph plus a mesh and the parameters' shardings ->
// one per-device (SPMD) graph. It propagates shardings through every op in
// topological order, and reshards an operand only where the op's semantics
// need it: a dot over a split contracting dimension leaves a partial sum,
// resolved by reduce_scatter when the consumer wants it split, by all_reduce
// when it wants it whole, and by nothing when it may stay partial. Every
// collective it inserts carries its reason. Generated constants (fill, iota,
// broadcasts of scalars and elementwise chains of them) are produced by each
// device for its own block, never gathered or shipped. Manual regions
// (shard_map) are emitted as written, with the mesh axes each value varies
// over tracked so that an out_spec cannot silently replicate a varying value.
// Custom kernels are inlined from their decomposition; their replication
// rule keeps the tracking exact. A pure library; any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/validator.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

struct PartitionOptions {
  v1::Mesh mesh;                                  // normalized (NormalizeMesh)
  std::vector<v1::Sharding> parameter_shardings;  // empty, or one per parameter
  std::vector<v1::Sharding> output_shardings;     // empty, or one per output (may be unspecified)
};

// A collective in the per-device graph: inserted by the partitioner, or
// written in a manual region.
struct PlannedCollective {
  std::string value;  // the per-device graph value it produces
  v1::Op op = v1::OP_INVALID;
  std::vector<std::string> axes;
  int64_t bytes_per_device = 0;  // received by each device (ring algorithms)
  std::string reason;
};

// A collective of the per-device graph (input and output block types) with
// the bytes each device receives under ring algorithms.
PlannedCollective PlanCollective(const v1::Mesh& mesh, const std::string& value, v1::Op op,
                                 const std::vector<std::string>& axes,
                                 const v1::TensorType& in_type, const v1::TensorType& out_type,
                                 const std::string& reason);

struct PartitionedGraph {
  v1::Graph local;                                // per-device shapes; types set on every node
  std::vector<v1::Sharding> parameter_shardings;  // normalized
  std::vector<v1::Sharding> output_shardings;     // normalized, as the outputs leave
  std::vector<PlannedCollective> collectives;
  std::vector<std::string> diagnostics;
};

// INVALID_ARGUMENT naming the value on a sharding that does not fit the mesh
// or the value, a body that does not match its in_specs, or an out_spec
// that replicates a value over an axis it varies over.
absl::StatusOr<PartitionedGraph> Partition(const TypedGraph& g, const PartitionOptions& options);

// Without a mesh: custom kernels inlined from their decompositions,
// sharding constraints dropped; a manual region is INVALID_ARGUMENT.
absl::StatusOr<v1::Graph> LowerUnpartitioned(const TypedGraph& g);

}  // namespace tessel::scheduler

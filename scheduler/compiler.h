// Compiler: graph -> plan. Validates and types the graph, fuses elementwise
// chains, plans buffer lifetimes, and renders the plan as text. A pure
// library: no RPC, no threads; any thread may call.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/donation.h"
#include "scheduler/partitioner.h"
#include "tessel/v1/ir.pb.h"
#include "tessel/v1/program.pb.h"

namespace tessel::scheduler {

struct CompiledProgram {
  std::string fingerprint;  // 32 hex digits; identical graphs, identical ids
  v1::Program program;
  std::vector<v1::TensorType> parameter_types;
  std::vector<v1::TensorType> output_types;
  std::string plan_text;
  std::vector<std::string> diagnostics;
  int64_t estimated_peak_bytes = 0;
  // Donation: the outputs each parameter may become in place, and the plan
  // for the parameters the compile declared donated.
  AliasCandidates alias_candidates;
  std::vector<int> donated_parameters;
  std::vector<AliasDecision> declared_aliases;
  // Partitioned programs: the mesh (no axes: not partitioned), the layouts
  // every execution takes and gives, and the collectives with their reasons.
  v1::Mesh mesh;
  std::vector<v1::Sharding> parameter_shardings;
  std::vector<v1::Sharding> output_shardings;
  std::vector<v1::TensorType> global_parameter_types;  // whole arrays
  std::vector<v1::TensorType> global_output_types;
  std::vector<PlannedCollective> collectives;
  bool partitioned() const { return mesh.axis_names_size() > 0; }
};

struct CompileOptions {
  std::vector<int> donated_parameters;  // every execution donates these
  bool strict_donation = false;         // an unaliasable donation is an error
  // Partitioned compile when the mesh has axes (see PartitionOptions).
  v1::Mesh mesh;
  std::vector<v1::Sharding> parameter_shardings;
  std::vector<v1::Sharding> output_shardings;
  // Whose executable it is (the coordinator's tenant): part of its key, so
  // equal graphs of two owners never share an id, a cache entry or a
  // program loaded on a worker. Empty: nobody's.
  std::string owner;
};

// Constants above this many bytes draw a diagnostic: they are shipped with
// the program to every device.
inline constexpr int64_t kLargeLiteralBytes = 1 << 20;

absl::StatusOr<CompiledProgram> Compile(const v1::Graph& graph, const CompileOptions& options = {});

// INVALID_ARGUMENT naming the first declared donated parameter that cannot
// give its buffer to any output, and why.
absl::Status CheckStrictDonation(const CompiledProgram& compiled);

// The cache key and executable id: 32 hex digits of a SHA-256 over the
// graph's deterministic serialization, the declared donations, the mesh, the
// shardings and the owner. Collision-resistant: an id is only ever the
// content it names, whoever chose the graph.
std::string ExecutableKey(const v1::Graph& graph, const CompileOptions& options);

// 128-bit fingerprint of a graph's deterministic serialization, as hex.
std::string Fingerprint(const v1::Graph& graph);

// Human-readable program listing, one instruction per line.
std::string PrintProgram(const v1::Program& program);

}  // namespace tessel::scheduler

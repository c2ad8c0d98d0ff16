// MPMD programs: a graph whose top level is mesh regions (MESH_REGION),
// split into one graph per region, each compiled for its own mesh, with the
// values that pass between them. Pure; any thread.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::server {

// Where a value of the MPMD graph comes from: parameter `index` (part -1),
// or output `index` of part `part`.
struct MpmdRef {
  int part = -1;
  int index = 0;
  friend bool operator==(const MpmdRef&, const MpmdRef&) = default;
};

struct MpmdPart {
  std::string name;  // the region node's
  v1::Graph graph;   // its body, with the top level's functions
  v1::Mesh mesh;
  std::vector<v1::Sharding> in_shardings, out_shardings;
  std::vector<MpmdRef> inputs;           // one per body parameter
  std::vector<std::string> input_names;  // the operands' names, for the plan
};

struct MpmdSplit {
  std::vector<v1::TensorType> parameter_types;  // by index
  std::vector<std::string> parameter_names;
  std::vector<MpmdPart> parts;  // in the graph's order (a topological one)
  std::vector<MpmdRef> outputs;
};

// Whether `g` has a mesh region at its top level.
bool IsMpmd(const v1::Graph& g);

// INVALID_ARGUMENT naming the node for anything but parameters, mesh
// regions and their tuple elements at the top level, an operand count that
// is not the body's parameter count, a graph output that is a parameter or
// appears twice.
absl::StatusOr<MpmdSplit> SplitMpmd(const v1::Graph& g);

}  // namespace tessel::server

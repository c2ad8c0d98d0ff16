// Varying-axis tracking for manual regions (shard_map): for every value of a
// region's body, the mesh axes over which its blocks may differ from device
// to device. The partitioner uses it to check out_specs; reverse mode uses it
// to decide where a cotangent must be summed over devices (the transpose of
// the implicit broadcast of a value replicated over an axis). Pure.
#pragma once

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

struct Varying {
  absl::flat_hash_map<std::string, std::string> why;  // axis -> what makes the value vary over it
  absl::flat_hash_map<std::string, std::string>
      maybe;  // axis -> why it may (a kernel with no rule)

  bool Over(const std::string& axis) const { return why.contains(axis) || maybe.contains(axis); }
  // The reason it varies (or may) over `axis`; empty when it does not.
  std::string Reason(const std::string& axis) const;
  // Adds `o`'s axes; whether anything was added.
  bool Merge(const Varying& o);
  void Erase(const std::string& axis) {
    why.erase(axis);
    maybe.erase(axis);
  }
};

// The axes a block under `spec` varies over: those its dimensions are split
// over, each with `what` as its reason.
Varying SpecVarying(const v1::Sharding& spec, const std::string& what);

class VaryingAnalysis {
 public:
  // `functions`: the graph's (for control flow and custom_vjp in bodies).
  VaryingAnalysis(const v1::Mesh& mesh,
                  const google::protobuf::RepeatedPtrField<v1::Graph>& functions);

  // The axes each result of `n` varies over (one entry for a single-result
  // op) given its operands'. A loop whose condition varies, or a
  // conditional whose index varies where a branch communicates, is an error
  // naming the axis; `label` prefixes errors. Not for TUPLE_ELEMENT (a
  // lookup of its operand's result) or PARAMETER.
  absl::StatusOr<std::vector<Varying>> Of(const v1::Node& n, const std::vector<Varying>& operands,
                                          const std::string& label);
  // Every value of `g` given its parameters' (by index): name -> axes; the
  // results of a multi-result node under "name#k".
  absl::StatusOr<absl::flat_hash_map<std::string, Varying>> OfGraph(
      const v1::Graph& g, const std::vector<Varying>& params, const std::string& label);
  // The axes each output of function `fn` varies over.
  absl::StatusOr<std::vector<Varying>> OfFunction(const std::string& fn,
                                                  const std::vector<Varying>& params,
                                                  const std::string& label);

 private:
  bool CallsCollectives(const std::string& fn);
  absl::StatusOr<std::vector<Varying>> OfControlFlow(const v1::Node& n,
                                                     const std::vector<Varying>& ops,
                                                     const std::string& label);

  const v1::Mesh& mesh_;
  const google::protobuf::RepeatedPtrField<v1::Graph>& functions_;
};

}  // namespace tessel::scheduler

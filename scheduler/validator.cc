#include "scheduler/validator.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"

namespace tessel::scheduler {

using absl::InvalidArgumentError;
using absl::StrCat;

namespace {
std::string NodeLabel(const v1::Node& n, int pos) {
  std::string op = v1::Op_IsValid(n.op()) ? OpName(n.op()) : StrCat("op ", int(n.op()));
  return StrCat("node '", n.name(), "' (#", pos, ", ", op, "): ");
}
}  // namespace

absl::StatusOr<TypedGraph> ValidateGraph(const v1::Graph& graph) {
  TypedGraph tg;
  tg.graph = graph;
  if (graph.nodes_size() == 0) return InvalidArgumentError("graph has no nodes");
  if (graph.outputs_size() == 0) return InvalidArgumentError("graph has no outputs");
  std::vector<const v1::Node*> params;
  for (int pos = 0; pos < graph.nodes_size(); ++pos) {
    v1::Node& n = *tg.graph.mutable_nodes(pos);
    const std::string label = NodeLabel(n, pos);
    if (n.name().empty()) return InvalidArgumentError(StrCat(label, "has no name"));
    if (!v1::Op_IsValid(n.op()) || n.op() == v1::OP_INVALID) {
      return InvalidArgumentError(StrCat(label, "unknown op: expected one of the tessel.v1.Op values, got ", int(n.op())));
    }
    if (!tg.index_of.emplace(n.name(), pos).second) {
      return InvalidArgumentError(StrCat(label, "name already used by node #", tg.index_of[n.name()]));
    }
    std::vector<const v1::TensorType*> operand_types;
    for (int i = 0; i < n.operands_size(); ++i) {
      auto it = tg.index_of.find(n.operands(i));
      if (it == tg.index_of.end() || it->second == pos) {
        return InvalidArgumentError(StrCat(
            label, "operand ", i, " '", n.operands(i), "' is not defined before this node ",
            "(nodes must be in topological order; a cycle or a dangling reference)"));
      }
      operand_types.push_back(&tg.graph.nodes(it->second).type());
    }
    auto type = InferType(n, operand_types);
    if (!type.ok()) return Annotate(type.status(), label);
    *n.mutable_type() = *type;
    if (n.op() == v1::PARAMETER) params.push_back(&n);
  }
  tg.parameters.assign(params.size(), -1);
  for (const v1::Node* p : params) {
    int idx = p->parameter().index();
    if (idx >= int(params.size())) {
      return InvalidArgumentError(StrCat("parameter '", p->name(), "': index ", idx,
                                         " out of range: expected 0 <= index < ", params.size(),
                                         " (parameters are numbered 0..n-1)"));
    }
    if (tg.parameters[idx] != -1) {
      return InvalidArgumentError(StrCat("parameter '", p->name(), "': index ", idx,
                                         " is already taken by '",
                                         tg.graph.nodes(tg.parameters[idx]).name(), "'"));
    }
    tg.parameters[idx] = tg.index_of[p->name()];
  }
  for (int i = 0; i < graph.outputs_size(); ++i) {
    auto it = tg.index_of.find(graph.outputs(i));
    if (it == tg.index_of.end()) {
      return InvalidArgumentError(StrCat("output ", i, " '", graph.outputs(i), "' names no node"));
    }
    tg.outputs.push_back(it->second);
  }
  return tg;
}

}  // namespace tessel::scheduler

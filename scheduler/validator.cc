#include "scheduler/validator.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
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
// Types the ops the partitioner resolves: constraints, regions, kernels.
absl::StatusOr<v1::TensorType> InferStructured(const v1::Node& n, absl::Span<const v1::TensorType* const> ops) {
  switch (n.op()) {
    case v1::SHARDING_CONSTRAINT:
      if (ops.size() != 1) return InvalidArgumentError(StrCat("expected 1 operand, got ", ops.size()));
      if (n.attrs_case() != v1::Node::kSharding) return InvalidArgumentError("missing attributes 'sharding'");
      return *ops[0];
    case v1::MANUAL_REGION: {
      if (n.attrs_case() != v1::Node::kManualRegion) return InvalidArgumentError("missing attributes 'manual_region'");
      const v1::ManualRegionAttrs& m = n.manual_region();
      if (m.in_specs_size() != int(ops.size())) {
        return InvalidArgumentError(StrCat("has ", ops.size(), " operands but ", m.in_specs_size(), " in_specs"));
      }
      if (m.body().outputs_size() != 1) {
        return InvalidArgumentError(StrCat("body must have exactly 1 output, has ", m.body().outputs_size()));
      }
      if (n.type().dtype() == v1::DTYPE_INVALID) {
        return InvalidArgumentError("needs its declared (global) result type");
      }
      TESSEL_RETURN_IF_ERROR(ValidateType(n.type()));
      return n.type();
    }
    case v1::CUSTOM_KERNEL: {
      if (n.attrs_case() != v1::Node::kCustomKernel) return InvalidArgumentError("missing attributes 'custom_kernel'");
      const v1::CustomKernelAttrs& k = n.custom_kernel();
      if (k.name().empty()) return InvalidArgumentError("custom kernel has no name");
      auto d = ValidateGraph(k.decomposition());
      if (!d.ok()) return Annotate(d.status(), StrCat("custom kernel '", k.name(), "' decomposition: "));
      if (d->parameters.size() != ops.size() || d->outputs.size() != 1) {
        return InvalidArgumentError(StrCat("custom kernel '", k.name(), "': decomposition takes ", d->parameters.size(),
                                           " parameters and gives ", d->outputs.size(), " outputs; expected ",
                                           ops.size(), " and 1"));
      }
      for (size_t i = 0; i < ops.size(); ++i) {
        const v1::TensorType& want = d->graph.nodes(d->parameters[i]).type();
        if (!SameType(want, *ops[i])) {
          return InvalidArgumentError(StrCat("custom kernel '", k.name(), "' operand ", i, ": decomposition expects ",
                                             TypeString(want), ", got ", TypeString(*ops[i])));
        }
      }
      const v1::ReplicationRule& r = k.replication();
      if (r.kind() == v1::ReplicationRule::FOLLOW && (r.operand() < 0 || r.operand() >= int(ops.size()))) {
        return InvalidArgumentError(StrCat("custom kernel '", k.name(), "': replication rule follows operand ",
                                           r.operand(), " of ", ops.size()));
      }
      v1::TensorType t = d->graph.nodes(d->outputs[0]).type();
      if (n.type().dtype() != v1::DTYPE_INVALID && !SameType(n.type(), t)) {
        return InvalidArgumentError(StrCat("declared type ", TypeString(n.type()),
                                           " does not match the decomposition's result ", TypeString(t)));
      }
      return t;
    }
    default:
      return InvalidArgumentError("not a structured op");
  }
}

}  // namespace

bool IsCollective(v1::Op op) { return op >= v1::ALL_REDUCE && op <= v1::AXIS_INDEX; }

absl::StatusOr<TypedGraph> ValidateGraph(const v1::Graph& graph, const ValidateOptions& options) {
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
    absl::StatusOr<v1::TensorType> type;
    if (n.op() == v1::SHARD_SLICE) {
      type = options.partitioned && options.manual_mesh != nullptr
                 ? InferCollectiveType(n, operand_types, *options.manual_mesh)
                 : InvalidArgumentError("shard_slice is emitted by the partitioner only");
    } else if (IsCollective(n.op())) {
      type = options.manual_mesh == nullptr
                 ? InvalidArgumentError(StrCat("collective outside a manual region: ", OpName(n.op()),
                                               " is explicit only inside a manual region (shard_map); elsewhere "
                                               "the partitioner inserts the collectives a sharding needs"))
                 : InferCollectiveType(n, operand_types, *options.manual_mesh);
    } else if (n.op() == v1::SHARDING_CONSTRAINT || n.op() == v1::MANUAL_REGION || n.op() == v1::CUSTOM_KERNEL) {
      type = InferStructured(n, operand_types);
    } else {
      type = InferType(n, operand_types);
    }
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

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
absl::Status CheckAxes(const v1::Node& n, const v1::Mesh& mesh) {
  const auto& axes = n.collective().axes();
  if (axes.empty()) return InvalidArgumentError("names no mesh axis");
  absl::flat_hash_set<std::string> seen;
  for (const std::string& a : axes) {
    if (AxisIndex(mesh, a) < 0) {
      return InvalidArgumentError(StrCat("unknown mesh axis '", a, "'; the mesh is ", MeshString(mesh)));
    }
    if (!seen.insert(a).second) return InvalidArgumentError(StrCat("mesh axis '", a, "' is named twice"));
  }
  return absl::OkStatus();
}

absl::Status CheckDim(const v1::TensorType& t, int64_t d, absl::string_view what) {
  if (d < 0 || d >= t.dims_size()) {
    return InvalidArgumentError(StrCat(what, " ", d, " out of range for ", TypeString(t)));
  }
  return absl::OkStatus();
}

// Types a collective of a manual region body (per-device shapes).
absl::StatusOr<v1::TensorType> InferCollective(const v1::Node& n, absl::Span<const v1::TensorType* const> ops,
                                               const v1::Mesh& mesh) {
  const int want = n.op() == v1::AXIS_INDEX ? 0 : 1;
  if (int(ops.size()) != want) {
    return InvalidArgumentError(StrCat("expected ", want, " operands, got ", ops.size()));
  }
  if (n.attrs_case() != v1::Node::kCollective) return InvalidArgumentError("missing attributes 'collective'");
  TESSEL_RETURN_IF_ERROR(CheckAxes(n, mesh));
  const v1::CollectiveAttrs& c = n.collective();
  const int64_t size = AxesSize(mesh, c.axes());
  if (n.op() == v1::AXIS_INDEX) return MakeType(v1::S32, {});
  v1::TensorType t = *ops[0];
  switch (n.op()) {
    case v1::ALL_REDUCE:
    case v1::COLLECTIVE_PERMUTE:
      break;
    case v1::ALL_GATHER:
      TESSEL_RETURN_IF_ERROR(CheckDim(t, c.dimension(), "dimension"));
      t.set_dims(c.dimension(), t.dims(c.dimension()) * size);
      break;
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
      TESSEL_RETURN_IF_ERROR(CheckDim(t, c.dimension(), "dimension"));
      if (t.dims(c.dimension()) % size != 0) {
        return InvalidArgumentError(StrCat("dimension ", c.dimension(), " of ", TypeString(t),
                                           " does not split evenly over ", size, " devices"));
      }
      t.set_dims(c.dimension(), t.dims(c.dimension()) / size);
      if (n.op() == v1::ALL_TO_ALL) {
        TESSEL_RETURN_IF_ERROR(CheckDim(t, c.concat_dimension(), "concat_dimension"));
        t.set_dims(c.concat_dimension(), t.dims(c.concat_dimension()) * size);
      }
      break;
    default:
      return InvalidArgumentError("not a collective");
  }
  if (n.op() == v1::COLLECTIVE_PERMUTE) {
    if (c.source_target_pairs_size() % 2 != 0) {
      return InvalidArgumentError("source_target_pairs: expected (source, target) pairs, got an odd count");
    }
    absl::flat_hash_set<int64_t> sources, targets;
    for (int i = 0; i < c.source_target_pairs_size(); i += 2) {
      const int64_t src = c.source_target_pairs(i), dst = c.source_target_pairs(i + 1);
      if (src < 0 || src >= size || dst < 0 || dst >= size) {
        return InvalidArgumentError(StrCat("pair (", src, ", ", dst, ") out of range: the group has ", size,
                                           " devices"));
      }
      if (!sources.insert(src).second || !targets.insert(dst).second) {
        return InvalidArgumentError(StrCat("pair (", src, ", ", dst, "): each device sends and receives at most once"));
      }
    }
  }
  return t;
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
      if (!options.partitioned || options.manual_mesh == nullptr || operand_types.size() != 1 ||
          n.attrs_case() != v1::Node::kCollective) {
        type = InvalidArgumentError("shard_slice is emitted by the partitioner only");
      } else if (absl::Status st = CheckAxes(n, *options.manual_mesh); !st.ok()) {
        type = st;
      } else if (absl::Status st = CheckDim(*operand_types[0], n.collective().dimension(), "dimension"); !st.ok()) {
        type = st;
      } else {
        v1::TensorType t = *operand_types[0];
        const int64_t d = n.collective().dimension(), k = AxesSize(*options.manual_mesh, n.collective().axes());
        if (t.dims(d) % k != 0) {
          type = InvalidArgumentError(StrCat("dimension ", d, " of ", TypeString(t), " does not split over ", k));
        } else {
          t.set_dims(d, t.dims(d) / k);
          type = t;
        }
      }
    } else if (IsCollective(n.op())) {
      type = options.manual_mesh == nullptr
                 ? InvalidArgumentError(StrCat("collective outside a manual region: ", OpName(n.op()),
                                               " is explicit only inside a manual region (shard_map); elsewhere "
                                               "the partitioner inserts the collectives a sharding needs"))
                 : InferCollective(n, operand_types, *options.manual_mesh);
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

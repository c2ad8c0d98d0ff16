// The protobuf behind a tessel::Graph, and the GraphBuilder's state (its
// graph so far, typed node by node by the shared shape rules), shared by
// graph.cc (the ops) and graph_functions.cc (control flow and
// transformations, which build functions of the graph).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "client/src/convert_internal.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "tessel/graph.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

class GraphImpl {
 public:
  v1::Graph proto;
};

class GraphBuilder::Impl {
 public:
  explicit Impl(std::string name) { graph.set_name(std::move(name)); }

  // Adds `node`, typed by the shared shape rules, or as `declared` when set
  // (the partitioned ops, whose types the builder works out itself).
  Value Add(v1::Node node, const std::vector<Value>& operands,
            const v1::TensorType* declared = nullptr) {
    if (!status.ok()) return Value();
    std::vector<const v1::TensorType*> types;
    for (size_t i = 0; i < operands.size(); ++i) {
      const Value& v = operands[i];
      if (!v.valid() || v.id_ >= graph.nodes_size() || graph.nodes(v.id_).name() != v.name()) {
        status = absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(),
                                                         "': ", OpName(node.op()), ": operand ", i,
                                                         " is not a value of this builder"));
        return Value();
      }
      node.add_operands(v.name());
      types.push_back(&graph.nodes(v.id_).type());
    }
    const int id = graph.nodes_size();
    if (node.name().empty()) node.set_name(absl::StrCat(OpName(node.op()), "_", id));
    auto t =
        declared != nullptr ? absl::StatusOr<v1::TensorType>(*declared) : InferType(node, types);
    if (!t.ok()) {
      status =
          absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(), "': ", OpName(node.op()),
                                                  " '", node.name(), "': ", t.status().message()));
      return Value();
    }
    *node.mutable_type() = *t;
    Value v;
    v.id_ = id;
    v.type_ = FromProto(*t);
    v.name_ = node.name();
    *graph.add_nodes() = std::move(node);
    return v;
  }

  using Function = GraphBuilder::Function;
  absl::StatusOr<std::vector<ArrayType>> AddFunction(const std::string& fn_name,
                                                     const std::vector<ArrayType>& types,
                                                     const Function& fn,
                                                     const std::vector<ArrayType>* want,
                                                     const std::string& want_what);
  std::vector<Value> ControlNode(v1::Node n, const std::vector<Value>& operands,
                                 const std::vector<ArrayType>& results);
  std::vector<Value> Derivative(
      v1::Op op, const Function& f, const std::vector<Value>& args, const std::vector<Value>& extra,
      const std::vector<int>& wrt,
      const std::function<std::vector<ArrayType>(const std::vector<ArrayType>& results,
                                                 const std::vector<ArrayType>& args)>& more);

  // The types of `args` into `types`; false (and the builder failed) where
  // one is not a value.
  bool ArgTypes(const std::vector<Value>& args, absl::string_view what,
                std::vector<ArrayType>& types) {
    for (const Value& v : args) {
      if (!v.valid()) return Fail(what, "an argument is not a value"), false;
      types.push_back(v.type());
    }
    return true;
  }

  Value Fail(absl::string_view what, absl::string_view why) {
    if (status.ok())
      status =
          absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(), "': ", what, ": ", why));
    return Value();
  }

  // A collective over `axes`, typed by the coordinator's rules for
  // per-device blocks; `attrs` fills in the rest of its attributes.
  Value Collective(v1::Op op, std::vector<Value> operands, const std::vector<std::string>& axes,
                   const std::function<void(v1::CollectiveAttrs&)>& attrs) {
    const std::string what = OpName(op);
    if (!status.ok()) return Value();
    if (!mesh) return Fail(what, "collectives are explicit only inside a manual region's body");
    v1::Node n;
    n.set_op(op);
    v1::CollectiveAttrs& c = *n.mutable_collective();
    for (const std::string& a : axes) c.add_axes(a);
    attrs(c);
    std::vector<v1::TensorType> types;
    for (size_t i = 0; i < operands.size(); ++i) {
      if (!operands[i].valid())
        return Fail(what, absl::StrCat("operand ", i, " is not a value of this builder"));
      types.push_back(ToProto(operands[i].type()));
    }
    std::vector<const v1::TensorType*> ptrs;
    for (const v1::TensorType& t : types) ptrs.push_back(&t);
    absl::StatusOr<v1::TensorType> declared = InferCollectiveType(n, ptrs, ToProto(*mesh));
    if (!declared.ok()) return Fail(what, declared.status().message());
    return Add(std::move(n), operands, &*declared);
  }

  v1::Graph graph;
  int num_parameters = 0;
  absl::Status status;
  std::optional<Mesh> mesh;  // set in a manual region's body
};

inline v1::Node NodeOf(v1::Op op) {
  v1::Node n;
  n.set_op(op);
  return n;
}
template <typename R>
inline void Assign(R* field, const std::vector<int64_t>& v) {
  for (int64_t x : v) field->Add(x);
}

}  // namespace tessel

// Inside automatic differentiation (scheduler/autodiff.h): reverse mode
// (autodiff_vjp.cc) and forward mode (autodiff_jvp.cc) over one function,
// for the driver that expands a graph's VJP and JVP nodes (autodiff.cc).
// Each rule of an op lives in scheduler/ops/; what is here is structural:
// regions, control flow, custom rules, tuple elements.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/sharding.h"
#include "scheduler/graph_emitter.h"
#include "scheduler/validator.h"
#include "scheduler/varying.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// A manual region's body, typed over the mesh (with the graph's functions),
// for its derivative; `where` names the derivative in errors.
absl::StatusOr<TypedGraph> RegionBody(
    const v1::Node& n, const v1::Mesh& mesh,
    const google::protobuf::RepeatedPtrField<v1::Graph>& functions, const std::string& where);

// What a manual region's derivative knows of its body's values: over which
// mesh axes each varies (scheduler/varying.h), for the collectives its
// transposition needs.
struct RegionContext {
  RegionContext(const v1::Mesh& m, const google::protobuf::RepeatedPtrField<v1::Graph>& functions,
                std::string l)
      : mesh(m), analysis(m, functions), label(std::move(l)) {}

  void Track(const v1::Node& n) {
    if (!status.ok() || n.op() == v1::PARAMETER) return;
    if (n.op() == v1::TUPLE_ELEMENT) {
      Varying v = Of(absl::StrCat(n.operands(0), "#", n.tuple_element().index()));
      vary[n.name()] = std::move(v);
      return;
    }
    std::vector<Varying> ops;
    for (const std::string& o : n.operands()) ops.push_back(Of(o));
    auto r = analysis.Of(n, ops, label);
    if (!r.ok()) {
      status = r.status();
      return;
    }
    if (IsMultiResult(n)) {
      for (size_t k = 0; k < r->size(); ++k)
        vary[absl::StrCat(n.name(), "#", k)] = std::move((*r)[k]);
    } else {
      vary[n.name()] = std::move(r->at(0));
    }
  }
  int64_t Size(const std::string& axis) const { return mesh.axis_sizes(AxisIndex(mesh, axis)); }
  // A copy: references into `vary` do not survive an insertion.
  Varying Of(const std::string& v) const {
    auto it = vary.find(v);
    return it == vary.end() ? Varying{} : it->second;
  }

  const v1::Mesh& mesh;
  VaryingAnalysis analysis;
  std::string label;
  absl::flat_hash_map<std::string, Varying> vary;
  absl::Status status;
};

// A parameter node (`name` may be empty) of a function being built.
inline v1::Node ParameterNode(const std::string& name, int index, const v1::TensorType& t) {
  v1::Node p;
  p.set_name(name);
  p.set_op(v1::PARAMETER);
  p.mutable_parameter()->set_index(index);
  *p.mutable_type() = t;
  return p;
}

// Result `index` (of type `t`) of the multi-result node `of`, named `name`.
inline v1::Node TupleElementNode(const std::string& name, const std::string& of, int index,
                                 const v1::TensorType& t) {
  v1::Node te;
  te.set_name(name);
  te.set_op(v1::TUPLE_ELEMENT);
  te.add_operands(of);
  te.mutable_tuple_element()->set_index(index);
  *te.mutable_type() = t;
  return te;
}

// `t` with a leading dimension of `length`: what a scan stacks.
inline v1::TensorType Stacked(const v1::TensorType& t, int64_t length) {
  v1::TensorType s = t;
  s.mutable_dims()->Add(0);
  std::rotate(s.mutable_dims()->begin(), s.mutable_dims()->end() - 1, s.mutable_dims()->end());
  s.set_dims(0, length);
  return s;
}

// A call of `function` as the one branch of a conditional on a constant 0,
// as the rules of custom_vjp and custom_jvp run: add its arguments and
// result types.
inline v1::Node BranchCall(Emitter& e, const std::string& function) {
  v1::Node call;
  call.set_op(v1::CONDITIONAL);
  v1::TensorType index;
  index.set_dtype(v1::S32);
  call.add_operands(e.Zeros(index));
  call.mutable_control()->add_branches(function);
  return call;
}

// Appends `n` to `g`; its name.
inline std::string AddNode(v1::Graph& g, v1::Node n) {
  std::string name = n.name();
  *g.add_nodes() = std::move(n);
  return name;
}

// Reverse mode over `f` for VJP node `node`: its forward nodes (to emit
// first) and the names of its results (F's results, then the cotangents of
// `wrt`); the backward pass is emitted into `e`. New functions (a loop's
// backward body) go to `functions`. `region`: set where the VJP node is in
// a manual region's body (a per-device gradient), with the varying axes of
// its operands; its collectives then transpose as shard_map's do.
struct VjpExpansion {
  std::vector<v1::Node> forward;
  std::vector<std::string> results;
};
absl::StatusOr<VjpExpansion> ExpandVjp(Emitter& e, const v1::Node& node, const TypedGraph& f,
                                       std::vector<std::string> args,
                                       std::vector<std::string> cotangents,
                                       google::protobuf::RepeatedPtrField<v1::Graph>* functions,
                                       const v1::Mesh& mesh, RegionContext* region = nullptr);

// Forward mode over `f` for JVP node `node`, emitted into `e`: the names
// of its results (F's results, then their tangents).
absl::StatusOr<std::vector<std::string>> ExpandJvp(
    Emitter& e, const v1::Node& node, const TypedGraph& f, std::vector<std::string> args,
    std::vector<std::string> tangents, google::protobuf::RepeatedPtrField<v1::Graph>* functions,
    const v1::Mesh& mesh);

}  // namespace tessel::scheduler

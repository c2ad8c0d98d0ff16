// The partitioner's state while it plans one graph: the global values'
// layouts, the per-device graph it emits, and the functions partitioned for
// the layouts they are called with. Private to partitioner.cc (values,
// resharding, nodes) and partitioner_regions.cc (control flow and manual
// regions).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/ops/op_rules.h"
#include "scheduler/partitioner.h"
#include "scheduler/varying.h"

namespace tessel::scheduler::partition_internal {

using absl::InvalidArgumentError;
using absl::StrCat;
using ops::Axes;

using ops::AxesText;
using ops::Complete;
using ops::DimAxes;
using ops::PartialAxes;
using ops::SetDimAxes;

class Partitioner : public ops::LocalGraph {
 public:
  Partitioner(const TypedGraph& g, const PartitionOptions& o)
      : g_(g), o_(o), mesh_(o.mesh), functions_(g.graph), analysis_(o.mesh, g.graph.functions()) {}

  absl::StatusOr<PartitionedGraph> Run();

 private:
  struct Value {
    std::string local;  // per-device graph name (empty while generated and not materialized)
    v1::Sharding s;     // normalized; meaningless while generated
    v1::TensorType global;
    bool generated = false;          // regenerated per block on demand
    const v1::Node* node = nullptr;  // the defining node (generated values)
    std::string prefix;              // its graph's name prefix
  };

  std::string Fresh(const std::string& base) {
    std::string name = base;
    for (int k = 1; !used_names_.insert(name).second; ++k) name = StrCat(base, ".", k);
    return name;
  }

  // Appends a node with its per-device type inferred from its operands.
  absl::StatusOr<std::string> Emit(v1::Node n) override {
    std::vector<const v1::TensorType*> types;
    for (const std::string& o : n.operands()) types.push_back(&local_types_.at(o));
    if (n.op() != v1::PARAMETER && n.op() != v1::CONSTANT && !IsCollective(n.op()) &&
        n.op() != v1::SHARD_SLICE && !IsControlFlow(n.op()) && n.op() != v1::TUPLE_ELEMENT) {
      n.clear_type();
      auto t = InferType(n, types);
      if (!t.ok()) return Annotate(t.status(), StrCat("partitioned node '", n.name(), "': "));
      *n.mutable_type() = *t;
    }
    local_types_[n.name()] = n.type();
    *out_.local.add_nodes() = n;
    return n.name();
  }

  const v1::TensorType& LocalTypeOf(const std::string& v) const override {
    return local_types_.at(v);
  }
  const v1::Mesh& mesh() const override { return mesh_; }

  // A node of `op` over `operands` (type inferred), named after `base`.
  absl::StatusOr<std::string> EmitOp(v1::Op op, std::vector<std::string> operands,
                                     const std::string& base,
                                     const std::function<void(v1::Node&)>& attrs = {}) override {
    v1::Node n;
    n.set_name(Fresh(base));
    n.set_op(op);
    for (std::string& o : operands) n.add_operands(std::move(o));
    if (attrs) attrs(n);
    return Emit(std::move(n));
  }
  // Every element of type `t` equal to `f` (floating types) or `i`.
  absl::StatusOr<std::string> EmitFill(const v1::TensorType& t, double f, int64_t i,
                                       const std::string& base) override {
    v1::Node n;
    n.set_name(Fresh(base));
    n.set_op(v1::CONSTANT);
    *n.mutable_type() = t;
    if (IsFloat(t.dtype())) {
      n.mutable_constant()->mutable_fill()->set_f(f);
    } else {
      n.mutable_constant()->mutable_fill()->set_i(i);
    }
    return Emit(std::move(n));
  }
  // Local `indices` into a dimension of `extent` split over `axes` in blocks
  // of `block`, as s64 positions in this device's block (out of [0, block)
  // where another device holds the slice). With `clamp`, first clamped into
  // [0, extent), as a gather over the whole dimension reads.
  absl::StatusOr<std::string> BlockIndices(const std::string& indices, const Axes& axes,
                                           int64_t extent, int64_t block, bool clamp,
                                           const std::string& base) override {
    const v1::TensorType& it = local_types_.at(indices);
    v1::TensorType s64 = it, scalar;
    s64.set_dtype(v1::S64);
    scalar.set_dtype(v1::S64);
    std::string src = indices;
    if (it.dtype() == v1::U64) {  // a u64 past int64 is out of range: it must stay past the end,
                                  // not wrap negative
      v1::TensorType u64;
      u64.set_dtype(v1::U64);
      TESSEL_ASSIGN_OR_RETURN(std::string lo, EmitFill(u64, 0, 0, base + ".u64_lo"));
      TESSEL_ASSIGN_OR_RETURN(std::string hi, EmitFill(u64, 0, INT64_MAX, base + ".u64_hi"));
      TESSEL_ASSIGN_OR_RETURN(src, EmitOp(v1::CLAMP, {lo, src, hi}, base + ".u64_clamp"));
    }
    TESSEL_ASSIGN_OR_RETURN(std::string idx,
                            EmitOp(v1::CONVERT, {src}, base + ".s64",
                                   [](v1::Node& n) { n.mutable_convert()->set_dtype(v1::S64); }));
    if (clamp) {
      TESSEL_ASSIGN_OR_RETURN(std::string lo, EmitFill(scalar, 0, 0, base + ".lo"));
      TESSEL_ASSIGN_OR_RETURN(std::string hi, EmitFill(scalar, 0, extent - 1, base + ".hi"));
      TESSEL_ASSIGN_OR_RETURN(idx, EmitOp(v1::CLAMP, {lo, idx, hi}, base + ".clamp"));
    }
    v1::Node ai;
    ai.set_name(Fresh(base + ".axis_index"));
    ai.set_op(v1::AXIS_INDEX);
    ai.mutable_type()->set_dtype(v1::S32);
    for (const std::string& a : axes) ai.mutable_collective()->add_axes(a);
    TESSEL_ASSIGN_OR_RETURN(std::string at, Emit(std::move(ai)));
    TESSEL_ASSIGN_OR_RETURN(at, EmitOp(v1::CONVERT, {at}, base + ".block", [](v1::Node& n) {
                              n.mutable_convert()->set_dtype(v1::S64);
                            }));
    TESSEL_ASSIGN_OR_RETURN(std::string size, EmitFill(scalar, 0, block, base + ".block_size"));
    TESSEL_ASSIGN_OR_RETURN(std::string offset, EmitOp(v1::MUL, {at, size}, base + ".offset"));
    TESSEL_ASSIGN_OR_RETURN(
        offset, EmitOp(v1::BROADCAST_IN_DIM, {offset}, base + ".offset", [&](v1::Node& n) {
          *n.mutable_broadcast_in_dim()->mutable_dims() = s64.dims();
        }));
    return EmitOp(v1::SUB, {idx, offset}, base + ".local");
  }

  absl::StatusOr<std::string> EmitCollective(v1::Op op, const std::string& input,
                                             const std::string& base, const Axes& axes, int64_t dim,
                                             int64_t concat_dim, v1::ReduceKind kind,
                                             const std::string& reason,
                                             const std::vector<int64_t>& pairs = {}) override {
    // Over axes of size 1 every collective is the identity: none is needed.
    if (AxesSize(mesh_, axes) == 1) return input;
    v1::Node n;
    n.set_name(Fresh(StrCat(base, ".", OpName(op))));
    n.set_op(op);
    n.add_operands(input);
    v1::CollectiveAttrs& c = *n.mutable_collective();
    for (const std::string& a : axes) c.add_axes(a);
    c.set_kind(kind);
    c.set_dimension(dim);
    c.set_concat_dimension(concat_dim);
    c.set_reason(reason);
    for (int64_t p : pairs) c.add_source_target_pairs(p);
    v1::TensorType t = local_types_.at(input);
    const int64_t k = AxesSize(mesh_, axes);
    switch (op) {
      case v1::ALL_GATHER: t.set_dims(dim, t.dims(dim) * k); break;
      case v1::REDUCE_SCATTER:
      case v1::SHARD_SLICE: t.set_dims(dim, t.dims(dim) / k); break;
      case v1::ALL_TO_ALL:
        t.set_dims(dim, t.dims(dim) / k);
        t.set_dims(concat_dim, t.dims(concat_dim) * k);
        break;
      default: break;
    }
    *n.mutable_type() = t;
    TESSEL_ASSIGN_OR_RETURN(std::string name, Emit(std::move(n)));
    if (op != v1::SHARD_SLICE) Record(name, op, input, axes, reason);
    return name;
  }

  // Lists a collective of the per-device graph with the bytes each device
  // receives under ring algorithms.
  void Record(const std::string& name, v1::Op op, const std::string& input, const Axes& axes,
              const std::string& reason) {
    out_.collectives.push_back(PlanCollective(mesh_, name, op, axes, local_types_.at(input),
                                              local_types_.at(name), reason));
  }

  // The value `name` laid out as `want` (normalized, same rank): itself, or
  // what the fewest collectives make of it.
  absl::StatusOr<std::string> Reshard(const std::string& name, const v1::Sharding& want,
                                      const std::string& why);

  // A generated value produced directly in the layout `want`.
  absl::StatusOr<std::string> Regenerate(const std::string& name, v1::Sharding want);
  // A parameter whose layout its first reader chooses (given unspecified):
  // it takes `want` there; any later reader gets a reshard of it.
  absl::StatusOr<std::string> ResolveParameter(const std::string& name, const v1::Sharding& want);
  // The block of iota `n` (named, typed per device) whose dimension `want` splits.
  absl::StatusOr<std::string> SplitIota(v1::Node n, const v1::TensorType& global,
                                        const v1::Sharding& want);

  bool IsGeneratedNode(const v1::Node& n, const std::string& prefix) const {
    if (n.op() == v1::CONSTANT) return n.constant().has_fill() || n.constant().has_iota();
    if (n.op() != v1::BROADCAST_IN_DIM && !IsElementwise(n.op())) return false;
    bool any = false;
    for (const std::string& o : n.operands()) {
      const Value& v = values_.at(StrCat(prefix, o));
      if (v.generated) {
        any = true;
      } else if (v.global.dims_size() != 0 || !IsReplicated(v.s)) {
        return false;
      }
    }
    if (n.op() == v1::BROADCAST_IN_DIM)
      return values_.at(StrCat(prefix, n.operands(0))).global.dims_size() == 0;
    return any;
  }

  // Processes `graph`'s nodes; names are `prefix` + node name; `bind` maps
  // parameter names to values already defined (inlined graphs).
  absl::Status ProcessGraph(const v1::Graph& graph, const std::string& prefix,
                            const absl::flat_hash_map<std::string, std::string>& bind, bool top);

  absl::Status ProcessNode(const v1::Node& n, const std::string& prefix, const std::string& name,
                           bool top);

  // ---------------------------------------------------------------- control flow

  // A loop's carries keep the layout they start with (the fixed point is
  // declared, not searched for): the body is partitioned with its
  // parameters and results in that layout, and what it computes is
  // resharded to it, with that reason. Scanned operands are unsplit along
  // the scanned dimension; a conditional's index is replicated; branches
  // give branch 0's layouts. Each function is partitioned for the layouts
  // it is called with (named fn@hash).
  absl::Status ProcessControl(const v1::Node& n, const std::string& prefix,
                              const std::string& name);

  // The layouts `fn`'s results take for parameters laid out as `params`
  // (nothing recorded).
  absl::StatusOr<std::vector<v1::Sharding>> ProbeFunction(const std::string& fn,
                                                          const std::vector<v1::Sharding>& params,
                                                          const std::vector<v1::Sharding>& outs,
                                                          const std::string& what);

  // Function `fn` partitioned for parameters laid out as `params` and
  // results as `outs` (empty or an entry unspecified: its choice). Returns
  // the per-device function's name and its results' layouts.
  absl::StatusOr<std::pair<std::string, std::vector<v1::Sharding>>> PartitionFunction(
      const std::string& fn, const std::vector<v1::Sharding>& params,
      const std::vector<v1::Sharding>& outs, const std::string& what);

  // ---------------------------------------------------------------- manual regions

  absl::Status ProcessRegion(const v1::Node& n, const std::string& prefix, const std::string& name);

  // Emits a body (per-device shapes) as written; returns its outputs' local names.
  absl::StatusOr<std::vector<std::string>> EmitManual(
      const v1::Graph& body, const std::string& bprefix,
      const absl::flat_hash_map<std::string, std::string>& bind,
      absl::flat_hash_map<std::string, Varying>& varying, const std::string& label);

  const TypedGraph& g_;
  const PartitionOptions& o_;
  const v1::Mesh& mesh_;
  FunctionTable functions_;  // the graph's, for control flow in manual regions
  VaryingAnalysis analysis_;
  PartitionedGraph out_;
  std::vector<bool> deferred_;                      // per parameter: given unspecified
  absl::flat_hash_map<int, std::string> resolved_;  // deferred parameter -> its value's name
  absl::flat_hash_map<std::string, Value> values_;
  absl::flat_hash_map<std::string, std::vector<v1::Sharding>>
      control_results_;  // a control node's results' layouts
  absl::flat_hash_map<std::string, v1::TensorType> local_types_;
  absl::flat_hash_map<std::string, std::string> reshard_cache_;
  absl::flat_hash_set<std::string> used_names_;
  std::vector<std::unique_ptr<v1::Graph>> decompositions_, regions_;  // nodes referenced by values_
};

}  // namespace tessel::scheduler::partition_internal

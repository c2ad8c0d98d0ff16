#include "scheduler/partitioner.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <memory>
#include <optional>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/ops/op_rules.h"
#include "scheduler/varying.h"

namespace tessel::scheduler {
namespace {

using absl::InvalidArgumentError;
using absl::StrCat;
using ops::Axes;

using ops::AxesText;
using ops::Complete;
using ops::DimAxes;
using ops::PartialAxes;
using ops::SetDimAxes;

}  // namespace

PlannedCollective PlanCollective(const v1::Mesh& mesh, const std::string& value, v1::Op op,
                                 const std::vector<std::string>& axes,
                                 const v1::TensorType& in_type, const v1::TensorType& out_type,
                                 const std::string& reason) {
  const int64_t k = AxesSize(mesh, axes);
  const int64_t in = ByteSizeUnchecked(in_type), out = ByteSizeUnchecked(out_type);
  int64_t received = in;  // collective_permute: one block
  switch (op) {
    case v1::ALL_REDUCE: received = 2 * (k - 1) * in / k; break;
    case v1::ALL_GATHER: received = (k - 1) * in; break;
    case v1::REDUCE_SCATTER: received = (k - 1) * out; break;
    case v1::ALL_TO_ALL: received = (k - 1) * in / k; break;
    default: break;
  }
  return {value, op, axes, received, reason};
}

namespace {

class Partitioner : public ops::LocalGraph {
 public:
  Partitioner(const TypedGraph& g, const PartitionOptions& o)
      : g_(g), o_(o), mesh_(o.mesh), functions_(g.graph), analysis_(o.mesh, g.graph.functions()) {}

  absl::StatusOr<PartitionedGraph> Run() {
    out_.local.set_name(g_.graph.name());
    const int np = g_.parameters.size();
    if (!o_.parameter_shardings.empty() && int(o_.parameter_shardings.size()) != np) {
      return InvalidArgumentError(StrCat("graph has ", np, " parameters; ",
                                         o_.parameter_shardings.size(),
                                         " parameter shardings given"));
    }
    if (!o_.output_shardings.empty() &&
        int(o_.output_shardings.size()) != g_.graph.outputs_size()) {
      return InvalidArgumentError(StrCat("graph has ", g_.graph.outputs_size(), " outputs; ",
                                         o_.output_shardings.size(), " output shardings given"));
    }
    out_.parameter_shardings.resize(np);
    for (int i = 0; i < np; ++i) {
      const v1::Node& p = g_.graph.nodes(g_.parameters[i]);
      const v1::Sharding s =
          o_.parameter_shardings.empty()
              ? Replicated(p.type().dims_size())
              : NormalizeSharding(o_.parameter_shardings[i], p.type().dims_size());
      TESSEL_RETURN_IF_ERROR(
          ValidateSharding(s, mesh_, p.type(), StrCat("parameter ", i, " '", p.name(), "'")));
      out_.parameter_shardings[i] = s;
    }
    absl::flat_hash_map<std::string, std::string> bind;
    TESSEL_RETURN_IF_ERROR(ProcessGraph(g_.graph, "", bind, /*top=*/true));
    for (int i = 0; i < g_.graph.outputs_size(); ++i) {
      const std::string& name = g_.graph.outputs(i);
      const Value& v = values_.at(name);
      v1::Sharding want;
      const std::string label = StrCat("output ", i, " '", name, "'");
      if (!o_.output_shardings.empty() && !o_.output_shardings[i].unspecified()) {
        want = NormalizeSharding(o_.output_shardings[i], v.global.dims_size());
        TESSEL_RETURN_IF_ERROR(ValidateSharding(want, mesh_, v.global, label));
      } else {
        want = v.generated ? Replicated(v.global.dims_size()) : Complete(v.s);
      }
      TESSEL_ASSIGN_OR_RETURN(std::string local,
                              Reshard(name, want, StrCat(label, " wants ", ShardingString(want))));
      out_.local.add_outputs(local);
      out_.output_shardings.push_back(want);
    }
    return std::move(out_);
  }

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
                                      const std::string& why) {
    Value& v = values_.at(name);
    if (v.generated) return Regenerate(name, want);
    if (SameSharding(v.s, want)) return v.local;
    const std::string key = StrCat(name, "|", ShardingString(want));
    if (auto it = reshard_cache_.find(key); it != reshard_cache_.end()) return it->second;
    const std::string what = StrCat("'", name, "' ", TypeString(v.global), " ", ShardingString(v.s),
                                    " -> ", ShardingString(want));
    std::string cur = v.local;
    v1::Sharding s = v.s;
    // 1. Partial sums: kept where `want` keeps them; resolved by
    //    reduce_scatter into a dimension `want` splits, else all_reduce.
    if (IsPartial(s)) {
      Axes resolve;
      for (const std::string& a : s.partial()) {
        const bool kept =
            std::find(want.partial().begin(), want.partial().end(), a) != want.partial().end() &&
            want.partial_kind() == s.partial_kind();
        if (!kept) resolve.push_back(a);
      }
      for (int d = 0; d < want.dims_size() && !resolve.empty(); ++d) {
        const Axes target = DimAxes(want, d);
        if (target.empty() || !DimAxes(s, d).empty()) continue;
        bool all = true;
        for (const std::string& a : target)
          all &= std::find(resolve.begin(), resolve.end(), a) != resolve.end();
        if (!all) continue;
        TESSEL_ASSIGN_OR_RETURN(
            cur,
            EmitCollective(v1::REDUCE_SCATTER, cur, name, target, d, 0, s.partial_kind(),
                           StrCat(why, ": ", what, ": the partial result over ", AxesText(target),
                                  " is reduced straight into the split of dimension ", d)));
        SetDimAxes(s, d, target);
        for (const std::string& a : target)
          resolve.erase(std::find(resolve.begin(), resolve.end(), a));
      }
      if (!resolve.empty()) {
        TESSEL_ASSIGN_OR_RETURN(
            cur, EmitCollective(v1::ALL_REDUCE, cur, name, resolve, 0, 0, s.partial_kind(),
                                StrCat(why, ": ", what, ": the partial result over ",
                                       AxesText(resolve), " must be complete")));
      }
      v1::Sharding kept = s;
      kept.clear_partial();
      for (const std::string& a : s.partial()) {
        if (std::find(resolve.begin(), resolve.end(), a) == resolve.end() &&
            std::find(want.partial().begin(), want.partial().end(), a) != want.partial().end()) {
          kept.add_partial(a);
        }
      }
      s = kept;
    }
    for (const std::string& a : want.partial()) {
      if (std::find(s.partial().begin(), s.partial().end(), a) == s.partial().end()) {
        return InvalidArgumentError(StrCat(
            why, ": ", what, ": a complete value cannot be made a partial sum over '", a, "'"));
      }
    }
    // 2. Dimensions split differently: all_to_all where an axis moves
    //    between two dimensions, all_gather otherwise.
    auto is_prefix = [](const Axes& a, const Axes& b) {
      return a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin());
    };
    for (int d = 0; d < s.dims_size(); ++d) {
      const Axes have = DimAxes(s, d), target = DimAxes(want, d);
      if (have.empty() || is_prefix(have, target)) continue;
      int to = -1;
      if (target.empty()) {
        for (int e = 0; e < s.dims_size(); ++e) {
          if (e != d && DimAxes(s, e).empty() && DimAxes(want, e) == have &&
              local_types_.at(cur).dims(e) % AxesSize(mesh_, have) == 0) {
            to = e;
          }
        }
      }
      if (to >= 0) {
        TESSEL_ASSIGN_OR_RETURN(
            cur, EmitCollective(v1::ALL_TO_ALL, cur, name, have, to, d, v1::REDUCE_INVALID,
                                StrCat(why, ": ", what, ": the split over ", AxesText(have),
                                       " moves from dimension ", d, " to ", to)));
        SetDimAxes(s, to, have);
      } else {
        TESSEL_ASSIGN_OR_RETURN(
            cur, EmitCollective(v1::ALL_GATHER, cur, name, have, d, 0, v1::REDUCE_INVALID,
                                StrCat(why, ": ", what, ": dimension ", d, " split over ",
                                       AxesText(have), " is needed whole")));
      }
      SetDimAxes(s, d, {});
    }
    // 3. Dimensions `want` splits further: each device keeps its block.
    for (int d = 0; d < s.dims_size(); ++d) {
      const Axes have = DimAxes(s, d), target = DimAxes(want, d);
      if (have == target) continue;
      const Axes extra(target.begin() + have.size(), target.end());
      TESSEL_ASSIGN_OR_RETURN(cur, EmitCollective(v1::SHARD_SLICE, cur, name, extra, d, 0,
                                                  v1::REDUCE_INVALID, StrCat(why, ": ", what)));
      SetDimAxes(s, d, target);
    }
    reshard_cache_[key] = cur;
    return cur;
  }

  // A generated value produced directly in the layout `want`.
  absl::StatusOr<std::string> Regenerate(const std::string& name, v1::Sharding want) {
    Value& v = values_.at(name);
    want.clear_partial();
    const std::string key = StrCat(name, "|", ShardingString(want));
    if (auto it = reshard_cache_.find(key); it != reshard_cache_.end()) return it->second;
    const v1::Node& src = *v.node;
    v1::Node n = src;
    n.set_name(Fresh(StrCat(v.prefix, src.name())));
    n.clear_operands();
    const v1::TensorType local = LocalType(v.global, want, mesh_);
    if (src.op() == v1::CONSTANT) {
      *n.mutable_type() = local;
      if (src.constant().has_iota()) {
        const int64_t d = src.constant().iota().dimension();
        for (const std::string& a : want.dims(d).axes())
          n.mutable_constant()->mutable_iota()->add_sharded_axes(a);
      }
    } else {
      for (const std::string& o : src.operands()) {
        const std::string full = StrCat(v.prefix, o);
        const Value& ov = values_.at(full);
        TESSEL_ASSIGN_OR_RETURN(
            std::string lo,
            Reshard(full, ov.global.dims_size() == 0 ? Replicated(0) : want, "generated"));
        n.add_operands(lo);
      }
      if (src.op() == v1::BROADCAST_IN_DIM) {
        n.mutable_broadcast_in_dim()->clear_dims();
        for (int64_t x : local.dims()) n.mutable_broadcast_in_dim()->add_dims(x);
      }
    }
    TESSEL_ASSIGN_OR_RETURN(std::string out, Emit(std::move(n)));
    reshard_cache_[key] = out;
    return out;
  }

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
                            const absl::flat_hash_map<std::string, std::string>& bind, bool top) {
    for (const v1::Node& n : graph.nodes()) {
      const std::string name = StrCat(prefix, n.name());
      if (n.op() == v1::PARAMETER && !top) {
        values_[name] = values_.at(bind.at(n.name()));
        continue;
      }
      TESSEL_RETURN_IF_ERROR(Annotate(ProcessNode(n, prefix, name, top),
                                      StrCat("node '", name, "' (", OpName(n.op()), "): ")));
    }
    return absl::OkStatus();
  }

  absl::Status ProcessNode(const v1::Node& n, const std::string& prefix, const std::string& name,
                           bool top) {
    Value v;
    v.global = n.type();
    v.node = &n;
    v.prefix = prefix;
    const int rank = n.type().dims_size();
    if (n.op() == v1::PARAMETER) {
      v1::Node p = n;
      v.s = out_.parameter_shardings[n.parameter().index()];
      *p.mutable_type() = LocalType(n.type(), v.s, mesh_);
      p.set_name(Fresh(name));
      TESSEL_ASSIGN_OR_RETURN(v.local, Emit(p));
      values_[name] = v;
      return absl::OkStatus();
    }
    if (IsGeneratedNode(n, prefix)) {
      v.generated = true;
      values_[name] = v;
      return absl::OkStatus();
    }
    auto operand = [&](int i) -> Value& { return values_.at(StrCat(prefix, n.operands(i))); };
    const std::string why = StrCat(OpName(n.op()), " '", name, "'");
    switch (n.op()) {
      case v1::SHARDING_CONSTRAINT: {
        v1::Sharding want = NormalizeSharding(n.sharding().sharding(), rank);
        TESSEL_RETURN_IF_ERROR(
            ValidateSharding(want, mesh_, n.type(), StrCat("sharding constraint '", name, "'")));
        TESSEL_ASSIGN_OR_RETURN(v.local, Reshard(StrCat(prefix, n.operands(0)), want,
                                                 StrCat("sharding constraint '", name, "'")));
        v.s = want;
        values_[name] = v;
        return absl::OkStatus();
      }
      case v1::CUSTOM_KERNEL: {
        absl::flat_hash_map<std::string, std::string> inner;
        TESSEL_ASSIGN_OR_RETURN(TypedGraph d, ValidateGraph(n.custom_kernel().decomposition()));
        for (size_t i = 0; i < d.parameters.size(); ++i) {
          const v1::Node& p = d.graph.nodes(d.parameters[i]);
          inner[p.name()] = StrCat(prefix, n.operands(p.parameter().index()));
        }
        decompositions_.push_back(std::make_unique<v1::Graph>(std::move(d.graph)));
        const v1::Graph& body = *decompositions_.back();
        TESSEL_RETURN_IF_ERROR(ProcessGraph(body, StrCat(name, "/"), inner, false));
        values_[name] = values_.at(StrCat(name, "/", body.outputs(0)));
        return absl::OkStatus();
      }
      case v1::MANUAL_REGION: return ProcessRegion(n, prefix, name);
      case v1::WHILE:
      case v1::CONDITIONAL:
      case v1::SCAN: return ProcessControl(n, prefix, name);
      case v1::TUPLE_ELEMENT: {
        const int k = n.tuple_element().index();
        if (auto region = values_.find(StrCat(prefix, n.operands(0), "#", k));
            region != values_.end()) {
          values_[name] = region->second;  // a result of a manual region
          return absl::OkStatus();
        }
        v.s = control_results_.at(StrCat(prefix, n.operands(0)))[k];
        v1::Node ln = n;
        ln.set_name(Fresh(name));
        ln.set_operands(0, operand(0).local);
        *ln.mutable_type() = LocalType(n.type(), v.s, mesh_);
        TESSEL_ASSIGN_OR_RETURN(v.local, Emit(std::move(ln)));
        values_[name] = v;
        return absl::OkStatus();
      }
      default: break;
    }
    const ops::OpRules* rules = ops::Find(n.op());
    if (rules == nullptr || rules->layout == nullptr) {
      return absl::UnimplementedError(StrCat("the partitioner has no rule for ", OpName(n.op())));
    }
    // The layout each operand must take and the result's, from the op's row.
    ops::LayoutQuery q{.node = n, .mesh = mesh_};
    for (int i = 0; i < n.operands_size(); ++i) {
      const Value& o = operand(i);
      q.current.push_back(o.generated ? Replicated(o.global.dims_size()) : o.s);
      q.generated.push_back(o.generated);
      q.types.push_back(&o.global);
    }
    ops::Layout layout;
    layout.want.resize(n.operands_size());
    layout.result = Replicated(rank);
    rules->layout(q, layout);
    v1::Node local = n;
    local.set_name(Fresh(name));
    local.clear_operands();
    for (int i = 0; i < n.operands_size(); ++i) {
      TESSEL_ASSIGN_OR_RETURN(std::string lo,
                              Reshard(StrCat(prefix, n.operands(i)), layout.want[i], why));
      local.add_operands(lo);
    }
    const v1::TensorType lt = LocalType(n.type(), layout.result, mesh_);
    const ops::Lowering lowering{
        .node = n, .name = name, .layout = layout, .local_type = lt, .types = q.types};
    TESSEL_ASSIGN_OR_RETURN(v.local, rules->lower != nullptr
                                         ? rules->lower(*this, lowering, std::move(local))
                                         : Emit(std::move(local)));
    v.s = layout.result;
    values_[name] = v;
    return absl::OkStatus();
  }

  // ---------------------------------------------------------------- control flow

  // A loop's carries keep the layout they start with (the fixed point is
  // declared, not searched for): the body is partitioned with its
  // parameters and results in that layout, and what it computes is
  // resharded to it, with that reason. Scanned operands are unsplit along
  // the scanned dimension; a conditional's index is replicated; branches
  // give branch 0's layouts. Each function is partitioned for the layouts
  // it is called with (named fn@hash).
  absl::Status ProcessControl(const v1::Node& n, const std::string& prefix,
                              const std::string& name) {
    const v1::ControlFlowAttrs& c = n.control();
    const std::string what = StrCat(OpName(n.op()), " '", name, "'");
    const int nc = n.op() == v1::WHILE ? n.operands_size() : n.op() == v1::SCAN ? c.num_carry() : 0;
    std::vector<v1::Sharding> in(n.operands_size());
    v1::Node ln = n;
    ln.set_name(Fresh(name));
    ln.clear_operands();
    ln.clear_results();
    ln.mutable_control()->clear_branches();
    for (int i = 0; i < n.operands_size(); ++i) {
      const Value& o = values_.at(StrCat(prefix, n.operands(i)));
      const int rank = o.global.dims_size();
      v1::Sharding s = o.generated ? Replicated(rank) : Complete(o.s);
      if (n.op() == v1::CONDITIONAL && i == 0) s = Replicated(0);
      if (n.op() == v1::SCAN && i >= nc && rank > 0) SetDimAxes(s, 0, {});
      in[i] = s;
    }
    // A carry that starts from a generated value (zeros, iota) may start in
    // any layout at no cost: it takes the one the body gives it, found by
    // partitioning the body once with those carries left to it.
    if (nc > 0) {
      std::vector<v1::Sharding> params(in.begin(), in.begin() + nc), outs = params;
      bool any = false;
      for (int i = 0; i < nc; ++i) {
        if (!values_.at(StrCat(prefix, n.operands(i))).generated) continue;
        outs[i].set_unspecified(true);
        any = true;
      }
      for (int i = nc; i < n.operands_size(); ++i) {
        v1::Sharding s = in[i];
        s.mutable_dims()->erase(s.mutable_dims()->begin());
        params.push_back(s);
      }
      for (int y = nc; y < n.results_size(); ++y) outs.emplace_back().set_unspecified(true);
      if (any) {
        TESSEL_ASSIGN_OR_RETURN(std::vector<v1::Sharding> found,
                                ProbeFunction(c.body(), params, outs, what));
        for (int i = 0; i < nc; ++i) {
          if (outs[i].unspecified() && !IsPartial(found[i])) in[i] = found[i];
        }
      }
    }
    for (int i = 0; i < n.operands_size(); ++i) {
      TESSEL_ASSIGN_OR_RETURN(std::string lo, Reshard(StrCat(prefix, n.operands(i)), in[i],
                                                      StrCat(what, " takes operand ", i, " as ",
                                                             ShardingString(in[i]))));
      ln.add_operands(lo);
    }
    std::vector<v1::Sharding> results;
    if (n.op() == v1::CONDITIONAL) {
      const std::vector<v1::Sharding> args(in.begin() + 1, in.end());
      std::vector<v1::Sharding> outs;
      for (int b = 0; b < c.branches_size(); ++b) {
        TESSEL_ASSIGN_OR_RETURN(auto f, PartitionFunction(c.branches(b), args, outs, what));
        ln.mutable_control()->add_branches(f.first);
        if (b == 0) outs = f.second;
      }
      results = outs;
    } else {
      const std::vector<v1::Sharding> carries(in.begin(), in.begin() + nc);
      std::vector<v1::Sharding> params = carries;
      for (int i = nc; i < n.operands_size(); ++i) {  // a scanned operand's slice
        v1::Sharding s = in[i];
        s.mutable_dims()->erase(s.mutable_dims()->begin());
        params.push_back(s);
      }
      if (n.op() == v1::WHILE) {
        TESSEL_ASSIGN_OR_RETURN(auto cond,
                                PartitionFunction(c.cond(), carries, {Replicated(0)}, what));
        ln.mutable_control()->set_cond(cond.first);
      }
      std::vector<v1::Sharding> outs = carries;
      const int ys = n.results_size() - nc;
      for (int y = 0; y < ys; ++y) {
        v1::Sharding any;
        any.set_unspecified(true);
        outs.push_back(any);
      }
      TESSEL_ASSIGN_OR_RETURN(auto body, PartitionFunction(c.body(), params, outs, what));
      ln.mutable_control()->set_body(body.first);
      results = carries;
      for (int y = nc; y < int(body.second.size()); ++y) {
        v1::Sharding s;
        s.add_dims();  // the stacked dimension: unsplit
        for (const auto& d : body.second[y].dims()) *s.add_dims() = d;
        results.push_back(s);
      }
    }
    for (int k = 0; k < n.results_size(); ++k)
      *ln.add_results() = LocalType(n.results(k), results[k], mesh_);
    Value v;
    v.node = &n;
    v.prefix = prefix;
    TESSEL_ASSIGN_OR_RETURN(v.local, Emit(std::move(ln)));
    values_[name] = v;
    control_results_[name] = std::move(results);
    return absl::OkStatus();
  }

  // The layouts `fn`'s results take for parameters laid out as `params`
  // (nothing recorded).
  absl::StatusOr<std::vector<v1::Sharding>> ProbeFunction(const std::string& fn,
                                                          const std::vector<v1::Sharding>& params,
                                                          const std::vector<v1::Sharding>& outs,
                                                          const std::string& what) {
    for (const v1::Graph& g : g_.graph.functions()) {
      if (g.name() != fn) continue;
      v1::Graph graph = g;
      *graph.mutable_functions() = g_.graph.functions();
      auto typed = ValidateGraph(graph);
      if (!typed.ok()) return Annotate(typed.status(), StrCat(what, ": function '", fn, "': "));
      auto part = Partition(*typed, {mesh_, params, outs});
      if (!part.ok()) return Annotate(part.status(), StrCat(what, ": function '", fn, "': "));
      return std::move(part->output_shardings);
    }
    return InvalidArgumentError(StrCat(what, ": function '", fn, "' is not defined"));
  }

  // Function `fn` partitioned for parameters laid out as `params` and
  // results as `outs` (empty or an entry unspecified: its choice). Returns
  // the per-device function's name and its results' layouts.
  absl::StatusOr<std::pair<std::string, std::vector<v1::Sharding>>> PartitionFunction(
      const std::string& fn, const std::vector<v1::Sharding>& params,
      const std::vector<v1::Sharding>& outs, const std::string& what) {
    const v1::Graph* f = nullptr;
    for (const v1::Graph& g : g_.graph.functions()) {
      if (g.name() == fn) f = &g;
    }
    if (f == nullptr)
      return InvalidArgumentError(StrCat(what, ": function '", fn, "' is not defined"));
    v1::Graph graph = *f;
    *graph.mutable_functions() = g_.graph.functions();  // for the loops inside it
    auto typed = ValidateGraph(graph);
    if (!typed.ok()) return Annotate(typed.status(), StrCat(what, ": function '", fn, "': "));
    std::string key = StrCat(fn, " in");
    for (const v1::Sharding& s : params) absl::StrAppend(&key, " ", ShardingString(s));
    absl::StrAppend(&key, " out");
    for (const v1::Sharding& s : outs)
      absl::StrAppend(&key, " ", s.unspecified() ? "auto" : ShardingString(s));
    uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char ch : key) h = (h ^ ch) * 0x100000001b3ull;
    const std::string local_name = StrCat(fn, "@", absl::Hex(h & 0xffffffffull, absl::kZeroPad8));
    auto part = Partition(*typed, {mesh_, params, outs});
    if (!part.ok()) return Annotate(part.status(), StrCat(what, ": function '", fn, "': "));
    for (PlannedCollective& pc : part->collectives) {
      pc.reason = StrCat("in function '", fn, "' (each time it runs): ", pc.reason);
      out_.collectives.push_back(std::move(pc));
    }
    for (std::string& d : part->diagnostics) out_.diagnostics.push_back(std::move(d));
    auto add = [&](v1::Graph g) {
      for (const v1::Graph& have : out_.local.functions()) {
        if (have.name() == g.name()) return;
      }
      *out_.local.add_functions() = std::move(g);
    };
    for (v1::Graph& nested : *part->local.mutable_functions()) add(std::move(nested));
    part->local.clear_functions();
    part->local.set_name(local_name);
    add(std::move(part->local));
    return std::make_pair(local_name, std::move(part->output_shardings));
  }

  // ---------------------------------------------------------------- manual regions

  absl::Status ProcessRegion(const v1::Node& n, const std::string& prefix,
                             const std::string& name) {
    const v1::ManualRegionAttrs& m = n.manual_region();
    const std::string label = StrCat("manual region '", name, "'");
    std::vector<std::string> inputs;
    std::vector<Varying> input_varying;
    absl::flat_hash_map<std::string, std::string> bind;  // body parameter -> local value
    absl::flat_hash_map<std::string, Varying> varying;   // body value (prefixed) -> axes
    for (int i = 0; i < n.operands_size(); ++i) {
      const Value& ov = values_.at(StrCat(prefix, n.operands(i)));
      v1::Sharding spec = NormalizeSharding(m.in_specs(i), ov.global.dims_size());
      TESSEL_RETURN_IF_ERROR(
          ValidateSharding(spec, mesh_, ov.global, StrCat(label, " in_spec ", i)));
      if (IsPartial(spec)) {
        return InvalidArgumentError(StrCat(label, " in_spec ", i, " ", ShardingString(spec),
                                           ": inputs are complete values"));
      }
      TESSEL_ASSIGN_OR_RETURN(std::string lo,
                              Reshard(StrCat(prefix, n.operands(i)), spec,
                                      StrCat(label, " in_spec ", i, " ", ShardingString(spec))));
      inputs.push_back(lo);
      input_varying.push_back(
          SpecVarying(spec, StrCat("operand ", i, " '", n.operands(i),
                                   "' is split over it by in_spec ", ShardingString(spec))));
    }
    auto body = ValidateGraph(m.body(), {.manual_mesh = &mesh_, .functions = &functions_});
    if (!body.ok()) return Annotate(body.status(), StrCat(label, " body: "));
    if (body->parameters.size() != inputs.size()) {
      return InvalidArgumentError(StrCat(label, ": body takes ", body->parameters.size(),
                                         " parameters; the region has ", inputs.size(),
                                         " operands"));
    }
    const std::string bprefix = StrCat(name, "/");
    for (size_t i = 0; i < body->parameters.size(); ++i) {
      const v1::Node& p = body->graph.nodes(body->parameters[i]);
      const int idx = p.parameter().index();
      const v1::TensorType& have = local_types_.at(inputs[idx]);
      if (!SameType(have, p.type())) {
        return InvalidArgumentError(
            StrCat(label, " body parameter ", idx, " '", p.name(), "': its block under in_spec ",
                   ShardingString(m.in_specs(idx)), " is ", TypeString(have),
                   ", the body declares ", TypeString(p.type())));
      }
      bind[p.name()] = inputs[idx];
      varying[StrCat(bprefix, p.name())] = input_varying[idx];
    }
    regions_.push_back(std::make_unique<v1::Graph>(body->graph));
    const v1::Graph& b = *regions_.back();
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> outs,
                            EmitManual(b, bprefix, bind, varying, label));
    const bool multi = m.out_specs_size() > 0;
    for (int k = 0; k < b.outputs_size(); ++k) {
      const v1::TensorType& global = multi ? n.results(k) : n.type();
      const std::string what = multi ? StrCat(label, " out_specs ", k) : StrCat(label, " out_spec");
      // The out_spec may replicate a result only over axes it does not vary
      // over (or may, through a kernel with no rule: trusted, as
      // shard_map's check_rep=False).
      v1::Sharding spec =
          NormalizeSharding(multi ? m.out_specs(k) : m.out_spec(), global.dims_size());
      TESSEL_RETURN_IF_ERROR(ValidateSharding(spec, mesh_, global, what));
      absl::flat_hash_set<std::string> covered(spec.partial().begin(), spec.partial().end());
      for (const auto& d : spec.dims()) covered.insert(d.axes().begin(), d.axes().end());
      const Varying& out_varying = varying[StrCat(bprefix, b.outputs(k))];
      for (const std::string& axis : mesh_.axis_names()) {
        auto it = out_varying.why.find(axis);
        if (it == out_varying.why.end() || covered.contains(axis)) continue;
        return InvalidArgumentError(StrCat(
            label, ": output '", b.outputs(k), "' varies over mesh axis '", axis, "' (", it->second,
            "), but ", multi ? StrCat("out_specs ", k) : std::string("out_spec"), " ",
            ShardingString(spec), " replicates it over '", axis,
            "'. Reduce it in the body (psum), split a dimension over '", axis, "', or mark '", axis,
            "' partial in out_spec to leave it as a partial sum; nothing is inserted silently"));
      }
      const v1::TensorType want_local = LocalType(global, spec, mesh_);
      if (!SameType(want_local, local_types_.at(outs[k]))) {
        return InvalidArgumentError(StrCat(label, ": the result ", TypeString(global), " under ",
                                           what, " ", ShardingString(spec), " has blocks of ",
                                           TypeString(want_local), "; the body gives ",
                                           TypeString(local_types_.at(outs[k]))));
      }
      Value v;
      v.global = global;
      v.local = outs[k];
      v.s = spec;
      values_[multi ? StrCat(name, "#", k) : name] = v;
    }
    return absl::OkStatus();
  }

  // Emits a body (per-device shapes) as written; returns its outputs' local names.
  absl::StatusOr<std::vector<std::string>> EmitManual(
      const v1::Graph& body, const std::string& bprefix,
      const absl::flat_hash_map<std::string, std::string>& bind,
      absl::flat_hash_map<std::string, Varying>& varying, const std::string& label) {
    absl::flat_hash_map<std::string, std::string> local;  // body name -> local name
    for (const v1::Node& bn : body.nodes()) {
      const std::string full = StrCat(bprefix, bn.name());
      if (bn.op() == v1::PARAMETER) {
        local[bn.name()] = bind.at(bn.name());
        continue;
      }
      if (bn.op() == v1::MANUAL_REGION || bn.op() == v1::SHARDING_CONSTRAINT) {
        return InvalidArgumentError(StrCat(label, ": node '", bn.name(), "' (", OpName(bn.op()),
                                           ") cannot appear inside a manual region"));
      }
      Varying vr;
      if (bn.op() == v1::TUPLE_ELEMENT) {
        vr = varying[StrCat(bprefix, bn.operands(0), "#", bn.tuple_element().index())];
      } else {
        std::vector<Varying> ops;
        for (const std::string& o : bn.operands()) ops.push_back(varying[StrCat(bprefix, o)]);
        TESSEL_ASSIGN_OR_RETURN(std::vector<Varying> results, analysis_.Of(bn, ops, label));
        if (IsMultiResult(bn)) {
          for (size_t k = 0; k < results.size(); ++k)
            varying[StrCat(full, "#", k)] = std::move(results[k]);
        } else {
          vr = std::move(results.at(0));
        }
      }
      if (bn.op() == v1::CUSTOM_KERNEL) {
        TESSEL_ASSIGN_OR_RETURN(TypedGraph d, ValidateGraph(bn.custom_kernel().decomposition()));
        absl::flat_hash_map<std::string, std::string> inner;
        absl::flat_hash_map<std::string, Varying> inner_varying;
        for (size_t i = 0; i < d.parameters.size(); ++i) {
          const v1::Node& p = d.graph.nodes(d.parameters[i]);
          inner[p.name()] = local.at(bn.operands(p.parameter().index()));
        }
        decompositions_.push_back(std::make_unique<v1::Graph>(std::move(d.graph)));
        TESSEL_ASSIGN_OR_RETURN(
            std::vector<std::string> r,
            EmitManual(*decompositions_.back(), StrCat(full, "/"), inner, inner_varying, label));
        local[bn.name()] = r.at(0);
        varying[full] = std::move(vr);
        continue;
      }
      v1::Node ln = bn;
      ln.set_name(Fresh(full));
      ln.clear_operands();
      for (const std::string& o : bn.operands()) ln.add_operands(local.at(o));
      if (IsCollective(bn.op())) {
        const std::string& why = bn.collective().reason();
        ln.mutable_collective()->set_reason(why.empty() ? StrCat("explicit in ", label)
                                                        : StrCat(why, " (in ", label, ")"));
        if ((bn.op() == v1::ALL_REDUCE || bn.op() == v1::REDUCE_SCATTER) &&
            ln.collective().kind() == v1::REDUCE_INVALID) {
          ln.mutable_collective()->set_kind(v1::SUM);
        }
      }
      TESSEL_ASSIGN_OR_RETURN(std::string emitted, Emit(ln));
      if (IsCollective(bn.op()) && bn.op() != v1::AXIS_INDEX) {
        const auto& axes = bn.collective().axes();
        Record(emitted, bn.op(), ln.operands(0), Axes(axes.begin(), axes.end()),
               ln.collective().reason());
      }
      local[bn.name()] = emitted;
      varying[full] = std::move(vr);
    }
    std::vector<std::string> outs;
    for (const std::string& o : body.outputs()) outs.push_back(local.at(o));
    return outs;
  }

  const TypedGraph& g_;
  const PartitionOptions& o_;
  const v1::Mesh& mesh_;
  FunctionTable functions_;  // the graph's, for control flow in manual regions
  VaryingAnalysis analysis_;
  PartitionedGraph out_;
  absl::flat_hash_map<std::string, Value> values_;
  absl::flat_hash_map<std::string, std::vector<v1::Sharding>>
      control_results_;  // a control node's results' layouts
  absl::flat_hash_map<std::string, v1::TensorType> local_types_;
  absl::flat_hash_map<std::string, std::string> reshard_cache_;
  absl::flat_hash_set<std::string> used_names_;
  std::vector<std::unique_ptr<v1::Graph>> decompositions_, regions_;  // nodes referenced by values_
};

}  // namespace

absl::StatusOr<PartitionedGraph> Partition(const TypedGraph& g, const PartitionOptions& options) {
  return Partitioner(g, options).Run();
}

absl::StatusOr<v1::Graph> LowerUnpartitioned(const TypedGraph& g) {
  v1::Graph out;
  out.set_name(g.graph.name());
  absl::flat_hash_map<std::string, std::string> rename;
  // Inlines `graph` with names under `prefix`; parameters bound through `bind`.
  std::function<absl::Status(const v1::Graph&, const std::string&,
                             const absl::flat_hash_map<std::string, std::string>&, bool)>
      inline_graph = [&](const v1::Graph& graph, const std::string& prefix,
                         const absl::flat_hash_map<std::string, std::string>& bind,
                         bool top) -> absl::Status {
    for (const v1::Node& n : graph.nodes()) {
      const std::string name = StrCat(prefix, n.name());
      if (n.op() == v1::PARAMETER && !top) {
        rename[name] = bind.at(n.name());
        continue;
      }
      if (n.op() == v1::MANUAL_REGION) {
        return InvalidArgumentError(
            StrCat("node '", name,
                   "' (manual_region): a manual region needs a mesh; compile "
                   "with one"));
      }
      if (n.op() == v1::SHARDING_CONSTRAINT) {
        rename[name] = rename.at(StrCat(prefix, n.operands(0)));
        continue;
      }
      if (n.op() == v1::CUSTOM_KERNEL) {
        TESSEL_ASSIGN_OR_RETURN(TypedGraph d, ValidateGraph(n.custom_kernel().decomposition()));
        absl::flat_hash_map<std::string, std::string> inner;
        for (size_t i = 0; i < d.parameters.size(); ++i) {
          const v1::Node& p = d.graph.nodes(d.parameters[i]);
          inner[p.name()] = rename.at(StrCat(prefix, n.operands(p.parameter().index())));
        }
        TESSEL_RETURN_IF_ERROR(inline_graph(d.graph, StrCat(name, "/"), inner, false));
        rename[name] = rename.at(StrCat(name, "/", d.graph.outputs(0)));
        continue;
      }
      v1::Node c = n;
      c.set_name(name);
      c.clear_operands();
      for (const std::string& o : n.operands()) c.add_operands(rename.at(StrCat(prefix, o)));
      rename[name] = name;
      *out.add_nodes() = std::move(c);
    }
    return absl::OkStatus();
  };
  TESSEL_RETURN_IF_ERROR(inline_graph(g.graph, "", {}, true));
  for (const std::string& o : g.graph.outputs()) out.add_outputs(rename.at(o));
  return out;
}

}  // namespace tessel::scheduler

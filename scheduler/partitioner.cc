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
#include "scheduler/varying.h"

namespace tessel::scheduler {
namespace {

using absl::InvalidArgumentError;
using absl::StrCat;
using Axes = std::vector<std::string>;

Axes DimAxes(const v1::Sharding& s, int d) { return {s.dims(d).axes().begin(), s.dims(d).axes().end()}; }
void SetDimAxes(v1::Sharding& s, int d, const Axes& a) {
  s.mutable_dims(d)->clear_axes();
  for (const std::string& x : a) s.mutable_dims(d)->add_axes(x);
}
v1::Sharding Complete(v1::Sharding s) {
  s.clear_partial();
  return s;
}
Axes PartialAxes(const v1::Sharding& s) { return {s.partial().begin(), s.partial().end()}; }
std::string AxesText(const Axes& a) { return absl::StrJoin(a, ", "); }

// Ops a partial sum passes through unchanged: sum_d f(x_d) is f(sum_d x_d)
// in floating point too. Not a conversion: a narrower float overflows on a
// device whose part is large where the sum fits (and a wider one need not
// overflow where the narrow sum does).
bool IsLinearUnary(const v1::Node& n, const v1::TensorType& operand) {
  (void)operand;
  return n.op() == v1::NEG;
}

}  // namespace

PlannedCollective PlanCollective(const v1::Mesh& mesh, const std::string& value, v1::Op op,
                                 const std::vector<std::string>& axes, const v1::TensorType& in_type,
                                 const v1::TensorType& out_type, const std::string& reason) {
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

class Partitioner {
 public:
  Partitioner(const TypedGraph& g, const PartitionOptions& o) : g_(g), o_(o), mesh_(o.mesh), functions_(g.graph),
        analysis_(o.mesh, g.graph.functions()) {}

  absl::StatusOr<PartitionedGraph> Run() {
    out_.local.set_name(g_.graph.name());
    const int np = g_.parameters.size();
    if (!o_.parameter_shardings.empty() && int(o_.parameter_shardings.size()) != np) {
      return InvalidArgumentError(StrCat("graph has ", np, " parameters; ", o_.parameter_shardings.size(),
                                         " parameter shardings given"));
    }
    if (!o_.output_shardings.empty() && int(o_.output_shardings.size()) != g_.graph.outputs_size()) {
      return InvalidArgumentError(StrCat("graph has ", g_.graph.outputs_size(), " outputs; ",
                                         o_.output_shardings.size(), " output shardings given"));
    }
    out_.parameter_shardings.resize(np);
    for (int i = 0; i < np; ++i) {
      const v1::Node& p = g_.graph.nodes(g_.parameters[i]);
      const v1::Sharding s = o_.parameter_shardings.empty() ? Replicated(p.type().dims_size())
                                                     : NormalizeSharding(o_.parameter_shardings[i], p.type().dims_size());
      TESSEL_RETURN_IF_ERROR(ValidateSharding(s, mesh_, p.type(), StrCat("parameter ", i, " '", p.name(), "'")));
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
      TESSEL_ASSIGN_OR_RETURN(std::string local, Reshard(name, want, StrCat(label, " wants ", ShardingString(want))));
      out_.local.add_outputs(local);
      out_.output_shardings.push_back(want);
    }
    return std::move(out_);
  }

 private:
  struct Value {
    std::string local;       // per-device graph name (empty while generated and not materialized)
    v1::Sharding s;          // normalized; meaningless while generated
    v1::TensorType global;
    bool generated = false;  // regenerated per block on demand
    const v1::Node* node = nullptr;  // the defining node (generated values)
    std::string prefix;              // its graph's name prefix
  };

  std::string Fresh(const std::string& base) {
    std::string name = base;
    for (int k = 1; !used_names_.insert(name).second; ++k) name = StrCat(base, ".", k);
    return name;
  }

  // Appends a node with its per-device type inferred from its operands.
  absl::StatusOr<std::string> Emit(v1::Node n) {
    std::vector<const v1::TensorType*> types;
    for (const std::string& o : n.operands()) types.push_back(&local_types_.at(o));
    if (n.op() != v1::PARAMETER && n.op() != v1::CONSTANT && !IsCollective(n.op()) && n.op() != v1::SHARD_SLICE &&
        !IsControlFlow(n.op()) && n.op() != v1::TUPLE_ELEMENT) {
      n.clear_type();
      auto t = InferType(n, types);
      if (!t.ok()) return Annotate(t.status(), StrCat("partitioned node '", n.name(), "': "));
      *n.mutable_type() = *t;
    }
    local_types_[n.name()] = n.type();
    *out_.local.add_nodes() = n;
    return n.name();
  }

  // The lowest value of a dtype, as a fill: -inf, or the least integer.
  static std::pair<double, int64_t> LowestValue(v1::DType dt) {
    switch (dt) {
      case v1::S8: return {0, std::numeric_limits<int8_t>::min()};
      case v1::S16: return {0, std::numeric_limits<int16_t>::min()};
      case v1::S32: return {0, std::numeric_limits<int32_t>::min()};
      case v1::S64: return {0, std::numeric_limits<int64_t>::min()};
      case v1::U8:
      case v1::U16:
      case v1::U32:
      case v1::U64:
      case v1::PRED: return {0, 0};
      default: return {-std::numeric_limits<double>::infinity(), 0};
    }
  }

  // A node of `op` over `operands` (type inferred), named after `base`.
  absl::StatusOr<std::string> EmitOp(v1::Op op, std::vector<std::string> operands, const std::string& base,
                                     const std::function<void(v1::Node&)>& attrs = {}) {
    v1::Node n;
    n.set_name(Fresh(base));
    n.set_op(op);
    for (std::string& o : operands) n.add_operands(std::move(o));
    if (attrs) attrs(n);
    return Emit(std::move(n));
  }
  // Every element of type `t` equal to `f` (floating types) or `i`.
  absl::StatusOr<std::string> EmitFill(const v1::TensorType& t, double f, int64_t i, const std::string& base) {
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
  absl::StatusOr<std::string> BlockIndices(const std::string& indices, const Axes& axes, int64_t extent,
                                           int64_t block, bool clamp, const std::string& base) {
    const v1::TensorType& it = local_types_.at(indices);
    v1::TensorType s64 = it, scalar;
    s64.set_dtype(v1::S64);
    scalar.set_dtype(v1::S64);
    std::string src = indices;
    if (it.dtype() == v1::U64) {  // a u64 past int64 is out of range: it must stay past the end, not wrap negative
      v1::TensorType u64;
      u64.set_dtype(v1::U64);
      TESSEL_ASSIGN_OR_RETURN(std::string lo, EmitFill(u64, 0, 0, base + ".u64_lo"));
      TESSEL_ASSIGN_OR_RETURN(std::string hi, EmitFill(u64, 0, INT64_MAX, base + ".u64_hi"));
      TESSEL_ASSIGN_OR_RETURN(src, EmitOp(v1::CLAMP, {lo, src, hi}, base + ".u64_clamp"));
    }
    TESSEL_ASSIGN_OR_RETURN(std::string idx, EmitOp(v1::CONVERT, {src}, base + ".s64",
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
    TESSEL_ASSIGN_OR_RETURN(at, EmitOp(v1::CONVERT, {at}, base + ".block",
                                       [](v1::Node& n) { n.mutable_convert()->set_dtype(v1::S64); }));
    TESSEL_ASSIGN_OR_RETURN(std::string size, EmitFill(scalar, 0, block, base + ".block_size"));
    TESSEL_ASSIGN_OR_RETURN(std::string offset, EmitOp(v1::MUL, {at, size}, base + ".offset"));
    TESSEL_ASSIGN_OR_RETURN(offset, EmitOp(v1::BROADCAST_IN_DIM, {offset}, base + ".offset", [&](v1::Node& n) {
                              *n.mutable_broadcast_in_dim()->mutable_dims() = s64.dims();
                            }));
    return EmitOp(v1::SUB, {idx, offset}, base + ".local");
  }

  absl::StatusOr<std::string> EmitCollective(v1::Op op, const std::string& input, const std::string& base,
                                             const Axes& axes, int64_t dim, int64_t concat_dim, v1::ReduceKind kind,
                                             const std::string& reason, const std::vector<int64_t>& pairs = {}) {
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
    out_.collectives.push_back(
        PlanCollective(mesh_, name, op, axes, local_types_.at(input), local_types_.at(name), reason));
  }

  // The value `name` laid out as `want` (normalized, same rank): itself, or
  // what the fewest collectives make of it.
  absl::StatusOr<std::string> Reshard(const std::string& name, const v1::Sharding& want, const std::string& why) {
    Value& v = values_.at(name);
    if (v.generated) return Regenerate(name, want);
    if (SameSharding(v.s, want)) return v.local;
    const std::string key = StrCat(name, "|", ShardingString(want));
    if (auto it = reshard_cache_.find(key); it != reshard_cache_.end()) return it->second;
    const std::string what = StrCat("'", name, "' ", TypeString(v.global), " ", ShardingString(v.s), " -> ",
                                    ShardingString(want));
    std::string cur = v.local;
    v1::Sharding s = v.s;
    // 1. Partial sums: kept where `want` keeps them; resolved by
    //    reduce_scatter into a dimension `want` splits, else all_reduce.
    if (IsPartial(s)) {
      Axes resolve;
      for (const std::string& a : s.partial()) {
        const bool kept = std::find(want.partial().begin(), want.partial().end(), a) != want.partial().end() &&
                          want.partial_kind() == s.partial_kind();
        if (!kept) resolve.push_back(a);
      }
      for (int d = 0; d < want.dims_size() && !resolve.empty(); ++d) {
        const Axes target = DimAxes(want, d);
        if (target.empty() || !DimAxes(s, d).empty()) continue;
        bool all = true;
        for (const std::string& a : target) all &= std::find(resolve.begin(), resolve.end(), a) != resolve.end();
        if (!all) continue;
        TESSEL_ASSIGN_OR_RETURN(
            cur, EmitCollective(v1::REDUCE_SCATTER, cur, name, target, d, 0, s.partial_kind(),
                                StrCat(why, ": ", what, ": the partial result over ", AxesText(target),
                                       " is reduced straight into the split of dimension ", d)));
        SetDimAxes(s, d, target);
        for (const std::string& a : target) resolve.erase(std::find(resolve.begin(), resolve.end(), a));
      }
      if (!resolve.empty()) {
        TESSEL_ASSIGN_OR_RETURN(cur, EmitCollective(v1::ALL_REDUCE, cur, name, resolve, 0, 0, s.partial_kind(),
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
        return InvalidArgumentError(StrCat(why, ": ", what, ": a complete value cannot be made a partial sum over '",
                                           a, "'"));
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
        TESSEL_ASSIGN_OR_RETURN(cur, EmitCollective(v1::ALL_TO_ALL, cur, name, have, to, d, v1::REDUCE_INVALID,
                                                    StrCat(why, ": ", what, ": the split over ", AxesText(have),
                                                           " moves from dimension ", d, " to ", to)));
        SetDimAxes(s, to, have);
      } else {
        TESSEL_ASSIGN_OR_RETURN(cur, EmitCollective(v1::ALL_GATHER, cur, name, have, d, 0, v1::REDUCE_INVALID,
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
      TESSEL_ASSIGN_OR_RETURN(cur, EmitCollective(v1::SHARD_SLICE, cur, name, extra, d, 0, v1::REDUCE_INVALID,
                                                  StrCat(why, ": ", what)));
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
        for (const std::string& a : want.dims(d).axes()) n.mutable_constant()->mutable_iota()->add_sharded_axes(a);
      }
    } else {
      for (const std::string& o : src.operands()) {
        const std::string full = StrCat(v.prefix, o);
        const Value& ov = values_.at(full);
        TESSEL_ASSIGN_OR_RETURN(std::string lo,
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
    if (n.op() == v1::BROADCAST_IN_DIM) return values_.at(StrCat(prefix, n.operands(0))).global.dims_size() == 0;
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

  absl::Status ProcessNode(const v1::Node& n, const std::string& prefix, const std::string& name, bool top) {
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
        TESSEL_RETURN_IF_ERROR(ValidateSharding(want, mesh_, n.type(), StrCat("sharding constraint '", name, "'")));
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
        if (auto region = values_.find(StrCat(prefix, n.operands(0), "#", k)); region != values_.end()) {
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
    // Decide the layout each operand must take and the result's.
    Axes gather_split;  // GATHER: the mesh axes its indexed dimension stays split over
    std::vector<v1::Sharding> want(n.operands_size());
    v1::Sharding result = Replicated(rank);
    const auto& op_type = [&](int i) -> const v1::TensorType& { return operand(i).global; };
    auto current = [&](int i) {
      const Value& o = operand(i);
      return o.generated ? Replicated(o.global.dims_size()) : o.s;
    };
    if (IsElementwise(n.op())) {
      int best = -1, best_split = -1;
      for (int i = 0; i < n.operands_size(); ++i) {
        if (operand(i).generated) continue;
        int split = 0;
        const v1::Sharding cur = current(i);
        for (const auto& d : cur.dims()) split += d.axes_size() > 0;
        if (split > best_split) best = i, best_split = split;
      }
      v1::Sharding t = best >= 0 ? Complete(current(best)) : Replicated(rank);
      std::optional<v1::Sharding> partial;
      auto all_partial_same = [&] {
        for (int i = 0; i < n.operands_size(); ++i) {
          if (operand(i).generated || !IsPartial(current(i)) || current(i).partial_kind() != v1::SUM) return false;
          if (PartialAxes(current(i)) != PartialAxes(current(0))) return false;
        }
        return true;
      };
      if ((n.op() == v1::ADD || n.op() == v1::SUB) && all_partial_same()) {
        partial = current(0);
      } else if (n.operands_size() == 1 && IsLinearUnary(n, op_type(0)) && IsPartial(current(0)) &&
                 current(0).partial_kind() == v1::SUM) {
        partial = current(0);
      }
      // Not through MUL or DIV: sum_d(x_d * y) is (sum_d x_d) * y only for a
      // finite y (a device whose x_d is 0 meets an infinite y with NaN,
      // where the complete sum would give an infinity).
      if (partial) {
        for (const std::string& a : partial->partial()) t.add_partial(a);
      }
      for (int i = 0; i < n.operands_size(); ++i) {
        want[i] = t;
        if (IsPartial(t) && !IsPartial(current(i))) want[i] = Complete(t);
        if (op_type(i).dims_size() != rank) want[i] = Replicated(op_type(i).dims_size());  // clamp's scalar bounds
      }
      result = t;
    } else {
      switch (n.op()) {
        case v1::CONSTANT: break;  // a literal: shipped whole
        case v1::BROADCAST_IN_DIM: {
          want[0] = current(0);
          const auto& bd = n.broadcast_in_dim().broadcast_dimensions();
          for (int i = 0; i < bd.size(); ++i) {
            if (op_type(0).dims(i) == n.type().dims(bd[i])) {
              SetDimAxes(result, bd[i], DimAxes(want[0], i));
            } else {
              SetDimAxes(want[0], i, {});
            }
          }
          *result.mutable_partial() = want[0].partial();
          result.set_partial_kind(want[0].partial_kind());
          break;
        }
        case v1::TRANSPOSE: {
          want[0] = current(0);
          const auto& perm = n.transpose().permutation();
          for (int j = 0; j < perm.size(); ++j) SetDimAxes(result, j, DimAxes(want[0], perm[j]));
          *result.mutable_partial() = want[0].partial();
          result.set_partial_kind(want[0].partial_kind());
          break;
        }
        case v1::RESHAPE: ReshapeRule(op_type(0), n.type(), current(0), want[0], result); break;
        case v1::SLICE: {
          want[0] = current(0);
          const v1::SliceAttrs& sl = n.slice();
          for (int d = 0; d < rank; ++d) {
            const bool full = sl.start(d) == 0 && sl.limit(d) == op_type(0).dims(d) &&
                              (sl.strides_size() == 0 || sl.strides(d) == 1);
            if (!full) SetDimAxes(want[0], d, {});
          }
          result = want[0];
          break;
        }
        case v1::SORT: {
          // Each row must be whole on one device. A split of the sorted
          // dimension moves (all_to_all) to a dimension that is whole and
          // divides, where there is one; else it is gathered.
          const int64_t sd = n.sort().dimension();
          v1::Sharding t = Complete(current(0));
          const Axes moved = DimAxes(t, sd);
          SetDimAxes(t, sd, {});
          if (!moved.empty()) {
            const int64_t k = AxesSize(mesh_, moved);
            for (int e = 0; e < rank; ++e) {
              if (e != sd && DimAxes(t, e).empty() && op_type(0).dims(e) % k == 0 &&
                  op_type(0).dims(e) >= k) {
                SetDimAxes(t, e, moved);
                break;
              }
            }
          }
          for (auto& w : want) w = t;
          result = t;
          break;
        }
        case v1::GATHER: {
          // A split indexed dimension: where the result is smaller than the
          // gathered operand would be, each device reads the slices it holds
          // and puts the lowest value elsewhere, so the result is a partial
          // max over the split (one all_reduce of the result, not an
          // all_gather of the operand); else the dimension is gathered.
          // The operand's other splits and the indices' splits carry to the
          // result, unless a mesh axis would then split two dimensions.
          const int64_t ax = n.gather().axis();
          v1::Sharding x = Complete(current(0)), ix = Complete(current(1));
          const Axes split = DimAxes(x, ax);
          const int64_t k = AxesSize(mesh_, split);
          if (k > 1 && NumElementsUnchecked(n.type()) < NumElementsUnchecked(op_type(0))) {
            gather_split = split;
          } else {
            SetDimAxes(x, ax, {});
          }
          absl::flat_hash_set<std::string> used;
          for (const auto& d : x.dims()) used.insert(d.axes().begin(), d.axes().end());
          for (int d = 0; d < ix.dims_size(); ++d) {
            for (const std::string& a : DimAxes(ix, d)) {
              if (used.contains(a)) {
                SetDimAxes(ix, d, {});
                break;
              }
            }
          }
          want[0] = x;
          want[1] = ix;
          const int ir = op_type(1).dims_size();
          for (int d = 0; d < op_type(0).dims_size(); ++d) {
            if (d < ax) SetDimAxes(result, d, DimAxes(x, d));
            if (d > ax) SetDimAxes(result, d - 1 + ir, DimAxes(x, d));
          }
          for (int d = 0; d < ir; ++d) SetDimAxes(result, int(ax) + d, DimAxes(ix, d));
          for (const std::string& a : gather_split) result.add_partial(a);
          if (!gather_split.empty()) result.set_partial_kind(v1::REDUCE_MAX);
          break;
        }
        case v1::SCATTER: {
          // Every device updates its own block of the operand, keeping its
          // splits, with all the indices (shifted into its block along a
          // split updated dimension: updates for other blocks fall out of
          // range and are dropped) and the updates' matching block. No
          // collective but those that make the indices whole.
          const int64_t ax = n.scatter().axis();
          v1::Sharding x = Complete(current(0));
          const int ir = op_type(1).dims_size();
          want[0] = x;
          want[1] = Replicated(ir);
          want[2] = Replicated(op_type(2).dims_size());
          for (int d = 0; d < op_type(0).dims_size(); ++d) {
            if (d < ax) SetDimAxes(want[2], d, DimAxes(x, d));
            if (d > ax) SetDimAxes(want[2], d - 1 + ir, DimAxes(x, d));
          }
          result = x;
          break;
        }
        case v1::REVERSE:  // linear: a partial sum stays partial
          want[0] = current(0);
          result = want[0];
          break;
        case v1::CONCATENATE: {
          int first = 0;
          for (int i = 0; i < n.operands_size(); ++i) {
            if (!operand(i).generated) {
              first = i;
              break;
            }
          }
          v1::Sharding t = Complete(current(first));
          SetDimAxes(t, n.concatenate().dimension(), {});
          for (auto& w : want) w = t;
          result = t;
          break;
        }
        case v1::PAD: {
          v1::Sharding t = Complete(current(0));
          const v1::PadAttrs& p = n.pad();
          for (int d = 0; d < rank; ++d) {
            if (p.low(d) != 0 || p.high(d) != 0 || (p.interior_size() > 0 && p.interior(d) != 0)) SetDimAxes(t, d, {});
          }
          want[0] = t;
          want[1] = Replicated(0);
          result = t;
          break;
        }
        case v1::REDUCE: {
          const v1::ReduceKind kind = n.reduce().kind();
          want[0] = current(0);
          if (IsPartial(want[0]) && !(kind == v1::SUM && want[0].partial_kind() == v1::SUM)) want[0] = Complete(want[0]);
          absl::flat_hash_set<int64_t> reduced(n.reduce().dims().begin(), n.reduce().dims().end());
          Axes partial = PartialAxes(want[0]);
          int j = 0;
          for (int d = 0; d < op_type(0).dims_size(); ++d) {
            if (reduced.contains(d)) {
              for (const std::string& a : DimAxes(want[0], d)) partial.push_back(a);
            } else {
              SetDimAxes(result, j++, DimAxes(want[0], d));
            }
          }
          for (const std::string& a : partial) result.add_partial(a);
          result.set_partial_kind(partial.empty() ? v1::SUM : kind);
          break;
        }
        case v1::ARGMAX:
        case v1::ARGMIN: {
          want[0] = Complete(current(0));
          const int64_t ad = n.arg_reduce().dimension();
          SetDimAxes(want[0], ad, {});
          int j = 0;
          for (int d = 0; d < op_type(0).dims_size(); ++d) {
            if (d != ad) SetDimAxes(result, j++, DimAxes(want[0], d));
          }
          break;
        }
        case v1::DOT_GENERAL: DotRule(n, current(0), current(1), operand(0).generated, operand(1).generated,
                                      want[0], want[1], result); break;
        default:
          return absl::UnimplementedError(StrCat("the partitioner has no rule for ", OpName(n.op())));
      }
    }
    v1::Node local = n;
    local.set_name(Fresh(name));
    local.clear_operands();
    for (int i = 0; i < n.operands_size(); ++i) {
      TESSEL_ASSIGN_OR_RETURN(std::string lo, Reshard(StrCat(prefix, n.operands(i)), want[i], why));
      local.add_operands(lo);
    }
    const v1::TensorType lt = LocalType(n.type(), result, mesh_);
    if (n.op() == v1::CONSTANT) {
      *local.mutable_type() = lt;
    } else if (n.op() == v1::BROADCAST_IN_DIM) {
      local.mutable_broadcast_in_dim()->clear_dims();
      for (int64_t x : lt.dims()) local.mutable_broadcast_in_dim()->add_dims(x);
    } else if (n.op() == v1::RESHAPE) {
      local.mutable_reshape()->clear_dims();
      for (int64_t x : lt.dims()) local.mutable_reshape()->add_dims(x);
    } else if (n.op() == v1::SLICE) {
      for (int d = 0; d < rank; ++d) {
        if (!result.dims(d).axes().empty()) local.mutable_slice()->set_limit(d, lt.dims(d));
      }
    }
    const int64_t indexed = n.op() == v1::GATHER ? n.gather().axis() : n.op() == v1::SCATTER ? n.scatter().axis() : -1;
    const Axes indexed_split = n.op() == v1::GATHER ? gather_split
                               : n.op() == v1::SCATTER ? DimAxes(result, indexed) : Axes{};
    std::string block_indices;
    if (!indexed_split.empty()) {
      const int64_t extent = op_type(0).dims(indexed);
      TESSEL_ASSIGN_OR_RETURN(block_indices,
                              BlockIndices(local.operands(1), indexed_split, extent,
                                           extent / AxesSize(mesh_, indexed_split), n.op() == v1::GATHER,
                                           Fresh(name)));
      local.set_operands(1, block_indices);
    }
    TESSEL_ASSIGN_OR_RETURN(v.local, Emit(std::move(local)));
    if (n.op() == v1::GATHER && !gather_split.empty()) {
      // Slices another device holds read as the lowest value: the max over
      // the split keeps the one read where it lives (-0.0 and NaN intact).
      const v1::TensorType gt = local_types_.at(v.local), bt = local_types_.at(block_indices);  // copies: Emit rehashes
      const int64_t block = op_type(0).dims(indexed) / AxesSize(mesh_, gather_split);
      v1::TensorType scalar;
      scalar.set_dtype(v1::S64);
      TESSEL_ASSIGN_OR_RETURN(std::string zero, EmitFill(bt, 0, 0, name + ".zero"));
      TESSEL_ASSIGN_OR_RETURN(std::string size, EmitFill(bt, 0, block, name + ".block_size"));
      auto compare = [&](v1::CompareDirection d) {
        return [d](v1::Node& c) { c.mutable_compare()->set_direction(d); };
      };
      TESSEL_ASSIGN_OR_RETURN(std::string ge, EmitOp(v1::COMPARE, {block_indices, zero}, name + ".mine", compare(v1::GE)));
      TESSEL_ASSIGN_OR_RETURN(std::string lt, EmitOp(v1::COMPARE, {block_indices, size}, name + ".mine", compare(v1::LT)));
      TESSEL_ASSIGN_OR_RETURN(std::string mine, EmitOp(v1::AND, {ge, lt}, name + ".mine"));
      TESSEL_ASSIGN_OR_RETURN(mine, EmitOp(v1::BROADCAST_IN_DIM, {mine}, name + ".mine", [&](v1::Node& b) {
                                *b.mutable_broadcast_in_dim()->mutable_dims() = gt.dims();
                                for (int d = 0; d < bt.dims_size(); ++d) {
                                  b.mutable_broadcast_in_dim()->add_broadcast_dimensions(indexed + d);
                                }
                              }));
      const auto [low_f, low_i] = LowestValue(gt.dtype());
      TESSEL_ASSIGN_OR_RETURN(std::string low, EmitFill(gt, low_f, low_i, name + ".lowest"));
      TESSEL_ASSIGN_OR_RETURN(v.local, EmitOp(v1::SELECT, {mine, v.local, low}, name + ".held"));
    }
    if (n.op() == v1::REVERSE) {
      // Each device reversed its own block; along a split dimension the
      // blocks are then mirrored: block i belongs where block k-1-i is.
      // Mirroring every axis coordinate mirrors the flat index over all of
      // them, so one permute serves every reversed dimension.
      Axes axes;
      std::vector<int64_t> split;
      for (int64_t d : n.reverse().dimensions()) {
        const Axes da = DimAxes(result, d);
        if (!da.empty()) split.push_back(d);
        axes.insert(axes.end(), da.begin(), da.end());
      }
      const int64_t k = AxesSize(mesh_, axes);
      std::vector<int64_t> pairs;
      for (int64_t i = 0; i < k; ++i) pairs.insert(pairs.end(), {i, k - 1 - i});
      TESSEL_ASSIGN_OR_RETURN(
          v.local, EmitCollective(v1::COLLECTIVE_PERMUTE, v.local, name, axes, 0, 0, v1::REDUCE_INVALID,
                                  StrCat("reverse '", name, "': dimension", split.size() > 1 ? "s " : " ",
                                         absl::StrJoin(split, ", "), " split over ", AxesText(axes),
                                         ", so each reversed block moves to the mirrored device"),
                                  pairs));
    }
    v.s = result;
    values_[name] = v;
    return absl::OkStatus();
  }

  void ReshapeRule(const v1::TensorType& in, const v1::TensorType& out, v1::Sharding s, v1::Sharding& want,
                   v1::Sharding& result) {
    // A split dimension keeps its split when it stays the major part of a
    // result dimension: same extent, merged with unsplit minor dimensions,
    // or split into a major piece its axes still divide.
    std::vector<int64_t> in_prefix(in.dims_size() + 1, 1), out_prefix(out.dims_size() + 1, 1);
    for (int i = 0; i < in.dims_size(); ++i) in_prefix[i + 1] = in_prefix[i] * in.dims(i);
    for (int i = 0; i < out.dims_size(); ++i) out_prefix[i + 1] = out_prefix[i] * out.dims(i);
    want = s;
    for (int d = 0; d < in.dims_size(); ++d) {
      const Axes a = DimAxes(s, d);
      if (a.empty()) continue;
      int r = -1;
      for (int j = 0; j < out.dims_size(); ++j) {
        if (out_prefix[j] == in_prefix[d] && out.dims(j) > 1) r = j;
      }
      bool ok = r >= 0;
      if (ok && out.dims(r) > in.dims(d)) {
        // Merged with the following input dimensions: they must be unsplit.
        int64_t p = in.dims(d);
        for (int e = d + 1; e < in.dims_size() && p < out.dims(r); ++e) {
          ok &= DimAxes(s, e).empty();
          p *= in.dims(e);
        }
        ok &= p == out.dims(r);
      } else if (ok && out.dims(r) < in.dims(d)) {
        ok = in.dims(d) % out.dims(r) == 0 && out.dims(r) % AxesSize(mesh_, a) == 0;
      }
      if (ok) {
        SetDimAxes(result, r, a);
      } else {
        SetDimAxes(want, d, {});
      }
    }
    *result.mutable_partial() = want.partial();
    result.set_partial_kind(want.partial_kind());
  }

  void DotRule(const v1::Node& n, v1::Sharding l, v1::Sharding r, bool l_gen, bool r_gen, v1::Sharding& wl,
               v1::Sharding& wr, v1::Sharding& result) {
    const v1::DotGeneralAttrs& dg = n.dot_general();
    // A partial operand is completed first: a dot of each device's partial
    // sum is the dot of the sum only where the other operand is finite (0
    // times an infinity is NaN on a device whose part is 0). A dot may still
    // produce a partial sum, over a split contracting dimension.
    if (IsPartial(l)) l = Complete(l);
    if (IsPartial(r)) r = Complete(r);
    wl = Replicated(l.dims_size());
    wr = Replicated(r.dims_size());
    absl::flat_hash_set<std::string> used;
    Axes partial = IsPartial(l) ? PartialAxes(l) : PartialAxes(r);
    for (const std::string& a : partial) used.insert(a);
    auto free_of = [&](const Axes& a) {
      for (const std::string& x : a) {
        if (used.contains(x)) return false;
      }
      return true;
    };
    auto take = [&](const Axes& a) { used.insert(a.begin(), a.end()); };
    auto pick = [&](const Axes& first, const Axes& second) -> Axes {
      if (!first.empty() && free_of(first)) return first;
      if (!second.empty() && free_of(second)) return second;
      return {};
    };
    std::vector<Axes> batch;
    for (int k = 0; k < dg.lhs_batch_size(); ++k) {
      Axes a = pick(l_gen ? Axes{} : DimAxes(l, dg.lhs_batch(k)), r_gen ? Axes{} : DimAxes(r, dg.rhs_batch(k)));
      take(a);
      SetDimAxes(wl, dg.lhs_batch(k), a);
      SetDimAxes(wr, dg.rhs_batch(k), a);
      batch.push_back(a);
    }
    absl::flat_hash_set<int64_t> lspecial(dg.lhs_batch().begin(), dg.lhs_batch().end());
    lspecial.insert(dg.lhs_contracting().begin(), dg.lhs_contracting().end());
    absl::flat_hash_set<int64_t> rspecial(dg.rhs_batch().begin(), dg.rhs_batch().end());
    rspecial.insert(dg.rhs_contracting().begin(), dg.rhs_contracting().end());
    // Free (non-batch, non-contracting) dimensions keep their split unless its axes are taken.
    auto keep_free = [&](const v1::Sharding& s, bool gen, const absl::flat_hash_set<int64_t>& special,
                         v1::Sharding& w) {
      std::vector<Axes> free;
      for (int d = 0; d < s.dims_size(); ++d) {
        if (special.contains(d)) continue;
        Axes a = gen ? Axes{} : DimAxes(s, d);
        if (!free_of(a)) a.clear();
        take(a);
        SetDimAxes(w, d, a);
        free.push_back(a);
      }
      return free;
    };
    const std::vector<Axes> lfree = keep_free(l, l_gen, lspecial, wl);
    for (int k = 0; k < dg.lhs_contracting_size(); ++k) {
      Axes a = pick(l_gen ? Axes{} : DimAxes(l, dg.lhs_contracting(k)),
                    r_gen ? Axes{} : DimAxes(r, dg.rhs_contracting(k)));
      take(a);
      SetDimAxes(wl, dg.lhs_contracting(k), a);
      SetDimAxes(wr, dg.rhs_contracting(k), a);
      partial.insert(partial.end(), a.begin(), a.end());
    }
    const std::vector<Axes> rfree = keep_free(r, r_gen, rspecial, wr);
    if (IsPartial(l)) *wl.mutable_partial() = l.partial();
    if (IsPartial(r)) *wr.mutable_partial() = r.partial();
    int j = 0;
    for (const Axes& a : batch) SetDimAxes(result, j++, a);
    for (const Axes& a : lfree) SetDimAxes(result, j++, a);
    for (const Axes& a : rfree) SetDimAxes(result, j++, a);
    for (const std::string& a : partial) result.add_partial(a);
    result.set_partial_kind(v1::SUM);
  }

  // ---------------------------------------------------------------- control flow

  // A loop's carries keep the layout they start with (the fixed point is
  // declared, not searched for): the body is partitioned with its
  // parameters and results in that layout, and what it computes is
  // resharded to it, with that reason. Scanned operands are unsplit along
  // the scanned dimension; a conditional's index is replicated; branches
  // give branch 0's layouts. Each function is partitioned for the layouts
  // it is called with (named fn@hash).
  absl::Status ProcessControl(const v1::Node& n, const std::string& prefix, const std::string& name) {
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
        TESSEL_ASSIGN_OR_RETURN(std::vector<v1::Sharding> found, ProbeFunction(c.body(), params, outs, what));
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
        TESSEL_ASSIGN_OR_RETURN(auto cond, PartitionFunction(c.cond(), carries, {Replicated(0)}, what));
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
    for (int k = 0; k < n.results_size(); ++k) *ln.add_results() = LocalType(n.results(k), results[k], mesh_);
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
      const std::string& fn, const std::vector<v1::Sharding>& params, const std::vector<v1::Sharding>& outs,
      const std::string& what) {
    const v1::Graph* f = nullptr;
    for (const v1::Graph& g : g_.graph.functions()) {
      if (g.name() == fn) f = &g;
    }
    if (f == nullptr) return InvalidArgumentError(StrCat(what, ": function '", fn, "' is not defined"));
    v1::Graph graph = *f;
    *graph.mutable_functions() = g_.graph.functions();  // for the loops inside it
    auto typed = ValidateGraph(graph);
    if (!typed.ok()) return Annotate(typed.status(), StrCat(what, ": function '", fn, "': "));
    std::string key = StrCat(fn, " in");
    for (const v1::Sharding& s : params) absl::StrAppend(&key, " ", ShardingString(s));
    absl::StrAppend(&key, " out");
    for (const v1::Sharding& s : outs) absl::StrAppend(&key, " ", s.unspecified() ? "auto" : ShardingString(s));
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

  absl::Status ProcessRegion(const v1::Node& n, const std::string& prefix, const std::string& name) {
    const v1::ManualRegionAttrs& m = n.manual_region();
    const std::string label = StrCat("manual region '", name, "'");
    std::vector<std::string> inputs;
    std::vector<Varying> input_varying;
    absl::flat_hash_map<std::string, std::string> bind;    // body parameter -> local value
    absl::flat_hash_map<std::string, Varying> varying;     // body value (prefixed) -> axes
    for (int i = 0; i < n.operands_size(); ++i) {
      const Value& ov = values_.at(StrCat(prefix, n.operands(i)));
      v1::Sharding spec = NormalizeSharding(m.in_specs(i), ov.global.dims_size());
      TESSEL_RETURN_IF_ERROR(ValidateSharding(spec, mesh_, ov.global, StrCat(label, " in_spec ", i)));
      if (IsPartial(spec)) {
        return InvalidArgumentError(StrCat(label, " in_spec ", i, " ", ShardingString(spec),
                                           ": inputs are complete values"));
      }
      TESSEL_ASSIGN_OR_RETURN(std::string lo, Reshard(StrCat(prefix, n.operands(i)), spec,
                                                      StrCat(label, " in_spec ", i, " ", ShardingString(spec))));
      inputs.push_back(lo);
      input_varying.push_back(SpecVarying(
          spec, StrCat("operand ", i, " '", n.operands(i), "' is split over it by in_spec ", ShardingString(spec))));
    }
    auto body = ValidateGraph(m.body(), {.manual_mesh = &mesh_, .functions = &functions_});
    if (!body.ok()) return Annotate(body.status(), StrCat(label, " body: "));
    if (body->parameters.size() != inputs.size()) {
      return InvalidArgumentError(StrCat(label, ": body takes ", body->parameters.size(), " parameters; the region has ",
                                         inputs.size(), " operands"));
    }
    const std::string bprefix = StrCat(name, "/");
    for (size_t i = 0; i < body->parameters.size(); ++i) {
      const v1::Node& p = body->graph.nodes(body->parameters[i]);
      const int idx = p.parameter().index();
      const v1::TensorType& have = local_types_.at(inputs[idx]);
      if (!SameType(have, p.type())) {
        return InvalidArgumentError(StrCat(label, " body parameter ", idx, " '", p.name(), "': its block under in_spec ",
                                           ShardingString(m.in_specs(idx)), " is ", TypeString(have), ", the body declares ",
                                           TypeString(p.type())));
      }
      bind[p.name()] = inputs[idx];
      varying[StrCat(bprefix, p.name())] = input_varying[idx];
    }
    regions_.push_back(std::make_unique<v1::Graph>(body->graph));
    const v1::Graph& b = *regions_.back();
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> outs, EmitManual(b, bprefix, bind, varying, label));
    const bool multi = m.out_specs_size() > 0;
    for (int k = 0; k < b.outputs_size(); ++k) {
      const v1::TensorType& global = multi ? n.results(k) : n.type();
      const std::string what = multi ? StrCat(label, " out_specs ", k) : StrCat(label, " out_spec");
      // The out_spec may replicate a result only over axes it does not vary
      // over (or may, through a kernel with no rule: trusted, as
      // shard_map's check_rep=False).
      v1::Sharding spec = NormalizeSharding(multi ? m.out_specs(k) : m.out_spec(), global.dims_size());
      TESSEL_RETURN_IF_ERROR(ValidateSharding(spec, mesh_, global, what));
      absl::flat_hash_set<std::string> covered(spec.partial().begin(), spec.partial().end());
      for (const auto& d : spec.dims()) covered.insert(d.axes().begin(), d.axes().end());
      const Varying& out_varying = varying[StrCat(bprefix, b.outputs(k))];
      for (const std::string& axis : mesh_.axis_names()) {
        auto it = out_varying.why.find(axis);
        if (it == out_varying.why.end() || covered.contains(axis)) continue;
        return InvalidArgumentError(StrCat(
            label, ": output '", b.outputs(k), "' varies over mesh axis '", axis, "' (", it->second, "), but ",
            multi ? StrCat("out_specs ", k) : std::string("out_spec"), " ", ShardingString(spec),
            " replicates it over '", axis, "'. Reduce it in the body (psum), split a dimension over '", axis,
            "', or mark '", axis, "' partial in out_spec to leave it as a partial sum; nothing is inserted silently"));
      }
      const v1::TensorType want_local = LocalType(global, spec, mesh_);
      if (!SameType(want_local, local_types_.at(outs[k]))) {
        return InvalidArgumentError(StrCat(label, ": the result ", TypeString(global), " under ", what, " ",
                                           ShardingString(spec), " has blocks of ", TypeString(want_local),
                                           "; the body gives ", TypeString(local_types_.at(outs[k]))));
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
  absl::StatusOr<std::vector<std::string>> EmitManual(const v1::Graph& body, const std::string& bprefix,
                                                      const absl::flat_hash_map<std::string, std::string>& bind,
                                                      absl::flat_hash_map<std::string, Varying>& varying,
                                                      const std::string& label) {
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
          for (size_t k = 0; k < results.size(); ++k) varying[StrCat(full, "#", k)] = std::move(results[k]);
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
        TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> r, EmitManual(*decompositions_.back(), StrCat(full, "/"), inner,
                                                                       inner_varying, label));
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
        ln.mutable_collective()->set_reason(why.empty() ? StrCat("explicit in ", label) : StrCat(why, " (in ", label, ")"));
        if ((bn.op() == v1::ALL_REDUCE || bn.op() == v1::REDUCE_SCATTER) &&
            ln.collective().kind() == v1::REDUCE_INVALID) {
          ln.mutable_collective()->set_kind(v1::SUM);
        }
      }
      TESSEL_ASSIGN_OR_RETURN(std::string emitted, Emit(ln));
      if (IsCollective(bn.op()) && bn.op() != v1::AXIS_INDEX) {
        const auto& axes = bn.collective().axes();
        Record(emitted, bn.op(), ln.operands(0), Axes(axes.begin(), axes.end()), ln.collective().reason());
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
  absl::flat_hash_map<std::string, std::vector<v1::Sharding>> control_results_;  // a control node's results' layouts
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
  std::function<absl::Status(const v1::Graph&, const std::string&, const absl::flat_hash_map<std::string, std::string>&,
                             bool)>
      inline_graph = [&](const v1::Graph& graph, const std::string& prefix,
                         const absl::flat_hash_map<std::string, std::string>& bind, bool top) -> absl::Status {
    for (const v1::Node& n : graph.nodes()) {
      const std::string name = StrCat(prefix, n.name());
      if (n.op() == v1::PARAMETER && !top) {
        rename[name] = bind.at(n.name());
        continue;
      }
      if (n.op() == v1::MANUAL_REGION) {
        return InvalidArgumentError(StrCat("node '", name, "' (manual_region): a manual region needs a mesh; compile "
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

#include "scheduler/partitioner.h"
#include "scheduler/partitioner_internal.h"

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

namespace partition_internal {

absl::StatusOr<PartitionedGraph> Partitioner::Run() {
  out_.local.set_name(g_.graph.name());
  const int np = g_.parameters.size();
  if (!o_.parameter_shardings.empty() && int(o_.parameter_shardings.size()) != np) {
    return InvalidArgumentError(StrCat("graph has ", np, " parameters; ",
                                       o_.parameter_shardings.size(),
                                       " parameter shardings given"));
  }
  if (!o_.output_shardings.empty() && int(o_.output_shardings.size()) != g_.graph.outputs_size()) {
    return InvalidArgumentError(StrCat("graph has ", g_.graph.outputs_size(), " outputs; ",
                                       o_.output_shardings.size(), " output shardings given"));
  }
  out_.parameter_shardings.resize(np);
  deferred_.assign(np, false);
  for (int i = 0; i < np; ++i) {
    const v1::Node& p = g_.graph.nodes(g_.parameters[i]);
    if (!o_.parameter_shardings.empty() && o_.parameter_shardings[i].unspecified()) {
      deferred_[i] = true;  // laid out as its first reader wants it
      continue;
    }
    const v1::Sharding s = o_.parameter_shardings.empty()
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
  for (int i = 0; i < np; ++i) {  // a deferred parameter nothing reads: replicated
    if (!deferred_[i] || resolved_.contains(i)) continue;
    const v1::Node& p = g_.graph.nodes(g_.parameters[i]);
    TESSEL_RETURN_IF_ERROR(ResolveParameter(p.name(), Replicated(p.type().dims_size())).status());
  }
  return std::move(out_);
}

absl::StatusOr<std::string> Partitioner::Reshard(const std::string& name, const v1::Sharding& want,
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

absl::StatusOr<std::string> Partitioner::Regenerate(const std::string& name, v1::Sharding want) {
  Value& v = values_.at(name);
  want.clear_partial();
  if (v.node->op() == v1::PARAMETER) return ResolveParameter(name, want);
  const std::string key = StrCat(name, "|", ShardingString(want));
  if (auto it = reshard_cache_.find(key); it != reshard_cache_.end()) return it->second;
  const v1::Node& src = *v.node;
  v1::Node n = src;
  n.set_name(Fresh(StrCat(v.prefix, src.name())));
  n.clear_operands();
  const v1::TensorType local = LocalType(v.global, want, mesh_);
  if (src.op() == v1::CONSTANT) {
    *n.mutable_type() = local;
    if (src.constant().has_iota() && !DimAxes(want, src.constant().iota().dimension()).empty()) {
      TESSEL_ASSIGN_OR_RETURN(std::string out, SplitIota(n, v.global, want));
      reshard_cache_[key] = out;
      return out;
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

absl::StatusOr<std::string> Partitioner::ResolveParameter(const std::string& name,
                                                          const v1::Sharding& want) {
  const v1::Node& n = *values_.at(name).node;
  const int index = n.parameter().index();
  if (auto it = resolved_.find(index); it != resolved_.end()) {
    return Reshard(it->second, want,
                   StrCat("parameter ", index, " '", n.name(), "', laid out for its first reader"));
  }
  Value r;
  r.global = n.type();
  r.node = &n;
  r.s = want;
  v1::Node p = n;
  *p.mutable_type() = LocalType(n.type(), want, mesh_);
  p.set_name(Fresh(n.name()));
  TESSEL_ASSIGN_OR_RETURN(r.local, Emit(std::move(p)));
  out_.parameter_shardings[index] = want;
  resolved_[index] = n.name();  // a top-level parameter: its value's name is its own
  values_[n.name()] = std::move(r);
  return values_.at(n.name()).local;
}

// A block of an iota whose dimension is split: the block's own iota plus
// the block's offset (this device's index along the split's axes times the
// block's extent), counted in an integer type that holds every index and
// converted once, as the whole iota's values would be. Every piece but the
// index is generated, so the fusion that reads the block makes it in place.
absl::StatusOr<std::string> Partitioner::SplitIota(v1::Node n, const v1::TensorType& global,
                                                   const v1::Sharding& want) {
  const int64_t d = n.constant().iota().dimension();
  const v1::TensorType local = n.type();
  const std::string base = n.name();
  v1::TensorType counted = local;
  counted.set_dtype(global.dims(d) <= (int64_t{1} << 31) ? v1::S32 : v1::S64);
  *n.mutable_type() = counted;
  TESSEL_ASSIGN_OR_RETURN(std::string within, Emit(std::move(n)));
  v1::Node ai;
  ai.set_name(Fresh(base + ".axis_index"));
  ai.set_op(v1::AXIS_INDEX);
  ai.mutable_type()->set_dtype(v1::S32);
  for (const std::string& a : DimAxes(want, d)) ai.mutable_collective()->add_axes(a);
  TESSEL_ASSIGN_OR_RETURN(std::string at, Emit(std::move(ai)));
  TESSEL_ASSIGN_OR_RETURN(at, EmitOp(v1::BROADCAST_IN_DIM, {at}, base + ".block", [&](v1::Node& b) {
                            *b.mutable_broadcast_in_dim()->mutable_dims() = local.dims();
                          }));
  if (counted.dtype() != v1::S32) {
    TESSEL_ASSIGN_OR_RETURN(at, EmitOp(v1::CONVERT, {at}, base + ".block", [&](v1::Node& c) {
                              c.mutable_convert()->set_dtype(counted.dtype());
                            }));
  }
  TESSEL_ASSIGN_OR_RETURN(std::string extent,
                          EmitFill(counted, 0, local.dims(d), base + ".block_extent"));
  TESSEL_ASSIGN_OR_RETURN(std::string offset, EmitOp(v1::MUL, {at, extent}, base + ".offset"));
  TESSEL_ASSIGN_OR_RETURN(std::string out, EmitOp(v1::ADD, {within, offset}, base + ".split"));
  if (local.dtype() == counted.dtype()) return out;
  return EmitOp(v1::CONVERT, {out}, base,
                [&](v1::Node& c) { c.mutable_convert()->set_dtype(local.dtype()); });
}

absl::Status Partitioner::ProcessGraph(const v1::Graph& graph, const std::string& prefix,
                                       const absl::flat_hash_map<std::string, std::string>& bind,
                                       bool top) {
  for (const v1::Node& n : graph.nodes()) {
    const std::string name = StrCat(prefix, n.name());
    if (n.op() == v1::PARAMETER && !top) {
      Value bound = values_.at(bind.at(n.name()));  // a copy: inserting `name` may rehash
      values_[name] = std::move(bound);
      continue;
    }
    TESSEL_RETURN_IF_ERROR(Annotate(ProcessNode(n, prefix, name, top),
                                    StrCat("node '", name, "' (", OpName(n.op()), "): ")));
  }
  return absl::OkStatus();
}

absl::Status Partitioner::ProcessNode(const v1::Node& n, const std::string& prefix,
                                      const std::string& name, bool top) {
  Value v;
  v.global = n.type();
  v.node = &n;
  v.prefix = prefix;
  const int rank = n.type().dims_size();
  if (n.op() == v1::PARAMETER) {
    if (deferred_[n.parameter().index()]) {  // made where it is first read
      v.generated = true;
      values_[name] = v;
      return absl::OkStatus();
    }
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
      Value result = values_.at(StrCat(name, "/", body.outputs(0)));  // a copy, as above
      values_[name] = std::move(result);
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
        Value result = region->second;  // a result of a manual region (copied, as above)
        values_[name] = std::move(result);
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

}  // namespace partition_internal

absl::StatusOr<PartitionedGraph> Partition(const TypedGraph& g, const PartitionOptions& options) {
  return partition_internal::Partitioner(g, options).Run();
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
      const std::string name = absl::StrCat(prefix, n.name());
      if (n.op() == v1::PARAMETER && !top) {
        rename[name] = bind.at(n.name());
        continue;
      }
      if (n.op() == v1::MANUAL_REGION) {
        return absl::InvalidArgumentError(
            absl::StrCat("node '", name,
                         "' (manual_region): a manual region needs a mesh; compile "
                         "with one"));
      }
      if (n.op() == v1::SHARDING_CONSTRAINT) {
        rename[name] = rename.at(absl::StrCat(prefix, n.operands(0)));
        continue;
      }
      if (n.op() == v1::CUSTOM_KERNEL) {
        TESSEL_ASSIGN_OR_RETURN(TypedGraph d, ValidateGraph(n.custom_kernel().decomposition()));
        absl::flat_hash_map<std::string, std::string> inner;
        for (size_t i = 0; i < d.parameters.size(); ++i) {
          const v1::Node& p = d.graph.nodes(d.parameters[i]);
          inner[p.name()] = rename.at(absl::StrCat(prefix, n.operands(p.parameter().index())));
        }
        TESSEL_RETURN_IF_ERROR(inline_graph(d.graph, absl::StrCat(name, "/"), inner, false));
        rename[name] = rename.at(absl::StrCat(name, "/", d.graph.outputs(0)));
        continue;
      }
      v1::Node c = n;
      c.set_name(name);
      c.clear_operands();
      for (const std::string& o : n.operands()) c.add_operands(rename.at(absl::StrCat(prefix, o)));
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

// The partitioner's control flow (loops, conditionals, scans: each function
// partitioned for the layouts it is called with) and manual regions (bodies
// emitted as written, per device).
#include <algorithm>
#include <functional>
#include <optional>

#include "absl/strings/str_join.h"
#include "scheduler/partitioner_internal.h"

namespace tessel::scheduler::partition_internal {

absl::Status Partitioner::ProcessControl(const v1::Node& n, const std::string& prefix,
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
    TESSEL_ASSIGN_OR_RETURN(
        std::string lo, Reshard(StrCat(prefix, n.operands(i)), in[i],
                                StrCat(what, " takes operand ", i, " as ", ShardingString(in[i]))));
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

absl::StatusOr<std::vector<v1::Sharding>> Partitioner::ProbeFunction(
    const std::string& fn, const std::vector<v1::Sharding>& params,
    const std::vector<v1::Sharding>& outs, const std::string& what) {
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

absl::StatusOr<std::pair<std::string, std::vector<v1::Sharding>>> Partitioner::PartitionFunction(
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

absl::Status Partitioner::ProcessRegion(const v1::Node& n, const std::string& prefix,
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
    TESSEL_RETURN_IF_ERROR(ValidateSharding(spec, mesh_, ov.global, StrCat(label, " in_spec ", i)));
    if (IsPartial(spec)) {
      return InvalidArgumentError(
          StrCat(label, " in_spec ", i, " ", ShardingString(spec), ": inputs are complete values"));
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
                                       " parameters; the region has ", inputs.size(), " operands"));
  }
  const std::string bprefix = StrCat(name, "/");
  for (size_t i = 0; i < body->parameters.size(); ++i) {
    const v1::Node& p = body->graph.nodes(body->parameters[i]);
    const int idx = p.parameter().index();
    const v1::TensorType& have = local_types_.at(inputs[idx]);
    if (!SameType(have, p.type())) {
      return InvalidArgumentError(StrCat(label, " body parameter ", idx, " '", p.name(),
                                         "': its block under in_spec ",
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

absl::StatusOr<std::vector<std::string>> Partitioner::EmitManual(
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

}  // namespace tessel::scheduler::partition_internal

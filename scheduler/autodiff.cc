#include "scheduler/autodiff.h"

#include <algorithm>
#include <functional>
#include <numeric>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/autodiff_modes.h"
#include "scheduler/batching.h"
#include "scheduler/graph_emitter.h"
#include "scheduler/ops/op_rules.h"
#include "scheduler/varying.h"

namespace tessel::scheduler {

using absl::StrCat;

// A manual region's body, typed over the mesh (with the graph's functions),
// for its derivative; `where` names the derivative in errors.
absl::StatusOr<TypedGraph> RegionBody(
    const v1::Node& n, const v1::Mesh& mesh,
    const google::protobuf::RepeatedPtrField<v1::Graph>& functions, const std::string& where) {
  if (mesh.axis_names_size() == 0) {
    return absl::InvalidArgumentError(
        StrCat(where, ": a manual region needs a mesh; compile with one"));
  }
  v1::Graph with_functions = n.manual_region().body();
  *with_functions.mutable_functions() = functions;
  auto typed = ValidateGraph(with_functions, {.manual_mesh = &mesh});
  if (!typed.ok()) return Annotate(typed.status(), StrCat(where, " body: "));
  return typed;
}

bool HasAutodiff(const v1::Graph& g) {
  for (const v1::Node& n : g.nodes()) {
    if (n.op() == v1::VJP || n.op() == v1::JVP || n.op() == v1::CUSTOM_VJP ||
        n.op() == v1::CUSTOM_JVP || n.op() == v1::VMAP) {
      return true;
    }
    if (n.op() == v1::MANUAL_REGION && HasAutodiff(n.manual_region().body())) return true;
  }
  for (const v1::Graph& f : g.functions()) {
    if (HasAutodiff(f)) return true;
  }
  return false;
}

// The function a CUSTOM_VJP or CUSTOM_JVP node computes.
static std::string CustomFunction(const v1::Node& n) {
  return n.op() == v1::CUSTOM_VJP ? n.custom_vjp().function() : n.custom_jvp().function();
}

// Once nothing is left to differentiate: each custom_vjp and custom_jvp in
// `g` (and in its manual regions' bodies) becomes a call of its function.
// A derivative still there was taken inside a region's body: an error (it
// needs the body's varying axes).
static absl::Status LowerCustomRules(v1::Graph& g, const std::string& where) {
  google::protobuf::RepeatedPtrField<v1::Node> nodes;
  absl::flat_hash_set<std::string> used;
  for (const v1::Node& n : g.nodes()) used.insert(n.name());
  for (v1::Node& n : *g.mutable_nodes()) {
    if (n.op() == v1::VJP || n.op() == v1::JVP || n.op() == v1::VMAP) {
      return absl::UnimplementedError(
          StrCat(where, "node '", n.name(), "' (", OpName(n.op()),
                 ") transforms a function inside a manual region's body, which is not ",
                 "supported yet; transform the function that calls the region"));
    }
    if (n.op() == v1::MANUAL_REGION) {
      TESSEL_RETURN_IF_ERROR(LowerCustomRules(*n.mutable_manual_region()->mutable_body(),
                                              StrCat(where, "manual region '", n.name(), "': ")));
    }
    if (n.op() != v1::CUSTOM_VJP && n.op() != v1::CUSTOM_JVP) {
      *nodes.Add() = std::move(n);
      continue;
    }
    v1::Node index;
    index.set_op(v1::CONSTANT);
    index.set_name(StrCat(n.name(), ".index"));
    for (int k = 1; !used.insert(index.name()).second; ++k)
      index.set_name(StrCat(n.name(), ".index.", k));
    index.mutable_type()->set_dtype(v1::S32);
    index.mutable_constant()->mutable_fill()->set_i(0);
    v1::Node call = n;
    call.set_op(v1::CONDITIONAL);
    call.clear_operands();
    call.add_operands(index.name());
    for (const std::string& o : n.operands()) call.add_operands(o);
    call.mutable_control()->add_branches(CustomFunction(n));
    *nodes.Add() = std::move(index);
    *nodes.Add() = std::move(call);
  }
  *g.mutable_nodes() = std::move(nodes);
  return absl::OkStatus();
}

// A node that transforms a function (derivatives and vmap), expanded here.
static bool IsTransform(const v1::Node& n) {
  return n.op() == v1::VJP || n.op() == v1::JVP || n.op() == v1::VMAP;
}

// The function a transform node transforms.
static const std::string& TransformedFunction(const v1::Node& n) {
  return n.op() == v1::VMAP ? n.batch().function() : n.grad().function();
}

// Whether `g`'s own nodes (its manual regions' bodies among them) take a
// derivative or map a function.
static bool HasDerivativeNodes(const v1::Graph& g) {
  for (const v1::Node& n : g.nodes()) {
    if (IsTransform(n)) return true;
    if (n.op() == v1::MANUAL_REGION && HasDerivativeNodes(n.manual_region().body())) return true;
  }
  return false;
}

// Whether `g` takes a derivative or maps a function (a VJP, JVP or VMAP
// node), itself or through a function it runs: one to expand before `g`
// can be transformed.
static bool HasDerivative(const v1::Graph& g, const FunctionTable& table,
                          absl::flat_hash_set<std::string>& seen) {
  for (const v1::Node& n : g.nodes()) {
    if (IsTransform(n)) return true;
    if (n.op() == v1::MANUAL_REGION && HasDerivative(n.manual_region().body(), table, seen))
      return true;
    std::vector<std::string> called = CalledFunctions(n);
    if (n.op() == v1::CUSTOM_VJP)
      called = {n.custom_vjp().function(), n.custom_vjp().fwd(), n.custom_vjp().bwd()};
    if (n.op() == v1::CUSTOM_JVP) called = {n.custom_jvp().function(), n.custom_jvp().jvp()};
    for (const std::string& f : called) {
      if (!seen.insert(f).second) continue;
      auto it = table.graphs.find(f);
      if (it != table.graphs.end() && HasDerivative(*it->second, table, seen)) return true;
    }
  }
  return false;
}

// `g`'s own VJP nodes expanded (not those of its functions). A derivative of
// a function that itself takes one waits for a later round.
// A function that runs a collective (itself or through what it calls) runs
// inside a manual region, the only place collectives may be: it is checked
// over the mesh, as the region's body is.
static bool RunsCollectives(const v1::Graph& f,
                            const google::protobuf::RepeatedPtrField<v1::Graph>& functions,
                            absl::flat_hash_set<std::string>& seen) {
  for (const v1::Node& n : f.nodes()) {
    if (IsCollective(n.op())) return true;
    std::vector<std::string> called = CalledFunctions(n);
    if (n.op() == v1::VJP || n.op() == v1::JVP || n.op() == v1::VMAP) {
      called.push_back(n.op() == v1::VMAP ? n.batch().function() : n.grad().function());
    }
    for (const std::string& c : called) {
      if (!seen.insert(c).second) continue;
      for (const v1::Graph& g : functions) {
        if (g.name() == c && RunsCollectives(g, functions, seen)) return true;
      }
    }
  }
  return false;
}

absl::StatusOr<TypedGraph> ValidateFunction(const v1::Graph& with_functions, const v1::Mesh& mesh) {
  absl::flat_hash_set<std::string> seen;
  const bool manual = mesh.axis_names_size() > 0 &&
                      RunsCollectives(with_functions, with_functions.functions(), seen);
  return ValidateGraph(with_functions, {.manual_mesh = manual ? &mesh : nullptr});
}

static absl::StatusOr<v1::Graph> ExpandNodes(
    const TypedGraph& g, const v1::Mesh& mesh, RegionContext* region = nullptr,
    google::protobuf::RepeatedPtrField<v1::Graph>* functions = nullptr);

// Manual region `n`'s body with its own VJP nodes expanded (a gradient
// taken on each device's blocks, as JAX's grad inside shard_map): its
// parameters vary over the axes their in_specs split, each node's varying
// axes are tracked as it is copied, and the gradient's collectives
// transpose as a region's backward pass's do. The new functions (a loop's
// backward body) go to `functions`.
static absl::StatusOr<v1::Graph> ExpandRegionBody(
    const v1::Node& n, google::protobuf::RepeatedPtrField<v1::Graph>* functions,
    const v1::Mesh& mesh) {
  const std::string label = StrCat("manual region '", n.name(), "'");
  v1::Graph body = n.manual_region().body();
  *body.mutable_functions() = *functions;
  auto typed = ValidateGraph(body, {.manual_mesh = &mesh});
  if (!typed.ok()) return Annotate(typed.status(), StrCat(label, ": "));
  RegionContext ctx(mesh, *functions, label);
  for (size_t i = 0; i < typed->parameters.size(); ++i) {
    const v1::Node& p = typed->graph.nodes(typed->parameters[i]);
    const int index = p.parameter().index();
    ctx.vary[p.name()] = SpecVarying(
        n.manual_region().in_specs(index),
        StrCat("operand ", index, " '", n.operands(index), "' of the region is split over it"));
  }
  // New functions go straight to `functions`, where the analysis finds them.
  auto expanded = ExpandNodes(*typed, mesh, &ctx, functions);
  if (!expanded.ok()) return Annotate(expanded.status(), StrCat(label, ": "));
  TESSEL_RETURN_IF_ERROR(ctx.status);
  return *std::move(expanded);
}

// `g`'s nodes with their transforms expanded. The new functions go to
// `functions` where given (a region's body: the enclosing graph's), else
// to the result's, after g's own.
static absl::StatusOr<v1::Graph> ExpandNodes(
    const TypedGraph& g, const v1::Mesh& mesh, RegionContext* region,
    google::protobuf::RepeatedPtrField<v1::Graph>* functions) {
  v1::Graph out;
  out.set_name(g.graph.name());
  if (functions == nullptr) {
    *out.mutable_functions() = g.graph.functions();
    functions = out.mutable_functions();
  }
  absl::flat_hash_set<std::string> used;
  for (const v1::Node& n : g.graph.nodes()) used.insert(n.name());
  absl::flat_hash_map<std::string, std::string> rename;
  absl::flat_hash_map<std::string, std::vector<std::string>> vjp_results;
  FunctionTable table(g.graph);
  auto renamed = [&](const std::string& v) {
    auto it = rename.find(v);
    return it == rename.end() ? v : it->second;
  };
  for (const v1::Node& n : g.graph.nodes()) {
    if (n.op() == v1::TUPLE_ELEMENT) {
      auto it = vjp_results.find(n.operands(0));
      if (it != vjp_results.end()) {
        rename[n.name()] = it->second.at(n.tuple_element().index());
        continue;
      }
    }
    if (IsTransform(n)) {
      auto it = table.graphs.find(TransformedFunction(n));
      absl::flat_hash_set<std::string> seen;
      if (it != table.graphs.end() && HasDerivative(*it->second, table, seen)) {
        v1::Node c = n;  // its function's own transforms first
        for (std::string& o : *c.mutable_operands()) o = renamed(o);
        *out.add_nodes() = std::move(c);
        continue;
      }
    }
    if (n.op() == v1::VMAP) {
      const auto* fg = table.graphs.contains(n.batch().function())
                           ? table.graphs.at(n.batch().function())
                           : nullptr;
      if (fg == nullptr) {
        return absl::InvalidArgumentError(
            StrCat("vmap '", n.name(), "': function '", n.batch().function(), "' is not defined"));
      }
      v1::Graph with_functions = *fg;
      *with_functions.mutable_functions() = g.graph.functions();
      TESSEL_ASSIGN_OR_RETURN(TypedGraph f, ValidateFunction(with_functions, mesh));
      std::vector<std::string> args;
      for (const std::string& o : n.operands()) args.push_back(renamed(o));
      Emitter e(out, used);
      for (const v1::Node& m : out.nodes()) e.Declare(m.name(), m.type());
      if (region != nullptr) e.on_emit = [region](const v1::Node& x) { region->Track(x); };
      auto results = EmitBatched(e, n, f, args, functions);
      if (!results.ok())
        return Annotate(results.status(), StrCat("node '", n.name(), "' (vmap): "));
      vjp_results[n.name()] = std::move(*results);
      continue;
    }
    if (n.op() == v1::JVP) {
      const v1::Graph* fg = table.graphs.contains(n.grad().function())
                                ? table.graphs.at(n.grad().function())
                                : nullptr;
      if (fg == nullptr) {
        return absl::InvalidArgumentError(
            StrCat("jvp '", n.name(), "': function '", n.grad().function(), "' is not defined"));
      }
      v1::Graph with_functions = *fg;
      *with_functions.mutable_functions() = g.graph.functions();
      TESSEL_ASSIGN_OR_RETURN(TypedGraph f, ValidateFunction(with_functions, mesh));
      const int np = int(f.parameters.size());
      std::vector<std::string> args, tangents;
      for (int i = 0; i < n.operands_size(); ++i)
        (i < np ? args : tangents).push_back(renamed(n.operands(i)));
      Emitter e(out, used);
      for (const v1::Node& m : out.nodes()) e.Declare(m.name(), m.type());
      if (region != nullptr) e.on_emit = [region](const v1::Node& x) { region->Track(x); };
      auto results = ExpandJvp(e, n, f, args, tangents, functions, mesh);
      if (!results.ok()) return Annotate(results.status(), StrCat("node '", n.name(), "' (jvp): "));
      vjp_results[n.name()] = std::move(*results);
      continue;
    }
    if (n.op() == v1::MANUAL_REGION && HasDerivativeNodes(n.manual_region().body())) {
      v1::Node c = n;
      for (std::string& o : *c.mutable_operands()) o = renamed(o);
      TESSEL_ASSIGN_OR_RETURN(*c.mutable_manual_region()->mutable_body(),
                              ExpandRegionBody(n, functions, mesh));
      *out.add_nodes() = std::move(c);
      continue;
    }
    if (n.op() != v1::VJP) {
      v1::Node c = n;
      for (std::string& o : *c.mutable_operands()) o = renamed(o);
      if (region != nullptr) region->Track(c);
      *out.add_nodes() = std::move(c);
      continue;
    }
    const auto* fg =
        table.graphs.contains(n.grad().function()) ? table.graphs.at(n.grad().function()) : nullptr;
    if (fg == nullptr)
      return absl::InvalidArgumentError(
          StrCat("vjp '", n.name(), "': function '", n.grad().function(), "' is not defined"));
    v1::Graph with_functions = *fg;
    *with_functions.mutable_functions() = g.graph.functions();
    TESSEL_ASSIGN_OR_RETURN(TypedGraph f, ValidateFunction(with_functions, mesh));
    const int np = int(f.parameters.size());
    std::vector<std::string> args, cts;
    for (int i = 0; i < n.operands_size(); ++i)
      (i < np ? args : cts).push_back(renamed(n.operands(i)));
    // Forward nodes first, then the backward pass (emitted as it is built).
    v1::Graph backward;
    Emitter eb(backward, used);
    for (const v1::Node& m : out.nodes()) eb.Declare(m.name(), m.type());
    if (region != nullptr) eb.on_emit = [region](const v1::Node& x) { region->Track(x); };
    auto expanded = ExpandVjp(eb, n, f, args, cts, functions, mesh, region);
    if (!expanded.ok()) return Annotate(expanded.status(), StrCat("node '", n.name(), "' (vjp): "));
    for (v1::Node& m : expanded->forward) *out.add_nodes() = std::move(m);
    for (v1::Node& m : *backward.mutable_nodes()) *out.add_nodes() = std::move(m);
    vjp_results[n.name()] = std::move(expanded->results);
  }
  for (const std::string& o : g.graph.outputs()) out.add_outputs(renamed(o));
  return out;
}

// One round: the VJPs of the functions, then of the graph's own nodes.
// Expanding a loop's VJP adds functions that hold VJPs (its backward body):
// the next round expands those.
static absl::StatusOr<v1::Graph> ExpandRound(const TypedGraph& g, const v1::Mesh& mesh) {
  google::protobuf::RepeatedPtrField<v1::Graph> functions = g.graph.functions();
  const int original = functions.size();
  for (int i = 0; i < original; ++i) {
    v1::Graph& f = functions[i];
    if (!HasDerivativeNodes(f)) continue;
    v1::Graph with_functions = f;
    *with_functions.mutable_functions() = g.graph.functions();
    auto typed = ValidateFunction(with_functions, mesh);
    if (!typed.ok()) return Annotate(typed.status(), StrCat("function '", f.name(), "': "));
    auto expanded = ExpandNodes(*typed, mesh);
    if (!expanded.ok()) return Annotate(expanded.status(), StrCat("function '", f.name(), "': "));
    for (int k = original; k < expanded->functions_size(); ++k)
      *functions.Add() = expanded->functions(k);
    f = std::move(*expanded);
    f.clear_functions();
  }
  // The graph's own nodes see the functions as this round left them (a
  // gradient of a gradient differentiates the inner one's expansion).
  v1::Graph top = g.graph;
  *top.mutable_functions() = std::move(functions);
  auto typed = ValidateGraph(top);
  if (!typed.ok())
    return Annotate(typed.status(), "internal: a graph with its functions' gradients expanded: ");
  return ExpandNodes(*typed, mesh);
}

// The functions `g`'s nodes (and its regions' bodies) run, and those they run.
static void Reachable(const v1::Graph& g, const FunctionTable& table,
                      absl::flat_hash_set<std::string>& seen) {
  for (const v1::Node& n : g.nodes()) {
    if (n.op() == v1::MANUAL_REGION) Reachable(n.manual_region().body(), table, seen);
    for (const std::string& f : CalledFunctions(n)) {
      if (!seen.insert(f).second) continue;
      if (auto it = table.graphs.find(f); it != table.graphs.end())
        Reachable(*it->second, table, seen);
    }
  }
}

absl::StatusOr<v1::Graph> ExpandAutodiff(const TypedGraph& g, const v1::Mesh& mesh) {
  auto pending = [](const v1::Graph& x) {
    if (HasDerivativeNodes(x)) return true;
    for (const v1::Graph& f : x.functions()) {
      if (HasDerivativeNodes(f)) return true;
    }
    return false;
  };
  v1::Graph out = g.graph;
  for (int round = 0; pending(out); ++round) {
    if (round >= 32)
      return absl::InternalError("autodiff: gradients still unexpanded after 32 rounds");
    auto typed = ValidateGraph(out);
    if (!typed.ok())
      return Annotate(typed.status(),
                      "internal: a graph with its gradients expanded does not check: ");
    TESSEL_ASSIGN_OR_RETURN(out, ExpandRound(*typed, mesh));
  }
  // Custom rules no derivative used are calls of their functions.
  TESSEL_RETURN_IF_ERROR(LowerCustomRules(out, ""));
  for (v1::Graph& f : *out.mutable_functions()) {
    TESSEL_RETURN_IF_ERROR(LowerCustomRules(f, StrCat("function '", f.name(), "': ")));
  }
  // The differentiated functions are inlined now: keep only those still run.
  absl::flat_hash_set<std::string> seen;
  {
    const FunctionTable table(out);
    Reachable(out, table, seen);
  }
  google::protobuf::RepeatedPtrField<v1::Graph> kept;
  for (v1::Graph& f : *out.mutable_functions()) {
    if (seen.contains(f.name())) *kept.Add() = std::move(f);
  }
  *out.mutable_functions() = std::move(kept);
  return out;
}

}  // namespace tessel::scheduler

#include "scheduler/validator.h"

#include <algorithm>
#include <optional>

#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/bodies.h"

namespace tessel::scheduler {

using absl::InvalidArgumentError;
using absl::StrCat;

namespace {
std::string NodeLabel(const v1::Node& n, int pos) {
  std::string op = v1::Op_IsValid(n.op()) ? OpName(n.op()) : StrCat("op ", int(n.op()));
  return StrCat("node '", n.name(), "' (#", pos, ", ", op, "): ");
}
// Types the ops the partitioner resolves: constraints, regions, kernels.
absl::StatusOr<v1::TensorType> InferStructured(const v1::Node& n,
                                               absl::Span<const v1::TensorType* const> ops) {
  switch (n.op()) {
    case v1::SHARDING_CONSTRAINT:
      if (ops.size() != 1)
        return InvalidArgumentError(StrCat("expected 1 operand, got ", ops.size()));
      if (n.attrs_case() != v1::Node::kSharding)
        return InvalidArgumentError("missing attributes 'sharding'");
      return *ops[0];
    case v1::MANUAL_REGION: {
      if (n.attrs_case() != v1::Node::kManualRegion)
        return InvalidArgumentError("missing attributes 'manual_region'");
      const v1::ManualRegionAttrs& m = n.manual_region();
      if (m.in_specs_size() != int(ops.size())) {
        return InvalidArgumentError(
            StrCat("has ", ops.size(), " operands but ", m.in_specs_size(), " in_specs"));
      }
      if (m.body().outputs_size() != 1) {
        return InvalidArgumentError(StrCat("body must have exactly 1 output, has ",
                                           m.body().outputs_size(),
                                           " (a region of several results gives out_specs)"));
      }
      if (n.type().dtype() == v1::DTYPE_INVALID) {
        return InvalidArgumentError("needs its declared (global) result type");
      }
      TESSEL_RETURN_IF_ERROR(ValidateType(n.type()));
      return n.type();
    }
    case v1::CUSTOM_KERNEL: {
      if (n.attrs_case() != v1::Node::kCustomKernel)
        return InvalidArgumentError("missing attributes 'custom_kernel'");
      const v1::CustomKernelAttrs& k = n.custom_kernel();
      if (k.name().empty()) return InvalidArgumentError("custom kernel has no name");
      auto d = ValidateGraph(k.decomposition());
      if (!d.ok())
        return Annotate(d.status(), StrCat("custom kernel '", k.name(), "' decomposition: "));
      if (d->parameters.size() != ops.size() || d->outputs.size() != 1) {
        return InvalidArgumentError(StrCat("custom kernel '", k.name(), "': decomposition takes ",
                                           d->parameters.size(), " parameters and gives ",
                                           d->outputs.size(), " outputs; expected ", ops.size(),
                                           " and 1"));
      }
      for (size_t i = 0; i < ops.size(); ++i) {
        const v1::TensorType& want = d->graph.nodes(d->parameters[i]).type();
        if (!SameType(want, *ops[i])) {
          return InvalidArgumentError(StrCat("custom kernel '", k.name(), "' operand ", i,
                                             ": decomposition expects ", TypeString(want), ", got ",
                                             TypeString(*ops[i])));
        }
      }
      const v1::ReplicationRule& r = k.replication();
      if (r.kind() == v1::ReplicationRule::FOLLOW &&
          (r.operand() < 0 || r.operand() >= int(ops.size()))) {
        return InvalidArgumentError(StrCat("custom kernel '", k.name(),
                                           "': replication rule follows operand ", r.operand(),
                                           " of ", ops.size()));
      }
      v1::TensorType t = d->graph.nodes(d->outputs[0]).type();
      if (n.type().dtype() != v1::DTYPE_INVALID && !SameType(n.type(), t)) {
        return InvalidArgumentError(StrCat("declared type ", TypeString(n.type()),
                                           " does not match the decomposition's result ",
                                           TypeString(t)));
      }
      return t;
    }
    default: return InvalidArgumentError("not a structured op");
  }
}

std::string TypesString(absl::Span<const v1::TensorType> ts) {
  std::vector<std::string> parts;
  for (const v1::TensorType& t : ts) parts.push_back(TypeString(t));
  return StrCat("(", absl::StrJoin(parts, ", "), ")");
}

// A manual region of several results: one per body output, their global
// types declared in Node.results.
absl::StatusOr<std::vector<v1::TensorType>> InferRegionResults(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops) {
  const v1::ManualRegionAttrs& m = n.manual_region();
  if (m.in_specs_size() != int(ops.size())) {
    return InvalidArgumentError(
        StrCat("has ", ops.size(), " operands but ", m.in_specs_size(), " in_specs"));
  }
  if (m.body().outputs_size() != m.out_specs_size() || n.results_size() != m.out_specs_size()) {
    return InvalidArgumentError(StrCat("has ", m.out_specs_size(), " out_specs, ", n.results_size(),
                                       " declared (global) results and a body of ",
                                       m.body().outputs_size(),
                                       " outputs; expected the same number of each"));
  }
  std::vector<v1::TensorType> out;
  for (const v1::TensorType& t : n.results()) {
    TESSEL_RETURN_IF_ERROR(ValidateType(t));
    out.push_back(t);
  }
  return out;
}

absl::StatusOr<std::vector<v1::TensorType>> InferControlFlow(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops, FunctionTable& table,
    const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kControl)
    return InvalidArgumentError("missing attributes 'control'");
  const v1::ControlFlowAttrs& c = n.control();
  std::vector<v1::TensorType> operands;
  for (const v1::TensorType* t : ops) operands.push_back(*t);
  auto signature = [&](const std::string& fn,
                       absl::string_view role) -> absl::StatusOr<const FunctionSignature*> {
    if (fn.empty()) return InvalidArgumentError(StrCat("names no ", role, " function"));
    return table.Signature(fn, o);
  };
  const v1::TensorType pred = [] {
    v1::TensorType t;
    t.set_dtype(v1::PRED);
    return t;
  }();
  switch (n.op()) {
    case v1::WHILE: {
      TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* cond, signature(c.cond(), "cond"));
      TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* body, signature(c.body(), "body"));
      TESSEL_RETURN_IF_ERROR(
          CheckTypes("parameters", c.cond(), cond->parameters, operands, "the carries"));
      TESSEL_RETURN_IF_ERROR(
          CheckTypes("results", c.cond(), cond->results, {pred}, "the loop predicate"));
      TESSEL_RETURN_IF_ERROR(
          CheckTypes("parameters", c.body(), body->parameters, operands, "the carries"));
      TESSEL_RETURN_IF_ERROR(CheckTypes("results", c.body(), body->results, operands,
                                        "the carries: a body may not change a carried type"));
      return operands;
    }
    case v1::CONDITIONAL: {
      if (ops.empty()) return InvalidArgumentError("expected an index operand, got none");
      const v1::TensorType& index = operands[0];
      if (index.dims_size() != 0 || (index.dtype() != v1::S32 && index.dtype() != v1::PRED)) {
        return InvalidArgumentError(
            StrCat("the index (operand 0) must be s32[] or pred[], got ", TypeString(index)));
      }
      if (c.branches_size() == 0) return InvalidArgumentError("has no branches");
      if (index.dtype() == v1::PRED && c.branches_size() != 2) {
        return InvalidArgumentError(
            StrCat("a pred[] index selects between 2 branches; got ", c.branches_size()));
      }
      std::vector<v1::TensorType> args(operands.begin() + 1, operands.end());
      std::vector<v1::TensorType> results;
      for (int b = 0; b < c.branches_size(); ++b) {
        TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, signature(c.branches(b), "branch"));
        TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", c.branches(b), f->parameters, args,
                                          "the operands after the index"));
        if (b == 0) {
          results = f->results;
        } else {
          TESSEL_RETURN_IF_ERROR(CheckTypes("results", c.branches(b), f->results, results,
                                            StrCat("branch 0 '", c.branches(0), "' results")));
        }
      }
      return results;
    }
    case v1::SCAN: {
      if (c.num_carry() < 0 || c.num_carry() > int(ops.size())) {
        return InvalidArgumentError(
            StrCat("num_carry ", c.num_carry(), " out of range: it has ", ops.size(), " operands"));
      }
      if (c.length() < 0)
        return InvalidArgumentError(StrCat("length must be >= 0, got ", c.length()));
      TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* body, signature(c.body(), "body"));
      std::vector<v1::TensorType> params(operands.begin(), operands.begin() + c.num_carry());
      for (size_t i = c.num_carry(); i < operands.size(); ++i) {
        const v1::TensorType& x = operands[i];
        if (x.dims_size() == 0 || x.dims(0) != c.length()) {
          return InvalidArgumentError(StrCat("scanned operand ", i, " is ", TypeString(x),
                                             "; expected a leading dimension of the length, ",
                                             c.length()));
        }
        v1::TensorType slice = x;
        slice.mutable_dims()->erase(slice.mutable_dims()->begin());
        params.push_back(slice);
      }
      TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", c.body(), body->parameters, params,
                                        "the carries, then one slice of each scanned operand"));
      const std::vector<v1::TensorType> carries(operands.begin(), operands.begin() + c.num_carry());
      if (int(body->results.size()) < c.num_carry()) {
        return InvalidArgumentError(StrCat("function '", c.body(), "' has ", body->results.size(),
                                           " results; expected at least the ", c.num_carry(),
                                           " carries"));
      }
      const std::vector<v1::TensorType> new_carries(body->results.begin(),
                                                    body->results.begin() + c.num_carry());
      TESSEL_RETURN_IF_ERROR(CheckTypes("results", c.body(), new_carries, carries,
                                        "the carries: a body may not change a carried type"));
      std::vector<v1::TensorType> results = carries;
      for (size_t i = c.num_carry(); i < body->results.size(); ++i) {
        v1::TensorType y = body->results[i];
        y.mutable_dims()->Add(0);
        std::rotate(y.mutable_dims()->begin(), y.mutable_dims()->end() - 1,
                    y.mutable_dims()->end());
        y.set_dims(0, c.length());
        TESSEL_RETURN_IF_ERROR(ValidateType(y));
        results.push_back(y);
      }
      return results;
    }
    default: return InvalidArgumentError("not a control-flow op");
  }
}

absl::StatusOr<std::vector<v1::TensorType>> InferVjp(const v1::Node& n,
                                                     absl::Span<const v1::TensorType* const> ops,
                                                     FunctionTable& table,
                                                     const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kGrad) return InvalidArgumentError("missing attributes 'grad'");
  const v1::GradAttrs& g = n.grad();
  if (g.function().empty()) return InvalidArgumentError("names no function to differentiate");
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(g.function(), o));
  const size_t np = f->parameters.size(), nr = f->results.size();
  std::vector<v1::TensorType> want = f->parameters;
  want.insert(want.end(), f->results.begin(), f->results.end());
  std::vector<v1::TensorType> got;
  for (const v1::TensorType* t : ops) got.push_back(*t);
  if (got.size() != want.size()) {
    return InvalidArgumentError(StrCat("vjp of '", g.function(), "' takes its ", np,
                                       " arguments and a cotangent for each of its ", nr,
                                       " results: ", want.size(), " operands ", TypesString(want),
                                       "; got ", got.size(), " ", TypesString(got)));
  }
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", g.function(), got, want,
                                    "the vjp's operands: arguments, then cotangents"));
  std::vector<v1::TensorType> results = f->results;
  for (int p : g.wrt()) {
    if (p < 0 || p >= int(np)) {
      return InvalidArgumentError(
          StrCat("vjp of '", g.function(), "' with respect to parameter ", p, ": it has ", np));
    }
    const v1::DType d = f->parameters[p].dtype();
    if (d != v1::F32 && d != v1::F64 && d != v1::F16 && d != v1::BF16) {
      return InvalidArgumentError(StrCat("vjp of '", g.function(), "' with respect to parameter ",
                                         p, ": gradients need a ", "floating-point input, got ",
                                         TypeString(f->parameters[p]), " (as jax.grad)"));
    }
    results.push_back(f->parameters[p]);
  }
  return results;
}

absl::StatusOr<std::vector<v1::TensorType>> InferVmap(const v1::Node& n,
                                                      absl::Span<const v1::TensorType* const> ops,
                                                      FunctionTable& table,
                                                      const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kBatch) return InvalidArgumentError("missing attributes 'batch'");
  const v1::BatchAttrs& b = n.batch();
  if (b.function().empty()) return InvalidArgumentError("names no function to map");
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(b.function(), o));
  if (b.size() < 0)
    return InvalidArgumentError(
        StrCat("vmap of '", b.function(), "': batch size ", b.size(), " < 0"));
  if (b.in_axes_size() != int(ops.size()) || ops.size() != f->parameters.size()) {
    return InvalidArgumentError(StrCat("vmap of '", b.function(), "': expected ",
                                       f->parameters.size(),
                                       " operands (its parameters) and as many in_axes; got ",
                                       ops.size(), " operands and ", b.in_axes_size(), " in_axes"));
  }
  if (b.out_axes_size() != int(f->results.size())) {
    return InvalidArgumentError(StrCat("vmap of '", b.function(), "': expected ", f->results.size(),
                                       " out_axes (one per result), got ", b.out_axes_size()));
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const v1::TensorType& p = f->parameters[i];
    const int64_t axis = b.in_axes(int(i));
    if (axis < -1 || axis > p.dims_size()) {
      return InvalidArgumentError(StrCat("vmap of '", b.function(), "': in_axes[", i, "] = ", axis,
                                         ": expected -1 (not batched) or an axis in [0, ",
                                         p.dims_size(), "] of ", TypeString(*ops[i])));
    }
    const v1::TensorType want = axis < 0 ? p : WithBatch(p, axis, b.size());
    if (!SameType(*ops[i], want)) {
      return InvalidArgumentError(
          StrCat("vmap of '", b.function(), "': operand ", i, " is ", TypeString(*ops[i]),
                 "; expected ", TypeString(want), " (parameter ", i, ", ", TypeString(p),
                 axis < 0 ? ", not batched)" : StrCat(", batched at axis ", axis, ")")));
    }
  }
  std::vector<v1::TensorType> results;
  for (size_t k = 0; k < f->results.size(); ++k) {
    const v1::TensorType& r = f->results[k];
    const int64_t axis = b.out_axes(int(k));
    if (axis < -1 || axis > r.dims_size()) {
      return InvalidArgumentError(StrCat("vmap of '", b.function(), "': out_axes[", k, "] = ", axis,
                                         ": expected -1 (not batched) or an axis in [0, ",
                                         r.dims_size(), "] of ", "result ", TypeString(r)));
    }
    results.push_back(axis < 0 ? r : WithBatch(r, axis, b.size()));
  }
  return results;
}

absl::StatusOr<std::vector<v1::TensorType>> InferJvp(const v1::Node& n,
                                                     absl::Span<const v1::TensorType* const> ops,
                                                     FunctionTable& table,
                                                     const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kGrad) return InvalidArgumentError("missing attributes 'grad'");
  const v1::GradAttrs& g = n.grad();
  if (g.function().empty()) return InvalidArgumentError("names no function to differentiate");
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(g.function(), o));
  std::vector<v1::TensorType> want = f->parameters;
  for (int p : g.wrt()) {
    if (p < 0 || p >= int(f->parameters.size())) {
      return InvalidArgumentError(StrCat("jvp of '", g.function(), "' with respect to parameter ",
                                         p, ": it has ", f->parameters.size()));
    }
    const v1::DType d = f->parameters[p].dtype();
    if (d != v1::F32 && d != v1::F64 && d != v1::F16 && d != v1::BF16) {
      return InvalidArgumentError(StrCat("jvp of '", g.function(), "' with respect to parameter ",
                                         p, ": tangents need a ", "floating-point input, got ",
                                         TypeString(f->parameters[p])));
    }
    want.push_back(f->parameters[p]);
  }
  std::vector<v1::TensorType> got;
  for (const v1::TensorType* t : ops) got.push_back(*t);
  if (got.size() != want.size()) {
    return InvalidArgumentError(
        StrCat("jvp of '", g.function(), "' takes its ", f->parameters.size(),
               " arguments and a tangent for each of the ", g.wrt_size(), " in wrt: ", want.size(),
               " operands ", TypesString(want), "; got ", got.size(), " ", TypesString(got)));
  }
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", g.function(), got, want,
                                    "the jvp's operands: arguments, then tangents"));
  std::vector<v1::TensorType> results = f->results;
  results.insert(results.end(), f->results.begin(), f->results.end());
  return results;
}

absl::StatusOr<std::vector<v1::TensorType>> InferCustomVjp(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops, FunctionTable& table,
    const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kCustomVjp)
    return InvalidArgumentError("missing attributes 'custom_vjp'");
  const v1::CustomVjpAttrs& c = n.custom_vjp();
  std::vector<v1::TensorType> args;
  for (const v1::TensorType* t : ops) args.push_back(*t);
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(c.function(), o));
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* fwd, table.Signature(c.fwd(), o));
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* bwd, table.Signature(c.bwd(), o));
  TESSEL_RETURN_IF_ERROR(
      CheckTypes("parameters", c.function(), f->parameters, args, "the operands"));
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", c.fwd(), fwd->parameters, args, "the operands"));
  if (fwd->results.size() < f->results.size()) {
    return InvalidArgumentError(StrCat("function '", c.fwd(), "' returns ", fwd->results.size(),
                                       " results; expected ", "the ", f->results.size(), " of '",
                                       c.function(), "', then residuals"));
  }
  const std::vector<v1::TensorType> first(fwd->results.begin(),
                                          fwd->results.begin() + f->results.size());
  TESSEL_RETURN_IF_ERROR(CheckTypes("results", c.fwd(), first, f->results,
                                    StrCat("the results of '", c.function(), "'")));
  std::vector<v1::TensorType> bwd_params(fwd->results.begin() + f->results.size(),
                                         fwd->results.end());
  bwd_params.insert(bwd_params.end(), f->results.begin(), f->results.end());
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", c.bwd(), bwd->parameters, bwd_params,
                                    "the residuals, then a cotangent per result"));
  TESSEL_RETURN_IF_ERROR(
      CheckTypes("results", c.bwd(), bwd->results, args, "a cotangent per operand"));
  return f->results;
}

absl::StatusOr<std::vector<v1::TensorType>> InferCustomJvp(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops, FunctionTable& table,
    const ValidateOptions& o) {
  if (n.attrs_case() != v1::Node::kCustomJvp)
    return InvalidArgumentError("missing attributes 'custom_jvp'");
  const v1::CustomJvpAttrs& c = n.custom_jvp();
  std::vector<v1::TensorType> args;
  for (const v1::TensorType* t : ops) args.push_back(*t);
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(c.function(), o));
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* jvp, table.Signature(c.jvp(), o));
  TESSEL_RETURN_IF_ERROR(
      CheckTypes("parameters", c.function(), f->parameters, args, "the operands"));
  std::vector<v1::TensorType> twice = args;
  twice.insert(twice.end(), args.begin(), args.end());
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", c.jvp(), jvp->parameters, twice,
                                    "the operands, then a tangent per operand"));
  std::vector<v1::TensorType> results = f->results;
  results.insert(results.end(), f->results.begin(), f->results.end());
  TESSEL_RETURN_IF_ERROR(
      CheckTypes("results", c.jvp(), jvp->results, results,
                 StrCat("the results of '", c.function(), "', then a tangent per result")));
  return f->results;
}

}  // namespace

absl::Status CheckTypes(const std::string& what, const std::string& fn,
                        absl::Span<const v1::TensorType> got, absl::Span<const v1::TensorType> want,
                        const std::string& want_what) {
  if (got.size() != want.size()) {
    return InvalidArgumentError(StrCat("function '", fn, "' has ", got.size(), " ", what, " ",
                                       TypesString(got), "; expected ", want.size(), " (",
                                       want_what, ") ", TypesString(want)));
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (!SameType(got[i], want[i])) {
      return InvalidArgumentError(StrCat("function '", fn, "' ", what.substr(0, what.size() - 1),
                                         " ", i, " is ", TypeString(got[i]), "; expected ",
                                         TypeString(want[i]), " (", want_what, " ", i, ")"));
    }
  }
  return absl::OkStatus();
}

v1::TensorType WithBatch(v1::TensorType t, int64_t axis, int64_t size) {
  t.mutable_dims()->Add(0);
  for (int d = t.dims_size() - 1; d > axis; --d) t.set_dims(d, t.dims(d - 1));
  t.set_dims(int(axis), size);
  return t;
}

bool IsControlFlow(v1::Op op) { return op == v1::WHILE || op == v1::CONDITIONAL || op == v1::SCAN; }
bool IsMultiResult(v1::Op op) {
  return IsControlFlow(op) || op == v1::VJP || op == v1::JVP || op == v1::CUSTOM_VJP ||
         op == v1::CUSTOM_JVP || op == v1::VMAP || op == v1::REDUCE_WITH_BODY ||
         op == v1::SORT_WITH_COMPARATOR;
}
bool IsMultiResult(const v1::Node& n) {
  return IsMultiResult(n.op()) ||
         (n.op() == v1::MANUAL_REGION && n.manual_region().out_specs_size() > 0);
}

std::vector<std::string> CalledFunctions(const v1::Node& n) {
  if (!n.has_control()) return {};
  const v1::ControlFlowAttrs& c = n.control();
  switch (n.op()) {
    case v1::WHILE: return {c.cond(), c.body()};
    case v1::SCAN: return {c.body()};
    case v1::CONDITIONAL: return {c.branches().begin(), c.branches().end()};
    default: return {};
  }
}

FunctionTable::FunctionTable(const v1::Graph& top) {
  for (const v1::Graph& f : top.functions()) graphs.emplace(f.name(), &f);
}

absl::StatusOr<const FunctionSignature*> FunctionTable::Signature(const std::string& name,
                                                                  const ValidateOptions& options) {
  const std::string key = options.manual_mesh != nullptr ? StrCat(name, "|manual") : name;
  if (auto it = signatures.find(key); it != signatures.end()) return &it->second;
  auto g = graphs.find(name);
  if (g == graphs.end()) {
    std::vector<std::string> known;
    for (const auto& [n, _] : graphs) known.push_back(StrCat("'", n, "'"));
    std::sort(known.begin(), known.end());
    return InvalidArgumentError(StrCat("function '", name,
                                       "' is not defined (the graph's functions: ",
                                       known.empty() ? "none" : absl::StrJoin(known, ", "), ")"));
  }
  if (std::find(active.begin(), active.end(), name) != active.end()) {
    return InvalidArgumentError(StrCat("function '", name, "' calls itself (through ",
                                       absl::StrJoin(active, " -> "),
                                       "); recursion is not supported"));
  }
  active.push_back(name);
  ValidateOptions inner = options;
  inner.functions = this;
  auto typed = ValidateGraph(*g->second, inner);
  active.pop_back();
  if (!typed.ok()) return Annotate(typed.status(), StrCat("function '", name, "': "));
  FunctionSignature sig;
  for (int p : typed->parameters) sig.parameters.push_back(typed->graph.nodes(p).type());
  for (int o : typed->outputs) sig.results.push_back(typed->graph.nodes(o).type());
  return &signatures.emplace(key, std::move(sig)).first->second;
}

bool IsCollective(v1::Op op) { return op >= v1::ALL_REDUCE && op <= v1::AXIS_INDEX; }

absl::StatusOr<TypedGraph> ValidateGraph(const v1::Graph& graph, const ValidateOptions& options) {
  return ValidateGraph(v1::Graph(graph), options);
}

namespace {

// The types of node `n`'s operands (at `pos`), each defined before it; a
// tuple_element reads a node of several results, and only it does.
absl::StatusOr<std::vector<const v1::TensorType*>> OperandTypes(const TypedGraph& tg,
                                                                const v1::Node& n, int pos) {
  auto label = [&n, pos] { return NodeLabel(n, pos); };  // made only for an error
  std::vector<const v1::TensorType*> operand_types;
  for (int i = 0; i < n.operands_size(); ++i) {
    auto it = tg.index_of.find(n.operands(i));
    if (it == tg.index_of.end() || it->second == pos) {
      return InvalidArgumentError(
          StrCat(label(), "operand ", i, " '", n.operands(i), "' is not defined before this node ",
                 "(nodes must be in topological order; a cycle or a dangling reference)"));
    }
    const v1::Node& def = tg.graph.nodes(it->second);
    if (IsMultiResult(def) != (n.op() == v1::TUPLE_ELEMENT)) {
      return InvalidArgumentError(
          n.op() == v1::TUPLE_ELEMENT
              ? StrCat(label(), "operand '", def.name(), "' (", OpName(def.op()),
                       ") has a single result; ",
                       "tuple_element reads the results of while, conditional, scan, vjp, jvp, "
                       "custom_vjp, custom_jvp, vmap, reduce_with_body, sort_with_comparator and "
                       "regions with out_specs")
              : StrCat(label(), "operand ", i, " '", def.name(), "' (", OpName(def.op()), ") has ",
                       def.results_size(), " results; read one with tuple_element"));
    }
    operand_types.push_back(&def.type());
  }
  return operand_types;
}

// Infers the results of a node of several results into `n.results`,
// checking any it declares.
absl::Status TypeResults(v1::Node& n, absl::FunctionRef<std::string()> label,
                         const std::vector<const v1::TensorType*>& operand_types,
                         FunctionTable& table, const ValidateOptions& options) {
  auto results = n.op() == v1::MANUAL_REGION ? InferRegionResults(n, operand_types)
                 : n.op() == v1::VJP         ? InferVjp(n, operand_types, table, options)
                 : n.op() == v1::JVP         ? InferJvp(n, operand_types, table, options)
                 : n.op() == v1::VMAP        ? InferVmap(n, operand_types, table, options)
                 : n.op() == v1::CUSTOM_VJP  ? InferCustomVjp(n, operand_types, table, options)
                 : n.op() == v1::CUSTOM_JVP  ? InferCustomJvp(n, operand_types, table, options)
                 : n.op() == v1::REDUCE_WITH_BODY || n.op() == v1::SORT_WITH_COMPARATOR
                     ? InferBodyResults(n, operand_types, table, options)
                     : InferControlFlow(n, operand_types, table, options);
  if (!results.ok()) return Annotate(results.status(), label());
  if (n.results_size() > 0) {
    const std::vector<v1::TensorType> declared(n.results().begin(), n.results().end());
    auto given = CheckTypes("results", StrCat(OpName(n.op()), " '", n.name(), "'"), declared,
                            *results, "the inferred results");
    if (!given.ok()) return Annotate(given, StrCat(label(), "declared results: "));
  }
  n.clear_results();
  for (const v1::TensorType& t : *results) *n.add_results() = t;
  n.clear_type();
  return absl::OkStatus();
}

// The type of a node of one result.
absl::StatusOr<v1::TensorType> TypeOf(const TypedGraph& tg, const v1::Node& n,
                                      absl::FunctionRef<std::string()> label,
                                      const std::vector<const v1::TensorType*>& operand_types,
                                      const ValidateOptions& options) {
  if (n.results_size() > 0) {
    return InvalidArgumentError(
        StrCat(label(),
               "only while, conditional, scan, vjp, jvp, custom_vjp, custom_jvp, vmap, "
               "reduce_with_body, sort_with_comparator and regions with out_specs have "
               "several results"));
  }
  if (n.op() == v1::TUPLE_ELEMENT) {
    const v1::Node& def = tg.graph.nodes(tg.index_of.at(n.operands(0)));
    const int k = n.has_tuple_element() ? n.tuple_element().index() : -1;
    if (n.operands_size() != 1 || k < 0 || k >= def.results_size()) {
      return InvalidArgumentError(StrCat(label(), "reads result ", k, " of '", def.name(),
                                         "', which has ", def.results_size(), " results"));
    }
    return def.results(k);
  }
  absl::StatusOr<v1::TensorType> type;
  if (n.op() == v1::SHARD_SLICE) {
    type = options.manual_mesh != nullptr
               ? InferCollectiveType(n, operand_types, *options.manual_mesh)
               : InvalidArgumentError(
                     "shard_slice takes a device's block: it is emitted by the partitioner, and "
                     "by reverse mode inside manual regions");
  } else if (IsCollective(n.op())) {
    type = options.manual_mesh == nullptr
               ? InvalidArgumentError(
                     StrCat("collective outside a manual region: ", OpName(n.op()),
                            " is explicit only inside a manual region (shard_map); elsewhere "
                            "the partitioner inserts the collectives a sharding needs"))
               : InferCollectiveType(n, operand_types, *options.manual_mesh);
  } else if (n.op() == v1::SHARDING_CONSTRAINT || n.op() == v1::MANUAL_REGION ||
             n.op() == v1::CUSTOM_KERNEL) {
    type = InferStructured(n, operand_types);
  } else {
    type = InferType(n, operand_types);
  }
  if (!type.ok()) return Annotate(type.status(), label());
  return type;
}

// tg.parameters from the parameters' indices (0..n-1, each once) and
// tg.outputs from the graph's output names (each of one result).
absl::Status NumberParametersAndOutputs(TypedGraph& tg,
                                        const std::vector<const v1::Node*>& params) {
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
  for (int i = 0; i < tg.graph.outputs_size(); ++i) {
    auto it = tg.index_of.find(tg.graph.outputs(i));
    if (it == tg.index_of.end()) {
      return InvalidArgumentError(
          StrCat("output ", i, " '", tg.graph.outputs(i), "' names no node"));
    }
    if (IsMultiResult(tg.graph.nodes(it->second))) {
      return InvalidArgumentError(StrCat("output ", i, " '", tg.graph.outputs(i),
                                         "' has several results; output ",
                                         "each through tuple_element"));
    }
    tg.outputs.push_back(it->second);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TypedGraph> ValidateGraph(v1::Graph&& graph, const ValidateOptions& options) {
  TypedGraph tg;
  tg.graph = std::move(graph);
  std::optional<FunctionTable> own_table;
  FunctionTable* table = options.functions;
  if (table == nullptr) table = &own_table.emplace(tg.graph);
  if (tg.graph.nodes_size() == 0) return InvalidArgumentError("graph has no nodes");
  if (tg.graph.outputs_size() == 0) return InvalidArgumentError("graph has no outputs");
  std::vector<const v1::Node*> params;
  for (int pos = 0; pos < tg.graph.nodes_size(); ++pos) {
    v1::Node& n = *tg.graph.mutable_nodes(pos);
    auto label = [&n, pos] { return NodeLabel(n, pos); };  // made only for an error
    if (n.name().empty()) return InvalidArgumentError(StrCat(label(), "has no name"));
    if (!v1::Op_IsValid(n.op()) || n.op() == v1::OP_INVALID) {
      return InvalidArgumentError(StrCat(
          label(), "unknown op: expected one of the tessel.v1.Op values, got ", int(n.op())));
    }
    if (!tg.index_of.emplace(n.name(), pos).second) {
      return InvalidArgumentError(
          StrCat(label(), "name already used by node #", tg.index_of[n.name()]));
    }
    TESSEL_ASSIGN_OR_RETURN(std::vector<const v1::TensorType*> operand_types,
                            OperandTypes(tg, n, pos));
    if (IsMultiResult(n)) {
      TESSEL_RETURN_IF_ERROR(TypeResults(n, label, operand_types, *table, options));
      continue;
    }
    TESSEL_ASSIGN_OR_RETURN(*n.mutable_type(), TypeOf(tg, n, label, operand_types, options));
    if (n.op() == v1::PARAMETER) params.push_back(&n);
  }
  TESSEL_RETURN_IF_ERROR(NumberParametersAndOutputs(tg, params));
  return tg;
}

}  // namespace tessel::scheduler

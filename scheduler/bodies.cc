#include "scheduler/bodies.h"

#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "scheduler/autodiff.h"
#include "scheduler/graph_emitter.h"

namespace tessel::scheduler {
namespace {

using absl::InvalidArgumentError;
using absl::StrCat;

bool HasBody(v1::Op op) { return op == v1::REDUCE_WITH_BODY || op == v1::SORT_WITH_COMPARATOR; }

v1::TensorType Scalar(v1::DType d) {
  v1::TensorType t;
  t.set_dtype(d);
  return t;
}

// The operands, after the first, have the first's dimensions.
absl::Status SameDims(absl::Span<const v1::TensorType* const> xs, absl::string_view what) {
  for (size_t k = 1; k < xs.size(); ++k) {
    if (Dims(*xs[k]) != Dims(*xs[0])) {
      return InvalidArgumentError(StrCat(what, " ", k, " is ", TypeString(*xs[k]),
                                         "; expected the dimensions of ", what, " 0, ",
                                         TypeString(*xs[0])));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::TensorType>> InferReduce(const v1::Node& n,
                                                        absl::Span<const v1::TensorType* const> ops,
                                                        FunctionTable& table,
                                                        const ValidateOptions& o) {
  const v1::BodyAttrs& b = n.body();
  if (ops.empty() || ops.size() % 2 != 0) {
    return InvalidArgumentError(
        StrCat("expected operands (x_1..x_N, init_1..init_N), N >= 1; got ", ops.size()));
  }
  const size_t count = ops.size() / 2;
  TESSEL_RETURN_IF_ERROR(SameDims(ops.subspan(0, count), "operand"));
  const v1::TensorType& x = *ops[0];
  std::vector<bool> reduced(x.dims_size(), false);
  for (int64_t d : b.dims()) {
    if (d < 0 || d >= x.dims_size() || reduced[d]) {
      return InvalidArgumentError(
          StrCat("dims: ", d, " is out of range or repeated for operand 0, ", TypeString(x)));
    }
    reduced[d] = true;
  }
  std::vector<v1::TensorType> scalars, results;
  for (size_t k = 0; k < count; ++k) {
    const v1::TensorType& init = *ops[count + k];
    if (init.dims_size() != 0 || init.dtype() != ops[k]->dtype()) {
      return InvalidArgumentError(StrCat(
          "init value ", k, " (operand ", count + k, ") is ", TypeString(init), "; expected ",
          TypeString(Scalar(ops[k]->dtype())), ", a scalar of operand ", k, "'s dtype"));
    }
    scalars.push_back(init);
    v1::TensorType r = Scalar(ops[k]->dtype());
    for (int d = 0; d < x.dims_size(); ++d) {
      if (!reduced[d]) r.add_dims(x.dims(d));
    }
    results.push_back(std::move(r));
  }
  if (b.function().empty()) return InvalidArgumentError("names no body function");
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(b.function(), o));
  std::vector<v1::TensorType> params = scalars;
  params.insert(params.end(), scalars.begin(), scalars.end());
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", b.function(), f->parameters, params,
                                    "an accumulator per operand, then an element of each"));
  TESSEL_RETURN_IF_ERROR(
      CheckTypes("results", b.function(), f->results, scalars, "an accumulator per operand"));
  return results;
}

absl::StatusOr<std::vector<v1::TensorType>> InferSort(const v1::Node& n,
                                                      absl::Span<const v1::TensorType* const> ops,
                                                      FunctionTable& table,
                                                      const ValidateOptions& o) {
  const v1::BodyAttrs& b = n.body();
  if (ops.empty()) return InvalidArgumentError("expected at least 1 operand, got none");
  TESSEL_RETURN_IF_ERROR(SameDims(ops, "operand"));
  if (b.dimension() < 0 || b.dimension() >= ops[0]->dims_size()) {
    return InvalidArgumentError(StrCat("dimension ", b.dimension(),
                                       " is out of range for operand 0, ", TypeString(*ops[0])));
  }
  if (b.function().empty()) return InvalidArgumentError("names no comparator function");
  TESSEL_ASSIGN_OR_RETURN(const FunctionSignature* f, table.Signature(b.function(), o));
  std::vector<v1::TensorType> params, results;
  for (const v1::TensorType* t : ops) {
    params.push_back(Scalar(t->dtype()));
    params.push_back(Scalar(t->dtype()));
    results.push_back(*t);
  }
  TESSEL_RETURN_IF_ERROR(CheckTypes("parameters", b.function(), f->parameters, params,
                                    "two elements of each operand, (a_1, b_1, ..., a_N, b_N)"));
  TESSEL_RETURN_IF_ERROR(CheckTypes("results", b.function(), f->results, {Scalar(v1::PRED)},
                                    "whether a sorts before b"));
  return results;
}

// `fn` (scalars to scalars) applied elementwise to `args`, arrays of one
// shape: its nodes inlined over that shape, its constants broadcast.
absl::StatusOr<std::vector<std::string>> Apply(Emitter& e, const v1::Graph& fn,
                                               const std::vector<std::string>& args) {
  const std::vector<int64_t> shape = Dims(e.type(args.at(0)));
  absl::flat_hash_map<std::string, std::string> value;
  auto refuse = [&](const v1::Node& n) {
    return InvalidArgumentError(StrCat("function '", fn.name(), "' holds node '", n.name(), "' (",
                                       OpName(n.op()),
                                       "); a reduction's body or a sort's comparator may hold only "
                                       "elementwise ops and scalar constants"));
  };
  for (const v1::Node& n : fn.nodes()) {
    switch (n.op()) {
      case v1::PARAMETER: value[n.name()] = args.at(n.parameter().index()); continue;
      case v1::CONSTANT: {
        if (n.type().dims_size() != 0) return refuse(n);
        v1::Node c = n;
        c.clear_name();
        if (c.constant().has_fill()) {
          for (int64_t d : shape) c.mutable_type()->add_dims(d);
          value[n.name()] = e.Emit(std::move(c), n.name());
        } else {
          value[n.name()] = e.Broadcast(e.Emit(std::move(c), n.name()), shape, {});
        }
        continue;
      }
      case v1::BROADCAST_IN_DIM:
        if (n.broadcast_in_dim().dims_size() != 0) return refuse(n);
        value[n.name()] = value.at(n.operands(0));
        continue;
      case v1::RESHAPE:
        if (n.reshape().dims_size() != 0) return refuse(n);
        value[n.name()] = value.at(n.operands(0));
        continue;
      default: break;
    }
    if (!IsElementwise(n.op())) return refuse(n);
    v1::Node m = n;
    m.clear_name();
    m.clear_type();
    m.clear_operands();
    for (const std::string& o : n.operands()) m.add_operands(value.at(o));
    value[n.name()] = e.Emit(std::move(m), n.name());
  }
  TESSEL_RETURN_IF_ERROR(e.status());
  std::vector<std::string> out;
  for (const std::string& o : fn.outputs()) out.push_back(value.at(o));
  return out;
}

std::string Concatenate(Emitter& e, const std::string& a, const std::string& b, int64_t dim) {
  v1::Node n = e.Op(v1::CONCATENATE, {a, b});
  n.mutable_concatenate()->set_dimension(dim);
  return e.Emit(std::move(n), a);
}

// The operands' reduced dimensions last, as [kept, reduced] (M x K): the
// permutation and the kept dimensions.
struct Folded {
  std::vector<int64_t> perm, kept;
  int64_t m = 1, k = 1;
};
Folded Fold(const v1::TensorType& x, const std::vector<bool>& last) {
  Folded f;
  for (int d = 0; d < x.dims_size(); ++d) {
    if (!last[d]) {
      f.perm.push_back(d);
      f.kept.push_back(x.dims(d));
      f.m *= x.dims(d);
    }
  }
  for (int d = 0; d < x.dims_size(); ++d) {
    if (last[d]) {
      f.perm.push_back(d);
      f.k *= x.dims(d);
    }
  }
  return f;
}

// A pairwise tree: halves of [M, K] combined by the body until one column
// is left, then that column combined into the init values.
absl::StatusOr<std::vector<std::string>> LowerReduce(Emitter& e, const v1::Node& n,
                                                     const v1::Graph& fn,
                                                     const std::vector<std::string>& operands) {
  const size_t count = operands.size() / 2;
  const v1::TensorType& x = e.type(operands[0]);
  std::vector<bool> reduced(x.dims_size(), false);
  for (int64_t d : n.body().dims()) reduced[d] = true;
  const Folded f = Fold(x, reduced);
  const int64_t m = f.m;
  int64_t k = f.k;
  std::vector<std::string> results;
  if (k == 0 || m == 0) {
    for (size_t j = 0; j < count; ++j)
      results.push_back(e.Broadcast(operands[count + j], f.kept, {}));
    return results;
  }
  std::vector<std::string> xs;
  for (size_t j = 0; j < count; ++j)
    xs.push_back(e.Reshape(e.Transpose(operands[j], f.perm), {m, k}));
  while (k > 1) {
    const int64_t h = k / 2;
    std::vector<std::string> args;
    for (size_t j = 0; j < count; ++j) args.push_back(e.Slice(xs[j], {0, 0}, {m, h}, {1, 1}));
    for (size_t j = 0; j < count; ++j) args.push_back(e.Slice(xs[j], {0, h}, {m, 2 * h}, {1, 1}));
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> ys, Apply(e, fn, args));
    if (k % 2 != 0) {
      for (size_t j = 0; j < count; ++j)
        ys[j] = Concatenate(e, ys[j], e.Slice(xs[j], {0, 2 * h}, {m, k}, {1, 1}), 1);
    }
    xs = std::move(ys);
    k = h + k % 2;
  }
  std::vector<std::string> args;
  for (size_t j = 0; j < count; ++j) args.push_back(e.Broadcast(operands[count + j], {m}, {}));
  for (size_t j = 0; j < count; ++j) args.push_back(e.Reshape(xs[j], {m}));
  TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> ys, Apply(e, fn, args));
  for (const std::string& y : ys) results.push_back(e.Reshape(y, f.kept));
  return results;
}

// One step of the bitonic network over [M, P] values (the positions last):
// in each block of `block` positions, the first half against the second,
// reversed where `flip` (the first step of each merge). Positions past
// `n` are padding, sorted after every element.
absl::Status CompareExchange(Emitter& e, const v1::Graph& fn, std::vector<std::string>& xs,
                             int64_t m, int64_t p, int64_t n, int64_t block, bool flip) {
  const std::vector<int64_t> split = {m, p / block, 2, block / 2};
  google::protobuf::RepeatedField<int64_t> last;
  last.Add(3);
  std::vector<std::string> us, vs;
  for (const std::string& x : xs) {
    const std::string r = e.Reshape(x, split);
    us.push_back(e.Slice(r, {0, 0, 0, 0}, {m, p / block, 1, block / 2}, {1, 1, 1, 1}));
    const std::string v = e.Slice(r, {0, 0, 1, 0}, {m, p / block, 2, block / 2}, {1, 1, 1, 1});
    vs.push_back(flip ? e.Reverse(v, last) : v);
  }
  // The comparator's operands exclude the positions, held last.
  auto pairs = [&](const std::vector<std::string>& a, const std::vector<std::string>& b) {
    std::vector<std::string> args;
    for (size_t j = 0; j + 1 < a.size(); ++j) {
      args.push_back(a[j]);
      args.push_back(b[j]);
    }
    return args;
  };
  TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> v_first, Apply(e, fn, pairs(vs, us)));
  TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> u_first, Apply(e, fn, pairs(us, vs)));
  const std::string iu = us.back(), iv = vs.back();
  const std::string earlier = e.Compare(v1::LT, iv, iu);
  // v goes first where the comparator says so, or it ties and v came first.
  std::string swap =
      e.Binary(v1::OR, v_first[0], e.Binary(v1::AND, e.Unary(v1::NOT, u_first[0]), earlier));
  if (p > n) {
    const std::string end = e.FillInt(e.type(iu), n);
    const std::string both =
        e.Binary(v1::AND, e.Compare(v1::LT, iu, end), e.Compare(v1::LT, iv, end));
    swap = e.Select(both, swap, earlier);
  }
  for (size_t j = 0; j < xs.size(); ++j) {
    const std::string u = e.Select(swap, vs[j], us[j]);
    std::string v = e.Select(swap, us[j], vs[j]);
    if (flip) v = e.Reverse(v, last);
    xs[j] = e.Reshape(Concatenate(e, u, v, 2), {m, p});
  }
  return e.status();
}

absl::StatusOr<std::vector<std::string>> LowerSort(Emitter& e, const v1::Node& node,
                                                   const v1::Graph& fn,
                                                   const std::vector<std::string>& operands) {
  const v1::TensorType& x = e.type(operands[0]);
  const int64_t dim = node.body().dimension();
  const int64_t n = x.dims(dim);
  if (n <= 1) return operands;
  std::vector<bool> sorted(x.dims_size(), false);
  sorted[dim] = true;
  const Folded f = Fold(x, sorted);
  const int64_t m = f.m;
  int64_t p = 1;
  while (p < n) p *= 2;
  std::vector<std::string> xs;
  for (const std::string& o : operands) {
    std::string v = e.Reshape(e.Transpose(o, f.perm), {m, n});
    if (p > n) v = e.Pad(v, e.Zeros(Scalar(e.type(o).dtype())), {0, 0}, {0, p - n}, {0, 0});
    xs.push_back(v);
  }
  v1::TensorType positions = Scalar(v1::S64);
  positions.add_dims(m);
  positions.add_dims(p);
  xs.push_back(e.Iota(positions, 1));
  for (int64_t size = 2; size <= p; size *= 2) {
    TESSEL_RETURN_IF_ERROR(CompareExchange(e, fn, xs, m, p, n, size, true));
    for (int64_t half = size / 4; half >= 1; half /= 2)
      TESSEL_RETURN_IF_ERROR(CompareExchange(e, fn, xs, m, p, n, 2 * half, false));
  }
  std::vector<int64_t> inverse(f.perm.size()), moved = f.kept;
  moved.push_back(n);
  for (size_t i = 0; i < f.perm.size(); ++i) inverse[f.perm[i]] = int64_t(i);
  std::vector<std::string> results;
  for (size_t j = 0; j + 1 < xs.size(); ++j) {
    const std::string cut = e.Slice(xs[j], {0, 0}, {m, n}, {1, 1});
    results.push_back(e.Transpose(e.Reshape(cut, moved), inverse));
  }
  return results;
}

absl::StatusOr<v1::Graph> LowerGraph(const TypedGraph& g, const v1::Mesh& mesh,
                                     const FunctionTable& functions);

// A graph whose node types are not filled in (a function or a region's
// body), typed first.
absl::StatusOr<v1::Graph> LowerUntyped(const v1::Graph& graph, const v1::Graph& top,
                                       const v1::Mesh& mesh, bool manual) {
  v1::Graph with_functions = graph;
  *with_functions.mutable_functions() = top.functions();
  auto typed = manual ? ValidateGraph(with_functions, {.manual_mesh = &mesh})
                      : ValidateFunction(with_functions, mesh);
  if (!typed.ok()) return typed.status();
  const FunctionTable table(top);
  TESSEL_ASSIGN_OR_RETURN(v1::Graph out, LowerGraph(*typed, mesh, table));
  out.clear_functions();
  return out;
}

absl::StatusOr<v1::Graph> LowerGraph(const TypedGraph& g, const v1::Mesh& mesh,
                                     const FunctionTable& functions) {
  v1::Graph out;
  out.set_name(g.graph.name());
  absl::flat_hash_set<std::string> used;
  for (const v1::Node& n : g.graph.nodes()) used.insert(n.name());
  Emitter e(out, used);
  absl::flat_hash_map<std::string, std::string> rename;
  absl::flat_hash_map<std::string, std::vector<std::string>> lowered;
  auto renamed = [&](const std::string& v) {
    auto it = rename.find(v);
    return it == rename.end() ? v : it->second;
  };
  for (const v1::Node& n : g.graph.nodes()) {
    if (n.op() == v1::TUPLE_ELEMENT) {
      auto it = lowered.find(n.operands(0));
      if (it != lowered.end()) {
        rename[n.name()] = it->second.at(n.tuple_element().index());
        continue;
      }
    }
    if (HasBody(n.op())) {
      std::vector<std::string> operands;
      for (const std::string& o : n.operands()) operands.push_back(renamed(o));
      const v1::Graph& fn = *functions.graphs.at(n.body().function());
      e.set_base(n.name());
      auto results = n.op() == v1::REDUCE_WITH_BODY ? LowerReduce(e, n, fn, operands)
                                                    : LowerSort(e, n, fn, operands);
      if (results.ok() && !e.status().ok()) results = e.status();
      if (!results.ok())
        return Annotate(results.status(), StrCat("node '", n.name(), "' (", OpName(n.op()), "): "));
      lowered[n.name()] = std::move(*results);
      continue;
    }
    v1::Node c = n;
    for (int i = 0; i < c.operands_size(); ++i) c.set_operands(i, renamed(c.operands(i)));
    if (c.op() == v1::MANUAL_REGION && HasBodies(c.manual_region().body())) {
      auto body = LowerUntyped(c.manual_region().body(), g.graph, mesh, true);
      if (!body.ok())
        return Annotate(body.status(), StrCat("node '", n.name(), "' (manual_region) body: "));
      *c.mutable_manual_region()->mutable_body() = std::move(*body);
    }
    e.Adopt(std::move(c));
  }
  TESSEL_RETURN_IF_ERROR(e.status());
  for (const std::string& o : g.graph.outputs()) out.add_outputs(renamed(o));
  return out;
}

}  // namespace

absl::StatusOr<std::vector<v1::TensorType>> InferBodyResults(
    const v1::Node& n, absl::Span<const v1::TensorType* const> ops, FunctionTable& table,
    const ValidateOptions& options) {
  if (n.attrs_case() != v1::Node::kBody) return InvalidArgumentError("missing attributes 'body'");
  return n.op() == v1::REDUCE_WITH_BODY ? InferReduce(n, ops, table, options)
                                        : InferSort(n, ops, table, options);
}

bool HasBodies(const v1::Graph& g) {
  for (const v1::Node& n : g.nodes()) {
    if (HasBody(n.op())) return true;
    if (n.op() == v1::MANUAL_REGION && HasBodies(n.manual_region().body())) return true;
  }
  for (const v1::Graph& f : g.functions()) {
    if (HasBodies(f)) return true;
  }
  return false;
}

absl::StatusOr<v1::Graph> LowerBodies(const TypedGraph& g, const v1::Mesh& mesh) {
  const FunctionTable table(g.graph);
  TESSEL_ASSIGN_OR_RETURN(v1::Graph out, LowerGraph(g, mesh, table));
  for (const v1::Graph& f : g.graph.functions()) {
    if (!HasBodies(f)) {
      *out.add_functions() = f;
      continue;
    }
    auto lowered = LowerUntyped(f, g.graph, mesh, false);
    if (!lowered.ok()) return Annotate(lowered.status(), StrCat("function '", f.name(), "': "));
    *out.add_functions() = std::move(*lowered);
  }
  return out;
}

}  // namespace tessel::scheduler

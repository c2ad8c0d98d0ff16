// GraphBuilder's functions of a graph: control flow (while, cond, scan) and
// transformations (vjp, jvp, vmap, custom derivative rules), each built as a
// function of the graph on its own parameters.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/convert_internal.h"
#include "client/src/graph_internal.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "tessel/graph.h"

namespace tessel {

namespace {
std::string TypesText(const std::vector<Value>& vs) {
  std::vector<std::string> parts;
  for (const Value& v : vs) parts.push_back(TypeString(ToProto(v.type())));
  return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
}
}  // namespace

// Builds function `fn` of this graph over parameters of `types`; checks its
// results against `want` where given. Returns the results' types.
absl::StatusOr<std::vector<ArrayType>> GraphBuilder::Impl::AddFunction(
    const std::string& fn_name, const std::vector<ArrayType>& types, const Function& fn,
    const std::vector<ArrayType>* want, const std::string& want_what) {
  GraphBuilder inner(fn_name);
  inner.impl_->mesh = mesh;
  std::vector<Value> params;
  for (size_t i = 0; i < types.size(); ++i)
    params.push_back(inner.Parameter(types[i], absl::StrCat("p", i)));
  const std::vector<Value> out = fn(inner, params);
  absl::StatusOr<Graph> g = inner.Build(out);
  if (!g.ok()) return g.status();
  std::vector<ArrayType> got;
  for (const Value& v : out) got.push_back(v.type());
  if (want != nullptr) {
    bool same = got.size() == want->size();
    for (size_t i = 0; same && i < got.size(); ++i) same = got[i] == (*want)[i];
    if (!same) {
      std::vector<Value> wanted;
      for (const ArrayType& t : *want) {
        Value v;
        v.type_ = t;
        wanted.push_back(v);
      }
      return absl::InvalidArgumentError(absl::StrCat("function '", fn_name, "' returns ",
                                                     TypesText(out), "; expected ", want_what, " ",
                                                     TypesText(wanted)));
    }
  }
  v1::Graph proto = g->impl().proto;
  for (v1::Graph& nested : *proto.mutable_functions()) *graph.add_functions() = std::move(nested);
  proto.clear_functions();
  *graph.add_functions() = std::move(proto);
  return got;
}

std::vector<Value> GraphBuilder::Impl::ControlNode(v1::Node n, const std::vector<Value>& operands,
                                                   const std::vector<ArrayType>& results) {
  for (size_t i = 0; i < operands.size(); ++i) {
    const Value& v = operands[i];
    if (!v.valid() || v.id_ >= graph.nodes_size() || graph.nodes(v.id_).name() != v.name()) {
      Fail(absl::StrCat(OpName(n.op()), " '", n.name(), "'"),
           absl::StrCat("operand ", i, " is not a value of this builder"));
      return {};
    }
    n.add_operands(v.name());
  }
  for (const ArrayType& t : results) *n.add_results() = ToProto(t);
  Value node;
  node.id_ = graph.nodes_size();
  node.name_ = n.name();
  *graph.add_nodes() = n;
  std::vector<Value> out;
  for (size_t k = 0; k < results.size(); ++k) {
    v1::Node r = NodeOf(v1::TUPLE_ELEMENT);
    r.mutable_tuple_element()->set_index(int(k));
    const v1::TensorType declared = ToProto(results[k]);
    out.push_back(Add(std::move(r), {node}, &declared));
  }
  return out;
}

std::vector<Value> GraphBuilder::While(std::vector<Value> init, const Function& cond,
                                       const Function& body) {
  if (!impl_->status.ok()) return {};
  const int id = impl_->graph.nodes_size();
  const std::string name = absl::StrCat("while_", id);
  const std::string what = absl::StrCat("while '", name, "'");
  std::vector<ArrayType> types;
  for (const Value& v : init) {
    if (!v.valid()) return impl_->Fail(what, "a carry is not a value"), std::vector<Value>{};
    types.push_back(v.type());
  }
  const std::vector<ArrayType> pred = {ArrayType{DType::kPred, {}}};
  const std::string prefix = absl::StrCat(impl_->graph.name(), "/", name);
  auto c = impl_->AddFunction(prefix + "/cond", types, cond, &pred, "the loop predicate");
  if (!c.ok()) return impl_->Fail(what, c.status().message()), std::vector<Value>{};
  auto b = impl_->AddFunction(prefix + "/body", types, body, &types, "the carries");
  if (!b.ok()) return impl_->Fail(what, b.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::WHILE);
  n.set_name(name);
  n.mutable_control()->set_cond(prefix + "/cond");
  n.mutable_control()->set_body(prefix + "/body");
  return impl_->ControlNode(std::move(n), init, types);
}

std::vector<Value> GraphBuilder::Cond(Value index, std::vector<Value> operands,
                                      const std::vector<Function>& branches) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("conditional_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("conditional '", name, "'");
  if (branches.empty()) return impl_->Fail(what, "no branches"), std::vector<Value>{};
  std::vector<ArrayType> types;
  for (const Value& v : operands) {
    if (!v.valid()) return impl_->Fail(what, "an operand is not a value"), std::vector<Value>{};
    types.push_back(v.type());
  }
  const std::string prefix = absl::StrCat(impl_->graph.name(), "/", name);
  v1::Node n = NodeOf(v1::CONDITIONAL);
  n.set_name(name);
  std::vector<ArrayType> results;
  for (size_t k = 0; k < branches.size(); ++k) {
    const std::string fn = absl::StrCat(prefix, "/branch", k);
    auto r = impl_->AddFunction(fn, types, branches[k], k == 0 ? nullptr : &results,
                                "branch 0's results");
    if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
    if (k == 0) results = *r;
    n.mutable_control()->add_branches(fn);
  }
  std::vector<Value> all = {index};
  all.insert(all.end(), operands.begin(), operands.end());
  return impl_->ControlNode(std::move(n), all, results);
}

std::vector<Value> GraphBuilder::Scan(std::vector<Value> init, std::vector<Value> xs,
                                      int64_t length, const Function& body, bool reverse) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("scan_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("scan '", name, "'");
  std::vector<ArrayType> carries, params;
  for (const Value& v : init) {
    if (!v.valid()) return impl_->Fail(what, "a carry is not a value"), std::vector<Value>{};
    carries.push_back(v.type());
  }
  params = carries;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].valid())
      return impl_->Fail(what, "a scanned operand is not a value"), std::vector<Value>{};
    ArrayType t = xs[i].type();
    if (t.dims.empty() || t.dims[0] != length) {
      return impl_->Fail(what,
                         absl::StrCat("scanned operand ", i, " is ", TypeString(ToProto(t)),
                                      "; expected a leading dimension of the length, ", length)),
             std::vector<Value>{};
    }
    t.dims.erase(t.dims.begin());
    params.push_back(t);
  }
  const std::string fn = absl::StrCat(impl_->graph.name(), "/", name, "/body");
  auto r = impl_->AddFunction(fn, params, body, nullptr, "");
  if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
  bool same = r->size() >= carries.size();
  for (size_t i = 0; same && i < carries.size(); ++i) same = (*r)[i] == carries[i];
  if (!same) {
    return impl_->Fail(what, absl::StrCat("function '", fn, "' must return the carries ",
                                          TypesText(init), " first, each with its type")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> results = carries;
  for (size_t i = carries.size(); i < r->size(); ++i) {
    ArrayType y = (*r)[i];
    y.dims.insert(y.dims.begin(), length);
    results.push_back(y);
  }
  v1::Node n = NodeOf(v1::SCAN);
  n.set_name(name);
  n.mutable_control()->set_body(fn);
  n.mutable_control()->set_length(length);
  n.mutable_control()->set_num_carry(int(init.size()));
  n.mutable_control()->set_reverse(reverse);
  std::vector<Value> all = init;
  all.insert(all.end(), xs.begin(), xs.end());
  return impl_->ControlNode(std::move(n), all, results);
}

namespace {
// The types `f` returns for parameters of `types`, by building it on a scratch builder.
absl::StatusOr<std::vector<ArrayType>> ResultTypes(const GraphBuilder::Function& f,
                                                   const std::vector<ArrayType>& types) {
  GraphBuilder scratch("scratch");
  std::vector<Value> params;
  for (size_t i = 0; i < types.size(); ++i) params.push_back(scratch.Parameter(types[i]));
  const std::vector<Value> out = f(scratch, params);
  TESSEL_RETURN_IF_ERROR(scratch.status());
  std::vector<ArrayType> got;
  for (const Value& v : out) got.push_back(v.type());
  return got;
}
}  // namespace

// A VJP or JVP node of f at `args` with `extra` operands (cotangents or
// tangents) after them; the results are f's, then those `more` gives from
// f's result and argument types.
std::vector<Value> GraphBuilder::Impl::Derivative(
    v1::Op op, const Function& f, const std::vector<Value>& args, const std::vector<Value>& extra,
    const std::vector<int>& wrt,
    const std::function<std::vector<ArrayType>(const std::vector<ArrayType>& results,
                                               const std::vector<ArrayType>& args)>& more) {
  if (!status.ok()) return {};
  const std::string name = absl::StrCat(OpName(op), "_", graph.nodes_size());
  const std::string what = absl::StrCat(OpName(op), " '", name, "'");
  std::vector<ArrayType> types;
  if (!ArgTypes(args, what, types)) return {};
  for (int p : wrt) {
    if (p < 0 || p >= int(types.size())) {
      return Fail(what,
                  absl::StrCat("wrt ", p, " is not an argument (", types.size(), " arguments)")),
             std::vector<Value>{};
    }
  }
  const std::string fn = absl::StrCat(graph.name(), "/", name, "/f");
  auto r = AddFunction(fn, types, f, nullptr, "");
  if (!r.ok()) return Fail(what, r.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(op);
  n.set_name(name);
  n.mutable_grad()->set_function(fn);
  for (int p : wrt) n.mutable_grad()->add_wrt(p);
  std::vector<ArrayType> results = *r;
  for (const ArrayType& t : more(*r, types)) results.push_back(t);
  std::vector<Value> all = args;
  all.insert(all.end(), extra.begin(), extra.end());
  return ControlNode(std::move(n), all, results);
}

std::vector<Value> GraphBuilder::Vjp(const Function& f, std::vector<Value> args,
                                     std::vector<Value> cotangents, std::vector<int> wrt) {
  return impl_->Derivative(v1::VJP, f, args, cotangents, wrt,
                           [&](const auto&, const std::vector<ArrayType>& types) {
                             std::vector<ArrayType> cts;
                             for (int p : wrt) cts.push_back(types[p]);
                             return cts;
                           });
}

std::vector<Value> GraphBuilder::ValueAndGrad(const Function& f, std::vector<Value> args,
                                              std::vector<int> wrt) {
  if (!impl_->status.ok()) return {};
  std::vector<ArrayType> types;
  for (const Value& v : args) types.push_back(v.type());
  auto r = ResultTypes(f, types);
  if (!r.ok()) return impl_->Fail("value_and_grad", r.status().message()), std::vector<Value>{};
  if (r->size() != 1 || !r->at(0).dims.empty()) {
    return impl_->Fail("value_and_grad", "the function must return one scalar"),
           std::vector<Value>{};
  }
  return Vjp(f, std::move(args), {Fill(r->at(0), 1.0)}, std::move(wrt));
}

std::vector<Value> GraphBuilder::Jvp(const Function& f, std::vector<Value> args,
                                     std::vector<Value> tangents, std::vector<int> wrt) {
  return impl_->Derivative(
      v1::JVP, f, args, tangents, wrt,
      [](const std::vector<ArrayType>& results, const auto&) { return results; });
}

std::vector<Value> GraphBuilder::Vmap(const Function& f, std::vector<Value> args,
                                      std::vector<int64_t> in_axes, std::vector<int64_t> out_axes) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("vmap_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("vmap '", name, "'");
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  if (in_axes.size() != args.size()) {
    return impl_->Fail(what,
                       absl::StrCat(args.size(), " arguments but ", in_axes.size(), " in_axes")),
           std::vector<Value>{};
  }
  int64_t size = -1;
  for (size_t i = 0; i < types.size(); ++i) {
    const int64_t a = in_axes[i];
    if (a == kNotMapped) continue;
    if (a < 0 || a >= int64_t(types[i].dims.size())) {
      return impl_->Fail(what,
                         absl::StrCat("in_axes[", i, "] = ", a,
                                      ": expected kNotMapped or an axis of ", types[i].ToString())),
             std::vector<Value>{};
    }
    if (size >= 0 && types[i].dims[a] != size) {
      return impl_->Fail(what, absl::StrCat("argument ", i, " maps ", types[i].dims[a],
                                            " elements; an earlier one ", size)),
             std::vector<Value>{};
    }
    size = types[i].dims[a];
    types[i].dims.erase(types[i].dims.begin() + a);
  }
  if (size < 0)
    return impl_->Fail(what, "no argument is mapped (every in_axes is kNotMapped)"),
           std::vector<Value>{};
  const std::string fn = absl::StrCat(impl_->graph.name(), "/", name, "/f");
  auto r = impl_->AddFunction(fn, types, f, nullptr, "");
  if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
  if (out_axes.size() != r->size()) {
    return impl_->Fail(what, absl::StrCat("f has ", r->size(), " results but ", out_axes.size(),
                                          " out_axes")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> results = *r;
  for (size_t k = 0; k < results.size(); ++k) {
    const int64_t a = out_axes[k];
    if (a == kNotMapped) continue;
    if (a < 0 || a > int64_t(results[k].dims.size())) {
      return impl_->Fail(
                 what,
                 absl::StrCat("out_axes[", k, "] = ", a, ": expected kNotMapped or an axis in [0, ",
                              results[k].dims.size(), "] of result ", results[k].ToString())),
             std::vector<Value>{};
    }
    results[k].dims.insert(results[k].dims.begin() + a, size);
  }
  v1::Node n = NodeOf(v1::VMAP);
  n.set_name(name);
  n.mutable_batch()->set_function(fn);
  for (int64_t a : in_axes) n.mutable_batch()->add_in_axes(a);
  for (int64_t a : out_axes) n.mutable_batch()->add_out_axes(a);
  n.mutable_batch()->set_size(size);
  return impl_->ControlNode(std::move(n), args, results);
}

std::vector<Value> GraphBuilder::CustomVjp(const Function& f, const Function& fwd,
                                           const Function& bwd, std::vector<Value> args) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("custom_vjp_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("custom_vjp '", name, "'"),
                    prefix = absl::StrCat(impl_->graph.name(), "/", name);
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  auto results = impl_->AddFunction(prefix + "/f", types, f, nullptr, "");
  if (!results.ok()) return impl_->Fail(what, results.status().message()), std::vector<Value>{};
  auto kept = impl_->AddFunction(prefix + "/fwd", types, fwd, nullptr, "");
  if (!kept.ok()) return impl_->Fail(what, kept.status().message()), std::vector<Value>{};
  if (kept->size() < results->size() ||
      !std::equal(results->begin(), results->end(), kept->begin())) {
    return impl_->Fail(what, absl::StrCat("fwd must return f's results ", results->size(),
                                          " first, then residuals")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> bwd_params(kept->begin() + results->size(), kept->end());
  bwd_params.insert(bwd_params.end(), results->begin(), results->end());
  auto cts =
      impl_->AddFunction(prefix + "/bwd", bwd_params, bwd, &types, "a cotangent per argument");
  if (!cts.ok()) return impl_->Fail(what, cts.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::CUSTOM_VJP);
  n.set_name(name);
  n.mutable_custom_vjp()->set_function(prefix + "/f");
  n.mutable_custom_vjp()->set_fwd(prefix + "/fwd");
  n.mutable_custom_vjp()->set_bwd(prefix + "/bwd");
  return impl_->ControlNode(std::move(n), args, *results);
}

std::vector<Value> GraphBuilder::CustomJvp(const Function& f, const Function& jvp,
                                           std::vector<Value> args) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("custom_jvp_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("custom_jvp '", name, "'"),
                    prefix = absl::StrCat(impl_->graph.name(), "/", name);
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  auto results = impl_->AddFunction(prefix + "/f", types, f, nullptr, "");
  if (!results.ok()) return impl_->Fail(what, results.status().message()), std::vector<Value>{};
  std::vector<ArrayType> twice = types, both = *results;
  twice.insert(twice.end(), types.begin(), types.end());
  both.insert(both.end(), results->begin(), results->end());
  auto rule = impl_->AddFunction(prefix + "/jvp", twice, jvp, &both,
                                 "f's results, then a tangent per result");
  if (!rule.ok()) return impl_->Fail(what, rule.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::CUSTOM_JVP);
  n.set_name(name);
  n.mutable_custom_jvp()->set_function(prefix + "/f");
  n.mutable_custom_jvp()->set_jvp(prefix + "/jvp");
  return impl_->ControlNode(std::move(n), args, *results);
}

}  // namespace tessel

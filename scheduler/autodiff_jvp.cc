#include "scheduler/autodiff_modes.h"

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
#include "scheduler/batching.h"
#include "scheduler/graph_emitter.h"
#include "scheduler/ops/op_rules.h"
#include "scheduler/varying.h"

namespace tessel::scheduler {
namespace {

using absl::StrCat;

// One JVP node's expansion into `e`: each node of the function, then its
// tangent, in one forward pass.
class Jvp : public ops::ForwardMode {
 public:
  Jvp(Emitter& e, const v1::Node& node, const TypedGraph& f, std::vector<std::string> args,
      std::vector<std::string> tangents, google::protobuf::RepeatedPtrField<v1::Graph>* functions,
      const v1::Mesh& mesh)
      : e_(e), node_(node), f_(f), args_(std::move(args)), functions_(functions), mesh_(mesh) {
    for (int k = 0; k < node.grad().wrt_size(); ++k) {
      in_tangent_[node.grad().wrt(k)] = tangents[k];
    }
  }

  absl::StatusOr<std::vector<std::string>> Run() {
    const std::string prefix = StrCat(node_.name(), "/");
    e_.set_base(prefix + "tangent");
    for (const v1::Node& n : f_.graph.nodes()) {
      if (n.op() == v1::PARAMETER) {
        fwd_[n.name()] = args_[n.parameter().index()];
        if (auto it = in_tangent_.find(n.parameter().index()); it != in_tangent_.end())
          tan_[n.name()] = it->second;
        continue;
      }
      if (n.op() == v1::VJP || n.op() == v1::JVP) {
        return absl::UnimplementedError(
            StrCat("jvp of '", node_.grad().function(), "': node '", n.name(),
                   "' is itself a derivative, which is not supported yet"));
      }
      v1::Node c = n;
      c.clear_operands();
      for (const std::string& o : n.operands()) c.add_operands(fwd_.at(o));
      fwd_[n.name()] = e_.Copy(std::move(c), prefix + n.name());
      bool any = false;
      for (const std::string& o : n.operands()) any |= tan_.contains(o);
      if (n.op() == v1::TUPLE_ELEMENT) {
        auto it = result_tan_.find(n.operands(0));
        if (it != result_tan_.end() && !it->second[n.tuple_element().index()].empty()) {
          tan_[n.name()] = it->second[n.tuple_element().index()];
        }
        continue;
      }
      if (!any) continue;
      if (n.op() == v1::CUSTOM_VJP) {
        return absl::InvalidArgumentError(
            StrCat("jvp of '", node_.grad().function(), "': node '", n.name(),
                   "' has a custom VJP, which forward mode cannot use (as JAX: ",
                   "define a custom_jvp, or differentiate in reverse mode)"));
      }
      if (n.op() == v1::WHILE || n.op() == v1::SCAN) {
        TESSEL_RETURN_IF_ERROR(TangentLoop(n));
      } else if (n.op() == v1::CONDITIONAL) {
        TESSEL_RETURN_IF_ERROR(TangentCond(n));
      } else if (n.op() == v1::CUSTOM_JVP) {
        TESSEL_RETURN_IF_ERROR(TangentCustom(n));
      } else if (n.op() == v1::MANUAL_REGION && IsMultiResult(n)) {
        TESSEL_ASSIGN_OR_RETURN(result_tan_[n.name()], TangentRegion(n));
      } else if (IsMultiResult(n)) {
        return absl::UnimplementedError(StrCat("jvp of '", node_.grad().function(), "': node '",
                                               n.name(), "' (", OpName(n.op()),
                                               ") has no forward-mode rule yet"));
      } else if (IsFloat(n.type().dtype())) {
        TESSEL_ASSIGN_OR_RETURN(std::string t, Tangent(n));
        if (!t.empty()) tan_[n.name()] = t;
      }
      TESSEL_RETURN_IF_ERROR(e_.status());
    }
    std::vector<std::string> results, tangents;
    for (const std::string& o : f_.graph.outputs()) {
      results.push_back(fwd_.at(o));
      auto it = tan_.find(o);
      tangents.push_back(it != tan_.end() ? it->second : e_.Zeros(TypeOf(o)));
    }
    results.insert(results.end(), tangents.begin(), tangents.end());
    TESSEL_RETURN_IF_ERROR(e_.status());
    return results;
  }

 private:
  const v1::TensorType& TypeOf(const std::string& v) const {
    return f_.graph.nodes(f_.index_of.at(v)).type();
  }
  std::string T(const v1::Node& n, int k) {  // operand k's tangent, or ""
    auto it = tan_.find(n.operands(k));
    return it == tan_.end() ? "" : it->second;
  }
  std::string TZ(const v1::Node& n, int k) {  // operand k's tangent, or zeros
    const std::string t = T(n, k);
    return t.empty() ? e_.Zeros(TypeOf(n.operands(k))) : t;
  }
  // The same op applied to the tangents in place of the operands.
  std::string Same(const v1::Node& n, const std::vector<std::string>& operands) override {
    v1::Node c = n;
    c.clear_operands();
    for (const std::string& o : operands) c.add_operands(o);
    return e_.Emit(std::move(c), StrCat(fwd_.at(n.name()), ".tangent"));
  }

  // The tangent of F's node `n`, or "" where none flows: a region's is
  // this driver's, every other op's its row's in scheduler/ops.
  absl::StatusOr<std::string> Tangent(const v1::Node& n) {
    if (n.op() == v1::MANUAL_REGION) {
      TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> t, TangentRegion(n));
      return t.at(0);
    }
    if (const ops::OpRules* r = ops::Find(n.op()); r != nullptr && r->jvp != nullptr)
      return r->jvp(*this, n);
    return absl::UnimplementedError(StrCat(Where(), ": node '", n.name(), "' (", OpName(n.op()),
                                           ") has no forward-mode rule yet"));
  }

  // ops::ForwardMode, for the rules.
  Emitter& e() override { return e_; }
  std::string Operand(const v1::Node& n, int k) override { return fwd_.at(n.operands(k)); }
  std::string Result(const v1::Node& n) override { return fwd_.at(n.name()); }
  std::string Tangent(const v1::Node& n, int k) override { return T(n, k); }
  std::string TangentOrZeros(const v1::Node& n, int k) override { return TZ(n, k); }
  const v1::TensorType& OperandType(const v1::Node& n, int k) override {
    return TypeOf(n.operands(k));
  }
  std::string Where() const override { return StrCat("jvp of '", node_.grad().function(), "'"); }

  // A custom_jvp's tangents: its rule, run as a call on the operands and
  // their tangents (zeros where none flows).
  absl::Status TangentCustom(const v1::Node& n) {
    const int m = n.results_size();
    v1::Node call = BranchCall(e_, n.custom_jvp().jvp());
    for (const std::string& o : n.operands()) call.add_operands(fwd_.at(o));
    for (int k = 0; k < n.operands_size(); ++k) call.add_operands(TZ(n, k));
    for (int r = 0; r < 2; ++r) {
      for (const v1::TensorType& t : n.results()) *call.add_results() = t;
    }
    const std::string b = e_.Multi(std::move(call), StrCat(fwd_.at(n.name()), ".jvp"));
    std::vector<std::string>& tans = result_tan_[n.name()];
    tans.assign(m, "");
    for (int k = 0; k < m; ++k) {
      if (IsFloat(n.results(k).dtype())) tans[k] = e_.Element(b, m + k, n.results(k));
    }
    return e_.status();
  }

  // A manual region's tangents come from a manual region over the same mesh
  // running its body's JVP on the blocks of the operands and of their
  // tangents; one per result, under the result's out_spec.
  absl::StatusOr<std::vector<std::string>> TangentRegion(const v1::Node& n) {
    const std::string where =
        StrCat("jvp of '", node_.grad().function(), "': manual region '", n.name(), "'");
    const v1::ManualRegionAttrs& m = n.manual_region();
    const bool multi = m.out_specs_size() > 0;
    auto body = RegionBody(n, mesh_, *functions_, where);
    if (!body.ok()) return body.status();
    const int np = int(body->parameters.size()), nr = body->graph.outputs_size();
    v1::Graph bb;
    bb.set_name(StrCat(n.name(), ".tangent"));
    absl::flat_hash_set<std::string> used;
    Emitter eb(bb, used);
    v1::Node region;
    region.set_op(v1::MANUAL_REGION);
    v1::ManualRegionAttrs& rm = *region.mutable_manual_region();
    std::vector<std::string> args, tangents;
    v1::Node jvp;
    jvp.set_name(n.name());
    jvp.set_op(v1::JVP);
    jvp.mutable_grad()->set_function(
        StrCat(node_.grad().function(), "' in manual region '", n.name()));
    for (int i = 0; i < np; ++i) {
      const v1::TensorType& t = body->graph.nodes(body->parameters[i]).type();
      args.push_back(eb.Copy(ParameterNode("", i, t), StrCat("x", i)));
      region.add_operands(fwd_.at(n.operands(i)));
      *rm.add_in_specs() = m.in_specs(i);
    }
    for (int i = 0; i < np; ++i) {
      const std::string t = T(n, i);
      if (t.empty()) continue;
      jvp.mutable_grad()->add_wrt(i);
      tangents.push_back(
          eb.Copy(ParameterNode("", region.operands_size(), eb.type(args[i])), StrCat("t", i)));
      region.add_operands(t);
      *rm.add_in_specs() = m.in_specs(i);
    }
    Jvp inner(eb, jvp, *body, args, tangents, functions_, mesh_);
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> results, inner.Run());
    for (int k = 0; k < nr; ++k) bb.add_outputs(results.at(nr + k));
    *rm.mutable_body() = std::move(bb);
    const std::string base = StrCat(fwd_.at(n.name()), ".tangent");
    if (!multi) {
      *rm.mutable_out_spec() = m.out_spec();
      *region.mutable_type() = n.type();
      return std::vector<std::string>{e_.Copy(std::move(region), base)};
    }
    *rm.mutable_out_specs() = m.out_specs();
    *region.mutable_results() = n.results();
    const std::string r = e_.Multi(std::move(region), base);
    std::vector<std::string> out;
    for (int k = 0; k < nr; ++k)
      out.push_back(IsFloat(n.results(k).dtype()) ? e_.Element(r, k, n.results(k)) : "");
    return out;
  }

  // A loop's tangent: the same loop over (carries, their tangents), whose
  // body is the JVP of the loop body (and whose condition ignores the
  // tangents); a scan also scans the tangents of its scanned operands and
  // stacks those of its ys.
  absl::Status TangentLoop(const v1::Node& n) {
    const bool scan = n.op() == v1::SCAN;
    const v1::ControlFlowAttrs& c = n.control();
    const int nc = scan ? c.num_carry() : n.operands_size(), nx = n.operands_size() - nc;
    const int ny = n.results_size() - nc;
    auto slice_type = [](v1::TensorType t) {
      t.mutable_dims()->erase(t.mutable_dims()->begin());
      return t;
    };
    std::vector<int> fc, fx;  // the float carries and scanned operands: those with tangents
    for (int k = 0; k < nc; ++k) {
      if (IsFloat(TypeOf(n.operands(k)).dtype())) fc.push_back(k);
    }
    for (int j = 0; j < nx; ++j) {
      if (IsFloat(TypeOf(n.operands(nc + j)).dtype())) fx.push_back(j);
    }
    const v1::Graph* cond = nullptr;
    for (const v1::Graph& g : *functions_) {
      if (!scan && g.name() == c.cond()) cond = &g;
    }
    // body'(c, tc, x, tx) -> (c', tc', y, ty) through the body's JVP.
    v1::Graph bb;
    bb.set_name(StrCat(c.body(), ".tangent"));
    std::vector<std::string> cs, tcs, xs, txs;
    int index = 0;
    auto param = [&](const std::string& name, const v1::TensorType& t) {
      return AddNode(bb, ParameterNode(name, index++, t));
    };
    for (int k = 0; k < nc; ++k) cs.push_back(param(StrCat("c", k), TypeOf(n.operands(k))));
    for (int k : fc) tcs.push_back(param(StrCat("tc", k), TypeOf(n.operands(k))));
    for (int j = 0; j < nx; ++j)
      xs.push_back(param(StrCat("x", j), slice_type(TypeOf(n.operands(nc + j)))));
    for (int j : fx) txs.push_back(param(StrCat("tx", j), slice_type(TypeOf(n.operands(nc + j)))));
    v1::Node v;
    v.set_name("jvp");
    v.set_op(v1::JVP);
    v.mutable_grad()->set_function(c.body());
    for (const std::string& o : cs) v.add_operands(o);
    for (const std::string& o : xs) v.add_operands(o);
    for (int k : fc) v.mutable_grad()->add_wrt(k);
    for (int j : fx) v.mutable_grad()->add_wrt(nc + j);
    for (const std::string& o : tcs) v.add_operands(o);
    for (const std::string& o : txs) v.add_operands(o);
    const int nr = nc + ny;
    std::vector<v1::TensorType> body_results;
    for (int k = 0; k < nr; ++k)
      body_results.push_back(k < nc ? TypeOf(n.operands(k)) : slice_type(n.results(k)));
    for (int r = 0; r < 2; ++r) {
      for (const v1::TensorType& t : body_results) *v.add_results() = t;
    }
    *bb.add_nodes() = v;
    auto element = [&](int k, const v1::TensorType& t) { AddOutput(bb, "jvp", k, t); };
    std::vector<int> fy;
    for (int m = 0; m < ny; ++m) {
      if (IsFloat(n.results(nc + m).dtype())) fy.push_back(m);
    }
    for (int k = 0; k < nc; ++k) element(k, body_results[k]);            // c'
    for (int k : fc) element(nr + k, body_results[k]);                   // tc'
    for (int m = 0; m < ny; ++m) element(nc + m, body_results[nc + m]);  // y
    for (int m : fy) element(nr + nc + m, body_results[nc + m]);         // ty
    v1::Node loop = n;
    loop.clear_operands();
    loop.clear_results();
    for (int k = 0; k < nc; ++k) loop.add_operands(fwd_.at(n.operands(k)));
    for (int k : fc) loop.add_operands(TZ(n, k));
    for (int j = 0; j < nx; ++j) loop.add_operands(fwd_.at(n.operands(nc + j)));
    for (int j : fx) loop.add_operands(TZ(n, nc + j));
    const std::string bname = AddFunction(std::move(bb));
    loop.mutable_control()->set_body(bname);
    if (scan) {
      loop.mutable_control()->set_num_carry(nc + int(fc.size()));
    } else {
      // cond'(c, tc) = cond(c): the same function with the tangents as unused parameters.
      v1::Graph cc = *cond;
      cc.set_name(StrCat(c.cond(), ".tangent"));
      for (size_t i = 0; i < fc.size(); ++i) {
        v1::Node p;
        p.set_name(StrCat("tangent", i, ".unused"));
        p.set_op(v1::PARAMETER);
        p.mutable_parameter()->set_index(nc + int(i));
        *p.mutable_type() = TypeOf(n.operands(fc[i]));
        *cc.add_nodes() = p;
      }
      loop.mutable_control()->set_cond(AddFunction(std::move(cc)));
    }
    for (int k = 0; k < nc; ++k) *loop.add_results() = n.results(k);
    for (int k : fc) *loop.add_results() = n.results(k);
    for (int m = 0; m < ny; ++m) *loop.add_results() = n.results(nc + m);
    for (int m : fy) *loop.add_results() = n.results(nc + m);
    // The tangent loop computes the primal results again: its own results
    // replace the forward loop's (which is left unread).
    const std::string l = e_.Multi(std::move(loop), StrCat(fwd_.at(n.name()), ".tangent"));
    std::vector<std::string>& rt = result_tan_[n.name()];
    rt.assign(n.results_size(), "");
    int r = nc;
    for (int k : fc) rt[k] = e_.Element(l, r++, n.results(k));
    r += ny;
    for (int m : fy) rt[nc + m] = e_.Element(l, r++, n.results(nc + m));
    return absl::OkStatus();
  }

  // A conditional's tangent: the same conditional over (operands, their
  // tangents), each branch the JVP of the original branch. Its results are
  // the primal results again, then the tangents of the float ones.
  absl::Status TangentCond(const v1::Node& n) {
    const int no = n.operands_size() - 1, nr = n.results_size();
    std::vector<int> fo, fr;  // float operands (of the branches) and results
    for (int k = 0; k < no; ++k) {
      if (IsFloat(TypeOf(n.operands(k + 1)).dtype())) fo.push_back(k);
    }
    for (int m = 0; m < nr; ++m) {
      if (IsFloat(n.results(m).dtype())) fr.push_back(m);
    }
    v1::Node cond = n;
    cond.clear_operands();
    cond.clear_results();
    cond.mutable_control()->clear_branches();
    cond.add_operands(fwd_.at(n.operands(0)));
    for (int k = 0; k < no; ++k) cond.add_operands(fwd_.at(n.operands(k + 1)));
    for (int k : fo) cond.add_operands(TZ(n, k + 1));
    for (const std::string& branch : n.control().branches()) {
      // branch'(ops, tangents) -> (results, float results' tangents)
      v1::Graph g;
      g.set_name(StrCat(branch, ".tangent"));
      v1::Node v;
      v.set_name("jvp");
      v.set_op(v1::JVP);
      v.mutable_grad()->set_function(branch);
      int index = 0;
      for (int k = 0; k < no; ++k)
        v.add_operands(
            AddNode(g, ParameterNode(StrCat("o", k), index++, TypeOf(n.operands(k + 1)))));
      for (int k : fo) {
        v.add_operands(
            AddNode(g, ParameterNode(StrCat("t", k), index++, TypeOf(n.operands(k + 1)))));
        v.mutable_grad()->add_wrt(k);
      }
      for (int r = 0; r < 2; ++r) {
        for (int m = 0; m < nr; ++m) *v.add_results() = n.results(m);
      }
      *g.add_nodes() = v;
      for (int m = 0; m < nr; ++m) AddOutput(g, "jvp", m, n.results(m));
      for (int m : fr) AddOutput(g, "jvp", nr + m, n.results(m));
      cond.mutable_control()->add_branches(AddFunction(std::move(g)));
    }
    for (int m = 0; m < nr; ++m) *cond.add_results() = n.results(m);
    for (int m : fr) *cond.add_results() = n.results(m);
    const std::string c = e_.Multi(std::move(cond), StrCat(fwd_.at(n.name()), ".tangent"));
    std::vector<std::string>& rt = result_tan_[n.name()];
    rt.assign(nr, "");
    int r = nr;
    for (int m : fr) rt[m] = e_.Element(c, r++, n.results(m));
    if (!IsMultiResult(n) && !rt[0].empty())
      tan_[n.name()] = rt[0];  // read without a tuple element
    return absl::OkStatus();
  }

  // Appends to `g`, and to its outputs, result `k` (of type `t`) of its
  // multi-result node `of`.
  static void AddOutput(v1::Graph& g, const std::string& of, int k, const v1::TensorType& t) {
    g.add_outputs(AddNode(g, TupleElementNode(StrCat("r", k), of, k, t)));
  }

  std::string AddFunction(v1::Graph g) {
    g.set_name(e_.Fresh(g.name()));
    const std::string name = g.name();
    *functions_->Add() = std::move(g);
    return name;
  }

  Emitter& e_;
  const v1::Node& node_;
  const TypedGraph& f_;
  std::vector<std::string> args_;
  google::protobuf::RepeatedPtrField<v1::Graph>* functions_;
  const v1::Mesh& mesh_;
  absl::flat_hash_map<int, std::string> in_tangent_;   // parameter index -> its tangent
  absl::flat_hash_map<std::string, std::string> fwd_;  // F's value -> its name in the output
  absl::flat_hash_map<std::string, std::string> tan_;  // F's value -> its tangent's name
  absl::flat_hash_map<std::string, std::vector<std::string>>
      result_tan_;  // a loop's results' tangents
};

}  // namespace

absl::StatusOr<std::vector<std::string>> ExpandJvp(
    Emitter& e, const v1::Node& node, const TypedGraph& f, std::vector<std::string> args,
    std::vector<std::string> tangents, google::protobuf::RepeatedPtrField<v1::Graph>* functions,
    const v1::Mesh& mesh) {
  Jvp jvp(e, node, f, std::move(args), std::move(tangents), functions, mesh);
  return jvp.Run();
}

}  // namespace tessel::scheduler

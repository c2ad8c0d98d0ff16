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

using absl::StrCat;

namespace {

// One VJP node's expansion into `e`.
class Vjp : public ops::ReverseMode {
 public:
  // New functions (a loop's backward body) go to `functions`. `mesh`: what
  // manual regions run over; `region`: set when `f` is a region's body.
  Vjp(Emitter& e, const v1::Node& node, const TypedGraph& f, std::vector<std::string> args,
      std::vector<std::string> cotangents, google::protobuf::RepeatedPtrField<v1::Graph>* functions,
      const v1::Mesh& mesh, RegionContext* region = nullptr)
      : e_(e),
        node_(node),
        f_(f),
        args_(std::move(args)),
        cts_(std::move(cotangents)),
        functions_(functions),
        mesh_(mesh),
        region_(region) {}

  // The names of the node's results: F's results, then the cotangents of `wrt`.
  absl::StatusOr<std::vector<std::string>> Run() {
    const std::string prefix = StrCat(node_.name(), "/");
    const std::string fn = node_.grad().function();
    // Only values that depend on a parameter in `wrt` take a cotangent.
    for (int p : node_.grad().wrt()) active_.insert(f_.graph.nodes(f_.parameters[p]).name());
    for (const v1::Node& n : f_.graph.nodes()) {
      if (Active(n)) active_.insert(n.name());
    }
    // Forward: F's nodes, inlined.
    e_.set_base(prefix + "fwd");
    for (const v1::Node& n : f_.graph.nodes()) {
      if (n.op() == v1::PARAMETER) {
        fwd_[n.name()] = args_[n.parameter().index()];
        continue;
      }
      if (n.op() == v1::VJP) {
        return absl::UnimplementedError(StrCat("vjp of '", fn, "': node '", n.name(),
                                               "' is itself a vjp (a gradient ",
                                               "of a gradient), which is not supported yet"));
      }
      v1::Node c = n;
      c.clear_operands();
      for (const std::string& o : n.operands()) c.add_operands(fwd_.at(o));
      if (n.op() == v1::SCAN && Active(n)) TESSEL_RETURN_IF_ERROR(KeepResiduals(c));
      if (n.op() == v1::CUSTOM_VJP) {
        // The user's forward function (results, then residuals) where it is
        // differentiated, else the function itself; run as a call.
        const std::string fn = Active(n) ? n.custom_vjp().fwd() : n.custom_vjp().function();
        TESSEL_ASSIGN_OR_RETURN(c, CallNode(n.name(), c, fn, prefix));
      }
      if (n.op() == v1::CUSTOM_JVP) {
        TESSEL_ASSIGN_OR_RETURN(c, CallNode(n.name(), c, n.custom_jvp().function(), prefix));
      }
      const std::string name = e_.Fresh(StrCat(prefix, n.name()));
      c.set_name(name);
      e_.Declare(name, n.type());
      fwd_[n.name()] = name;
      if (region_ != nullptr) region_->Track(c);
      pending_.push_back(std::move(c));
    }

    // Backward: the cotangents, from F's results back to its parameters.
    for (int j = 0; j < f_.graph.outputs_size(); ++j) Accumulate(f_.graph.outputs(j), cts_[j]);
    e_.set_base(prefix + "bwd");
    for (int i = f_.graph.nodes_size() - 1; i >= 0; --i) {
      const v1::Node& n = f_.graph.nodes(i);
      if (n.op() == v1::SCAN || n.op() == v1::CONDITIONAL || n.op() == v1::CUSTOM_VJP ||
          n.op() == v1::CUSTOM_JVP || (n.op() == v1::MANUAL_REGION && IsMultiResult(n))) {
        if (auto r = result_ct_.find(n.name()); r != result_ct_.end()) {
          const std::vector<std::string> cts = r->second;
          TESSEL_RETURN_IF_ERROR(n.op() == v1::MANUAL_REGION ? TransposeRegion(n, cts)
                                 : n.op() == v1::SCAN        ? TransposeScan(n, cts)
                                 : n.op() == v1::CONDITIONAL ? TransposeConditional(n, cts)
                                 : n.op() == v1::CUSTOM_VJP  ? TransposeCustom(n, cts)
                                                             : TransposeCustomJvp(n, cts));
          TESSEL_RETURN_IF_ERROR(e_.status());
        }
        continue;
      }
      if (!ct_.contains(n.name()) || n.op() == v1::PARAMETER) continue;
      // An all_gather's transpose sums its cotangent itself (a
      // reduce_scatter where it can).
      const std::string ct = Total(n.name(), /*settle=*/n.op() != v1::ALL_GATHER);
      TESSEL_RETURN_IF_ERROR(Transpose(n, ct));
      TESSEL_RETURN_IF_ERROR(e_.status());
      if (region_ != nullptr) TESSEL_RETURN_IF_ERROR(region_->status);
    }
    std::vector<std::string> results;
    for (const std::string& o : f_.graph.outputs()) results.push_back(fwd_.at(o));
    for (int p : node_.grad().wrt()) {
      const v1::Node& prm = f_.graph.nodes(f_.parameters[p]);
      results.push_back(ct_.contains(prm.name()) ? Total(prm.name()) : e_.Fill(prm.type(), 0.0));
    }
    TESSEL_RETURN_IF_ERROR(e_.status());
    if (region_ != nullptr) TESSEL_RETURN_IF_ERROR(region_->status);
    return results;
  }

  // The forward nodes, to be emitted before the backward ones (they are
  // collected first so that a node's name is known to the backward pass).
  std::vector<v1::Node>& forward() { return pending_; }

 private:
  const v1::TensorType& TypeOf(const std::string& f_name) const {
    return f_.graph.nodes(f_.index_of.at(f_name)).type();
  }
  // Adds `ct` to the cotangent of F's value `v` (floats only).
  // In a region's body the contributions are summed apart by the mesh
  // axes they vary over beyond `v`: each such part is summed over those
  // axes once (Settle), so that a contribution already the same on every
  // device of an axis (a loop carry passed through, a replicated use) is
  // not counted once per device. JAX sums at each implicit broadcast (its
  // pvary), which comes to the same.
  void Accumulate(const std::string& v, const std::string& ct) {
    if (ct.empty() || !active_.contains(v) || !IsFloat(TypeOf(v).dtype())) return;
    const std::string key = region_ != nullptr ? absl::StrJoin(Excess(v, ct), ",") : "";
    std::vector<std::pair<std::string, std::string>>& parts = ct_[v];
    for (auto& [k, sum] : parts) {
      if (k == key) {
        sum = e_.Binary(v1::ADD, sum, ct);
        return;
      }
    }
    parts.emplace_back(key, ct);
  }

  // The cotangent of F's value `v`: its parts, each summed over the axes
  // it varies over beyond v's (unless not `settle`), added.
  std::string Total(const std::string& v, bool settle = true) {
    std::string total;
    for (const auto& [key, sum] : std::vector(ct_.at(v))) {  // a copy: Settle emits
      const std::string part = settle ? Settle(v, sum) : sum;
      total = total.empty() ? part : e_.Binary(v1::ADD, total, part);
    }
    return total;
  }

  // F's value `v` for the backward pass: a generated constant (fill, iota)
  // is generated again there rather than kept from the forward pass, so it
  // costs no buffer.
  std::string Forward(const std::string& v) {
    const v1::Node& def = f_.graph.nodes(f_.index_of.at(v));
    if (def.op() == v1::CONSTANT && !def.constant().has_literal()) {
      auto [it, fresh] = regenerated_.emplace(v, "");
      if (fresh) it->second = e_.Emit(def, StrCat(fwd_.at(v), ".again"));
      return it->second;
    }
    return fwd_.at(v);
  }

  // Adds each operand's share of `ct`, the cotangent of F's node `n`.
  // Regions, collectives (whose transposition depends on what the region's
  // values vary over) and tuple elements are this driver's; every other op
  // is its row's in scheduler/ops.
  absl::Status Transpose(const v1::Node& n, const std::string& ct) {
    switch (n.op()) {
      case v1::MANUAL_REGION: return TransposeRegion(n, {ct});
      case v1::ALL_REDUCE:
      case v1::ALL_GATHER:
      case v1::REDUCE_SCATTER:
      case v1::ALL_TO_ALL:
      case v1::COLLECTIVE_PERMUTE: return TransposeCollective(n, ct);
      case v1::CUSTOM_KERNEL:
        return absl::UnimplementedError(StrCat(Where(), ": custom kernel '",
                                               n.custom_kernel().name(), "' (node '", n.name(),
                                               "') has no derivative of its own: wrap its call in "
                                               "custom_vjp, whose backward function may call a ",
                                               "backward kernel with its own replication rule"));
      case v1::TUPLE_ELEMENT: return TransposeTupleElement(n, ct);
      default: break;
    }
    if (const ops::OpRules* r = ops::Find(n.op()); r != nullptr && r->vjp != nullptr)
      return r->vjp(*this, n, ct);
    return absl::UnimplementedError(StrCat(Where(), ": node '", n.name(), "' (", OpName(n.op()),
                                           "): reverse mode has no transposition rule for it yet"));
  }

  absl::Status TransposeTupleElement(const v1::Node& n, const std::string& ct) {
    const v1::Node& src = f_.graph.nodes(f_.index_of.at(n.operands(0)));
    if (src.op() == v1::SCAN || src.op() == v1::CONDITIONAL || src.op() == v1::CUSTOM_VJP ||
        src.op() == v1::CUSTOM_JVP || src.op() == v1::MANUAL_REGION) {
      std::vector<std::string>& cts = result_ct_[src.name()];
      cts.resize(src.results_size());
      std::string& slot = cts[n.tuple_element().index()];
      slot = slot.empty() ? ct : e_.Binary(v1::ADD, slot, ct);
      return absl::OkStatus();
    }
    const std::string where = StrCat(Where(), ": node '", n.name(), "' (", OpName(n.op()), ")");
    if (src.op() == v1::WHILE) {
      return absl::InvalidArgumentError(
          StrCat(where, " reads while loop '", src.name(),
                 "': reverse mode needs a trip count known at compile time, ",
                 "as in JAX; write the loop as scan or as fori_loop with Python int bounds"));
    }
    return absl::UnimplementedError(StrCat(where, " reads ", OpName(src.op()), " '", src.name(),
                                           "', which reverse mode does not differentiate yet"));
  }

  // ops::ReverseMode, for the rules.
  Emitter& e() override { return e_; }
  std::string Operand(const v1::Node& n, int k) override { return Forward(n.operands(k)); }
  std::string Result(const v1::Node& n) override { return fwd_.at(n.name()); }
  const v1::TensorType& OperandType(const v1::Node& n, int k) override {
    return TypeOf(n.operands(k));
  }
  bool Active(const v1::Node& n, int k) override { return active_.contains(n.operands(k)); }
  void Into(const v1::Node& n, int k, const std::string& ct) override {
    Accumulate(n.operands(k), ct);
  }
  std::string Where() const override { return StrCat("vjp of '", node_.grad().function(), "'"); }

  // ------------------------------------------------------------ manual regions

  // The mesh axes, in mesh order, that `ct` varies over and F's value `v`
  // does not.
  std::vector<std::string> Excess(const std::string& v, const std::string& ct) {
    std::vector<std::string> out;
    const Varying want = region_->Of(fwd_.at(v)), have = region_->Of(ct);
    for (const std::string& a : mesh_.axis_names()) {
      if (have.Over(a) && !want.Over(a)) out.push_back(a);
    }
    return out;
  }

  // A collective over `axes` on `x`, typed for this mesh.
  std::string Collective(v1::Op op, const std::string& x, const std::vector<std::string>& axes,
                         const std::string& reason, int64_t dimension = 0, int64_t concat = 0,
                         const std::vector<int64_t>& pairs = {}) {
    if (!e_.status().ok()) return "";
    v1::Node n = e_.Op(op, {x});
    v1::CollectiveAttrs& c = *n.mutable_collective();
    for (const std::string& a : axes) c.add_axes(a);
    if (op == v1::ALL_REDUCE || op == v1::REDUCE_SCATTER) c.set_kind(v1::SUM);
    c.set_dimension(dimension);
    c.set_concat_dimension(concat);
    for (int64_t p : pairs) c.add_source_target_pairs(p);
    c.set_reason(reason);
    auto t = InferCollectiveType(n, {&e_.type(x)}, mesh_);
    if (!t.ok()) {
      e_.Fail(Annotate(t.status(), StrCat("internal: reverse-mode ", OpName(op), ": ")));
      return "";
    }
    *n.mutable_type() = *t;
    return e_.Copy(std::move(n), StrCat(x, ".", OpName(op)));
  }

  // The cotangent of F's value `v`: in a region's body, what its uses
  // contribute summed over the devices of each axis those contributions
  // vary over and `v` does not (the transpose of the implicit broadcast of
  // a replicated value; pbroadcast's transpose is psum).
  std::string Settle(const std::string& v, const std::string& ct) {
    if (region_ == nullptr || ct.empty()) return ct;
    const std::vector<std::string> extra = Excess(v, ct);
    if (extra.empty()) return ct;
    const std::string why = region_->Of(ct).Reason(extra[0]);
    return Collective(
        v1::ALL_REDUCE, ct, extra,
        StrCat("reverse mode: '", v, "' is the same on every device over ",
               absl::StrJoin(extra, ", "), " and the cotangents its uses contribute vary over it (",
               why, "): their sum"));
  }

  absl::Status TransposeCollective(const v1::Node& n, const std::string& ct) {
    const std::string where =
        StrCat("vjp of '", node_.grad().function(), "': ", OpName(n.op()), " '", n.name(), "'");
    if (region_ == nullptr) {
      return absl::UnimplementedError(
          StrCat(where, ": reverse mode transposes the collectives of a manual region's ",
                 "body; inside a loop or a conditional there it does not yet"));
    }
    const v1::CollectiveAttrs& c = n.collective();
    const std::vector<std::string> axes(c.axes().begin(), c.axes().end());
    const std::string x = n.operands(0);
    const std::string reason =
        StrCat("reverse mode: transpose of ", OpName(n.op()), " '", n.name(), "'");
    // Over the axes of the group its operand does not vary over, a psum
    // (or psum_scatter) added copies of one value: the cotangent counts them.
    int64_t copies = 1;
    for (const std::string& a : axes) {
      if (!region_->Of(fwd_.at(x)).Over(a)) copies *= region_->Size(a);
    }
    auto counted = [&](const std::string& v) {
      return copies == 1 ? v : e_.Binary(v1::MUL, v, e_.Like(v, double(copies)));
    };
    switch (n.op()) {
      case v1::ALL_REDUCE:
        if (c.kind() != v1::SUM && c.kind() != v1::REDUCE_INVALID) {
          return absl::InvalidArgumentError(StrCat(
              where,
              ": only psum is linear; pmax, pmin and pprod have no transpose in reverse mode"));
        }
        Accumulate(
            x,
            counted(
                ct));  // pbroadcast: free, the cotangent is the same on every device of the group
        return absl::OkStatus();
      case v1::REDUCE_SCATTER:
        Accumulate(x, counted(Collective(v1::ALL_GATHER, ct, axes, reason, c.dimension())));
        return absl::OkStatus();
      case v1::ALL_TO_ALL:
        Accumulate(
            x, Collective(v1::ALL_TO_ALL, ct, axes, reason, c.concat_dimension(), c.dimension()));
        return absl::OkStatus();
      case v1::COLLECTIVE_PERMUTE: {
        std::vector<int64_t> inverse;
        for (int i = 0; i + 1 < c.source_target_pairs_size(); i += 2) {
          inverse.push_back(c.source_target_pairs(i + 1));
          inverse.push_back(c.source_target_pairs(i));
        }
        Accumulate(x, Collective(v1::COLLECTIVE_PERMUTE, ct, axes, reason, 0, 0, inverse));
        return absl::OkStatus();
      }
      case v1::ALL_GATHER: {
        // Where the cotangent must be summed over every axis of the group,
        // the sum and this device's block are one reduce_scatter.
        std::vector<std::string> extra = Excess(n.name(), ct);
        const bool whole = std::all_of(axes.begin(), axes.end(), [&](const std::string& a) {
          return std::find(extra.begin(), extra.end(), a) != extra.end();
        });
        if (!whole) {
          Accumulate(
              x, Collective(v1::SHARD_SLICE, Settle(n.name(), ct), axes, reason, c.dimension()));
          return absl::OkStatus();
        }
        std::string v = Collective(v1::REDUCE_SCATTER, ct, axes, reason, c.dimension());
        std::erase_if(extra, [&](const std::string& a) {
          return std::find(axes.begin(), axes.end(), a) != axes.end();
        });
        if (!extra.empty())
          v = Collective(v1::ALL_REDUCE, v, extra, StrCat(reason, ": the rest of its sum"));
        Accumulate(x, v);
        return absl::OkStatus();
      }
      default: return absl::InternalError(StrCat(where, ": not a collective"));
    }
  }

  // A manual region's backward pass is a manual region over the same mesh:
  // each device runs its body's VJP on its blocks (the body's forward
  // values recomputed there) and the cotangent's block of the region's
  // result, and gives the cotangent's block of each floating-point operand
  // under the operand's in_spec.
  absl::Status TransposeRegion(const v1::Node& n, const std::vector<std::string>& result_cts) {
    const std::string label = StrCat("manual region '", n.name(), "'");
    const std::string where = StrCat("vjp of '", node_.grad().function(), "': ", label);
    const v1::ManualRegionAttrs& m = n.manual_region();
    const bool multi = m.out_specs_size() > 0;
    TESSEL_ASSIGN_OR_RETURN(const TypedGraph body, RegionBody(n, mesh_, *functions_, where));
    const int np = int(body.parameters.size()), nr = body.graph.outputs_size();
    RegionContext ctx(mesh_, *functions_, label);
    // The backward body: (blocks of the operands, a block of each result's cotangent).
    v1::Graph bb;
    bb.set_name(StrCat(n.name(), ".backward"));
    absl::flat_hash_set<std::string> used;
    Emitter eb(bb, used);
    eb.on_emit = [&ctx](const v1::Node& x) { ctx.Track(x); };
    eb.set_base("ct");
    std::vector<std::string> args;
    std::vector<Varying> param_vary;
    for (int i = 0; i < np; ++i) {
      const v1::TensorType& t = body.graph.nodes(body.parameters[i]).type();
      param_vary.push_back(SpecVarying(m.in_specs(i), StrCat("operand ", i, " '", n.operands(i),
                                                             "' of the region is split over it")));
      args.push_back(eb.Copy(ParameterNode("x", i, t), StrCat("x", i)));
      ctx.vary[args.back()] = param_vary.back();
    }
    TESSEL_ASSIGN_OR_RETURN(auto forward_vary, ctx.analysis.OfGraph(body.graph, param_vary, label));
    std::vector<v1::Sharding> ct_specs;
    std::vector<std::string> entries, outer_cts;
    for (int k = 0; k < nr; ++k) {
      const v1::Sharding& out_spec = multi ? m.out_specs(k) : m.out_spec();
      v1::Sharding ct_spec = out_spec;
      ct_spec.clear_partial();  // the cotangent of a partial sum is the same for every part
      ct_specs.push_back(ct_spec);
      const v1::TensorType& global = multi ? n.results(k) : n.type();
      const std::string& ct = k < int(result_cts.size()) ? result_cts[k] : std::string();
      outer_cts.push_back(ct.empty() ? e_.Zeros(global) : ct);
      const v1::TensorType& out_t = body.graph.nodes(body.outputs[k]).type();
      std::string entry = eb.Copy(ParameterNode("ct", np + k, out_t), StrCat("ct", k));
      ctx.vary[entry] = SpecVarying(ct_spec, "the region's result is split over it");
      // Where the result may vary (a kernel with no replication rule) over
      // an axis its out_spec replicates it over, the devices of that axis
      // each take an equal share of the cotangent, and their contributions
      // are summed where the operands are replicated (shard_map with
      // check_rep=False does the same).
      const Varying result_vary = forward_vary[body.graph.outputs(k)];
      absl::flat_hash_set<std::string> covered(out_spec.partial().begin(),
                                               out_spec.partial().end());
      for (const auto& d : out_spec.dims()) covered.insert(d.axes().begin(), d.axes().end());
      int64_t shares = 1;
      Varying uncertain;
      for (const std::string& a : mesh_.axis_names()) {
        if (covered.contains(a) || !result_vary.maybe.contains(a)) continue;
        shares *= ctx.Size(a);
        uncertain.maybe[a] = result_vary.maybe.at(a);
      }
      if (shares > 1) {
        entry = eb.Binary(v1::MUL, entry, eb.Like(entry, 1.0 / double(shares)));
        ctx.vary[entry].Merge(uncertain);
      }
      entries.push_back(entry);
    }
    // The body's VJP with respect to its floating-point parameters.
    v1::Node grad;
    grad.set_name(n.name());
    grad.set_op(v1::VJP);
    grad.mutable_grad()->set_function(
        StrCat(node_.grad().function(), "' in manual region '", n.name()));
    std::vector<int> wrt;
    for (int i = 0; i < np; ++i) {
      // Only operands that depend on what is differentiated take a cotangent.
      if (IsFloat(body.graph.nodes(body.parameters[i]).type().dtype()) &&
          active_.contains(n.operands(i))) {
        grad.mutable_grad()->add_wrt(i);
        wrt.push_back(i);
      }
    }
    v1::Graph backward;
    Emitter ebb(backward, used);
    ebb.on_emit = eb.on_emit;
    for (int i = 0; i < np; ++i) ebb.Declare(args[i], eb.type(args[i]));
    for (const std::string& entry : entries) ebb.Declare(entry, eb.type(entry));
    Vjp inner(ebb, grad, body, args, entries, functions_, mesh_, &ctx);
    auto results = inner.Run();
    TESSEL_RETURN_IF_ERROR(eb.status());
    if (!results.ok()) return results.status();
    for (v1::Node& x : inner.forward()) *bb.add_nodes() = std::move(x);
    for (v1::Node& x : *backward.mutable_nodes()) *bb.add_nodes() = std::move(x);
    for (size_t j = 0; j < wrt.size(); ++j) bb.add_outputs((*results)[nr + j]);
    if (wrt.empty()) return absl::OkStatus();
    // The region that runs it.
    v1::Node back;
    back.set_op(v1::MANUAL_REGION);
    v1::ManualRegionAttrs& bm = *back.mutable_manual_region();
    for (int i = 0; i < np; ++i) {
      back.add_operands(Forward(n.operands(i)));
      *bm.add_in_specs() = m.in_specs(i);
    }
    for (int k = 0; k < nr; ++k) {
      back.add_operands(outer_cts[k]);
      *bm.add_in_specs() = ct_specs[k];
    }
    for (int i : wrt) {
      *bm.add_out_specs() = m.in_specs(i);
      *back.add_results() = TypeOf(n.operands(i));
    }
    *bm.mutable_body() = std::move(bb);
    const std::string b = e_.Multi(std::move(back), StrCat(fwd_.at(n.name()), ".backward"));
    for (size_t j = 0; j < wrt.size(); ++j) {
      Accumulate(n.operands(wrt[j]), e_.Element(b, int(j), TypeOf(n.operands(wrt[j]))));
    }
    return absl::OkStatus();
  }

  bool Active(const v1::Node& n) const {
    if (active_.contains(n.name())) return true;
    for (const std::string& o : n.operands()) {
      if (active_.contains(o)) return true;
    }
    return false;
  }

  const v1::Graph& Function(const std::string& name) const {
    for (const v1::Graph& g : *functions_) {
      if (g.name() == name) return g;
    }
    return f_.graph;  // not reached: validated
  }
  std::string AddFunction(v1::Graph g) {
    g.set_name(e_.Fresh(g.name()));
    const std::string name = g.name();
    *functions_->Add() = std::move(g);
    return name;
  }

  // The forward scan also stacks the carry each iteration starts from (the
  // residuals its backward pass recomputes each iteration from): its body
  // returns its carry parameters as extra ys.
  absl::Status KeepResiduals(v1::Node& scan) {
    const v1::ControlFlowAttrs& c = scan.control();
    v1::Graph body = Function(c.body());
    const int nc = c.num_carry();
    std::vector<std::string> params(nc);
    for (const v1::Node& p : body.nodes()) {
      if (p.op() == v1::PARAMETER && p.parameter().index() < nc)
        params[p.parameter().index()] = p.name();
    }
    for (const std::string& p : params) body.add_outputs(p);
    body.set_name(StrCat(c.body(), ".residuals"));
    scan.mutable_control()->set_body(AddFunction(std::move(body)));
    for (int k = 0; k < nc; ++k) *scan.add_results() = Stacked(scan.results(k), c.length());
    return absl::OkStatus();
  }

  // The backward pass of a scan is a scan the other way over the residuals:
  // each iteration is the VJP of the body at the carry that iteration
  // started from (recomputed, not stored), carrying the carries' cotangents
  // and stacking the scanned operands'.
  absl::Status TransposeScan(const v1::Node& n, const std::vector<std::string>& result_cts) {
    const v1::ControlFlowAttrs& c = n.control();
    const int nc = c.num_carry(), nx = n.operands_size() - nc, ny = n.results_size() - nc;
    const int64_t length = c.length();
    const std::string fwd = fwd_.at(n.name());
    auto slice_type = [&](const v1::TensorType& t) {
      v1::TensorType s = t;
      s.mutable_dims()->erase(s.mutable_dims()->begin());
      return s;
    };
    // Operands of the backward scan: carry cotangents, then residuals, xs, ys' cotangents.
    std::vector<std::string> ops;
    std::vector<v1::TensorType> carry_t(nc), x_t(nx), y_t(ny);
    for (int k = 0; k < nc; ++k) carry_t[k] = n.results(k);
    for (int j = 0; j < nx; ++j) x_t[j] = slice_type(TypeOf(n.operands(nc + j)));
    for (int m = 0; m < ny; ++m) y_t[m] = slice_type(n.results(nc + m));
    auto ct_or_zero = [&](int k) {
      const std::string& ct = k < int(result_cts.size()) ? result_cts[k] : std::string();
      return ct.empty() ? e_.Zeros(n.results(k)) : ct;
    };
    for (int k = 0; k < nc; ++k) ops.push_back(ct_or_zero(k));
    for (int k = 0; k < nc; ++k)
      ops.push_back(e_.Element(fwd, nc + ny + k, Stacked(carry_t[k], length)));
    for (int j = 0; j < nx; ++j) ops.push_back(fwd_.at(n.operands(nc + j)));
    for (int m = 0; m < ny; ++m) ops.push_back(ct_or_zero(nc + m));
    // Its body: (ct_c, c, x, ct_y) -> (ct_c', ct_x) through the body's VJP.
    v1::Graph bb;
    bb.set_name(StrCat(c.body(), ".backward"));
    std::vector<std::string> ct_c, cs, xs, cty;
    int index = 0;
    for (int k = 0; k < nc; ++k)
      ct_c.push_back(AddNode(bb, ParameterNode(StrCat("ct_c", k), index++, carry_t[k])));
    for (int k = 0; k < nc; ++k)
      cs.push_back(AddNode(bb, ParameterNode(StrCat("c", k), index++, carry_t[k])));
    for (int j = 0; j < nx; ++j)
      xs.push_back(AddNode(bb, ParameterNode(StrCat("x", j), index++, x_t[j])));
    for (int m = 0; m < ny; ++m)
      cty.push_back(AddNode(bb, ParameterNode(StrCat("ct_y", m), index++, y_t[m])));
    v1::Node v;
    v.set_name("vjp");
    v.set_op(v1::VJP);
    v.mutable_grad()->set_function(c.body());
    for (const auto* group : {&cs, &xs, &ct_c, &cty}) {
      for (const std::string& o : *group) v.add_operands(o);
    }
    std::vector<int> position(nc + nx, -1);  // body parameter -> its result in v
    int r = nc + ny;
    for (int k = 0; k < nc + nx; ++k) {
      const v1::TensorType& t = k < nc ? carry_t[k] : x_t[k - nc];
      if (!IsFloat(t.dtype())) continue;
      v.mutable_grad()->add_wrt(k);
      position[k] = r++;
    }
    std::vector<v1::TensorType> results;
    for (int k = 0; k < nc; ++k) results.push_back(carry_t[k]);
    for (int m = 0; m < ny; ++m) results.push_back(y_t[m]);
    for (int k = 0; k < nc + nx; ++k) {
      if (position[k] >= 0) results.push_back(k < nc ? carry_t[k] : x_t[k - nc]);
    }
    for (const v1::TensorType& t : results) *v.add_results() = t;
    // In a region's body: the carries (and their cotangents, as JAX types
    // a cotangent like its primal) vary as the loop's fixpoint says, each
    // scanned slice as its stack, each ys cotangent as its ys.
    std::vector<std::string> inlined;
    if (region_ != nullptr) {
      std::vector<Varying> vary;
      for (int k = 0; k < nc; ++k) vary.push_back(ResultVarying(n, k));
      for (int j = 0; j < nx; ++j) vary.push_back(region_->Of(fwd_.at(n.operands(nc + j))));
      for (int k = 0; k < nc; ++k) vary.push_back(ResultVarying(n, k));
      for (int m = 0; m < ny; ++m) vary.push_back(ResultVarying(n, nc + m));
      TESSEL_ASSIGN_OR_RETURN(inlined, InlineVjp(bb, v, vary));
    } else {
      *bb.add_nodes() = v;
    }
    for (int k = 0; k < nc + nx; ++k) {
      const v1::TensorType& t = k < nc ? carry_t[k] : x_t[k - nc];
      if (position[k] >= 0 && !inlined.empty()) {
        bb.add_outputs(inlined[position[k]]);
      } else if (position[k] >= 0) {
        bb.add_outputs(AddNode(bb, TupleElementNode(StrCat("d", k), "vjp", position[k], t)));
      } else if (k < nc) {
        bb.add_outputs(ct_c[k]);  // not differentiable: its zero cotangent passes through
      } else {
        v1::Node z;
        z.set_name(StrCat("d", k));
        z.set_op(v1::CONSTANT);
        *z.mutable_type() = t;
        z.mutable_constant()->mutable_fill()->set_i(0);
        bb.add_outputs(AddNode(bb, z));
      }
    }
    v1::Node back;
    back.set_op(v1::SCAN);
    for (const std::string& o : ops) back.add_operands(o);
    back.mutable_control()->set_body(AddFunction(std::move(bb)));
    back.mutable_control()->set_length(length);
    back.mutable_control()->set_num_carry(nc);
    back.mutable_control()->set_reverse(!c.reverse());
    for (int k = 0; k < nc; ++k) *back.add_results() = carry_t[k];
    for (int j = 0; j < nx; ++j) *back.add_results() = TypeOf(n.operands(nc + j));
    const std::string b = e_.Multi(std::move(back), StrCat(fwd, ".backward"));
    for (int k = 0; k < nc + nx; ++k) {
      const v1::TensorType& t = k < nc ? carry_t[k] : TypeOf(n.operands(k));
      if (IsFloat(t.dtype())) Accumulate(n.operands(k), e_.Element(b, k, t));
    }
    return absl::OkStatus();
  }

  // `n` (a CUSTOM_VJP with operands already renamed) as a call of `fn`: a
  // one-branch conditional on a constant index, whose index node is queued
  // ahead of it.
  absl::StatusOr<v1::Node> CallNode(const std::string& base, const v1::Node& n,
                                    const std::string& fn, const std::string& prefix) {
    v1::Node index;
    index.set_op(v1::CONSTANT);
    index.set_name(e_.Fresh(StrCat(prefix, base, ".index")));
    index.mutable_type()->set_dtype(v1::S32);
    index.mutable_constant()->mutable_fill()->set_i(0);
    e_.Declare(index.name(), index.type());
    v1::Node call;
    call.set_op(v1::CONDITIONAL);
    call.add_operands(index.name());
    for (const std::string& o : n.operands()) call.add_operands(o);
    call.mutable_control()->add_branches(fn);
    TESSEL_ASSIGN_OR_RETURN(std::vector<v1::TensorType> results, ResultsOf(fn));
    for (const v1::TensorType& t : results) *call.add_results() = t;
    pending_.push_back(std::move(index));
    return call;
  }

  absl::StatusOr<std::vector<v1::TensorType>> ResultsOf(const std::string& fn) {
    v1::Graph g = Function(fn);
    *g.mutable_functions() = *functions_;
    TESSEL_ASSIGN_OR_RETURN(TypedGraph t, ValidateGraph(g));
    std::vector<v1::TensorType> out;
    for (int o : t.outputs) out.push_back(t.graph.nodes(o).type());
    return out;
  }

  // A custom_vjp's backward pass: the user's `bwd` on the residuals the
  // forward call kept and the results' cotangents.
  absl::Status TransposeCustom(const v1::Node& n, const std::vector<std::string>& result_cts) {
    const v1::CustomVjpAttrs& c = n.custom_vjp();
    const std::string fwd = fwd_.at(n.name());
    TESSEL_ASSIGN_OR_RETURN(std::vector<v1::TensorType> fwd_results, ResultsOf(c.fwd()));
    const int m = n.results_size();
    v1::Node call = BranchCall(e_, c.bwd());
    for (size_t r = m; r < fwd_results.size(); ++r)
      call.add_operands(e_.Element(fwd, int(r), fwd_results[r]));
    for (int k = 0; k < m; ++k) {
      const std::string& ct = k < int(result_cts.size()) ? result_cts[k] : std::string();
      call.add_operands(ct.empty() ? e_.Zeros(n.results(k)) : ct);
    }
    for (int i = 0; i < n.operands_size(); ++i) *call.add_results() = TypeOf(n.operands(i));
    const std::string b = e_.Multi(std::move(call), StrCat(fwd, ".backward"));
    for (int i = 0; i < n.operands_size(); ++i) {
      if (IsFloat(TypeOf(n.operands(i)).dtype()))
        Accumulate(n.operands(i), e_.Element(b, i, TypeOf(n.operands(i))));
    }
    return absl::OkStatus();
  }

  // A custom_jvp's backward pass: the transpose of its rule's tangent part
  // (linear in the tangents) at the operands, built by a VJP of that part
  // with respect to the tangents, expanded here.
  absl::Status TransposeCustomJvp(const v1::Node& n, const std::vector<std::string>& result_cts) {
    const v1::CustomJvpAttrs& c = n.custom_jvp();
    const int np = n.operands_size(), m = n.results_size();
    v1::Graph part = Function(c.jvp());
    google::protobuf::RepeatedPtrField<std::string> tangent_outputs(part.outputs().begin() + m,
                                                                    part.outputs().end());
    *part.mutable_outputs() = std::move(tangent_outputs);
    *part.mutable_functions() = *functions_;
    auto typed = ValidateGraph(part, {.manual_mesh = region_ != nullptr ? &mesh_ : nullptr});
    if (!typed.ok()) return Annotate(typed.status(), StrCat("custom_jvp rule '", c.jvp(), "': "));
    v1::Node grad;
    grad.set_name(StrCat(fwd_.at(n.name()), ".transpose"));
    grad.set_op(v1::VJP);
    grad.mutable_grad()->set_function(c.jvp());
    std::vector<std::string> args, cts;
    for (int i = 0; i < np; ++i) args.push_back(Forward(n.operands(i)));
    for (int i = 0; i < np; ++i) {
      const v1::TensorType& t = TypeOf(n.operands(i));
      args.push_back(e_.Zeros(t));
      if (IsFloat(t.dtype()) && active_.contains(n.operands(i)))
        grad.mutable_grad()->add_wrt(np + i);
    }
    for (int k = 0; k < m; ++k) {
      const std::string& ct = k < int(result_cts.size()) ? result_cts[k] : std::string();
      cts.push_back(ct.empty() ? e_.Zeros(n.results(k)) : ct);
    }
    TESSEL_RETURN_IF_ERROR(e_.status());
    v1::Graph backward;
    Emitter inner_e(backward, e_.used());
    inner_e.on_emit = e_.on_emit;
    for (const std::string& v : args) inner_e.Declare(v, e_.type(v));
    for (const std::string& v : cts) inner_e.Declare(v, e_.type(v));
    Vjp inner(inner_e, grad, *typed, args, cts, functions_, mesh_, region_);
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> results, inner.Run());
    for (v1::Node& x : inner.forward()) e_.Adopt(std::move(x));
    for (v1::Node& x : *backward.mutable_nodes()) e_.Adopt(std::move(x));
    for (int j = 0; j < grad.grad().wrt_size(); ++j)
      Accumulate(n.operands(grad.grad().wrt(j) - np), results[m + j]);
    return absl::OkStatus();
  }

  // What result `k` of F's node `n` (a scan or a conditional) varies over
  // in the region: its forward copy's, as the region's analysis tracked it.
  Varying ResultVarying(const v1::Node& n, int k) const {
    const std::string& fwd = fwd_.at(n.name());
    return region_->Of(IsMultiResult(n) ? StrCat(fwd, "#", k) : fwd);
  }

  // In a region's body, the VJP `v` of a loop body or a branch, over
  // `bb`'s parameters (its operands), is expanded into `bb` at once, with
  // `vary` (one per operand: the varying axes of the value the parameter
  // stands for), so that its collectives transpose as the region's own do.
  // (Outside a region it waits for the next round as a VJP node, where no
  // variance is needed.) The names of v's results in `bb`.
  absl::StatusOr<std::vector<std::string>> InlineVjp(v1::Graph& bb, const v1::Node& v,
                                                     const std::vector<Varying>& vary) {
    v1::Graph fn = Function(v.grad().function());
    *fn.mutable_functions() = *functions_;
    auto typed = ValidateGraph(fn, {.manual_mesh = &mesh_});
    if (!typed.ok())
      return Annotate(typed.status(), StrCat(Where(), ": body '", v.grad().function(), "': "));
    const int np = int(typed->parameters.size());
    RegionContext ctx(mesh_, *functions_, region_->label);
    absl::flat_hash_set<std::string> used;
    absl::flat_hash_map<std::string, v1::TensorType> types;
    for (const v1::Node& x : bb.nodes()) {
      used.insert(x.name());
      types[x.name()] = x.type();
    }
    for (const v1::Graph& g : *functions_) used.insert(g.name());
    v1::Graph backward;
    Emitter e(backward, used);
    e.on_emit = [&ctx](const v1::Node& x) { ctx.Track(x); };
    std::vector<std::string> args, cts;
    for (int i = 0; i < v.operands_size(); ++i) {
      const std::string& o = v.operands(i);
      e.Declare(o, types.at(o));
      ctx.vary[o] = vary[i];
      (i < np ? args : cts).push_back(o);
    }
    Vjp inner(e, v, *typed, args, cts, functions_, mesh_, &ctx);
    auto results = inner.Run();
    TESSEL_RETURN_IF_ERROR(e.status());
    if (!results.ok()) return results.status();
    for (v1::Node& x : inner.forward()) *bb.add_nodes() = std::move(x);
    for (v1::Node& x : *backward.mutable_nodes()) *bb.add_nodes() = std::move(x);
    return *results;
  }

  // A conditional's backward pass is a conditional on the same index over
  // the VJPs of its branches.
  absl::Status TransposeConditional(const v1::Node& n, const std::vector<std::string>& result_cts) {
    const v1::ControlFlowAttrs& c = n.control();
    const int no = n.operands_size() - 1, nr = n.results_size();
    v1::Node back;
    back.set_op(v1::CONDITIONAL);
    back.add_operands(fwd_.at(n.operands(0)));
    for (int i = 0; i < no; ++i) back.add_operands(fwd_.at(n.operands(1 + i)));
    for (int k = 0; k < nr; ++k) {
      const std::string& ct = k < int(result_cts.size()) ? result_cts[k] : std::string();
      back.add_operands(ct.empty() ? e_.Zeros(n.results(k)) : ct);
    }
    for (const std::string& branch : c.branches()) {
      v1::Graph bb;
      bb.set_name(StrCat(branch, ".backward"));
      v1::Node v;
      v.set_name("vjp");
      v.set_op(v1::VJP);
      v.mutable_grad()->set_function(branch);
      for (int i = 0; i < no + nr; ++i) {
        const v1::TensorType& t = i < no ? TypeOf(n.operands(1 + i)) : n.results(i - no);
        v.add_operands(AddNode(bb, ParameterNode(StrCat("p", i), i, t)));
      }
      std::vector<int> position(no, -1);
      for (const v1::TensorType& t : n.results()) *v.add_results() = t;
      int r = nr;
      for (int i = 0; i < no; ++i) {
        if (!IsFloat(TypeOf(n.operands(1 + i)).dtype())) continue;
        v.mutable_grad()->add_wrt(i);
        *v.add_results() = TypeOf(n.operands(1 + i));
        position[i] = r++;
      }
      std::vector<std::string> inlined;
      if (region_ != nullptr) {
        std::vector<Varying> vary;
        for (int i = 0; i < no; ++i) vary.push_back(region_->Of(fwd_.at(n.operands(1 + i))));
        for (int k = 0; k < nr; ++k) vary.push_back(ResultVarying(n, k));
        TESSEL_ASSIGN_OR_RETURN(inlined, InlineVjp(bb, v, vary));
      } else {
        *bb.add_nodes() = v;
      }
      for (int i = 0; i < no; ++i) {
        if (position[i] >= 0 && !inlined.empty()) {
          bb.add_outputs(inlined[position[i]]);
          continue;
        }
        v1::Node o;
        o.set_name(StrCat("d", i));
        *o.mutable_type() = TypeOf(n.operands(1 + i));
        if (position[i] >= 0) {
          o.set_op(v1::TUPLE_ELEMENT);
          o.add_operands("vjp");
          o.mutable_tuple_element()->set_index(position[i]);
        } else {
          o.set_op(v1::CONSTANT);
          o.mutable_constant()->mutable_fill()->set_i(0);
        }
        bb.add_outputs(AddNode(bb, o));
      }
      back.mutable_control()->add_branches(AddFunction(std::move(bb)));
    }
    for (int i = 0; i < no; ++i) *back.add_results() = TypeOf(n.operands(1 + i));
    const std::string b = e_.Multi(std::move(back), StrCat(fwd_.at(n.name()), ".backward"));
    for (int i = 0; i < no; ++i) {
      if (IsFloat(TypeOf(n.operands(1 + i)).dtype()))
        Accumulate(n.operands(1 + i), e_.Element(b, i, TypeOf(n.operands(1 + i))));
    }
    return absl::OkStatus();
  }

  Emitter& e_;
  const v1::Node& node_;
  const TypedGraph& f_;
  std::vector<std::string> args_, cts_;
  absl::flat_hash_map<std::string, std::string> fwd_;  // F's value -> its name in the output
  // F's value -> its cotangent's parts: (the axes they vary over beyond
  // the value's, joined; the name of their sum).
  absl::flat_hash_map<std::string, std::vector<std::pair<std::string, std::string>>> ct_;
  absl::flat_hash_set<std::string> active_;  // F's values that depend on a parameter in wrt
  absl::flat_hash_map<std::string, std::string>
      regenerated_;  // F's generated constants, made again
  absl::flat_hash_map<std::string, std::vector<std::string>>
      result_ct_;  // a scan's or conditional's results' cotangents
  google::protobuf::RepeatedPtrField<v1::Graph>* functions_;
  const v1::Mesh& mesh_;
  RegionContext* region_;
  std::vector<v1::Node> pending_;
};

}  // namespace

absl::StatusOr<VjpExpansion> ExpandVjp(Emitter& e, const v1::Node& node, const TypedGraph& f,
                                       std::vector<std::string> args,
                                       std::vector<std::string> cotangents,
                                       google::protobuf::RepeatedPtrField<v1::Graph>* functions,
                                       const v1::Mesh& mesh, RegionContext* region) {
  Vjp vjp(e, node, f, std::move(args), std::move(cotangents), functions, mesh, region);
  VjpExpansion out;
  TESSEL_ASSIGN_OR_RETURN(out.results, vjp.Run());
  out.forward = std::move(vjp.forward());
  return out;
}

}  // namespace tessel::scheduler

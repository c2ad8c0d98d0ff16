#include "scheduler/batching.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler {
namespace {

using absl::StrCat;

// from, from + 1, ..., to - 1.
std::vector<int64_t> Range(int64_t from, int64_t to) {
  std::vector<int64_t> r;
  for (int64_t i = from; i < to; ++i) r.push_back(i);
  return r;
}

// out_axes value (internal) for a result left as it is: batched first, or not.
constexpr int64_t kAsIs = -2;

class Batcher : public ops::Batching {
 public:
  Batcher(Emitter& e, const v1::Node& node, const TypedGraph& f,
          google::protobuf::RepeatedPtrField<v1::Graph>* functions)
      : e_(e), node_(node), f_(f), size_(node.batch().size()), functions_(functions) {}

  // With `out_batched`, each result with out_axes kAsIs says there whether it carries the batch.
  absl::StatusOr<std::vector<std::string>> Run(const std::vector<std::string>& args,
                                               std::vector<bool>* out_batched = nullptr) {
    const v1::BatchAttrs& b = node_.batch();
    const std::string prefix = StrCat(node_.name(), "/");
    for (const v1::Node& n : f_.graph.nodes()) {
      e_.set_base(prefix + n.name());
      if (n.op() == v1::PARAMETER) {
        const int i = n.parameter().index();
        if (b.in_axes(i) < 0) {
          val_[n.name()] = args[i];
        } else {
          val_[n.name()] = MoveAxis(args[i], b.in_axes(i), 0);
          batched_.insert(n.name());
        }
        continue;
      }
      bool any = false;
      for (const std::string& o : n.operands()) any |= batched_.contains(o);
      if (any && n.op() == v1::TUPLE_ELEMENT) {  // a result of a batched multi-result node
        const Multi& m = multi_.at(n.operands(0));
        const int k = n.tuple_element().index();
        std::string v = m.node.empty() ? m.values[k] : e_.Element(m.node, k, m.types[k]);
        if (m.axis[k] >= 0) {
          val_[n.name()] = MoveAxis(v, m.axis[k], 0);
          batched_.insert(n.name());
        } else {
          val_[n.name()] = v;
        }
        continue;
      }
      if (any && IsMultiResult(n)) {
        TESSEL_RETURN_IF_ERROR(MultiRule(n));
        TESSEL_RETURN_IF_ERROR(e_.status());
        batched_.insert(n.name());
        continue;
      }
      if (!any) {  // independent of the batch: computed once
        v1::Node c = n;
        c.clear_operands();
        for (const std::string& o : n.operands()) c.add_operands(val_.at(o));
        val_[n.name()] = e_.Copy(std::move(c), prefix + n.name());
        continue;
      }
      TESSEL_ASSIGN_OR_RETURN(std::string v, Rule(n));
      TESSEL_RETURN_IF_ERROR(e_.status());
      val_[n.name()] = std::move(v);
      batched_.insert(n.name());
    }
    std::vector<std::string> results;
    e_.set_base(prefix + "result");
    for (int k = 0; k < f_.graph.outputs_size(); ++k) {
      const std::string& o = f_.graph.outputs(k);
      const int64_t axis = b.out_axes(k);
      if (axis == kAsIs) {
        results.push_back(val_.at(o));
        if (out_batched != nullptr) out_batched->push_back(batched_.contains(o));
      } else if (axis < 0) {
        if (batched_.contains(o)) {
          return absl::InvalidArgumentError(
              StrCat("vmap of '", b.function(), "': result ", k, " ('", o,
                     "') depends on the batch, but its out_axes is -1 (None): ",
                     "expected a result the same for every index, as in jax.vmap"));
        }
        results.push_back(val_.at(o));
      } else {
        results.push_back(MoveAxis(Batched(o), 0, axis));
      }
    }
    TESSEL_RETURN_IF_ERROR(e_.status());
    return results;
  }

 private:
  // A batched multi-result node as emitted: its results' types and where
  // each carries the batch (-1: not batched). `values`, when set, are the
  // results themselves (batch first) and there is no node.
  struct Multi {
    std::string node;
    std::vector<v1::TensorType> types;
    std::vector<int64_t> axis;
    std::vector<std::string> values;
  };

  const v1::TensorType& TypeOf(const std::string& v) const override {
    return f_.graph.nodes(f_.index_of.at(v)).type();
  }

  std::vector<int64_t> BatchDims(std::vector<int64_t> dims) const {
    dims.insert(dims.begin(), size_);
    return dims;
  }

  // `v` (emitted, of rank r) with its dimension `from` moved to `to`.
  std::string MoveAxis(const std::string& v, int64_t from, int64_t to) override {
    if (!e_.status().ok()) return "";
    const int64_t rank = e_.type(v).dims_size();
    std::vector<int64_t> perm;
    for (int64_t d = 0; d < rank; ++d) {
      if (d != from) perm.push_back(d);
    }
    perm.insert(perm.begin() + to, from);
    return e_.Transpose(v, perm);
  }

  // Value `o` of f with the batch first: broadcast along it when `o` does
  // not depend on the batch.
  std::string Batched(const std::string& o) override {
    if (batched_.contains(o)) return val_.at(o);
    const std::vector<int64_t> dims = Dims(TypeOf(o));
    return e_.Broadcast(val_.at(o), BatchDims(dims), Range(1, int64_t(dims.size()) + 1));
  }

  // Value `o` as [batch] + `dims`: an elementwise operand, which may be a
  // scalar where the op admits one (select's predicate, clamp's bounds).
  std::string BatchedTo(const std::string& o, const std::vector<int64_t>& dims) override {
    const std::vector<int64_t> own = Dims(TypeOf(o));
    if (own == dims) return Batched(o);
    // a scalar: its batch (if any) is its only dimension
    return e_.Broadcast(val_.at(o), BatchDims(dims),
                        batched_.contains(o) ? std::vector<int64_t>{0} : std::vector<int64_t>{});
  }

  // `n` over the given batched operands, its result's type inferred.
  std::string Emit(const v1::Node& n, std::vector<std::string> operands,
                   const std::function<void(v1::Node&)>& attrs = {}) override {
    v1::Node c = n;
    c.clear_operands();
    for (std::string& o : operands) c.add_operands(std::move(o));
    if (attrs) attrs(c);
    return e_.Emit(std::move(c), StrCat(node_.name(), "/", n.name()));
  }

  // ops::Batching, for the rules.
  Emitter& e() override { return e_; }
  int64_t size() const override { return size_; }
  bool IsBatched(const std::string& v) const override { return batched_.contains(v); }
  std::string Value(const std::string& v) override { return val_.at(v); }

  absl::Status NoRule(const v1::Node& n, const std::string& why = "") override {
    return absl::UnimplementedError(StrCat("vmap of '", node_.batch().function(), "': node '",
                                           n.name(), "' (", OpName(n.op()), ") ",
                                           why.empty() ? "has no batching rule yet" : why));
  }

  // The batched result of `n`, from its row in scheduler/ops.
  absl::StatusOr<std::string> Rule(const v1::Node& n) {
    if (const ops::OpRules* r = ops::Find(n.op()); r != nullptr && r->batch != nullptr)
      return r->batch(*this, n);
    return NoRule(n);
  }

  // ---- control flow: each function the node runs, batched into a new one.

  absl::StatusOr<TypedGraph> Function(const std::string& name) {
    for (const v1::Graph& g : *functions_) {
      if (g.name() != name) continue;
      v1::Graph with_functions = g;
      *with_functions.mutable_functions() = *functions_;
      return ValidateGraph(with_functions);
    }
    return absl::InvalidArgumentError(StrCat("vmap: function '", name, "' is not defined"));
  }

  // Function `name` over parameters batched (first) where `in` says; each
  // result batched (first) where `force` says, else as it comes: `out`
  // tells which results carry the batch. With `keep`, the batched function
  // joins the graph's functions and its name is returned.
  absl::StatusOr<std::string> BatchFunction(const std::string& name, const std::vector<bool>& in,
                                            const std::vector<bool>& force, std::vector<bool>* out,
                                            bool keep) {
    TESSEL_ASSIGN_OR_RETURN(TypedGraph f, Function(name));
    v1::Graph g;
    std::string fresh = StrCat(name, "/vmap");
    for (int k = 1;; ++k) {
      bool taken = false;
      for (const v1::Graph& h : *functions_) taken |= h.name() == fresh;
      if (!taken) break;
      fresh = StrCat(name, "/vmap.", k);
    }
    g.set_name(fresh);
    absl::flat_hash_set<std::string> used;
    Emitter e(g, used);
    v1::Node vm;
    vm.set_name(StrCat(node_.name(), "/", fresh));
    vm.mutable_batch()->set_function(name);
    vm.mutable_batch()->set_size(size_);
    std::vector<std::string> params;
    for (size_t i = 0; i < in.size(); ++i) {
      v1::Node p;
      p.set_op(v1::PARAMETER);
      p.mutable_parameter()->set_index(int(i));
      const v1::TensorType& t = f.graph.nodes(f.parameters[i]).type();
      *p.mutable_type() = in[i] ? WithBatch(t, 0, size_) : t;
      params.push_back(e.Copy(std::move(p), StrCat("arg", i)));
      vm.mutable_batch()->add_in_axes(in[i] ? 0 : -1);
    }
    for (bool b : force) vm.mutable_batch()->add_out_axes(b ? 0 : kAsIs);
    Batcher inner(e, vm, f, functions_);
    std::vector<bool> as_is;
    TESSEL_ASSIGN_OR_RETURN(std::vector<std::string> results, inner.Run(params, &as_is));
    TESSEL_RETURN_IF_ERROR(e.status());
    out->clear();
    for (size_t k = 0, j = 0; k < force.size(); ++k)
      out->push_back(force[k] ? true : bool(as_is[j++]));
    if (!keep) return fresh;
    for (const std::string& r : results) g.add_outputs(r);
    *functions_->Add() = std::move(g);
    return fresh;
  }

  // Carries batched where the loop's operands are, and wherever an
  // iteration makes them so (a fixed point over `body`'s results).
  absl::Status CarryFixedPoint(const std::string& body, std::vector<bool>& carry,
                               const std::vector<bool>& rest, std::vector<bool>* out) {
    for (size_t round = 0; round <= carry.size(); ++round) {
      std::vector<bool> in = carry, force(out->size(), false);
      in.insert(in.end(), rest.begin(), rest.end());
      for (size_t i = 0; i < carry.size(); ++i) force[i] = carry[i];
      TESSEL_RETURN_IF_ERROR(BatchFunction(body, in, force, out, false).status());
      bool grew = false;
      for (size_t i = 0; i < carry.size(); ++i) {
        if ((*out)[i] && !carry[i]) carry[i] = grew = true;
      }
      if (!grew) return absl::OkStatus();
    }
    return absl::InternalError("vmap: the carries' batching does not settle");
  }

  // The node's operands, batched (first) where `batched` says.
  std::vector<std::string> Operands(const v1::Node& n, int from, const std::vector<bool>& batched) {
    std::vector<std::string> ops;
    for (int i = from; i < n.operands_size(); ++i) {
      ops.push_back(batched[i - from] ? Batched(n.operands(i)) : val_.at(n.operands(i)));
    }
    return ops;
  }

  // A result type of `n` with the batch at `axis` (-1: none).
  v1::TensorType ResultType(const v1::Node& n, int k, int64_t axis) const {
    return axis < 0 ? n.results(k) : WithBatch(n.results(k), axis, size_);
  }

  absl::Status MultiRule(const v1::Node& n) {
    const std::string base = StrCat(node_.name(), "/", n.name());
    Multi m;
    v1::Node c = n;
    c.clear_operands();
    c.clear_results();
    if (n.op() == v1::SCAN || n.op() == v1::WHILE) {
      const bool scan = n.op() == v1::SCAN;
      const int nc = scan ? n.control().num_carry() : n.operands_size();
      std::vector<bool> carry, xs;
      for (int i = 0; i < n.operands_size(); ++i)
        (i < nc ? carry : xs).push_back(batched_.contains(n.operands(i)));
      std::vector<bool> out(n.results_size());
      TESSEL_RETURN_IF_ERROR(CarryFixedPoint(n.control().body(), carry, xs, &out));
      std::vector<bool> in = carry, force(out.size(), false);
      in.insert(in.end(), xs.begin(), xs.end());
      for (int i = 0; i < nc; ++i) force[i] = carry[i];
      TESSEL_ASSIGN_OR_RETURN(std::string body,
                              BatchFunction(n.control().body(), in, force, &out, true));
      c.mutable_control()->set_body(body);
      if (!scan) {
        std::vector<bool> pred;
        TESSEL_ASSIGN_OR_RETURN(std::string cond,
                                BatchFunction(n.control().cond(), carry, {false}, &pred, true));
        if (pred[0]) {
          return NoRule(
              n,
              "has a condition that depends on the batch, which is not supported yet (each element "
              "would need its own trip count)");
        }
        c.mutable_control()->set_cond(cond);
      }
      for (int i = 0; i < n.operands_size(); ++i) {
        std::string v = in[i] ? Batched(n.operands(i)) : val_.at(n.operands(i));
        if (i >= nc && in[i])
          v = MoveAxis(v, 0, 1);  // xs are sliced along 0: the batch goes second
        c.add_operands(v);
      }
      for (int k = 0; k < n.results_size(); ++k) {
        // carries keep the batch first; stacked ys carry it second
        m.axis.push_back(!out[k] ? -1 : (k < nc ? 0 : 1));
        m.types.push_back(ResultType(n, k, m.axis.back()));
        *c.add_results() = m.types.back();
      }
    } else if (n.op() == v1::CONDITIONAL) {
      std::vector<bool> in;
      for (int i = 1; i < n.operands_size(); ++i) in.push_back(batched_.contains(n.operands(i)));
      const bool index_batched = batched_.contains(n.operands(0));
      // Results batched where any branch (or the index) makes them so.
      std::vector<bool> force(n.results_size(), index_batched), out;
      for (const std::string& b : n.control().branches()) {
        TESSEL_RETURN_IF_ERROR(BatchFunction(b, in, force, &out, false).status());
        for (size_t k = 0; k < out.size(); ++k) force[k] = force[k] || out[k];
      }
      std::vector<std::string> branches;
      for (const std::string& b : n.control().branches()) {
        TESSEL_ASSIGN_OR_RETURN(std::string name, BatchFunction(b, in, force, &out, true));
        branches.push_back(name);
      }
      for (int k = 0; k < n.results_size(); ++k) {
        m.axis.push_back(force[k] ? 0 : -1);
        m.types.push_back(ResultType(n, k, m.axis.back()));
      }
      if (index_batched) return SelectBranches(n, branches, in, m);
      c.add_operands(val_.at(n.operands(0)));
      for (const std::string& o : Operands(n, 1, in)) c.add_operands(o);
      c.mutable_control()->clear_branches();
      for (const std::string& b : branches) c.mutable_control()->add_branches(b);
      for (const v1::TensorType& t : m.types) *c.add_results() = t;
    } else {
      return NoRule(n);
    }
    m.node = e_.Multi(std::move(c), base);
    multi_[n.name()] = std::move(m);
    return absl::OkStatus();
  }

  // A conditional whose index depends on the batch: every branch runs on
  // the whole batch and each element takes its own branch's results (an
  // index out of range takes the last, as the conditional does).
  absl::Status SelectBranches(const v1::Node& n, const std::vector<std::string>& branches,
                              const std::vector<bool>& in, Multi& m) {
    const std::string base = StrCat(node_.name(), "/", n.name());
    std::vector<std::vector<std::string>> per_branch;
    for (const std::string& b : branches) {
      v1::Node call;  // a one-branch conditional: a call
      call.set_op(v1::CONDITIONAL);
      call.add_operands(e_.FillInt(ScalarOf(v1::S32), 0));
      for (const std::string& o : Operands(n, 1, in)) call.add_operands(o);
      call.mutable_control()->add_branches(b);
      for (const v1::TensorType& t : m.types) *call.add_results() = t;
      const std::string node = e_.Multi(std::move(call), base + ".branch");
      std::vector<std::string> rs;
      for (size_t k = 0; k < m.types.size(); ++k)
        rs.push_back(e_.Element(node, int(k), m.types[k]));
      per_branch.push_back(std::move(rs));
    }
    const std::string index =
        e_.Convert(val_.at(n.operands(0)), v1::S32);  // [B]; pred: false 0, true 1
    std::vector<std::string> results;
    for (size_t k = 0; k < m.types.size(); ++k) {
      std::string r = per_branch.back()[k];
      const std::vector<int64_t> dims = Dims(m.types[k]);
      for (int j = int(branches.size()) - 2; j >= 0; --j) {
        const std::string is_j = e_.Compare(v1::EQ, index, e_.FillInt(e_.type(index), j));
        r = e_.Select(e_.Broadcast(is_j, dims, {0}), per_branch[j][k], r);
      }
      results.push_back(r);
    }
    // The results stand for the node's: a tuple of values already batched.
    m.node.clear();
    m.values = std::move(results);
    multi_[n.name()] = std::move(m);
    return absl::OkStatus();
  }

  static v1::TensorType ScalarOf(v1::DType d) {
    v1::TensorType t;
    t.set_dtype(d);
    return t;
  }

  Emitter& e_;
  const v1::Node& node_;
  const TypedGraph& f_;
  const int64_t size_;
  google::protobuf::RepeatedPtrField<v1::Graph>* functions_;
  absl::flat_hash_map<std::string, Multi> multi_;      // f's batched multi-result nodes
  absl::flat_hash_map<std::string, std::string> val_;  // f's value -> emitted value
  absl::flat_hash_set<std::string> batched_;           // f's values that carry the batch (first)
};

}  // namespace

absl::StatusOr<std::vector<std::string>> EmitBatched(
    Emitter& e, const v1::Node& node, const TypedGraph& f, const std::vector<std::string>& args,
    google::protobuf::RepeatedPtrField<v1::Graph>* functions) {
  return Batcher(e, node, f, functions).Run(args);
}

}  // namespace tessel::scheduler

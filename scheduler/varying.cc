#include "scheduler/varying.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/validator.h"

namespace tessel::scheduler {

using absl::InvalidArgumentError;
using absl::StrCat;

std::string Varying::Reason(const std::string& axis) const {
  if (auto it = why.find(axis); it != why.end()) return it->second;
  if (auto it = maybe.find(axis); it != maybe.end()) return it->second;
  return "";
}

bool Varying::Merge(const Varying& o) {
  bool changed = false;
  for (const auto& [a, r] : o.why) {
    changed |= why.emplace(a, r).second;
    maybe.erase(a);
  }
  for (const auto& [a, r] : o.maybe) {
    if (!why.contains(a)) changed |= maybe.emplace(a, r).second;
  }
  return changed;
}

Varying SpecVarying(const v1::Sharding& spec, const std::string& what) {
  Varying v;
  for (const auto& d : spec.dims()) {
    for (const std::string& a : d.axes()) v.why[a] = what;
  }
  return v;
}

VaryingAnalysis::VaryingAnalysis(const v1::Mesh& mesh,
                                 const google::protobuf::RepeatedPtrField<v1::Graph>& functions)
    : mesh_(mesh), functions_(functions) {}

absl::StatusOr<std::vector<Varying>> VaryingAnalysis::Of(const v1::Node& n,
                                                         const std::vector<Varying>& ops,
                                                         const std::string& label) {
  if (IsControlFlow(n.op())) return OfControlFlow(n, ops, label);
  if (n.op() == v1::CUSTOM_VJP || n.op() == v1::CUSTOM_JVP) {
    std::vector<Varying> args(ops.begin(), ops.end());
    return OfFunction(
        n.op() == v1::CUSTOM_VJP ? n.custom_vjp().function() : n.custom_jvp().function(), args,
        label);
  }
  Varying vr;
  for (const Varying& o : ops) vr.Merge(o);
  const auto& axes = n.collective().axes();
  switch (n.op()) {
    case v1::ALL_REDUCE:
    case v1::ALL_GATHER:  // the same value on every device of the group
      for (const std::string& a : axes) vr.Erase(a);
      break;
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::COLLECTIVE_PERMUTE:
    case v1::AXIS_INDEX:
    case v1::SHARD_SLICE:
      for (const std::string& a : axes) {
        vr.maybe.erase(a);
        vr.why.emplace(a, StrCat(OpName(n.op()), " '", n.name(), "' over it"));
      }
      break;
    case v1::CUSTOM_KERNEL: {
      const v1::CustomKernelAttrs& k = n.custom_kernel();
      const v1::ReplicationRule& rule = k.replication();
      switch (rule.kind()) {
        case v1::ReplicationRule::FOLLOW:
          if (rule.operand() < 0 || rule.operand() >= int(ops.size())) {
            return InvalidArgumentError(StrCat(label, ": custom kernel '", k.name(),
                                               "' replication rule follows operand ",
                                               rule.operand(), "; it has ", ops.size()));
          }
          vr = ops[rule.operand()];
          break;
        case v1::ReplicationRule::EXPLICIT:
          vr = Varying{};
          for (const std::string& a : rule.axes()) {
            if (AxisIndex(mesh_, a) < 0) {
              return InvalidArgumentError(StrCat(label, ": custom kernel '", k.name(),
                                                 "' replication rule names ", "unknown mesh axis '",
                                                 a, "'"));
            }
            vr.why[a] =
                StrCat("custom kernel '", k.name(), "' declares its result varying over it");
          }
          break;
        case v1::ReplicationRule::UNKNOWN:
          for (const std::string& a : mesh_.axis_names()) {
            if (!vr.why.contains(a)) {
              vr.maybe.emplace(a, StrCat("custom kernel '", k.name(),
                                         "' has no replication rule, so its result may ",
                                         "vary over every mesh axis"));
            }
          }
          break;
        default: break;  // UNION: the operands'
      }
      break;
    }
    default: break;
  }
  return std::vector<Varying>{std::move(vr)};
}

absl::StatusOr<absl::flat_hash_map<std::string, Varying>> VaryingAnalysis::OfGraph(
    const v1::Graph& g, const std::vector<Varying>& params, const std::string& label) {
  absl::flat_hash_map<std::string, Varying> vary;
  for (const v1::Node& n : g.nodes()) {
    if (n.op() == v1::PARAMETER) {
      vary[n.name()] = params.at(n.parameter().index());
      continue;
    }
    if (n.op() == v1::TUPLE_ELEMENT) {
      Varying v =
          vary[StrCat(n.operands(0), "#", n.tuple_element().index())];  // a copy: the map may grow
      vary[n.name()] = std::move(v);
      continue;
    }
    std::vector<Varying> ops;
    for (const std::string& o : n.operands()) ops.push_back(vary[o]);
    TESSEL_ASSIGN_OR_RETURN(std::vector<Varying> results, Of(n, ops, label));
    if (IsMultiResult(n)) {
      for (size_t k = 0; k < results.size(); ++k)
        vary[StrCat(n.name(), "#", k)] = std::move(results[k]);
    } else {
      vary[n.name()] = std::move(results.at(0));
    }
  }
  return vary;
}

absl::StatusOr<std::vector<Varying>> VaryingAnalysis::OfFunction(const std::string& fn,
                                                                 const std::vector<Varying>& params,
                                                                 const std::string& label) {
  const v1::Graph* f = nullptr;
  for (const v1::Graph& c : functions_) {
    if (c.name() == fn) f = &c;
  }
  if (f == nullptr)
    return InvalidArgumentError(StrCat(label, ": function '", fn, "' is not defined"));
  TESSEL_ASSIGN_OR_RETURN(auto vary, OfGraph(*f, params, label));
  std::vector<Varying> out;
  for (const std::string& o : f->outputs()) out.push_back(vary[o]);
  return out;
}

bool VaryingAnalysis::CallsCollectives(const std::string& fn) {
  for (const v1::Graph& c : functions_) {
    if (c.name() != fn) continue;
    for (const v1::Node& n : c.nodes()) {
      if (IsCollective(n.op()) && n.op() != v1::AXIS_INDEX) return true;
      for (const std::string& inner : CalledFunctions(n)) {
        if (CallsCollectives(inner)) return true;
      }
    }
  }
  return false;
}

// A loop's carry varies over what its start or any iteration makes it vary
// over (a fixed point). A varying condition or index is an error only where
// the axis is known to vary (a kernel with no rule is trusted).
absl::StatusOr<std::vector<Varying>> VaryingAnalysis::OfControlFlow(const v1::Node& n,
                                                                    const std::vector<Varying>& ops,
                                                                    const std::string& label) {
  const v1::ControlFlowAttrs& c = n.control();
  const std::string what = StrCat(OpName(n.op()), " '", n.name(), "'");
  if (n.op() == v1::CONDITIONAL) {
    const Varying& index = ops[0];
    if (!index.why.empty()) {
      for (const std::string& b : c.branches()) {
        if (!CallsCollectives(b)) continue;
        const auto& [axis, why] = *index.why.begin();
        return InvalidArgumentError(StrCat(label, ": ", what, ": its index varies over mesh axis '",
                                           axis, "' (", why, "), and branch '", b,
                                           "' runs a collective: devices of one group could take "
                                           "different branches. Make the index uniform "
                                           "with a collective over '",
                                           axis, "' (pmax, psum) first"));
      }
    }
    std::vector<Varying> results;
    const std::vector<Varying> args(ops.begin() + 1, ops.end());
    for (const std::string& b : c.branches()) {
      TESSEL_ASSIGN_OR_RETURN(std::vector<Varying> r, OfFunction(b, args, label));
      results.resize(r.size());
      for (size_t k = 0; k < r.size(); ++k) {
        results[k].Merge(r[k]);
        for (const auto& [a, why] : index.why) {
          results[k].why.emplace(a, StrCat("the index of ", what, " varies over it"));
        }
      }
    }
    return results;
  }
  const int carries = n.op() == v1::WHILE ? n.operands_size() : c.num_carry();
  std::vector<Varying> carry(ops.begin(), ops.begin() + carries);
  std::vector<Varying> ys;
  for (bool changed = true; changed;) {
    changed = false;
    std::vector<Varying> params = carry;
    params.insert(params.end(), ops.begin() + carries, ops.end());
    TESSEL_ASSIGN_OR_RETURN(std::vector<Varying> out, OfFunction(c.body(), params, label));
    for (int k = 0; k < carries; ++k) changed |= carry[k].Merge(out[k]);
    ys.assign(out.begin() + carries, out.end());
  }
  if (n.op() == v1::WHILE) {
    TESSEL_ASSIGN_OR_RETURN(std::vector<Varying> pred, OfFunction(c.cond(), carry, label));
    if (!pred[0].why.empty()) {
      // Each device may run its own number of iterations (as JAX's
      // shard_map does) unless an iteration meets the others in a
      // collective; the carry then varies with the trip count.
      const auto& [axis, why] = *pred[0].why.begin();
      for (const std::string& f : {c.body(), c.cond()}) {
        if (!CallsCollectives(f)) continue;
        return InvalidArgumentError(
            StrCat(label, ": ", what, ": its condition '", c.cond(), "' varies over mesh axis '",
                   axis, "' (", why, "), and '", f,
                   "' runs a collective: every device of a group must stop at the same iteration. "
                   "Make the predicate uniform with a collective over '",
                   axis, "' (psum, pmax or all_gather) before comparing"));
      }
      for (Varying& v : carry) {
        for (const auto& [a, w] : pred[0].why) {
          v.why.emplace(a, StrCat("the trip count of ", what, " varies over it"));
        }
      }
    }
  }
  carry.insert(carry.end(), ys.begin(), ys.end());
  return carry;
}

}  // namespace tessel::scheduler

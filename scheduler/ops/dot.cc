// dot_general.
#include <algorithm>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

// Batch dimensions split alike on both sides; free dimensions keep their
// splits unless their axes are taken; a split contracting dimension makes
// the result a partial sum over its axes.
void LayoutDot(const LayoutQuery& q, Layout& layout) {
  const v1::DotGeneralAttrs& dg = q.node.dot_general();
  const bool l_gen = q.generated[0], r_gen = q.generated[1];
  v1::Sharding l = q.current[0], r = q.current[1];
  v1::Sharding &wl = layout.want[0], &wr = layout.want[1], &result = layout.result;
  // A partial operand is completed first: a dot of each device's partial
  // sum is the dot of the sum only where the other operand is finite (0
  // times an infinity is NaN on a device whose part is 0). A dot may still
  // produce a partial sum, over a split contracting dimension.
  if (IsPartial(l)) l = Complete(l);
  if (IsPartial(r)) r = Complete(r);
  wl = Replicated(l.dims_size());
  wr = Replicated(r.dims_size());
  absl::flat_hash_set<std::string> used;
  Axes partial;
  auto free_of = [&](const Axes& a) {
    for (const std::string& x : a) {
      if (used.contains(x)) return false;
    }
    return true;
  };
  auto take = [&](const Axes& a) { used.insert(a.begin(), a.end()); };
  auto pick = [&](const Axes& first, const Axes& second) -> Axes {
    if (!first.empty() && free_of(first)) return first;
    if (!second.empty() && free_of(second)) return second;
    return {};
  };
  std::vector<Axes> batch;
  for (int k = 0; k < dg.lhs_batch_size(); ++k) {
    Axes a = pick(l_gen ? Axes{} : DimAxes(l, dg.lhs_batch(k)),
                  r_gen ? Axes{} : DimAxes(r, dg.rhs_batch(k)));
    take(a);
    SetDimAxes(wl, dg.lhs_batch(k), a);
    SetDimAxes(wr, dg.rhs_batch(k), a);
    batch.push_back(a);
  }
  absl::flat_hash_set<int64_t> lspecial(dg.lhs_batch().begin(), dg.lhs_batch().end());
  lspecial.insert(dg.lhs_contracting().begin(), dg.lhs_contracting().end());
  absl::flat_hash_set<int64_t> rspecial(dg.rhs_batch().begin(), dg.rhs_batch().end());
  rspecial.insert(dg.rhs_contracting().begin(), dg.rhs_contracting().end());
  auto keep_free = [&](const v1::Sharding& s, bool gen, const absl::flat_hash_set<int64_t>& special,
                       v1::Sharding& w) {
    std::vector<Axes> free;
    for (int d = 0; d < s.dims_size(); ++d) {
      if (special.contains(d)) continue;
      Axes a = gen ? Axes{} : DimAxes(s, d);
      if (!free_of(a)) a.clear();
      take(a);
      SetDimAxes(w, d, a);
      free.push_back(a);
    }
    return free;
  };
  const std::vector<Axes> lfree = keep_free(l, l_gen, lspecial, wl);
  for (int k = 0; k < dg.lhs_contracting_size(); ++k) {
    Axes a = pick(l_gen ? Axes{} : DimAxes(l, dg.lhs_contracting(k)),
                  r_gen ? Axes{} : DimAxes(r, dg.rhs_contracting(k)));
    take(a);
    SetDimAxes(wl, dg.lhs_contracting(k), a);
    SetDimAxes(wr, dg.rhs_contracting(k), a);
    partial.insert(partial.end(), a.begin(), a.end());
  }
  const std::vector<Axes> rfree = keep_free(r, r_gen, rspecial, wr);
  int j = 0;
  for (const Axes& a : batch) SetDimAxes(result, j++, a);
  for (const Axes& a : lfree) SetDimAxes(result, j++, a);
  for (const Axes& a : rfree) SetDimAxes(result, j++, a);
  for (const std::string& a : partial) result.add_partial(a);
  result.set_partial_kind(v1::SUM);
}

// The free dimensions of a dot operand (neither batch nor contracting), in order.
std::vector<int64_t> FreeDims(int rank, const google::protobuf::RepeatedField<int64_t>& batch,
                              const google::protobuf::RepeatedField<int64_t>& contracting) {
  std::vector<int64_t> free;
  for (int d = 0; d < rank; ++d) {
    if (std::find(batch.begin(), batch.end(), d) == batch.end() &&
        std::find(contracting.begin(), contracting.end(), d) == contracting.end()) {
      free.push_back(d);
    }
  }
  return free;
}

// out[B, Fl, Fr] = lhs[B, Fl, C] . rhs[B, C, Fr] (dimensions in any order).
absl::Status VjpDot(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const v1::DotGeneralAttrs& d = n.dot_general();
  const v1::TensorType& lt = m.OperandType(n, 0);
  const v1::TensorType& rt = m.OperandType(n, 1);
  const std::vector<int64_t> lfree = FreeDims(lt.dims_size(), d.lhs_batch(), d.lhs_contracting());
  const std::vector<int64_t> rfree = FreeDims(rt.dims_size(), d.rhs_batch(), d.rhs_contracting());
  const int64_t nb = d.lhs_batch_size();
  std::vector<int64_t> ct_batch(nb), ct_lfree(lfree.size()), ct_rfree(rfree.size());
  std::iota(ct_batch.begin(), ct_batch.end(), 0);
  std::iota(ct_lfree.begin(), ct_lfree.end(), nb);
  std::iota(ct_rfree.begin(), ct_rfree.end(), nb + int64_t(lfree.size()));
  const std::string lhs = m.Operand(n, 0), rhs = m.Operand(n, 1);
  // Each operand's cotangent is a dot of the other operand with ct over the
  // other's free dimensions, with the operands in the order that gives the
  // usual layouts without a transpose: d lhs[M,K] = ct[M,N] . rhs[K,N]^T,
  // d rhs[K,N] = lhs[M,K]^T . ct[M,N].
  auto grad_of = [&](bool of_lhs) {
    const std::string& other = of_lhs ? rhs : lhs;
    const auto& other_batch = of_lhs ? d.rhs_batch() : d.lhs_batch();
    const auto& other_contracting = of_lhs ? d.rhs_contracting() : d.lhs_contracting();
    const std::vector<int64_t>& other_free = of_lhs ? rfree : lfree;
    const std::vector<int64_t>& ct_other_free = of_lhs ? ct_rfree : ct_lfree;
    const auto& my_batch = of_lhs ? d.lhs_batch() : d.rhs_batch();
    const auto& my_contracting = of_lhs ? d.lhs_contracting() : d.rhs_contracting();
    const std::vector<int64_t>& my_free = of_lhs ? lfree : rfree;
    const v1::TensorType& mine = of_lhs ? lt : rt;
    const std::vector<int64_t> ob(other_batch.begin(), other_batch.end());
    // g: [batch, then (lhs side) my free dims and the other's contracting
    // dims, or (rhs side) the other's contracting dims and my free dims];
    // the other's contracting dims in increasing order of its index.
    const std::string g = of_lhs ? e.Dot(ct, other, ct_batch, ob, ct_other_free, other_free)
                                 : e.Dot(other, ct, ob, ct_batch, other_free, ct_other_free);
    std::vector<int> by_other(other_contracting.size());
    std::iota(by_other.begin(), by_other.end(), 0);
    std::sort(by_other.begin(), by_other.end(),
              [&](int x, int y) { return other_contracting[x] < other_contracting[y]; });
    const int64_t nfree = int64_t(my_free.size()), ncon = int64_t(by_other.size());
    std::vector<int64_t> perm(mine.dims_size());  // perm[my dim] = g's dim
    for (int i = 0; i < my_batch.size(); ++i) perm[my_batch[i]] = i;
    for (int64_t i = 0; i < nfree; ++i) perm[my_free[i]] = nb + (of_lhs ? i : ncon + i);
    for (int64_t k = 0; k < ncon; ++k)
      perm[my_contracting[by_other[k]]] = nb + (of_lhs ? nfree + k : k);
    return e.Convert(e.Transpose(g, perm), mine.dtype());
  };
  if (IsFloat(lt.dtype()) && m.Active(n, 0)) m.Into(n, 0, grad_of(true));
  if (IsFloat(rt.dtype()) && m.Active(n, 1)) m.Into(n, 1, grad_of(false));
  return absl::OkStatus();
}

// With the batch of either operand or both: both batched, the batch is one
// more batch dimension (the first of the result); one batched, it is a
// free dimension of that operand, moved first.
absl::StatusOr<std::string> BatchDot(Batching& b, const v1::Node& n) {
  const bool lb = b.IsBatched(n.operands(0)), rb = b.IsBatched(n.operands(1));
  const v1::DotGeneralAttrs& d = n.dot_general();
  std::string out = b.Emit(n, {b.Value(n.operands(0)), b.Value(n.operands(1))}, [&](v1::Node& c) {
    v1::DotGeneralAttrs& a = *c.mutable_dot_general();
    if (lb) {
      ShiftAll(*a.mutable_lhs_batch());
      ShiftAll(*a.mutable_lhs_contracting());
    }
    if (rb) {
      ShiftAll(*a.mutable_rhs_batch());
      ShiftAll(*a.mutable_rhs_contracting());
    }
    if (lb && rb) {
      Prepend(*a.mutable_lhs_batch(), 0);
      Prepend(*a.mutable_rhs_batch(), 0);
    }
  });
  if (lb && rb) return out;
  const int64_t nb = d.lhs_batch_size();
  const int64_t lhs_free = b.TypeOf(n.operands(0)).dims_size() - nb - d.lhs_contracting_size();
  return b.MoveAxis(out, lb ? nb : nb + lhs_free, 0);
}

}  // namespace

void DotRows(Rows& rows) {
  rows.emplace_back(
      v1::DOT_GENERAL,
      OpRules{.layout = LayoutDot, .vjp = VjpDot, .jvp = BilinearTangent, .batch = BatchDot});
}

}  // namespace tessel::scheduler::ops

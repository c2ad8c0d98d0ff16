// Reductions, arg-reductions and sort.
#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

// A reduction over a split dimension leaves a partial result over its axes;
// a partial sum passes through a sum.
void LayoutReduce(const LayoutQuery& q, Layout& l) {
  const v1::ReduceKind kind = q.node.reduce().kind();
  l.want[0] = q.current[0];
  if (IsPartial(l.want[0]) && !(kind == v1::SUM && l.want[0].partial_kind() == v1::SUM)) {
    l.want[0] = Complete(l.want[0]);
  }
  absl::flat_hash_set<int64_t> reduced(q.node.reduce().dims().begin(),
                                       q.node.reduce().dims().end());
  Axes partial = PartialAxes(l.want[0]);
  int j = 0;
  for (int d = 0; d < q.types[0]->dims_size(); ++d) {
    if (reduced.contains(d)) {
      for (const std::string& a : DimAxes(l.want[0], d)) partial.push_back(a);
    } else {
      SetDimAxes(l.result, j++, DimAxes(l.want[0], d));
    }
  }
  for (const std::string& a : partial) l.result.add_partial(a);
  l.result.set_partial_kind(partial.empty() ? v1::SUM : kind);
}

void LayoutArgReduce(const LayoutQuery& q, Layout& l) {
  l.want[0] = Complete(q.current[0]);
  const int64_t ad = q.node.arg_reduce().dimension();
  SetDimAxes(l.want[0], ad, {});
  int j = 0;
  for (int d = 0; d < q.types[0]->dims_size(); ++d) {
    if (d != ad) SetDimAxes(l.result, j++, DimAxes(l.want[0], d));
  }
}

// Each row must be whole on one device. A split of the sorted dimension
// moves (all_to_all) to a dimension that is whole and divides, where there
// is one; else it is gathered.
void LayoutSort(const LayoutQuery& q, Layout& l) {
  const int64_t sd = q.node.sort().dimension();
  const v1::TensorType& x = *q.types[0];
  v1::Sharding t = Complete(q.current[0]);
  const Axes moved = DimAxes(t, sd);
  SetDimAxes(t, sd, {});
  if (!moved.empty()) {
    const int64_t k = AxesSize(q.mesh, moved);
    for (int e = 0; e < x.dims_size(); ++e) {
      if (e != sd && DimAxes(t, e).empty() && x.dims(e) % k == 0 && x.dims(e) >= k) {
        SetDimAxes(t, e, moved);
        break;
      }
    }
  }
  for (auto& w : l.want) w = t;
  l.result = t;
}

// The reduced operand's dimensions and those the reduction keeps.
struct Reduced {
  std::vector<int64_t> in, kept, dims;
};
Reduced Of(const v1::Node& n, const v1::TensorType& x) {
  Reduced r{Dims(x), {}, {n.reduce().dims().begin(), n.reduce().dims().end()}};
  for (int d = 0; d < int(r.in.size()); ++d) {
    if (std::find(r.dims.begin(), r.dims.end(), d) == r.dims.end()) r.kept.push_back(d);
  }
  return r;
}

absl::Status VjpReduce(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const Reduced r = Of(n, m.OperandType(n, 0));
  const std::string out = m.Result(n), x = m.Operand(n, 0);
  const std::string spread = e.Broadcast(ct, r.in, r.kept);
  switch (n.reduce().kind()) {
    case v1::SUM: m.Into(n, 0, spread); break;
    case v1::PROD:  // out / x: not defined where x is 0
      m.Into(n, 0, e.Binary(v1::DIV, e.Binary(v1::MUL, spread, e.Broadcast(out, r.in, r.kept)), x));
      break;
    default: {  // max, min: the elements equal to the result share it (as JAX)
      const std::string hit = e.Convert(e.Compare(v1::EQ, x, e.Broadcast(out, r.in, r.kept)),
                                        m.OperandType(n, 0).dtype());
      const std::string count = e.Reduce(hit, v1::SUM, r.dims);
      m.Into(n, 0, e.Binary(v1::MUL, e.Broadcast(e.Binary(v1::DIV, ct, count), r.in, r.kept), hit));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpReduce(ForwardMode& m, const v1::Node& n) {
  Emitter& e = m.e();
  const Reduced r = Of(n, m.OperandType(n, 0));
  const std::string out = m.Result(n), x = m.Operand(n, 0), t = m.Tangent(n, 0);
  switch (n.reduce().kind()) {
    case v1::SUM: return m.Same(n, {t});
    case v1::PROD:
      return e.Reduce(e.Binary(v1::DIV, e.Binary(v1::MUL, t, e.Broadcast(out, r.in, r.kept)), x),
                      v1::SUM, r.dims);
    default: {
      const std::string hit = e.Convert(e.Compare(v1::EQ, x, e.Broadcast(out, r.in, r.kept)),
                                        m.OperandType(n, 0).dtype());
      return e.Binary(v1::DIV, e.Reduce(e.Binary(v1::MUL, t, hit), v1::SUM, r.dims),
                      e.Reduce(hit, v1::SUM, r.dims));
    }
  }
}

// The result is operand r moved by a permutation of each row; its
// cotangent goes back by the inverse permutation, which is itself a sort:
// of the cotangent, by where each element came from.
absl::Status VjpSort(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const int r = n.sort().result_operand();
  if (!IsFloat(m.OperandType(n, r).dtype())) return absl::OkStatus();
  const std::string from =
      e.SortBy(m.Operand(n, 0), e.Iota(m.OperandType(n, 0), n.sort().dimension()), n.sort());
  v1::SortAttrs back;
  back.set_dimension(n.sort().dimension());
  m.Into(n, r, e.SortBy(from, ct, back));
  return absl::OkStatus();
}

// The order is piecewise constant in the keys: only the moved values' tangents move.
absl::StatusOr<std::string> JvpSort(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, n.sort().result_operand());
  return t.empty() ? std::string() : m.e().SortBy(m.Operand(n, 0), t, n.sort());
}

absl::StatusOr<std::string> BatchReduce(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))},
                [&](v1::Node& c) { ShiftAll(*c.mutable_reduce()->mutable_dims()); });
}

absl::StatusOr<std::string> BatchArgReduce(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))}, [&](v1::Node& c) {
    c.mutable_arg_reduce()->set_dimension(c.arg_reduce().dimension() + 1);
  });
}

absl::StatusOr<std::string> BatchSort(Batching& b, const v1::Node& n) {
  std::vector<std::string> ops;
  for (const std::string& o : n.operands()) ops.push_back(b.Batched(o));
  return b.Emit(n, std::move(ops),
                [&](v1::Node& c) { c.mutable_sort()->set_dimension(c.sort().dimension() + 1); });
}

}  // namespace

void ReduceRows(Rows& rows) {
  rows.emplace_back(
      v1::REDUCE,
      OpRules{.layout = LayoutReduce, .vjp = VjpReduce, .jvp = JvpReduce, .batch = BatchReduce});
  for (v1::Op op : {v1::ARGMAX, v1::ARGMIN}) {
    rows.emplace_back(op, OpRules{.layout = LayoutArgReduce,
                                  .vjp = NoCotangent,
                                  .jvp = NoTangent,
                                  .batch = BatchArgReduce});
  }
  rows.emplace_back(
      v1::SORT, OpRules{.layout = LayoutSort, .vjp = VjpSort, .jvp = JvpSort, .batch = BatchSort});
}

}  // namespace tessel::scheduler::ops

// Layout ops: constants, broadcast, reshape, transpose, slice, reverse,
// pad, concatenate and sharding constraints. All are linear: a partial sum
// passes through those whose rule keeps it, and forward mode applies the
// op itself to the tangent.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

using absl::StrCat;

void LayoutConstant(const LayoutQuery& q, Layout& l) {
  l.result = Replicated(q.node.type().dims_size());
}

absl::StatusOr<std::string> LowerConstant(LocalGraph& g, const Lowering& w, v1::Node local) {
  *local.mutable_type() = w.local_type;
  return g.Emit(std::move(local));
}

void LayoutBroadcast(const LayoutQuery& q, Layout& l) {
  const v1::Node& n = q.node;
  l.want[0] = q.current[0];
  const auto& bd = n.broadcast_in_dim().broadcast_dimensions();
  for (int i = 0; i < bd.size(); ++i) {
    if (q.types[0]->dims(i) == n.type().dims(bd[i])) {
      SetDimAxes(l.result, bd[i], DimAxes(l.want[0], i));
    } else {
      SetDimAxes(l.want[0], i, {});
    }
  }
  KeepPartial(l.want[0], l.result);
}

absl::StatusOr<std::string> LowerBroadcast(LocalGraph& g, const Lowering& w, v1::Node local) {
  local.mutable_broadcast_in_dim()->clear_dims();
  for (int64_t x : w.local_type.dims()) local.mutable_broadcast_in_dim()->add_dims(x);
  return g.Emit(std::move(local));
}

void LayoutTranspose(const LayoutQuery& q, Layout& l) {
  l.want[0] = q.current[0];
  const auto& perm = q.node.transpose().permutation();
  for (int j = 0; j < perm.size(); ++j) SetDimAxes(l.result, j, DimAxes(l.want[0], perm[j]));
  KeepPartial(l.want[0], l.result);
}

// A split dimension keeps its split when it stays the major part of a
// result dimension: same extent, merged with unsplit minor dimensions, or
// split into a major piece its axes still divide.
void LayoutReshape(const LayoutQuery& q, Layout& l) {
  const v1::TensorType &in = *q.types[0], &out = q.node.type();
  const v1::Sharding& s = q.current[0];
  std::vector<int64_t> in_prefix(in.dims_size() + 1, 1), out_prefix(out.dims_size() + 1, 1);
  for (int i = 0; i < in.dims_size(); ++i) in_prefix[i + 1] = in_prefix[i] * in.dims(i);
  for (int i = 0; i < out.dims_size(); ++i) out_prefix[i + 1] = out_prefix[i] * out.dims(i);
  l.want[0] = s;
  for (int d = 0; d < in.dims_size(); ++d) {
    const Axes a = DimAxes(s, d);
    if (a.empty()) continue;
    int r = -1;
    for (int j = 0; j < out.dims_size(); ++j) {
      if (out_prefix[j] == in_prefix[d] && out.dims(j) > 1) r = j;
    }
    bool ok = r >= 0;
    if (ok && out.dims(r) > in.dims(d)) {
      // Merged with the following input dimensions: they must be unsplit.
      int64_t p = in.dims(d);
      for (int e = d + 1; e < in.dims_size() && p < out.dims(r); ++e) {
        ok &= DimAxes(s, e).empty();
        p *= in.dims(e);
      }
      ok &= p == out.dims(r);
    } else if (ok && out.dims(r) < in.dims(d)) {
      ok = in.dims(d) % out.dims(r) == 0 && out.dims(r) % AxesSize(q.mesh, a) == 0;
    }
    if (ok) {
      SetDimAxes(l.result, r, a);
    } else {
      SetDimAxes(l.want[0], d, {});
    }
  }
  KeepPartial(l.want[0], l.result);
}

absl::StatusOr<std::string> LowerReshape(LocalGraph& g, const Lowering& w, v1::Node local) {
  local.mutable_reshape()->clear_dims();
  for (int64_t x : w.local_type.dims()) local.mutable_reshape()->add_dims(x);
  return g.Emit(std::move(local));
}

void LayoutSlice(const LayoutQuery& q, Layout& l) {
  l.want[0] = q.current[0];
  const v1::SliceAttrs& sl = q.node.slice();
  for (int d = 0; d < q.node.type().dims_size(); ++d) {
    const bool full = sl.start(d) == 0 && sl.limit(d) == q.types[0]->dims(d) &&
                      (sl.strides_size() == 0 || sl.strides(d) == 1);
    if (!full) SetDimAxes(l.want[0], d, {});
  }
  l.result = l.want[0];
}

absl::StatusOr<std::string> LowerSlice(LocalGraph& g, const Lowering& w, v1::Node local) {
  for (int d = 0; d < w.local_type.dims_size(); ++d) {
    if (!w.layout.result.dims(d).axes().empty())
      local.mutable_slice()->set_limit(d, w.local_type.dims(d));
  }
  return g.Emit(std::move(local));
}

void LayoutReverse(const LayoutQuery& q, Layout& l) {  // linear: a partial sum stays partial
  l.want[0] = q.current[0];
  l.result = l.want[0];
}

// Each device reversed its own block; along a split dimension the blocks
// are then mirrored: block i belongs where block k-1-i is. Mirroring every
// axis coordinate mirrors the flat index over all of them, so one permute
// serves every reversed dimension.
absl::StatusOr<std::string> LowerReverse(LocalGraph& g, const Lowering& w, v1::Node local) {
  TESSEL_ASSIGN_OR_RETURN(std::string out, g.Emit(std::move(local)));
  Axes axes;
  std::vector<int64_t> split;
  for (int64_t d : w.node.reverse().dimensions()) {
    const Axes da = DimAxes(w.layout.result, d);
    if (!da.empty()) split.push_back(d);
    axes.insert(axes.end(), da.begin(), da.end());
  }
  const int64_t k = AxesSize(g.mesh(), axes);
  std::vector<int64_t> pairs;
  for (int64_t i = 0; i < k; ++i) pairs.insert(pairs.end(), {i, k - 1 - i});
  return g.EmitCollective(v1::COLLECTIVE_PERMUTE, out, w.name, axes, 0, 0, v1::REDUCE_INVALID,
                          StrCat("reverse '", w.name, "': dimension", split.size() > 1 ? "s " : " ",
                                 absl::StrJoin(split, ", "), " split over ", AxesText(axes),
                                 ", so each reversed block moves to the mirrored device"),
                          pairs);
}

void LayoutPad(const LayoutQuery& q, Layout& l) {
  v1::Sharding t = Complete(q.current[0]);
  const v1::PadAttrs& p = q.node.pad();
  for (int d = 0; d < q.node.type().dims_size(); ++d) {
    if (p.low(d) != 0 || p.high(d) != 0 || (p.interior_size() > 0 && p.interior(d) != 0))
      SetDimAxes(t, d, {});
  }
  l.want[0] = t;
  l.want[1] = Replicated(0);
  l.result = t;
}

void LayoutConcatenate(const LayoutQuery& q, Layout& l) {
  int first = 0;
  for (int i = 0; i < q.node.operands_size(); ++i) {
    if (!q.generated[i]) {
      first = i;
      break;
    }
  }
  v1::Sharding t = Complete(q.current[first]);
  SetDimAxes(t, q.node.concatenate().dimension(), {});
  for (auto& w : l.want) w = t;
  l.result = t;
}

// ---- reverse mode

absl::Status VjpIdentity(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  m.Into(n, 0, ct);
  return absl::OkStatus();
}

absl::Status VjpReshape(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  m.Into(n, 0, m.e().Reshape(ct, Dims(m.OperandType(n, 0))));
  return absl::OkStatus();
}

absl::Status VjpTranspose(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const auto& perm = n.transpose().permutation();
  std::vector<int64_t> inverse(perm.size());
  for (int i = 0; i < perm.size(); ++i) inverse[perm[i]] = i;
  m.Into(n, 0, m.e().Transpose(ct, inverse));
  return absl::OkStatus();
}

absl::Status VjpReverse(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  m.Into(n, 0, m.e().Reverse(ct, n.reverse().dimensions()));
  return absl::OkStatus();
}

absl::Status VjpBroadcast(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const std::vector<int64_t> in = Dims(m.OperandType(n, 0)), res = Dims(n.type());
  const auto& bd = n.broadcast_in_dim().broadcast_dimensions();
  std::vector<int64_t> sum;
  for (int d = 0; d < int(res.size()); ++d) {
    const auto it = std::find(bd.begin(), bd.end(), d);
    if (it == bd.end() || (in[it - bd.begin()] == 1 && res[d] != 1)) sum.push_back(d);
  }
  m.Into(n, 0, m.e().Reshape(m.e().Reduce(ct, v1::SUM, sum), in));
  return absl::OkStatus();
}

absl::Status VjpSlice(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const std::vector<int64_t> in = Dims(m.OperandType(n, 0)), res = Dims(n.type());
  const v1::SliceAttrs& s = n.slice();
  std::vector<int64_t> low(in.size()), high(in.size()), interior(in.size());
  for (size_t d = 0; d < in.size(); ++d) {
    const int64_t stride = d < size_t(s.strides_size()) && s.strides(d) > 0 ? s.strides(d) : 1;
    low[d] = s.start(d);
    interior[d] = res[d] > 0 ? stride - 1 : 0;
    const int64_t covered = res[d] > 0 ? s.start(d) + (res[d] - 1) * stride + 1 : s.start(d);
    high[d] = in[d] - covered;
  }
  v1::TensorType scalar;
  scalar.set_dtype(e.type(ct).dtype());
  m.Into(n, 0, e.Pad(ct, e.Fill(scalar, 0.0), low, high, interior));
  return absl::OkStatus();
}

absl::Status VjpPad(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const std::vector<int64_t> in = Dims(m.OperandType(n, 0));
  const v1::PadAttrs& p = n.pad();
  std::vector<int64_t> start(in.size()), limit(in.size()), strides(in.size());
  for (size_t d = 0; d < in.size(); ++d) {
    const int64_t interior = d < size_t(p.interior_size()) ? p.interior(d) : 0;
    if (p.low(d) < 0 || p.high(d) < 0) {
      return absl::UnimplementedError(
          StrCat(m.Where(), ": pad '", n.name(),
                 "' has negative padding, which has no transposition rule yet"));
    }
    start[d] = p.low(d);
    strides[d] = interior + 1;
    limit[d] = in[d] == 0 ? start[d] : p.low(d) + (in[d] - 1) * (interior + 1) + 1;
  }
  const std::string inner = e.Slice(ct, start, limit, strides);
  m.Into(n, 0, inner);
  m.Into(n, 1, e.Binary(v1::SUB, e.SumAll(ct), e.SumAll(inner)));
  return absl::OkStatus();
}

absl::Status VjpConcatenate(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const std::vector<int64_t> res = Dims(n.type());
  const int64_t dim = n.concatenate().dimension();
  int64_t offset = 0;
  for (int k = 0; k < n.operands_size(); ++k) {
    const std::vector<int64_t> in = Dims(m.OperandType(n, k));
    std::vector<int64_t> start(res.size(), 0), limit = res, strides(res.size(), 1);
    start[dim] = offset;
    limit[dim] = offset + in[dim];
    offset += in[dim];
    m.Into(n, k, m.e().Slice(ct, start, limit, strides));
  }
  return absl::OkStatus();
}

// ---- forward mode

absl::StatusOr<std::string> JvpPad(ForwardMode& m, const v1::Node& n) {
  const std::string tv = m.Tangent(n, 1);
  return m.Same(n, {m.TangentOrZeros(n, 0), tv.empty() ? m.e().Zeros(m.OperandType(n, 1)) : tv});
}

absl::StatusOr<std::string> JvpConcatenate(ForwardMode& m, const v1::Node& n) {
  std::vector<std::string> ts;
  for (int k = 0; k < n.operands_size(); ++k) ts.push_back(m.TangentOrZeros(n, k));
  return m.Same(n, ts);
}

// ---- batching: the batch is a new leading dimension

absl::StatusOr<std::string> BatchBroadcast(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))}, [&](v1::Node& c) {
    auto& a = *c.mutable_broadcast_in_dim();
    ShiftAll(*a.mutable_broadcast_dimensions());
    Prepend(*a.mutable_broadcast_dimensions(), 0);
    Prepend(*a.mutable_dims(), b.size());
  });
}

absl::StatusOr<std::string> BatchReshape(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))},
                [&](v1::Node& c) { Prepend(*c.mutable_reshape()->mutable_dims(), b.size()); });
}

absl::StatusOr<std::string> BatchTranspose(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))}, [&](v1::Node& c) {
    ShiftAll(*c.mutable_transpose()->mutable_permutation());
    Prepend(*c.mutable_transpose()->mutable_permutation(), 0);
  });
}

absl::StatusOr<std::string> BatchSlice(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))}, [&](v1::Node& c) {
    auto& s = *c.mutable_slice();
    Prepend(*s.mutable_start(), 0);
    Prepend(*s.mutable_limit(), b.size());
    if (s.strides_size() > 0) Prepend(*s.mutable_strides(), 1);
  });
}

absl::StatusOr<std::string> BatchReverse(Batching& b, const v1::Node& n) {
  return b.Emit(n, {b.Batched(n.operands(0))},
                [&](v1::Node& c) { ShiftAll(*c.mutable_reverse()->mutable_dimensions()); });
}

absl::StatusOr<std::string> BatchPad(Batching& b, const v1::Node& n) {
  if (b.IsBatched(n.operands(1)))
    return b.NoRule(n, "has a padding value that depends on the batch");
  return b.Emit(n, {b.Batched(n.operands(0)), b.Value(n.operands(1))}, [&](v1::Node& c) {
    auto& p = *c.mutable_pad();
    Prepend(*p.mutable_low(), 0);
    Prepend(*p.mutable_high(), 0);
    if (p.interior_size() > 0) Prepend(*p.mutable_interior(), 0);
  });
}

absl::StatusOr<std::string> BatchConcatenate(Batching& b, const v1::Node& n) {
  std::vector<std::string> ops;
  for (const std::string& o : n.operands()) ops.push_back(b.Batched(o));
  return b.Emit(n, std::move(ops), [&](v1::Node& c) {
    c.mutable_concatenate()->set_dimension(c.concatenate().dimension() + 1);
  });
}

}  // namespace

void LayoutRows(Rows& rows) {
  rows.emplace_back(
      v1::CONSTANT,
      OpRules{
          .layout = LayoutConstant, .lower = LowerConstant, .vjp = NoCotangent, .jvp = NoTangent});
  rows.emplace_back(v1::BROADCAST_IN_DIM, OpRules{.layout = LayoutBroadcast,
                                                  .lower = LowerBroadcast,
                                                  .vjp = VjpBroadcast,
                                                  .jvp = SameOfTangent,
                                                  .batch = BatchBroadcast});
  rows.emplace_back(v1::TRANSPOSE, OpRules{.layout = LayoutTranspose,
                                           .vjp = VjpTranspose,
                                           .jvp = SameOfTangent,
                                           .batch = BatchTranspose});
  rows.emplace_back(v1::RESHAPE, OpRules{.layout = LayoutReshape,
                                         .lower = LowerReshape,
                                         .vjp = VjpReshape,
                                         .jvp = SameOfTangent,
                                         .batch = BatchReshape});
  rows.emplace_back(v1::SLICE, OpRules{.layout = LayoutSlice,
                                       .lower = LowerSlice,
                                       .vjp = VjpSlice,
                                       .jvp = SameOfTangent,
                                       .batch = BatchSlice});
  rows.emplace_back(v1::REVERSE, OpRules{.layout = LayoutReverse,
                                         .lower = LowerReverse,
                                         .vjp = VjpReverse,
                                         .jvp = SameOfTangent,
                                         .batch = BatchReverse});
  rows.emplace_back(v1::PAD,
                    OpRules{.layout = LayoutPad, .vjp = VjpPad, .jvp = JvpPad, .batch = BatchPad});
  rows.emplace_back(v1::CONCATENATE, OpRules{.layout = LayoutConcatenate,
                                             .vjp = VjpConcatenate,
                                             .jvp = JvpConcatenate,
                                             .batch = BatchConcatenate});
  // Its layout is the constraint itself, which the partitioner applies.
  rows.emplace_back(v1::SHARDING_CONSTRAINT, OpRules{.vjp = VjpIdentity, .jvp = SameOfTangent});
}

}  // namespace tessel::scheduler::ops

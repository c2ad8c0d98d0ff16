// gather and scatter along one axis.
#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

using absl::StrCat;

// Batch dims (batch_dims) pair the operand's with the indices': where the
// operand's is whole and the indices' split (over axes the operand does not
// use), the operand takes that split, which a replicated operand gives
// without moving a byte.
void TakeBatchSplits(v1::Sharding& x, const v1::Sharding& indices, int64_t nb) {
  for (int d = 0; d < nb; ++d) {
    const Axes want = DimAxes(indices, d);
    if (!DimAxes(x, d).empty() || want.empty()) continue;
    bool free = true;
    for (const auto& dim : x.dims()) {
      for (const std::string& a : dim.axes())
        free &= std::find(want.begin(), want.end(), a) == want.end();
    }
    if (free) SetDimAxes(x, d, want);
  }
}

// A split indexed dimension: where the result is smaller than the gathered
// operand would be, each device reads the slices it holds and puts the
// lowest value elsewhere, so the result is a partial max over the split
// (one all_reduce of the result, not an all_gather of the operand); else
// the dimension is gathered. The operand's other splits and the indices'
// splits carry to the result, unless a mesh axis would then split two
// dimensions.
//
// Batch dimensions (batch_dims) pair the operand's with the indices': each
// keeps the operand's split, which the indices take too, so a batch split
// alike on both needs no collective.
void LayoutGather(const LayoutQuery& q, Layout& l) {
  const int64_t ax = q.node.gather().axis(), nb = q.node.gather().batch_dims();
  const v1::TensorType &xt = *q.types[0], &it = *q.types[1];
  v1::Sharding x = Complete(q.current[0]), ix = Complete(q.current[1]);
  TakeBatchSplits(x, ix, nb);
  for (int d = 0; d < nb; ++d) SetDimAxes(ix, d, DimAxes(x, d));
  const Axes split = DimAxes(x, ax);
  if (AxesSize(q.mesh, split) > 1 &&
      NumElementsUnchecked(q.node.type()) < NumElementsUnchecked(xt)) {
    l.indexed_split = split;
  } else {
    SetDimAxes(x, ax, {});
  }
  absl::flat_hash_set<std::string> used;
  for (const auto& d : x.dims()) used.insert(d.axes().begin(), d.axes().end());
  for (int d = int(nb); d < ix.dims_size(); ++d) {
    for (const std::string& a : DimAxes(ix, d)) {
      if (used.contains(a)) {
        SetDimAxes(ix, d, {});
        break;
      }
    }
  }
  l.want[0] = x;
  l.want[1] = ix;
  const int ir = it.dims_size() - int(nb);  // the indices' dims in the result
  for (int d = 0; d < xt.dims_size(); ++d) {
    if (d < ax) SetDimAxes(l.result, d, DimAxes(x, d));
    if (d > ax) SetDimAxes(l.result, d - 1 + ir, DimAxes(x, d));
  }
  for (int d = 0; d < ir; ++d) SetDimAxes(l.result, int(ax) + d, DimAxes(ix, int(nb) + d));
  for (const std::string& a : l.indexed_split) l.result.add_partial(a);
  if (!l.indexed_split.empty()) l.result.set_partial_kind(v1::REDUCE_MAX);
}

// The lowest value of a dtype, as a fill: -inf, or the least integer.
std::pair<double, int64_t> LowestValue(v1::DType dt) {
  switch (dt) {
    case v1::S8: return {0, std::numeric_limits<int8_t>::min()};
    case v1::S16: return {0, std::numeric_limits<int16_t>::min()};
    case v1::S32: return {0, std::numeric_limits<int32_t>::min()};
    case v1::S64: return {0, std::numeric_limits<int64_t>::min()};
    case v1::U8:
    case v1::U16:
    case v1::U32:
    case v1::U64:
    case v1::PRED: return {0, 0};
    default: return {-std::numeric_limits<double>::infinity(), 0};
  }
}

absl::StatusOr<std::string> LowerGather(LocalGraph& g, const Lowering& w, v1::Node local) {
  const Axes& split = w.layout.indexed_split;
  if (split.empty()) return g.Emit(std::move(local));
  const std::string& name = w.name;
  const int64_t indexed = w.node.gather().axis();
  const int64_t extent = w.types[0]->dims(indexed), block = extent / AxesSize(g.mesh(), split);
  TESSEL_ASSIGN_OR_RETURN(std::string bi, g.BlockIndices(local.operands(1), split, extent, block,
                                                         /*clamp=*/true, local.name()));
  local.set_operands(1, bi);
  TESSEL_ASSIGN_OR_RETURN(std::string out, g.Emit(std::move(local)));
  // Slices another device holds read as the lowest value: the max over the
  // split keeps the one read where it lives (-0.0 and NaN intact).
  const v1::TensorType gt = g.LocalTypeOf(out), bt = g.LocalTypeOf(bi);  // copies: Emit rehashes
  TESSEL_ASSIGN_OR_RETURN(std::string zero, g.EmitFill(bt, 0, 0, name + ".zero"));
  TESSEL_ASSIGN_OR_RETURN(std::string size, g.EmitFill(bt, 0, block, name + ".block_size"));
  auto compare = [&](v1::CompareDirection d) {
    return [d](v1::Node& c) { c.mutable_compare()->set_direction(d); };
  };
  TESSEL_ASSIGN_OR_RETURN(std::string ge,
                          g.EmitOp(v1::COMPARE, {bi, zero}, name + ".mine", compare(v1::GE)));
  TESSEL_ASSIGN_OR_RETURN(std::string lt,
                          g.EmitOp(v1::COMPARE, {bi, size}, name + ".mine", compare(v1::LT)));
  TESSEL_ASSIGN_OR_RETURN(std::string mine, g.EmitOp(v1::AND, {ge, lt}, name + ".mine"));
  TESSEL_ASSIGN_OR_RETURN(
      mine, g.EmitOp(v1::BROADCAST_IN_DIM, {mine}, name + ".mine", [&](v1::Node& b) {
        *b.mutable_broadcast_in_dim()->mutable_dims() = gt.dims();
        const int64_t nb = w.node.gather().batch_dims();
        for (int d = 0; d < bt.dims_size(); ++d) {
          b.mutable_broadcast_in_dim()->add_broadcast_dimensions(d < nb ? d : indexed + d - nb);
        }
      }));
  const auto [low_f, low_i] = LowestValue(gt.dtype());
  TESSEL_ASSIGN_OR_RETURN(std::string low, g.EmitFill(gt, low_f, low_i, name + ".lowest"));
  return g.EmitOp(v1::SELECT, {mine, out, low}, name + ".held");
}

// Every device updates its own block of the operand, keeping its splits,
// with all the indices (shifted into its block along a split updated
// dimension: updates for other blocks fall out of range and are dropped)
// and the updates' matching block. No collective but those that make the
// indices whole.
void LayoutScatter(const LayoutQuery& q, Layout& l) {
  const int64_t ax = q.node.scatter().axis(), nb = q.node.scatter().batch_dims();
  v1::Sharding x = Complete(q.current[0]);
  TakeBatchSplits(x, Complete(q.current[1]), nb);
  const int ir = q.types[1]->dims_size() - int(nb);  // the indices' dims in the updates
  l.want[0] = x;
  l.want[1] = Replicated(q.types[1]->dims_size());
  for (int d = 0; d < nb; ++d) SetDimAxes(l.want[1], d, DimAxes(x, d));  // batch: as the operand
  l.want[2] = Replicated(q.types[2]->dims_size());
  for (int d = 0; d < q.types[0]->dims_size(); ++d) {
    if (d < ax) SetDimAxes(l.want[2], d, DimAxes(x, d));
    if (d > ax) SetDimAxes(l.want[2], d - 1 + ir, DimAxes(x, d));
  }
  l.result = x;
}

absl::StatusOr<std::string> LowerScatter(LocalGraph& g, const Lowering& w, v1::Node local) {
  const int64_t indexed = w.node.scatter().axis();
  const Axes split = DimAxes(w.layout.result, indexed);
  if (!split.empty()) {
    const int64_t extent = w.types[0]->dims(indexed);
    TESSEL_ASSIGN_OR_RETURN(std::string bi, g.BlockIndices(local.operands(1), split, extent,
                                                           extent / AxesSize(g.mesh(), split),
                                                           /*clamp=*/false, local.name()));
    local.set_operands(1, bi);
  }
  return g.Emit(std::move(local));
}

// The gather clamped its indices: each slice's cotangent adds into the
// slice it was read from.
absl::Status VjpGather(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const v1::TensorType& xt = m.OperandType(n, 0);
  if (!IsFloat(xt.dtype())) return absl::OkStatus();
  const int64_t axis = n.gather().axis();
  v1::TensorType scalar;
  scalar.set_dtype(m.OperandType(n, 1).dtype());
  const std::string idx = e.Emit(e.Op(v1::CLAMP, {e.FillInt(scalar, 0), m.Operand(n, 1),
                                                  e.FillInt(scalar, xt.dims(axis) - 1)}),
                                 "clamp");
  m.Into(n, 0, e.Scatter(e.Zeros(xt), idx, ct, axis, v1::SUM, n.gather().batch_dims()));
  return absl::OkStatus();
}

absl::Status VjpScatter(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  Emitter& e = m.e();
  const v1::TensorType &xt = m.OperandType(n, 0), &it = m.OperandType(n, 1),
                       &ut = m.OperandType(n, 2);
  if (!IsFloat(xt.dtype())) return absl::OkStatus();
  const v1::ReduceKind k = n.scatter().combine();
  if (k != v1::REDUCE_INVALID && k != v1::SUM) {
    return absl::UnimplementedError(
        StrCat(m.Where(), ": scatter '", n.name(), "' combines by ", v1::ReduceKind_Name(k),
               ", which has no reverse-mode rule yet (replace and SUM have one)"));
  }
  const std::string i = m.Operand(n, 1);
  const int64_t axis = n.scatter().axis(), count = NumElementsUnchecked(it);
  const int64_t nb = n.scatter().batch_dims();
  if (nb > 0 && k == v1::REDUCE_INVALID) {
    return absl::UnimplementedError(StrCat(m.Where(), ": scatter '", n.name(),
                                           "' replaces with batch_dims ", nb,
                                           ", which has no reverse-mode rule yet (SUM has one)"));
  }
  // An update reaches the result when its index is in range and, when
  // updates replace, no later update at that index overwrote it.
  std::string kept = e.Binary(v1::AND, e.Compare(v1::GE, i, e.FillInt(it, 0)),
                              e.Compare(v1::LT, i, e.FillInt(it, xt.dims(axis))));
  if (k == v1::SUM) {
    m.Into(n, 0, ct);
  } else {
    m.Into(n, 0, e.Scatter(ct, i, e.Zeros(ut), axis, v1::REDUCE_INVALID));
    v1::TensorType flat, slots;
    flat.set_dtype(v1::S64);
    flat.add_dims(count);
    slots.set_dtype(v1::S64);
    slots.add_dims(xt.dims(axis));
    const std::string fi = e.Reshape(i, {count}), own = e.Iota(flat, 0);
    const std::string last = e.Scatter(e.FillInt(slots, -1), fi, own, 0, v1::REDUCE_INVALID);
    const std::string won = e.Compare(v1::EQ, e.Gather(last, fi, 0), own);
    kept = e.Binary(v1::AND, kept, e.Reshape(won, Dims(it)));
  }
  std::vector<int64_t> at(it.dims_size());
  for (int d = 0; d < it.dims_size(); ++d) at[d] = d < nb ? d : axis + d - nb;
  m.Into(n, 2, e.Select(e.Broadcast(kept, Dims(ut), at), e.Gather(ct, i, axis, nb), e.Zeros(ut)));
  return absl::OkStatus();
}

absl::StatusOr<std::string> JvpGather(ForwardMode& m, const v1::Node& n) {
  const std::string t = m.Tangent(n, 0);
  return t.empty() ? std::string() : m.Same(n, {t, m.Operand(n, 1)});
}

absl::StatusOr<std::string> JvpScatter(ForwardMode& m, const v1::Node& n) {
  if (m.Tangent(n, 0).empty() && m.Tangent(n, 2).empty()) return std::string();
  const v1::ReduceKind k = n.scatter().combine();
  if (k != v1::REDUCE_INVALID && k != v1::SUM) {
    return absl::UnimplementedError(
        StrCat(m.Where(), ": scatter '", n.name(), "' combines by ", v1::ReduceKind_Name(k),
               ", which has no forward-mode rule yet (replace and SUM have one)"));
  }
  return m.Same(n, {m.TangentOrZeros(n, 0), m.Operand(n, 1), m.TangentOrZeros(n, 2)});
}

// ---- batching

// Indices (batched, [B] + idx) into `extent` slices of each batch element
// as s64 positions in the batch flattened ([B * extent]): out-of-range
// indices clamp within their element (`clamp`) or become -1 (dropped).
std::string FlatIndices(Emitter& e, const std::string& i, int64_t extent, bool clamp) {
  if (!e.status().ok()) return "";
  v1::TensorType s64 = e.type(i), scalar;
  s64.set_dtype(v1::S64);
  scalar.set_dtype(v1::S64);
  std::string idx = i;
  if (e.type(i).dtype() == v1::U64) {  // past int64 is out of range: keep it past the end
    v1::TensorType u64;
    u64.set_dtype(v1::U64);
    idx =
        e.Emit(e.Op(v1::CLAMP, {e.FillInt(u64, 0), idx, e.FillInt(u64, INT64_MAX)}), "vmap.index");
  }
  idx = e.Convert(idx, v1::S64);
  const std::string lo = e.FillInt(scalar, 0),
                    hi = e.FillInt(scalar, std::max<int64_t>(extent - 1, 0));
  std::string inside;
  if (clamp) {
    idx = e.Emit(e.Op(v1::CLAMP, {lo, idx, hi}), "vmap.index");
  } else {
    inside = e.Binary(v1::AND, e.Compare(v1::GE, idx, e.FillInt(s64, 0)),
                      e.Compare(v1::LE, idx, e.FillInt(s64, extent - 1)));
  }
  const std::string offset = e.Binary(v1::MUL, e.Iota(s64, 0), e.FillInt(s64, extent));
  idx = e.Binary(v1::ADD, idx, offset);
  return clamp ? idx : e.Select(inside, idx, e.FillInt(s64, -1));
}

// A batched operand [B] + x with `axis` (of x) as [B * extent] + the rest of x.
std::string FlatOperand(Batching& b, const std::string& x, int64_t axis,
                        std::vector<int64_t>* rest) {
  Emitter& e = b.e();
  if (!e.status().ok()) return "";
  const std::vector<int64_t> dims = Dims(e.type(x));  // [B] + x
  const int64_t extent = dims[axis + 1];
  std::string moved = b.MoveAxis(x, axis + 1, 1);
  rest->clear();
  for (size_t d = 1; d < dims.size(); ++d) {
    if (int64_t(d) != axis + 1) rest->push_back(dims[d]);
  }
  std::vector<int64_t> flat = {b.size() * extent};
  flat.insert(flat.end(), rest->begin(), rest->end());
  return e.Reshape(moved, flat);
}

absl::StatusOr<std::string> BatchGather(Batching& b, const v1::Node& n) {
  const int64_t axis = n.gather().axis(), nb = n.gather().batch_dims();
  const bool xb = b.IsBatched(n.operands(0)), ib = b.IsBatched(n.operands(1));
  const std::string x = b.Value(n.operands(0)), i = b.Value(n.operands(1));
  if (nb > 0) {  // the batch is one more batch dimension of both
    return b.Emit(n, {b.Batched(n.operands(0)), b.Batched(n.operands(1))}, [&](v1::Node& c) {
      c.mutable_gather()->set_axis(axis + 1);
      c.mutable_gather()->set_batch_dims(nb + 1);
    });
  }
  if (!ib) {  // the batch is one more leading dimension of the operand
    return b.Emit(n, {x, i}, [&](v1::Node& c) { c.mutable_gather()->set_axis(axis + 1); });
  }
  if (!xb)
    return b.MoveAxis(b.Emit(n, {x, i}), axis,
                      0);  // the batch is one more dimension of the indices
  // Both: each element gathers from its own operand, through the batch flattened.
  const int64_t extent = b.TypeOf(n.operands(0)).dims(int(axis));
  const int64_t k = b.TypeOf(n.operands(1)).dims_size();
  std::vector<int64_t> rest;
  const std::string flat = FlatOperand(b, x, axis, &rest);
  const std::string idx = FlatIndices(b.e(), i, extent, /*clamp=*/true);
  // [B, idx..., x[:axis]..., x[axis+1:]...] -> [B, x[:axis]..., idx..., x[axis+1:]...]
  const std::string g =
      b.Emit(n, {flat, idx}, [&](v1::Node& c) { c.mutable_gather()->set_axis(0); });
  std::vector<int64_t> perm = {0};
  for (int64_t d = 0; d < axis; ++d) perm.push_back(1 + k + d);
  for (int64_t d = 0; d < k; ++d) perm.push_back(1 + d);
  for (int64_t d = 1 + k + axis; d < 1 + k + int64_t(rest.size()); ++d) perm.push_back(d);
  return b.e().Transpose(g, perm);
}

absl::StatusOr<std::string> BatchScatter(Batching& b, const v1::Node& n) {
  const int64_t axis = n.scatter().axis(), nb = n.scatter().batch_dims();
  if (nb > 0) {  // the batch is one more batch dimension of all three
    return b.Emit(n, {b.Batched(n.operands(0)), b.Batched(n.operands(1)), b.Batched(n.operands(2))},
                  [&](v1::Node& c) {
                    c.mutable_scatter()->set_axis(axis + 1);
                    c.mutable_scatter()->set_batch_dims(nb + 1);
                  });
  }
  if (!b.IsBatched(n.operands(1))) {  // the batch leads the operand and the updates alike
    return b.Emit(n, {b.Batched(n.operands(0)), b.Value(n.operands(1)), b.Batched(n.operands(2))},
                  [&](v1::Node& c) { c.mutable_scatter()->set_axis(axis + 1); });
  }
  // Batched indices: each element scatters into its own operand, through
  // the batch flattened; indices out of range stay out of every element.
  const int64_t extent = b.TypeOf(n.operands(0)).dims(int(axis));
  const int64_t k = b.TypeOf(n.operands(1)).dims_size();
  std::vector<int64_t> rest;
  const std::string flat = FlatOperand(b, b.Batched(n.operands(0)), axis, &rest);
  const std::string idx = FlatIndices(b.e(), b.Value(n.operands(1)), extent, /*clamp=*/false);
  // updates [B, x[:axis]..., idx..., x[axis+1:]...] -> [B, idx..., x[:axis]..., x[axis+1:]...]
  std::vector<int64_t> perm = {0};
  for (int64_t d = 0; d < k; ++d) perm.push_back(1 + axis + d);
  for (int64_t d = 0; d < axis; ++d) perm.push_back(1 + d);
  for (int64_t d = 1 + axis + k; d < 1 + k + int64_t(rest.size()); ++d) perm.push_back(d);
  const std::string upd = b.e().Transpose(b.Batched(n.operands(2)), perm);
  const std::string s =
      b.Emit(n, {flat, idx, upd}, [&](v1::Node& c) { c.mutable_scatter()->set_axis(0); });
  std::vector<int64_t> unflat = {b.size(), extent};
  unflat.insert(unflat.end(), rest.begin(), rest.end());
  return b.MoveAxis(b.e().Reshape(s, unflat), 1, axis + 1);
}

}  // namespace

void IndexingRows(Rows& rows) {
  rows.emplace_back(v1::GATHER, OpRules{.layout = LayoutGather,
                                        .lower = LowerGather,
                                        .vjp = VjpGather,
                                        .jvp = JvpGather,
                                        .batch = BatchGather});
  rows.emplace_back(v1::SCATTER, OpRules{.layout = LayoutScatter,
                                         .lower = LowerScatter,
                                         .vjp = VjpScatter,
                                         .jvp = JvpScatter,
                                         .batch = BatchScatter});
}

}  // namespace tessel::scheduler::ops

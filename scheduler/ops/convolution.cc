// convolution: its layout, its transposes (which are convolutions, as in
// JAX), its tangent and its batching.
#include "absl/container/flat_hash_set.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

using Dims = std::vector<int64_t>;

using Specs = ConvolutionSpecs;

void SetSpecs(v1::ConvolutionAttrs& a, const Specs& s) {
  a.set_input_batch_dimension(s.lhs[0]);
  a.set_input_feature_dimension(s.lhs[1]);
  a.set_kernel_output_feature_dimension(s.rhs[0]);
  a.set_kernel_input_feature_dimension(s.rhs[1]);
  a.set_output_batch_dimension(s.out[0]);
  a.set_output_feature_dimension(s.out[1]);
  a.clear_input_spatial_dimensions();
  a.clear_kernel_spatial_dimensions();
  a.clear_output_spatial_dimensions();
  for (size_t i = 2; i < s.lhs.size(); ++i) {
    a.add_input_spatial_dimensions(s.lhs[i]);
    a.add_kernel_spatial_dimensions(s.rhs[i]);
    a.add_output_spatial_dimensions(s.out[i]);
  }
}

Dims Swap01(Dims d) {
  std::swap(d[0], d[1]);
  return d;
}

Dims DimsOf(const v1::TensorType& t) { return Dims(t.dims().begin(), t.dims().end()); }

// Axis `src` of `x` merged into axis `dst` (numbered without `src`), as
// its major part.
std::string AxisInto(Emitter& e, int64_t src, int64_t dst, const std::string& x) {
  const Dims dims = DimsOf(e.type(x));
  Dims perm, shape;
  for (int64_t i = 0; i < int64_t(dims.size()); ++i) {
    if (i == src) continue;
    perm.push_back(i);
    shape.push_back(dims[i]);
  }
  perm.insert(perm.begin() + dst, src);
  shape[dst] *= dims[src];
  return e.Reshape(e.Transpose(x, perm), shape);
}

// Axis `src` of `x` split into (size, rest).
std::string AxisOutOf(Emitter& e, int64_t src, int64_t size, const std::string& x) {
  Dims shape = DimsOf(e.type(x));
  shape[src] /= size;
  shape.insert(shape.begin() + src, size);
  return e.Reshape(x, shape);
}

// The spatial dimension of lhs (by position, 0 for the first) whose split
// a convolution keeps, each device reading its neighbours' edges (a halo);
// -1 where none. A split stays where the window moves by 1 over an
// undilated input and the padding each side fits in a block: the
// convolution of one block, widened by the halos in place of the padding,
// is then the block's share. Either the window is rhs's own (rhs's
// dimension whole) and the output is as long as the input, so the result
// keeps the split; or rhs's dimension is split alike and as long (a weight
// gradient), so each device's share is a partial sum.
int HaloDimension(const LayoutQuery& q, const v1::ConvolutionAttrs& a, const Specs& s,
                  const v1::Sharding& l, const v1::Sharding& r) {
  for (size_t i = 0; i + 2 < s.lhs.size(); ++i) {
    const Axes axes = q.generated[0] ? Axes{} : DimAxes(l, s.lhs[i + 2]);
    if (axes.empty() || a.window_strides(i) != 1 || a.lhs_dilation(i) != 1) continue;
    const int64_t n = q.types[0]->dims(s.lhs[i + 2]), k = AxesSize(q.mesh, axes);
    const int64_t block = n / k, lo = a.padding_low(i), hi = a.padding_high(i);
    if (n % k != 0 || lo < 0 || hi < 0 || lo > block || hi > block) continue;
    const Axes kernel = q.generated[1] ? Axes{} : DimAxes(r, s.rhs[i + 2]);
    const int64_t window = q.types[1]->dims(s.rhs[i + 2]);
    const bool own = kernel.empty() && DilatedExtent(window, a.rhs_dilation(i)) == lo + hi + 1;
    const bool split_alike = kernel == axes && window == n && a.rhs_dilation(i) == 1;
    if (own || split_alike) return int(i);
  }
  return -1;
}

// The batch split on lhs's batch dimension, a spatial split kept where a
// halo exchange serves it (HaloDimension), the output features on rhs's,
// the input features alike on both (the result a partial sum over their
// axes). Other spatial splits are gathered.
void LayoutConvolution(const LayoutQuery& q, Layout& layout) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(q.node.convolution());
  const Specs s = ConvolutionSpecsOf(a);
  v1::Sharding l = q.current[0], r = q.current[1];
  if (IsPartial(l)) l = Complete(l);
  if (IsPartial(r)) r = Complete(r);
  const int rank = l.dims_size();
  layout.want[0] = Replicated(rank);
  layout.want[1] = Replicated(rank);
  layout.result = Replicated(rank);
  const bool ungrouped = a.feature_group_count() == 1 && a.batch_group_count() == 1;
  absl::flat_hash_set<std::string> used;
  auto free_of = [&](const Axes& x) {
    for (const std::string& y : x) {
      if (used.contains(y)) return false;
    }
    return !x.empty();
  };
  auto axes = [&](int k, const v1::Sharding& sh, int64_t d) {
    return q.generated[k] ? Axes{} : DimAxes(sh, d);
  };
  if (a.batch_group_count() == 1) {
    const Axes b = axes(0, l, s.lhs[0]);
    if (free_of(b)) {
      used.insert(b.begin(), b.end());
      SetDimAxes(layout.want[0], s.lhs[0], b);
      SetDimAxes(layout.result, s.out[0], b);
    }
  }
  if (const int i = HaloDimension(q, a, s, l, r); i >= 0) {
    const Axes h = DimAxes(l, s.lhs[i + 2]);
    if (free_of(h)) {
      used.insert(h.begin(), h.end());
      SetDimAxes(layout.want[0], s.lhs[i + 2], h);
      if (DimAxes(r, s.rhs[i + 2]).empty()) {
        SetDimAxes(layout.result, s.out[i + 2], h);
      } else {
        SetDimAxes(layout.want[1], s.rhs[i + 2], h);
        for (const std::string& x : h) layout.result.add_partial(x);
        layout.result.set_partial_kind(v1::SUM);
      }
    }
  }
  if (!ungrouped) return;
  const Axes o = axes(1, r, s.rhs[0]);
  if (free_of(o)) {
    used.insert(o.begin(), o.end());
    SetDimAxes(layout.want[1], s.rhs[0], o);
    SetDimAxes(layout.result, s.out[1], o);
  }
  Axes c = axes(0, l, s.lhs[1]);
  if (!free_of(c)) c = axes(1, r, s.rhs[1]);
  if (free_of(c)) {
    SetDimAxes(layout.want[0], s.lhs[1], c);
    SetDimAxes(layout.want[1], s.rhs[1], c);
    for (const std::string& x : c) layout.result.add_partial(x);
    layout.result.set_partial_kind(v1::SUM);
  }
}

// A kept spatial split: each device's block of lhs widened by the rows of
// its neighbours' blocks the window reaches (collective_permutes along the
// split; the blocks at the ends get zeros, which are the padding), then
// convolved with no padding along that dimension.
absl::StatusOr<std::string> LowerConvolution(LocalGraph& g, const Lowering& w, v1::Node local) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(w.node.convolution());
  const Specs s = ConvolutionSpecsOf(a);
  int i = -1;
  for (size_t j = 0; j + 2 < s.lhs.size() && i < 0; ++j) {
    if (!DimAxes(w.layout.want[0], s.lhs[j + 2]).empty()) i = int(j);
  }
  if (i < 0) return g.Emit(std::move(local));
  const int64_t d = s.lhs[i + 2];
  const Axes axes = DimAxes(w.layout.want[0], d);
  const int64_t k = AxesSize(g.mesh(), axes);
  const std::string x = local.operands(0);
  const v1::TensorType xt = g.LocalTypeOf(x);  // a copy: Emit rehashes
  const int64_t block = xt.dims(d);
  auto rows = [&](int64_t from, int64_t to) {
    return g.EmitOp(v1::SLICE, {x}, w.name + ".edge", [&](v1::Node& n) {
      for (int e = 0; e < xt.dims_size(); ++e) {
        n.mutable_slice()->add_start(e == d ? from : 0);
        n.mutable_slice()->add_limit(e == d ? to : xt.dims(e));
        n.mutable_slice()->add_strides(1);
      }
    });
  };
  auto halo = [&](int64_t from, int64_t to, int step,
                  const char* side) -> absl::StatusOr<std::string> {
    TESSEL_ASSIGN_OR_RETURN(std::string edge, rows(from, to));
    std::vector<int64_t> pairs;
    for (int64_t j = 0; j < k; ++j) {
      if (j + step < 0 || j + step >= k) continue;
      pairs.push_back(j);
      pairs.push_back(j + step);
    }
    return g.EmitCollective(
        v1::COLLECTIVE_PERMUTE, edge, w.name + ".halo", axes, 0, 0, v1::REDUCE_INVALID,
        absl::StrCat("convolution '", w.node.name(), "': dimension ", d, " of lhs split over ",
                     AxesText(axes), " reads ", to - from, " of the ", side,
                     " neighbour's positions (a halo exchange)"),
        pairs);
  };
  std::vector<std::string> parts;
  if (a.padding_low(i) > 0) {
    TESSEL_ASSIGN_OR_RETURN(std::string low, halo(block - a.padding_low(i), block, 1, "lower"));
    parts.push_back(low);
  }
  parts.push_back(x);
  if (a.padding_high(i) > 0) {
    TESSEL_ASSIGN_OR_RETURN(std::string high, halo(0, a.padding_high(i), -1, "upper"));
    parts.push_back(high);
  }
  std::string widened = x;
  if (parts.size() > 1) {
    TESSEL_ASSIGN_OR_RETURN(
        widened, g.EmitOp(v1::CONCATENATE, parts, w.name + ".widened",
                          [&](v1::Node& n) { n.mutable_concatenate()->set_dimension(d); }));
  }
  *local.mutable_convolution() = a;
  local.mutable_convolution()->set_padding_low(i, 0);
  local.mutable_convolution()->set_padding_high(i, 0);
  local.set_operands(0, widened);
  return g.Emit(std::move(local));
}

// Per spatial dimension: the input, window and output extents.
struct Extents {
  Dims in, window, out;
};

Extents ExtentsOf(const Specs& s, const v1::TensorType& lt, const v1::TensorType& rt,
                  const v1::TensorType& ot) {
  Extents x;
  for (size_t i = 2; i < s.lhs.size(); ++i) {
    x.in.push_back(lt.dims(s.lhs[i]));
    x.window.push_back(rt.dims(s.rhs[i]));
    x.out.push_back(ot.dims(s.out[i]));
  }
  return x;
}

// d lhs: the cotangent convolved with the reversed kernel, its roles
// swapped; strides become input dilation (JAX's
// _conv_general_dilated_transpose_lhs).
std::string TransposeLhs(Emitter& e, const v1::ConvolutionAttrs& a, const Specs& s,
                         const Extents& x, const std::string& ct, std::string rhs) {
  const int64_t g = a.feature_group_count(), b = a.batch_group_count();
  if (g > 1 || b > 1) {
    rhs = AxisOutOf(e, s.rhs[0], std::max(g, b), rhs);
    rhs = AxisInto(e, s.rhs[0], s.rhs[1], rhs);
  }
  v1::ConvolutionAttrs t;
  SetSpecs(t, Specs{s.out, Swap01(s.rhs), s.lhs});
  for (size_t i = 0; i < x.in.size(); ++i) {
    const int64_t lhs_d = DilatedExtent(x.in[i], a.lhs_dilation(i));
    const int64_t rhs_d = DilatedExtent(x.window[i], a.rhs_dilation(i));
    const int64_t out_d = DilatedExtent(x.out[i], a.window_strides(i));
    const int64_t before = rhs_d - a.padding_low(i) - 1;
    t.add_padding_low(before);
    t.add_padding_high(lhs_d + rhs_d - 1 - out_d - before);
    t.add_window_strides(a.lhs_dilation(i));
    t.add_lhs_dilation(a.window_strides(i));
    t.add_rhs_dilation(a.rhs_dilation(i));
  }
  t.set_feature_group_count(std::max(g, b));
  t.set_batch_group_count(1);
  google::protobuf::RepeatedField<int64_t> spatial;
  for (size_t i = 2; i < s.rhs.size(); ++i) spatial.Add(s.rhs[i]);
  std::string out = e.Convolution(ct, e.Reverse(rhs, spatial), t);
  if (b > 1) {
    out = AxisOutOf(e, s.lhs[1], b, out);
    out = AxisInto(e, s.lhs[1], s.lhs[0], out);
  }
  return out;
}

// d rhs: lhs convolved with the cotangent, batch and feature roles
// swapped; feature groups become batch groups and back (JAX's
// _conv_general_dilated_transpose_rhs).
std::string TransposeRhs(Emitter& e, const v1::ConvolutionAttrs& a, const Specs& s,
                         const Extents& x, const std::string& lhs, const std::string& ct) {
  v1::ConvolutionAttrs t;
  SetSpecs(t, Specs{Swap01(s.lhs), Swap01(s.out), Swap01(s.rhs)});
  for (size_t i = 0; i < x.in.size(); ++i) {
    const int64_t lhs_d = DilatedExtent(x.in[i], a.lhs_dilation(i));
    const int64_t rhs_d = DilatedExtent(x.window[i], a.rhs_dilation(i));
    const int64_t out_d = DilatedExtent(x.out[i], a.window_strides(i));
    t.add_padding_low(a.padding_low(i));
    t.add_padding_high(out_d - lhs_d + rhs_d - a.padding_low(i) - 1);
    t.add_window_strides(a.rhs_dilation(i));
    t.add_lhs_dilation(a.lhs_dilation(i));
    t.add_rhs_dilation(a.window_strides(i));
  }
  t.set_feature_group_count(a.batch_group_count());
  t.set_batch_group_count(a.feature_group_count());
  return e.Convolution(lhs, ct, t);
}

absl::Status VjpConvolution(ReverseMode& m, const v1::Node& n, const std::string& ct) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(n.convolution());
  const v1::TensorType& lt = m.OperandType(n, 0);
  const v1::TensorType& rt = m.OperandType(n, 1);
  if (!IsFloat(lt.dtype()) || NumElementsUnchecked(n.type()) == 0) return absl::OkStatus();
  const Specs s = ConvolutionSpecsOf(a);
  const Extents x = ExtentsOf(s, lt, rt, n.type());
  Emitter& e = m.e();
  if (m.Active(n, 0)) m.Into(n, 0, TransposeLhs(e, a, s, x, ct, m.Operand(n, 1)));
  if (m.Active(n, 1)) m.Into(n, 1, TransposeRhs(e, a, s, x, m.Operand(n, 0), ct));
  return absl::OkStatus();
}

// As JAX batches it: the batch joins lhs's batch (lhs batched), rhs's
// output features (rhs batched), or becomes more feature groups (both).
absl::StatusOr<std::string> BatchConvolution(Batching& b, const v1::Node& n) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(n.convolution());
  const Specs s = ConvolutionSpecsOf(a);
  const bool lb = b.IsBatched(n.operands(0)), rb = b.IsBatched(n.operands(1));
  const int64_t size = b.size();
  const int64_t g = a.feature_group_count(), bg = a.batch_group_count();
  Emitter& e = b.e();
  std::string lhs = b.Value(n.operands(0)), rhs = b.Value(n.operands(1));
  int64_t out_axis;
  int64_t groups = g, batch_groups = bg;
  if (lb && rb) {
    if (bg > 1) {
      lhs = AxisInto(e, 0, s.lhs[0], lhs);
      batch_groups *= size;
    } else {
      lhs = AxisInto(e, 0, s.lhs[1], lhs);
      groups *= size;
    }
    rhs = AxisInto(e, 0, s.rhs[0], rhs);
    out_axis = s.out[1];
  } else if (lb && bg == 1) {
    lhs = AxisInto(e, 0, s.lhs[0], lhs);
    out_axis = s.out[0];
  } else if (rb && g == 1 && bg == 1) {
    rhs = AxisInto(e, 0, s.rhs[0], rhs);
    out_axis = s.out[1];
  } else {
    return b.NoRule(n, "a batched operand of a grouped convolution");
  }
  std::string out = b.Emit(n, {lhs, rhs}, [&](v1::Node& c) {
    c.mutable_convolution()->set_feature_group_count(groups);
    c.mutable_convolution()->set_batch_group_count(batch_groups);
  });
  return b.MoveAxis(AxisOutOf(e, out_axis, size, out), out_axis, 0);
}

}  // namespace

void ConvolutionRows(Rows& rows) {
  rows.emplace_back(v1::CONVOLUTION, OpRules{.layout = LayoutConvolution,
                                             .lower = LowerConvolution,
                                             .vjp = VjpConvolution,
                                             .jvp = BilinearTangent,
                                             .batch = BatchConvolution});
}

}  // namespace tessel::scheduler::ops

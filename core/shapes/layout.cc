// Parameters, constants and the layout ops (broadcast, reshape, transpose,
// slice, reverse, concatenate, pad).
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel::shapes {
namespace {

absl::StatusOr<TensorType> Parameter(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 0));
  if (n.type().dtype() == v1::DTYPE_INVALID)
    return InvalidArgumentError(StrCat(OpName(n.op()), " needs a declared type"));
  TESSEL_RETURN_IF_ERROR(ValidateType(n.type()));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kParameter, "parameter"));
  if (n.parameter().index() < 0) {
    return InvalidArgumentError(
        StrCat("parameter index: expected >= 0, got ", n.parameter().index()));
  }
  return n.type();
}

absl::StatusOr<TensorType> Constant(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 0));
  if (n.type().dtype() == v1::DTYPE_INVALID)
    return InvalidArgumentError(StrCat(OpName(n.op()), " needs a declared type"));
  TESSEL_RETURN_IF_ERROR(ValidateType(n.type()));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kConstant, "constant"));
  if (n.constant().kind_case() == v1::ConstantAttrs::KIND_NOT_SET) {
    return InvalidArgumentError("constant needs one of literal, fill or iota");
  }
  const TensorType& t = n.type();
  if (n.constant().has_literal()) {
    const v1::Literal& lit = n.constant().literal();
    int64_t elems = NumElementsUnchecked(t);
    int64_t bytes = ByteSizeUnchecked(t);
    int kinds = !lit.data().empty() + (lit.f_size() > 0) + (lit.i_size() > 0);
    if (kinds > 1) return InvalidArgumentError("literal: give only one of data, f, i");
    if (!lit.data().empty() && int64_t(lit.data().size()) != bytes) {
      return InvalidArgumentError(StrCat("literal of type ", TypeString(t), ": expected ", bytes,
                                         " bytes of data, got ", lit.data().size()));
    }
    if (lit.f_size() > 0 && lit.f_size() != elems) {
      return InvalidArgumentError(StrCat("literal of type ", TypeString(t), ": expected ", elems,
                                         " values in f, got ", lit.f_size()));
    }
    if (lit.i_size() > 0 && lit.i_size() != elems) {
      return InvalidArgumentError(StrCat("literal of type ", TypeString(t), ": expected ", elems,
                                         " values in i, got ", lit.i_size()));
    }
    if (kinds == 0 && elems != 0) {
      return InvalidArgumentError(
          StrCat("literal of type ", TypeString(t), ": expected ", elems, " values, got none"));
    }
  } else if (n.constant().has_iota()) {
    if (IsPred(t.dtype())) return InvalidArgumentError("iota: expected a numeric dtype, got pred");
    TESSEL_RETURN_IF_ERROR(
        CheckDimIndex("iota dimension", n.constant().iota().dimension(), t.dims_size()));
  }
  return t;
}

absl::StatusOr<TensorType> BroadcastInDim(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kBroadcastInDim, "broadcast_in_dim"));
  const TensorType& x = *ops[0];
  const auto& a = n.broadcast_in_dim();
  std::vector<int64_t> out = ToVec(a.dims());
  std::vector<int64_t> bd = ToVec(a.broadcast_dimensions());
  if (int64_t(bd.size()) != x.dims_size()) {
    return InvalidArgumentError(StrCat("broadcast_dimensions ", Dims(bd),
                                       " must have one entry per operand dimension: expected ",
                                       x.dims_size(), ", got ", bd.size()));
  }
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims("broadcast dimension", bd, out.size()));
  for (size_t i = 0; i < bd.size(); ++i) {
    int64_t od = x.dims(i), rd = out[bd[i]];
    if (od != 1 && od != rd) {
      return InvalidArgumentError(StrCat("operand dimension ", i, " (size ", od,
                                         ") maps to result dimension ", bd[i], " (size ", rd,
                                         "): expected size 1 or ", rd));
    }
  }
  TensorType r = Make(x.dtype(), out);
  TESSEL_RETURN_IF_ERROR(ValidateType(r));
  return r;
}

absl::StatusOr<TensorType> Reshape(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kReshape, "reshape"));
  TensorType t = Make(ops[0]->dtype(), ToVec(n.reshape().dims()));
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  if (NumElementsUnchecked(t) != NumElementsUnchecked(*ops[0])) {
    return InvalidArgumentError(StrCat("reshape of ", TypeString(*ops[0]), " to ", TypeString(t),
                                       ": element counts differ (", NumElementsUnchecked(*ops[0]),
                                       " vs ", NumElementsUnchecked(t), ")"));
  }
  return t;
}

absl::StatusOr<TensorType> Transpose(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kTranspose, "transpose"));
  std::vector<int64_t> perm = ToVec(n.transpose().permutation());
  if (int64_t(perm.size()) != ops[0]->dims_size()) {
    return InvalidArgumentError(StrCat("permutation ", Dims(perm), " of ", TypeString(*ops[0]),
                                       ": expected ", ops[0]->dims_size(), " entries, got ",
                                       perm.size()));
  }
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims("permutation entry", perm, perm.size()));
  std::vector<int64_t> out;
  for (int64_t p : perm) out.push_back(ops[0]->dims(p));
  return Make(ops[0]->dtype(), out);
}

absl::StatusOr<TensorType> Slice(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kSlice, "slice"));
  const TensorType& x = *ops[0];
  const auto& a = n.slice();
  int64_t rank = x.dims_size();
  std::vector<int64_t> start = ToVec(a.start()), limit = ToVec(a.limit()),
                       strides = ToVec(a.strides());
  if (strides.empty()) strides.assign(rank, 1);
  if (int64_t(start.size()) != rank || int64_t(limit.size()) != rank ||
      int64_t(strides.size()) != rank) {
    return InvalidArgumentError(StrCat("slice of ", TypeString(x),
                                       ": start, limit and strides need ", rank, " entries, got ",
                                       start.size(), ", ", limit.size(), " and ", strides.size()));
  }
  std::vector<int64_t> out(rank);
  for (int64_t i = 0; i < rank; ++i) {
    if (start[i] < 0 || start[i] > limit[i] || limit[i] > x.dims(i) || strides[i] < 1) {
      return InvalidArgumentError(StrCat("slice of ", TypeString(x), " dimension ", i,
                                         ": expected 0 <= start <= limit <= ", x.dims(i),
                                         " and stride >= 1, got start ", start[i], ", limit ",
                                         limit[i], ", stride ", strides[i]));
    }
    out[i] = (limit[i] - start[i] + strides[i] - 1) / strides[i];
  }
  return Make(x.dtype(), out);
}

absl::StatusOr<TensorType> Reverse(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kReverse, "reverse"));
  TESSEL_RETURN_IF_ERROR(
      CheckUniqueDims("reverse dimension", ToVec(n.reverse().dimensions()), ops[0]->dims_size()));
  return *ops[0];
}

absl::StatusOr<TensorType> Concatenate(const v1::Node& n, Operands ops) {
  if (ops.empty()) return InvalidArgumentError("expected at least 1 operand, got 0");
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kConcatenate, "concatenate"));
  const TensorType& first = *ops[0];
  int64_t d = n.concatenate().dimension();
  TESSEL_RETURN_IF_ERROR(CheckDimIndex("concatenate dimension", d, first.dims_size()));
  TensorType t = first;
  for (size_t i = 1; i < ops.size(); ++i) {
    const TensorType& o = *ops[i];
    bool ok = o.dtype() == first.dtype() && o.dims_size() == first.dims_size();
    for (int64_t j = 0; ok && j < first.dims_size(); ++j) {
      if (j != d && o.dims(j) != first.dims(j)) ok = false;
    }
    if (!ok) {
      return InvalidArgumentError(StrCat("operand ", i, ": expected ", DTypeName(first.dtype()),
                                         " with dimensions of ", TypeString(first),
                                         " except dimension ", d, ", got ", TypeString(o)));
    }
    t.set_dims(d, t.dims(d) + o.dims(d));
  }
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  return t;
}

absl::StatusOr<TensorType> Pad(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kPad, "pad"));
  const TensorType &x = *ops[0], &pv = *ops[1];
  const auto& a = n.pad();
  int64_t rank = x.dims_size();
  if (pv.dims_size() != 0 || pv.dtype() != x.dtype()) {
    return InvalidArgumentError(
        StrCat("padding value: expected ", DTypeName(x.dtype()), "[], got ", TypeString(pv)));
  }
  std::vector<int64_t> lo = ToVec(a.low()), hi = ToVec(a.high()), in = ToVec(a.interior());
  if (in.empty()) in.assign(rank, 0);
  if (int64_t(lo.size()) != rank || int64_t(hi.size()) != rank || int64_t(in.size()) != rank) {
    return InvalidArgumentError(StrCat("pad of ", TypeString(x), ": low, high and interior need ",
                                       rank, " entries, got ", lo.size(), ", ", hi.size(), " and ",
                                       in.size()));
  }
  std::vector<int64_t> out(rank);
  for (int64_t i = 0; i < rank; ++i) {
    if (in[i] < 0) {
      return InvalidArgumentError(StrCat("pad interior ", i, ": expected >= 0, got ", in[i]));
    }
    int64_t d = x.dims(i);
    int64_t core = d == 0 ? 0 : d + (d - 1) * in[i];
    out[i] = lo[i] + hi[i] + core;
    if (out[i] < 0) {
      return InvalidArgumentError(StrCat("pad of ", TypeString(x), " dimension ", i,
                                         ": result size ", out[i], " is negative"));
    }
  }
  TensorType r = Make(x.dtype(), out);
  TESSEL_RETURN_IF_ERROR(ValidateType(r));
  return r;
}

}  // namespace

void LayoutShapes(ShapeRows& rows) {
  rows.emplace_back(v1::PARAMETER, Parameter);
  rows.emplace_back(v1::CONSTANT, Constant);
  rows.emplace_back(v1::BROADCAST_IN_DIM, BroadcastInDim);
  rows.emplace_back(v1::RESHAPE, Reshape);
  rows.emplace_back(v1::TRANSPOSE, Transpose);
  rows.emplace_back(v1::SLICE, Slice);
  rows.emplace_back(v1::REVERSE, Reverse);
  rows.emplace_back(v1::CONCATENATE, Concatenate);
  rows.emplace_back(v1::PAD, Pad);
}

}  // namespace tessel::shapes

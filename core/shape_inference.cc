#include "core/shape_inference.h"

#include <algorithm>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessel {
namespace {

using absl::InvalidArgumentError;
using absl::StrCat;
using v1::TensorType;

std::string Dims(const std::vector<int64_t>& d) { return StrCat("[", absl::StrJoin(d, ","), "]"); }

template <typename R>
std::vector<int64_t> ToVec(const R& r) {
  return std::vector<int64_t>(r.begin(), r.end());
}

TensorType Make(v1::DType dt, const std::vector<int64_t>& dims) {
  TensorType t;
  t.set_dtype(dt);
  for (int64_t d : dims) t.add_dims(d);
  return t;
}

absl::Status CheckArity(const v1::Node& n, size_t have, size_t want) {
  if (have != want) {
    return InvalidArgumentError(StrCat("expected ", want, " operand", want == 1 ? "" : "s",
                                       ", got ", have));
  }
  return absl::OkStatus();
}

enum class Admits { kAny, kNumeric, kSigned, kFloat, kIntOrPred, kFloatOrInt };

bool AdmitsDType(Admits a, v1::DType t) {
  switch (a) {
    case Admits::kAny: return true;
    case Admits::kNumeric: return !IsPred(t);
    case Admits::kSigned: return IsSigned(t);
    case Admits::kFloat: return IsFloat(t);
    case Admits::kIntOrPred: return IsInteger(t) || IsPred(t);
    case Admits::kFloatOrInt: return IsFloat(t) || IsInteger(t);
  }
  return false;
}

absl::string_view AdmitsName(Admits a) {
  switch (a) {
    case Admits::kAny: return "any dtype";
    case Admits::kNumeric: return "a numeric dtype (not pred)";
    case Admits::kSigned: return "a signed dtype (f32, f64, f16, bf16, s8, s16, s32, s64)";
    case Admits::kFloat: return "a floating dtype (f32, f64, f16, bf16)";
    case Admits::kIntOrPred: return "an integer or pred dtype (s8, s16, s32, s64, u8, u16, u32, u64, pred)";
    case Admits::kFloatOrInt: return "a numeric dtype (not pred)";
  }
  return "";
}

absl::Status CheckDType(absl::string_view what, Admits a, const TensorType& t) {
  if (!AdmitsDType(a, t.dtype())) {
    return InvalidArgumentError(
        StrCat(what, ": expected ", AdmitsName(a), ", got ", TypeString(t)));
  }
  return absl::OkStatus();
}

Admits UnaryAdmits(v1::Op op) {
  switch (op) {
    case v1::NEG: return Admits::kNumeric;
    case v1::ABS:
    case v1::SIGN: return Admits::kSigned;
    case v1::NOT: return Admits::kIntOrPred;
    default: return Admits::kFloat;
  }
}

Admits BinaryAdmits(v1::Op op) {
  switch (op) {
    case v1::AND:
    case v1::OR:
    case v1::XOR: return Admits::kIntOrPred;
    case v1::ATAN2: return Admits::kFloat;
    default: return Admits::kNumeric;
  }
}

absl::Status CheckDimIndex(absl::string_view what, int64_t d, int64_t rank) {
  if (d < 0 || d >= rank) {
    return InvalidArgumentError(
        StrCat(what, " ", d, " out of range: expected 0 <= dim < ", rank));
  }
  return absl::OkStatus();
}

absl::Status CheckUniqueDims(absl::string_view what, const std::vector<int64_t>& dims,
                             int64_t rank) {
  std::set<int64_t> seen;
  for (int64_t d : dims) {
    TESSEL_RETURN_IF_ERROR(CheckDimIndex(what, d, rank));
    if (!seen.insert(d).second) {
      return InvalidArgumentError(StrCat(what, " ", Dims(dims), " names dimension ", d, " twice"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorType> InferConstant(const v1::Node& n) {
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
      return InvalidArgumentError(StrCat("literal of type ", TypeString(t), ": expected ", elems,
                                         " values, got none"));
    }
  } else if (n.constant().has_iota()) {
    if (IsPred(t.dtype())) return InvalidArgumentError("iota: expected a numeric dtype, got pred");
    TESSEL_RETURN_IF_ERROR(CheckDimIndex("iota dimension", n.constant().iota().dimension(),
                                         t.dims_size()));
  }
  return t;
}

absl::StatusOr<TensorType> InferBroadcastInDim(const v1::Node& n, const TensorType& x) {
  const auto& a = n.broadcast_in_dim();
  std::vector<int64_t> out = ToVec(a.dims());
  std::vector<int64_t> bd = ToVec(a.broadcast_dimensions());
  if (int64_t(bd.size()) != x.dims_size()) {
    return InvalidArgumentError(StrCat("broadcast_dimensions ", Dims(bd), " must have one entry per operand dimension: expected ",
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

absl::StatusOr<TensorType> InferSlice(const v1::Node& n, const TensorType& x) {
  const auto& a = n.slice();
  int64_t rank = x.dims_size();
  std::vector<int64_t> start = ToVec(a.start()), limit = ToVec(a.limit()), strides = ToVec(a.strides());
  if (strides.empty()) strides.assign(rank, 1);
  if (int64_t(start.size()) != rank || int64_t(limit.size()) != rank || int64_t(strides.size()) != rank) {
    return InvalidArgumentError(StrCat("slice of ", TypeString(x), ": start, limit and strides need ",
                                       rank, " entries, got ", start.size(), ", ", limit.size(),
                                       " and ", strides.size()));
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

absl::StatusOr<TensorType> InferPad(const v1::Node& n, const TensorType& x, const TensorType& pv) {
  const auto& a = n.pad();
  int64_t rank = x.dims_size();
  if (pv.dims_size() != 0 || pv.dtype() != x.dtype()) {
    return InvalidArgumentError(StrCat("padding value: expected ", DTypeName(x.dtype()),
                                       "[], got ", TypeString(pv)));
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

absl::StatusOr<TensorType> InferDotGeneral(const v1::Node& n, const TensorType& l, const TensorType& r) {
  const auto& a = n.dot_general();
  if (l.dtype() != r.dtype()) {
    return InvalidArgumentError(StrCat("operands must share a dtype: got ", TypeString(l), " and ",
                                       TypeString(r)));
  }
  TESSEL_RETURN_IF_ERROR(CheckDType("dot_general operand", Admits::kNumeric, l));
  std::vector<int64_t> lb = ToVec(a.lhs_batch()), rb = ToVec(a.rhs_batch());
  std::vector<int64_t> lc = ToVec(a.lhs_contracting()), rc = ToVec(a.rhs_contracting());
  if (lb.size() != rb.size()) {
    return InvalidArgumentError(StrCat("lhs_batch ", Dims(lb), " and rhs_batch ", Dims(rb),
                                       " must have the same length"));
  }
  if (lc.size() != rc.size()) {
    return InvalidArgumentError(StrCat("lhs_contracting ", Dims(lc), " and rhs_contracting ",
                                       Dims(rc), " must have the same length"));
  }
  std::vector<int64_t> lall = lb, rall = rb;
  lall.insert(lall.end(), lc.begin(), lc.end());
  rall.insert(rall.end(), rc.begin(), rc.end());
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims("lhs batch/contracting dimension", lall, l.dims_size()));
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims("rhs batch/contracting dimension", rall, r.dims_size()));
  for (size_t i = 0; i < lall.size(); ++i) {
    if (l.dims(lall[i]) != r.dims(rall[i])) {
      return InvalidArgumentError(StrCat(i < lb.size() ? "batch" : "contracting", " dimension ",
                                         lall[i], " of lhs ", TypeString(l), " and ", rall[i],
                                         " of rhs ", TypeString(r), " differ: ",
                                         l.dims(lall[i]), " vs ", r.dims(rall[i])));
    }
  }
  std::vector<int64_t> out;
  for (int64_t d : lb) out.push_back(l.dims(d));
  for (int64_t i = 0; i < l.dims_size(); ++i) {
    if (std::find(lall.begin(), lall.end(), i) == lall.end()) out.push_back(l.dims(i));
  }
  for (int64_t i = 0; i < r.dims_size(); ++i) {
    if (std::find(rall.begin(), rall.end(), i) == rall.end()) out.push_back(r.dims(i));
  }
  TensorType t = Make(l.dtype(), out);
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  return t;
}

absl::StatusOr<TensorType> InferUnchecked(const v1::Node& n,
                                          absl::Span<const TensorType* const> ops) {
  const v1::Op op = n.op();
  auto attrs_needed = [&](v1::Node::AttrsCase want, absl::string_view name) -> absl::Status {
    if (n.attrs_case() != want) {
      return InvalidArgumentError(StrCat("missing attributes '", name, "'"));
    }
    return absl::OkStatus();
  };
  switch (op) {
    case v1::PARAMETER:
    case v1::CONSTANT: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 0));
      if (n.type().dtype() == v1::DTYPE_INVALID) {
        return InvalidArgumentError(StrCat(OpName(op), " needs a declared type"));
      }
      TESSEL_RETURN_IF_ERROR(ValidateType(n.type()));
      if (op == v1::PARAMETER) {
        TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kParameter, "parameter"));
        if (n.parameter().index() < 0) {
          return InvalidArgumentError(StrCat("parameter index: expected >= 0, got ", n.parameter().index()));
        }
        return n.type();
      }
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kConstant, "constant"));
      return InferConstant(n);
    }
    case v1::NEG: case v1::ABS: case v1::EXP: case v1::LOG: case v1::LOG1P: case v1::TANH:
    case v1::LOGISTIC: case v1::SQRT: case v1::RSQRT: case v1::FLOOR: case v1::CEIL:
    case v1::ROUND: case v1::SIGN: case v1::NOT: case v1::SIN: case v1::COS: case v1::TAN: case v1::ASIN:
    case v1::ACOS: case v1::ATAN: case v1::SINH: case v1::COSH: case v1::ASINH: case v1::ACOSH: case v1::ATANH:
    case v1::EXPM1: case v1::ERF: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(CheckDType("operand", UnaryAdmits(op), *ops[0]));
      return *ops[0];
    }
    case v1::ADD: case v1::SUB: case v1::MUL: case v1::DIV: case v1::REM: case v1::POW:
    case v1::MAX: case v1::MIN: case v1::AND: case v1::OR: case v1::XOR: case v1::ATAN2: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 2));
      if (!SameType(*ops[0], *ops[1])) {
        return InvalidArgumentError(StrCat("operands must have the same type: expected ",
                                           TypeString(*ops[0]), ", got ", TypeString(*ops[1])));
      }
      TESSEL_RETURN_IF_ERROR(CheckDType("operand", BinaryAdmits(op), *ops[0]));
      return *ops[0];
    }
    case v1::COMPARE: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 2));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kCompare, "compare"));
      if (n.compare().direction() == v1::COMPARE_INVALID) {
        return InvalidArgumentError("compare: expected a direction (EQ, NE, LT, LE, GT, GE)");
      }
      if (!SameType(*ops[0], *ops[1])) {
        return InvalidArgumentError(StrCat("operands must have the same type: expected ",
                                           TypeString(*ops[0]), ", got ", TypeString(*ops[1])));
      }
      TensorType t = *ops[0];
      t.set_dtype(v1::PRED);
      return t;
    }
    case v1::SELECT: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 3));
      const TensorType &p = *ops[0], &a = *ops[1], &b = *ops[2];
      if (!SameType(a, b)) {
        return InvalidArgumentError(StrCat("on_true and on_false must have the same type: got ",
                                           TypeString(a), " and ", TypeString(b)));
      }
      TensorType want = a;
      want.set_dtype(v1::PRED);
      if (!(p.dtype() == v1::PRED && (p.dims_size() == 0 || SameType(p, want)))) {
        return InvalidArgumentError(StrCat("predicate: expected pred[] or ", TypeString(want),
                                           ", got ", TypeString(p)));
      }
      return a;
    }
    case v1::CLAMP: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 3));
      const TensorType &lo = *ops[0], &x = *ops[1], &hi = *ops[2];
      TESSEL_RETURN_IF_ERROR(CheckDType("operand", Admits::kNumeric, x));
      for (const TensorType* b : {&lo, &hi}) {
        if (!(b->dtype() == x.dtype() && (b->dims_size() == 0 || SameType(*b, x)))) {
          return InvalidArgumentError(StrCat(b == &lo ? "min" : "max", ": expected ",
                                             DTypeName(x.dtype()), "[] or ", TypeString(x),
                                             ", got ", TypeString(*b)));
        }
      }
      return x;
    }
    case v1::CONVERT: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kConvert, "convert"));
      if (DTypeSize(n.convert().dtype()) == 0) {
        return InvalidArgumentError("convert: expected a target dtype");
      }
      TensorType t = *ops[0];
      t.set_dtype(n.convert().dtype());
      return t;
    }
    case v1::BROADCAST_IN_DIM:
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kBroadcastInDim, "broadcast_in_dim"));
      return InferBroadcastInDim(n, *ops[0]);
    case v1::RESHAPE: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kReshape, "reshape"));
      TensorType t = Make(ops[0]->dtype(), ToVec(n.reshape().dims()));
      TESSEL_RETURN_IF_ERROR(ValidateType(t));
      if (NumElementsUnchecked(t) != NumElementsUnchecked(*ops[0])) {
        return InvalidArgumentError(StrCat("reshape of ", TypeString(*ops[0]), " to ",
                                           TypeString(t), ": element counts differ (",
                                           NumElementsUnchecked(*ops[0]), " vs ",
                                           NumElementsUnchecked(t), ")"));
      }
      return t;
    }
    case v1::TRANSPOSE: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kTranspose, "transpose"));
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
    case v1::SLICE:
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kSlice, "slice"));
      return InferSlice(n, *ops[0]);
    case v1::REVERSE:
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kReverse, "reverse"));
      TESSEL_RETURN_IF_ERROR(
          CheckUniqueDims("reverse dimension", ToVec(n.reverse().dimensions()), ops[0]->dims_size()));
      return *ops[0];
    case v1::CONCATENATE: {
      if (ops.empty()) return InvalidArgumentError("expected at least 1 operand, got 0");
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kConcatenate, "concatenate"));
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
    case v1::PAD:
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 2));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kPad, "pad"));
      return InferPad(n, *ops[0], *ops[1]);
    case v1::DOT_GENERAL:
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 2));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kDotGeneral, "dot_general"));
      return InferDotGeneral(n, *ops[0], *ops[1]);
    case v1::REDUCE: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kReduce, "reduce"));
      v1::ReduceKind k = n.reduce().kind();
      if (k == v1::REDUCE_INVALID) {
        return InvalidArgumentError("reduce: expected a kind (SUM, PROD, REDUCE_MAX, REDUCE_MIN)");
      }
      TESSEL_RETURN_IF_ERROR(CheckDType(StrCat("reduce ", v1::ReduceKind_Name(k), " operand"),
                                        Admits::kNumeric, *ops[0]));
      std::vector<int64_t> dims = ToVec(n.reduce().dims());
      TESSEL_RETURN_IF_ERROR(CheckUniqueDims("reduce dimension", dims, ops[0]->dims_size()));
      std::vector<int64_t> out;
      for (int64_t i = 0; i < ops[0]->dims_size(); ++i) {
        if (std::find(dims.begin(), dims.end(), i) == dims.end()) out.push_back(ops[0]->dims(i));
      }
      return Make(ops[0]->dtype(), out);
    }
    case v1::ARGMAX:
    case v1::ARGMIN: {
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), 1));
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kArgReduce, "arg_reduce"));
      TESSEL_RETURN_IF_ERROR(CheckDType("operand", Admits::kNumeric, *ops[0]));
      int64_t d = n.arg_reduce().dimension();
      TESSEL_RETURN_IF_ERROR(CheckDimIndex("dimension", d, ops[0]->dims_size()));
      if (ops[0]->dims(d) == 0) {
        return InvalidArgumentError(StrCat(OpName(op), " over dimension ", d, " of ",
                                           TypeString(*ops[0]), ": the dimension is empty"));
      }
      v1::DType it = n.arg_reduce().index_dtype();
      if (it == v1::DTYPE_INVALID) it = v1::S32;
      if (it != v1::S32 && it != v1::S64) {
        return InvalidArgumentError(StrCat("index_dtype: expected s32 or s64, got ", DTypeName(it)));
      }
      std::vector<int64_t> out;
      for (int64_t i = 0; i < ops[0]->dims_size(); ++i) {
        if (i != d) out.push_back(ops[0]->dims(i));
      }
      return Make(it, out);
    }
    case v1::SORT: {
      if (ops.empty()) return InvalidArgumentError("sort: expected at least 1 operand (the keys), got 0");
      TESSEL_RETURN_IF_ERROR(attrs_needed(v1::Node::kSort, "sort"));
      const v1::SortAttrs& a = n.sort();
      TESSEL_RETURN_IF_ERROR(CheckDimIndex("sort dimension", a.dimension(), ops[0]->dims_size()));
      for (size_t i = 1; i < ops.size(); ++i) {
        if (!std::equal(ops[i]->dims().begin(), ops[i]->dims().end(), ops[0]->dims().begin(),
                        ops[0]->dims().end())) {
          return InvalidArgumentError(StrCat("sort operand ", i, ": expected the keys' dimensions ",
                                             Dims(ToVec(ops[0]->dims())), ", got ", TypeString(*ops[i])));
        }
      }
      if (a.result_operand() < 0 || size_t(a.result_operand()) >= ops.size()) {
        return InvalidArgumentError(StrCat("sort result_operand: expected 0 to ", ops.size() - 1, ", got ",
                                           a.result_operand()));
      }
      return *ops[a.result_operand()];
    }
    case v1::GATHER:
    case v1::SCATTER: {
      const bool gather = op == v1::GATHER;
      TESSEL_RETURN_IF_ERROR(CheckArity(n, ops.size(), gather ? 2 : 3));
      TESSEL_RETURN_IF_ERROR(gather ? attrs_needed(v1::Node::kGather, "gather")
                                    : attrs_needed(v1::Node::kScatter, "scatter"));
      const int64_t axis = gather ? n.gather().axis() : n.scatter().axis();
      const std::string what = gather ? "gather" : "scatter";
      TESSEL_RETURN_IF_ERROR(CheckDimIndex(StrCat(what, " axis"), axis, ops[0]->dims_size()));
      TESSEL_RETURN_IF_ERROR(CheckDType(StrCat(what, " indices"), Admits::kFloatOrInt, *ops[1]));
      if (IsFloat(ops[1]->dtype())) {
        return InvalidArgumentError(StrCat(what, " indices: expected an integer dtype (s8, s16, s32, s64, u8, u16, u32, u64), got ",
                                           TypeString(*ops[1])));
      }
      // Picked slices: operand[:axis] + indices + operand[axis+1:].
      std::vector<int64_t> picked(ops[0]->dims().begin(), ops[0]->dims().begin() + axis);
      picked.insert(picked.end(), ops[1]->dims().begin(), ops[1]->dims().end());
      picked.insert(picked.end(), ops[0]->dims().begin() + axis + 1, ops[0]->dims().end());
      if (gather && ops[0]->dims(axis) == 0 && NumElementsUnchecked(*ops[1]) > 0) {
        return InvalidArgumentError(StrCat("gather along axis ", axis, " of ", TypeString(*ops[0]),
                                           ": the axis is empty, so no index can pick a slice"));
      }
      if (gather) return Make(ops[0]->dtype(), picked);
      if (ops[2]->dtype() != ops[0]->dtype() || ToVec(ops[2]->dims()) != picked) {
        return InvalidArgumentError(StrCat("scatter updates: expected ", DTypeName(ops[0]->dtype()), Dims(picked),
                                           " (the operand's slices at the indices), got ", TypeString(*ops[2])));
      }
      const v1::ReduceKind k = n.scatter().combine();
      if (k == v1::SUM || k == v1::PROD) {
        TESSEL_RETURN_IF_ERROR(CheckDType(StrCat("scatter ", v1::ReduceKind_Name(k), " operand"),
                                          Admits::kNumeric, *ops[0]));
      } else if (k != v1::REDUCE_INVALID && k != v1::REDUCE_MAX && k != v1::REDUCE_MIN) {
        return InvalidArgumentError(StrCat("scatter combine: expected unset (replace), SUM, PROD, REDUCE_MAX or "
                                           "REDUCE_MIN, got ", int(k)));
      }
      return *ops[0];
    }
    default:
      return InvalidArgumentError(StrCat("unknown op ", int(op)));
  }
}

}  // namespace

absl::Status ValidateType(const v1::TensorType& t) {
  return ByteSize(t).status();
}

bool IsElementwise(v1::Op op) {
  return (op >= v1::NEG && op <= v1::ERF) || (op >= v1::ADD && op <= v1::ATAN2) ||
         op == v1::COMPARE || op == v1::SELECT || op == v1::CLAMP || op == v1::CONVERT;
}

absl::StatusOr<TensorType> InferType(const v1::Node& node,
                                     absl::Span<const TensorType* const> operands) {
  for (size_t i = 0; i < operands.size(); ++i) {
    if (DTypeSize(operands[i]->dtype()) == 0) {
      return InvalidArgumentError(StrCat("operand ", i, " has no valid dtype"));
    }
  }
  TESSEL_ASSIGN_OR_RETURN(TensorType t, InferUnchecked(node, operands));
  const bool declared = node.type().dtype() != v1::DTYPE_INVALID;
  if (declared && node.op() != v1::PARAMETER && node.op() != v1::CONSTANT &&
      !SameType(node.type(), t)) {
    return InvalidArgumentError(StrCat("declared type ", TypeString(node.type()),
                                       " does not match the inferred type ", TypeString(t)));
  }
  return t;
}

}  // namespace tessel

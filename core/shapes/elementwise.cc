// Elementwise ops: same-typed operands (select's predicate and clamp's
// bounds may be scalars).
#include "core/shapes/shape_rules.h"

namespace tessel::shapes {
namespace {

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

absl::Status CheckSameType(const TensorType& a, const TensorType& b) {
  if (!SameType(a, b)) {
    return InvalidArgumentError(StrCat("operands must have the same type: expected ", TypeString(a),
                                       ", got ", TypeString(b)));
  }
  return absl::OkStatus();
}

absl::StatusOr<TensorType> Unary(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckDType("operand", UnaryAdmits(n.op()), *ops[0]));
  return *ops[0];
}

absl::StatusOr<TensorType> Binary(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  TESSEL_RETURN_IF_ERROR(CheckSameType(*ops[0], *ops[1]));
  TESSEL_RETURN_IF_ERROR(CheckDType("operand", BinaryAdmits(n.op()), *ops[0]));
  return *ops[0];
}

absl::StatusOr<TensorType> Compare(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kCompare, "compare"));
  if (n.compare().direction() == v1::COMPARE_INVALID) {
    return InvalidArgumentError("compare: expected a direction (EQ, NE, LT, LE, GT, GE)");
  }
  TESSEL_RETURN_IF_ERROR(CheckSameType(*ops[0], *ops[1]));
  TensorType t = *ops[0];
  t.set_dtype(v1::PRED);
  return t;
}

absl::StatusOr<TensorType> Select(const v1::Node&, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 3));
  const TensorType &p = *ops[0], &a = *ops[1], &b = *ops[2];
  if (!SameType(a, b)) {
    return InvalidArgumentError(StrCat("on_true and on_false must have the same type: got ",
                                       TypeString(a), " and ", TypeString(b)));
  }
  TensorType want = a;
  want.set_dtype(v1::PRED);
  if (!(p.dtype() == v1::PRED && (p.dims_size() == 0 || SameType(p, want)))) {
    return InvalidArgumentError(
        StrCat("predicate: expected pred[] or ", TypeString(want), ", got ", TypeString(p)));
  }
  return a;
}

absl::StatusOr<TensorType> Clamp(const v1::Node&, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 3));
  const TensorType &lo = *ops[0], &x = *ops[1], &hi = *ops[2];
  TESSEL_RETURN_IF_ERROR(CheckDType("operand", Admits::kNumeric, x));
  for (const TensorType* b : {&lo, &hi}) {
    if (!(b->dtype() == x.dtype() && (b->dims_size() == 0 || SameType(*b, x)))) {
      return InvalidArgumentError(StrCat(b == &lo ? "min" : "max", ": expected ",
                                         DTypeName(x.dtype()), "[] or ", TypeString(x), ", got ",
                                         TypeString(*b)));
    }
  }
  return x;
}

absl::StatusOr<TensorType> Convert(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kConvert, "convert"));
  if (DTypeSize(n.convert().dtype()) == 0)
    return InvalidArgumentError("convert: expected a target dtype");
  if (n.convert().bitcast() && (n.convert().dtype() == v1::PRED || ops[0]->dtype() == v1::PRED)) {
    return InvalidArgumentError(StrCat("bitcast_convert: ", DTypeName(ops[0]->dtype()), " to ",
                                       DTypeName(n.convert().dtype()),
                                       ": pred has no bits to read as another dtype"));
  }
  if (n.convert().bitcast() && DTypeSize(n.convert().dtype()) != DTypeSize(ops[0]->dtype())) {
    return InvalidArgumentError(
        StrCat("bitcast_convert: ", DTypeName(ops[0]->dtype()), " (", DTypeSize(ops[0]->dtype()),
               " bytes) to ", DTypeName(n.convert().dtype()), " (", DTypeSize(n.convert().dtype()),
               " bytes): expected dtypes of the same width"));
  }
  TensorType t = *ops[0];
  t.set_dtype(n.convert().dtype());
  return t;
}

}  // namespace

void ElementwiseShapes(ShapeRows& rows) {
  for (int op = v1::NEG; op <= v1::CBRT; ++op) {
    if (v1::Op_IsValid(op)) rows.emplace_back(v1::Op(op), Unary);
  }
  for (int op = v1::ADD; op <= v1::ATAN2; ++op) {
    if (v1::Op_IsValid(op)) rows.emplace_back(v1::Op(op), Binary);
  }
  rows.emplace_back(v1::COMPARE, Compare);
  rows.emplace_back(v1::SELECT, Select);
  rows.emplace_back(v1::CLAMP, Clamp);
  rows.emplace_back(v1::CONVERT, Convert);
}

}  // namespace tessel::shapes

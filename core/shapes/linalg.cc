// Linear algebra (CHOLESKY, TRIANGULAR_SOLVE, LU, EIGH, QR, SVD): a matrix in the
// last two dimensions, any leading ones a batch.
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel {
namespace shapes {
namespace {

// f32 or f64 (what LAPACK and cuSOLVER factor), rank >= 2.
absl::Status CheckMatrix(const v1::Node& n, const char* what, const TensorType& t) {
  if (t.dtype() != v1::F32 && t.dtype() != v1::F64) {
    return InvalidArgumentError(
        StrCat(OpName(n.op()), " ", what, ": expected f32 or f64, got ", TypeString(t)));
  }
  if (t.dims_size() < 2) {
    return InvalidArgumentError(StrCat(OpName(n.op()), " ", what,
                                       ": expected a matrix [..., m, n] (rank >= 2), got ",
                                       TypeString(t)));
  }
  return absl::OkStatus();
}

absl::Status CheckSquare(const v1::Node& n, const char* what, const TensorType& t) {
  TESSEL_RETURN_IF_ERROR(CheckMatrix(n, what, t));
  const int r = t.dims_size();
  if (t.dims(r - 1) != t.dims(r - 2)) {
    return InvalidArgumentError(StrCat(
        OpName(n.op()), " ", what, ": expected a square matrix [..., n, n], got ", TypeString(t)));
  }
  return absl::OkStatus();
}

// a's type with `extra` more rows: the packed results of LU and EIGH.
absl::StatusOr<TensorType> Square(const v1::Node& n, Operands ops, int64_t extra) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  const TensorType& a = *ops[0];
  TESSEL_RETURN_IF_ERROR(CheckSquare(n, "operand", a));
  TensorType t = a;
  t.set_dims(a.dims_size() - 2, a.dims(a.dims_size() - 2) + extra);
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  return t;
}

absl::StatusOr<TensorType> Cholesky(const v1::Node& n, Operands ops) { return Square(n, ops, 0); }
absl::StatusOr<TensorType> Lu(const v1::Node& n, Operands ops) { return Square(n, ops, 2); }
absl::StatusOr<TensorType> Eigh(const v1::Node& n, Operands ops) { return Square(n, ops, 1); }

// a [..., m, n] with `extra` + min(m, n) more rows: QR's and SVD's packing.
absl::StatusOr<TensorType> Rectangular(const v1::Node& n, Operands ops, int64_t extra) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  const TensorType& a = *ops[0];
  TESSEL_RETURN_IF_ERROR(CheckMatrix(n, "operand", a));
  const int r = a.dims_size();
  TensorType t = a;
  t.set_dims(r - 2, a.dims(r - 2) + extra + std::min(a.dims(r - 2), a.dims(r - 1)));
  TESSEL_RETURN_IF_ERROR(ValidateType(t));
  return t;
}

absl::StatusOr<TensorType> Qr(const v1::Node& n, Operands ops) { return Rectangular(n, ops, 0); }
absl::StatusOr<TensorType> Svd(const v1::Node& n, Operands ops) { return Rectangular(n, ops, 1); }

absl::StatusOr<TensorType> TriangularSolve(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  const TensorType &a = *ops[0], &b = *ops[1];
  TESSEL_RETURN_IF_ERROR(CheckSquare(n, "a (operand 0)", a));
  TESSEL_RETURN_IF_ERROR(CheckMatrix(n, "b (operand 1)", b));
  const int r = a.dims_size();
  const bool left = n.linalg().left_side();
  if (b.dims_size() != r || b.dtype() != a.dtype()) {
    return InvalidArgumentError(
        StrCat("TRIANGULAR_SOLVE: b (operand 1) must have a's dtype and rank: a ", TypeString(a),
               ", b ", TypeString(b)));
  }
  for (int d = 0; d < r - 2; ++d) {
    if (a.dims(d) != b.dims(d)) {
      return InvalidArgumentError(StrCat("TRIANGULAR_SOLVE: a and b must have the same batch ",
                                         "dimensions: a ", TypeString(a), ", b ", TypeString(b)));
    }
  }
  const int64_t want = a.dims(r - 1), have = b.dims(left ? r - 2 : r - 1);
  if (want != have) {
    return InvalidArgumentError(StrCat(
        "TRIANGULAR_SOLVE: b (operand 1) must have ", want, left ? " rows" : " columns", " (a is ",
        want, "x", want, left ? ", left_side" : ", right side", "), got ", TypeString(b)));
  }
  return b;
}

}  // namespace

void LinalgShapes(ShapeRows& rows) {
  rows.emplace_back(v1::CHOLESKY, Cholesky);
  rows.emplace_back(v1::TRIANGULAR_SOLVE, TriangularSolve);
  rows.emplace_back(v1::LU, Lu);
  rows.emplace_back(v1::EIGH, Eigh);
  rows.emplace_back(v1::QR, Qr);
  rows.emplace_back(v1::SVD, Svd);
}

}  // namespace shapes
}  // namespace tessel

#include "core/shape_inference.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shapes/shape_rules.h"
#include "core/status.h"

namespace tessel {
namespace {

using absl::InvalidArgumentError;
using absl::StrCat;
using v1::TensorType;

absl::flat_hash_map<int, shapes::ShapeRule> BuildShapeTable() {
  shapes::ShapeRows rows;
  shapes::ElementwiseShapes(rows);
  shapes::LayoutShapes(rows);
  shapes::ReduceShapes(rows);
  shapes::DotShapes(rows);
  shapes::ConvolutionShapes(rows);
  shapes::LinalgShapes(rows);
  shapes::IndexingShapes(rows);
  return {rows.begin(), rows.end()};
}

absl::StatusOr<TensorType> InferUnchecked(const v1::Node& n,
                                          absl::Span<const TensorType* const> ops) {
  static const absl::flat_hash_map<int, shapes::ShapeRule>* const table =
      new auto(BuildShapeTable());
  auto it = table->find(int(n.op()));
  if (it == table->end()) return InvalidArgumentError(StrCat("unknown op ", int(n.op())));
  return it->second(n, ops);
}

}  // namespace

absl::Status ValidateType(const v1::TensorType& t) { return ByteSize(t).status(); }

bool IsElementwise(v1::Op op) {
  return (op >= v1::NEG && op <= v1::CBRT) || (op >= v1::ADD && op <= v1::ATAN2) ||
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

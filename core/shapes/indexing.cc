// gather and scatter along one axis.
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel::shapes {
namespace {

absl::StatusOr<TensorType> GatherOrScatter(const v1::Node& n, Operands ops) {
  const bool gather = n.op() == v1::GATHER;
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), gather ? 2 : 3));
  TESSEL_RETURN_IF_ERROR(gather ? CheckAttrs(n, v1::Node::kGather, "gather")
                                : CheckAttrs(n, v1::Node::kScatter, "scatter"));
  const int64_t axis = gather ? n.gather().axis() : n.scatter().axis();
  const int64_t batch = gather ? n.gather().batch_dims() : n.scatter().batch_dims();
  const std::string what = gather ? "gather" : "scatter";
  TESSEL_RETURN_IF_ERROR(CheckDimIndex(StrCat(what, " axis"), axis, ops[0]->dims_size()));
  if (batch < 0 || batch > axis || batch > ops[1]->dims_size()) {
    return InvalidArgumentError(StrCat(what, " batch_dims: expected 0 to ",
                                       std::min<int64_t>(axis, ops[1]->dims_size()),
                                       " (at most the axis, ", axis, ", and the indices' rank, ",
                                       ops[1]->dims_size(), "), got ", batch));
  }
  for (int d = 0; d < batch; ++d) {
    if (ops[0]->dims(d) != ops[1]->dims(d)) {
      return InvalidArgumentError(StrCat(what, " batch dimension ", d, ": the operand ",
                                         TypeString(*ops[0]), " and the indices ",
                                         TypeString(*ops[1]), " must agree on it"));
    }
  }
  TESSEL_RETURN_IF_ERROR(CheckDType(StrCat(what, " indices"), Admits::kFloatOrInt, *ops[1]));
  if (IsFloat(ops[1]->dtype())) {
    return InvalidArgumentError(StrCat(
        what, " indices: expected an integer dtype (s8, s16, s32, s64, u8, u16, u32, u64), got ",
        TypeString(*ops[1])));
  }
  // Picked slices: operand[:axis] + indices + operand[axis+1:].
  std::vector<int64_t> picked(ops[0]->dims().begin(), ops[0]->dims().begin() + axis);
  picked.insert(picked.end(), ops[1]->dims().begin() + batch, ops[1]->dims().end());
  picked.insert(picked.end(), ops[0]->dims().begin() + axis + 1, ops[0]->dims().end());
  if (gather && ops[0]->dims(axis) == 0 && NumElementsUnchecked(*ops[1]) > 0) {
    return InvalidArgumentError(StrCat("gather along axis ", axis, " of ", TypeString(*ops[0]),
                                       ": the axis is empty, so no index can pick a slice"));
  }
  if (gather) return Make(ops[0]->dtype(), picked);
  if (ops[2]->dtype() != ops[0]->dtype() || ToVec(ops[2]->dims()) != picked) {
    return InvalidArgumentError(StrCat("scatter updates: expected ", DTypeName(ops[0]->dtype()),
                                       Dims(picked), " (the operand's slices at the indices), got ",
                                       TypeString(*ops[2])));
  }
  const v1::ReduceKind k = n.scatter().combine();
  if (k == v1::SUM || k == v1::PROD) {
    TESSEL_RETURN_IF_ERROR(CheckDType(StrCat("scatter ", v1::ReduceKind_Name(k), " operand"),
                                      Admits::kNumeric, *ops[0]));
  } else if (k != v1::REDUCE_INVALID && k != v1::REDUCE_MAX && k != v1::REDUCE_MIN) {
    return InvalidArgumentError(
        StrCat("scatter combine: expected unset (replace), SUM, PROD, REDUCE_MAX or "
               "REDUCE_MIN, got ",
               int(k)));
  }
  return *ops[0];
}

}  // namespace

void IndexingShapes(ShapeRows& rows) {
  rows.emplace_back(v1::GATHER, GatherOrScatter);
  rows.emplace_back(v1::SCATTER, GatherOrScatter);
}

}  // namespace tessel::shapes

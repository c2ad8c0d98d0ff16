// dot_general.
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel::shapes {
namespace {

absl::StatusOr<TensorType> DotGeneral(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 2));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kDotGeneral, "dot_general"));
  const TensorType &l = *ops[0], &r = *ops[1];
  const auto& a = n.dot_general();
  if (l.dtype() != r.dtype()) {
    return InvalidArgumentError(
        StrCat("operands must share a dtype: got ", TypeString(l), " and ", TypeString(r)));
  }
  TESSEL_RETURN_IF_ERROR(CheckDType("dot_general operand", Admits::kNumeric, l));
  std::vector<int64_t> lb = ToVec(a.lhs_batch()), rb = ToVec(a.rhs_batch());
  std::vector<int64_t> lc = ToVec(a.lhs_contracting()), rc = ToVec(a.rhs_contracting());
  if (lb.size() != rb.size()) {
    return InvalidArgumentError(
        StrCat("lhs_batch ", Dims(lb), " and rhs_batch ", Dims(rb), " must have the same length"));
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
                                         " of rhs ", TypeString(r), " differ: ", l.dims(lall[i]),
                                         " vs ", r.dims(rall[i])));
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

}  // namespace

void DotShapes(ShapeRows& rows) { rows.emplace_back(v1::DOT_GENERAL, DotGeneral); }

}  // namespace tessel::shapes

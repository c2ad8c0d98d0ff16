// Reductions, arg-reductions and sort.
#include <algorithm>

#include "core/shapes/shape_rules.h"

namespace tessel::shapes {
namespace {

absl::StatusOr<TensorType> Reduce(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kReduce, "reduce"));
  v1::ReduceKind k = n.reduce().kind();
  if (k == v1::REDUCE_INVALID) {
    return InvalidArgumentError("reduce: expected a kind (SUM, PROD, REDUCE_MAX, REDUCE_MIN)");
  }
  TESSEL_RETURN_IF_ERROR(
      CheckDType(StrCat("reduce ", v1::ReduceKind_Name(k), " operand"), Admits::kNumeric, *ops[0]));
  std::vector<int64_t> dims = ToVec(n.reduce().dims());
  TESSEL_RETURN_IF_ERROR(CheckUniqueDims("reduce dimension", dims, ops[0]->dims_size()));
  std::vector<int64_t> out;
  for (int64_t i = 0; i < ops[0]->dims_size(); ++i) {
    if (std::find(dims.begin(), dims.end(), i) == dims.end()) out.push_back(ops[0]->dims(i));
  }
  return Make(ops[0]->dtype(), out);
}

absl::StatusOr<TensorType> ArgReduce(const v1::Node& n, Operands ops) {
  TESSEL_RETURN_IF_ERROR(CheckArity(ops.size(), 1));
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kArgReduce, "arg_reduce"));
  TESSEL_RETURN_IF_ERROR(CheckDType("operand", Admits::kNumeric, *ops[0]));
  int64_t d = n.arg_reduce().dimension();
  TESSEL_RETURN_IF_ERROR(CheckDimIndex("dimension", d, ops[0]->dims_size()));
  if (ops[0]->dims(d) == 0) {
    return InvalidArgumentError(StrCat(OpName(n.op()), " over dimension ", d, " of ",
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

absl::StatusOr<TensorType> Sort(const v1::Node& n, Operands ops) {
  if (ops.empty())
    return InvalidArgumentError("sort: expected at least 1 operand (the keys), got 0");
  TESSEL_RETURN_IF_ERROR(CheckAttrs(n, v1::Node::kSort, "sort"));
  const v1::SortAttrs& a = n.sort();
  TESSEL_RETURN_IF_ERROR(CheckDimIndex("sort dimension", a.dimension(), ops[0]->dims_size()));
  for (size_t i = 1; i < ops.size(); ++i) {
    if (!std::equal(ops[i]->dims().begin(), ops[i]->dims().end(), ops[0]->dims().begin(),
                    ops[0]->dims().end())) {
      return InvalidArgumentError(StrCat("sort operand ", i, ": expected the keys' dimensions ",
                                         Dims(ToVec(ops[0]->dims())), ", got ",
                                         TypeString(*ops[i])));
    }
  }
  if (a.result_operand() < 0 || size_t(a.result_operand()) >= ops.size()) {
    return InvalidArgumentError(StrCat("sort result_operand: expected 0 to ", ops.size() - 1,
                                       ", got ", a.result_operand()));
  }
  return *ops[a.result_operand()];
}

}  // namespace

void ReduceShapes(ShapeRows& rows) {
  rows.emplace_back(v1::REDUCE, Reduce);
  rows.emplace_back(v1::ARGMAX, ArgReduce);
  rows.emplace_back(v1::ARGMIN, ArgReduce);
  rows.emplace_back(v1::SORT, Sort);
}

}  // namespace tessel::shapes

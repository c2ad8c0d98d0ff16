// Shape rules, one file per op family (elementwise, layout, reduce, dot,
// indexing), and the checks they share. Internal to core: users call
// InferType (core/shape_inference.h), which looks the op up here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::shapes {

// What every shape rule uses.
using absl::InvalidArgumentError;
using absl::StrCat;

using v1::TensorType;
using Operands = absl::Span<const TensorType* const>;

// The result type of `n` over operands of these types, its constraints checked.
using ShapeRule = absl::StatusOr<TensorType> (*)(const v1::Node& n, Operands ops);
using ShapeRows = std::vector<std::pair<v1::Op, ShapeRule>>;

void ElementwiseShapes(ShapeRows& rows);
void LayoutShapes(ShapeRows& rows);
void ReduceShapes(ShapeRows& rows);
void DotShapes(ShapeRows& rows);
void ConvolutionShapes(ShapeRows& rows);
void LinalgShapes(ShapeRows& rows);
void IndexingShapes(ShapeRows& rows);

// ---- shared checks; each error names the thing, the expected and the actual

std::string Dims(const std::vector<int64_t>& d);  // "[2,3]"
template <typename R>
std::vector<int64_t> ToVec(const R& r) {
  return std::vector<int64_t>(r.begin(), r.end());
}
TensorType Make(v1::DType dt, const std::vector<int64_t>& dims);

absl::Status CheckArity(size_t have, size_t want);
// The node carries attributes `name` (the oneof case `want`).
absl::Status CheckAttrs(const v1::Node& n, v1::Node::AttrsCase want, absl::string_view name);

enum class Admits { kAny, kNumeric, kSigned, kFloat, kIntOrPred, kFloatOrInt };
absl::Status CheckDType(absl::string_view what, Admits a, const TensorType& t);
absl::Status CheckDimIndex(absl::string_view what, int64_t d, int64_t rank);
absl::Status CheckUniqueDims(absl::string_view what, const std::vector<int64_t>& dims,
                             int64_t rank);

}  // namespace tessel::shapes

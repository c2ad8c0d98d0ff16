// Shape and dtype inference for every IR op, with the op's constraints
// checked. Shared by the scheduler (Compile) and the C++ graph builder so
// that a shape error is the same message at build time and at compile time.
// Pure functions; any thread.
#pragma once

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

// Result type of `node` given its operands' types. Errors say what was
// expected and what was found, without naming the node (callers add it).
absl::StatusOr<v1::TensorType> InferType(const v1::Node& node,
                                         absl::Span<const v1::TensorType* const> operands);

// Checks a type as a standalone value: valid dtype, dimensions >= 0, and a
// byte size that fits in int64.
absl::Status ValidateType(const v1::TensorType& t);

// True for ops evaluated element by element on same-shaped operands.
bool IsElementwise(v1::Op op);

}  // namespace tessel

// Shape and dtype inference for every IR op, with the op's constraints
// checked. Shared by the scheduler (Compile) and the C++ graph builder so
// that a shape error is the same message at build time and at compile time.
// Pure functions; any thread.
#pragma once

#include <cstdint>
#include <vector>

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

// A convolution's attributes with every default spelled out: strides and
// dilations 1 and padding 0 per spatial dimension where a list is empty,
// group counts 1 where 0.
v1::ConvolutionAttrs ConvolutionWithDefaults(const v1::ConvolutionAttrs& a);
// A convolution's dimension numbers as JAX writes them: lhs and the output
// as (batch, feature, spatial...), rhs as (output feature, input feature,
// spatial...).
struct ConvolutionSpecs {
  std::vector<int64_t> lhs, rhs, out;
};
ConvolutionSpecs ConvolutionSpecsOf(const v1::ConvolutionAttrs& a);
// The extent of `n` elements with `dilation - 1` holes between neighbours.
int64_t DilatedExtent(int64_t n, int64_t dilation);
// A convolution's output extent along spatial dimension `i` of `a` (with
// defaults), for an input of extent `in` and a window of extent `window`.
int64_t ConvolutionOutputExtent(const v1::ConvolutionAttrs& a, int i, int64_t in, int64_t window);

// True for ops evaluated element by element on same-shaped operands.
bool IsElementwise(v1::Op op);

}  // namespace tessel

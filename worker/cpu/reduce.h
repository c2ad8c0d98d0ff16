// Reductions over any set of dimensions, and argmax/argmin along one.
// Stateless; any thread.
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

void Reduce(const v1::TensorType& in_type, const void* in, const v1::ReduceAttrs& a,
            const v1::TensorType& out_type, void* out);

// First index of the max (min) along the dimension; NaN wins, as in numpy.
void ArgReduce(bool is_max, const v1::TensorType& in_type, const void* in,
               const v1::ArgReduceAttrs& a, const v1::TensorType& out_type, void* out);

}  // namespace tessel::cpu

// SORT on the CPU: a stable sort of each row of the keys along one
// dimension, moving one operand by the order found (see SortAttrs).
#pragma once

#include <vector>

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

// keys_type: operand 0's type; `result` (of result_type, the dimensions of
// the keys) receives operand a.result_operand() reordered.
void Sort(const v1::TensorType& keys_type, const void* keys, const v1::TensorType& result_type,
          const void* result_source, const v1::SortAttrs& a, void* result);

}  // namespace tessel::cpu

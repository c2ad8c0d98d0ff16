// GATHER and SCATTER on the CPU: slices along one axis picked, or updated,
// by integer indices (see GatherAttrs and ScatterAttrs).
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

// `out` = operand's slices along `axis` at `indices` (clamped into range),
// each batch element's from its own operand (GatherAttrs.batch_dims).
void Gather(const v1::TensorType& operand_type, const void* operand,
            const v1::TensorType& indices_type, const void* indices, const v1::GatherAttrs& attrs,
            void* out);

// `out` (operand's type) = operand with `updates` combined in at `indices`
// along a.axis(); updates at indices out of range are dropped. Repeated
// indices apply in row-major order of the indices.
void Scatter(const v1::TensorType& operand_type, const void* operand,
             const v1::TensorType& indices_type, const void* indices, const void* updates,
             const v1::ScatterAttrs& a, void* out);

}  // namespace tessel::cpu

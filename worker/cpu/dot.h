// dot_general on the CPU: f32 and f64 through OpenBLAS (batched GEMM over a
// canonical [batch, M, K] x [batch, K, N] view, transposing only operands
// whose layout GEMM cannot read directly); other dtypes by a plain loop
// (f16/bf16 accumulate in f32, integers wrap). Stateless; any thread.
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

void DotGeneral(const v1::TensorType& lhs_type, const void* lhs, const v1::TensorType& rhs_type,
                const void* rhs, const v1::DotGeneralAttrs& a, const v1::TensorType& out_type,
                void* out);

}  // namespace tessel::cpu

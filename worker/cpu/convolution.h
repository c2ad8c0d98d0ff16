// StableHLO's convolution on the CPU. f32 runs on oneDNN: the operands are
// put in [batch, feature, spatial...] / [out, in, spatial...] order, input
// dilation and negative padding are materialized first (oneDNN has
// neither), and batch groups run as one oneDNN convolution each. Other
// dtypes, and f32 convolutions without spatial dimensions, run as a direct
// loop over the operands' own layouts (f16/bf16 accumulate in f32,
// integers wrap), which is also the reference the CUDA kernel is checked
// against. Stateless; any thread.
#pragma once

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

void Convolution(const v1::TensorType& lhs_type, const void* lhs, const v1::TensorType& rhs_type,
                 const void* rhs, const v1::ConvolutionAttrs& attrs, const v1::TensorType& out_type,
                 void* out);

// The direct loop, for any dtype.
void ConvolutionDirect(const v1::TensorType& lhs_type, const void* lhs,
                       const v1::TensorType& rhs_type, const void* rhs,
                       const v1::ConvolutionAttrs& attrs, const v1::TensorType& out_type,
                       void* out);

}  // namespace tessel::cpu

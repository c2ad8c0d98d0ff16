// Layout kernels: they move elements without looking at their values, so
// they work on bytes of the element size. Arrays are dense row-major.
// Stateless; any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "tessel/v1/ir.pb.h"

namespace tessel::cpu {

// Copies the `dims`-shaped box of elements (size `esize`) whose strides, in
// elements, are `src_strides` from `src` and `dst_strides` into `dst`.
// Strides may be 0 (broadcast).
void CopyStrided(int esize, const std::vector<int64_t>& dims, const char* src,
                 const std::vector<int64_t>& src_strides, char* dst,
                 const std::vector<int64_t>& dst_strides);

std::vector<int64_t> RowMajorStrides(const google::protobuf::RepeatedField<int64_t>& dims);

void Transpose(const v1::TensorType& in_type, const void* in, const v1::TransposeAttrs& a,
               const v1::TensorType& out_type, void* out);
// Reverses the order of elements along a.dimensions(); the result has `type` too.
void Reverse(const v1::TensorType& type, const void* in, const v1::ReverseAttrs& a, void* out);
void Slice(const v1::TensorType& in_type, const void* in, const v1::SliceAttrs& a,
           const v1::TensorType& out_type, void* out);
void BroadcastInDim(const v1::TensorType& in_type, const void* in, const v1::BroadcastInDimAttrs& a,
                    const v1::TensorType& out_type, void* out);
void Concatenate(const std::vector<const v1::TensorType*>& in_types,
                 const std::vector<const void*>& ins, int64_t dimension,
                 const v1::TensorType& out_type, void* out);
// `pad_value` points at one element.
void Pad(const v1::TensorType& in_type, const void* in, const void* pad_value,
         const v1::PadAttrs& a, const v1::TensorType& out_type, void* out);

}  // namespace tessel::cpu

// Element types and tensor types: names, sizes, byte counts. Pure functions,
// callable from any thread.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

// Every valid dtype, in enum order.
inline constexpr v1::DType kAllDTypes[] = {v1::F32, v1::F64, v1::F16,  v1::BF16, v1::S32,
                                           v1::S64, v1::U8,  v1::PRED, v1::S8,   v1::S16,
                                           v1::U16, v1::U32, v1::U64};

// Size of one element in bytes (pred is one byte); 0 for DTYPE_INVALID.
int DTypeSize(v1::DType t);
// "f32", "bf16", "pred", ...
absl::string_view DTypeName(v1::DType t);
absl::StatusOr<v1::DType> ParseDType(absl::string_view name);

bool IsFloat(v1::DType t);    // f32 f64 f16 bf16
bool IsInteger(v1::DType t);  // s8 s16 s32 s64 u8 u16 u32 u64
bool IsSigned(v1::DType t);   // floats, s8 s16 s32 s64
inline bool IsPred(v1::DType t) { return t == v1::PRED; }

// "f32[2,3]"; a scalar is "f32[]".
std::string TypeString(const v1::TensorType& t);
std::string DimsString(const google::protobuf::RepeatedField<int64_t>& dims);

// Elements and bytes of a type; INVALID_ARGUMENT on negative dimensions or
// overflow of int64.
absl::StatusOr<int64_t> NumElements(const v1::TensorType& t);
absl::StatusOr<int64_t> ByteSize(const v1::TensorType& t);
// For types already validated.
int64_t NumElementsUnchecked(const v1::TensorType& t);
int64_t ByteSizeUnchecked(const v1::TensorType& t);

bool SameType(const v1::TensorType& a, const v1::TensorType& b);
v1::TensorType MakeType(v1::DType dtype, std::initializer_list<int64_t> dims);

// Lower-case op name ("dot_general").
std::string OpName(v1::Op op);

}  // namespace tessel

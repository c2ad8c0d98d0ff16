// Conversions between the SDK's public types and the protobuf messages.
#pragma once

#include "tessel/types.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

inline v1::DType ToProto(DType t) { return static_cast<v1::DType>(static_cast<int>(t)); }
inline DType FromProto(v1::DType t) { return static_cast<DType>(static_cast<int>(t)); }

inline v1::TensorType ToProto(const ArrayType& t) {
  v1::TensorType p;
  p.set_dtype(ToProto(t.dtype));
  for (int64_t d : t.dims) p.add_dims(d);
  return p;
}

inline ArrayType FromProto(const v1::TensorType& p) {
  return ArrayType{FromProto(p.dtype()), std::vector<int64_t>(p.dims().begin(), p.dims().end())};
}

}  // namespace tessel

// Conversions between the SDK's public types and the protobuf messages.
#pragma once

#include "tessel/session.h"
#include "tessel/sharding.h"
#include "tessel/types.h"
#include "tessel/v1/ir.pb.h"
#include "tessel/v1/session.pb.h"

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

inline v1::ReduceKind ToProto(ReduceKind k) {
  return static_cast<v1::ReduceKind>(static_cast<int>(k) + 1);
}
inline ReduceKind FromProto(v1::ReduceKind k) {
  return k == v1::REDUCE_INVALID ? ReduceKind::kSum
                                 : static_cast<ReduceKind>(static_cast<int>(k) - 1);
}

inline v1::Mesh ToProto(const Mesh& m) {
  v1::Mesh p;
  for (const Mesh::Axis& a : m.axes) {
    p.add_axis_names(a.name);
    p.add_axis_sizes(a.size);
  }
  for (int d : m.devices) p.add_devices(d);
  return p;
}

inline Mesh FromProto(const v1::Mesh& p) {
  Mesh m;
  for (int i = 0; i < p.axis_names_size(); ++i) {
    m.axes.push_back({p.axis_names(i), i < p.axis_sizes_size() ? p.axis_sizes(i) : 0});
  }
  m.devices.assign(p.devices().begin(), p.devices().end());
  return m;
}

inline v1::Sharding ToProto(const Sharding& s) {
  v1::Sharding p;
  for (const auto& d : s.dims) p.add_dims()->mutable_axes()->Assign(d.begin(), d.end());
  p.mutable_partial()->Assign(s.partial.begin(), s.partial.end());
  p.set_partial_kind(ToProto(s.partial_kind));
  p.set_unspecified(s.unspecified);
  return p;
}

inline Sharding FromProto(const v1::Sharding& p) {
  Sharding s;
  for (const auto& d : p.dims()) s.dims.emplace_back(d.axes().begin(), d.axes().end());
  while (!s.dims.empty() && s.dims.back().empty()) s.dims.pop_back();
  s.partial.assign(p.partial().begin(), p.partial().end());
  s.partial_kind = FromProto(p.partial_kind());
  s.unspecified = p.unspecified();
  return s;
}

inline v1::Placement ToProto(const Placement& p) {
  v1::Placement out;
  if (p.sharded) {
    *out.mutable_sharded()->mutable_mesh() = ToProto(p.sharded->mesh);
    *out.mutable_sharded()->mutable_sharding() = ToProto(p.sharded->spec);
  } else if (p.replicated) {
    out.set_replicated(true);
  } else {
    out.set_device(p.device);
  }
  return out;
}

}  // namespace tessel

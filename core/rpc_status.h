// The one place absl::Status and grpc::Status meet. Used at service edges only.
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "core/status.h"

namespace tessel {

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), BoundedMessage(s.message()));
}

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

}  // namespace tessel

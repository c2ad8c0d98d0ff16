// Protocol versions spoken by Tessel's services, and the handshake rule.
#pragma once

#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace tessel {

inline constexpr int kProtocolVersionMin = 1;
inline constexpr int kProtocolVersionMax = 1;
inline constexpr absl::string_view kTesselVersion = "0.1.0";

// The highest version both sides speak, or FAILED_PRECONDITION naming both
// ranges. A request stating no range (both 0, as a bare `GetVersion {}` from
// grpcurl) asks what the server speaks: its highest version.
inline absl::StatusOr<int> NegotiateVersion(int client_min, int client_max) {
  if (client_min == 0 && client_max == 0) return kProtocolVersionMax;
  int lo = std::max(client_min, kProtocolVersionMin);
  int hi = std::min(client_max, kProtocolVersionMax);
  if (lo > hi) {
    return absl::FailedPreconditionError(
        absl::StrCat("protocol version mismatch: client speaks [", client_min, ", ", client_max,
                     "], server speaks [", kProtocolVersionMin, ", ", kProtocolVersionMax, "]"));
  }
  return hi;
}

}  // namespace tessel

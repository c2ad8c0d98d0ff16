// Status helpers shared by every Tessel module. absl::Status is used inside;
// conversion to gRPC status happens only at the service edges.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define TESSEL_CONCAT_INNER(a, b) a##b
#define TESSEL_CONCAT(a, b) TESSEL_CONCAT_INNER(a, b)

#define TESSEL_RETURN_IF_ERROR(expr)              \
  do {                                            \
    ::absl::Status tessel_status_ = (expr);       \
    if (!tessel_status_.ok()) return tessel_status_; \
  } while (0)

#define TESSEL_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(*tmp)

#define TESSEL_ASSIGN_OR_RETURN(lhs, expr) \
  TESSEL_ASSIGN_OR_RETURN_IMPL(TESSEL_CONCAT(tessel_statusor_, __LINE__), lhs, expr)

namespace tessel {

// Payload on a status from a collective that broke its group (a peer lost, a
// timeout across workers, workers out of step): later calls on that group
// fail at once, and the steps after it must meet in a group of a new epoch.
inline constexpr char kGroupBrokenPayload[] = "tessel.dev/group_broken";

// Prepends context to an error ("node 'y' (add): " + message), keeping its
// code and payloads.
inline absl::Status Annotate(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(prefix, s.message()));
  s.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace tessel

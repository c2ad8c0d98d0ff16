// Status helpers shared by every Tessel module. absl::Status is used inside;
// conversion to gRPC status happens only at the service edges.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#define TESSEL_CONCAT_INNER(a, b) a##b
#define TESSEL_CONCAT(a, b) TESSEL_CONCAT_INNER(a, b)

#define TESSEL_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status tessel_status_ = (expr);          \
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

// Error messages travel in gRPC trailing metadata, which peers refuse past
// 16 KiB, and into logs: messages longer than this keep their head and tail
// and say how much was cut.
inline constexpr size_t kMaxStatusMessageBytes = 4096;

inline std::string BoundedMessage(absl::string_view m) {
  if (m.size() <= kMaxStatusMessageBytes) return std::string(m);
  const size_t keep = kMaxStatusMessageBytes / 2 - 64;
  return absl::StrCat(m.substr(0, keep), " … [", m.size() - 2 * keep, " bytes cut] … ",
                      m.substr(m.size() - keep));
}

// The root cause a dependent error quotes, and how many steps of its chain
// have failed from it (decimal), carried as payloads of the chain's errors.
inline constexpr char kRootCausePayload[] = "tessel.dev/root_cause";
inline constexpr char kDependentStepsPayload[] = "tessel.dev/dependent_steps";

// The error of a step that failed because an argument had: `what` names
// the argument ("argument 0 'x' (array 0x…)"), `cause` is its error. Quotes
// the root cause, the chain's first failure, once, with the step's place in
// the chain, never the chain in between, so the message stays bounded
// however long the chain:
//   argument 0 failed earlier; dependent step 5000 to fail from this cause: <root>
// Keeps the code and the payloads.
inline absl::Status DependentError(const absl::Status& cause, absl::string_view what) {
  if (cause.ok()) return cause;
  const auto quoted = cause.GetPayload(kRootCausePayload);  // absl::optional<absl::Cord>
  const std::string root = quoted ? std::string(*quoted) : std::string(cause.message());
  int64_t steps = 0;
  if (const auto n = cause.GetPayload(kDependentStepsPayload))
    (void)absl::SimpleAtoi(std::string(*n), &steps);
  ++steps;
  absl::Status out(cause.code(), absl::StrCat(what, " failed earlier; dependent step ", steps,
                                              " to fail from this cause: ", root));
  cause.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  out.SetPayload(kRootCausePayload, absl::Cord(root));
  out.SetPayload(kDependentStepsPayload, absl::Cord(absl::StrCat(steps)));
  return out;
}

// Prepends context to an error ("node 'y' (add): " + message), keeping its
// code and payloads.
inline absl::Status Annotate(const absl::Status& s, absl::string_view prefix) {
  if (s.ok()) return s;
  absl::Status out(s.code(), absl::StrCat(prefix, s.message()));
  s.ForEachPayload(
      [&](absl::string_view url, const absl::Cord& payload) { out.SetPayload(url, payload); });
  return out;
}

}  // namespace tessel

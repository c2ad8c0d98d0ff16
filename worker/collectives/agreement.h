// Call agreement: before any data of a collective moves, every participant
// (a worker of a Gloo group, a rank of an NCCL group) tells every other a
// header: which collective it is at (CollectiveId), with which arguments,
// and whether its ranks can take part. Each participant then judges the
// same headers alike (JudgeHeaders), so every participant returns the same
// verdict: a participant at another collective means the group is out of
// step; one that could not take part fails the call with its reason; calls
// that differ fail it naming both.
//
// The header is a plain struct sent as bytes between processes of the same
// build: its layout is fixed by the static_assert below.
#pragma once

#include <cstdint>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/types/span.h"
#include "worker/collectives/call.h"

namespace tessel::worker {

struct CallHeader {
  uint64_t magic;
  int64_t execution;
  int32_t op;
  uint32_t kind;
  uint64_t scope;
  int64_t count;
  int32_t dtype;
  int32_t reduce_op;
  uint64_t pairs_digest;
  int32_t code;  // 0: the participant can take part; else why it cannot (absl::StatusCode)
  int32_t message_len;
  char message[200];
};
static_assert(sizeof(CallHeader) == 264, "CallHeader travels as bytes: keep its layout");

inline constexpr uint64_t kCallHeaderMagic = 0x54534c4852444831;  // "TSLHRDH1"

// This participant's header for `call` under `id`; `failure` is why it
// cannot take part (OK: it can).
CallHeader MakeHeader(const CollectiveId& id, const CollectiveCall& call,
                      const absl::Status& failure);

// "all_reduce(f32[1024], sum)", from a header (a permute's pairs by digest).
std::string DescribeHeader(const CallHeader& h);

// The verdict on a collective, from every participant's header
// (`headers[i]` is participant i's, this participant's own included), the
// same on every participant:
// - FAILED_PRECONDITION "out of step" if a header is not for `id`;
// - ABORTED with the first failing participant's message;
// - INVALID_ARGUMENT "the ranks disagree on the call" naming participant 0
//   and the first that differs from it;
// - OK otherwise.
// `name(i)` names participant i in errors; `what()` prefixes them (both
// are made only for an error: this runs once per collective).
absl::Status JudgeHeaders(const CollectiveId& id, absl::Span<const CallHeader> headers,
                          absl::FunctionRef<std::string()> what,
                          absl::FunctionRef<std::string(int)> name);

}  // namespace tessel::worker

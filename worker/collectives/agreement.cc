#include "worker/collectives/agreement.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace tessel::worker {

CallHeader MakeHeader(const CollectiveId& id, const CollectiveCall& call,
                      const absl::Status& failure) {
  CallHeader h{};
  h.magic = kCallHeaderMagic;
  h.execution = id.execution;
  h.op = id.op;
  h.scope = id.scope;
  h.kind = uint32_t(call.kind);
  h.count = call.count;
  h.dtype = call.dtype;
  h.reduce_op = int32_t(call.op);
  h.pairs_digest = PairsDigest(call);
  h.code = int32_t(failure.code());
  const absl::string_view m = failure.message().substr(0, sizeof(h.message));
  h.message_len = int32_t(m.size());
  if (!m.empty()) std::memcpy(h.message, m.data(), m.size());  // an OK status's is null
  return h;
}

std::string DescribeHeader(const CallHeader& h) {
  const auto kind = CollectiveKind(h.kind);
  std::string s = KindName(kind);
  if (kind == CollectiveKind::kAbandoned) return s;
  absl::StrAppend(&s, "(", DTypeName(v1::DType(h.dtype)), "[", h.count, "]");
  if (Reduces(kind)) absl::StrAppend(&s, ", ", ReduceOpName(ReduceOp(h.reduce_op)));
  if (kind == CollectiveKind::kPermute) absl::StrAppend(&s, ", pairs #", h.pairs_digest);
  return s + ")";
}

namespace {

bool SameArguments(const CallHeader& a, const CallHeader& b) {
  if (a.kind != b.kind || a.count != b.count || a.dtype != b.dtype) return false;
  if (Reduces(CollectiveKind(a.kind)) && a.reduce_op != b.reduce_op) return false;
  return a.pairs_digest == b.pairs_digest;
}

}  // namespace

absl::Status JudgeHeaders(const CollectiveId& id, absl::Span<const CallHeader> headers,
                          absl::FunctionRef<std::string()> what,
                          absl::FunctionRef<std::string(int)> name) {
  for (size_t i = 0; i < headers.size(); ++i) {
    const CallHeader& h = headers[i];
    if (h.magic != kCallHeaderMagic || h.execution != id.execution || h.op != id.op ||
        h.scope != id.scope) {
      return absl::FailedPreconditionError(absl::StrCat(
          what(), ": workers out of step: ", name(int(i)), " is at execution ", h.execution,
          ", op ", h.op, h.scope == 0 ? "" : absl::StrCat(", scope ", h.scope),
          "; this device is at ", id.ToString(), "; the group must start over"));
    }
  }
  for (const CallHeader& h : headers) {
    if (h.code != 0) {
      const size_t len =
          std::clamp<size_t>(size_t(std::max(h.message_len, 0)), 0, sizeof(h.message));
      return absl::AbortedError(std::string(h.message, len));
    }
  }
  for (size_t i = 1; i < headers.size(); ++i) {
    if (!SameArguments(headers[0], headers[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          what(), ": the ranks disagree on the call: ", name(0), " calls ",
          DescribeHeader(headers[0]), ", ", name(int(i)), " calls ", DescribeHeader(headers[i])));
    }
  }
  return absl::OkStatus();
}

}  // namespace tessel::worker

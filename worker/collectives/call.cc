#include "worker/collectives/call.h"

#include "absl/strings/str_cat.h"
#include "core/dtype.h"

namespace tessel::worker {

const char* KindName(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllToAll: return "all_to_all";
    case CollectiveKind::kPermute: return "collective_permute";
    case CollectiveKind::kAbandoned: return "(abandoned)";
  }
  return "(unknown collective)";
}

bool Reduces(CollectiveKind k) {
  return k == CollectiveKind::kAllReduce || k == CollectiveKind::kReduceScatter;
}

std::string DescribeCall(const CollectiveCall& c) {
  std::string s = KindName(c.kind);
  if (c.kind == CollectiveKind::kAbandoned) return s;
  absl::StrAppend(&s, "(", DTypeName(c.dtype), "[", c.count, "]");
  if (Reduces(c.kind)) absl::StrAppend(&s, ", ", ReduceOpName(c.op));
  if (c.kind == CollectiveKind::kPermute && c.pairs != nullptr)
    absl::StrAppend(&s, ", ", c.pairs->size(), " pairs");
  return s + ")";
}

bool SameCall(const CollectiveCall& a, const CollectiveCall& b) {
  if (a.kind != b.kind || a.count != b.count || a.dtype != b.dtype) return false;
  if (Reduces(a.kind) && a.op != b.op) return false;
  if (a.kind == CollectiveKind::kPermute) {
    if (a.pairs != nullptr && b.pairs != nullptr) return *a.pairs == *b.pairs;
    return PairsDigest(a) == PairsDigest(b);
  }
  return true;
}

uint64_t PairsDigest(const CollectiveCall& c) {
  if (c.kind != CollectiveKind::kPermute || c.pairs == nullptr) return 0;
  uint64_t h = 1469598103934665603ull;
  for (const auto& [s, t] : *c.pairs) {
    for (int v : {s, t}) h = (h ^ uint64_t(uint32_t(v))) * 1099511628211ull;
  }
  return h;
}

}  // namespace tessel::worker

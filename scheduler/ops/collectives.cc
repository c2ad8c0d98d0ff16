// Collectives of a manual region's body, and axis_index. They are not
// partitioned (a manual region's body is per device already) and their
// transposition is the reverse-mode driver's: it depends on what the
// region's values vary over (varying.h), which the driver tracks.
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {
namespace {

// Linear: the same collective of the tangent (a sum; max and min are not linear).
absl::StatusOr<std::string> JvpCollective(ForwardMode& m, const v1::Node& n) {
  if (n.op() == v1::ALL_REDUCE && n.collective().kind() != v1::SUM &&
      n.collective().kind() != v1::REDUCE_INVALID) {
    return absl::UnimplementedError(absl::StrCat(m.Where(), ": node '", n.name(), "' (",
                                                 OpName(n.op()), ") has no forward-mode rule yet"));
  }
  v1::Node c = n;
  c.clear_operands();
  c.add_operands(m.Tangent(n, 0));
  return m.e().Copy(std::move(c), absl::StrCat(m.Result(n), ".tangent"));
}

}  // namespace

void CollectiveRows(Rows& rows) {
  for (v1::Op op : {v1::ALL_REDUCE, v1::ALL_GATHER, v1::REDUCE_SCATTER, v1::ALL_TO_ALL,
                    v1::COLLECTIVE_PERMUTE}) {
    rows.emplace_back(op, OpRules{.jvp = JvpCollective});
  }
  rows.emplace_back(v1::AXIS_INDEX, OpRules{.vjp = NoCotangent});
}

}  // namespace tessel::scheduler::ops

#include "worker/collective_group.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessel::worker {

bool IsCollective(v1::Op op) {
  switch (op) {
    case v1::ALL_REDUCE:
    case v1::ALL_GATHER:
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::COLLECTIVE_PERMUTE: return true;
    default: return false;
  }
}

ReduceOp ReduceOpOf(v1::ReduceKind k) {
  switch (k) {
    case v1::PROD: return ReduceOp::kProd;
    case v1::REDUCE_MAX: return ReduceOp::kMax;
    case v1::REDUCE_MIN: return ReduceOp::kMin;
    default: return ReduceOp::kSum;
  }
}

AxisSplit SplitAround(const v1::TensorType& t, int64_t d) {
  AxisSplit s;
  for (int64_t i = 0; i < d; ++i) s.outer *= t.dims(i);
  s.extent = t.dims(d);
  for (int64_t i = d + 1; i < t.dims_size(); ++i) s.inner *= t.dims(i);
  return s;
}

absl::StatusOr<ResolvedGroup> ResolveGroup(const v1::Program& p, const v1::Node& node,
                                           const StepContext& ctx, absl::string_view what) {
  const auto& axes = node.collective().axes();
  const std::vector<int> members =
      GroupPositions(p.mesh(), ctx.mesh_position, {axes.begin(), axes.end()});
  ResolvedGroup g;
  g.size = members.size();
  for (size_t i = 0; i < members.size(); ++i) {
    if (members[i] == ctx.mesh_position) g.rank = i;
  }
  if (g.size == 1) return g;
  if (ctx.collectives == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": this worker has no collectives configured"));
  }
  if (p.device_workers_size() != p.mesh().devices_size()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the program does not say which worker holds each device"));
  }
  GroupSpec& spec = g.spec;
  for (int m : members) {
    spec.rank_devices.push_back(p.mesh().devices(m));
    spec.rank_workers.push_back(p.device_workers(m));
  }
  spec.key =
      absl::StrCat("devices:", absl::StrJoin(spec.rank_devices, ","), "@", ctx.collective_epoch);
  TESSEL_ASSIGN_OR_RETURN(g.comm, ctx.collectives->Get(spec));
  return g;
}

CollectiveId IdOf(const StepContext& ctx, int op_index) {
  return CollectiveId{ctx.execution_id, op_index, ctx.scope};
}

void AbandonCollectives(const v1::Program& program, const StepContext& ctx,
                        const absl::Status& cause) {
  if (!program.has_mesh()) return;
  const int after = ctx.last_collective != nullptr ? *ctx.last_collective : -1;
  for (int i = after + 1; i < program.instructions_size(); ++i) {
    const v1::Instruction& in = program.instructions(i);
    if (!in.has_node() || !IsCollective(in.node().op())) continue;
    auto g = ResolveGroup(program, in.node(), ctx, in.node().name());
    if (!g.ok() || g->comm == nullptr) continue;
    (void)g->comm->Abandon(g->rank, IdOf(ctx, i), cause);
  }
}

}  // namespace tessel::worker

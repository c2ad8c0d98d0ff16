#include "worker/cpu/spmd_ops.h"

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "worker/collective_group.h"
#include "worker/cpu/elementwise.h"

namespace tessel::cpu {
namespace {

using absl::StrCat;

// A type as [outer, extent, slab bytes] around dimension d.
struct Split {
  int64_t outer = 1, extent = 1, slab = 1;  // slab: bytes of one index along d
};
Split SplitAt(const v1::TensorType& t, int64_t d) {
  const worker::AxisSplit a = worker::SplitAround(t, d);
  return {a.outer, a.extent, a.inner * DTypeSize(t.dtype())};
}

// [outer, k, piece] -> [k, outer, piece] (piece in bytes), or the reverse.
void SwapMajor(const char* in, char* out, int64_t outer, int64_t k, int64_t piece,
               bool to_rank_major) {
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t r = 0; r < k; ++r) {
      const int64_t a = (o * k + r) * piece, b = (r * outer + o) * piece;
      if (to_rank_major) {
        std::memcpy(out + b, in + a, piece);
      } else {
        std::memcpy(out + a, in + b, piece);
      }
    }
  }
}

}  // namespace

absl::Status RunSpmdOp(const v1::Node& n, int op_index, const v1::Program& p,
                       const v1::TensorType& in_type, const void* in_v, void* out_v,
                       const worker::StepContext& ctx) {
  const v1::CollectiveAttrs& c = n.collective();
  const std::string what =
      StrCat(OpName(n.op()), " '", n.name(), "' over ", absl::StrJoin(c.axes(), ","));
  const char* in = static_cast<const char*>(in_v);
  char* out = static_cast<char*>(out_v);
  const v1::DType dt = n.type().dtype();
  if (n.op() == v1::AXIS_INDEX || n.op() == v1::SHARD_SLICE) {
    const int64_t idx = IndexAlong(p.mesh(), ctx.mesh_position, {c.axes().begin(), c.axes().end()});
    if (n.op() == v1::AXIS_INDEX) {
      const int32_t v = int32_t(idx);
      std::memcpy(out, &v, sizeof(v));
      return absl::OkStatus();
    }
    const Split s = SplitAt(in_type, c.dimension());
    const int64_t k = AxesSize(p.mesh(), c.axes());
    const int64_t piece = s.extent / k * s.slab;
    for (int64_t o = 0; o < s.outer; ++o)
      std::memcpy(out + o * piece, in + (o * k + idx) * piece, piece);
    return absl::OkStatus();
  }
  if (ctx.last_collective != nullptr) *ctx.last_collective = op_index;
  TESSEL_ASSIGN_OR_RETURN(worker::ResolvedGroup g, worker::ResolveGroup(p, n, ctx, what));
  const worker::CollectiveId id = worker::IdOf(ctx, op_index);
  const int64_t in_bytes = ByteSizeUnchecked(in_type), out_bytes = ByteSizeUnchecked(n.type());
  const int64_t esize = DTypeSize(dt);
  if (g.size == 1) {
    // A group of one: every collective is a copy.
    std::memcpy(out, in, std::min(in_bytes, out_bytes));
    return absl::OkStatus();
  }
  absl::Status st;
  switch (n.op()) {
    case v1::ALL_REDUCE:
      if (out != in) std::memcpy(out, in, in_bytes);
      st = g.comm->AllReduce(g.rank, id, out, in_bytes / esize, dt, worker::ReduceOpOf(c.kind()));
      break;
    case v1::ALL_GATHER: {
      const Split s = SplitAt(in_type, c.dimension());
      if (s.outer == 1) {
        st = g.comm->AllGather(g.rank, id, in, out, in_bytes / esize, dt);
        break;
      }
      std::vector<char> tmp(out_bytes);
      st = g.comm->AllGather(g.rank, id, in, tmp.data(), in_bytes / esize, dt);
      if (st.ok())
        SwapMajor(tmp.data(), out, s.outer, g.size, s.extent * s.slab, /*to_rank_major=*/false);
      break;
    }
    case v1::REDUCE_SCATTER: {
      const Split s = SplitAt(in_type, c.dimension());
      const int64_t piece = s.extent / g.size * s.slab;
      if (s.outer == 1) {
        st = g.comm->ReduceScatter(g.rank, id, in, out, out_bytes / esize, dt,
                                   worker::ReduceOpOf(c.kind()));
        break;
      }
      std::vector<char> tmp(in_bytes);
      SwapMajor(in, tmp.data(), s.outer, g.size, piece, /*to_rank_major=*/true);
      st = g.comm->ReduceScatter(g.rank, id, tmp.data(), out, out_bytes / esize, dt,
                                 worker::ReduceOpOf(c.kind()));
      break;
    }
    case v1::ALL_TO_ALL: {
      const Split s = SplitAt(in_type, c.dimension());
      const int64_t piece = s.extent / g.size * s.slab;
      std::vector<char> send(in_bytes), recv(in_bytes);
      SwapMajor(in, send.data(), s.outer, g.size, piece, /*to_rank_major=*/true);
      st = g.comm->AllToAll(g.rank, id, send.data(), recv.data(), in_bytes / g.size / esize, dt);
      if (!st.ok()) break;
      // Block i (from rank i) takes position i along the concat dimension.
      v1::TensorType block = in_type;
      block.set_dims(c.dimension(), in_type.dims(c.dimension()) / g.size);
      const Split cs = SplitAt(block, c.concat_dimension());
      SwapMajor(recv.data(), out, cs.outer, g.size, cs.extent * cs.slab, /*to_rank_major=*/false);
      break;
    }
    case v1::COLLECTIVE_PERMUTE: {
      std::vector<std::pair<int, int>> pairs;
      for (int i = 0; i + 1 < c.source_target_pairs_size(); i += 2) {
        pairs.emplace_back(int(c.source_target_pairs(i)), int(c.source_target_pairs(i + 1)));
      }
      st = g.comm->Permute(g.rank, id, in, out, in_bytes / esize, dt, pairs);
      break;
    }
    default: return absl::UnimplementedError(StrCat(what, ": not a collective"));
  }
  return Annotate(st, StrCat(what, " (rank ", g.rank, " of ", g.size, "): "));
}

absl::Status SplitIota(const v1::Node& n, const v1::Program& p, void* out,
                       const worker::StepContext& ctx) {
  const v1::TensorType& t = n.type();
  const v1::Iota& iota = n.constant().iota();
  const int64_t d = iota.dimension();
  const int64_t offset = IndexAlong(p.mesh(), ctx.mesh_position,
                                    {iota.sharded_axes().begin(), iota.sharded_axes().end()}) *
                         t.dims(d);
  int64_t inner = 1;
  for (int i = d + 1; i < t.dims_size(); ++i) inner *= t.dims(i);
  const int64_t n_el = NumElementsUnchecked(t);
  std::vector<int64_t> v(n_el);
  for (int64_t i = 0; i < n_el; ++i) v[i] = (i / inner) % t.dims(d) + offset;
  ConvertKernel(v1::S64, t.dtype(), v.data(), out, n_el);
  return absl::OkStatus();
}

}  // namespace tessel::cpu

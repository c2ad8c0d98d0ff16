// What a collective call is, as every backend describes and compares it:
// its kind, element count, dtype, reduction and (for a permute) its pairs.
// Shared by the Gloo groups (collectives/group.h) and NCCL
// (cuda/nccl_communicator.h), so both name a call alike in errors.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tessel/v1/ir.pb.h"
#include "worker/communicator.h"

namespace tessel::worker {

enum class CollectiveKind : uint32_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kPermute,
  kAbandoned,  // a rank's step failed before this collective (Communicator::Abandon)
};

// The IR's name: "all_reduce", "collective_permute", ...
const char* KindName(CollectiveKind k);
// Whether the call carries a reduction (all_reduce, reduce_scatter).
bool Reduces(CollectiveKind k);

struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int64_t count = 0;  // elements per rank-block
  v1::DType dtype = v1::F32;
  ReduceOp op = ReduceOp::kSum;                             // when Reduces(kind)
  const std::vector<std::pair<int, int>>* pairs = nullptr;  // kPermute: (source, target)
};

// "all_reduce(f32[1024], sum)", "collective_permute(f32[8], 3 pairs)".
std::string DescribeCall(const CollectiveCall& c);
// Whether two calls are the same collective: kind, count, dtype, and the
// reduction or pairs where the kind has them.
bool SameCall(const CollectiveCall& a, const CollectiveCall& b);
// FNV-1a over the pairs, in order; 0 for a call without pairs.
uint64_t PairsDigest(const CollectiveCall& c);

}  // namespace tessel::worker

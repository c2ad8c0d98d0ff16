// Meshes and shardings: validation, local (per-device) types, block
// coordinates, device groups for collectives, and the PartitionSpec-style
// text used in every message ("P('data', None)"). Shared by the scheduler
// (partitioning), the coordinator (placing blocks) and the worker (groups).
// Pure functions over the protos; any thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

// Checks names (non-empty, distinct), sizes (>= 1) and devices (as many as
// the axes' product, distinct, each < `num_devices` when that is >= 0), and
// fills in the default devices 0..n-1.
absl::StatusOr<v1::Mesh> NormalizeMesh(const v1::Mesh& mesh, int num_devices = -1);
int64_t MeshSize(const v1::Mesh& mesh);
bool SameMesh(const v1::Mesh& a, const v1::Mesh& b);  // names, sizes and devices
// -1 when the mesh has no such axis.
int AxisIndex(const v1::Mesh& mesh, absl::string_view axis);
std::string MeshString(const v1::Mesh& mesh);  // "{data: 2, model: 2} over devices 0,1,2,3"

// A fully replicated sharding of rank `rank`.
v1::Sharding Replicated(int rank);
// Pads dims to `rank` and sets the default partial kind.
v1::Sharding NormalizeSharding(const v1::Sharding& s, int rank);
bool SameSharding(const v1::Sharding& a, const v1::Sharding& b);  // both normalized
bool IsReplicated(const v1::Sharding& s);  // no split dimension, no partial axis
bool IsPartial(const v1::Sharding& s);

// INVALID_ARGUMENT naming `what` on: more dims than the rank, an unknown
// axis, an axis used twice, or a dimension its axes do not divide evenly.
absl::Status ValidateSharding(const v1::Sharding& s, const v1::Mesh& mesh,
                              const v1::TensorType& type, absl::string_view what);

// "P('data', None)", "P(('data', 'model'),)", plus " partial(sum: model)".
std::string ShardingString(const v1::Sharding& s);

// Product of the sizes of `axes`.
int64_t AxesSize(const v1::Mesh& mesh, const google::protobuf::RepeatedPtrField<std::string>& axes);
int64_t AxesSize(const v1::Mesh& mesh, const std::vector<std::string>& axes);

// The block each device holds (sharding valid for `global`).
v1::TensorType LocalType(const v1::TensorType& global, const v1::Sharding& s, const v1::Mesh& mesh);

// Coordinates of mesh position `pos` (row-major over the axes).
std::vector<int64_t> MeshCoords(const v1::Mesh& mesh, int pos);
// Index of `pos` along `axes` (row-major over them, in the order given).
int64_t IndexAlong(const v1::Mesh& mesh, int pos, const std::vector<std::string>& axes);
// For each dimension, the index of the block position `pos` holds.
std::vector<int64_t> BlockIndex(const v1::Sharding& s, const v1::Mesh& mesh, int pos);

// The positions that differ from `pos` only along `axes`, ordered by their
// index along `axes`: the group of a collective over `axes`.
std::vector<int> GroupPositions(const v1::Mesh& mesh, int pos,
                                const std::vector<std::string>& axes);

// Types a collective (ALL_REDUCE .. AXIS_INDEX, and SHARD_SLICE) on per-device
// blocks over `mesh`: its axes must be known and distinct, its dimensions in
// range, and a split even. INVALID_ARGUMENT saying which, otherwise.
absl::StatusOr<v1::TensorType> InferCollectiveType(const v1::Node& node,
                                                   absl::Span<const v1::TensorType* const> operands,
                                                   const v1::Mesh& mesh);

}  // namespace tessel

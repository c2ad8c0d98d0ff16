// Meshes and shardings in the C++ SDK (as jax.sharding's Mesh,
// PartitionSpec and NamedSharding). Plain data; thread-compatible.
//
//   Mesh mesh({{"data", 2}, {"model", 2}});            // devices 0..3, row-major
//   Sharding rows = Sharding::Split({"data", ""});     // P('data', None)
//   session->Put(x, Placement::Sharded(mesh, rows));   // each device gets its block
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tessel {

enum class ReduceKind { kSum, kProd, kMax, kMin };

// Named axes over the cluster's devices. `devices` lists the global device
// ids in row-major order over the axes; empty means 0..size()-1.
struct Mesh {
  struct Axis {
    std::string name;
    int64_t size = 1;
  };
  std::vector<Axis> axes;
  std::vector<int> devices;

  Mesh() = default;
  Mesh(std::vector<Axis> a, std::vector<int> d = {}) : axes(std::move(a)), devices(std::move(d)) {}
  int64_t size() const;
  // 0 when the mesh has no axis `name`.
  int64_t axis_size(const std::string& name) const;
  // Product of the sizes of `names` (1 for none).
  int64_t axes_size(const std::vector<std::string>& names) const;
  // "{data: 2, model: 2}" (with " over devices ..." when listed).
  std::string ToString() const;
  // "data=2,model=2" (the CLI's form).
  static absl::StatusOr<Mesh> Parse(const std::string& text);
  bool operator==(const Mesh& o) const;
};

// PartitionSpec: dimension i is split over the mesh axes dims[i] (major
// first; empty: not split); axes named nowhere hold copies. Over the
// `partial` axes each device holds an unreduced partial result that combines
// with `partial_kind`. `unspecified` (output shardings only) lets the
// partitioner choose.
struct Sharding {
  std::vector<std::vector<std::string>> dims;
  std::vector<std::string> partial;
  ReduceKind partial_kind = ReduceKind::kSum;
  bool unspecified = false;

  static Sharding Replicated() { return {}; }
  static Sharding Unspecified();
  // One axis per dimension, "" for none: Split({"data", ""}) is P('data', None).
  static Sharding Split(const std::vector<std::string>& axis_per_dimension);
  // This sharding, unreduced (partial sums) over `axes`.
  Sharding Unreduced(std::vector<std::string> axes, ReduceKind kind = ReduceKind::kSum) const;
  // "P('data', None)", with " partial(sum: model)" when partial: the text
  // every plan and error uses.
  std::string ToString() const;
  // Reads ToString()'s form; quotes around axis names are optional, and
  // "unreduced=(a, b)" may stand inside the parentheses: "P(data, None)",
  // "P((data, model),)", "P(None, unreduced=(model,))".
  static absl::StatusOr<Sharding> Parse(const std::string& text);
  // The block shape each device holds of an array of shape `dims`.
  std::vector<int64_t> BlockDims(const Mesh& mesh, std::vector<int64_t> dims) const;
  bool operator==(const Sharding& o) const;  // trailing unsplit dims ignored
};

// An array laid out over a mesh.
struct NamedSharding {
  Mesh mesh;
  Sharding spec;
  std::string ToString() const { return spec.ToString() + " on " + mesh.ToString(); }
};

}  // namespace tessel

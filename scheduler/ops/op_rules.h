// One row per op: how the partitioner lays it out and lowers it to a
// per-device node, how reverse and forward mode differentiate it, and how
// vmap batches it. The drivers (partitioner.cc, autodiff.cc, batching.cc)
// look an op up here and keep only what is structural: parameters,
// regions, control flow, custom rules and tuple elements.
//
// Adding an op: its shape rule (core/shape_inference.cc), a row in the
// family file here (elementwise, layout, reduce, dot, convolution, linalg,
// indexing, collectives), and its kernels. A field left null means the driver has no
// rule for the op and says so in its error.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "scheduler/graph_emitter.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler::ops {

using Axes = std::vector<std::string>;

// Sharding helpers the layout rules and the partitioner share.
Axes DimAxes(const v1::Sharding& s, int d);
void SetDimAxes(v1::Sharding& s, int d, const Axes& a);
v1::Sharding Complete(v1::Sharding s);  // without its partial axes
Axes PartialAxes(const v1::Sharding& s);
std::string AxesText(const Axes& a);
// The result's partial axes and kind are the operand's.
void KeepPartial(const v1::Sharding& from, v1::Sharding& result);

// ---------------------------------------------------------------- partitioning

// What a layout rule sees of a node: its operands' layouts and types.
struct LayoutQuery {
  const v1::Node& node;
  const v1::Mesh& mesh;
  std::vector<v1::Sharding> current;         // each operand's layout (replicated where generated)
  std::vector<bool> generated;               // each operand regenerated per block on demand
  std::vector<const v1::TensorType*> types;  // each operand's global type
};

// The layout each operand must take where the node reads it, and the
// result's (normalized; partial axes say how a partial sum passes through).
struct Layout {
  std::vector<v1::Sharding> want;
  v1::Sharding result;
  Axes indexed_split;  // gather: the mesh axes its indexed dimension stays split over
};
using LayoutRule = void (*)(const LayoutQuery&, Layout&);

// The partitioner's per-device graph, for lowering rules whose per-device
// computation is more than the node over local operands.
class LocalGraph {
 public:
  virtual ~LocalGraph() = default;
  // Appends `n`, its type inferred from its operands (a constant keeps its own).
  virtual absl::StatusOr<std::string> Emit(v1::Node n) = 0;
  virtual absl::StatusOr<std::string> EmitOp(v1::Op op, std::vector<std::string> operands,
                                             const std::string& base,
                                             const std::function<void(v1::Node&)>& attrs = {}) = 0;
  // Every element of `t` equal to `f` (floating types) or `i`.
  virtual absl::StatusOr<std::string> EmitFill(const v1::TensorType& t, double f, int64_t i,
                                               const std::string& base) = 0;
  // A collective over `axes`, recorded with its reason in the plan.
  virtual absl::StatusOr<std::string> EmitCollective(v1::Op op, const std::string& input,
                                                     const std::string& base, const Axes& axes,
                                                     int64_t dim, int64_t concat_dim,
                                                     v1::ReduceKind kind, const std::string& reason,
                                                     const std::vector<int64_t>& pairs = {}) = 0;
  // Local `indices` into a dimension of `extent` split over `axes` in blocks
  // of `block`, as s64 positions in this device's block; with `clamp`,
  // clamped into [0, extent) first.
  virtual absl::StatusOr<std::string> BlockIndices(const std::string& indices, const Axes& axes,
                                                   int64_t extent, int64_t block, bool clamp,
                                                   const std::string& base) = 0;
  virtual const v1::TensorType& LocalTypeOf(const std::string& v) const = 0;
  virtual const v1::Mesh& mesh() const = 0;
};

// One node to lower: `local` is the node with its operands in the layouts
// the rule asked for, under a fresh name.
struct Lowering {
  const v1::Node& node;     // the global node
  const std::string& name;  // its name in the partitioned graph's source
  const Layout& layout;
  const v1::TensorType& local_type;          // the result's per-device type
  std::vector<const v1::TensorType*> types;  // the operands' global types
};
using LowerRule = absl::StatusOr<std::string> (*)(LocalGraph&, const Lowering&, v1::Node local);

// ---------------------------------------------------------------- reverse mode

// What a transposition rule may ask of the reverse-mode driver, for the
// node it transposes.
class ReverseMode {
 public:
  virtual ~ReverseMode() = default;
  virtual Emitter& e() = 0;
  virtual std::string Operand(const v1::Node& n, int k) = 0;  // its forward value
  virtual std::string Result(const v1::Node& n) = 0;          // the node's forward value
  virtual const v1::TensorType& OperandType(const v1::Node& n, int k) = 0;
  virtual bool Active(const v1::Node& n, int k) = 0;  // operand k takes a cotangent
  virtual void Into(const v1::Node& n, int k,
                    const std::string& ct) = 0;  // adds to operand k's cotangent
  virtual std::string Where() const = 0;         // "vjp of 'f'", for errors
};
// Adds each operand's share of `ct`, the node's cotangent, with Into.
using VjpRule = absl::Status (*)(ReverseMode&, const v1::Node&, const std::string& ct);

// ---------------------------------------------------------------- forward mode

class ForwardMode {
 public:
  virtual ~ForwardMode() = default;
  virtual Emitter& e() = 0;
  virtual std::string Operand(const v1::Node& n, int k) = 0;
  virtual std::string Result(const v1::Node& n) = 0;
  virtual std::string Tangent(const v1::Node& n, int k) = 0;  // "" where none flows
  virtual std::string TangentOrZeros(const v1::Node& n, int k) = 0;
  virtual const v1::TensorType& OperandType(const v1::Node& n, int k) = 0;
  // The node itself over `operands` (the tangent of a linear op).
  virtual std::string Same(const v1::Node& n, const std::vector<std::string>& operands) = 0;
  virtual std::string Where() const = 0;  // "jvp of 'f'"
};
// The node's tangent, or "" where none flows.
using JvpRule = absl::StatusOr<std::string> (*)(ForwardMode&, const v1::Node&);

// ---------------------------------------------------------------- batching

class Batching {
 public:
  virtual ~Batching() = default;
  virtual Emitter& e() = 0;
  virtual int64_t size() const = 0;                        // the batch
  virtual bool IsBatched(const std::string& v) const = 0;  // F's value depends on the batch
  virtual std::string Value(const std::string& v) = 0;  // as computed (batch first where batched)
  virtual std::string Batched(
      const std::string& v) = 0;  // batch first, broadcast where not batched
  // As [batch] + `dims`: an elementwise operand, which may be a scalar.
  virtual std::string BatchedTo(const std::string& v, const std::vector<int64_t>& dims) = 0;
  virtual const v1::TensorType& TypeOf(const std::string& v) const = 0;  // F's (unbatched) type
  // The node over `operands`, its attributes changed by `attrs`, its type inferred.
  virtual std::string Emit(const v1::Node& n, std::vector<std::string> operands,
                           const std::function<void(v1::Node&)>& attrs = {}) = 0;
  virtual std::string MoveAxis(const std::string& v, int64_t from, int64_t to) = 0;
  virtual absl::Status NoRule(const v1::Node& n, const std::string& why = "") = 0;
};
// Dimension numbers of a repeated field, each one more (the batch leads).
template <typename Field>
void ShiftAll(Field& f) {
  for (auto& x : f) ++x;
}
// `v` put first in a repeated field.
template <typename Field>
void Prepend(Field& f, int64_t v) {
  f.Add(v);
  for (int i = f.size() - 1; i > 0; --i) f.Set(i, f.Get(i - 1));
  f.Set(0, v);
}

// The node's result with the batch first.
using BatchRule = absl::StatusOr<std::string> (*)(Batching&, const v1::Node&);

// ---------------------------------------------------------------- the table

struct OpRules {
  LayoutRule layout = nullptr;
  LowerRule lower = nullptr;  // null: the node over its local operands
  VjpRule vjp = nullptr;
  JvpRule jvp = nullptr;
  BatchRule batch = nullptr;
};

// The row of `op`; null where the op has none.
const OpRules* Find(v1::Op op);

// Each family file fills its rows.
using Rows = std::vector<std::pair<v1::Op, OpRules>>;
void ElementwiseRows(Rows& rows);
void LayoutRows(Rows& rows);
void ReduceRows(Rows& rows);
void DotRows(Rows& rows);
void ConvolutionRows(Rows& rows);
void LinalgRows(Rows& rows);
void IndexingRows(Rows& rows);
void CollectiveRows(Rows& rows);

// Shared rules: no cotangent or tangent flows (a constant, or piecewise
// constant in its operands).
absl::Status NoCotangent(ReverseMode&, const v1::Node&, const std::string&);
absl::StatusOr<std::string> NoTangent(ForwardMode&, const v1::Node&);
// The node over its operands' tangents (a linear op of one operand).
absl::StatusOr<std::string> SameOfTangent(ForwardMode&, const v1::Node&);
// The node over (tangent of lhs, rhs) plus the node over (lhs, tangent of
// rhs): a product linear in each operand (dot, convolution).
absl::StatusOr<std::string> BilinearTangent(ForwardMode&, const v1::Node&);

}  // namespace tessel::scheduler::ops
